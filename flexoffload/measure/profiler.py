"""Measure what the cost model needs on this machine: disk bandwidth and latency, and compute speed.

- Disk: O_DIRECT reads of the model file itself, as the streaming runtime issues them (one tensor or chunk a
  request, several in flight, the same bytes pass after pass), so the page cache plays no part and the number is
  what prefetch threads will see.
- Compute: decode tok/s with every weight in memory (the file read into the page cache first, mmap), the
  ceiling that streaming can approach.
- A mixture of experts' reads: bursts of expert slices at random places of the file, as a layer's misses go out
  once its router has chosen (expert_reads): far smaller reads than a pass's, and none in flight before them.

Profiles are kept in the cache per model file (name, size, mtime), so planning does not measure again.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import CHUNK_BYTES, IO_THREADS, cache_dir, file_key, write_atomic
from flexoffload.gguf.model import Model
from flexoffload.measure import about
from flexoffload.measure.diskrecord import (  # noqa: F401  (the disk's record, importable from here as before)
    IO_BOUND_SHARE, SEEN_KEEP, SUSTAINED_BYTES, best_disk_bw, record_disk_bw, record_expert_run, record_run,
    seen_disk_bw, seen_expert_bw, typical_disk_bw, typical_expert_bw)
from flexoffload.plan.costmodel import MATMUL_KINDS, Profile, chunk_rows, compute_seconds, row_bytes
from flexoffload.plan.expertcache import HUGE_PAGE

ALIGN = 4096  # O_DIRECT wants offset, length and buffer aligned to the logical block size; 4 KiB covers all

log = logging.getLogger(__name__)


@dataclass
class DiskSpeed:
    bandwidth: float  # bytes/s: the median pass
    latency: float  # seconds for one small read
    passes: tuple[float, ...] = ()  # bytes/s of each pass, in order
    direct: bool = True  # read with O_DIRECT (else through the page cache: not the disk's speed)


def pass_requests(model: Model, max_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """The (offset, length) requests one streamed pass issues, O_DIRECT-aligned: a request per tensor a matrix
    multiplication reads (not the small ones, resident in every plan, unless all are small), a request per chunk
    of one larger than chunk_bytes; tensors in file order, spread over the file, at most max_bytes of them."""
    from flexoffload.plan.planners import is_small

    matmul = [t for t in model.tensors if t.kind in MATMUL_KINDS]
    tensors = [t for t in matmul if not is_small(t)] or matmul  # what a plan streams; a tiny model: all of them
    total = sum(t.n_bytes for t in tensors)
    step = max(1, round(total / max_bytes)) if total > max_bytes else 1
    requests = []
    for t in tensors[::step]:
        rows = chunk_rows(t, chunk_bytes)
        pieces = t.n_bytes if rows is None else rows * row_bytes(t)
        for start in range(t.offset, t.offset + t.n_bytes, pieces):
            end = min(start + pieces, t.offset + t.n_bytes)
            a, b = start // ALIGN * ALIGN, -(-end // ALIGN) * ALIGN
            requests.append((a, b - a))  # the last may pass the end of the file: a short read
    return requests


def huge_buffer(n: int) -> memoryview:
    """n bytes of committed memory at a 2 MiB boundary, advised to be transparent huge pages, as the runtime's read
    pool is (patch 0011): into scattered 4 KiB pages an O_DIRECT read goes out in block requests of under 1 MiB,
    and this disk serves those markedly slower."""
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory is not THP
    start = -ctypes.addressof(ctypes.c_char.from_buffer(buf)) % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(buf)[start:start + n]
    view[::mmap.PAGESIZE] = b"\0" * len(view[::mmap.PAGESIZE])  # commit now, outside the timed reads
    return view


def open_direct(path) -> tuple[int, bool]:
    """path opened for O_DIRECT reads, as the runtime reads, and whether it is: a file system without O_DIRECT
    (tmpfs) gives buffered reads, page cache and all."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), True
    except OSError:
        return os.open(path, os.O_RDONLY), False


def disk_speed(model: Model, max_bytes: int = 768 << 20, io_threads: int = IO_THREADS, passes: int = 3) -> DiskSpeed:
    """O_DIRECT bandwidth as the streaming runtime sees it: its requests (a tensor or a chunk each, see
    pass_requests), io_threads in flight, the same bytes read again pass after pass as every decoded token does;
    the median pass. Then the latency of single 4 KiB reads.

    The reads go into huge pages, as the runtime's do (huge_buffer): into fresh 4 KiB pages five passes over the
    1.5B read at 0.79-1.07 GB/s (results/disk_qwen1.5b.csv), into huge pages at 1.78-2.36 GB/s
    (results/disk_qwen1.5b_huge.csv). The median of a few passes of the runtime's own pattern, not one sequential
    read, is the number to plan with."""
    from concurrent.futures import ThreadPoolExecutor

    requests = pass_requests(model, max_bytes)
    if not requests:
        raise FlexoffloadError(f"cannot measure disk speed on {model.path}: no tensor to read")
    fd, direct = open_direct(model.path)
    try:
        largest = max(n for _, n in requests)
        buffers = [huge_buffer(largest) for _ in range(io_threads)]

        def reader(k: int) -> int:
            return sum(os.preadv(fd, [buffers[k][:n]], off) for off, n in requests[k::io_threads])

        rates = []
        with ThreadPoolExecutor(io_threads) as pool:  # preadv releases the GIL
            for _ in range(passes):
                t0 = time.perf_counter()
                n_bytes = sum(pool.map(reader, range(io_threads)))
                rates.append(n_bytes / max(time.perf_counter() - t0, 1e-9))
        small = mmap.mmap(-1, ALIGN)
        size = os.fstat(fd).st_size
        step = max(size // 64 // ALIGN * ALIGN, ALIGN)
        t1 = time.perf_counter()
        count = 0
        for off in range(0, size - ALIGN, step):
            os.preadv(fd, [small], off)
            count += 1
        latency = (time.perf_counter() - t1) / max(count, 1)
    except OSError as e:
        raise FlexoffloadError(f"cannot read {model.path} for profiling: {e.strerror}") from None
    finally:
        os.close(fd)
    if not rates or max(rates) <= 0:
        raise FlexoffloadError(f"cannot measure disk speed on {model.path}: nothing was read")
    return DiskSpeed(bandwidth=statistics.median(rates), latency=latency, passes=tuple(rates), direct=direct)


@dataclass
class ExpertReads:
    """Bursts of expert slices, fitted: a burst of b bytes takes latency + b / bandwidth seconds."""

    bandwidth: float  # bytes/s
    latency: float  # seconds
    bursts: tuple[tuple[int, float], ...] = ()  # (bytes, seconds) of each burst timed
    direct: bool = True


def unit_requests(model: Model, layer: int, expert: int) -> list[tuple[int, int]]:
    """The (offset, length) reads one expert unit's miss makes, O_DIRECT-aligned: its slice of each of the layer's
    *_exps tensors (the runtime reads a slice with the pages around it: same offset modulo 4096 as in the file)."""
    out = []
    for t in model.layer_tensors(layer):
        if t.kind == "expert":
            size = t.n_bytes // model.n_expert
            start = t.offset + expert * size
            a, b = start // ALIGN * ALIGN, -(-(start + size) // ALIGN) * ALIGN
            out.append((a, b - a))
    return out


def burst_sizes(model: Model) -> list[int]:
    """Units a timed burst misses: one, a token's routed experts (all missed), and two between."""
    k = model.n_expert_used
    return sorted({1, max(1, k // 3), max(1, 2 * k // 3), k})


def expert_reads(model: Model, io_threads: int = IO_THREADS, seconds: float = 3.0, max_bursts: int = 40,
                 seed: int = 0) -> ExpertReads:
    """O_DIRECT reads of expert slices as the runtime issues a layer's misses (patch 0018): once the router has
    chosen, m units of one layer at once, every *_exps tensor's slices of them (the op's own tensor first), over
    io_threads (the runtime's LLAMA_STREAM_IO_THREADS), nothing else in flight; timed until the last is in. Random
    layers and experts, bursts of burst_sizes' units in turn for about `seconds`, each burst's bytes and time kept,
    a line fitted through them (fit_bursts).

    The reads go where the runtime's do (patch 0025): into an expert's slot, memory a layer keeps from one miss to
    the next, backed by huge pages where the kernel gives them (huge_buffer); each thread's reads one after another
    in its own buffer. Bursts into fresh 4 KiB pages, as before the slots, ran at about half the speed (docs/moe.md)."""
    from concurrent.futures import ThreadPoolExecutor

    layers = sorted({t.layer for t in model.tensors if t.kind == "expert" and t.layer is not None})
    if not model.n_expert or not layers:
        raise FlexoffloadError(f"{model.path.name} is not a mixture of experts")
    rng = random.Random(seed)
    sizes = burst_sizes(model)
    fd, direct = open_direct(model.path)
    try:
        largest = max(n for il in layers for _, n in unit_requests(model, il, 0)) + ALIGN
        most = -(-max(len(unit_requests(model, il, 0)) for il in layers) * sizes[-1] // io_threads)  # a thread's
        buffers = [huge_buffer(largest * most) for _ in range(io_threads)]

        def burst(units: int) -> tuple[int, float]:
            il = rng.choice(layers)
            chosen = rng.sample(range(model.n_expert), units)
            per_unit = [unit_requests(model, il, e) for e in chosen]
            requests = [u[j] for j in range(len(per_unit[0])) for u in per_unit]  # by tensor, as queued

            def reader(k: int) -> int:
                n_bytes, at = 0, 0
                view = buffers[k]
                for off, n in requests[k::io_threads]:
                    n_bytes += os.preadv(fd, [view[at:at + n]], off)
                    at += n
                return n_bytes

            t0 = time.perf_counter()
            n_bytes = sum(pool.map(reader, range(io_threads)))
            seconds = time.perf_counter() - t0
            return n_bytes, seconds

        bursts = []
        with ThreadPoolExecutor(io_threads) as pool:  # preadv releases the GIL
            burst(sizes[-1])  # the threads started and the buffers touched, untimed
            deadline = time.perf_counter() + seconds
            for _ in range(max_bursts):
                for units in sizes:
                    bursts.append(burst(units))
                if time.perf_counter() > deadline:
                    break
    except OSError as e:
        raise FlexoffloadError(f"cannot read {model.path} for profiling: {e.strerror}") from None
    finally:
        os.close(fd)
    bandwidth, latency = fit_bursts(bursts)
    return ExpertReads(bandwidth, latency, tuple(bursts), direct)


def fit_bursts(bursts: list[tuple[int, float]]) -> tuple[float, float]:
    """(bandwidth, latency) of the least-squares line seconds = latency + bytes / bandwidth; where the bursts do
    not span sizes enough for a slope (or it comes out at zero or below, or the latency below zero), the mean
    bytes/s with no latency."""
    n = len(bursts)
    if not n or sum(s for _, s in bursts) <= 0:
        raise FlexoffloadError("no expert read was timed")
    mean_b = sum(b for b, _ in bursts) / n
    mean_s = sum(s for _, s in bursts) / n
    var = sum((b - mean_b) ** 2 for b, _ in bursts)
    slope = sum((b - mean_b) * (s - mean_s) for b, s in bursts) / var if var > 0 else 0.0
    latency = mean_s - slope * mean_b
    if slope <= 0 or latency < 0:
        return mean_b / mean_s, 0.0
    return 1.0 / slope, latency


def warm_page_cache(path: str | os.PathLike) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


# A compute measure whose threads got less than this share of their cores ran beside other work: measured so, the
# 30B-A3B shape's profile said 1.6 tok/s in memory against 9 on the quiet machine, and its plans' predictions were
# a third of what runs made
BUSY_SHARE = 0.7


# A file larger than this share of the machine's memory is timed by slices (sliced_speed): read into the page cache
# whole, it would not stay there
IN_MEMORY_SHARE = 0.5


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def too_large(n_bytes: int) -> bool:
    """Whether a file of n_bytes is over the share of this machine's memory a timing with every weight in memory
    may take (IN_MEMORY_SHARE): such a file is timed on slices of its first layers."""
    return n_bytes > IN_MEMORY_SHARE * memory_bytes()


def compute_speed(path: str | os.PathLike, n_threads: int, n_tokens: int = 24) -> float:
    """Decode tok/s with all weights in memory: the compute-bound ceiling. Warns where the machine was busy. A file
    too large to hold in memory is timed by slices (sliced_speed)."""
    from flexoffload.runtime import engine

    if too_large(os.path.getsize(path)):
        return sliced_speed(path, n_threads, n_tokens)
    warm_page_cache(path)
    settings = engine.Settings(n_ctx=512, n_threads=n_threads, temp=0.0)
    with engine.Engine(path, settings) as eng:
        eng.generate("def main():", 4)  # warm up the graph and thread pool
        cpu, wall = time.process_time(), time.perf_counter()  # process time: every thread of this process
        tok_s = eng.generate("def main():", n_tokens).decode_tok_s
        share = (time.process_time() - cpu) / max((time.perf_counter() - wall) * n_threads, 1e-9)
    if share < BUSY_SHARE:
        log.warning("the machine was busy while %s's compute was measured (its %d threads had %.0f %% of their "
                    "cores): %.2f tok/s in memory is likely too low, and so are the plans' predictions; measure "
                    "again on a quiet machine: flexoffload profile -m %s --remeasure", Path(path).name, n_threads,
                    100 * share, tok_s, path)
    return tok_s


def sliced_speed(path: str | os.PathLike, n_threads: int, n_tokens: int = 24) -> float:
    """Decode tok/s with all weights in memory, for a model too large to hold: its first layers written as a slice
    (gguf/slices.py) as deep as fits, timed in memory, and the cost model calibrated on it (Profile.calibrated: the
    slice's token spread over the bytes its matmuls read, a tenth as fixed costs) gives the whole model's token. A
    slope between two slices was tried first: it multiplies a timing's error by layers over depths (12 on the 120b)
    and gave 2.9-32 tok/s for one model in one session."""
    import tempfile

    from flexoffload.gguf import slices
    from flexoffload.gguf.model import load

    model = load(path)
    _, deep = _depths(model)
    log.info("%s is larger than half this machine's memory: its compute is timed on its first %d layers (a slice "
             "written beside it, then removed) and scaled by the bytes a token reads", model.path.name, deep)
    with tempfile.TemporaryDirectory(prefix="flexoffload-slices-", dir=model.path.parent) as tmp:
        part = slices.write(model.path, Path(tmp) / f"{deep}.gguf", deep)
        seconds = token_seconds(part, n_threads, n_tokens)
        calibrated = Profile.calibrated(load(part), tok_s=1.0 / seconds, disk_bw=1.0)
        part.unlink()
    return 1.0 / compute_seconds(model, calibrated)


SLICE_TIMINGS = 3  # a slice's token timed this many times, the median kept


def token_seconds(path: str | os.PathLike, n_threads: int, n_tokens: int, times: int = SLICE_TIMINGS) -> float:
    """A decoded token's seconds with every weight of path in memory: the median of `times` generations' median
    tokens, so that a stalled moment of a busy machine does not decide it."""
    from flexoffload.runtime import engine

    warm_page_cache(path)
    settings = engine.Settings(n_ctx=512, n_threads=n_threads, temp=0.0)
    medians = []
    with engine.Engine(path, settings) as eng:
        eng.generate("def main():", 4)  # warm up the graph and thread pool
        for _ in range(times):
            medians.append(eng.generate("def main():", n_tokens).timings["token_p50_s"])
    return statistics.median(medians)


def prompt_seconds(path: str | os.PathLike, n_threads: int, prompt: str, times: int = SLICE_TIMINGS) -> float:
    """A prompt's seconds to its first token with every weight in memory, computed in one ubatch; a file too large
    to hold is timed by slices (sliced_prompt_seconds)."""
    if too_large(os.path.getsize(path)):
        return sliced_prompt_seconds(path, n_threads, prompt, times)
    return first_token_seconds(path, n_threads, prompt, times)


def first_token_seconds(path: str | os.PathLike, n_threads: int, prompt: str, times: int = SLICE_TIMINGS) -> float:
    """The prompt's first token with every weight of path in memory, in one ubatch: the median of `times`."""
    from flexoffload.runtime import engine

    n = engine.count_tokens(str(path), prompt)
    warm_page_cache(path)
    settings = engine.Settings(n_ctx=n + 16, n_batch=n, n_ubatch=n, n_threads=n_threads, temp=0.0)
    with engine.Engine(path, settings) as eng:
        eng.generate("def main():", 1)  # warm up the graph and thread pool
        return statistics.median(eng.generate(prompt, 1).ttft_s for _ in range(times))


def sliced_prompt_seconds(path: str | os.PathLike, n_threads: int, prompt: str, times: int = SLICE_TIMINGS) -> float:
    """prompt_seconds for a model too large to hold: the prompt timed on two slices of its first layers
    (on_two_slices), a layer's seconds their slope, the rest added once. A long prompt's pass takes seconds a layer,
    so the slope's error is a timing's small share of it (a decoded token's is not: sliced_speed). The slices'
    layers route the prompt as the whole model's first layers do; the deeper ones are taken to cost the same."""
    from flexoffload.gguf.model import load

    model = load(path)
    (shallow, low), (deep, high) = on_two_slices(model, lambda p: first_token_seconds(p, n_threads, prompt, times))
    layer = max(high - low, 0.0) / (deep - shallow)
    log.info("%s's prompt timed on slices of %d and %d layers in memory: %.1f and %.1f s, %.2f s a layer",
             model.path.name, shallow, deep, low, high, layer)
    return high + layer * (model.n_layer - deep)


def _depths(model: Model) -> tuple[int, int]:
    """The depths of two slices of model's first layers (gguf/slices.depths) in half the memory and on the disk
    beside the file, a GiB to spare."""
    from flexoffload.gguf import slices

    disk = shutil.disk_usage(model.path.parent).free - (1 << 30)
    try:
        return slices.depths(model, min(int(IN_MEMORY_SHARE * memory_bytes()), disk))
    except ValueError as e:  # in half the memory, or on the disk beside the file
        raise FlexoffloadError(f"{model.path.name}: {e} (half the memory, or the disk's free space beside the file): "
                               "it cannot be timed in memory here") from None


def on_two_slices(model: Model, timed):
    """timed(path) of two slices of model's first layers (gguf/slices.py: the deeper as deep as half the memory, and
    the disk beside the file, hold; the other about half as deep), each written beside the file and removed after:
    ((shallow, its result), (deep, its result))."""
    import tempfile

    from flexoffload.gguf import slices

    out = []
    with tempfile.TemporaryDirectory(prefix="flexoffload-slices-", dir=model.path.parent) as tmp:
        for depth in _depths(model):
            part = slices.write(model.path, Path(tmp) / f"{depth}.gguf", depth)
            out.append((depth, timed(part)))
            part.unlink()
    return tuple(out)


def _cache_path(model: Model, n_threads: int) -> Path:
    # v2: the disk read as the runtime reads it (pass_requests), not one cold sequential read; v3: into huge pages;
    # v4: a tied output's matmul counted in the calibration; v5: a MoE's routed experts counted; v6: a MoE's expert
    # reads timed in bursts (a dense model's profile has no new field: it stays v5); v7: those bursts into huge pages
    # kept, as the runtime's expert slots (patch 0025)
    version = 7 if model.n_expert else 5
    return cache_dir() / "profiles" / f"{file_key(model.path)}-t{n_threads}-v{version}.json"


def measure(model: Model, n_threads: int, remeasure: bool = False) -> Profile:
    """The machine's profile for this model, measured once and cached; its disk bandwidth the typical one, the
    profile's passes and the streamed runs since (typical_disk_bw), and a MoE's expert read rate likewise, the
    profile's bursts and the rates MoE runs' expert reads met since (typical_expert_bw)."""
    profile = as_measured(model, n_threads, remeasure)
    profile = replace(profile, disk_bw=typical_disk_bw(model.path, profile.disk_bw),
                      peak_disk_bw=best_disk_bw(model.path))
    if model.n_expert:  # a dense model's profile has no bursts to plan (and the device's record is MoE runs')
        profile = replace(profile, expert_read_bw=typical_expert_bw(model.path, profile.expert_read_bw))
    return profile


def as_measured(model: Model, n_threads: int, remeasure: bool = False) -> Profile:
    """The profile as its own passes measured it (cached): measure without the runs since."""
    cached = _cache_path(model, n_threads)
    if cached.exists() and not remeasure:
        d = json.loads(cached.read_text())
        return Profile.from_dict(d)
    timed = sum(n for _, n in pass_requests(model, 768 << 20))
    sliced = too_large(model.file_size)
    log.info("measuring this machine's disk and compute for %s at -t %d (once, cached; `flexoffload profile "
             "-m %s` does it ahead): 3 reads of %.2f GB, %s%s, then 28 tokens decoded", model.path.name, n_threads,
             model.path, timed / 1e9, "3 s of expert reads, " if model.n_expert else "",
             "two slices of its first layers written and read into the page cache" if sliced
             else f"the file read into the page cache ({model.file_size / 1e9:.1f} GB)")
    disk = disk_speed(model)
    if disk.direct and timed >= SUSTAINED_BYTES:
        record_disk_bw(model.path, max(disk.passes), "profile")
    bursts = expert_reads(model) if model.n_expert else None
    if model.file_size > 1 << 30 and not sliced:  # bound by reading the file once: say how long that takes here
        log.info("disk: %.2f GB/s; reading %.1f GB into the page cache: %s at that speed, then the decoding",
                 disk.bandwidth / 1e9, model.file_size / 1e9, about(model.file_size / max(disk.bandwidth, 1)))
    tok_s = compute_speed(model.path, n_threads)
    profile = Profile.calibrated(model, tok_s=tok_s, disk_bw=disk.bandwidth, io_latency=disk.latency)
    if bursts is not None:
        profile = replace(profile, expert_read_bw=bursts.bandwidth, expert_read_latency=bursts.latency)
    write_atomic(cached, json.dumps(profile.to_dict(), indent=1))
    return profile

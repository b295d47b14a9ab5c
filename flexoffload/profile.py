"""Measure what the cost model needs on this machine: disk bandwidth and latency, and compute speed.

- Disk: O_DIRECT reads of the model file itself, in the sizes the streaming runtime issues (one tensor a
  request), so the page cache plays no part and the number is what prefetch threads will see.
- Compute: decode tok/s with every weight in memory (the file read into the page cache first, mmap), the
  ceiling that streaming can approach.

Profiles are kept in the cache per model file (name, size, mtime), so planning does not measure again.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import FlexoffloadError
from .costmodel import Profile
from .model import Model
from .models import cache_dir

ALIGN = 4096  # O_DIRECT wants offset, length and buffer aligned to the logical block size; 4 KiB covers all


@dataclass
class DiskSpeed:
    bandwidth: float  # bytes/s
    latency: float  # seconds for one small read


def disk_speed(path: str | os.PathLike, max_bytes: int = 768 << 20, chunk: int = 8 << 20,
               io_threads: int = 4) -> DiskSpeed:
    """O_DIRECT bandwidth with io_threads readers (as the runtime reads: several requests in flight) over up to
    max_bytes of the file, and the latency of single 4 KiB reads."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:  # a file system without O_DIRECT (tmpfs): buffered reads, page cache and all
        fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offsets = list(range(0, min(size, max_bytes) // ALIGN * ALIGN - chunk + 1, chunk)) or [0]

        def reader(k: int) -> int:
            buf = mmap.mmap(-1, chunk)  # anonymous mappings are page aligned
            return sum(os.preadv(fd, [buf], off) for off in offsets[k::io_threads])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(io_threads) as pool:  # preadv releases the GIL
            total = sum(pool.map(reader, range(io_threads)))
        elapsed = time.perf_counter() - t0
        small = mmap.mmap(-1, ALIGN)
        step = max(size // 64 // ALIGN * ALIGN, ALIGN)
        t1 = time.perf_counter()
        count = 0
        for off in range(0, size - ALIGN, step):
            os.preadv(fd, [small], off)
            count += 1
        latency = (time.perf_counter() - t1) / max(count, 1)
    except OSError as e:
        raise FlexoffloadError(f"cannot read {path} for profiling: {e.strerror}") from None
    finally:
        os.close(fd)
    if total == 0 or elapsed <= 0:
        raise FlexoffloadError(f"cannot measure disk speed on {path}: nothing was read")
    return DiskSpeed(bandwidth=total / elapsed, latency=latency)


def warm_page_cache(path: str | os.PathLike) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def compute_speed(path: str | os.PathLike, n_threads: int, n_tokens: int = 24) -> float:
    """Decode tok/s with all weights in memory: the compute-bound ceiling."""
    from . import engine

    warm_page_cache(path)
    settings = engine.Settings(n_ctx=512, n_threads=n_threads, temp=0.0)
    with engine.Engine(path, settings) as eng:
        eng.generate("def main():", 4)  # warm up the graph and thread pool
        return eng.generate("def main():", n_tokens).decode_tok_s


def _cache_path(model: Model, n_threads: int) -> Path:
    st = model.path.stat()
    return cache_dir() / "profiles" / f"{model.path.name}-{st.st_size}-{int(st.st_mtime)}-t{n_threads}.json"


def measure(model: Model, n_threads: int, remeasure: bool = False) -> Profile:
    """The machine's profile for this model, measured once and cached."""
    cached = _cache_path(model, n_threads)
    if cached.exists() and not remeasure:
        d = json.loads(cached.read_text())
        return Profile.from_dict(d)
    disk = disk_speed(model.path)
    tok_s = compute_speed(model.path, n_threads)
    profile = Profile.calibrated(model, tok_s=tok_s, disk_bw=disk.bandwidth, io_latency=disk.latency)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    tmp.replace(cached)
    return profile

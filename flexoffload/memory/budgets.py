"""Memory budgets: parsing `--mem`, and enforcing a budget with a child memory cgroup.

A budget is the whole process: weights kept in memory, page cache it causes, KV cache, compute buffers
and the runtime's own overhead. `MemoryCgroup` makes a child of the caller's own memory cgroup (v2
memory.max or v1 memory.limit_in_bytes; page cache is charged there too), so the kernel holds a run to
its budget and reports the peak.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from flexoffload import BudgetTooSmall, FlexoffloadError
from flexoffload.memory.footprint import KERNEL_FIXED, smallest_budget
from flexoffload.native import process

MiB = 1 << 20
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
_FRACTION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*x\s*$", re.IGNORECASE)


def parse_size(text: str, model_size: int | None = None) -> int:
    """Bytes from '400M', '1.5G', '512MiB', '1073741824', or '0.4x' (a fraction of model_size).

    Units are binary (M = MiB), as llama.cpp and the kernel count them.
    """
    m = _FRACTION.match(text)
    if m:
        if model_size is None:
            raise FlexoffloadError(f"budget {text!r} is relative to a model's size, but there is no model")
        value = float(m.group(1)) * model_size
    else:
        m = _SIZE.match(text)
        if not m:
            raise FlexoffloadError(f"cannot read memory size {text!r}: use e.g. 400M, 1.5G or 0.4x")
        value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise FlexoffloadError(f"memory size must be positive: {text!r}")
    return int(value)


def is_relative(text: str) -> bool:
    """Whether a --mem is a fraction of a model's size (0.4x)."""
    return bool(_FRACTION.match(text))


def format_size(n: int, up: bool = False) -> str:
    """n bytes in MiB, or GiB to 0.01; up: rounded up, so that a minimum given back as --mem is enough."""
    import math

    if n >= 1 << 30:
        return f"{math.ceil(n / (1 << 30) * 100) / 100:.2f} GiB" if up else f"{n / (1 << 30):.2f} GiB"
    return f"{math.ceil(n / MiB)} MiB" if up else f"{n / MiB:.0f} MiB"


def holding(model, weights: int, run) -> int:
    """The budget a run needs to hold this many bytes of weights (and buffers for them) beside run, its Footprint
    (what the run takes beside weights at its settings, measured by measure/probe.py)."""
    return smallest_budget(run.runtime + run.code + run.total + KERNEL_FIXED + weights)


def largest_layer(model) -> int:
    """The bytes of the model's largest block one token reads (of a mixture of experts, the routed experts only):
    the page cache mmap cannot compute with less of."""
    return max((sum(model.token_bytes(t) for t in model.layer_tensors(i)) for i in range(model.n_layer)), default=0)


def minimum(model, run) -> int:
    """The smallest budget a run can work in with the mmap strategy.

    Beside the runtime and the context, the page cache must hold at least one layer's weights while the layer
    computes; below that every page faults in more than once per token.
    """
    return holding(model, largest_layer(model), run)


def check(model, budget: int, run, n_ctx: int, n_batch: int) -> None:
    """Refuse a budget below the minimum (run: the Footprint at -c n_ctx -b n_batch) before anything is loaded,
    naming the minimum."""
    need = minimum(model, run)
    if budget < need:
        raise BudgetTooSmall(
            f"budget {format_size(budget)} is too small for {model.path.name} at -c {n_ctx} -b {n_batch}: "
            f"the minimum is {format_size(need, up=True)}")


def status_bytes(field: str) -> int:
    """A size field of this process's /proc/self/status (VmHWM, RssAnon, ...), in bytes; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes: the peak when no cgroup measures it."""
    return status_bytes("VmHWM")


def drop_page_cache() -> bool:
    """Sync and drop the page cache (needs root). False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _own_memory_cgroup() -> tuple[str, Path] | None:
    """(version, path) of the memory cgroup this process is in, where this process may make children."""
    mounts = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, fstype = left.split(), right.split()
            if fstype[0] == "cgroup2":
                mounts.setdefault("v2", fields[4])
            elif fstype[0] == "cgroup" and "memory" in fstype[-1].split(","):
                mounts["v1"] = fields[4]
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, rel in lines:
        if "memory" in controllers.split(",") and "v1" in mounts:
            path = Path(mounts["v1"] + rel)
            if (path / "memory.limit_in_bytes").exists():
                return "v1", path
    for hid, controllers, rel in lines:
        if hid == "0" and controllers == "" and "v2" in mounts:
            path = Path(mounts["v2"] + rel)
            if "memory" in (path / "cgroup.controllers").read_text().split():
                return "v2", path
    return None


class MemoryCgroup:
    """A child memory cgroup with a hard limit. Use as a context manager; it is removed on exit.

    `popen` starts a command inside it (moved in before exec, so every allocation is charged).
    """

    _counter = itertools.count()

    def __init__(self, limit: int):
        self.limit = limit
        found = _own_memory_cgroup()
        if found is None:
            raise FlexoffloadError("no memory cgroup can be made here")
        self.version, parent = found
        self.path = parent / f"flexoffload-{os.getpid()}-{next(self._counter)}"
        try:
            self.path.mkdir()
            if self.version == "v2":
                (parent / "cgroup.subtree_control").write_text("+memory")
                (self.path / "memory.max").write_text(str(limit))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as e:
            self._remove()
            raise FlexoffloadError(f"cannot make a memory cgroup under {parent}: {e.strerror}") from None

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def popen(self, cmd: list[str], **kwargs) -> process.Popen:
        """Start cmd inside the cgroup, charged from its first allocation: moved into it before it execs
        (process.start's before_exec). kwargs: process.start's."""
        return process.start(cmd, before_exec=self._take, **kwargs)

    def _take(self, proc: process.Popen) -> None:
        """Move proc into the cgroup."""
        try:
            (self.path / "cgroup.procs").write_text(str(proc.pid))
        except OSError as e:
            raise FlexoffloadError(f"cannot move a process into {self.path}: {e.strerror}") from None

    def peak(self) -> int:
        """The peak memory charged to the cgroup (page cache included), in bytes."""
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except OSError:
            return 0

    def faults(self) -> dict:
        """What memory pressure cost the cgroup's processes (memory.stat, v1 or v2): major page faults, and
        refaults of file pages (code, libraries) that the kernel reclaimed and had to read again. Both stay small
        unless the run is squeezed at its limit."""
        try:
            lines = (self.path / "memory.stat").read_text().splitlines()
        except OSError:
            return {}
        stat = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
        names = {"pgmajfault": "major_faults", "workingset_refault_file": "refaults_file"}
        return {ours: int(stat[theirs]) for theirs, ours in names.items() if theirs in stat}

    def unreclaimable(self) -> int:
        """What the cgroup's processes hold now that reclaim cannot take back: anonymous memory (locked included),
        shared memory and kernel memory (memory.stat, and v1's kmem counter). Unlike the peak, page cache is not
        in it: a cgroup with cache to spare fills with it up to its limit, which says nothing about the run."""
        try:
            stat = dict(line.split()[:2] for line in (self.path / "memory.stat").read_text().splitlines()
                        if len(line.split()) >= 2)
        except OSError:
            return 0
        if self.version == "v2":
            kernel = int(stat.get("kernel", 0)) or sum(int(stat.get(k, 0)) for k in (
                "kernel_stack", "pagetables", "percpu", "sock", "slab"))
            return int(stat.get("anon", 0)) + int(stat.get("shmem", 0)) + kernel
        try:
            kernel = int((self.path / "memory.kmem.usage_in_bytes").read_text())
        except OSError:
            kernel = 0
        return int(stat.get("total_rss", 0)) + int(stat.get("total_shmem", 0)) + kernel

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer stopped a process of this cgroup (its `oom_kill` count)."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            lines = (self.path / name).read_text().splitlines()
        except OSError:
            return False
        return any(line.split()[:1] == ["oom_kill"] and int(line.split()[1]) > 0 for line in lines)

    def _remove(self) -> None:
        # tasks can take a moment to leave after exit: seconds where a killed process gives back a GB or more on a
        # busy machine (a fresh-clone test run beside a 1.5B's profile left a server's cgroup after 5 s)
        for _ in range(300):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


@dataclass
class Limited:
    """A command run to its end under a budget: its exit, output, and what the cgroup saw."""
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_mem_mb: float  # the cgroup's peak (page cache included); 0 when run without a budget
    unreclaimable_mb: float  # the sampled peak of what reclaim cannot take back (MemoryCgroup.unreclaimable)
    faults: dict  # MemoryCgroup.faults
    enforced: bool
    oom_killed: bool


def run_limited(cmd: list[str], limit: int | None, timeout: float | None = None,
                capture_stdout: bool = True, interactive: bool = False) -> Limited:
    """Run cmd to its end in its own memory cgroup of limit bytes (None: no cgroup), within timeout seconds.

    The one way flexoffload runs a child under a budget. Its stderr is collected; its stdout too, unless
    capture_stdout is False (then it is this process's, for text as it comes). interactive: it reads this process's
    stdin (a conversation). A run past the timeout is killed and is an error; an exit status is left to the caller.
    """
    t0 = time.perf_counter()
    cgroup = MemoryCgroup(limit) if limit is not None else None
    try:
        start = cgroup.popen if cgroup else process.start
        proc = start(cmd, stdin=None if interactive else process.DEVNULL, stdout=process.PIPE if capture_stdout else None,
                     stderr=process.PIPE)
        unreclaimable, out, err = 0, b"", b""
        try:
            while True:  # the peak of what the run cannot give back, sampled: the kernel keeps no peak of it
                if cgroup:
                    unreclaimable = max(unreclaimable, cgroup.unreclaimable())
                try:
                    out, err = proc.communicate(timeout=0.02)
                    break
                except process.TimeoutExpired:
                    if timeout is not None and time.perf_counter() - t0 > timeout:
                        raise FlexoffloadError(f"timed out after {timeout:.0f} s") from None
        except BaseException:  # a timeout, or this process stopped (Ctrl-C, SIGTERM): the child does not outlive it
            proc.kill()
            proc.communicate()
            raise
        return Limited(returncode=proc.returncode, stdout=(out or b"").decode("utf-8", "replace"),
                       stderr=(err or b"").decode("utf-8", "replace"), wall_s=time.perf_counter() - t0,
                       peak_mem_mb=cgroup.peak() / MiB if cgroup else 0.0, unreclaimable_mb=unreclaimable / MiB,
                       faults=cgroup.faults() if cgroup else {}, enforced=cgroup is not None,
                       oom_killed=(cgroup.oom_killed() or proc.returncode == -9) if cgroup else False)
    finally:
        if cgroup:
            cgroup.__exit__(None, None, None)


def cgroup_unavailable() -> str | None:
    """Why no memory cgroup can be made here, or None where one can (a small one is made and removed)."""
    try:
        MemoryCgroup(64 * MiB).__exit__(None, None, None)
        return None
    except FlexoffloadError as e:
        return str(e)

"""The disk as this machine has shown it, per device: the best sustained read bandwidth (the roofline's ceiling) and
the bandwidths of the last streamed runs the disk set the pace of (what plans predict with: typical_disk_bw).
Kept in the cache beside the profiles; measure/profiler.py measures, this remembers."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from flexoffload.defaults import cache_dir, write_atomic


# Reads that show a sustained bandwidth: at least this many bytes, all with O_DIRECT (a small model's few reads say
# more about latency; buffered ones may come from the page cache)
SUSTAINED_BYTES = 256 << 20


def _best_path(path) -> Path | None:
    try:
        return cache_dir() / "profiles" / f"disk-best-{os.stat(path).st_dev}.json"  # one a device
    except OSError:
        return None


def best_disk_bw(path) -> float:
    """The best sustained read bandwidth the device holding path has shown (0 if none is known)."""
    best = _best_path(path)
    try:
        return float(json.loads(best.read_text())["bytes_per_s"]) if best else 0.0
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def record_disk_bw(path, bytes_per_s: float, source: str) -> None:
    """Remember bytes_per_s if it is the best the device holding path has shown: a profile's pass, or a streamed
    run's bytes over its time. The roofline is computed from it: a ceiling must not sit below what a run reached,
    and this disk drifts between about 0.8 and 2.2 GB/s, so a median is no ceiling."""
    best = _best_path(path)
    if best is None or bytes_per_s <= best_disk_bw(path):
        return
    write_atomic(best, json.dumps({"bytes_per_s": bytes_per_s, "source": source, "file": str(path)}))


# The disk as streamed runs have met it: this disk drifts between about 0.8 and 2.2 GB/s over minutes, so one
# profile's few passes can sit far from what later runs see (measured: a profile's passes at 2.95 GB/s, runs at
# 0.8x streaming at 1.9-2.1 GB/s, and the plan predicting 10.99 tok/s for a run that made 7.7). A run counts when
# its compute waited on reads for at least IO_BOUND_SHARE of its time: then its bytes over its time are the disk's
# pace, not compute's. The last SEEN_KEEP such runs are kept per device.
IO_BOUND_SHARE = 0.2
SEEN_KEEP = 15


def _seen_path(path) -> Path | None:
    try:
        return cache_dir() / "profiles" / f"disk-seen-{os.stat(path).st_dev}.json"
    except OSError:
        return None


def seen_disk_bw(path) -> list[float]:
    """The read bandwidths (bytes/s) of the last streamed runs on the device holding path the disk set the pace
    of, oldest first."""
    seen = _seen_path(path)
    try:
        return [float(x) for x in json.loads(seen.read_text())["bytes_per_s"]] if seen else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def record_run(path, timings: dict, typical: bool = True) -> None:
    """What a streamed run's O_DIRECT reads say of the disk holding path (timings: engine.stream_timings'): its
    bytes over its time raise the best (the roofline's ceiling), and where the disk set the pace, they join the
    runs plans predict with (typical_disk_bw) unless typical is False: a speculative run's disk also waits while
    the draft drafts, and a run that does not read ahead (window 0) waits on each read in turn, so their bytes over
    their time say less than the disk can. Nor does a mixture of experts' run (expert_uses): its expert slices are
    read in bursts after each router, which this disk serves at a third to half of a pass's speed (docs/moe.md)."""
    typical = typical and not timings.get("expert_uses")
    if timings.get("stream_bytes_read", 0) < SUSTAINED_BYTES or timings["stream_direct"] != timings["stream_reads"]:
        return
    bytes_per_s = timings["stream_read_gb_s"] * 1e9
    record_disk_bw(path, bytes_per_s, "run")
    elapsed = timings["stream_bytes_read"] / bytes_per_s
    seen = _seen_path(path)
    if not typical or seen is None or timings["stream_stall_s"] < IO_BOUND_SHARE * elapsed:
        return
    recent = (seen_disk_bw(path) + [bytes_per_s])[-SEEN_KEEP:]
    write_atomic(seen, json.dumps({"bytes_per_s": recent, "file": str(path)}))


def typical_disk_bw(path, measured: float) -> float:
    """The bandwidth to plan with: the median of a profile's measure and the recent runs the disk paced."""
    return statistics.median([measured, *seen_disk_bw(path)])

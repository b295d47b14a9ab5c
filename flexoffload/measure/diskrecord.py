"""The disk as this machine has shown it, per device: the best sustained read bandwidth (the roofline's ceiling),
the bandwidths of the last streamed runs the disk set the pace of (what plans predict with: typical_disk_bw), and
the rates the last MoE runs' expert reads met where they set the pace (typical_expert_bw). Kept in the cache beside
the profiles; measure/profiler.py measures, this remembers."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from flexoffload.defaults import cache_dir, write_atomic


# Reads that show a sustained bandwidth: at least this many bytes, all with O_DIRECT (a small model's few reads say
# more about latency; buffered ones may come from the page cache)
SUSTAINED_BYTES = 256 << 20


def _record(name: str, path) -> Path | None:
    """The file of a record `name` for the device holding path (one a device, beside the profiles); None where path
    cannot be read."""
    try:
        return cache_dir() / "profiles" / f"{name}-{os.stat(path).st_dev}.json"
    except OSError:
        return None


def _rates(record: Path | None) -> list[float]:
    """A record's rates (bytes/s), oldest first; none where it is missing or cannot be read."""
    try:
        return [float(x) for x in json.loads(record.read_text())["bytes_per_s"]] if record else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _best_path(path) -> Path | None:
    return _record("disk-best", path)


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
    return _record("disk-seen", path)


def seen_disk_bw(path) -> list[float]:
    """The read bandwidths (bytes/s) of the last streamed runs on the device holding path the disk set the pace
    of, oldest first."""
    return _rates(_seen_path(path))


def record_run(path, timings: dict, typical: bool = True) -> None:
    """What a streamed run's O_DIRECT reads say of the disk holding path (timings: engine.stream_timings'): its
    bytes over its time raise the best (the roofline's ceiling), and where the disk set the pace, they join the
    runs plans predict with (typical_disk_bw) unless typical is False: a speculative run's disk also waits while
    the draft drafts, and a run that does not read ahead (window 0) waits on each read in turn, so their bytes over
    their time say less than the disk can. Nor does a mixture of experts' run (expert_uses): its expert slices are
    read in bursts after each router, which this disk serves at a third to half of a pass's speed (docs/moe.md):
    record_expert_run records those."""
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


# A mixture of experts' reads as runs have met them: bursts of expert slices after each router, which the profile
# times in 3 s of one moment (profiler.expert_reads: latency + bytes / expert_read_bw) while this disk drifts (the
# same file's bursts at 0.74-1.07 GB/s and 1.42-1.53 GB/s minutes apart, docs/moe.md). A run counts where its
# expert reads set its pace: compute waited on reads for at least IO_BOUND_SHARE of its time, the expert slices
# were at least half of what it read (else the waits are the dense tensors' too) and at least EXPERT_BYTES, all
# O_DIRECT. Its rate: the expert bytes over those waits where nothing was read ahead (a burst then overlaps
# nothing, so the wait is its time, as the plan counts it: plan/replay.py cost); where a prompt's batch read experts
# under compute, over the run's time (the waits would miss the hidden reads): a lower bound, as a dense run's; a run
# that looks ahead records nothing (expert_run_bw). The last SEEN_KEEP are kept per device.
EXPERT_BYTES = SUSTAINED_BYTES
EXPERT_SHARE = 0.5


def _expert_path(path) -> Path | None:
    return _record("expert-seen", path)


def seen_expert_bw(path) -> list[float]:
    """The rates (bytes/s) the expert reads of the last MoE runs on the device holding path met where they set the
    run's pace, oldest first."""
    return _rates(_expert_path(path))


def expert_run_bw(timings: dict) -> float:
    """The rate a MoE run's expert reads met (timings: engine.stream_timings'), or 0 where they did not set its
    pace or say too little."""
    n_bytes, total = timings.get("expert_bytes_read", 0), timings.get("stream_bytes_read", 0)
    if (n_bytes < EXPERT_BYTES or n_bytes < EXPERT_SHARE * total or timings.get("stream_read_gb_s", 0) <= 0
            or timings["stream_direct"] != timings["stream_reads"]):
        return 0.0
    if timings.get("expert_predicted", 0):  # its decode alone: a long prompt's compute hides the run's waits
        return _decode_bw(timings)
    elapsed, stall = total / (timings["stream_read_gb_s"] * 1e9), timings.get("stream_stall_s", 0.0)
    if stall <= 0 or stall < IO_BOUND_SHARE * elapsed:
        return 0.0
    # a prompt's batch read the next layer's experts ahead (patch 0022): over the run's time, a lower bound
    return n_bytes / (elapsed if timings.get("expert_ahead", 0) else stall)


def _decode_bw(timings: dict) -> float:
    """A run that looks ahead reads the next layer's experts under this one's compute, every token: neither its
    waits nor its whole time is the reads' (the 120b shape's runs met 1.37-1.67 GB/s decoding at 12 GiB, and bytes
    over the run's time, its 18-26 s prompt included, said 0.96-1.38, results/moe_120b_predicted.csv). Where the
    reads set its decode's pace (compute waited a share of it), what decode read over its time is the rate they met
    at least; 0 otherwise, or for a run that does not say what its prompt read."""
    decode_s = timings.get("stream_decode_s", 0.0)
    if decode_s <= 0 or "stream_prompt_stall_s" not in timings:
        return 0.0
    n_bytes = timings["stream_bytes_read"] - timings["stream_prompt_bytes_read"]
    stall = timings["stream_stall_s"] - timings["stream_prompt_stall_s"]
    if n_bytes < EXPERT_BYTES or stall < IO_BOUND_SHARE * decode_s:
        return 0.0
    return n_bytes / decode_s


def record_expert_run(path, timings: dict) -> float:
    """Remember the rate a MoE run's expert reads met (expert_run_bw) on the device holding path, where they set
    its pace; that rate (0: none recorded)."""
    bytes_per_s, seen = expert_run_bw(timings), _expert_path(path)
    if bytes_per_s <= 0 or seen is None:
        return 0.0
    recent = (seen_expert_bw(path) + [bytes_per_s])[-SEEN_KEEP:]
    write_atomic(seen, json.dumps({"bytes_per_s": recent, "file": str(path)}))
    return bytes_per_s


def typical_expert_bw(path, measured: float) -> float:
    """The rate to plan a MoE's expert bursts with: the median of the profile's fit (measured; 0: none) and the
    recent runs' rates; measured where no run recorded one."""
    seen = seen_expert_bw(path)
    return statistics.median([measured, *seen] if measured > 0 else seen) if seen else measured

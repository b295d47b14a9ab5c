"""--precision auto, wired (M2Cache; issue 17): the sensitivity profile measured, the walk over it and the point
chosen (plan/mixed.py), the chosen point's file written, its residency planned with its own compute speed, and its
quality measured where asked (plan --precision reports it). prepare's precision step runs it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model, load
from flexoffload.measure import probe
from flexoffload.measure import requantize
from flexoffload.measure import profiler
from flexoffload.measure import sensitivity
from flexoffload.plan.dimensions import Alternative, Precision
from flexoffload.plan.mixed import choose, search
from flexoffload.plan.planners import plan_budget


def plan(model: Model, budget: int, profile, n_ctx: int, n_batch: int, max_kld: float | None = None,
         min_tok_s: float | None = None, n_threads: int | None = None, io_threads: int | None = None,
         measure_quality: bool = True, original: Path | None = None, on_row=None, n_outputs: int = 1,
         n_seq_max: int = 1, draft: int = 0):
    """plan --precision auto: the walk, the chosen point's file written (requantized with the calibration text's
    importance matrix, or quantized from the original weights where given), its residency planned on the file
    itself with its own profile, its quality measured (against the file: the bound is in its terms).
    Returns (the residency Plan of the mixed file, with a `precision` record; the walk). n_outputs, n_seq_max
    and draft: speculation's (a tree's rows, its sequences, the resident draft's bytes)."""
    if original is not None:
        requantize.check_original(model, original)  # before the profile's hour is spent
    sens = sensitivity.measure(model, n_threads=n_threads, on_row=on_row)
    walk_ = search(model, budget, sens, profile, probe.measure(model, n_ctx, n_batch, n_outputs, n_seq_max),
                   io_threads, draft)
    point = choose(walk_, max_kld, min_tok_s)
    matrix = requantize.imatrix(model, sensitivity.calibration_text(), n_threads=n_threads)
    if original is not None or point.types:
        path = requantize.requantize(model, point.types, matrix, original, n_threads)
    else:
        path = model.path
    mixed = load(path)
    # the mixed file computes at its own speed (a Q2_K byte is not a Q4_K byte), measured once and cached with its
    # profile, so plan and run decide the same; the disk is the source's measure, so the two predictions differ by
    # the types alone
    own = replace(profiler.as_measured(mixed, n_threads or 1), disk_bw=profile.disk_bw,
                  io_latency=profile.io_latency, peak_disk_bw=profile.peak_disk_bw,
                  expert_read_bw=profile.expert_read_bw, expert_read_latency=profile.expert_read_latency)
    residency = plan_budget(mixed, budget, "balanced", own,
                            probe.measure(mixed, n_ctx, n_batch, n_outputs, n_seq_max),
                            io_threads=io_threads or IO_THREADS, draft=draft)
    measured = None
    if measure_quality and (point.types or original is not None):
        measured = sensitivity.quality(model, path, n_threads)
    record = Precision(source=str(model.path), original=str(original) if original else None,
                       types=dict(point.types), steps=tuple(tuple(s) for s in point.steps),
                       weight_bytes=point.weight_bytes,
                       source_weight_bytes=model.weight_bytes, predicted_kld=point.kld,
                       predicted_uqest_delta=point.uqest_delta, walk_tok_s=point.predicted_tok_s,
                       own_types_tok_s=walk_.points[0].predicted_tok_s,
                       alternatives=tuple(Alternative(p.steps[0][1], p.kld, p.weight_bytes, p.predicted_tok_s)
                                          for p in walk_.alternatives),
                       max_kld=max_kld if min_tok_s is None else None, min_tok_s=min_tok_s, measured=measured,
                       walk=tuple({"steps": len(x.steps), "kld": x.kld, "weight_bytes": x.weight_bytes,
                                   "predicted_tok_s": x.predicted_tok_s} for x in walk_.points))
    return replace(residency, precision=record), walk_


def with_quality(plan, n_threads: int | None = None):
    """A precision plan with its requantized file's quality measured (sensitivity.quality), where it lowered
    anything."""
    r = plan.precision
    if r is None or r.measured is not None or not (r.types or r.original):
        return plan
    return replace(plan, precision=replace(r, measured=sensitivity.quality(load(r.source), Path(plan.model),
                                                                           n_threads)))

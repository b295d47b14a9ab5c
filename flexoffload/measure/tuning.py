"""`plan --tune`: choose among plans by measuring them, where the cost model cannot tell them apart (the candidates
and the choice among the measured: plan/candidates.py; this module runs them and caches the choice).

At low budgets every policy streams nearly the same bytes and the cost model predicts them within a few per cent,
yet one measured faster than another by 30% (ffn-first against balanced at 0.4x, README). So: the N plans balanced
predicts fastest (one per window it tries), every baseline policy at its own best window, and upstream mmap (the
cost model has no model of the page cache under a budget: measured, it is never chosen blindly nor missed) each
run a few tokens in a fresh process under the enforced budget, cold, the candidates in turn, for a few rounds. The
fastest mean is kept if it beats the predicted best by more than the drift between runs (MARGIN), else the
predicted best is. Its plan.json records every candidate's predicted and measured tok/s (`tuning`). Tuned plans are
cached per model file, budget, -c, -b and machine, and `run --mem` streams by one when it exists (api.plan_for_run).
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, file_key
from flexoffload.measure import about
from flexoffload.plan.candidates import MMAP, candidates, label, mmap_candidate, pick

log = logging.getLogger(__name__)

PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list of numbers in ascending order.\"\"\"\n"



def _machine() -> str:
    """This machine, as far as plans care: its CPU and its memory."""
    text = ""
    for path, prefix in (("/proc/cpuinfo", "flags"), ("/proc/meminfo", "MemTotal")):
        try:
            text += next((line for line in open(path) if line.startswith(prefix)), "")
        except OSError:
            pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_path(model, budget: int, n_ctx: int, n_batch: int) -> Path:
    key = f"{file_key(model.path)}-m{budget}-c{n_ctx}-b{n_batch}-{_machine()}"
    return cache_dir() / "tuned" / key


def cached(model, budget: int, n_ctx: int, n_batch: int):
    """The tuned plan for this model, budget, context and machine, or None."""
    from flexoffload.plan import plans

    directory = cache_path(model, budget, n_ctx, n_batch)
    try:
        return plans.read(directory)
    except FlexoffloadError:
        return None


def tune(model, budget: int, profile, run, timed: Callable[[dict], float], n_ctx: int = 2048, n_batch: int = 512,
         n_best: int = 3, rounds: int = 2):
    """Measure the candidates under the enforced budget and return the fastest, with `tuning` recorded; it is
    cached for `run --mem`. run: the Footprint at n_ctx and n_batch; timed: the decode tok/s of a cold run of
    PROMPT under the enforced budget, given how it streams ({"strategy": "mmap"} or {"plan_dir": DIR}); api.tune
    gives it."""
    from flexoffload.memory import budgets
    from flexoffload.plan import plans

    if budgets.cgroup_unavailable():
        raise FlexoffloadError(f"--tune measures under an enforced budget: {budgets.cgroup_unavailable()}")
    plan_list = candidates(model, budget, profile, run, n_best)
    plan_list.append(mmap_candidate(model, budget, plan_list[0]))
    # a run: starting and loading (a few seconds), a prompt, the tokens at about the predicted speed
    seconds = rounds * sum(5 + 8 / max(p.predicted_tok_s or plan_list[0].predicted_tok_s, 0.1) for p in plan_list)
    log.info("--tune runs %d candidate plans cold under the enforced budget, in turn, %d round(s): %s (the "
             "choice is cached: `run --mem` streams by it)", len(plan_list), rounds, about(seconds))
    speeds: list[list[float]] = [[] for _ in plan_list]
    errors = [""] * len(plan_list)
    with tempfile.TemporaryDirectory(prefix="flexoffload-tune-") as tmp:
        dirs = [plans.write(p, Path(tmp) / str(i)) for i, p in enumerate(plan_list)]
        for r in range(rounds):
            for i, (p, directory) in enumerate(zip(plan_list, dirs)):  # in turn: the disk drifts over minutes
                if errors[i]:
                    continue
                how = {"strategy": MMAP} if p.policy == MMAP else {"plan_dir": str(directory)}
                try:
                    speeds[i].append(timed(how))
                except FlexoffloadError as e:
                    errors[i] = str(e)
                got = f"{speeds[i][-1]:.2f} tok/s" if speeds[i] and not errors[i] else errors[i]
                log.info(f"tune: round {r + 1}/{rounds}: {label(p.policy, p.window, p.predicted_tok_s)}: {got}")
    measured = [statistics.fmean(s) if s and not e else 0.0 for s, e in zip(speeds, errors)]
    if not any(measured):
        raise FlexoffloadError(f"no candidate plan ran under {budget} bytes: {errors[0]}")
    tuning = tuple({"policy": p.policy, "window": p.window, "predicted_tok_s": p.predicted_tok_s,
                    "measured_tok_s": m, "runs": s, "error": e}
                   for p, m, s, e in zip(plan_list, measured, speeds, errors))
    best = replace(plan_list[pick(measured)], tuning=tuning)
    plans.write(best, cache_path(model, budget, n_ctx, n_batch))
    return best

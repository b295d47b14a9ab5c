"""The choice among plans `plan --tune` measures (measure/tuning.py runs them): the candidates, which measured run
to keep, mmap as a candidate, and what a tuned plan tells the user. Pure: it plans over data and starts nothing."""

from __future__ import annotations

from dataclasses import replace

from flexoffload import FlexoffloadError
from flexoffload.defaults import POLICIES
from flexoffload.plan import plans
from flexoffload.plan.planners import AUTO_WINDOWS, plan_budget

# Runs of one plan in turn with others differ by up to a few per cent here (sd 1.5-6% in results/
# tuned_qwen1.5b_v1.csv): a candidate measured less than this much faster than the predicted best is not known to
# be faster. There, the first tuned bench kept balanced at window 4 over window 2 for 1.3% in tuning, then ran 6%
# slower than the untuned plan at 1.0x.
MARGIN = 0.03


def candidates(model, budget: int, profile, run, n_best: int) -> list:
    """The n_best balanced plans by prediction (a window each), the best first, and every baseline policy's plan
    (run: the Footprint at the run's -c and -b)."""
    balanced = []
    for window in AUTO_WINDOWS:
        try:
            balanced.append(plan_budget(model, budget, "balanced", profile, run, window=window))
        except FlexoffloadError:  # a deeper window that does not fit this budget
            pass
    if not balanced:
        raise FlexoffloadError(f"no plan fits {budget} bytes for {model.path.name}")
    balanced.sort(key=lambda p: -p.predicted_tok_s)
    found = balanced[:n_best] + [plan_budget(model, budget, policy, profile, run)
                                 for policy in POLICIES if policy != "balanced"]
    unique, seen = [], set()
    for p in found:
        key = (frozenset(p.resident), p.window)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def pick(measured: list[float], margin: float = MARGIN) -> int:
    """The index of the plan to keep: the fastest measured if it beats the predicted best (index 0) by more than
    margin, else the predicted best (0 when it ran; a candidate that failed measured 0)."""
    best = max(range(len(measured)), key=lambda i: measured[i])
    if measured[0] > 0 and measured[best] <= measured[0] * (1 + margin):
        return 0
    return best


MMAP = "mmap"  # the candidate that does not stream: upstream mmap under the same budget


def mmap_candidate(model, budget: int, best) -> plans.Plan:
    """mmap as a plan: nothing streamed, the memory beside the weights that of the streaming plans, no prediction."""
    names = tuple(t.name for t in model.tensors)
    memory = replace(best.memory, resident=0, window=0)
    return plans.Plan(model=str(model.path), policy=MMAP, budget=budget, memory=memory, resident=names, streamed=(),
                      window=0, io_threads=best.io_threads, predicted_tok_s=0.0, roofline_tok_s=best.roofline_tok_s,
                      profile=best.profile)


def label(policy: str, window: int, predicted: float) -> str:
    """A candidate as the user reads it."""
    if policy == MMAP:
        return "mmap (not predicted)"
    return f"{policy} window {window} (predicted {predicted:.2f})"


def describe(plan) -> str:
    """The tuning of a plan, a line a candidate."""
    return "\n".join(f"  {label(t['policy'], t['window'], t['predicted_tok_s'])}: measured "
                     + (f"{t['measured_tok_s']:.2f} tok/s" if not t["error"] else f"failed: {t['error']}")
                     for t in plan.tuning)


def mmap_note(plan) -> str:
    """What a run tells the user when the tuned choice is mmap."""
    streamed = [t["measured_tok_s"] for t in plan.tuning if t["policy"] != MMAP]
    mmap = next(t["measured_tok_s"] for t in plan.tuning if t["policy"] == MMAP)
    return (f"flexoffload: mmap measured faster than streaming at this budget (plan --tune: {mmap:.2f} tok/s, the "
            f"best plan {max(streamed, default=0):.2f}): running mmap (--untuned streams)")

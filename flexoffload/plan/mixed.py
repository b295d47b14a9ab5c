"""Precision and residency chosen together under a budget (M2Cache's offline ratio search; issue 17, item 3).

M2Cache searches the ratios of FP16, INT8 and INT4 neurons that fit a fixed memory budget, ranking candidates by
the uncertainty (UQEst) of what the model then generates. Here the unit is a group of tensors (sensitivity.py: one
kind over a run of layers) and the choices are llama.cpp's types. The search is greedy in the order the paper's
search ranks: from the file's own types, lower the group whose next type costs the least harm (measured KL
divergence) per byte it saves, one step at a time; after each step the residency planner plans the re-typed model
under the budget and the cost model predicts its tok/s. That walk is the trade-off curve; a quality bound
(--max-kld) or a speed target (--min-tok-s) picks the point on it.

A plan's harm is the sum of its groups' measured divergences: an approximation (two changes can compound or
cancel), so the chosen plan's requantized file is measured itself before it is reported. The walk is checked
against uniform plans (every group at one type: what llama-quantize alone does to a file), counted the same way:
one of them is taken where it is predicted faster within the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from flexoffload import FlexoffloadError
from flexoffload.gguf.model import Model
from flexoffload.plan import qtypes
from flexoffload.plan.qtypes import Row, Sensitivity

BOTH_BOUNDS = "give --max-kld or --min-tok-s, not both"  # rules.py refuses the options with it first
DEFAULT_MAX_KLD = 0.05  # nats: about half of what requantizing this Q4_K_M to Q3_K_M costs (0.089, measured)


@dataclass(frozen=True)
class Point:
    """One point of the walk: the types so far, their summed harm and bytes, the predicted speed."""
    types: dict  # {tensor name: type} for the tensors lowered
    steps: tuple  # (group, type) in the order taken
    kld: float  # summed over the groups' current types
    uqest_delta: float
    weight_bytes: int
    predicted_tok_s: float


@dataclass
class Walk:
    points: list[Point] = field(default_factory=list)
    alternatives: list[Point] = field(default_factory=list)  # uniform plans: every group at one type

    def fastest(self, max_kld: float) -> Point:
        within = [p for p in self.points + self.alternatives if p.kld <= max_kld]
        if not within:
            raise FlexoffloadError(f"no plan has a KL divergence of at most {max_kld}: the least is "
                                   f"{min(p.kld for p in self.points):.4f}")
        return max(within, key=lambda p: (p.predicted_tok_s, -p.kld))

    def least_harm(self, min_tok_s: float) -> Point:
        fast = [p for p in self.points + self.alternatives if p.predicted_tok_s >= min_tok_s]
        if not fast:
            best = max(self.points + self.alternatives, key=lambda p: p.predicted_tok_s)
            raise FlexoffloadError(f"no plan is predicted at {min_tok_s} tok/s or more under this budget: the fastest "
                                   f"is {best.predicted_tok_s:.2f} tok/s (KL divergence {best.kld:.4f})")
        return min(fast, key=lambda p: (p.kld, -p.predicted_tok_s))


def retyped(model: Model, types: dict[str, str]) -> Model:
    """The model as it would be with the types: each re-typed tensor's type and size changed (offsets are the
    original file's; for planning only, the written file has its own)."""
    tensors = [replace(t, type=types[t.name], n_bytes=qtypes.tensor_bytes(t, types[t.name])) if t.name in types
               else t for t in model.tensors]
    size = model.file_size - model.weight_bytes + sum(t.n_bytes for t in tensors)
    return replace(model, tensors=tensors, file_size=size)


def _chains(model: Model, sens: Sensitivity) -> dict[str, list[Row]]:
    """Each group's measured lower types, most bits first."""
    chains: dict[str, list[Row]] = {}
    for r in sens.rows:
        chains.setdefault(r.group, []).append(r)
    for rows in chains.values():
        rows.sort(key=lambda r: -qtypes.qtype(r.type).bits_per_weight)
    return chains


def walk(model: Model, sens: Sensitivity, predict, max_steps: int | None = None) -> Walk:
    """The greedy walk from the file's types. predict(retyped model) gives tok/s. At each step every group may move
    to any of its lower measured types; the move with the least added harm per added byte saved is taken (a move
    that saves bytes at no measured harm first)."""
    chains = _chains(model, sens)
    current: dict[str, Row | None] = {g: None for g in chains}
    types: dict[str, str] = {}
    steps: list[tuple[str, str]] = []
    out = Walk([Point({}, (), 0.0, 0.0, model.weight_bytes, predict(model))])
    while max_steps is None or len(steps) < max_steps:
        best = None
        for g, rows in chains.items():
            now = current[g]
            for r in rows:
                if now is not None and qtypes.qtype(r.type).bits_per_weight >= qtypes.qtype(now.type).bits_per_weight:
                    continue
                saved = r.bytes_saved - (now.bytes_saved if now else 0)
                harm = max(r.kld, 0.0) - (max(now.kld, 0.0) if now else 0.0)
                if saved <= 0:
                    continue
                score = harm / saved
                if best is None or score < best[0]:
                    best = score, g, r
        if best is None:
            break
        _, g, r = best
        current[g] = r
        for name in r.tensors:
            types[name] = r.type
        steps.append((g, r.type))
        m = retyped(model, types)
        chosen = [x for x in current.values() if x is not None]
        out.points.append(Point(dict(types), tuple(steps), sum(max(x.kld, 0.0) for x in chosen),
                                sum(x.uqest_delta for x in chosen), m.weight_bytes, predict(m)))
    return out


UNIFORM = ("Q5_K", "Q4_K", "Q3_K", "Q2_K")


def uniform(model: Model, sens: Sensitivity, predict) -> list[Point]:
    """The alternatives the walk is checked against: every group that was measured at a type lowered to it (what
    llama-quantize alone does to a whole file), its harm summed the same way."""
    out = []
    for ty in UNIFORM:
        rows = [r for r in sens.rows if r.type == ty]
        if not rows:
            continue
        types = {name: ty for r in rows for name in r.tensors}
        m = retyped(model, types)
        out.append(Point(types, (("all", ty),), sum(max(r.kld, 0.0) for r in rows),
                         sum(r.uqest_delta for r in rows), m.weight_bytes, predict(m)))
    return out


def search(model: Model, budget: int, sens: Sensitivity, profile, run, io_threads: int | None = None,
           draft: int = 0) -> Walk:
    """The walk under a budget: each point planned by the balanced residency planner; a point the budget cannot
    hold at all (the file's own types may not fit where lower ones do) predicts 0 tok/s. run: the source's
    Footprint at the run's settings (a retyped model's context is the source's); draft: a resident draft's
    bytes."""
    from flexoffload.defaults import IO_THREADS
    from flexoffload.plan.planners import plan_budget

    def predict(m: Model) -> float:
        try:
            return plan_budget(m, budget, "balanced", profile, run, io_threads=io_threads or IO_THREADS,
                               draft=draft).predicted_tok_s
        except FlexoffloadError:
            return 0.0

    out = walk(model, sens, predict)
    out.alternatives = uniform(model, sens, predict)
    return out


def choose(walk_: Walk, max_kld: float | None, min_tok_s: float | None) -> Point:
    """The walk's point for the bound: the fastest within --max-kld, or the least harm reaching --min-tok-s."""
    if max_kld is not None and min_tok_s is not None:
        raise FlexoffloadError(BOTH_BOUNDS)
    if min_tok_s is not None:
        return walk_.least_harm(min_tok_s)
    point = walk_.fastest(DEFAULT_MAX_KLD if max_kld is None else max_kld)
    if point.predicted_tok_s <= 0:
        raise FlexoffloadError("no plan within the bound fits the budget: raise --mem or --max-kld")
    return point

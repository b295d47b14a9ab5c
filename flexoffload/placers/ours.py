"""The default placement: the one the cost model predicts fastest, across the three tiers.

Candidates are llama.cpp's layer assignments (-ngl with any split of the trailing layers among the devices,
the output head on its device or kept on the host by an override: its logits then need not cross the link), and
the placements of the other policies (layers, split, oato), so the choice is checked against them. Each is ranked
by a quick estimate (Problem.quick); the host's tier (what stays resident there, what streams) is planned for the
best few, and the one predicted fastest wins. Contiguous layers keep the graph's visits to a device to one a
token: on a link every visit costs round trips, which is why per-operator placement loses over RPC.
"""

from __future__ import annotations

from ..placement import Placement, head_home
from . import Problem, evaluate, layer_counts, layers, oato, split

FINALISTS = 4  # candidates whose host tier is planned in full


def candidates(problem: Problem) -> list[Placement]:
    model, names = problem.model, problem.names
    out = []
    for n in range(0, model.n_layer + 2):
        for counts in layer_counts(model, n, len(names)) if n else [[0] * len(names)]:
            p = Placement("auto", names, n, tuple(float(c) for c in counts) if len(names) > 1 else ())
            if n and problem.fits(p):
                out.append(p)
                out.append(Placement("auto", names, n, p.tensor_split, head_home(model)))
            elif not n:
                out.append(p)
    return out


def place(problem: Problem) -> Placement:
    pool = [p for p in candidates(problem) if problem.fits(p)]
    pool.sort(key=problem.quick)
    others = [f(problem) for f in (layers.place, split.place, oato.place)]
    finalists = pool[:FINALISTS] + [p for p in others if problem.fits(p)]
    best = min(finalists, key=lambda p: evaluate(problem, p)[1].seconds_per_token)
    return Placement("auto", best.devices, best.n_gpu_layers, best.tensor_split, best.placed)

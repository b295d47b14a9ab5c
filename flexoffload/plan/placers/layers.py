"""llama.cpp's -ngl: the most trailing layers that fit every device (the output head counts as the first of them),
split among the devices as upstream splits them by default (by the free memory each reports; RPC servers here
report their machine's, so equal shares)."""

from __future__ import annotations

from flexoffload.plan.placement import Placement
from flexoffload.plan.placers.common import Problem


def place(problem: Problem) -> Placement:
    best = Placement("layers", problem.names, 0)
    for n in range(1, problem.model.n_layer + 2):
        candidate = Placement("layers", problem.names, n)
        if not problem.fits(candidate):
            break
        best = candidate
    return best

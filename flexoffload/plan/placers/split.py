"""Upstream's --tensor-split: every layer offloaded (-ngl all), the layers shared among the devices in proportion
to their budgets; if they cannot hold them all, the most trailing layers they can, in the same proportion."""

from __future__ import annotations

from flexoffload.plan.placement import Placement
from flexoffload.plan.placers.common import Problem


def place(problem: Problem) -> Placement:
    shares = tuple(float(b) for b in problem.budgets)
    for n in range(problem.model.n_layer + 1, 0, -1):
        candidate = Placement("split", problem.names, n, shares)
        if problem.fits(candidate):
            return candidate
    return Placement("split", problem.names, 0, shares)

"""The paper's policies by name: FlexInfer's Algorithm 1, its ablations, and no preservation at all. The default
(balanced.py) takes each one's resident set as a candidate, so it never predicts slower than any of them."""

from __future__ import annotations

from flexoffload.gguf.model import Model
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.planners import flexinfer, kind_first, layer
from flexoffload.plan.planners.common import Planner, always_resident


def stream_all(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    """No preservation: only the small tensors stay resident (FlexInfer's "Prefetch only" and "Sync Read")."""
    return always_resident(model)


BASELINES: dict[str, Planner] = {
    "flexinfer": flexinfer.plan,
    "attn-first": kind_first.attn_first,
    "ffn-first": kind_first.ffn_first,
    "layer": layer.plan,
    "none": stream_all,
}

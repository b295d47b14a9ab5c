"""FlexInfer's two ablation baselines: "Attn-first" (attention tensors first, then FFN) and "FFN-first".

Kind by kind across all layers (the paper's balanced locking granularity), smallest kind first, layers in order,
each tensor that still fits; other layer tensors last.
"""

from __future__ import annotations

from flexoffload.gguf.model import Model
from flexoffload.plan.costmodel import Profile
from flexoffload.gguf.model import ATTENTION_KINDS, FFN_KINDS
from flexoffload.plan.planners.common import base, by_kind, layer_pool


def _kinds_first(model: Model, capacity: int, window: int, first: tuple[str, ...], then: tuple[str, ...]) -> set[str]:
    ledger = base(model, capacity, window)
    pool = layer_pool(model, ledger.resident)
    order = [t for kind in by_kind(pool, first) + by_kind(pool, then) for t in kind]
    return ledger.take(order + pool).resident


def attn_first(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    return _kinds_first(model, capacity, window, ATTENTION_KINDS, FFN_KINDS)


def ffn_first(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    return _kinds_first(model, capacity, window, FFN_KINDS, ATTENTION_KINDS)

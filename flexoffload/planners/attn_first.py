"""FlexInfer's "Attn-first" ablation baseline: attention tensors first, then FFN tensors.

Kind by kind across all layers (the paper's balanced locking granularity), smallest kind first, layers in order,
each tensor that still fits; other layer tensors last.
"""

from __future__ import annotations

from ..costmodel import Profile
from ..model import Model
from . import ATTENTION, FFN, base, by_kind, layer_pool


def plan(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    ledger = base(model, capacity, window)
    pool = layer_pool(model, ledger.resident)
    order = [t for kind in by_kind(pool, ATTENTION) + by_kind(pool, FFN) for t in kind]
    return ledger.take(order + pool).resident

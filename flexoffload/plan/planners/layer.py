"""Whole layers from the first: FlexInfer's "w/o Balance" ablation (and M2Cache's fixed area).

Layers 0, 1, … stay resident whole while the next one fits whole; the memory left keeps what fits of the
following layers' tensors, tensor by tensor in layer order (the paper's "remaining memory stores part of the
next layer"). The layers that stream whole then read far more than the resident ones: the imbalance balanced
memory locking removes, and they need the biggest window.
"""

from __future__ import annotations

from flexoffload.gguf.model import Model
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.planners.common import base, layer_pool


def plan(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    ledger = base(model, capacity, window)
    pool = layer_pool(model, ledger.resident)
    layers = [[t for t in pool if t.layer == layer] for layer in range(model.n_layer)]
    whole = 0
    while whole < len(layers) and ledger.fits(layers[whole]):
        ledger.add(layers[whole])
        whole += 1
    return ledger.take(t for layer in layers[whole:] for t in layer).resident

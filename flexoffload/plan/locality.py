"""How a trace routes, in the figures published for trained mixtures of experts (issue 42, item 2), so a synthetic
model's routing can be set beside a real one's:

- touched: the distinct experts a layer uses within a window of consecutive tokens (GLM-5.2: 237 of its 256 within
  75 tokens), as a share of the layer's experts, averaged over the trace's windows;
- entropy: of a layer's load over the trace (how often each expert is chosen), over its most, log2(n_expert): 1.0
  is a uniform load (load-balancing losses keep trained routers near it), 0 one expert;
- repeat: the share of a token's experts the token before it used too (BigMoeOnEdge: "same as the previous token"
  predicts 35-43 % of trained Qwen MoEs' choices);
- lru_hit: an LRU cache's hit rate with a quarter and a half of each layer's experts as slots, replayed (llama.cpp
  #27861: 64 of 256 about 67 %, 128 of 256 about 81 %).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from flexoffload.plan.replay import Trace, simulate


@dataclass(frozen=True)
class Locality:
    layer: int  # -1: the mean over layers
    touched: float
    entropy: float
    repeat: float

    def to_dict(self) -> dict:
        return asdict(self)


def by_layer(trace: Trace, window: int = 100) -> list[Locality]:
    """Each layer's figures over the trace (window: the tokens of touched's windows)."""
    if trace.n_tokens < 2:
        raise ValueError("a trace of at least 2 tokens has a previous token to compare with")
    window = min(window, trace.n_tokens)
    out = []
    for layer in range(trace.n_layer):
        ids = trace.ids[:, layer, :]
        starts = range(0, trace.n_tokens - window + 1, window)
        touched = float(np.mean([len(np.unique(ids[s:s + window])) for s in starts])) / trace.n_expert
        load = np.bincount(ids.ravel(), minlength=trace.n_expert) / ids.size
        nonzero = load[load > 0]
        entropy = float(-(nonzero * np.log2(nonzero)).sum()) / math.log2(trace.n_expert)
        repeat = float(np.mean([len(np.intersect1d(ids[t - 1], ids[t])) for t in range(1, trace.n_tokens)]))
        out.append(Locality(layer, touched, entropy, repeat / trace.n_used))
    return out


def mean(rows: list[Locality]) -> Locality:
    return Locality(-1, *(float(np.mean([getattr(r, k) for r in rows])) for k in ("touched", "entropy", "repeat")))


def lru_hits(trace: Trace) -> dict[str, float]:
    """An LRU cache's hit rate at a quarter and a half of each layer's experts as slots, a token a step."""
    return {f"{k}/{trace.n_expert}": simulate(trace, k, "lru").hit_rate
            for k in (trace.n_expert // 4, trace.n_expert // 2)}

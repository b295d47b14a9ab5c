"""How a trace routes, in the figures published for trained mixtures of experts (issue 42, item 2), so a synthetic
model's routing can be set beside a real one's:

- touched: the distinct experts a layer uses within a window of consecutive tokens (GLM-5.2: 237 of its 256 within
  75 tokens), as a share of the layer's experts, averaged over the trace's windows;
- entropy: of a layer's load over the trace (how often each expert is chosen), over its most, log2(n_expert): 1.0
  is a uniform load (load-balancing losses keep trained routers near it), 0 one expert;
- repeat: the share of a token's experts the token before it used too (BigMoeOnEdge: "same as the previous token"
  predicts 35-43 % of trained Qwen MoEs' choices);
- lru_hit: an LRU cache's hit rate with a quarter and a half of each layer's experts as slots, replayed (llama.cpp
  #27861: 64 of 256 about 67 %, 128 of 256 about 81 %);
- split: what a cache of the same memory gains by another shape (issue 42, item 3): each layer its own slot count
  chosen on the trace's first half (early layers of trained MoEs touch far more experts), one pool for all layers,
  or LFU, each replayed on the second half against LRU's even slots.
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
    """An LRU cache's hit rate at an eighth, a quarter and a half of each layer's experts as slots, a token a
    step."""
    return {f"{k}/{trace.n_expert}": simulate(trace, k, "lru").hit_rate
            for k in (trace.n_expert // 8, trace.n_expert // 4, trace.n_expert // 2) if k}


def slots_by_layer(trace: Trace, slots: int, step: int = 0) -> list[int]:
    """Each layer's slot count for as many slots in all as `slots` a layer, from a replay of the trace: from a
    token's experts up, each time to the layer and count (in steps of `step`, 0: an eighth of the rest) with the
    most hits gained a slot (a count, not the next step: LRU gains nothing on a cycle until it holds all of it);
    where nothing gains, the rest evenly."""
    k, n = trace.n_used, trace.n_expert
    step = step or max(1, (n - k) // 8)
    hits = {}
    for c in range(k, n + 1, step):
        r = simulate(trace, c, "lru")  # a token a step: every layer asks for as many units
        hits[c] = [r.requests / trace.n_layer - m for m in r.misses_by_layer]
    alloc, room = [min(k, slots)] * trace.n_layer, slots * trace.n_layer - min(k, slots) * trace.n_layer
    while room >= step:
        moves = [((hits[c][il] - hits[a][il]) / (c - a), il, c) for il, a in enumerate(alloc) for c in hits
                 if a < c <= a + room]
        gain, il, c = max(moves, default=(0, 0, 0))
        if gain <= 0:  # nothing gains: the rest a step at a time to the smallest
            il = min(range(trace.n_layer), key=lambda i: alloc[i])
            c = alloc[il] + step
            if c not in hits:
                break
        room -= c - alloc[il]
        alloc[il] = c
    return alloc


@dataclass(frozen=True)
class Split:
    """Hit rates on a trace's second half of caches as large as `slots` a layer, shaped otherwise."""

    slots: int
    lru: float  # `slots` every layer, LRU
    by_layer: float  # each layer its own count (slots_by_layer on the first half), LRU
    pool: float  # one LRU pool of slots * n_layer for every layer
    lfu: float  # `slots` every layer, least frequently used out

    def to_dict(self) -> dict:
        return asdict(self)


def split(trace: Trace, slots: int, step: int = 0) -> Split:
    """The cache of `slots` a layer and its other shapes (Split), each chosen on the trace's first half and
    replayed on its second."""
    half = trace.n_tokens // 2
    first, second = (Trace(trace.n_layer, trace.n_expert, trace.n_used, ids, trace.source)
                     for ids in (trace.ids[:half], trace.ids[half:]))
    alloc = slots_by_layer(first, slots, step)
    lru = {c: simulate(second, c, "lru") for c in {*alloc, slots}}  # one replay a count, not one a layer
    requests = sum(lru[a].requests / trace.n_layer for a in alloc)
    misses = sum(lru[a].misses_by_layer[il] for il, a in enumerate(alloc))
    return Split(slots, lru[slots].hit_rate, 1 - misses / requests if requests else 1.0,
                 simulate(second, slots, "lru", pool=True).hit_rate, simulate(second, slots, "lfu").hit_rate)

"""A mixture of experts' expert cache as a plan dimension.

The runtime streams expert tensors by expert (patch 0018): once a layer's router has chosen, the chosen experts it
lacks are read (one read per expert and tensor), and each layer keeps `slots` experts between tokens. So a plan
for a MoE is a dense plan (every other tensor resident or streamed through the window, as for a dense model) plus a
slot count, and the two share the budget: the cache takes `slots` experts of every layer, and a prompt batch may
hold all of one layer's experts at once (it uses the union of its tokens' experts, trimmed back after the layer).

Expert reads cannot hide behind compute the way window prefetches do: which experts a layer needs is known only
when its router has run. So a miss costs its read time on top of the dense pipeline's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from flexoffload.gguf.model import Model
from flexoffload.plan import experts
from flexoffload.plan.costmodel import Profile

HitRate = Callable[[int], float]  # slots per layer -> share of a token's routed experts found in memory


def dense(model: Model) -> Model:
    """The model without its expert tensors: what the dense planners plan."""
    return replace(model, tensors=[t for t in model.tensors if t.kind != "expert"], n_expert=0, n_expert_used=0)


def expert_layers(model: Model) -> list[int]:
    return sorted({t.layer for t in model.tensors if t.kind == "expert"})


def memory(model: Model, slots: int, ubatch: int | None = None) -> int:
    """What the experts take at most: every layer's slots, and the layer computing holding the experts its batch
    uses beyond them (a decoded token: its routed experts; a prompt ubatch of `ubatch` tokens: up to all of them,
    None: all), given back after the layer."""
    k, n = model.n_expert_used, model.n_expert
    used = n if ubatch is None else min(n, ubatch * k)
    units = [experts.unit_bytes(model)[il] for il in expert_layers(model)]
    return sum(slots * u for u in units) + max((max(used - slots, 0) * u for u in units), default=0)


def uniform(model: Model) -> HitRate:
    """Routing spread evenly over the experts (random weights route so): a layer keeping s of its n experts holds
    a routed expert with probability s/n. The worst case for a cache; a routing trace replaces it."""
    return lambda slots: min(1.0, max(slots, 0) / model.n_expert)


@dataclass(frozen=True)
class Cost:
    slots: int
    hit_rate: float
    bytes_per_token: int  # expert bytes read per decoded token
    seconds: float  # what experts add to a token's time: their reads and their compute


def cost(model: Model, slots: int, profile: Profile, hit_rate: HitRate, io_threads: int) -> Cost:
    """A decoded token's expert reads (its misses: one read per expert and tensor, several in flight on the I/O
    threads, none overlapped with compute) and the routed experts' compute."""
    h = hit_rate(slots)
    k = model.n_expert_used
    units, unit_reads = experts.unit_bytes(model), experts.unit_reads(model)
    seconds, n_bytes = 0.0, 0
    for il in expert_layers(model):
        unit = units[il]
        misses = k * (1.0 - h)
        reads = misses * unit_reads[il]
        n_bytes += int(misses * unit)
        seconds += misses * unit / profile.disk_bw + math.ceil(reads / io_threads) * profile.io_latency
        for t in model.layer_tensors(il):
            if t.kind == "expert":
                seconds += k * (t.n_bytes // model.n_expert) * profile.seconds_per_byte(t.type)
    return Cost(slots=slots, hit_rate=h, bytes_per_token=n_bytes, seconds=seconds)


def candidates(model: Model) -> list[int]:
    """Slot counts worth planning: none kept between tokens, a token's routed experts, and on up to every expert
    in about a dozen steps."""
    k, n = model.n_expert_used, model.n_expert
    step = max(1, (n - k) // 12)
    return sorted({0, n} | set(range(k, n, step)))

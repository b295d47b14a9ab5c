"""A mixture of experts' expert cache as a plan dimension.

The runtime streams expert tensors by expert (patch 0018): once a layer's router has chosen, the chosen experts it
lacks are read (one read per expert and tensor), and each layer keeps `slots` experts between tokens. So a plan
for a MoE is a dense plan (every other tensor resident or streamed through the window, as for a dense model) plus a
slot count, and the two share the budget: the cache takes `slots` experts of every layer, and a prompt batch may
hold all of one layer's experts at once (it uses the union of its tokens' experts, trimmed back after the layer).

Expert reads cannot hide behind compute the way window prefetches do: which experts a layer needs is known only
when its router has run. So a decoded token's miss costs its read time on top of the dense pipeline's time, but for
the share the layer before predicted (lookahead, patch 0029: its router input through this layer's router), read
while that layer computed; a plan looks ahead where a token's experts fit in the slots (looks_ahead). A
prompt batch that names most of a layer's experts can read the next layer's ahead (patch 0022) while it computes,
at the memory of a second layer's experts (`ahead`); no plan turns that on yet (docs/moe.md says why).
What experts cost is replay.cost's (the one cost model of experts); this module sizes the cache and asks it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from flexoffload.gguf.model import Model
from flexoffload.plan import replay
from flexoffload.plan.costmodel import Profile

# (slots per layer, policy) -> what a cache of that many misses under that policy, by layer
MissesBySlots = Callable[[int, str], replay.Misses]
POLICIES = ("lru", "lfu")  # the runtime's (patch 0018); a plan sizes the cache by the first, then asks the others


def dense(model: Model) -> Model:
    """The model without its expert tensors: what the dense planners plan."""
    return replace(model, tensors=[t for t in model.tensors if t.kind != "expert"], n_expert=0, n_expert_used=0)


def expert_layers(model: Model) -> list[int]:
    return sorted({t.layer for t in model.tensors if t.kind == "expert"})


PAGE = 4096
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)


def slot_bytes(model: Model) -> list[int]:
    """Bytes of an expert's slot, by layer (patch 0025): each of its *_exps tensors' slices in whole pages, from the
    page its first byte is on (a slice's place in the file need not start one)."""
    return [sum(-(-b // PAGE) * PAGE + PAGE for b in layer) for layer in replay.expert_slices(model)]


def memory(model: Model, slots: int, ubatch: int | None = None) -> int:
    """What the experts take at most: every layer's slots, and the layer computing holding the experts its batch
    uses beyond them (a decoded token: its routed experts; a prompt ubatch of `ubatch` tokens: up to all of them,
    None: all), in the spill array the layers of a pass take in turn (patch 0027). A layer's slots are one array
    with room for every expert, the spill one with room for all but a layer's slots, each from a huge page
    boundary: the huge page the last slot in use ends in may be committed whole, where the array holds it."""
    k, n = model.n_expert_used, model.n_expert
    used = n if ubatch is None else min(n, ubatch * k)
    sizes = slot_bytes(model)  # once, not once a layer
    units = [sizes[il] for il in expert_layers(model)]

    def rounding(held: int, u: int) -> int:
        return min(HUGE_PAGE, (n - held) * u) if held else 0

    return (sum(slots * u + rounding(slots, u) for u in units)
            + max((max(used - slots, 0) * u + rounding(max(used, slots), u) for u in units), default=0))


def uniform(model: Model) -> MissesBySlots:
    """Routing spread evenly over the experts (replay.Misses.uniform), where no routing trace was measured. Not
    what random weights do: they send nearly every token to the same few experts (docs/experts.md), so a plan
    predicts fewer hits than such a model gets."""
    return lambda slots, policy="lru": replay.Misses.uniform(model, slots)  # any policy alike


def cost(model: Model, slots: int, profile: Profile, misses: MissesBySlots, io_threads: int,
         policy: str = "lru", lookahead: bool = False) -> replay.Cost:
    """What experts add to a decoded token's time with `slots` a layer under `policy` (and lookahead: the next
    layer's predicted experts read while a layer computes): replay.cost of the misses `misses` gives."""
    return replay.cost(model, slots, misses(slots, policy), profile, io_threads, lookahead)


def looks_ahead(model: Model, slots: int, lookahead: bool | None) -> bool:
    """Whether a plan of `slots` a layer reads the next layer's predicted experts (lookahead, patch 0029): as given,
    or (None) where a token's experts fit in the slots, which the runtime needs to act on it."""
    return slots >= model.n_expert_used if lookahead is None else lookahead


def candidates(model: Model) -> list[int]:
    """Slot counts worth planning: none kept between tokens, a token's routed experts, and on up to every expert
    in about a dozen steps."""
    k, n = model.n_expert_used, model.n_expert
    step = max(1, (n - k) // 12)
    return sorted({0, n} | set(range(k, n, step)))

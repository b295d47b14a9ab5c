"""What every policy shares: the small tensors kept resident, the ledger a resident set is built in within a
capacity (its window counted), the start every policy fills from (`base`), and the pools it chooses among.

The rules are the package's (planners/__init__.py says why); the policy modules import them from here, and the
package's __init__ imports the policy modules to list them (POLICIES), so no module imports back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from flexoffload import FlexoffloadError
from flexoffload.defaults import SMALL_BYTES
from flexoffload.gguf.model import Model, Tensor
from flexoffload.memory.budgets import format_size
from flexoffload.plan.costmodel import Pipeline, Profile, window_bytes_of

# a policy: (model, capacity, profile, window, io_threads) -> the names of the tensors it keeps resident
Planner = Callable[[Model, int, Profile, int, int], set[str]]


def is_small(t: Tensor) -> bool:
    """Whether the tensor is one the rules keep resident whatever the policy: a norm, a bias, or under SMALL_BYTES."""
    return t.kind in ("norm", "bias") or t.n_bytes < SMALL_BYTES


def always_resident(model: Model) -> set[str]:
    """The small tensors, and a mixture of experts' routers: every token reads each layer's whole, and lookahead
    (patch 0029) puts the layer before's input through it, which it does only for a router in memory (a streamed
    one gave the 30B-A3B shape no prediction at all: 1 MiB each, just over SMALL_BYTES). (A mixture of experts'
    expert tensors are never resident: they stream by expert, with a cache of their own, expertcache.py.)"""
    return {t.name for t in model.tensors if (is_small(t) or t.kind == "router") and t.kind != "expert"}


def memory_for(model: Model, resident: Collection[str], window: int) -> int:
    """Memory for weights a resident set takes: its bytes and the window its streamed tensors need."""
    return sum(t.n_bytes for t in model.tensors if t.name in resident) + Pipeline(model).window_bytes(resident, window)


class Ledger:
    """A resident set being built, within a capacity for its bytes plus its window.

    Only layer tensors are added (the stages are then fixed). Making a tensor resident never grows the window while
    its stage still streams, so what fits with the window as last computed fits; it is recomputed only when that is
    not enough. A stage that stops streaming leaves the runtime's ring, and the window then reaches one stage
    further: that can grow it, so it is recomputed at once.
    """

    def __init__(self, model: Model, resident: set[str], capacity: int, window: int):
        pipe = Pipeline(model)
        stages = pipe.stages(resident)
        index = {s.name: i for i, s in enumerate(stages)}
        self.stage = {t.name: index[f"blk.{t.layer}"] for t in model.tensors if t.layer is not None}
        self.held = pipe.held  # read buffers a streamed tensor holds (a chunked one: a few chunks)
        self.streamed = [s.held_bytes for s in stages]  # per stage, what its streamed tensors hold
        # stages in the runtime's ring that hold no read buffer (a row-read token_embd): fixed, as only layer
        # tensors are added
        self.rows_stages = {i for i, s in enumerate(stages) if s.n_streamed and not s.held_bytes}
        self.resident = set(resident)
        # resident bytes, and the pages of the rows a streamed token_embd reads (fixed: only layer tensors are added)
        self.used = sum(t.n_bytes for t in model.tensors if t.name in resident) + pipe.rows_memory(resident)
        self.capacity, self.window = capacity, window
        self.window_bytes = self.window_of(self.streamed)  # an upper bound while not fresh
        self._fresh, self._window_stages = True, None

    def copy(self) -> "Ledger":
        other = object.__new__(Ledger)
        other.__dict__.update(self.__dict__, resident=set(self.resident), streamed=list(self.streamed))
        return other

    def fits(self, tensors: Iterable[Tensor]) -> bool:
        """Whether all these (streamed layer) tensors can be made resident together."""
        tensors = [t for t in tensors if t.name not in self.resident]
        n_bytes = sum(t.n_bytes for t in tensors)
        freed: dict[int, int] = {}  # stage -> read buffers it would no longer hold
        for t in tensors:
            freed[self.stage[t.name]] = freed.get(self.stage[t.name], 0) + self.held[t.name]
        # a stage that stops streaming leaves the ring: the window may grow, so it is computed (only then: this is
        # the planners' inner loop)
        leaves = any(self.streamed[s] > 0 and self.streamed[s] - b <= 0 for s, b in freed.items())
        if not leaves:
            if self.used + n_bytes + self.window_bytes <= self.capacity:
                return True
            self._refresh()
            if self.used + n_bytes + self.window_bytes <= self.capacity:
                return True
            if len(tensors) == 1 and self.stage[tensors[0].name] not in self.window_stages():
                return False  # the window would not shrink
        streamed = list(self.streamed)
        for stage, b in freed.items():
            streamed[stage] -= b
        return self.used + n_bytes + self.window_of(streamed) <= self.capacity

    def add(self, tensors: Iterable[Tensor]) -> None:
        for t in tensors:
            if t.name not in self.resident:
                self.resident.add(t.name)
                self.used += t.n_bytes
                stage = self.stage[t.name]
                self.streamed[stage] -= self.held[t.name]
                self._fresh, self._window_stages = False, None
                if not self.streamed[stage]:  # left the ring
                    self._refresh()
        if self.used + self.window_bytes > self.capacity:
            self._refresh()
            assert self.used + self.window_bytes <= self.capacity, "added tensors that do not fit"

    def take(self, tensors: Iterable[Tensor]) -> "Ledger":
        """Make tensors resident in the given order, each one that still fits (first fit)."""
        for t in tensors:
            if t.name not in self.resident and self.fits([t]):
                self.add([t])
        return self

    def shrink(self, t: Tensor) -> int:
        """How much making t resident would shrink the window (less than nothing if its stage leaves the ring)."""
        self._refresh()
        streamed = list(self.streamed)
        streamed[self.stage[t.name]] -= self.held[t.name]
        return self.window_bytes - self.window_of(streamed)

    def window_stages(self) -> set[int]:
        """The stages in every run of window+1 stages that sets the window: only a tensor there can shrink it."""
        if self._window_stages is None:
            ring = self._ring(self.streamed)
            n, span = len(ring), self.window + 1
            stages = set(ring)
            if span < n:
                runs = [sum(self.streamed[ring[(i + j) % n]] for j in range(span)) for i in range(n)]
                top = max(runs)
                for i, run in enumerate(runs):
                    if run == top:
                        stages &= {ring[(i + j) % n] for j in range(span)}
            self._window_stages = stages
        return self._window_stages

    def _ring(self, streamed: list[int]) -> list[int]:
        """The stages in the runtime's ring: those that stream (sched.cpp has a group only for those)."""
        return [i for i, b in enumerate(streamed) if b > 0 or i in self.rows_stages]

    def window_of(self, streamed: list[int]) -> int:
        return window_bytes_of([streamed[i] for i in self._ring(streamed)], self.window)

    def _refresh(self) -> None:
        if not self._fresh:
            self.window_bytes, self._fresh = self.window_of(self.streamed), True


def base(model: Model, capacity: int, window: int) -> Ledger:
    """The ledger every policy starts from: small tensors, then output and token_embd, each if it fits with
    everything else streamed (output first: token_embd streams first)."""
    resident = always_resident(model)
    need = memory_for(model, resident, window)
    if need > capacity:
        raise FlexoffloadError(f"{format_size(capacity)} for weights is below the {format_size(need)} that the small "
                               f"tensors and a window of {window} over everything else streamed need")
    outside = [t for t in model.tensors if t.layer is None and t.name not in resident]
    outside.sort(key=lambda t: (t.kind == "token_embd", -t.n_bytes))  # output and any others, token_embd last
    for t in outside:
        if memory_for(model, resident | {t.name}, window) <= capacity:
            resident.add(t.name)
    return Ledger(model, resident, capacity, window)


def layer_pool(model: Model, resident: Iterable[str]) -> list[Tensor]:
    """The layer tensors a policy chooses among: those not already resident, in file order."""
    resident = set(resident)
    return [t for t in model.tensors if t.layer is not None and t.name not in resident]


def by_kind(pool: Iterable[Tensor], kinds: Iterable[str]) -> list[list[Tensor]]:
    """The pool's tensors of each kind (layers ascending), the kinds smallest total first (ties in llama order):
    with GQA the small K and V come before Q and output, as FlexInfer prefers."""
    pool = sorted(pool, key=lambda t: t.layer)  # files may list layers as 0, 1, 10, 11, …
    groups = [[t for t in pool if t.kind == k] for k in kinds]
    groups = [g for g in groups if g]
    return sorted(groups, key=lambda g: sum(t.n_bytes for t in g))

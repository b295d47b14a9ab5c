"""An expert cache, replayed: which experts a text routes to (a Trace), how many of them a cache of a given size and
replacement policy would have to read (a Replay), and what that costs a decoded token (cost, predict): the one cost
model of experts, which the planner's expert cache (expertcache.py) uses too. Issue 28, items 2-3; the trace itself
is measured by measure/tracing.py.

The cache being predicted is the runtime's (patch 0018): a unit is one expert of one layer, its slices of all that
layer's *_exps tensors (nb[2] bytes of each). Each layer keeps `slots` units between steps (or, the pool variant, all
layers share slots * n_layer). A step is one ubatch: a decoded token, or a prompt batch of B tokens. At each layer a
step uses the union of its tokens' experts, those fewer of its tokens route to first (ties, and a decoded token's,
in ascending id order), so that of a batch's experts the most routed count as the most recently used; those not
cached are read (misses) and all of them stay while the layer computes, so the layer may hold more than `slots`. A
unit to give back is chosen by the policy among those the step did not use, and only if none is left among the
step's own:

- "lru": the least recently used.
- "lfu": the least frequently used, counting the tokens routed to the expert since the trace began (a decoded
  token's step one, a prompt's step as many of its tokens as chose it; the count is kept when an expert is
  evicted); ties go to the least recently used.
- "belady": the one whose next use is farthest away (never again: farthest of all), Belady's MIN. No policy that
  keeps what it reads while there is room misses less, so it is the bound the others are measured against.

Misses include the cold start (each unit's first use): at most n_layer * n_expert units once, well under 1 % of the
accesses of a trace of a few thousand tokens.
"""

from __future__ import annotations

import base64
import heapq
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from flexoffload import FlexoffloadError
from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model
from flexoffload.plan.costmodel import Profile, compute_seconds, expert_seconds

POLICIES = ("lru", "lfu", "belady")


@dataclass(frozen=True)
class Trace:
    """The experts each token of a text routes to: ids[token, layer, rank] (rank 0 the router's first choice)."""

    n_layer: int
    n_expert: int
    n_used: int
    ids: np.ndarray  # int, tokens x n_layer x n_used
    source: str = ""  # what was traced: the model file and the text

    def __post_init__(self):
        ids = np.asarray(self.ids)
        if ids.ndim != 3 or ids.shape[1:] != (self.n_layer, self.n_used):
            raise ValueError(f"a trace of {self.n_layer} layers and {self.n_used} experts a token is tokens x "
                             f"{self.n_layer} x {self.n_used}, not {'x'.join(map(str, ids.shape))}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_expert):
            raise ValueError(f"expert ids run from 0 to {self.n_expert - 1}: the trace has {ids.min()}-{ids.max()}")
        object.__setattr__(self, "ids", ids.astype(np.int32, copy=False))

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]

    def to_dict(self) -> dict:
        """A compact form for JSON: the ids as base64 of little-endian bytes (uint8 for up to 256 experts)."""
        dtype = "<u1" if self.n_expert <= 256 else "<u2"
        return {"n_layer": self.n_layer, "n_expert": self.n_expert, "n_used": self.n_used,
                "n_tokens": self.n_tokens, "source": self.source, "dtype": dtype,
                "ids": base64.b64encode(self.ids.astype(dtype).tobytes()).decode("ascii")}

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        flat = np.frombuffer(base64.b64decode(d["ids"]), dtype=d["dtype"])
        ids = flat.reshape(d["n_tokens"], d["n_layer"], d["n_used"])
        return cls(d["n_layer"], d["n_expert"], d["n_used"], ids, d.get("source", ""))

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def read(cls, path: str | Path) -> "Trace":
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Replay:
    """What a cache did over a trace."""

    policy: str
    slots: int  # units per layer (the pool: slots * n_layer in all)
    batch: int  # tokens a step
    pool: bool  # one pool for all layers, not slots per layer
    n_tokens: int
    n_steps: int
    requests: int  # units the steps needed (per step and layer, the union of its tokens' experts)
    misses_by_layer: tuple[int, ...]  # units read, by layer
    steps_by_misses: tuple[tuple[int, ...], ...] = ()  # by layer: [m] the steps that read m units there

    @property
    def misses(self) -> int:
        return sum(self.misses_by_layer)

    @property
    def hits(self) -> int:
        return self.requests - self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 1.0

    @property
    def misses_per_token(self) -> float:
        """Expert units read per token."""
        return self.misses / max(self.n_tokens, 1)

    @property
    def misses_per_step(self) -> float:
        """Expert units read per step (a decoded token, or a prompt ubatch of `batch` tokens)."""
        return self.misses / max(self.n_steps, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "misses_by_layer": list(self.misses_by_layer),
                "steps_by_misses": [list(x) for x in self.steps_by_misses], "hit_rate": self.hit_rate,
                "misses_per_token": self.misses_per_token, "misses_per_step": self.misses_per_step}


def _steps(trace: Trace, batch: int, first: int = 0) -> list[list[list[tuple[int, int]]]]:
    """Per step, per layer: the experts it uses, each once with the tokens of the step routed to it, in the
    runtime's order of use (patch 0026): by those tokens, fewest first, ties in ascending id order; the first
    `first` tokens one step (a prompt's pass, whose last layer computes its last token alone: llama.cpp keeps only
    the rows it outputs there), then steps of `batch` tokens."""
    ids = trace.ids.tolist()
    bounds = ([0] if first else []) + list(range(first, len(ids), batch)) + [len(ids)]
    steps = []
    for start, end in zip(bounds, bounds[1:]):
        tokens = ids[start:end]
        step = []
        for layer in range(trace.n_layer):
            rows: dict[int, int] = {}
            for token in tokens[-1:] if first and start == 0 and layer == trace.n_layer - 1 else tokens:
                for e in token[layer]:
                    rows[e] = rows.get(e, 0) + 1
            step.append([(e, rows[e]) for e in sorted(rows, key=lambda e: (rows[e], e))])
        steps.append(step)
    return steps


_NEVER = math.inf


def simulate(trace: Trace, slots: int, policy: str, batch: int = 1, pool: bool = False, first: int = 0) -> Replay:
    """Replay the trace through the expert cache (the module's docstring says how it behaves): slots units per layer,
    or with pool one cache of slots * n_layer units that all layers share, steps of `batch` tokens (the first
    `first` tokens one step before them: a prompt's pass; its requests and misses are not counted, so the hit rate
    is the decoded tokens' with the cache the prompt left)."""
    if policy not in POLICIES:
        raise FlexoffloadError(f"unknown expert cache policy {policy!r}: one of {', '.join(POLICIES)}")
    if slots < 0 or batch < 1:
        raise FlexoffloadError(f"an expert cache needs slots >= 0 and a batch >= 1, not {slots} and {batch}")
    steps = _steps(trace, batch, first)
    n_layer = trace.n_layer
    capacity = slots * n_layer if pool else slots
    # a unit is (layer, expert)
    caches = [_Cache(policy, capacity) for _ in range(1 if pool else n_layer)]
    upcoming = _next_uses(steps, n_layer) if policy == "belady" else None
    misses = [0] * n_layer
    by_misses = [[0] * (trace.n_expert + 1) for _ in range(n_layer)]
    requests = 0
    for s, step in enumerate(steps):
        counted = not (first and s == 0)  # the prompt's pass fills the cache, uncounted
        for layer, units in enumerate(step):
            cache = caches[0 if pool else layer]
            missed = 0
            for i, (e, rows) in enumerate(units):
                unit = (layer, e)
                if unit not in cache:
                    missed += 1
                cache.use(unit, upcoming[s][layer][i] if upcoming else None, rows)
            cache.trim({(layer, e) for e, _ in units})
            if counted:
                requests += len(units)
                misses[layer] += missed
                by_misses[layer][missed] += 1
    skipped = 1 if first else 0
    return Replay(policy, slots, batch, pool, trace.n_tokens - first, len(steps) - skipped, requests, tuple(misses),
                  tuple(tuple(x) for x in by_misses))


def _next_uses(steps: list[list[list[tuple[int, int]]]], n_layer: int) -> list[list[list[float]]]:
    """For each use, as steps lists them: the time of that unit's next use (never: infinity). Time is the visit
    index step * n_layer + layer, so it orders uses across layers too (the pool)."""
    out = [[[] for _ in range(n_layer)] for _ in steps]
    following: dict[tuple[int, int], float] = {}
    for s in range(len(steps) - 1, -1, -1):
        for layer in range(n_layer - 1, -1, -1):
            out[s][layer] = [following.get((layer, e), _NEVER) for e, _ in steps[s][layer]]
            for e, _ in steps[s][layer]:
                following[(layer, e)] = s * n_layer + layer
    return out


class _Cache:
    """One cache of units under a policy: use() what a layer's step uses (all kept while it computes, so the cache
    may overfill), trim() after it.

    Victims come off a heap with lazy deletion: every use pushes the unit's new key, and a popped key that is not the
    unit's current one is stale. Keys, smallest evicted first: LFU (count, order), Belady (-next use, order); LRU is
    an ordered dict, least recent first. `order` counts uses, so later in a step is more recent. LFU's count is
    the tokens routed to a unit since the start (patch 0028: a prompt's step counts as many as chose it)."""

    def __init__(self, policy: str, capacity: int):
        self.policy, self.capacity = policy, capacity
        self.recency: OrderedDict = OrderedDict()  # LRU: every cached unit, least recent first
        self.key: dict = {}  # LFU, Belady: every cached unit's current heap key
        self.heap: list = []
        self.counts: dict = {}  # LFU: tokens routed to each unit since the start, cached or not
        self.order = 0

    def __contains__(self, unit) -> bool:
        return unit in (self.recency if self.policy == "lru" else self.key)

    def use(self, unit, next_use: float | None, rows: int = 1) -> None:
        self.order += 1
        if self.policy == "lru":
            self.recency[unit] = None
            self.recency.move_to_end(unit)
            return
        if self.policy == "lfu":
            self.counts[unit] = self.counts.get(unit, 0) + rows
            key = (self.counts[unit], self.order)
        else:
            key = (-next_use, self.order)
        self.key[unit] = key
        heapq.heappush(self.heap, (key, unit))

    def trim(self, used: set) -> None:
        """Back to capacity: victims among the units not in used first (LRU's least recent are never in it)."""
        if self.policy == "lru":
            while len(self.recency) > self.capacity:
                self.recency.popitem(last=False)
            return
        spared = []  # used units popped while others could go: pushed back after
        while len(self.key) > self.capacity:
            if not self.heap:  # only used units are left: give them back by the policy as well
                self.heap = spared
                heapq.heapify(self.heap)
                spared, used = [], set()
            key, unit = heapq.heappop(self.heap)
            if self.key.get(unit) != key:
                continue
            if unit in used:
                spared.append((key, unit))
                continue
            del self.key[unit]
        for entry in spared:
            heapq.heappush(self.heap, entry)
        if len(self.heap) > 4 * len(self.key) + 64:  # drop the stale keys now and then
            self.heap = [(k, u) for k, u in self.heap if self.key.get(u) == k]
            heapq.heapify(self.heap)


# --- what it costs a decoded token ------------------------------------------------------------------------------

def expert_slices(model: Model) -> list[list[int]]:
    """By layer, the bytes of one expert's slice (nb[2]) of each of the layer's *_exps tensors: what a unit is made
    of (unit_bytes, unit_reads, and the slots of expertcache.slot_bytes). Empty lists for a dense model."""
    out: list[list[int]] = [[] for _ in range(model.n_layer)]
    for t in model.tensors:
        if t.kind == "expert" and t.layer is not None:
            out[t.layer].append(t.n_bytes // model.n_expert)
    return out


def unit_bytes(model: Model) -> list[int]:
    """Bytes of one expert unit, by layer: its slices of the layer's *_exps tensors."""
    if not model.n_expert:
        raise FlexoffloadError(f"{model.path.name} is not a mixture of experts")
    return [sum(s) for s in expert_slices(model)]


def unit_reads(model: Model) -> list[int]:
    """Read requests one unit's miss makes, by layer: one per *_exps tensor (its slice is contiguous)."""
    return [len(s) for s in expert_slices(model)]


def check(model: Model, trace: Trace) -> None:
    """The trace is of this model's shape (layers, experts, experts a token)."""
    if (trace.n_layer, trace.n_expert, trace.n_used) != (model.n_layer, model.n_expert, model.n_expert_used):
        raise FlexoffloadError(
            f"the expert trace has {trace.n_layer} layers routing to {trace.n_used} of {trace.n_expert} experts; "
            f"{model.path.name} has {model.n_layer} routing to {model.n_expert_used} of {model.n_expert}")


@dataclass(frozen=True)
class Misses:
    """What an expert cache misses where a decoded token passes: shares[layer][m], the share of tokens that read m
    units at that layer (a layer's shares sum to 1), and the hit rate over all the units tokens use."""

    hit_rate: float
    shares: tuple[tuple[float, ...], ...]
    # by layer, the share of its routed experts the layer before's router input predicts through its router
    # (measure/lookahead.py on the calibration text); empty: not measured, no read counted as hidden by lookahead
    recall: tuple[float, ...] = ()

    @classmethod
    def replayed(cls, replay: Replay) -> "Misses":
        """As a replay of one token a step counted them."""
        if replay.batch != 1:
            raise FlexoffloadError("a decode prediction replays one token a step, not a batch")
        steps = max(replay.n_steps, 1)
        return cls(replay.hit_rate, tuple(tuple(n / steps for n in layer) for layer in replay.steps_by_misses))

    @classmethod
    def uniform(cls, model: Model, slots: int) -> "Misses":
        """Routing spread evenly over the experts, each token's choice independent of the last: a layer keeping
        s of its n experts holds each of a token's k with probability s/n, so it misses m of them binomially. No
        measured routing looks like this (random weights send nearly every token to the same few experts,
        docs/experts.md); it stands in where no trace was measured."""
        k, n = model.n_expert_used, model.n_expert
        hit = min(1.0, max(slots, 0) / n)
        miss = tuple(math.comb(k, m) * (1 - hit) ** m * hit ** (k - m) for m in range(k + 1))
        reads = unit_reads(model)
        return cls(hit, tuple(miss if reads[il] else (1.0,) for il in range(model.n_layer)))

    def per_layer(self) -> list[float]:
        """Units read per token, by layer."""
        return [sum(m * p for m, p in enumerate(layer)) for layer in self.shares]


@dataclass(frozen=True)
class Cost:
    """What experts add to a decoded token with `slots` units a layer cached."""

    slots: int
    hit_rate: float
    units_per_token: float  # expert units read per token
    bytes_per_token: float  # bytes those units weigh
    compute_s: float  # the routed experts' compute (hits and misses alike)
    read_s: float  # the misses' reads

    @property
    def seconds(self) -> float:
        return self.compute_s + self.read_s


def cost(model: Model, slots: int, misses: Misses, profile: Profile, io_threads: int = IO_THREADS,
         lookahead: bool = False) -> Cost:
    """A decoded token's experts: the routed experts' compute, and the reads of the units it misses.

    At each layer the units a token misses are read as one burst (a request per unit and *_exps tensor, io_threads
    in flight; profile.expert_read_seconds: a latency plus its bytes at the profile's rate for bursts of expert
    slices). Without lookahead a burst starts once the layer's router has run and its experts compute right after:
    it overlaps nothing. With lookahead (patch 0029) the layers are a pipeline over one disk (_pipelined). Not
    modelled: up and down read while gate computes, a wrong prediction's read and the expert it evicted, the dense
    tensors' own streaming on the same disk, the page cache."""
    sizes, reads = unit_bytes(model), unit_reads(model)
    if len(misses.shares) != model.n_layer:
        raise FlexoffloadError(f"misses of {len(misses.shares)} layers for {model.path.name}'s {model.n_layer}")
    bursts = [sum(share * profile.expert_read_seconds(m * sizes[il], m * reads[il], io_threads)
                  for m, share in enumerate(layer) if m and share) for il, layer in enumerate(misses.shares)]
    read_s = sum(bursts)
    if lookahead and len(misses.recall) == model.n_layer:  # what the pipeline adds to the token's compute
        computed, experts, n = compute_seconds(model, profile), expert_seconds(model, profile), model.n_layer
        read_s = _pipelined(bursts, misses.recall, (computed - experts) / n, experts / n) - computed
    per_layer = misses.per_layer()
    return Cost(slots, misses.hit_rate, sum(per_layer), sum(u * b for u, b in zip(per_layer, sizes)),
                expert_seconds(model, profile), max(read_s, 0.0))


def _pipelined(bursts: list[float], recall: tuple[float, ...], dense_s: float, expert_s: float) -> float:
    """A decoded token's time through the layers with lookahead, one disk reading in turn what is queued. bursts: a
    layer's expected read time; recall: the share of it the layer before predicts, queued at that layer's router
    after its own unpredicted misses; dense_s, expert_s: a layer's compute before its experts, and theirs, which
    wait for its reads. Where reads outlast compute the disk never idles. Expected times stand for each token's;
    the first layer is predicted by none (nor is the next token's)."""
    t = disk = ready = 0.0  # ready: when the layer's predicted reads, queued at the router before, are done
    for il, burst in enumerate(bursts):
        t += dense_s
        own = burst * (1 - recall[il]) if il else burst
        disk = max(disk, t) + own
        done = disk if own > 0 else ready
        if il + 1 < len(bursts):
            disk += bursts[il + 1] * recall[il + 1]
            ready = disk
        t = max(t, done) + expert_s
    return t


@dataclass(frozen=True)
class Prediction:
    """A decoded token with an expert cache of `slots` units per layer under `policy`."""

    policy: str
    slots: int
    hit_rate: float
    units_per_token: float  # expert units read per token
    bytes_per_token: float  # bytes those units weigh
    cache_bytes: int  # what the cache holds: slots units of every layer
    compute_s: float  # the token's compute with every weight in memory, the routed experts' included
    read_s: float  # the misses' reads
    tok_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def predict(model: Model, trace: Trace, slots: int, policy: str, profile: Profile, io_threads: int = IO_THREADS,
            replay: Replay | None = None) -> Prediction:
    """Decode speed with an expert cache, by replaying the trace one token a step (or from a replay of it): the
    token's compute with every weight in memory (compute_seconds, the routed experts' included: the calibrated
    profile spreads the measured in-memory time over the dense matmuls and the routed experts) plus cost()'s reads. Not
    modelled: the dense weights' own streaming (the planner adds that: planners/_moe_plan)."""
    check(model, trace)
    c = cost(model, slots, Misses.replayed(replay or simulate(trace, slots, policy)), profile, io_threads)
    compute_s = compute_seconds(model, profile)  # the routed experts' compute (c.compute_s) included
    return Prediction(policy, slots, c.hit_rate, c.units_per_token, c.bytes_per_token, slots * sum(unit_bytes(model)),
                      compute_s, c.read_s, 1.0 / (compute_s + c.read_s))


def default_slots(model: Model) -> list[int]:
    """Slot counts worth a look: none (every routed expert read), one token's, a quarter, half and three quarters of
    the experts."""
    n, k = model.n_expert, model.n_expert_used
    return sorted({0, k, n // 4, n // 2, 3 * n // 4} - {n})


def table(model: Model, trace: Trace, slots: list[int], profile: Profile, batch: int,
          io_threads: int = IO_THREADS) -> list[dict]:
    """`profile --experts`'s rows, one per slot count and policy: decode's hit rate and prediction (Prediction's
    fields), the same cache as one pool of slots * n_layer (pool_hit_rate), and a prompt's ubatches of `batch`
    tokens (units_per_ubatch read, ubatch_hit_rate)."""
    for n in slots:
        if not 0 <= n <= model.n_expert:
            raise FlexoffloadError(f"an expert cache has 0 to {model.n_expert} slots a layer, not {n}")
    rows = []
    for n in slots:
        for policy in POLICIES:
            decode = simulate(trace, n, policy)
            pooled = simulate(trace, n, policy, pool=True)
            prompt = simulate(trace, n, policy, batch=batch)
            p = predict(model, trace, n, policy, profile, io_threads, decode)
            rows.append({**p.to_dict(), "pool_hit_rate": pooled.hit_rate, "batch": batch,
                         "units_per_ubatch": prompt.misses_per_step, "ubatch_hit_rate": prompt.hit_rate})
    return rows

"""Planners: which tensors stay resident under a memory budget; every policy is judged by the one cost model.

A policy is `plan(model, capacity, profile, window, io_threads) -> set of resident tensor names`. The capacity is
the budget less KV cache, compute buffers and runtime overhead: the memory for weights, which holds the resident
tensors and the prefetch window's buffers for the streamed ones. The window's size depends on what streams (the
most streamed bytes of window+1 consecutive stages), so each policy pays for its own: a `Ledger` keeps resident
bytes + window <= capacity exactly as tensors are added. A lumpy plan (whole layers streamed) needs a bigger
window than an even one, and that memory is not there for resident tensors: part of what balance buys.

Rules shared by all policies (common.py, `base`):
- Small tensors (norms, biases, anything under SMALL_BYTES) are always resident: together they are about 1% of a
  model, and streaming each would cost a read request per token for almost no bytes (HyperGen's size-aware
  caching). So are a mixture of experts' routers (read whole by every token, and lookahead predicts with them). A
  capacity below them and the window of streaming all else is an error (see `minimum_budget`).
- The tensors outside the layers (token_embd, output) stay resident unless the capacity cannot hold them. The
  output matrix is one large lump in the pipeline whose read cannot be spread over layers. It used to need a
  window buffer as big as itself (183 MiB on the 1.5B), which set the minimum budget; the runtime now reads a
  tensor larger than defaults.CHUNK_BYTES in row chunks and gives each back after use (patch 0007), so a streamed
  output holds only CHUNKS_IN_FLIGHT chunks of window (costmodel.held_bytes: 32 MiB) and streaming it frees nearly
  all its bytes. `balanced` therefore also tries it streamed whenever anything streams (the baselines keep the
  shared rule). When one must give way, token_embd streams first: the runtime reads only the rows a pass looks up
  (get_rows: a row per decoded token, into the pages of a few rows; costmodel.reads_rows), so it costs almost no
  memory and one small read a token. That makes streaming it worth it whenever anything streams: `balanced` weighs
  that too. A token_embd the output is tied to (no output.weight) is both: streamed, a lookup reads its rows and
  the output's matmul its row chunks (patches 0004, 0006, 0007), so it is weighed like an output matrix.
"""

from __future__ import annotations

from dataclasses import replace

from flexoffload import BudgetTooSmall, FlexoffloadError
from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model
from flexoffload.memory.budgets import format_size
from flexoffload.memory.footprint import Footprint, costs, smallest_budget
from flexoffload.plan import expertcache
from flexoffload.plan.costmodel import Pipeline, Profile, roofline, rows_memory
from flexoffload.plan.dimensions import Experts
from flexoffload.plan.planners import balanced
from flexoffload.plan.planners.baselines import BASELINES
# is_small: the shared rule, importable from here as before (the policy modules import it from common.py)
from flexoffload.plan.planners.common import Planner, always_resident, is_small, memory_for  # noqa: F401
from flexoffload.plan.plans import Memory, Plan

# what _moe_plan refuses, written once: rules.py's rules say it of the options
WHOLE_SLOTS_REFUSED = "expert slots are a cache of experts read by expert: not with expert tensors read whole"
WHOLE_LOOKAHEAD_REFUSED = "expert lookahead reads experts by expert: not with expert tensors read whole"

AUTO_WINDOWS = (0, 1, 2, 3, 4)  # prefetch windows make_plan chooses among (FlexInfer's default is 3)

# every policy by name: the default, then the paper's (baselines.py)
POLICIES: dict[str, Planner] = {"balanced": balanced.plan, **BASELINES}


def minimum_budget(model: Model, window: int | None = None, kv_cache: int = 0, compute: int = 0,
                   overhead: int = 0, code: int = 0) -> int:
    """The smallest budget that runs: everything streamable streamed, small tensors resident, the window's
    buffers, KV cache, compute buffers, overhead and code (window None: the least over AUTO_WINDOWS, i.e. window 0).
    Streaming a tensor moves its bytes to the window at most (a chunked one: a few chunks), so no plan needs less."""
    windows = AUTO_WINDOWS if window is None else (window,)
    experts = expertcache.memory(model, 0) if model.n_expert else 0
    model = expertcache.dense(model) if model.n_expert else model
    small = always_resident(model)
    return min(memory_for(model, small, w) for w in windows) + experts + kv_cache + compute + overhead + code


def make_plan(model: Model, budget: int, policy: str, profile: Profile, window: int | None = None,
              io_threads: int = IO_THREADS, kv_cache: int = 0, compute: int = 0, overhead: int = 0,
              code: int = 0, slots: int | None = None, misses: expertcache.MissesBySlots | None = None,
              whole: bool | None = None, lookahead: bool | None = None) -> Plan:
    """Plan a whole-process budget: resident weights + window + KV cache + compute buffers + overhead + code.

    window None: the one of AUTO_WINDOWS the cost model predicts fastest for this policy and budget. A deeper
    window overlaps more but its buffers take memory from resident tensors: while the disk is the bottleneck one
    layer read ahead (1) keeps it busy, and more only costs memory; near the compute/disk balance 2-3 win.
    """
    if policy not in POLICIES:
        raise FlexoffloadError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    if model.n_expert:
        return _moe_plan(model, budget, policy, profile, window, io_threads, kv_cache, compute, overhead, code,
                         slots, misses, whole, lookahead)
    windows = AUTO_WINDOWS if window is None else (window,)
    refuse_below(model, budget, min(minimum_budget(model, w, kv_cache, compute, overhead, code) for w in windows),
                 min(windows))
    capacity = budget - kv_cache - compute - overhead - code
    pipe = Pipeline(model, profile, io_threads)
    best = None
    for w in windows:
        if budget >= minimum_budget(model, w, kv_cache, compute, overhead, code):
            resident = POLICIES[policy](model, capacity, profile, w, io_threads)
            seconds = pipe.seconds(resident, w)
            if best is None or seconds < best[0]:
                best = seconds, w, resident
    seconds, window, resident = best
    memory = Memory(resident=sum(t.n_bytes for t in model.tensors if t.name in resident),
                    window=pipe.window_bytes(resident, window), kv_cache=kv_cache, compute=compute,
                    overhead=overhead, code=code)
    return Plan(
        model=str(model.path), policy=policy, budget=budget, memory=memory,
        resident=tuple(t.name for t in model.tensors if t.name in resident),
        streamed=tuple(t.name for t in model.tensors if t.name not in resident),
        window=window, io_threads=io_threads,
        predicted_tok_s=1.0 / seconds,
        roofline_tok_s=roofline(model, ceiling(profile), capacity),
        profile=profile,
    )


def _moe_plan(model: Model, budget: int, policy: str, profile: Profile, window: int | None, io_threads: int,
              kv_cache: int, compute: int, overhead: int, code: int, slots: int | None,
              misses: expertcache.MissesBySlots | None, whole: bool | None, lookahead: bool | None = None) -> Plan:
    """A mixture of experts: the dense tensors planned as a dense model's in what the expert cache leaves, for each
    slot count (slots None: the candidates), the fastest predicted; expert tensors stream by expert. Or (whole True,
    or None with no slots given) the expert tensors planned with the others as a dense model's tensors, streamed
    whole by the window (_whole_plan): faster where a token routes to a large share of the experts. None: the
    faster. lookahead: whether a decoded token's layer reads the next layer's predicted experts (patch 0029); None:
    where a token's experts fit in the slots."""
    if whole and slots is not None:  # rules.py's "whole-slots" refuses the options first; this guards the API
        raise FlexoffloadError(WHOLE_SLOTS_REFUSED)
    if whole and lookahead:  # and "whole-lookahead"
        raise FlexoffloadError(WHOLE_LOOKAHEAD_REFUSED)
    windows = AUTO_WINDOWS if window is None else (window,)
    refuse_below(model, budget, min(minimum_budget(model, w, kv_cache, compute, overhead, code) for w in windows),
                 min(windows))
    misses = misses or expertcache.uniform(model)
    base_model = expertcache.dense(model)
    whole_plan = None
    if whole is not False and slots is None:
        whole_plan = _whole_plan(model, budget, policy, profile, window, io_threads, kv_cache, compute, overhead,
                                 code, forced=bool(whole))
        if whole:
            return whole_plan
    best = None
    for s in ([slots] if slots is not None else expertcache.candidates(model)):
        experts = expertcache.memory(model, s)
        rest = budget - experts
        if rest < min(minimum_budget(base_model, w, kv_cache, compute, overhead, code) for w in windows):
            continue
        p = make_plan(base_model, rest, policy, profile, window, io_threads, kv_cache, compute, overhead, code)
        c = expertcache.cost(model, s, profile, misses, io_threads,
                             lookahead=expertcache.looks_ahead(model, s, lookahead))
        seconds = 1.0 / p.predicted_tok_s + c.seconds
        if best is None or seconds < best[0]:
            best = seconds, p, c, experts
    if whole_plan is not None and (best is None or whole_plan.predicted_tok_s >= 1.0 / best[0]):
        return whole_plan
    if best is None:
        need = minimum_budget(model, min(windows), kv_cache, compute, overhead, code) \
            + expertcache.memory(model, slots) - expertcache.memory(model, 0)
        raise BudgetTooSmall(f"budget {format_size(budget)} is too small for {model.path.name} with {slots} expert "
                               f"slots a layer: the minimum is {format_size(need, up=True)}")
    seconds, p, c, experts = best
    if slots is None:
        # the dense plan may leave part of its share unused (all it would keep resident is): slots take it, where
        # the candidates' steps (about a twelfth of the experts) left it
        spare, more = p.budget - p.memory.total, c.slots
        while more < model.n_expert and expertcache.memory(model, more + 1) - experts <= spare:
            more += 1
        if more > c.slots:
            o = expertcache.cost(model, more, profile, misses, io_threads,
                                 lookahead=expertcache.looks_ahead(model, more, lookahead))
            if o.seconds < c.seconds:
                seconds, c, experts = seconds - c.seconds + o.seconds, o, expertcache.memory(model, more)
    # the cache sized under LRU, then each other policy at that size (one replay each, not one a slot count): on
    # the 30B-A3B shape's calibration text LFU hit 74 % of a quarter's uses against LRU's 66 % (results/moe_locality)
    evicts = expertcache.POLICIES[0]  # not `policy`: that is the dense tensors' placement
    for other in expertcache.POLICIES[1:]:
        o = expertcache.cost(model, c.slots, profile, misses, io_threads, other,
                             expertcache.looks_ahead(model, c.slots, lookahead))
        if o.seconds < c.seconds:
            seconds, c, evicts = seconds - c.seconds + o.seconds, o, other
    expert_names = {t.name for t in model.tensors if t.kind == "expert"}
    streamed = set(p.streamed) | expert_names
    # reading ahead in a prompt (patch 0022) is not planned (Experts.ahead stays False): on the 30B-A3B shape at
    # 4 GiB a plan with room for the next layer's experts beside its slots ran out of memory under --enforce
    # (docs/moe.md)
    return replace(
        p, model=str(model.path), budget=budget, memory=replace(p.memory, experts=experts),
        streamed=tuple(t.name for t in model.tensors if t.name in streamed),
        predicted_tok_s=1.0 / seconds,
        experts=Experts(slots=c.slots, policy=evicts, hit_rate=c.hit_rate, bytes_per_token=c.bytes_per_token,
                        seconds=c.seconds, lookahead=expertcache.looks_ahead(model, c.slots, lookahead)))


def _whole_plan(model: Model, budget: int, policy: str, profile: Profile, window: int | None, io_threads: int,
                kv_cache: int, compute: int, overhead: int, code: int, forced: bool) -> Plan | None:
    """A MoE's expert tensors planned as dense tensors (kept resident or streamed whole by the window, patch 0021),
    with the routed experts' compute added; None where the budget holds no such plan (forced: a one-line error)."""
    try:
        p = make_plan(replace(model, n_expert=0, n_expert_used=0), budget, policy, profile, window, io_threads,
                      kv_cache, compute, overhead, code)
    except FlexoffloadError:
        if forced:
            raise
        return None
    # every expert cached: the routed experts' compute alone (the dense pipeline counts no expert compute)
    c = expertcache.cost(model, model.n_expert, profile, expertcache.uniform(model), io_threads)
    streamed = set(p.streamed)
    read = sum(t.n_bytes for t in model.tensors if t.kind == "expert" and t.name in streamed)
    return replace(p, predicted_tok_s=1.0 / (1.0 / p.predicted_tok_s + c.seconds),
                   experts=Experts(slots=0, policy="lru", hit_rate=0.0, bytes_per_token=read, seconds=c.seconds,
                                   whole=True))


def refuse_below(model: Model, budget: int, need: int, window: int) -> None:
    if budget < need:
        raise BudgetTooSmall(f"budget {format_size(budget)} is too small for {model.path.name} with window "
                               f"{window}: the minimum is {format_size(need, up=True)}")


def ceiling(profile: Profile) -> Profile:
    """The profile with the best disk bandwidth this machine has shown for the model's device, for the roofline
    (the plan itself is predicted with the profile's median: what to expect, not the best case)."""
    from dataclasses import replace

    return replace(profile, disk_bw=max(profile.disk_bw, profile.peak_disk_bw))


def plan_budget(model: Model, budget: int, policy: str, profile: Profile, run: Footprint,
                window: int | None = None, io_threads: int = IO_THREADS, draft: int = 0, slots: int | None = None,
                misses: expertcache.MissesBySlots | None = None, whole: bool | None = None,
                lookahead: bool | None = None) -> Plan:
    """make_plan with what a run takes beside the weights at its settings, run (the Footprint llama.cpp reports and
    the probe measures: measure.footprint); draft is what a resident draft model takes (resident_bytes), counted
    with the overhead."""
    check_budget(model, budget, run, window, draft)
    return make_plan(model, budget, policy, profile, window=window, io_threads=io_threads, slots=slots,
                     misses=misses, whole=whole, lookahead=lookahead, **costs(run, draft, budget))


def check_budget(model: Model, budget: int, run: Footprint, window: int | None = None, draft: int = 0) -> None:
    """Refuse a budget below what plan_budget needs (a one-line error naming the minimum): before anything is
    measured for the plan."""
    # the slack grows with the budget: the minimum is the smallest budget that holds its own
    floor = smallest_budget(minimum_budget(model, window, **costs(run, draft)))
    refuse_below(model, budget, floor, min(AUTO_WINDOWS) if window is None else window)


def run_minimum(model: Model, run: Footprint) -> int:
    """The smallest budget plan_budget accepts for a run whose footprint is run (window chosen freely)."""
    return smallest_budget(minimum_budget(model, None, **costs(run)))


def resident_bytes(model: Model, run: Footprint, by_rows=()) -> int:
    """What a model kept in memory takes beside the runtime (a draft model): weights and its context (run: its
    Footprint). by_rows: tensors it reads by rows instead (a streamed token_embd), which take the pages of a few
    rows instead of themselves."""
    by_rows = set(by_rows)
    rows = [t for t in model.tensors if t.name in by_rows]
    weights = model.weight_bytes - sum(t.n_bytes for t in rows) + sum(rows_memory(t) for t in rows)
    return weights + run.total

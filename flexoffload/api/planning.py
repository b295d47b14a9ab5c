"""The plan a run streams by: the one planning path `run`, `serve`, `plan` and the API share (prepare's plan step).

Everything here reads a request's values and the model; nothing here decides drafting or writes into a request.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from flexoffload import BudgetTooSmall
from flexoffload.defaults import EXPERT_LOOKAHEAD, EXPERT_READS, IO_THREADS, WINDOW
from flexoffload.measure import dryrun, lookahead, opprofile, probe, profiler, tracing, tuning, ubatches
from flexoffload.memory import budgets, stepmem
from flexoffload.memory.budgets import format_size
from flexoffload.memory.footprint import KERNEL_FIXED, MARGIN, smallest_budget
from flexoffload.native import devices
from flexoffload.plan import costmodel, placement, placers, plans, prefill, replay
from flexoffload.plan.placement import DeviceProfile
from flexoffload.plan.planners import check_budget, make_plan, plan_budget

MMAP_TIE = 0.02  # mmap runs where predicted within this of the plan: the cost model's resolution


def kv_quantized(r) -> bool:
    return (r.cache_type_k, r.cache_type_v) != ("f16", "f16")


def step_setting(r, n_outputs: int = 1) -> stepmem.Setting | None:
    """The context's setting for llama.cpp's dry run (stepmem), where -ub, -fa or the KV types are given; else
    None (the footprint probe's costs at -c/-b apply)."""
    if not ((r.n_ubatch and r.n_ubatch != r.n_batch) or r.flash_attn != "auto" or kv_quantized(r)):
        return None
    return stepmem.Setting(r.n_ctx, min(r.n_ubatch or r.n_batch, r.n_ctx), "on" if r.flash_attn == "auto" else
                           r.flash_attn, r.cache_type_k, r.cache_type_v, n_outputs=n_outputs)


def expert_whole(r) -> bool | None:
    """--expert-reads as the planner takes it: True whole, False routed, None the plan's choice."""
    return EXPERT_READS[r.expert_reads]


def expert_misses(model):
    """A mixture of experts' misses by slots and policy (replay.Misses) from its measured routing (`profile
    --experts`), replayed through the runtime's cache under that policy (lru, lfu); None where none was measured (the
    planner then assumes uniform routing, which random weights do not show: they send nearly every token to the same
    few experts). With them, how well each layer predicts the next one's experts (lookahead's recall, where `profile
    --experts` measured it)."""
    if not model.n_expert:
        return None
    trace = tracing.cached(model)
    if trace is None:
        return None
    recall = lookahead.recall_cached(model) or ()
    misses: dict[tuple[int, str], replay.Misses] = {}

    def replayed(slots: int, policy: str = "lru") -> replay.Misses:
        if (slots, policy) not in misses:
            misses[slots, policy] = replace(replay.Misses.replayed(replay.simulate(trace, slots, policy)),
                                            recall=recall)
        return misses[slots, policy]

    return replayed


def _check_mmap(model, r, limit: int, draft: int, n_outputs: int) -> None:
    """mmap under a budget: refused where the context's buffers alone do not fit."""
    setting = step_setting(r, n_outputs)
    if setting is None:
        budgets.check(model, limit - draft, probe.measure(model, r.n_ctx, r.n_batch), r.n_ctx, r.n_batch)
        return
    # -ub, -fa or the KV types set the buffers: the dry run's costs, as for a plan
    costs = dryrun.run_costs(model, setting, limit)
    need = smallest_budget(sum(costs.values()) + KERNEL_FIXED + budgets.largest_layer(model))
    if limit - draft < need:
        raise BudgetTooSmall(f"budget {format_size(limit - draft)} is too small for {model.path.name} at "
                               f"-c {r.n_ctx} -ub {setting.n_ubatch} (KV {r.cache_type_k}/"
                               f"{r.cache_type_v}): the minimum is {format_size(need, up=True)}")


def plan_for_run(model, r, limit: int | None, n_outputs: int = 1, n_seq_max: int = 1, draft: int = 0):
    """The plan a run streams by, or None for mmap (and for `stream` with neither budget nor plan: all resident).

    r: the request's values as decided so far (strategy set). prefetch and sync stream every tensor but the small
    ones (policy none), with window 3 and 0. draft: the bytes a resident draft model (or free drafters' tables)
    take out of the budget.
    """
    if limit is not None:  # llama.cpp's own report of the context: refuses a model it cannot load, first
        probe.measure(model, r.n_ctx, r.n_batch, n_outputs, n_seq_max)
    if r.strategy == "mmap":
        if limit is not None:
            _check_mmap(model, r, limit, draft, n_outputs)
        return None
    if r.plan_dir:
        plan = plans.read(r.plan_dir)
        relative = r.mem and budgets.is_relative(r.mem)
        source = Path(plan.precision.source) if plan.precision is not None else model.path
        of = f" (--mem {r.mem} of {source.name}, {format_size(source.stat().st_size)})" if relative else ""
        placement.check_fits(plan, model, limit, r.plan_dir, of)
        return plan
    if r.rpc and r.mem and r.strategy == "stream":  # placed across the servers' devices, the host's share too
        return for_endpoints(model, devices.parse_endpoints(r.rpc), r.mem, r.placement,
                             profiler.measure(model, r.n_threads), r.n_threads, r.n_ctx, r.n_batch)
    policy, window = r.policy, r.window
    if r.tuned and r.strategy == "stream" and policy == "balanced" and window is None and limit is not None \
            and n_outputs == 1 and not draft:
        tuned = tuning.cached(model, limit, r.n_ctx, r.n_batch)
        if tuned is not None:
            return tuned
    if r.strategy in ("prefetch", "sync"):
        policy, window = "none", 0 if r.strategy == "sync" else (WINDOW if window is None else window)
    elif limit is None:
        return None
    budget = limit if limit is not None else 4 * model.file_size + (1 << 30)
    experts = dict(slots=r.expert_slots, misses=expert_misses(model), whole=expert_whole(r),
                   lookahead=EXPERT_LOOKAHEAD[r.expert_lookahead])
    setting = step_setting(r, n_outputs)
    if setting is not None:
        # the ubatch, the attention path and the KV types set the buffers: their costs from llama.cpp's dry run
        costs = dryrun.run_costs(model, setting, budget)
        costs["overhead"] += draft  # a resident draft's memory, as plan_budget counts it
        return make_plan(model, budget, policy, profiler.measure(model, r.n_threads), window=window,
                         io_threads=r.io_threads or IO_THREADS, **experts, **costs)
    run = probe.measure(model, r.n_ctx, r.n_batch, n_outputs, n_seq_max)
    check_budget(model, budget, run, window, draft)  # a budget too small is refused before the profile runs
    return plan_budget(model, budget, policy, profiler.measure(model, r.n_threads), run, window=window,
                       io_threads=r.io_threads or IO_THREADS, draft=draft, **experts)


def mmap_instead(model, plan, n_threads: int) -> str:
    """What to tell the user if upstream mmap is predicted as fast as the plan at its budget ('' if not).

    That is where the page cache beside the run's other memory holds what a token touches: mmap is compute-bound
    there, and the plan can only match it. A tie goes to mmap: measured over the matrix (results/matrix.md), every
    run where mmap's cache held a token's bytes was as fast or faster with mmap (a plan streaming a few MiB a token
    lost up to 11 %; one keeping every weight resident, in memory llama.cpp allocates and locks, 0-9 %, as upstream's
    own --mlock loses to mmap). The plan's margin (footprint.MARGIN) is for the budget's promise, not this
    prediction: it counts as cache."""
    m = plan.memory
    page_cache = plan.budget - (m.kv_cache + m.compute + m.overhead + m.code) + int(MARGIN * plan.budget)
    mmap_tok_s = 1 / costmodel.mmap_seconds(model, profiler.measure(model, n_threads), page_cache)
    if mmap_tok_s < plan.predicted_tok_s * (1 - MMAP_TIE):
        return ""
    return (f"flexoffload: the page cache holds what a token reads at this budget: mmap is predicted as fast as "
            f"the plan or faster ({mmap_tok_s:.2f} tok/s, the plan {plan.predicted_tok_s:.2f}): running mmap "
            f"(--strategy stream streams)")


def for_endpoints(model, endpoints: list[str], mem: str | None, policy: str, profile: costmodel.Profile,
                  n_threads: int, n_ctx: int, n_batch: int, io_threads: int = IO_THREADS) -> plans.Plan:
    """A placement plan over RPC servers (each one's first device), every device profiled (cached) and budgeted
    (placers.device_budget), the placers' problem solved over them."""
    host, named = placers.parse_mem(mem, endpoints, model) if mem else (None, {})
    profiles, budgets_ = [], []
    for i, endpoint in enumerate(endpoints):
        device = devices.probe_rpc(endpoint)[0]
        budget = placers.device_budget(named, i, endpoint, device.free)
        measured = opprofile.device_cached(model, endpoint, n_threads, budget=budget)
        profiles.append(DeviceProfile.from_dict({**{k: v for k, v in measured.items() if k != "measured"},
                                                 "name": device.name}))
        budgets_.append(budget)
    run = probe.measure(model, n_ctx, n_batch)
    problem = placers.problem_for(model, profiles, budgets_, host, profile, run, n_ctx, n_batch, io_threads)
    return placers.solve(problem, policy)


def prompt_ubatch(model, limit: int, n_prompt: int, r, profile: costmodel.Profile) -> tuple[int, plans.Plan, float]:
    """The ubatch a long prompt is computed in under the budget (plan/prefill.choose_ubatch over llama.cpp's buffers
    at each, measure/ubatches.py), its plan and its predicted time to first token."""
    io_threads = r.io_threads or IO_THREADS
    found = prefill.choose_ubatch(model, limit, n_prompt, r.n_predict, r.policy, profile, io_threads,
                                  ubatches.rates(model, r.n_threads, up_to=n_prompt),
                                  ubatches.candidates(model, limit, n_prompt, r.n_ctx, r.cache_type_k,
                                                      r.cache_type_v))
    if found is None:
        raise ubatches.none_fits(model, limit, r.n_ctx, r.cache_type_k, r.cache_type_v)
    return found

"""The Python API: the one place that wires measurement, planning and the runtime. The CLI, `bench` and the
scripts call it; nothing here prints.

    from flexoffload import api

    model = api.load("qwen2.5-coder-1.5b-instruct")                 # a catalog name or a GGUF path
    plan = api.plan(model, api.Budget(mem="0.5x"))                  # a Plan: read it, edit it, plan.write(DIR)
    result = api.generate(model, "def fib(n):", api.Generation(n_predict=32, temp=0), plan=plan)
    print(result["text"], result["decode_tok_s"], result["peak_mem_mb"])

The arguments come by concern: what to generate (Generation), the budget and how weights reach memory (Budget), a
resident draft model (Draft), RPC servers (Placement), lowered precision (Precision). `generate(..., enforce=True)`
runs in a child process the kernel holds to the budget.

Underneath, one flat Request carries all of them: `prepare` does what comes before loading (resolve the model, read
the budget, plan, decide whether a draft pays), `run_prepared` loads and generates. An enforced run is a fresh
process (`python -m flexoffload.api`) started in a child memory cgroup of the budget: it receives the prepared
request (the strategy and the draft decided) as JSON and writes its result as JSON. `generate(Request)` is the
older form and still works.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import IO_THREADS, STRATEGIES, WINDOW, cache_dir, file_key
from flexoffload.gguf import catalog
from flexoffload.measure import probe
from flexoffload.measure import tuning
from flexoffload.memory import budgets
from flexoffload.memory.budgets import MiB, format_size


@dataclass
class Request:
    """One generation, flat: the model, the prompt, and every concern's settings (see `request`); the form an
    enforced run's child receives as JSON."""
    model: str | None = None  # a GGUF path or a catalog name (None: the default model)
    prompt: str = ""
    n_predict: int = 128  # -1: until end of text
    n_ctx: int = 2048
    n_batch: int = 512
    n_threads: int = os.cpu_count() or 1
    temp: float = 0.8  # 0: greedy
    seed: int = -1  # -1: random
    mem: str | None = None  # the budget for the whole process: 400M, 1.5G, 0.4x
    strategy: str | None = None  # None: stream with mem or plan_dir, mmap otherwise
    policy: str = "balanced"
    plan_dir: str | None = None  # stream by a saved plan
    window: int | None = None  # None: the plan's
    io_threads: int | None = None  # None: the plan's, else IO_THREADS
    expert_slots: int | None = None  # a mixture of experts: experts each layer keeps cached (None: the plan's)
    expert_reads: str = "auto"  # its expert tensors read by expert ("routed"), "whole" by the window, or as planned
    draft: str | None = None  # a draft model kept resident: token-tree speculation
    draft_max: int | None = None
    draft_p_split: float = 0.3
    spec: str = "tree"  # or "chain"
    pacer: bool = True
    adaptive: bool = True
    adaptive_split: bool = True
    pipeline: bool = False
    tiled_verify: bool = False  # verification passes with the tiled kernels (not bit-exact: an ablation)
    draft_always: bool = False  # speculate even where the target alone is predicted faster
    spec_type: str = "none"  # free drafters (runtime/drafters.py), a comma list; auto: as the cost model says
    rpc: str | None = None  # RPC servers (HOST:PORT,...) the plan places tensors on
    n_gpu_layers: int = 0  # with rpc: the last layers offloaded to the servers' devices, as llama.cpp's -ngl
    placement: str = "auto"  # with rpc and --mem: how weights are placed across the devices (placers)
    n_ubatch: int = 0  # tokens a forward pass computes at once (-ub); 0: n_batch
    flash_attn: str = "auto"  # on, off, auto (-fa)
    cache_type_k: str = "f16"  # the KV cache's types (-ctk, -ctv)
    cache_type_v: str = "f16"
    move_back: bool = True  # after the prompt, the compute buffers' memory goes to weights (False: an ablation)
    precision: str | None = None  # "auto": lower some tensors' types under --mem (plan/mixed.py), by the bound below
    max_kld: float | None = None  # with precision: the fastest plan within this KL divergence (default plan/mixed.py's)
    min_tok_s: float | None = None  # with precision: the least harm reaching this predicted tok/s
    original: str | None = None  # with precision: the model's F16/BF16 weights, quantized from (not requantizing)
    sparsity: str | None = None  # predicted neurons: "auto" (by max_kld) or the groups a token reads (a number)
    tuned: bool = True  # stream by a plan --tune made for this model, budget and machine, where there is one
    chat: bool = False  # a conversation read from stdin (run -cnv; the prompt is its system message, if any)
    verbose: bool = False


@dataclass(frozen=True)
class Generation:
    """What to generate and llama.cpp's context for it (-n, --temp, --seed, -c, -b, -ub, -t, -fa, -ctk, -ctv)."""
    n_predict: int = 128  # -1: until end of text
    temp: float = 0.8  # 0: greedy
    seed: int = -1  # -1: random
    n_ctx: int = 2048
    n_batch: int = 512
    n_ubatch: int = 0  # 0: n_batch (under a budget, chosen for a long prompt)
    n_threads: int = os.cpu_count() or 1
    flash_attn: str = "auto"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    verbose: bool = False


@dataclass(frozen=True)
class Budget:
    """The memory budget and how weights reach memory (--mem, --strategy, --policy, --plan, --window, ...)."""
    mem: str | None = None  # the whole process: 400M, 1.5G, 0.4x (of the model's size)
    strategy: str | None = None  # None: stream with mem or a plan, mmap otherwise
    policy: str = "balanced"
    plan_dir: str | None = None  # stream by a saved plan
    window: int | None = None  # None: the plan's
    io_threads: int | None = None  # None: the plan's
    tuned: bool = True  # stream by a plan --tune made for this model, budget and machine, where there is one
    move_back: bool = True  # after the prompt, the compute buffers' memory goes to weights


@dataclass(frozen=True)
class Draft:
    """A draft model kept resident for token-tree speculation (-md, --draft-max, --draft-p-split, --spec)."""
    model: str
    max: int | None = None  # the tree's node budget (None: from the cost model)
    p_split: float = 0.3
    spec: str = "tree"  # or "chain"
    pacer: bool = True
    adaptive: bool = True
    adaptive_split: bool = True
    pipeline: bool = False
    always: bool = False  # speculate even where the target alone is predicted faster
    spec_type: str = "none"  # free drafters beside it, or alone with model None (run --spec-type; see Request)


@dataclass(frozen=True)
class Placement:
    """RPC servers to place weights on (--rpc, -ngl, --placement); per-device budgets go in Budget.mem."""
    rpc: str | None = None  # HOST:PORT,...
    n_gpu_layers: int = 0
    policy: str = "auto"


@dataclass(frozen=True)
class Precision:
    """Lowered precision under the budget (--precision auto, --max-kld, --min-tok-s, --original), or predicted
    neurons (--sparsity auto or K, by --max-kld)."""
    mode: str | None = "auto"
    max_kld: float | None = None
    min_tok_s: float | None = None
    original: str | None = None
    sparsity: str | None = None


def request(model, prompt: str, generation: Generation = Generation(), budget: Budget = Budget(),
            draft: Draft | None = None, placement: Placement = Placement(),
            precision: Precision | None = None) -> Request:
    """The flat Request the concerns make (model: a path, a catalog name, or a loaded Model)."""
    g, b, p = generation, budget, placement
    d = draft or Draft(model=None)
    q = precision or Precision(mode=None)
    return Request(model=str(getattr(model, "path", model)) if model is not None else None, prompt=prompt,
                   n_predict=g.n_predict, n_ctx=g.n_ctx, n_batch=g.n_batch, n_threads=g.n_threads, temp=g.temp,
                   seed=g.seed, mem=b.mem, strategy=b.strategy, policy=b.policy, plan_dir=b.plan_dir,
                   window=b.window, io_threads=b.io_threads, draft=d.model, draft_max=d.max,
                   draft_p_split=d.p_split, spec=d.spec, pacer=d.pacer, adaptive=d.adaptive,
                   adaptive_split=d.adaptive_split, pipeline=d.pipeline, draft_always=d.always, spec_type=d.spec_type,
                   rpc=p.rpc,
                   n_gpu_layers=p.n_gpu_layers, placement=p.policy, n_ubatch=g.n_ubatch, flash_attn=g.flash_attn,
                   cache_type_k=g.cache_type_k, cache_type_v=g.cache_type_v, move_back=b.move_back,
                   precision=q.mode, max_kld=q.max_kld, min_tok_s=q.min_tok_s, original=q.original,
                   sparsity=q.sparsity, tuned=b.tuned, verbose=g.verbose)


@dataclass
class Prepared:
    """A request ready to load: its model read, its budget in bytes, its plan (None: mmap, or all resident)."""
    request: Request  # with the strategy set and the draft decided (draft None, or draft_always)
    model: object  # model.Model
    limit: int | None
    plan: object | None  # plan.Plan
    draft_model: object | None = None
    draft_bytes: int = 0
    notes: list[str] = field(default_factory=list)  # what the caller should tell the user (stderr)
    decode_ubatch: int = 0  # after the prompt, the context's ubatch (its compute buffers shrink); 0: unchanged
    resident_after_prefill: tuple[str, ...] = ()  # streamed tensors decode keeps resident (plan/prefill.after_prefill)
    decode_tok_s: float = 0.0  # decode's predicted speed with them (0: the plan's)


def _check(r: Request) -> None:
    if r.strategy not in STRATEGIES:
        raise FlexoffloadError(f"unknown strategy {r.strategy!r}: one of {', '.join(STRATEGIES)}")
    if r.n_ctx < 16 or r.n_batch < 1 or r.n_threads < 1 or (r.io_threads is not None and r.io_threads < 1) \
            or (r.window is not None and r.window < 0):
        raise FlexoffloadError("-c must be at least 16, -b, -t and --io-threads at least 1, --window at least 0")
    if r.strategy == "sync" and r.window is not None:
        raise FlexoffloadError("--window does not apply to sync: it reads each tensor when compute needs it")
    if r.strategy == "mmap" and (r.window is not None or r.io_threads is not None or r.plan_dir):
        raise FlexoffloadError("--window, --io-threads and --plan stream weights: not with --strategy mmap")
    if not r.prompt:
        raise FlexoffloadError("no prompt: give one with -p TEXT or -f FILE")
    if r.n_ubatch < 0 or r.n_ubatch > r.n_batch or r.flash_attn not in ("on", "off", "auto"):
        raise FlexoffloadError("-ub must be between 1 and -b, -fa one of on, off, auto")
    from flexoffload.runtime.engine import KV_TYPES

    if r.cache_type_k not in KV_TYPES or r.cache_type_v not in KV_TYPES:
        raise FlexoffloadError(f"-ctk and -ctv must be one of {', '.join(KV_TYPES)}")
    if r.cache_type_v not in ("f16", "f32", "bf16") and r.flash_attn == "off":
        raise FlexoffloadError(f"a {r.cache_type_v} V cache needs flash attention: -fa on or auto")
    if (r.n_ubatch or r.flash_attn != "auto" or _kv_quantized(r)) and r.draft:
        raise FlexoffloadError("-ub, -fa, -ctk and -ctv are for a run without -md, for now")
    if r.chat and r.draft:
        raise FlexoffloadError("-cnv and -md: a conversation runs the model alone, for now")
    if r.spec not in ("tree", "chain"):
        raise FlexoffloadError(f"unknown speculation shape {r.spec!r}: tree or chain")
    free = _free_types(r)  # checks the list
    if free and free != ["auto"] and not r.draft:
        if r.n_ubatch or r.flash_attn != "auto" or _kv_quantized(r) or r.chat or r.rpc:
            raise FlexoffloadError("--spec-type with free drafters: not with -ub, -fa, -ctk, -ctv, -cnv or --rpc, "
                                   "for now")
    if r.rpc:
        from flexoffload.native import devices

        devices.parse_endpoints(r.rpc)
        if r.draft:
            raise FlexoffloadError("--rpc and -md: speculation runs on this machine only, for now")
    if r.n_gpu_layers and not r.rpc:
        raise FlexoffloadError("-ngl offloads layers to RPC servers here (this build has no GPU): add --rpc")
    if r.n_gpu_layers < 0:
        raise FlexoffloadError("-ngl must be at least 0")
    if r.precision not in (None, "auto"):
        raise FlexoffloadError(f"--precision takes auto (the file's own types: leave it out), not {r.precision}")
    if r.precision and (not r.mem or r.plan_dir or r.rpc or r.strategy != "stream"):
        raise FlexoffloadError("--precision auto plans precision with residency under --mem: not with --plan, --rpc "
                               "or another --strategy, for now")
    from flexoffload.plan import mixed
    from flexoffload.plan import levels

    if r.sparsity is not None:
        if levels.parse(r.sparsity) != "auto" and r.max_kld is not None:
            raise FlexoffloadError("--max-kld goes with --sparsity auto (or --precision auto)")
        if r.precision or r.draft or r.rpc or r.plan_dir or r.chat:
            raise FlexoffloadError("--sparsity: not with --precision, -md, --rpc, --plan or -cnv, for now")
        if r.min_tok_s is not None or r.original:
            raise FlexoffloadError("--min-tok-s and --original go with --precision auto")
    else:
        mixed.check_options(r.precision, r.max_kld, r.min_tok_s, r.original)


def _kv_quantized(r: Request) -> bool:
    return (r.cache_type_k, r.cache_type_v) != ("f16", "f16")


FREE_AUTO = ("ngram-simple", "recycle")  # --spec-type auto's free drafters where they pay, without -md
FREE_AUTO_MD = ("ngram-simple",)  # and beside a draft model (its n-grams cost no draft time, no table)
FREE_PAYS = 1.5  # auto without -md: speculate where a target pass takes this many times its compute or more


def recycle_store(model) -> Path:
    """Where Token Recycling's table for this model file outlives a run (about 5 MB: n_vocab x 8 ids)."""
    from flexoffload.runtime import drafters

    return cache_dir() / "recycle" / f"{file_key(model.path)}-k{drafters.RECYCLE_K}.npz"


def _free_types(r: Request) -> list[str]:
    """--spec-type's free drafters (runtime/drafters.py), ["auto"] while undecided, [] for none. `model` names the
    draft model (-md), which is in the tree whenever -md is given."""
    from flexoffload.runtime import drafters

    names = [n.strip() for n in (r.spec_type or "none").split(",") if n.strip()]
    for n in names:
        if n == "layers":  # measured before building: scripts/layers_study, results/layers_draft_qwen1.5b.csv
            raise FlexoffloadError("--spec-type layers is not built: a draft through the layers a plan keeps "
                                   "resident gave the target's greedy token 0-2 % of the time on the 1.5B at "
                                   "0.4x-0.8x (docs/speculation.md)")
        if n not in drafters.SPEC_TYPES + ("none",):
            raise FlexoffloadError(f"unknown --spec-type {n!r}: a list of {', '.join(drafters.SPEC_TYPES)}, or none")
    if ("auto" in names or "none" in names) and len(names) > 1:
        raise FlexoffloadError("--spec-type auto and none stand alone, not in a list")
    if "model" in names and not r.draft:
        raise FlexoffloadError("--spec-type model is the draft model: give it with -md")
    return ["auto"] if names == ["auto"] else [n for n in names if n in drafters.DRAFTERS]


def _free_pays(model, r: Request, limit: int | None) -> bool:
    """--spec-type auto without -md: whether free drafters pay, by a simple rule: where the run streams by a plan
    whose one-token pass takes FREE_PAYS times the target's compute or more (the disk, not compute, sets the pass, so
    a tree costs little more than a token). Not for a mixture of experts (predicted neurons too): each of a tree's
    tokens reads its own experts, so a pass reads more than a token's."""
    if (limit is None or r.strategy != "stream" or r.plan_dir or r.rpc or r.chat or r.n_ubatch
            or r.flash_attn != "auto" or _kv_quantized(r) or model.n_expert):
        return False
    from flexoffload.measure import profiler
    from flexoffload.plan import plans
    from flexoffload.plan.costmodel import compute_seconds

    alone = plan_for_run(model, r, limit)
    if alone is None or alone.policy == tuning.MMAP or not plans.streamed_bytes(alone, model):
        return False
    return 1 / alone.predicted_tok_s > FREE_PAYS * compute_seconds(model, profiler.measure(model, r.n_threads))


def _prepare_free(model, r: Request, limit: int | None, notes: list[str]) -> tuple[Prepared | None, Request]:
    """A run without -md with free drafters (--spec-type): its plan counts the tree's logits rows, its sequences and
    the drafters' tables. (None, the request decided to run alone) where auto finds they do not pay."""
    from flexoffload.runtime import drafters, speculate, spectree

    names = _free_types(r)
    if names == ["auto"]:
        if not _free_pays(model, r, limit):
            return None, replace(r, spec_type="none")
        names = list(FREE_AUTO)
    table = drafters.table_bytes(names, model.n_vocab)
    rows = r.draft_max or (speculate.FREE_NODES_MAX if limit is not None else speculate.FREE_NODES)
    plan = plan_for_run(model, r, limit, max(rows, spectree.MAX_BRANCHES + 1), spectree.MAX_BRANCHES + 1, table)
    return Prepared(replace(r, spec_type=",".join(names)), model, limit, plan, draft_bytes=table, notes=notes), r


def _step_setting(r: Request, n_outputs: int = 1):
    """The context's setting for llama.cpp's dry run (stepmem), where -ub, -fa or the KV types are given; else
    None (the footprint probe's costs at -c/-b apply)."""
    from flexoffload.memory import stepmem

    if not ((r.n_ubatch and r.n_ubatch != r.n_batch) or r.flash_attn != "auto" or _kv_quantized(r)):
        return None
    return stepmem.Setting(r.n_ctx, min(r.n_ubatch or r.n_batch, r.n_ctx), "on" if r.flash_attn == "auto" else
                           r.flash_attn, r.cache_type_k, r.cache_type_v, n_outputs=n_outputs)


def plan_for_run(model, r: Request, limit: int | None, n_outputs: int = 1, n_seq_max: int = 1, draft: int = 0):
    """The plan a run streams by, or None for mmap (and for `stream` with neither budget nor plan: all resident).

    prefetch and sync stream every tensor but the small ones (policy none), with window 3 and 0. draft: the bytes a
    resident draft model takes out of the budget.
    """
    from flexoffload.measure import profiler
    from flexoffload.plan import plans
    from flexoffload.plan.planners import check_budget, plan_budget

    if limit is not None:  # llama.cpp's own report of the context: refuses a model it cannot load, first
        probe.measure(model, r.n_ctx, r.n_batch, n_outputs, n_seq_max)
    if r.strategy == "mmap":
        setting = _step_setting(r, n_outputs)
        if limit is not None and setting is None:
            budgets.check(model, limit - draft, probe.measure(model, r.n_ctx, r.n_batch), r.n_ctx, r.n_batch)
        elif limit is not None:  # -ub, -fa or the KV types set the buffers: the dry run's costs, as for a plan
            from flexoffload.measure import dryrun
            from flexoffload.memory.footprint import KERNEL_FIXED, smallest_budget

            costs = dryrun.run_costs(model, setting, limit)
            need = smallest_budget(sum(costs.values()) + KERNEL_FIXED + budgets.largest_layer(model))
            if limit - draft < need:
                raise FlexoffloadError(f"budget {format_size(limit - draft)} is too small for {model.path.name} at "
                                       f"-c {r.n_ctx} -ub {setting.n_ubatch} (KV {r.cache_type_k}/"
                                       f"{r.cache_type_v}): the minimum is {format_size(need, up=True)}")
        return None
    if r.plan_dir:
        plan = plans.read(r.plan_dir)
        relative = r.mem and budgets.is_relative(r.mem)
        source = Path(plan.precision["source"]) if plan.precision else model.path
        of = f" (--mem {r.mem} of {source.name}, {format_size(source.stat().st_size)})" if relative else ""
        plans.check_fits(plan, model, limit, r.plan_dir, of)
        return plan
    if r.rpc and r.mem and r.strategy == "stream":  # placed across the servers' devices, the host's share too
        from flexoffload.measure import servers
        from flexoffload.native import devices

        return servers.for_endpoints(model, devices.parse_endpoints(r.rpc), r.mem, r.placement,
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
    setting = _step_setting(r, n_outputs)
    if setting is not None:
        # the ubatch, the attention path and the KV types set the buffers: their costs from llama.cpp's dry run
        from flexoffload.measure import dryrun
        from flexoffload.plan.planners import make_plan

        budget = limit if limit is not None else 4 * model.file_size + (1 << 30)
        return make_plan(model, budget, policy, profiler.measure(model, r.n_threads), window=window,
                         io_threads=r.io_threads or IO_THREADS, slots=r.expert_slots,
                         misses=expert_misses(model), whole=expert_whole(r),
                         **dryrun.run_costs(model, setting, budget))
    budget = limit if limit is not None else 4 * model.file_size + (1 << 30)
    run = probe.measure(model, r.n_ctx, r.n_batch, n_outputs, n_seq_max)
    check_budget(model, budget, run, window, draft)  # a budget too small is refused before the profile runs
    return plan_budget(model, budget, policy, profiler.measure(model, r.n_threads), run, window=window,
                       io_threads=r.io_threads or IO_THREADS, draft=draft, slots=r.expert_slots,
                       misses=expert_misses(model), whole=expert_whole(r))


def expert_whole(r: Request) -> bool | None:
    from flexoffload.plan.expertcache import READS

    if r.expert_reads not in READS:
        raise FlexoffloadError(f"unknown expert reads {r.expert_reads!r}: one of {', '.join(READS)}")
    return READS[r.expert_reads]


def expert_misses(model):
    """A mixture of experts' misses by slots (plan.experts.Misses) from its measured routing (`profile --experts`),
    replayed through the runtime's LRU cache; None where none was measured (the planner then assumes uniform
    routing, which random weights do not show: they send nearly every token to the same few experts)."""
    if not model.n_expert:
        return None
    from flexoffload.measure import tracing
    from flexoffload.plan import replay as cache

    trace = tracing.cached(model)
    if trace is None:
        return None
    misses: dict[int, cache.Misses] = {}

    def replayed(slots: int) -> cache.Misses:
        if slots not in misses:
            misses[slots] = cache.Misses.replayed(cache.simulate(trace, slots, "lru"))
        return misses[slots]

    return replayed


LONG_PROMPT = 256  # tokens: a prompt longer than this has its prefill's ubatch chosen (plan/prefill.py)
MMAP_TIE = 0.02  # mmap runs where predicted within this of the plan: the cost model's resolution


def _mmap_instead(model, plan, n_threads: int) -> str:
    """What to tell the user if upstream mmap is predicted as fast as the plan at its budget ('' if not).

    That is where the page cache beside the run's other memory holds what a token touches: mmap is compute-bound
    there, and the plan can only match it. A tie goes to mmap: measured over the matrix (results/matrix.md), every
    run where mmap's cache held a token's bytes was as fast or faster with mmap (a plan streaming a few MiB a token
    lost up to 11 %; one keeping every weight resident, in memory llama.cpp allocates and locks, 0-9 %, as upstream's
    own --mlock loses to mmap). The plan's margin (probe.MARGIN) is for the budget's promise, not this
    prediction: it counts as cache."""
    from flexoffload.measure import profiler
    from flexoffload.memory.footprint import MARGIN
    from flexoffload.plan import costmodel

    m = plan.memory
    page_cache = plan.budget - (m.kv_cache + m.compute + m.overhead + m.code) + int(MARGIN * plan.budget)
    mmap_tok_s = 1 / costmodel.mmap_seconds(model, profiler.measure(model, n_threads), page_cache)
    if mmap_tok_s < plan.predicted_tok_s * (1 - MMAP_TIE):
        return ""
    return (f"flexoffload: the page cache holds what a token reads at this budget: mmap is predicted as fast as "
            f"the plan or faster ({mmap_tok_s:.2f} tok/s, the plan {plan.predicted_tok_s:.2f}): running mmap "
            f"(--strategy stream streams)")


def _check_prompt_length(model, r: Request) -> int:
    """The prompt's tokens; a prompt longer than the context (-c) or the model's trained context is one error,
    before anything loads."""
    from flexoffload.runtime.engine import count_tokens

    n = count_tokens(str(model.path), r.prompt)
    if n >= r.n_ctx:
        raise FlexoffloadError(f"the prompt is {n} tokens, longer than the context of {r.n_ctx}: raise -c")
    if n > model.n_ctx_train:
        raise FlexoffloadError(f"the prompt is {n} tokens, longer than {model.path.name}'s trained context of "
                               f"{model.n_ctx_train} tokens")
    return n


def _draft_bytes(draft_model, r: Request) -> int:
    """What the resident draft model takes out of the target's budget."""
    from flexoffload.plan.planners import resident_bytes
    from flexoffload.runtime import spectree, speculate

    run = probe.measure(draft_model, r.n_ctx, r.n_batch, spectree.MAX_BRANCHES, spectree.MAX_BRANCHES)
    return resident_bytes(draft_model, run, speculate.draft_by_rows(draft_model))


def _tree_outputs(r: Request) -> int:
    """A logits row per tree node (the node budget is memory), and llama.cpp keeps one per sequence."""
    from flexoffload.runtime import spectree

    return max(r.draft_max or spectree.MAX_NODES, spectree.MAX_BRANCHES + 1)


def _plan_model(r: Request) -> tuple[Path, Path] | None:
    """A saved plan of lowered precision runs its own (requantized) file: given -m, that must be its source.
    (the file, its source), or None for any other plan."""
    if not r.plan_dir:
        return None
    from flexoffload.plan import plans

    plan = plans.read(r.plan_dir)
    if not plan.precision:
        return None
    given = catalog.resolve(r.model).resolve() if r.model is not None else None
    if given is not None and given not in (Path(plan.precision["source"]).resolve(), Path(plan.model).resolve()):
        raise FlexoffloadError(f"the plan in {r.plan_dir} was made for {Path(plan.precision['source']).name}, not "
                               f"{catalog.resolve(r.model).name}")
    if not Path(plan.model).is_file():
        raise FlexoffloadError(f"the plan's requantized file is gone ({plan.model}): run plan --precision auto again")
    return Path(plan.model), Path(plan.precision["source"])


def _precision_plan(r: Request, model, limit: int):
    """run --precision auto: the plan measure/precision.py chooses (quality not measured again: plan --precision reports it),
    written to the cache; the request then runs the requantized file by it."""
    from flexoffload.gguf.model import load
    from flexoffload.measure import precision
    from flexoffload.measure import profiler
    from flexoffload.plan import plans
    from flexoffload.runtime import spectree

    run = {}
    if r.draft:  # the target's plan leaves the resident draft its memory, and the tree its rows and sequences
        draft_model = load(catalog.resolve(r.draft))
        run = {"n_outputs": _tree_outputs(r), "n_seq_max": spectree.MAX_BRANCHES + 1,
               "draft": _draft_bytes(draft_model, r)}
    plan, _ = precision.plan(model, limit, profiler.measure(model, r.n_threads), r.n_ctx, r.n_batch, r.max_kld,
                         r.min_tok_s, r.n_threads, r.io_threads, measure_quality=False,
                         original=Path(r.original) if r.original else None, **run)
    directory = cache_dir() / "plans" / Path(plan.model).stem / f"{limit}-{r.n_ctx}-{r.n_batch}-{bool(r.draft)}"
    plans.write(plan, directory)
    return replace(r, model=plan.model, plan_dir=str(directory)), load(plan.model)


def _sparse(r: Request, model, limit: int | None, notes: list[str]):
    """run --sparsity: the file of predicted neuron groups at the level asked for, or chosen (auto: the fewest
    groups within --max-kld, then only where its plan is predicted faster than the dense model's)."""
    from flexoffload.gguf import moefy
    from flexoffload.gguf.model import load
    from flexoffload.measure import sparsity as measured
    from flexoffload.plan import levels

    measured.check(model)
    want = levels.parse(r.sparsity)
    dense = replace(r, sparsity=None, max_kld=None)

    def say(msg: str) -> None:  # a first build or profile takes minutes: say what it is doing
        print(f"flexoffload: {msg}", file=sys.stderr, flush=True)

    s = measured.load_cached(model)  # the grouping profile --neurons made, if it ran
    if want == "auto" and s is None:
        say(f"--sparsity auto: measuring {model.path.name}'s predicted neurons first (profile --neurons; cached, "
            "minutes)")
        s = measured.measure(model, say=say, n_threads=r.n_threads)
    if want == "auto":
        level = levels.choose(s, r.max_kld)
        if level is None:
            notes.append(f"flexoffload: --sparsity auto: no level of {model.path.name}'s predicted neurons is within "
                         f"the KL divergence bound but reading every group: running the dense model")
            return dense, model
        grouped, k, n_group = Path(s.file), level.n_used, s.n_group
        what = f"KL divergence {level.kld:.3f} held out, {level.read_share:.0%} of the weights a token"
    else:
        grouped = Path(s.file) if s and Path(s.file).is_file() else measured.build(
            model, s.n_group if s else measured.GROUPS, s.n_hot if s else None, say=say, n_threads=r.n_threads)[0]
        k, n_group, what = want, moefy.used(grouped), "KL divergence: profile --neurons"
        if k > n_group:
            raise FlexoffloadError(f"--sparsity {k}: {model.path.name} has {n_group} groups a layer")
    path = moefy.with_used(grouped, k)
    sparse = load(path)
    # the budget stays the named model's (0.4x of the dense file): in bytes from here, child runs included
    decided = replace(dense, model=str(path), mem=str(limit) if limit is not None else None)
    if want == "auto" and limit is not None and r.strategy == "stream":
        alone = plan_for_run(model, dense, limit)
        try:
            grouped_plan = plan_for_run(sparse, decided, limit)
        except FlexoffloadError as e:  # the grouped file's larger ffn_down can need more than the budget
            notes.append(f"flexoffload: --sparsity auto: {k} of {n_group} groups a token does not fit ({e}): "
                         f"running the dense model")
            return dense, model
        if alone is not None and grouped_plan is not None \
                and alone.predicted_tok_s >= grouped_plan.predicted_tok_s:
            notes.append(f"flexoffload: --sparsity auto: {k} of {n_group} groups a token is predicted "
                         f"{grouped_plan.predicted_tok_s:.2f} tok/s, the dense model {alone.predicted_tok_s:.2f}: "
                         f"running the dense model")
            return dense, model
    notes.append(f"flexoffload: predicted neurons: {k} of {n_group} groups a token ({what})")
    return decided, sparse


def prepare(request: Request, n_seq_max: int = 1) -> Prepared:
    """Everything before loading: the model, the budget, the plan, and whether the draft pays at this budget.
    n_seq_max: the sequences decoded together (serve's -np): the plan counts a decode batch and a logits row of each.

    Bad input is a FlexoffloadError here, before any cgroup is made or weight is read."""
    from flexoffload.gguf.model import load

    auto = request.strategy is None
    r = replace(request, strategy=request.strategy or ("stream" if request.mem or request.plan_dir else "mmap"))
    _check(r)
    mixed = _plan_model(r)
    path = mixed[0] if mixed else catalog.resolve(r.model)
    r.model = str(path)
    model = load(path)
    n_prompt = _check_prompt_length(model, r)
    # a relative budget (0.4x) is of the model the user named: a precision plan's source, not the file it runs
    named = load(mixed[1]) if mixed else model
    if r.rpc and r.mem and "=" in r.mem:  # per device: this machine's budget is cpu=
        from flexoffload.native import devices
        from flexoffload.plan import placers

        limit = placers.parse_mem(r.mem, devices.parse_endpoints(r.rpc), named)[0]
    else:
        limit = budgets.parse_size(r.mem, named.file_size) if r.mem else None
    if r.precision:  # the mixed file and its plan, saved like plan -o writes them; the run streams by them
        r, model = _precision_plan(r, model, limit)
        # decided: the plan is the request now, and a child run must not plan precision again
        r = replace(r, precision=None, max_kld=None, min_tok_s=None, original=None)
    notes = []
    if r.sparsity is not None:  # decided here: the request then runs the grouped file (or the dense one)
        r, model = _sparse(r, model, limit, notes)
    if r.rpc:  # llama.cpp aborts on a server it cannot reach: each is asked first, for a one-line error
        from flexoffload.native import devices

        for endpoint in devices.parse_endpoints(r.rpc):
            devices.probe_rpc(endpoint)
    if not r.draft and n_seq_max == 1 and _free_types(r):  # free drafters, or auto deciding on them
        prepared, r = _prepare_free(model, r, limit, notes)  # (a tree's prompt is read at -b, as -md's)
        if prepared is not None:
            return prepared
    if (limit is not None and r.strategy == "stream" and not r.n_ubatch and not r.plan_dir and not r.rpc
            and not r.draft and r.flash_attn == "auto" and n_prompt > LONG_PROMPT):
        # a long prompt: the ubatch that makes the whole run fastest under the budget (plan/prefill.py)
        from flexoffload.measure import ubatches
        from flexoffload.measure import profiler

        u, _, first = ubatches.choose(model, limit, n_prompt, r.n_predict, r.n_ctx, r.policy,
                                     profiler.measure(model, r.n_threads), r.n_threads, r.io_threads or IO_THREADS,
                                     type_k=r.cache_type_k, type_v=r.cache_type_v)
        r = replace(r, n_ubatch=u, n_batch=max(r.n_batch, u), flash_attn="on")
        notes.append(f"flexoffload: a prompt of {n_prompt} tokens: prefill in ubatches of {u} (-ub), time to first "
                     f"token predicted {first:.1f} s")
    if not r.draft:
        plan = plan_for_run(model, r, limit, n_seq_max, n_seq_max)
        if plan is not None and plan.policy == tuning.MMAP:  # plan --tune measured mmap faster at this budget
            return Prepared(replace(r, strategy="mmap", plan_dir=None), model, limit, None,
                            notes=notes + [tuning.mmap_note(plan)])
        if plan is not None and plan.placed and not r.rpc:
            raise FlexoffloadError(f"the plan in {r.plan_dir} places tensors on "
                                   f"{', '.join(dict.fromkeys(b for _, b in plan.placed))}: give their servers "
                                   f"with --rpc")
        if auto and plan is not None and not plan.tuning and not r.plan_dir and not r.rpc \
                and r.policy == "balanced" and r.window is None:
            note = _mmap_instead(model, plan, r.n_threads)
            if note:
                return Prepared(replace(r, strategy="mmap"), model, limit, None, notes=notes + [note])
        prepared = Prepared(r, model, limit, plan, notes=notes)
        setting = _step_setting(r)
        if setting is not None and not r.rpc and r.move_back:
            # decode after the prompt: the compute buffers shrink, and what they give back holds weights
            from flexoffload.measure import profiler
            from flexoffload.measure import dryrun
            from flexoffload.plan import prefill

            prepared.decode_ubatch = prefill.DECODE_UBATCH
            if plan is not None and limit is not None and r.strategy == "stream" and not r.plan_dir:
                prepared.resident_after_prefill, prepared.decode_tok_s = prefill.after_prefill(
                    model, plan, dryrun.room(model, setting), profiler.measure(model, r.n_threads))
        return prepared

    from flexoffload.runtime import spectree

    if r.draft_max is not None and not 2 <= r.draft_max <= spectree.MAX_NODES:
        raise FlexoffloadError(f"--draft-max must be between 2 and {spectree.MAX_NODES}")
    if not 0 < r.draft_p_split <= 1:
        raise FlexoffloadError("--draft-p-split must be in (0, 1]")
    draft_model = load(catalog.resolve(r.draft))
    r.draft = str(draft_model.path)
    from flexoffload.runtime import drafters

    free = _free_types(r)
    r = replace(r, spec_type=",".join(["model"] + (list(FREE_AUTO_MD) if free == ["auto"] else free)))
    # the free drafters' tables come out of the budget with the draft
    draft_bytes = _draft_bytes(draft_model, r) + drafters.table_bytes(free, model.n_vocab)
    n_outputs = _tree_outputs(r)
    n_seq_max = spectree.MAX_BRANCHES + 1  # as speculate.target_settings
    plan = plan_for_run(model, r, limit, n_outputs, n_seq_max, draft_bytes)
    prepared = Prepared(r, model, limit, plan, draft_model, draft_bytes)
    if plan and limit is not None and not r.plan_dir and not r.draft_always:
        # the draft's memory makes the target stream more: speculate only where that is predicted to pay
        from flexoffload.measure import profiler
        from flexoffload.plan.costmodel import compute_seconds

        alone = plan_for_run(model, r, limit)
        draft_token_s = compute_seconds(draft_model, profiler.measure(draft_model, r.n_threads))
        target_token_s = compute_seconds(model, profiler.measure(model, r.n_threads))
        with_draft = spectree.predicted_tok_s(1 / plan.predicted_tok_s, draft_token_s, target_token_s)
        if alone.predicted_tok_s > with_draft:
            prepared.notes.append(f"flexoffload: the target alone is predicted faster at this budget "
                                  f"({alone.predicted_tok_s:.2f} tok/s, with the draft {with_draft:.2f}): running "
                                  f"without -md (--draft-always speculates anyway)")
            if free == ["auto"]:  # without the draft, the free drafters may still pay
                freed, _ = _prepare_free(model, replace(r, draft=None, spec_type="auto"), limit, prepared.notes)
                if freed is not None:
                    return freed
            return Prepared(replace(r, draft=None, spec_type="none"), model, limit, alone, notes=prepared.notes)
    prepared.request = replace(r, draft_always=True)  # decided: a child run must not decide again
    return prepared


def load(model=None):
    """The model's tensor table (gguf.model.Model), read without loading weights: a GGUF path or a catalog name
    (None: the default model)."""
    from flexoffload.gguf.model import load as read

    return read(catalog.resolve(model))


def plan(model, budget: Budget, generation: Generation = Generation(), draft: Draft | None = None,
         placement: Placement = Placement(), precision: Precision | None = None, prompt: str = " "):
    """The plan a run of model would stream by under the budget (plan.plan.Plan; None where it would not stream:
    mmap, or everything resident), decided as generate decides it. Save it with plan.write(DIRECTORY) and give it
    back to generate (plan=) or to `flexoffload run --plan DIRECTORY`."""
    return prepare(request(model, prompt, generation, budget, draft, placement, precision)).plan


def generate(model, prompt: str | None = None, generation: Generation = Generation(), budget: Budget = Budget(),
             draft: Draft | None = None, placement: Placement = Placement(), precision: Precision | None = None,
             plan=None, on_text=None, enforce: bool = False, echo=None, timeout: float | None = None,
             cgroup_limit: int | None = None) -> dict:
    """Generate from prompt with model under the budget; the result as a dict (text, tokens, decode_tok_s,
    ttft_s, peak_mem_mb, the plan's prediction, ...). plan: a Plan to stream by (api.plan's, or plan.read's).
    enforce: in a child process held to the budget by a memory cgroup (where none can be made, echo says so and
    the run goes unenforced); cgroup_limit: the cgroup's limit instead of the budget. on_text: called with each
    piece of text as it comes. echo: called with each line to tell the user (stderr).
    generate(Request, ...) is the older form: one flat Request."""
    if isinstance(model, Request):
        return _generate(model, on_text, enforce, echo, timeout, cgroup_limit)
    if plan is None:
        r = request(model, prompt or "", generation, budget, draft, placement, precision)
        return _generate(r, on_text, enforce, echo, timeout, cgroup_limit)
    with tempfile.TemporaryDirectory(prefix="flexoffload-plan-") as directory:  # a run streams by a plan's files
        plan.write(directory)
        budget = replace(budget, plan_dir=directory)
        r = request(model, prompt or "", generation, budget, draft, placement, precision)
        return _generate(r, on_text, enforce, echo, timeout, cgroup_limit)


def engine_settings(p: Prepared):
    """The runtime's settings for a prepared request (engine.Settings): what `run` loads by, and what `serve` hands
    llama-server as flags."""
    from flexoffload.native import devices
    from flexoffload.plan import plans
    from flexoffload.runtime import engine

    r, plan = p.request, p.plan
    pairs = plans.overrides(plan) if plan else []  # tensors.ot's lines: (pattern, buffer type)
    return engine.Settings(
        n_ctx=r.n_ctx, n_batch=r.n_batch, n_threads=r.n_threads, temp=r.temp, seed=r.seed & 0xFFFFFFFF,
        strategy=r.strategy,
        streamed_patterns=tuple(p for p, b in pairs if b == plans.STREAMED_BUFT),
        placed_patterns=tuple((p, b) for p, b in pairs if b != plans.STREAMED_BUFT),
        rpc=tuple(devices.parse_endpoints(r.rpc)) if r.rpc else (),
        n_ubatch=r.n_ubatch, flash_attn=r.flash_attn, type_k=r.cache_type_k, type_v=r.cache_type_v,
        decode_ubatch=p.decode_ubatch,
        resident_after_prefill=p.resident_after_prefill,
        n_gpu_layers=plan.placement["n_gpu_layers"] if plan and plan.placement else r.n_gpu_layers,
        tensor_split=tuple(plan.placement["tensor_split"]) if plan and plan.placement else (),
        window=(r.window if r.window is not None else plan.window) if plan else 0,
        expert_slots=plan.experts["slots"] if plan and plan.experts else -1,
        expert_whole=bool(plan and plan.experts and plan.experts.get("whole")),
        io_threads=r.io_threads or (plan.io_threads if plan else IO_THREADS), verbose=r.verbose)


def run_prepared(p: Prepared, on_text=None, read_line=None, note=None) -> dict:
    """Load and generate in this process; the result as a dict (engine.Result's fields and the run's context).
    A conversation (request.chat) reads its messages with read_line() and says what is not a reply with note(line)."""
    from flexoffload.plan import plans
    from flexoffload.runtime import engine

    r, model, plan = p.request, p.model, p.plan
    settings = engine_settings(p)
    if r.chat:
        from flexoffload.runtime import chat

        with engine.Engine(r.model, settings) as eng:
            result = chat.converse(eng, r.prompt.strip() or None, r.n_predict, read_line or _read_message, on_text,
                                   note or (lambda line: print(line, file=sys.stderr)))
    elif p.draft_model is not None or _free_types(r) not in ([], ["auto"]):
        from flexoffload.runtime import spectree, speculate

        node_s, hidden_nodes = 0.0, 0
        if plan is not None:  # what a node adds to a pass: the cost model's share of a token's compute
            from flexoffload.measure import profiler
            from flexoffload.plan.costmodel import compute_seconds

            node_s, hidden_nodes = spectree.node_costs(1 / plan.predicted_tok_s if plan.predicted_tok_s else 0,
                                                       compute_seconds(model, profiler.measure(model, r.n_threads)))
        spec = spectree.Options(tree=r.spec == "tree", pacer=r.pacer, adaptive=r.adaptive,
                                 adaptive_split=r.adaptive_split, pipeline=r.pipeline, tiled=r.tiled_verify,
                                 threshold=r.draft_p_split, max_nodes=r.draft_max, node_s=node_s,
                                 hidden_nodes=hidden_nodes)
        free = tuple(_free_types(r))
        store = recycle_store(model) if "recycle" in free else None
        result = speculate.run(r.model, settings, r.draft, spec, r.prompt, r.n_predict, on_text, free,
                               store).to_dict()
        if r.draft:
            result["draft"] = {"path": r.draft, "resident_mb": p.draft_bytes / MiB}
        result["spec"] = {"types": r.spec_type.split(","), "node_s": node_s, "hidden_nodes": hidden_nodes,
                          "table_mb": result["timings"].get("free_table_bytes", 0) / MiB}
    else:
        with engine.Engine(r.model, settings) as eng:
            result = eng.generate(r.prompt, r.n_predict, on_text).to_dict()
    timings = result.get("timings", {})
    from flexoffload.measure import profiler

    if "stream_read_gb_s" in timings:
        typical = not r.draft and "n_verify" not in timings and settings.window > 0  # a tree's passes are not
        profiler.record_run(r.model, timings, typical=typical)
    result.update(peak_mem_mb=budgets.peak_rss() / MiB, peak_source="rss", enforced=False,
                  budget_mb=p.limit / MiB if p.limit else None,
                  model={"path": r.model, "size": model.file_size, "name": model.name})
    if plan:
        result["plan"] = {"policy": plan.policy, "window": settings.window, "io_threads": settings.io_threads,
                          "memory_mb": plan.memory.total / MiB, "unreclaimable_mb": plan.memory.unreclaimable / MiB,
                          "resident_mb": plan.memory.resident / MiB,
                          "streamed_mb": plans.streamed_bytes(plan, model) / MiB,
                          "predicted_tok_s": plan.predicted_tok_s, "roofline_tok_s": plan.roofline_tok_s}
        if plan.precision:  # the model run is the plan's requantized file (result["model"])
            result["plan"]["precision"] = {k: plan.precision[k] for k in ("source", "types", "predicted_kld")}
        if p.resident_after_prefill:
            sizes = {t.name: t.n_bytes for t in model.tensors}
            result["plan"]["after_prefill"] = {
                "resident_mb": sum(sizes[n] for n in p.resident_after_prefill) / MiB,
                "tensors": len(p.resident_after_prefill), "predicted_tok_s": p.decode_tok_s}
    return result


def _read_message() -> str:
    """A conversation's next message from stdin (a prompt mark where a person types it)."""
    if sys.stdin.isatty():
        return input("> ")
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


def run_in_cgroup(p: Prepared, limit: int | None, stream_text: bool = False, timeout: float | None = None) -> dict:
    """Run the prepared request in a fresh process in its own memory cgroup of limit bytes (the budget, or more to
    measure with room to spare; None: no cgroup); its result with the cgroup's peak, faults and the peak of
    unreclaimable memory.
    stream_text: the child writes the text to this process's stdout as it comes."""
    with tempfile.TemporaryDirectory(prefix="flexoffload-") as tmp:
        request_file, result_file = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_file.write_text(json.dumps(asdict(p.request)))
        cmd = [sys.executable, "-m", "flexoffload.api", str(request_file), str(result_file)]
        cmd += ["--stream-text"] if stream_text else []
        # a conversation's child reads this terminal; a Ctrl-C is its (it stops a reply), not this process's
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if p.request.chat else None
        try:
            run = budgets.run_limited(cmd, limit, timeout, capture_stdout=not stream_text, interactive=p.request.chat)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if run.returncode != 0 or not result_file.exists():
            if run.oom_killed:
                raise FlexoffloadError(
                    f"out of memory: the kernel stopped the run at the enforced budget of {format_size(limit)}")
            if p.request.rpc:
                # llama.cpp's RPC client aborts when a server stops answering (RPC_STATUS_ASSERT)
                from flexoffload.native import devices

                raise FlexoffloadError(devices.failure(devices.parse_endpoints(p.request.rpc), "the run went on",
                                                       run.stderr, run.returncode))
            last = [line for line in run.stderr.strip().splitlines() if line.strip()][-1:] or [f"exit {run.returncode}"]
            where = " under the cgroup" if limit is not None else ""
            raise FlexoffloadError(f"the run failed{where}: {last[0].removeprefix('flexoffload: ')}")
        result = json.loads(result_file.read_text())
    if limit is None:  # a child only for its own sake (RPC): its peak is its RSS, as in process
        result["wall_s"] = run.wall_s
        return result
    result.update(peak_rss_mb=result["peak_mem_mb"], peak_mem_mb=run.peak_mem_mb, peak_source="cgroup",
                  enforced=True, faults=run.faults, peak_unreclaimable_mb=run.unreclaimable_mb, wall_s=run.wall_s)
    return result


def _generate(request: Request, on_text=None, enforce: bool = False, echo=None, timeout: float | None = None,
              cgroup_limit: int | None = None) -> dict:
    """Prepare and run a request (generate's arguments; enforced, the child writes the text to stdout if on_text
    is given)."""
    p = prepare(request)
    for note in p.notes:
        if echo:
            echo(note)
    if not enforce and p.request.rpc:  # in a child: llama.cpp aborts the process when an RPC server fails
        return run_in_cgroup(p, None, stream_text=on_text is not None, timeout=timeout)
    if not enforce or not _enforceable(p, echo):
        return run_prepared(p, on_text)
    result = run_in_cgroup(p, cgroup_limit or p.limit, stream_text=on_text is not None, timeout=timeout)
    result["budget_mb"] = p.limit / MiB
    return result


def _enforceable(p: Prepared, echo=None) -> bool:
    """--enforce: whether a memory cgroup can hold the run at its budget (a run without a budget is refused; where no
    cgroup can be made, echo says so and the run goes unenforced)."""
    if p.limit is None:
        raise FlexoffloadError("--enforce needs a budget: add --mem SIZE")
    unavailable = budgets.cgroup_unavailable()
    if unavailable and echo:
        echo(f"flexoffload: {unavailable}; running without an enforced budget")
    return not unavailable


def serve(request: Request, n_parallel: int, listen, enforce: bool = False, extra: tuple[str, ...] = (), echo=None,
          on_ready=None):
    """`flexoffload serve`: llama-server for n_parallel sequences, prepared and planned as `run` is (the plan for that
    many sequences, the same settings, cgroup and page-cache handling), behind the front (runtime/server.py:
    listen is its Listen), until SIGINT or SIGTERM. on_ready(port, load_s, prepared, enforced) once it answers;
    returns server.Served."""
    from flexoffload.runtime import server

    p = prepare(replace(request, prompt=request.prompt or " "), n_seq_max=n_parallel)  # a server has no prompt
    for note in p.notes:
        if echo:
            echo(note)
    limit = p.limit if enforce and _enforceable(p, echo) else None
    ready = (lambda port, load_s: on_ready(port, load_s, p, limit is not None)) if on_ready else None
    return server.serve(p.request.model, engine_settings(p), n_parallel, listen, limit, p.limit, extra, echo, ready)


def tune(model, budget: int, profile, n_ctx: int = 2048, n_batch: int = 512, n_best: int = 3, rounds: int = 2,
         n_predict: int = 8, echo=None):
    """plan --tune (measure/tuning.py): the candidate plans each run cold under the enforced budget, in turn."""

    def timed(how: dict) -> float:
        request = Request(model=str(model.path), prompt=tuning.PROMPT, n_predict=n_predict, n_ctx=n_ctx,
                          n_batch=n_batch, temp=0, mem=str(budget), **how)
        prepared = prepare(request)
        budgets.drop_page_cache()
        return run_in_cgroup(prepared, budget, timeout=900)["decode_tok_s"]

    return tuning.tune(model, budget, profile, probe.measure(model, n_ctx, n_batch), timed, n_ctx, n_batch,
                     n_best, rounds, echo)


def experts(model, slots: list[int] | None = None, text: str | None = None, n_threads: int | None = None,
            batch: int = 512, remeasure: bool = False) -> dict:
    """profile --experts: the experts a text routes to (measure/tracing.py; None: the HumanEval tuning problems;
    measured once, cached) replayed through an expert cache of each slot count and policy (plan/replay.py)."""
    from flexoffload.measure import tracing
    from flexoffload.measure import profiler
    from flexoffload.plan import replay as cache
    from flexoffload.plan.costmodel import compute_seconds

    n_threads = n_threads or os.cpu_count() or 1
    trace = tracing.trace(model, text, n_threads, remeasure=remeasure)
    cache.check(model, trace)
    profile = profiler.measure(model, n_threads)
    slots = cache.default_slots(model) if slots is None else slots
    return {"model": str(model.path), "name": model.name, "source": trace.source, "tokens": trace.n_tokens,
            "n_layer": model.n_layer, "n_expert": model.n_expert, "n_used": model.n_expert_used,
            "unit_bytes": cache.unit_bytes(model), "disk_bw": profile.disk_bw,
            "resident_tok_s": 1.0 / compute_seconds(model, profile),
            "rows": cache.table(model, trace, slots, profile, batch)}


def main() -> None:
    """The child of an enforced run (or an RPC one): `python -m flexoffload.api REQUEST.json RESULT.json
    [--stream-text]`. It runs here, in this process: the parent made the child to hold it."""
    request_file, result_file, *flags = sys.argv[1:]
    request = Request(**json.loads(Path(request_file).read_text()))
    if request.rpc:
        from flexoffload import native

        native.spin_briefly()
    on_text = (lambda s: (sys.stdout.write(s), sys.stdout.flush())) if "--stream-text" in flags else None
    if request.chat:  # the parent waits with Ctrl-C ignored, which the child inherits: here it stops a reply
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = run_prepared(prepare(request), on_text)
    except FlexoffloadError as e:
        print(f"flexoffload: {e}", file=sys.stderr)
        sys.exit(1)
    Path(result_file).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

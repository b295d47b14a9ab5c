"""prepare: everything before loading, as a short sequence of named steps that returns a Prepared.

    check -> model -> budget -> precision -> sparsity -> servers -> drafting -> prefill -> plan -> settings

The request stays as the user gave it (`Prepared.request`); each step reads the values decided so far from a private
working copy and what was decided travels as the Prepared: the file run, the budget in bytes, the plan, the engine's
settings, the drafting, the notes for the user. An enforced run's child receives the Prepared as JSON (to_json)
and runs it without preparing again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from flexoffload import FlexoffloadError, rules
from flexoffload.defaults import IO_THREADS, cache_dir, content_key, file_key
from flexoffload.gguf import catalog, moefy
from flexoffload.gguf.model import Model, load
from flexoffload.measure import precision, profiler, sparsity, tuning, ubatches
from flexoffload.memory import budgets
from flexoffload.native import devices
from flexoffload.plan import levels, placers, plans, prefill
from flexoffload.runtime import engine
from flexoffload.speculation import tree as spectree
from flexoffload.runtime.engine import count_tokens
from flexoffload.api import drafting
from flexoffload.api.prepared import DECISION_FILE, Prepared
from flexoffload.api.planning import mmap_instead, plan_for_run, step_setting

LONG_PROMPT = 256  # tokens: a prompt longer than this has its prefill's ubatch chosen (plan/prefill.py)

log = logging.getLogger(__name__)


# --- the steps ---------------------------------------------------------------------------------------------------

def _model(w) -> tuple[Model, Model]:
    """The file run and the file the user named (a saved precision plan runs its requantized file; given -m, that
    must be its source)."""
    if w.plan_dir:
        plan = plans.read(w.plan_dir)
        if plan.precision is not None:
            source = Path(plan.precision.source)
            given = catalog.resolve(w.model).resolve() if w.model is not None else None
            if given is not None and given not in (source.resolve(), Path(plan.model).resolve()):
                raise FlexoffloadError(f"the plan in {w.plan_dir} was made for {source.name}, not "
                                       f"{catalog.resolve(w.model).name}")
            if not Path(plan.model).is_file():
                raise FlexoffloadError(f"the plan's requantized file is gone ({plan.model}): run plan --precision "
                                       f"auto again")
            return load(plan.model), load(source)
    model = load(catalog.resolve(w.model))
    return model, model


def _prompt_tokens(model, w) -> int:
    """The prompt's tokens; a prompt longer than the context (-c) or the model's trained context is one error,
    before anything loads."""
    n = count_tokens(str(model.path), w.prompt)
    if n >= w.n_ctx:
        raise FlexoffloadError(f"the prompt is {n} tokens, longer than the context of {w.n_ctx}: raise -c")
    if n > model.n_ctx_train:
        raise FlexoffloadError(f"the prompt is {n} tokens, longer than {model.path.name}'s trained context of "
                               f"{model.n_ctx_train} tokens")
    return n


def _budget(w, named) -> int | None:
    """The budget in bytes: a relative one (0.4x) is of the model the user named; with --rpc per device, this
    machine's share (cpu=)."""
    if w.rpc and w.mem and "=" in w.mem:
        return placers.parse_mem(w.mem, devices.parse_endpoints(w.rpc), named)[0]
    return budgets.parse_size(w.mem, named.file_size) if w.mem else None


def _precision(w, model, limit: int):
    """run --precision auto: the plan measure/precision.py chooses (quality not measured again: plan --precision
    reports it), saved in the cache as plan -o writes it; the run then streams the requantized file by it."""
    run = {}
    if w.draft:  # the target's plan leaves the resident draft its memory, and the tree its rows and sequences
        run = {"n_outputs": drafting.tree_outputs(w), "n_seq_max": spectree.MAX_BRANCHES + 1,
               "draft": drafting.draft_bytes(load(catalog.resolve(w.draft)), w)}
    # decided once for these inputs and kept: the walk plans every step's residency (tens of seconds on the 1.5B),
    # which a run at the same budget and bound would only repeat
    inputs = (file_key(model.path), limit, w.n_ctx, w.n_batch, w.max_kld, w.min_tok_s, w.original, w.n_threads,
              w.io_threads, sorted(run.items()), profiler.as_measured(model, w.n_threads).to_dict())
    directory = cache_dir() / "plans" / model.path.stem / content_key(json.dumps(inputs, sort_keys=True, default=str))
    if (directory / plans.PLAN_FILE).is_file():
        plan = plans.read(directory)
        if Path(plan.model).is_file():
            log.info("--precision auto: the plan decided before for this budget and bound (%s)", directory)
            return replace(w, model=plan.model, plan_dir=str(directory), precision=None), load(plan.model)
    plan, _ = precision.plan(model, limit, profiler.measure(model, w.n_threads), w.n_ctx, w.n_batch, w.max_kld,
                             w.min_tok_s, w.n_threads, w.io_threads, measure_quality=False,
                             original=Path(w.original) if w.original else None, **run)
    plans.write(plan, directory)
    return replace(w, model=plan.model, plan_dir=str(directory), precision=None), load(plan.model)


def _sparsity(w, model, limit: int | None, notes: list[str]):
    """run --sparsity: the file of predicted neuron groups at the level asked for, or chosen (auto: the fewest
    groups within --max-kld, then only where its plan is predicted faster than the dense model's)."""
    sparsity.check(model)
    want = levels.parse(w.sparsity)
    dense = replace(w, sparsity=None, max_kld=None)
    say = log.info  # a first build takes minutes: said as it goes
    s = sparsity.load_cached(model)  # the grouping profile --neurons made, if it ran
    if want == "auto" and s is None:
        say(f"--sparsity auto: measuring {model.path.name}'s predicted neurons first (profile --neurons; cached, "
            "minutes)")
        s = sparsity.measure(model, say=say, n_threads=w.n_threads)
    if want == "auto":
        level = levels.choose(s, w.max_kld)
        if level is None:
            notes.append(f"flexoffload: --sparsity auto: no level of {model.path.name}'s predicted neurons is within "
                         f"the KL divergence bound but reading every group: running the dense model")
            return dense, model
        grouped, k, n_group = Path(s.file), level.n_used, s.n_group
        what = f"KL divergence {level.kld:.3f} held out, {level.read_share:.0%} of the weights a token"
    else:
        grouped = Path(s.file) if s and Path(s.file).is_file() else sparsity.build(
            model, s.n_group if s else sparsity.GROUPS, s.n_hot if s else None, say=say, n_threads=w.n_threads)[0]
        k, n_group, what = want, moefy.used(grouped), "KL divergence: profile --neurons"
        if k > n_group:
            raise FlexoffloadError(f"--sparsity {k}: {model.path.name} has {n_group} groups a layer")
    sparse = load(moefy.with_used(grouped, k))
    decided = replace(dense, model=str(sparse.path))
    if want == "auto" and limit is not None and w.strategy == "stream":
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


def _saved_decision(w):
    """`run --plan D`: the drafting and ubatch `plan -o D` decided with it (run.json), where the user gave none."""
    path = Path(w.plan_dir) / DECISION_FILE
    if not path.is_file():
        return w, None
    d = json.loads(path.read_text())
    if not w.n_ubatch and d.get("n_ubatch") and d["n_ubatch"] != d.get("n_batch"):
        w = replace(w, n_ubatch=d["n_ubatch"], n_batch=max(w.n_batch, d["n_batch"]), flash_attn=d["flash_attn"])
    if w.draft and not d.get("draft"):  # the plan was made for the target alone: its memory has no room for -md
        w = replace(w, draft=None)
    if rules.spec_types(w.spec_type, w.draft) == ["auto"]:
        w = replace(w, spec_type=",".join(["model"] * bool(w.draft) + d.get("free", [])) or "none")
    return w, d


def _long_prompt(w, model, limit, n_prompt: int, notes: list[str]):
    """A long prompt under a budget: the ubatch that makes the whole run fastest (plan/prefill.py)."""
    if not (limit is not None and w.strategy == "stream" and not w.n_ubatch and not w.plan_dir and not w.rpc
            and w.flash_attn == "auto" and n_prompt > LONG_PROMPT):
        return w
    u, _, first = ubatches.choose(model, limit, n_prompt, w.n_predict, w.n_ctx, w.policy,
                                  profiler.measure(model, w.n_threads), w.n_threads, w.io_threads or IO_THREADS,
                                  type_k=w.cache_type_k, type_v=w.cache_type_v)
    notes.append(f"flexoffload: a prompt of {n_prompt} tokens: prefill in ubatches of {u} (-ub), time to first "
                 f"token predicted {first:.1f} s")
    return replace(w, n_ubatch=u, n_batch=max(w.n_batch, u), flash_attn="on")


def _tree_prompt(w, model, limit, n_prompt: int, notes: list[str]):
    """A speculating run's long prompt read in the ubatches the target alone would read it in, where the tree's plan
    has room for them (at most -b, the ubatch its compute buffers were sized for). A pass's rows decide its kernels
    (the tiled ones from 8 rows of a weight, or of one expert in a MoE), so the prompt's cache, and a near tie after
    it, round by its ubatches: read alike, the tree's greedy text is the alone run's."""
    alone = _long_prompt(w, model, limit, n_prompt, [])
    if alone is w or alone.n_ubatch > w.n_batch:
        return w
    notes.append(f"flexoffload: a prompt of {n_prompt} tokens: prefill in ubatches of {alone.n_ubatch} (-ub), as "
                 "the target alone would")
    return replace(w, n_ubatch=alone.n_ubatch, flash_attn=alone.flash_attn)


def settings_for(w, plan, limit: int | None, model, tree: bool) -> tuple[engine.Settings, float]:
    """The runtime's settings for the decided values and plan: what `run` loads by and `serve` hands llama-server
    as flags; and decode's predicted speed where weights move in after the prompt (0: the plan's)."""
    pairs = plans.overrides(plan) if plan else []  # tensors.ot's lines: (pattern, buffer type)
    after, decode_tok_s, decode_ubatch = (), 0.0, 0
    setting = step_setting(w)
    if setting is not None and not w.rpc and w.move_back and not tree:
        # decode after the prompt: the compute buffers shrink, and what they give back holds weights
        from flexoffload.measure import dryrun

        decode_ubatch = prefill.DECODE_UBATCH
        if plan is not None and limit is not None and w.strategy == "stream" and not w.plan_dir:
            after, decode_tok_s = prefill.after_prefill(model, plan, dryrun.room(model, setting),
                                                        profiler.measure(model, w.n_threads))
    settings = engine.Settings(
        n_ctx=w.n_ctx, n_batch=w.n_batch, n_threads=w.n_threads, temp=w.temp, seed=w.seed & 0xFFFFFFFF,
        strategy=w.strategy,
        streamed_patterns=tuple(p for p, b in pairs if b == plans.STREAMED_BUFT),
        placed_patterns=tuple((p, b) for p, b in pairs if b != plans.STREAMED_BUFT),
        rpc=tuple(devices.parse_endpoints(w.rpc)) if w.rpc else (),
        n_ubatch=w.n_ubatch, flash_attn=w.flash_attn, type_k=w.cache_type_k, type_v=w.cache_type_v,
        decode_ubatch=decode_ubatch, resident_after_prefill=tuple(after),
        n_gpu_layers=plan.placement.n_gpu_layers if plan and plan.placement else w.n_gpu_layers,
        tensor_split=plan.placement.tensor_split if plan and plan.placement else (),
        window=(w.window if w.window is not None else plan.window) if plan else 0,
        expert_slots=plan.experts.slots if plan and plan.experts else -1,
        expert_policy=plan.experts.policy if plan and plan.experts else "lru",
        expert_whole=bool(plan and plan.experts and plan.experts.whole),
        expert_ahead=bool(plan and plan.experts and plan.experts.ahead),
        expert_lookahead=bool(plan and plan.experts and plan.experts.lookahead),
        io_threads=w.io_threads or (plan.io_threads if plan else IO_THREADS), verbose=w.verbose)
    return settings, decode_tok_s


def _lookahead_blind(model, plan) -> list[str]:
    """Lookahead predicts the next layer's experts through that layer's router in memory (patch 0029): a plan that
    streams routers (one given by --plan, edited) leaves those layers unpredicted, which the runtime does silently."""
    streamed = set(plan.streamed)
    routers = [t for t in model.tensors if t.kind == "router" and t.name in streamed]
    if not routers:
        return []
    return [f"flexoffload: lookahead: the plan streams {len(routers)} of the routers ({routers[0].name}, ...), and a "
            "streamed router is not predicted through: those layers' experts are read only once chosen (keep the "
            "routers resident, or --expert-lookahead off)"]


def prepare(request, n_seq_max: int = 1, server: bool = False) -> Prepared:
    """Everything before loading: the model, the budget, the plan, and whether drafting pays at this budget.
    n_seq_max: the sequences decoded together (serve's -np): the plan counts a decode batch and a logits row of each.
    server: serve's (llama-server speculates its own way, drafting.for_server).

    Bad input is a FlexoffloadError here, before any cgroup is made or weight is read."""
    rules.check(request)
    auto = request.strategy is None
    w = replace(request, strategy=request.strategy or ("stream" if request.mem or request.plan_dir else "mmap"))
    model, named = _model(w)
    w = replace(w, model=str(model.path))
    n_prompt = _prompt_tokens(model, w)
    limit = _budget(w, named)
    notes: list[str] = []
    if w.precision:  # the mixed file and its plan, saved as plan -o writes them; the run streams by them
        w, model = _precision(w, model, limit)
    if w.sparsity is not None:  # the grouped file (or the dense one)
        w, model = _sparsity(w, model, limit, notes)
    if w.rpc:  # llama.cpp aborts on a server it cannot reach: each is asked first, for a one-line error
        for endpoint in devices.parse_endpoints(w.rpc):
            devices.probe_rpc(endpoint)
    if w.plan_dir:
        w, _ = _saved_decision(w)
    chosen = drafting.Drafting()
    if server:  # llama-server's own speculation (Prepared.draft: the draft model, free: its n-gram types)
        chosen = drafting.for_server(model, w, limit, n_seq_max, notes)
    elif w.draft and n_seq_max == 1:
        chosen = drafting.with_model(model, load(catalog.resolve(w.draft)), w, limit, notes)
    elif n_seq_max == 1 and rules.spec_types(w.spec_type, None):
        chosen = drafting.free(model, w, limit, notes)  # (a tree's prompt is read at -b, as -md's)
    if chosen.alone:
        w = _long_prompt(w, model, limit, n_prompt, notes)
        plan = plan_for_run(model, w, limit, n_seq_max, n_seq_max)
    else:
        plan = chosen.plan
        if not server:
            w = _tree_prompt(w, model, limit, n_prompt, notes)
    mmap_plan = None
    if plan is not None and plan.policy == tuning.MMAP:  # plan --tune measured mmap faster at this budget, or plan
        notes.append(tuning.mmap_note(plan) if plan.tuning else "flexoffload: the plan runs upstream mmap at this "
                     "budget (the page cache holds what a token reads)")
        w, plan, mmap_plan = replace(w, strategy="mmap", plan_dir=None), None, plan
    if plan is not None and plan.placed and not w.rpc:
        raise FlexoffloadError(f"the plan in {w.plan_dir} places tensors on "
                               f"{', '.join(dict.fromkeys(b for _, b in plan.placed))}: give their servers with --rpc")
    if chosen.alone and auto and plan is not None and not plan.tuning and not w.plan_dir and not w.rpc \
            and w.policy == "balanced" and w.window is None:
        note = mmap_instead(model, plan, w.n_threads)
        if note:
            notes.append(note)
            w, plan, mmap_plan = replace(w, strategy="mmap"), None, tuning.mmap_candidate(model, limit, plan)
    settings, decode_tok_s = settings_for(w, plan, limit, model, not chosen.alone)
    if settings.expert_lookahead and plan is not None:
        notes += _lookahead_blind(model, plan)
    p = Prepared(request, model, limit, plan, settings, decode_tok_s=decode_tok_s, notes=notes, mmap_plan=mmap_plan)
    if not chosen.alone:
        p.draft, p.free, p.draft_bytes = chosen.draft, chosen.free, chosen.bytes
        p.tree = drafting.tree_options(w, model, plan, chosen)
        p.store = str(drafting.recycle_store(model)) if "recycle" in chosen.free else None
    return p

"""prepare: everything before loading, as a short sequence of named steps that returns a Prepared.

    check -> files -> check the model -> budget -> precision -> sparsity -> servers -> saved -> drafting
          -> prefill -> plan (tune) -> settings

The request stays as the user gave it (`Prepared.request`). Each step returns its own frozen decision (Files,
Lowered, Prefill, Planned, drafting.Drafting); the values the next steps read are the request with the decisions so
far in it (`_values`), and the Prepared is built once from the decisions: the file run, the budget in bytes, the
plan, the engine's settings, the drafting, the notes for the user. An enforced run's child receives the Prepared as
JSON (to_json) and runs it without preparing again; `plan -o` writes it beside the plan (Prepared.write).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from flexoffload import FlexoffloadError, rules
from flexoffload.defaults import cache_dir, content_key, file_key
from flexoffload.gguf import catalog, moefy
from flexoffload.gguf.model import Model, load
from flexoffload.measure import probe, profiler, sparsity, tuning
from flexoffload.memory import budgets
from flexoffload.native import devices
from flexoffload.plan import candidates, levels, placers, plans
from flexoffload.plan.planners import check_budget
from flexoffload.speculation import tree as spectree
from flexoffload.runtime.engine import count_tokens
from flexoffload.api import drafting, precision
from flexoffload.api.prepared import DECISION_FILE, Prepared
from flexoffload.api.planning import mmap_instead, plan_for_run, prompt_ubatch
from flexoffload.api.running import run_in_cgroup
from flexoffload.api.settings import settings_for

LONG_PROMPT = 256  # tokens: a prompt longer than this has its prefill's ubatch chosen (plan/prefill.py)
TUNE_TOKENS = 8  # a --tune candidate's decoded tokens a run

log = logging.getLogger(__name__)


# --- the decisions -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Files:
    """The file run and the file the user named: a precision plan (saved, or decided here) runs its requantized file,
    a sparsity level its grouped one; plan_dir: the folder of the plan decided with the file, where there is one."""
    model: Model
    named: Model
    plan_dir: str | None = None


@dataclass(frozen=True)
class Prefill:
    """How the prompt is computed: its ubatch, the batch that holds it, the attention path."""
    n_ubatch: int
    n_batch: int
    flash_attn: str


@dataclass(frozen=True)
class Planned:
    """The plan the run streams by (None: mmap, or every weight resident), the strategy run, and mmap's choice as a
    plan where mmap was chosen over one (policy mmap)."""
    plan: plans.Plan | None
    strategy: str
    mmap_plan: plans.Plan | None = None


def _values(request, **decided):
    """What the steps read: the request with the decisions made so far in it (the request itself is not changed)."""
    return replace(request, **decided)


# --- the steps ---------------------------------------------------------------------------------------------------

def _files(w) -> Files:
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
            return Files(load(plan.model), load(source), w.plan_dir)
    model = load(catalog.resolve(w.model))
    return Files(model, model, w.plan_dir)


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


def _precision(w, files: Files, limit: int) -> Files:
    """--precision auto: the plan api/precision.py chooses (its quality not measured: `plan` measures it after),
    saved in the cache as plan -o writes it; the run then streams the requantized file by it."""
    model = files.model
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
            return Files(load(plan.model), files.named, str(directory))
    plan, _ = precision.plan(model, limit, profiler.measure(model, w.n_threads), w.n_ctx, w.n_batch, w.max_kld,
                             w.min_tok_s, w.n_threads, w.io_threads, measure_quality=False,
                             original=Path(w.original) if w.original else None, **run)
    plans.write(plan, directory)
    return Files(load(plan.model), files.named, str(directory))


def _sparsity(w, files: Files, limit: int | None, notes: list[str]) -> Files:
    """run --sparsity: the file of predicted neuron groups at the level asked for, or chosen (auto: the fewest
    groups within --max-kld, then only where its plan is predicted faster than the dense model's)."""
    model = files.model
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
            return files
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
            return files
        if alone is not None and grouped_plan is not None \
                and alone.predicted_tok_s >= grouped_plan.predicted_tok_s:
            notes.append(f"flexoffload: --sparsity auto: {k} of {n_group} groups a token is predicted "
                         f"{grouped_plan.predicted_tok_s:.2f} tok/s, the dense model {alone.predicted_tok_s:.2f}: "
                         f"running the dense model")
            return files
    notes.append(f"flexoffload: predicted neurons: {k} of {n_group} groups a token ({what})")
    return Files(sparse, files.named, files.plan_dir)


def _saved(w) -> tuple[Prefill | None, dict]:
    """`run --plan D`: the ubatch and drafting `plan -o D` decided with the plan (run.json: the Prepared it wrote),
    where the user gave none: its Prefill (None: the user's) and the drafting values ({} where none was saved)."""
    path = Path(w.plan_dir) / DECISION_FILE
    if not path.is_file():
        return None, {}
    d = json.loads(path.read_text())
    settings = d.get("settings", d)  # a Prepared's, or the five fields plan -o wrote before
    prefill = None
    if not w.n_ubatch and settings.get("n_ubatch") and settings["n_ubatch"] != settings.get("n_batch"):
        prefill = Prefill(settings["n_ubatch"], max(w.n_batch, settings["n_batch"]), settings["flash_attn"])
    drafted = {}
    if w.draft and not d.get("draft"):  # the plan was made for the target alone: its memory has no room for -md
        drafted["draft"] = None
    if rules.spec_types(w.spec_type, w.draft) == ["auto"]:
        draft = drafted.get("draft", w.draft)
        drafted["spec_type"] = ",".join(["model"] * bool(draft) + list(d.get("free", []))) or "none"
    return prefill, drafted


def _long_prompt(w, model, limit, n_prompt: int, notes: list[str]) -> Prefill | None:
    """A long prompt under a budget: the ubatch that makes the whole run fastest (plan/prefill.py); None: -b's."""
    if not (limit is not None and w.strategy == "stream" and not w.n_ubatch and not w.plan_dir and not w.rpc
            and w.flash_attn == "auto" and n_prompt > LONG_PROMPT):
        return None
    u, _, first = prompt_ubatch(model, limit, n_prompt, w, profiler.measure(model, w.n_threads))
    notes.append(f"flexoffload: a prompt of {n_prompt} tokens: prefill in ubatches of {u} (-ub), time to first "
                 f"token predicted {first:.1f} s")
    return Prefill(u, max(w.n_batch, u), "on")


def _tree_prompt(w, model, limit, n_prompt: int, notes: list[str]) -> Prefill | None:
    """A speculating run's long prompt read in the ubatches the target alone would read it in, where the tree's plan
    has room for them (at most -b, the ubatch its compute buffers were sized for). A pass's rows decide its kernels
    (the tiled ones from 8 rows of a weight, or of one expert in a MoE), so the prompt's cache, and a near tie after
    it, round by its ubatches: read alike, the tree's greedy text is the alone run's."""
    alone = _long_prompt(w, model, limit, n_prompt, [])
    if alone is None or alone.n_ubatch > w.n_batch:
        return None
    notes.append(f"flexoffload: a prompt of {n_prompt} tokens: prefill in ubatches of {alone.n_ubatch} (-ub), as "
                 "the target alone would")
    return Prefill(alone.n_ubatch, w.n_batch, alone.flash_attn)


def _tuned(w, model, limit: int) -> plans.Plan:
    """plan --tune: the candidate plans (plan/candidates.py) each run cold under the enforced budget, in turn, by the
    target alone (measure/tuning.py); the fastest kept, and cached for `run --mem`."""
    run = probe.measure(model, w.n_ctx, w.n_batch)
    check_budget(model, limit, run, w.window)  # a budget too small is refused before anything runs

    def timed(how: dict) -> float:  # how: {"strategy": "mmap"} or {"plan_dir": DIR}
        candidate = type(w)(model=str(model.path), prompt=tuning.PROMPT, n_predict=TUNE_TOKENS, n_ctx=w.n_ctx,
                            n_batch=w.n_batch, n_threads=w.n_threads, temp=0, mem=str(limit), spec_type="none",
                            **how)
        prepared = prepare(candidate)
        budgets.drop_page_cache()
        return run_in_cgroup(prepared, limit, timeout=900)["decode_tok_s"]

    return tuning.tune(model, limit, profiler.measure(model, w.n_threads), run, timed, w.n_ctx, w.n_batch, w.tune,
                       w.tune_rounds)


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


def _plan(w, model, limit, n_seq_max: int, chosen: drafting.Drafting, auto: bool, notes: list[str]) -> Planned:
    """The plan the run streams by: the drafting's where it speculates, else the target alone's (measured by --tune
    where asked); mmap where plan --tune measured it faster, or where it is predicted as fast (an automatic
    strategy)."""
    if not chosen.alone:
        plan = chosen.plan
    elif w.tune is not None:
        plan = _tuned(w, model, limit)
    else:
        plan = plan_for_run(model, w, limit, n_seq_max, n_seq_max)
    if plan is not None and plan.policy == candidates.MMAP:  # plan --tune measured mmap faster at this budget
        notes.append(candidates.mmap_note(plan) if plan.tuning else "flexoffload: the plan runs upstream mmap at "
                     "this budget (the page cache holds what a token reads)")
        return Planned(None, "mmap", plan)
    if plan is not None and plan.placed and not w.rpc:
        raise FlexoffloadError(f"the plan in {w.plan_dir} places tensors on "
                               f"{', '.join(dict.fromkeys(b for _, b in plan.placed))}: give their servers with --rpc")
    if chosen.alone and auto and plan is not None and not plan.tuning and not w.plan_dir and not w.rpc \
            and w.policy == "balanced" and w.window is None:
        note = mmap_instead(model, plan, w.n_threads)
        if note:
            notes.append(note)
            return Planned(None, "mmap", candidates.mmap_candidate(model, limit, plan))
    return Planned(plan, w.strategy)


def prepare(request, n_seq_max: int = 1, server: bool = False) -> Prepared:
    """Everything before loading: the model, the budget, the plan, and whether drafting pays at this budget.
    n_seq_max: the sequences decoded together (serve's -np): the plan counts a decode batch and a logits row of each.
    server: serve's (llama-server speculates its own way, drafting.for_server).

    Bad input is a FlexoffloadError here, before any cgroup is made or weight is read."""
    rules.check(request)
    auto = request.strategy is None
    strategy = request.strategy or ("stream" if request.mem or request.plan_dir else "mmap")
    w = _values(request, strategy=strategy)
    files = _files(w)
    rules.check_model(w, files.model)  # what the headers refuse (another vocabulary, ...), before the prompt is read
    n_prompt = _prompt_tokens(files.model, _values(w, model=str(files.model.path)))
    limit = _budget(w, files.named)
    notes: list[str] = []
    if w.precision:  # the mixed file and its plan, saved as plan -o writes them; the run streams by them
        files = _precision(w, files, limit)
    if w.sparsity is not None:  # the grouped file (or the dense one)
        files = _sparsity(w, files, limit, notes)
    if w.rpc:  # llama.cpp aborts on a server it cannot reach: each is asked first, for a one-line error
        for endpoint in devices.parse_endpoints(w.rpc):
            devices.probe_rpc(endpoint)
    model = files.model
    w = _values(w, model=str(model.path), plan_dir=files.plan_dir, precision=None, sparsity=None,
                max_kld=None if w.sparsity is not None else w.max_kld)
    saved, drafted = _saved(w) if w.plan_dir else (None, {})
    w = _values(w, **drafted, **(vars(saved) if saved else {}))
    chosen = drafting.Drafting()  # the target alone
    one = n_seq_max == 1 and w.tune is None  # (--tune times its candidates by the target alone)
    if server:  # llama-server's own speculation (Prepared.draft: the draft model, free: its n-gram types)
        chosen = drafting.for_server(model, w, limit, n_seq_max, notes)
    elif one and w.draft:
        chosen = drafting.with_model(model, load(catalog.resolve(w.draft)), w, limit, notes)
    elif one and rules.spec_types(w.spec_type, None):
        chosen = drafting.free(model, w, limit, notes)  # (a tree's prompt is read at -b, as -md's)
    prefill = None
    if chosen.alone:
        prefill = _long_prompt(w, model, limit, n_prompt, notes)
    elif not server:
        prefill = _tree_prompt(w, model, limit, n_prompt, notes)
    w = _values(w, **(vars(prefill) if prefill else {}))
    planned = _plan(w, model, limit, n_seq_max, chosen, auto, notes)
    w = _values(w, strategy=planned.strategy, plan_dir=None if planned.strategy == "mmap" else w.plan_dir)
    settings, decode_tok_s = settings_for(w, planned.plan, limit, model, not chosen.alone)
    if settings.expert_lookahead and planned.plan is not None:
        notes += _lookahead_blind(model, planned.plan)
    tree = None if chosen.alone else drafting.tree_options(w, model, planned.plan, chosen)
    return Prepared(request, model, limit, planned.plan, settings, draft=chosen.draft, draft_bytes=chosen.bytes,
                    free=chosen.free, tree=tree,
                    store=str(drafting.recycle_store(model)) if "recycle" in chosen.free else None,
                    decode_tok_s=decode_tok_s, notes=notes, mmap_plan=planned.mmap_plan)

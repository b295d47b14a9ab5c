"""Prepare's drafting step: whether a run speculates, with what, and what that takes out of the budget.

A resident draft model (-md) and free drafters (--spec-type: n-grams, Token Recycling) each cost memory the target
then streams more for; `auto` takes them only where the cost model predicts they fit and pay, and otherwise runs the
target alone and says why (a default never refuses a budget the run without it accepts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, file_key
from flexoffload.gguf import catalog, headcut
from flexoffload.gguf.model import load
from flexoffload.measure import headrows, probe, profiler, requantize
from flexoffload.rules import spec_types
from flexoffload.plan import plans
from flexoffload.plan import candidates, costmodel, qtypes
from flexoffload.plan.planners import resident_bytes
from flexoffload.runtime import server
from flexoffload.speculation import drafters, history, control as speccontrol, tree as spectree, speculate
from flexoffload.api.planning import kv_quantized, plan_for_run

FREE_AUTO = ("ngram-simple", "recycle")  # --spec-type auto's free drafters where they pay, without -md
FREE_AUTO_MD = ("ngram-simple",)  # and beside a draft model (its n-grams cost no draft time, no table)
FREE_PAYS = 1.5  # auto without -md: speculate where a target pass takes this many times its compute or more


@dataclass(frozen=True)
class Drafting:
    """What prepare decided about speculation: the draft model's path (None: none), the free drafters run, what
    they take out of the budget, and the plan made for them (None: the run goes on without speculating)."""
    draft: str | None = None
    free: tuple[str, ...] = ()
    bytes: int = 0
    plan: object | None = None
    alone: bool = True  # the target alone: no tree
    history: dict | None = None  # the stored measurements of this pair and prompt kind the decision used
    history_path: str | None = None  # where the run keeps its own (None: --no-history)
    kind: str = ""  # the prompt's kind (history.kind)
    step_s: float = 0.0  # a draft step's predicted seconds


def recycle_store(model) -> Path:
    """Where Token Recycling's table for this model file outlives a run (about 5 MB: n_vocab x 8 ids)."""
    return cache_dir() / "recycle" / f"{file_key(model.path)}-k{drafters.RECYCLE_K}.npz"


def free_pays(model, r, limit: int | None) -> bool:
    """--spec-type auto without -md: whether free drafters pay, by a simple rule: where the run streams by a plan
    whose one-token pass takes FREE_PAYS times the target's compute or more (the disk, not compute, sets the pass, so
    a tree costs little more than a token). Not for a mixture of experts (predicted neurons too): each of a tree's
    tokens reads its own experts, so a pass reads more than a token's."""
    if (limit is None or r.strategy != "stream" or r.plan_dir or r.rpc or r.chat or r.forced or r.n_ubatch
            or r.flash_attn != "auto" or kv_quantized(r) or model.n_expert):
        return False
    try:
        alone = plan_for_run(model, r, limit)
    except FlexoffloadError:  # a budget only the long prompt's own ubatch fits: not one for a tree either
        return False
    if alone is None or alone.policy == candidates.MMAP or not plans.streamed_bytes(alone, model):
        return False
    return 1 / alone.predicted_tok_s > FREE_PAYS * costmodel.compute_seconds(model, profiler.measure(model, r.n_threads))


def free(model, r, limit: int | None, notes: list[str]) -> Drafting:
    """Free drafters without -md: the plan counts the tree's logits rows, its sequences and the drafters' tables.
    Alone where auto finds they do not pay, or where their rows and tables do not fit a budget the target alone
    fits (said on stderr)."""
    names = spec_types(r.spec_type, None)
    if names == ["auto"]:
        if not free_pays(model, r, limit):
            return Drafting()
        names = list(FREE_AUTO)
    table = drafters.table_bytes(names, model.n_vocab)
    rows = r.draft_max or (speculate.FREE_NODES_MAX if limit is not None else speculate.FREE_NODES)
    try:
        plan = plan_for_run(model, r, limit, max(rows, spectree.MAX_BRANCHES + 1), spectree.MAX_BRANCHES + 1, table)
    except FlexoffloadError as e:
        if spec_types(r.spec_type, None) != ["auto"]:
            raise
        notes.append(f"flexoffload: --spec-type auto: the drafters' rows and tables do not fit this budget ({e}): "
                     f"running the target alone")
        return Drafting()
    return Drafting(None, tuple(names), table, plan, alone=False)


def tree_outputs(r) -> int:
    """A logits row per tree node (the node budget is memory), and llama.cpp keeps one per sequence."""
    return max(r.draft_max or spectree.MAX_NODES, spectree.MAX_BRANCHES + 1)


def draft_bytes(draft_model, r) -> int:
    """What the resident draft model takes out of the target's budget."""
    run = probe.measure(draft_model, r.n_ctx, r.n_batch, spectree.MAX_BRANCHES, spectree.MAX_BRANCHES)
    return resident_bytes(draft_model, run, speculate.draft_by_rows(draft_model))


def history_file(target: Path, draft: Path) -> Path:
    """Where runs of this target and draft keep what they measured (speculation/history.py)."""
    return history.path(cache_dir() / "speculation", file_key(target), file_key(draft))


SMALLER = "Q4_0"  # the smaller draft's type (the 0.5B's 896-wide rows take no K-quant: they fall back)


@dataclass
class _Candidate:
    """A draft -md could run with: the file as given, its SMALLER copy, or either with its head cut to the frequent
    tokens (copies made only once chosen)."""
    label: str
    types: dict  # the copy's types ({}: the file as given)
    head: bool  # its output head cut to headrows.ROWS tokens
    taken: int  # what it takes out of the target's budget, with the free drafters' tables
    step_s: float  # a draft step's predicted seconds
    path: Path | None  # its file (None: the copy is not made yet)
    plan: object = None
    predicted: float = 0.0
    stored: dict | None = None
    where: Path | None = None  # the history it was predicted by


def smaller_types(draft_model) -> dict[str, str]:
    """Every weight matrix of the draft at SMALLER, where that is smaller than its own type."""
    return {t.name: SMALLER for t in draft_model.tensors
            if qtypes.quantizable(t) and qtypes.tensor_bytes(t, SMALLER) < t.n_bytes}


def _resident(draft_model, types: dict, head: bool) -> int:
    """The bytes of the draft's resident tensors at these types, its head cut or not: a cut head is its kept rows
    (a tied model gets one of its own, and its embeddings are then only looked up, read by rows)."""
    by_rows = set(speculate.draft_by_rows(draft_model))
    tied = costmodel.tied_output(draft_model)
    out = 0
    for t in draft_model.tensors:
        size = qtypes.tensor_bytes(t, types[t.name]) if t.name in types else t.n_bytes
        if head and (t.kind == "output" or t in tied):
            out += size * headrows.ROWS // draft_model.n_vocab  # a tied model's embeddings are then looked up only
        elif t.name not in by_rows:
            out += size
    return out


def _made(draft_model, types: dict, head: bool) -> Path | None:
    """The file of a candidate, where it is made (the file as given always is)."""
    path = requantize.mixed_path(draft_model, types, None) if types else Path(draft_model.path)
    if head and path.is_file():
        path = headrows.path(load(path))
    return path if path.is_file() else None


def _candidates(draft_model, r, table: int) -> list[_Candidate]:
    """The drafts --draft-quant and --draft-head allow: the file as given, its SMALLER copy, and each with its head
    cut, each with what it would take (the copy's weights computed from its types, the rest as the file's) and its
    predicted step (a step reads every resident weight: its time follows their bytes)."""
    own_taken = draft_bytes(draft_model, r) + table
    step_s = costmodel.compute_seconds(draft_model, profiler.measure(draft_model, r.n_threads))
    own = _resident(draft_model, {}, False)
    smaller = smaller_types(draft_model) if r.draft_quant != "own" else {}
    quants = ([{}] if r.draft_quant != "q4_0" else []) + ([smaller] if smaller else [])
    heads = {"auto": (False, True), "full": (False,), "cut": (True,)}[r.draft_head]
    if draft_model.n_vocab <= headrows.ROWS or headcut.rows(draft_model) is not None:
        heads = (False,)
    out = []
    for types in quants:
        for head in heads:
            size = _resident(draft_model, types, head)
            label = "its own types" if not types else f"all {SMALLER}"
            out.append(_Candidate(label + (f", head cut to {headrows.ROWS} tokens" if head else ""), types, head,
                                  own_taken - (own - size), step_s * size / own, _made(draft_model, types, head)))
    return out


def with_model(model, draft_model, r, limit: int | None, notes: list[str]) -> Drafting:
    """-md: the target's plan leaves the resident draft (and the free drafters beside it) their memory. The decisions
    made before loading are the memory's: which draft (its own types or a smaller copy, by the speed predicted from
    measured acceptance and the memory each leaves the target), and whether to spend memory on one at all: where
    the stored history of this pair and prompt kind (what earlier runs measured) predicts the target alone faster,
    it runs alone (or with free drafters, if those pay), unless --draft-always. Without a history the draft is
    loaded wherever it fits, and the run decides pass by pass whether it drafts (control.Controller)."""
    if limit is not None and draft_model.file_size >= limit:
        raise FlexoffloadError(f"the draft {draft_model.path.name} ({draft_model.file_size / 2**20:.0f} MiB) is "
                               f"larger than the whole budget ({limit / 2**20:.0f} MiB)")
    given = spec_types(r.spec_type, r.draft)
    names = list(FREE_AUTO_MD) if given == ["auto"] else given
    kind = history.kind(r.prompt)
    row_s = spectree.VERIFY_SHARE * costmodel.compute_seconds(model, profiler.measure(model, r.n_threads))
    fits, why = [], None
    for c in _candidates(draft_model, r, drafters.table_bytes(names, model.n_vocab)):
        try:
            c.plan = plan_for_run(model, r, limit, tree_outputs(r), spectree.MAX_BRANCHES + 1, c.taken)
        except FlexoffloadError as e:
            why = why or e
            continue
        # a copy not made yet has no history of its own: the file's stands in; a cut head without one, the whole
        # head's at the same types (its spare rows hold the prompt's tokens: the acceptance is nearly the same)
        c.where = history_file(model.path, c.path or draft_model.path)
        c.stored = history.load(c.where, kind, notes) if r.history else None
        whole = _made(draft_model, c.types, False) if c.stored is None and c.head and r.history else None
        if whole:
            c.where = history_file(model.path, whole)
            c.stored = history.load(c.where, kind, notes)
        if c.plan is not None and c.plan.predicted_tok_s:
            c.predicted = speccontrol.predicted_tok_s(speccontrol.Measured.from_json(c.stored) if c.stored
                                                      else speccontrol.Measured(), 1 / c.plan.predicted_tok_s,
                                                      row_s, c.step_s)
        fits.append(c)
    if not fits:
        if r.draft_always or limit is None or r.plan_dir:
            raise why
        notes.append(f"flexoffload: the draft does not fit beside the target at this budget ({why}): running the "
                     f"target alone (--draft-always refuses instead)")
        return _without_draft(model, r, limit, notes, given)
    if r.draft_quant == "auto" and any(c.types == {} for c in fits):
        # the copy unmeasured beside a file that fits: requantizing an already quantized draft cost more acceptance
        # than its memory won (results/headline_md52b.csv: 0.91x the file at 0.8x), so it runs only once measured
        fits = [c for c in fits if c.types == {} or (c.path and c.stored)]
    best = max(fits, key=lambda c: (c.predicted, -c.taken))  # a tie: the one leaving the target more
    if len(fits) > 1:
        def said(c):
            return (f"at {c.label} ({c.taken / 2**20:.0f} MiB with its context, "
                    f"{'measured' if c.stored else 'prior'} acceptance) {c.predicted:.2f} tok/s")
        others = "; ".join(said(c) for c in fits if c is not best)
        notes.append(f"flexoffload: -md: the draft is predicted {said(best)}; {others}, by the memory each leaves "
                     f"the target and its step: running it at {best.label}")
    elif r.draft_quant == "auto" and best.types == {} and limit is not None and why is not None:
        notes.append(f"flexoffload: -md: the draft's smaller copies do not fit beside the target either ({why})")
    path = best.path
    if path is None:  # made once, then cached
        path = Path(draft_model.path)
        if best.types:
            notes.append(f"flexoffload: making the draft's {SMALLER} copy (once, cached)")
            path = requantize.requantize(draft_model, best.types, n_threads=r.n_threads)
        if best.head:
            notes.append(f"flexoffload: making the draft's copy with its head cut to {headrows.ROWS} tokens (once, "
                         f"cached)")
            path = headrows.cut(load(path))
        made = load(path)
        best.taken = draft_bytes(made, r) + drafters.table_bytes(names, model.n_vocab)
        best.plan = plan_for_run(model, r, limit, tree_outputs(r), spectree.MAX_BRANCHES + 1, best.taken)
    where = history_file(model.path, path)
    speculating = Drafting(str(path), tuple(names), best.taken, best.plan, alone=False, history=best.stored,
                           history_path=str(where) if r.history else None, kind=kind, step_s=best.step_s)
    if best.plan is None or limit is None or r.plan_dir or r.draft_always or best.stored is None:
        return speculating
    alone = plan_for_run(model, r, limit)
    if alone.predicted_tok_s <= best.predicted:
        return speculating
    notes.append(f"flexoffload: by what earlier runs of this pair measured on {kind} ({best.where}), the target "
                 f"alone is predicted faster at this budget ({alone.predicted_tok_s:.2f} tok/s, with the draft "
                 f"{best.predicted:.2f}): running without -md (--draft-always or --no-history loads it anyway)")
    return _without_draft(model, r, limit, notes, given, alone)


def _without_draft(model, r, limit, notes, given, alone=None) -> Drafting:
    """-md decided against: the free drafters alone where auto finds they pay, else the target alone."""
    if given == ["auto"]:
        freed = free(model, replace(r, draft=None, spec_type="auto"), limit, notes)
        if not freed.alone:
            return freed
    return Drafting(plan=alone if alone is not None else plan_for_run(model, r, limit))


def tree_options(r, model, plan, chosen: Drafting) -> spectree.Options:
    """The tree's options: the user's, what a node adds to a pass (the cost model's share of a token's compute),
    and where the measured decision starts (the plan's pass, the draft's step, the history), decided here so that
    a child run does not measure again."""
    node_s, hidden, pass_s = 0.0, 0, 0.0
    if plan is not None and plan.predicted_tok_s:
        pass_s = 1 / plan.predicted_tok_s
        node_s, hidden = spectree.node_costs(pass_s,
                                             costmodel.compute_seconds(model, profiler.measure(model, r.n_threads)))
    return spectree.Options(tree=r.spec == "tree", pacer=r.pacer, adaptive=r.adaptive,
                            adaptive_split=r.adaptive_split, pipeline=r.pipeline, tiled=r.tiled_verify,
                            threshold=r.draft_p_split, max_nodes=r.draft_max, node_s=node_s, hidden_nodes=hidden,
                            control=r.spec_control, pass_s=pass_s, step_s=chosen.step_s, always=r.draft_always,
                            history=chosen.history, history_path=chosen.history_path, history_kind=chosen.kind)


# --- serve: llama-server's own speculation -------------------------------------------------------------------------

SERVER_FREE = ("ngram-simple", "ngram-map-k")  # run's free drafters llama-server has, by the same names
# the draft model's longest draft a step (llama-server's --spec-draft-n-max, 3 upstream): patch 0030 drafts up to it
# while a^d >= 1/4 (a: the sequence's measured acceptance), so this caps a draft the target keeps accepting, and
# the logits rows each sequence reserves (n_max + 1)
SERVER_DRAFT_N_MAX = 8
SERVER_STOP = 0.25  # patch 0030's rule: draft on while the chance the whole draft is accepted stays at least this
# The draft model's tokens the target accepts a step, each given the one before: llama-speculative with the 0.5B
# drafting the 1.5B gave 2.7-3.0 tokens a pass at n-max 2 and 4.4-4.8 at n-max 4 (HumanEval 0, 20;
# results/llmcad_qwen_08.csv): 1 + a + a^2 = 2.71 at a = 0.9 (4.4-4.8 at n-max 4 implies a of 0.94-0.97). Used only
# to predict whether a draft model pays.
SERVER_ACCEPT = 0.9


def server_speculation(draft: str | None, free, r) -> server.Speculation:
    """llama-server's speculation for a draft model's path (None: none) and n-gram types, the longest draft a
    sequence verifies in one pass from --draft-max: the draft model's (SERVER_DRAFT_N_MAX by default) and an n-gram
    match's (run's NGRAM_LENGTH by default; llama-server's own 48 would reserve 49 logits rows a sequence). With
    --rpc a sequence's pass stays under the servers' tiled kernels, as run's trees do (speculate.RPC_NODES)."""
    ngram_max = r.draft_max or (speculate.RPC_NODES - 1 if r.rpc else drafters.NGRAM_LENGTH)
    return server.Speculation(draft, (server.DRAFT_TYPE,) * bool(draft) + tuple(free),
                              r.draft_max or SERVER_DRAFT_N_MAX, ngram_max)


def server_tok_s(pass_s: float, n_seq: int, target_token_s: float, n_draft: int = 0,
                 draft_token_s: float = 0.0) -> float:
    """The aggregate decode speed of n_seq sequences decoded together, each verifying up to n_draft draft-model
    tokens a pass (0: none; patch 0030 drafts as long as SERVER_ACCEPT pays within it): a one-token pass by the plan (pass_s) and VERIFY_SHARE of the target's compute a token for each
    further row, the draft's n_draft steps for each sequence; each sequence gains the tokens a chain of n_draft
    yields at SERVER_ACCEPT."""
    if n_draft:  # the length patch 0030 drafts at SERVER_ACCEPT, within n_draft
        n_draft = min(n_draft, next(d for d in range(1, 100) if SERVER_ACCEPT ** (d + 1) < SERVER_STOP))
    rows = n_seq * (1 + n_draft)
    tokens = n_seq * sum(SERVER_ACCEPT ** k for k in range(n_draft + 1))
    return tokens / (pass_s + (rows - 1) * spectree.VERIFY_SHARE * target_token_s + n_seq * n_draft * draft_token_s)


def for_server(model, r, limit: int | None, n_seq: int, notes: list[str]) -> Drafting:
    """serve: llama-server's own speculation for n_seq sequences, decided as run decides its own. -md: the draft
    model (llama-server's draft-simple); --spec-type ngram-simple, ngram-map-k: llama-server's drafters of those names;
    auto: with -md the draft model, without it ngram-simple for one sequence where free_pays finds the pass disk-bound
    (beside others it lost). The plan leaves
    the draft model its memory (its weights, whole, and its context for n_seq sequences) and counts the target's
    logits rows (each sequence's last token and its longest draft). Where that does not fit, or the target alone is
    predicted faster (a draft model), the server runs without it and says so: a budget that serves without
    speculation is never refused for it. Drafting.draft: the draft's path; free: the llama-server n-gram types."""
    given = spec_types(r.spec_type, r.draft)
    if r.plan_dir:  # a saved plan was made for run: its memory has no room for the server's rows or draft
        if r.draft or (given and given != ["auto"]):
            notes.append(f"flexoffload: the plan in {r.plan_dir} has no room for the server's speculation: the "
                         f"server runs without it")
        return Drafting()
    if "recycle" in given:
        raise FlexoffloadError("--spec-type recycle is run's own drafter, not llama-server's: serve speculates with "
                               "ngram-simple, ngram-map-k or a draft model (-md)")
    if given == ["auto"]:
        # the n-gram drafter for one sequence only: beside 4 and 8 it cost 0.82x and 0.83x the aggregate at 0.8x
        # (results/serve_md52.csv, where -md was declined for them and auto fell back to it)
        free = [] if r.draft or n_seq > 1 or not free_pays(model, r, limit) else ["ngram-simple"]
    else:
        free = [n for n in given if n in SERVER_FREE]
    if not r.draft and not free:
        return Drafting()
    draft_model = load(catalog.resolve(r.draft)) if r.draft else None
    speculation = server_speculation(str(draft_model.path) if draft_model else None, free, r)
    taken = 0
    if draft_model is not None:  # kept whole (no -ot reaches it), one context of n_seq sequences at the target's -c, -b
        taken = resident_bytes(draft_model, probe.measure(draft_model, r.n_ctx, r.n_batch, n_seq, n_seq))
    what = ", ".join(([f"the draft {draft_model.path.name}"] if draft_model else []) + free)
    try:
        plan = plan_for_run(model, r, limit, min(r.n_batch, n_seq * speculation.rows), n_seq, taken)
    except FlexoffloadError as e:
        if limit is None or (draft_model is not None and r.draft_always):  # the API's draft_always refuses, as run
            raise
        notes.append(f"flexoffload: speculation ({what}) does not fit beside the target at this budget ({e}): "
                     f"the server runs without it")
        return _server_without_draft(model, r, limit, n_seq, notes, given, bool(draft_model))
    speculating = Drafting(str(draft_model.path) if draft_model else None, tuple(free), taken, plan, alone=False)
    if draft_model is None or plan is None or limit is None or r.draft_always:
        return speculating
    alone = plan_for_run(model, r, limit, n_seq, n_seq)
    target_token_s = costmodel.compute_seconds(model, profiler.measure(model, r.n_threads))
    draft_token_s = costmodel.compute_seconds(draft_model, profiler.measure(draft_model, r.n_threads))
    predicted = server_tok_s(1 / plan.predicted_tok_s, n_seq, target_token_s, speculation.n_max, draft_token_s)
    without = server_tok_s(1 / alone.predicted_tok_s, n_seq, target_token_s)
    if without <= predicted:
        return speculating
    notes.append(f"flexoffload: the target alone is predicted faster at this budget ({without:.2f} tok/s for "
                 f"{n_seq} sequences, with the draft {predicted:.2f}): the server runs without -md")
    return _server_without_draft(model, r, limit, n_seq, notes, given, True)


def _server_without_draft(model, r, limit, n_seq, notes, given, had_draft: bool) -> Drafting:
    """The server's speculation decided against: auto's n-gram drafter where it pays (a draft model was), else the
    target alone."""
    if had_draft and given == ["auto"]:
        return for_server(model, replace(r, draft=None), limit, n_seq, notes)
    return Drafting()

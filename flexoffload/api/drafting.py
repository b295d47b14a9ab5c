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
from flexoffload.measure import probe, profiler, tuning
from flexoffload.options import spec_types
from flexoffload.plan import plans
from flexoffload.plan import costmodel
from flexoffload.plan.planners import resident_bytes
from flexoffload.runtime import drafters, spectree, speculate
from flexoffload.api.planning import kv_quantized, plan_for_run

FREE_AUTO = ("ngram-simple", "recycle")  # --spec-type auto's free drafters where they pay, without -md
FREE_AUTO_MD = ("ngram-simple",)  # and beside a draft model (its n-grams cost no draft time, no table)
FREE_PAYS = 1.5  # auto without -md: speculate where a target pass takes this many times its compute or more


@dataclass
class Drafting:
    """What prepare decided about speculation: the draft model's path (None: none), the free drafters run, what
    they take out of the budget, and the plan made for them (None: the run goes on without speculating)."""
    draft: str | None = None
    free: tuple[str, ...] = ()
    bytes: int = 0
    plan: object | None = None
    alone: bool = True  # the target alone: no tree


def recycle_store(model) -> Path:
    """Where Token Recycling's table for this model file outlives a run (about 5 MB: n_vocab x 8 ids)."""
    return cache_dir() / "recycle" / f"{file_key(model.path)}-k{drafters.RECYCLE_K}.npz"


def free_pays(model, r, limit: int | None) -> bool:
    """--spec-type auto without -md: whether free drafters pay, by a simple rule: where the run streams by a plan
    whose one-token pass takes FREE_PAYS times the target's compute or more (the disk, not compute, sets the pass, so
    a tree costs little more than a token). Not for a mixture of experts (predicted neurons too): each of a tree's
    tokens reads its own experts, so a pass reads more than a token's."""
    if (limit is None or r.strategy != "stream" or r.plan_dir or r.rpc or r.chat or r.n_ubatch
            or r.flash_attn != "auto" or kv_quantized(r) or model.n_expert):
        return False
    alone = plan_for_run(model, r, limit)
    if alone is None or alone.policy == tuning.MMAP or not plans.streamed_bytes(alone, model):
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


def with_model(model, draft_model, r, limit: int | None, notes: list[str]) -> Drafting:
    """-md: the target's plan leaves the resident draft (and the free drafters beside it) their memory. Where the
    draft's memory makes the target stream so much more that the target alone is predicted faster, it runs alone
    (or with free drafters, if those pay), unless --draft-always."""
    given = spec_types(r.spec_type, r.draft)
    names = list(FREE_AUTO_MD) if given == ["auto"] else given
    taken = draft_bytes(draft_model, r) + drafters.table_bytes(names, model.n_vocab)
    try:
        plan = plan_for_run(model, r, limit, tree_outputs(r), spectree.MAX_BRANCHES + 1, taken)
    except FlexoffloadError as e:
        if r.draft_always or limit is None or r.plan_dir:
            raise
        notes.append(f"flexoffload: the draft does not fit beside the target at this budget ({e}): running the "
                     f"target alone (--draft-always refuses instead)")
        return _without_draft(model, r, limit, notes, given)
    speculating = Drafting(str(draft_model.path), tuple(names), taken, plan, alone=False)
    if plan is None or limit is None or r.plan_dir or r.draft_always:
        return speculating
    alone = plan_for_run(model, r, limit)
    draft_token_s = costmodel.compute_seconds(draft_model, profiler.measure(draft_model, r.n_threads))
    target_token_s = costmodel.compute_seconds(model, profiler.measure(model, r.n_threads))
    predicted = spectree.predicted_tok_s(1 / plan.predicted_tok_s, draft_token_s, target_token_s)
    if alone.predicted_tok_s <= predicted:
        return speculating
    notes.append(f"flexoffload: the target alone is predicted faster at this budget ({alone.predicted_tok_s:.2f} "
                 f"tok/s, with the draft {predicted:.2f}): running without -md (--draft-always speculates anyway)")
    return _without_draft(model, r, limit, notes, given, alone)


def _without_draft(model, r, limit, notes, given, alone=None) -> Drafting:
    """-md decided against: the free drafters alone where auto finds they pay, else the target alone."""
    if given == ["auto"]:
        freed = free(model, replace(r, draft=None, spec_type="auto"), limit, notes)
        if not freed.alone:
            return freed
    return Drafting(plan=alone if alone is not None else plan_for_run(model, r, limit))


def tree_options(r, model, plan) -> spectree.Options:
    """The tree's options: the user's, and what a node adds to a pass (the cost model's share of a token's
    compute), decided here so that a child run does not measure again."""
    node_s, hidden = 0.0, 0
    if plan is not None and plan.predicted_tok_s:
        node_s, hidden = spectree.node_costs(1 / plan.predicted_tok_s,
                                             costmodel.compute_seconds(model, profiler.measure(model, r.n_threads)))
    return spectree.Options(tree=r.spec == "tree", pacer=r.pacer, adaptive=r.adaptive,
                            adaptive_split=r.adaptive_split, pipeline=r.pipeline, tiled=r.tiled_verify,
                            threshold=r.draft_p_split, max_nodes=r.draft_max, node_s=node_s, hidden_nodes=hidden)

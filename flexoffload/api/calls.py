"""The API's calls: load a model's table, plan, generate, tune, trace experts (api/__init__.py exports them)."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace

import flexoffload.gguf.model
from flexoffload import FlexoffloadError, rules
from flexoffload.gguf import catalog
from flexoffload.measure import lookahead, profiler, tracing
from flexoffload.options import BY_NAME, Budget, Draft, Generation, Placement, Precision, Request, request
from flexoffload.plan import locality, replay
from flexoffload.plan.costmodel import compute_seconds
from flexoffload.api.running import execute
from flexoffload.api.preparing import prepare

log = logging.getLogger(__name__)


def load(model=None):
    """The model's tensor table (gguf.model.Model), read without loading weights: a GGUF path or a catalog name
    (None: the default model)."""
    return flexoffload.gguf.model.load(catalog.resolve(model))


def plan(model, budget: Budget, generation: Generation = Generation(), draft: Draft | None = None,
         placement: Placement = Placement(), precision: Precision | None = None, prompt: str = " "):
    """The plan a run of model would stream by under the budget (plan.plans.Plan; None where it would not stream:
    mmap, or everything resident), decided as generate decides it. Save it with plan.write(DIRECTORY) and give it
    back to generate (plan=) or to `flexoffload run --plan DIRECTORY`."""
    return prepare(request(model, prompt, generation, budget, draft, placement, precision)).plan


def generate(model, prompt: str | None = None, generation: Generation = Generation(), budget: Budget = Budget(),
             draft: Draft | None = None, placement: Placement = Placement(), precision: Precision | None = None,
             plan=None, on_text=None, enforce: bool = False, timeout: float | None = None,
             cgroup_limit: int | None = None) -> dict:
    """Generate from prompt with model under the budget; the result as a dict (text, tokens, decode_tok_s,
    ttft_s, peak_mem_mb, the plan's prediction, ...). plan: a Plan to stream by (api.plan's, or plans.read's).
    enforce: in a child process held to the budget by a memory cgroup (where none can be made, the user is told and
    the run goes unenforced); cgroup_limit: the cgroup's limit instead of the budget. on_text: called with each
    piece of text as it comes. What the user is told goes to the "flexoffload" logger (the CLI prints it).
    generate(Request, ...) is the flat form."""
    run = dict(on_text=on_text, enforce=enforce, timeout=timeout, cgroup_limit=cgroup_limit)
    if isinstance(model, Request):
        return execute(prepare(model), **run)
    if plan is None:
        return execute(prepare(request(model, prompt or "", generation, budget, draft, placement, precision)), **run)
    with tempfile.TemporaryDirectory(prefix="flexoffload-plan-") as directory:  # a run streams by a plan's files
        plan.write(directory)
        budget = replace(budget, plan_dir=directory)
        return execute(prepare(request(model, prompt or "", generation, budget, draft, placement, precision)), **run)


def tune(model, budget: int, n_ctx: int = BY_NAME["n_ctx"].default, n_batch: int = BY_NAME["n_batch"].default,
         n_best: int = BY_NAME["tune"].flag_value, rounds: int = BY_NAME["tune_rounds"].default):
    """plan --tune: prepare's tune step (the candidate plans each run cold under the enforced budget, in turn); the
    plan kept (policy mmap where mmap measured faster)."""
    p = prepare(Request(model=str(model.path), prompt=" ", mem=str(budget), n_ctx=n_ctx, n_batch=n_batch,
                        strategy="stream", spec_type="none", tune=n_best, tune_rounds=rounds))
    return p.plan or p.mmap_plan


def experts(model, slots: list[int] | None = None, text: str | None = None, n_threads: int | None = None,
            batch: int = 512, remeasure: bool = False) -> dict:
    """profile --experts: the experts a text routes to (measure/tracing.py; None: the HumanEval tuning problems;
    measured once, cached) replayed through an expert cache of each slot count and policy (plan/replay.py), and
    how local the routing is, by layer and on average (plan/locality.py: layer -1 the mean). With the calibration
    text, also how well each layer predicts the next one's experts (measure/lookahead.py: what the plan's lookahead
    counts on; None where its routers are of a kind lookahead does not model)."""
    n_threads = n_threads or os.cpu_count() or 1
    trace = tracing.trace(model, text, n_threads, remeasure=remeasure)
    replay.check(model, trace)
    recall = None
    if text is None:
        try:
            recall = lookahead.recall_by_layer(model, n_threads, remeasure)
        except FlexoffloadError as e:
            log.warning("no lookahead recall for %s: %s", model.path.name, e)
    profile = profiler.measure(model, n_threads)
    slots = replay.default_slots(model) if slots is None else slots
    layers = locality.by_layer(trace)
    return {"model": str(model.path), "name": model.name, "source": trace.source, "tokens": trace.n_tokens,
            "n_layer": model.n_layer, "n_expert": model.n_expert, "n_used": model.n_expert_used,
            "unit_bytes": replay.unit_bytes(model), "disk_bw": profile.disk_bw,
            "resident_tok_s": 1.0 / compute_seconds(model, profile),
            "rows": replay.table(model, trace, slots, profile, batch),
            "locality": [x.to_dict() for x in layers] + [locality.mean(layers).to_dict()],
            "lru_hits": locality.lru_hits(trace), "lookahead_recall": recall}


def check(r: Request) -> None:
    """A request's options checked (rules.check): a one-line FlexoffloadError, before anything is read."""
    rules.check(r)

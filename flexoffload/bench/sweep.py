"""`flexoffload bench`: decode speed and peak memory per budget and strategy.

Every run is a fresh `flexoffload run` process in its own memory cgroup at the budget, after the page
cache is dropped (where permitted), so each starts cold and the kernel holds it to the budget.
"""

from __future__ import annotations

import csv
import logging
import statistics
import sys
from dataclasses import asdict, dataclass, is_dataclass

from tqdm import tqdm

from flexoffload import FlexoffloadError
from flexoffload.gguf import catalog
from flexoffload.gguf.model import load
from flexoffload.memory import budgets
from flexoffload.memory.budgets import MiB

DEFAULT_PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list of numbers in ascending order.\"\"\"\n"
from flexoffload.defaults import POLICIES, STRATEGIES  # a bench entry is a strategy, or a policy `stream` runs by

log = logging.getLogger(__name__)


def strategy_fields(name: str) -> dict:
    """api.Request fields for a bench entry: a strategy, a resident-set policy streamed by (as planned, untuned), or
    `tuned`: the plan `plan --tune` chose (made first where there is none)."""
    if name in STRATEGIES:
        return {"strategy": name, "tuned": False}
    if name in POLICIES:
        return {"strategy": "stream", "policy": name, "tuned": False}
    if name == "tuned":
        return {"strategy": "stream", "policy": "balanced", "tuned": True}
    raise FlexoffloadError(f"unknown strategy {name!r}: one of {', '.join(STRATEGIES + POLICIES + ('tuned',))}")


@dataclass
class Row:
    model: str
    size_mb: float
    budget: str
    budget_mb: float
    strategy: str
    runs: int
    tok_s_mean: float
    tok_s_sd: float
    ttft_s_mean: float
    peak_mb: float
    enforced: bool
    predicted_tok_s: float = 0.0  # the plan's cost model, for streamed runs
    roofline_tok_s: float = 0.0
    read_gb_s: float = 0.0  # what the streamed runs read over their time, mean
    error: str = ""


def run(model_spec, mems, strategies, repetitions, n_predict, prompt, n_ctx, n_threads) -> list[Row]:
    from flexoffload import api

    path = catalog.resolve(model_spec)
    model = load(path)
    if repetitions < 1:
        raise FlexoffloadError("-r must be at least 1")
    budgets_bytes = [(m, budgets.parse_size(m, model.file_size)) for m in mems]
    for name in strategies:
        strategy_fields(name)  # unknown names fail before anything runs
    profile = None
    if any(name != "mmap" for name in strategies):
        from flexoffload.measure import profiler

        profile = profiler.measure(model, n_threads)
    unavailable = budgets.cgroup_unavailable()
    if unavailable:
        raise FlexoffloadError(f"bench needs enforced budgets: {unavailable}")
    if not budgets.drop_page_cache():
        log.info("cannot drop the page cache here (needs root); runs after the first start warm")
    rows = []
    total = len(budgets_bytes) * len(strategies) * repetitions
    log.info("bench: %d runs (%d budgets x %d strategies x %d), each a fresh process in its own cgroup, cold "
             "(the table at the end)", total, len(budgets_bytes), len(strategies), repetitions)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=None) as bar:
        for label, limit in budgets_bytes:
            if "tuned" in strategies:
                from flexoffload.measure import tuning

                if tuning.cached(model, limit, n_ctx, 512) is None:
                    bar.set_postfix_str(f"{label} tuning")
                    api.tune(model, limit, n_ctx, 512)
            # the strategies in turn within each repetition, not one strategy's repetitions in a row: the disk's
            # speed drifts over minutes here, and this spreads the drift over all strategies alike
            runs = {name: [] for name in strategies}
            errors = {}
            for _ in range(repetitions):
                for strategy in strategies:
                    bar.update(1)
                    if strategy in errors:
                        continue
                    bar.set_postfix_str(f"{label} {strategy}")
                    request = api.Request(model=str(path), prompt=prompt or DEFAULT_PROMPT, n_predict=n_predict,
                                          n_ctx=n_ctx, n_threads=n_threads, temp=0, mem=str(limit),
                                          **strategy_fields(strategy))
                    try:
                        prepared = api.prepare(request)
                        budgets.drop_page_cache()
                        runs[strategy].append(api.run_in_cgroup(prepared, limit))
                    except FlexoffloadError as e:
                        errors[strategy] = str(e)
                    if bar.disable:  # no bar (stderr is no terminal): a line a run
                        got = errors.get(strategy) or f"{runs[strategy][-1]['decode_tok_s']:.2f} tok/s"
                        log.info("bench %d/%d: %s %s: %s", bar.n, total, label, strategy, got)
            for strategy in strategies:
                results = runs[strategy]
                speeds = [r["decode_tok_s"] for r in results]
                plan = (results[-1].get("plan") or {}) if results else {}
                rows.append(Row(
                    model=model.path.name, size_mb=model.file_size / MiB, budget=label, budget_mb=limit / MiB,
                    strategy=strategy, runs=len(speeds),
                    tok_s_mean=statistics.fmean(speeds) if speeds else 0.0,
                    tok_s_sd=statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
                    ttft_s_mean=statistics.fmean(r["ttft_s"] for r in results) if results else 0.0,
                    peak_mb=max((r["peak_mem_mb"] for r in results), default=0.0),
                    enforced=all(r["enforced"] for r in results),
                    predicted_tok_s=plan.get("predicted_tok_s", 0.0), roofline_tok_s=plan.get("roofline_tok_s", 0.0),
                    read_gb_s=statistics.fmean(r.get("timings", {}).get("stream_read_gb_s", 0.0) for r in results)
                    if results else 0.0,
                    error=errors.get(strategy, "")))
            if profile is not None:
                rows.append(roofline_row(model, profile, label, limit, n_ctx))
    return rows


def roofline_row(model, profile, label: str, limit: int, n_ctx: int, n_batch: int = 512) -> Row:
    """What any resident set could reach at this budget if streaming were perfect (the issue's definition)."""
    from flexoffload.measure import probe
    from flexoffload.memory.footprint import slack
    from flexoffload.plan.costmodel import roofline
    from flexoffload.plan.planners import ceiling

    run = probe.measure(model, n_ctx, n_batch)
    capacity = limit - run.total - run.runtime - run.code - slack(limit)
    tok_s = roofline(model, ceiling(profile), max(capacity, 0))
    return Row(model=model.path.name, size_mb=model.file_size / MiB, budget=label, budget_mb=limit / MiB,
               strategy="roofline", runs=0, tok_s_mean=tok_s, tok_s_sd=0.0, ttft_s_mean=0.0, peak_mb=0.0,
               enforced=False, roofline_tok_s=tok_s)


def markdown(rows: list[Row]) -> str:
    """A table in llama-bench's style."""
    lines = ["| model | size | budget | strategy | tok/s | ttft s | peak MB | read GB/s |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r.strategy == "roofline":
            speed = f"{r.tok_s_mean:.2f}"
        else:
            speed = f"{r.tok_s_mean:.2f} ± {r.tok_s_sd:.2f}" if r.runs else f"failed: {r.error}"
        lines.append(f"| {r.model} | {r.size_mb:.0f} MiB | {r.budget} ({r.budget_mb:.0f} MiB) | {r.strategy} | "
                     f"{speed} | {r.ttft_s_mean:.2f} | {r.peak_mb:.0f} | {r.read_gb_s:.2f} |")
    return "\n".join(lines)


def write_csv(rows: list, path: str) -> None:
    """Rows (dataclasses like Row, or dicts with the same keys) as CSV, a header first (the scripts use it too)."""
    rows = [asdict(r) if is_dataclass(r) else r for r in rows]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["model"])
        w.writeheader()
        w.writerows(rows)

"""`flexoffload bench`: decode speed and peak memory per budget and strategy.

Every run is a fresh `flexoffload run` process in its own memory cgroup at the budget, after the page
cache is dropped (where permitted), so each starts cold and the kernel holds it to the budget.
"""

from __future__ import annotations

import csv
import statistics
import sys
from dataclasses import asdict, dataclass

from tqdm import tqdm

from . import FlexoffloadError
from . import budget as budgets
from . import models as catalog
from .budget import MiB
from .model import load

DEFAULT_PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list of numbers in ascending order.\"\"\"\n"


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
    error: str = ""


def run(model_spec, mems, strategies, repetitions, n_predict, prompt, n_ctx, n_threads, echo) -> list[Row]:
    from .cli import run_in_cgroup

    path = catalog.resolve(model_spec)
    model = load(path)
    if repetitions < 1:
        raise FlexoffloadError("-r must be at least 1")
    budgets_bytes = [(m, budgets.parse_size(m, model.file_size)) for m in mems]
    if not budgets.drop_page_cache():
        echo("flexoffload: cannot drop the page cache here (needs root); runs after the first start warm")
    rows = []
    total = len(budgets_bytes) * len(strategies) * repetitions
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=None) as bar:
        for label, limit in budgets_bytes:
            for strategy in strategies:
                speeds, ttfts, peaks, error, enforced = [], [], [], "", True
                for _ in range(repetitions):
                    bar.set_postfix_str(f"{label} {strategy}")
                    args = ["-m", str(path), "-p", prompt or DEFAULT_PROMPT, "-n", str(n_predict), "-c", str(n_ctx),
                            "-t", str(n_threads), "--temp", "0", "--mem", str(limit), "--strategy", strategy,
                            "--json"]
                    budgets.drop_page_cache()
                    try:
                        cgroup = budgets.MemoryCgroup(limit)
                    except FlexoffloadError as e:
                        raise FlexoffloadError(f"bench needs enforced budgets: {e}") from None
                    try:
                        with cgroup:
                            result = run_in_cgroup(cgroup, args, quiet=True)
                    except FlexoffloadError as e:
                        error = str(e)
                        bar.update(repetitions - len(speeds))
                        break
                    speeds.append(result["decode_tok_s"])
                    ttfts.append(result["ttft_s"])
                    peaks.append(result["peak_mem_mb"])
                    enforced = enforced and result["enforced"]
                    bar.update(1)
                rows.append(Row(
                    model=model.path.name, size_mb=model.file_size / MiB, budget=label, budget_mb=limit / MiB,
                    strategy=strategy, runs=len(speeds),
                    tok_s_mean=statistics.fmean(speeds) if speeds else 0.0,
                    tok_s_sd=statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
                    ttft_s_mean=statistics.fmean(ttfts) if ttfts else 0.0,
                    peak_mb=max(peaks) if peaks else 0.0, enforced=enforced, error=error))
    return rows


def markdown(rows: list[Row]) -> str:
    """A table in llama-bench's style."""
    lines = ["| model | size | budget | strategy | tok/s | ttft s | peak MB |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        speed = f"{r.tok_s_mean:.2f} ± {r.tok_s_sd:.2f}" if r.runs else f"failed: {r.error}"
        lines.append(f"| {r.model} | {r.size_mb:.0f} MiB | {r.budget} ({r.budget_mb:.0f} MiB) | {r.strategy} | "
                     f"{speed} | {r.ttft_s_mean:.2f} | {r.peak_mb:.0f} |")
    return "\n".join(lines)


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()) if rows else ["model"])
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))

#!/usr/bin/env python3
"""The cost model's predicted tok/s against measured runs, with the disk as the profile measured it once and as
the recent runs have met it (profiler.typical_disk_bw), and which way `run -md` decides under each.

This disk drifts between about 0.8 and 2.2 GB/s over minutes, so a profile's passes are one sample. Each round
runs every budget in turn, each run an enforced cgroup with the page cache dropped; before each run one pass of
the profile's reads says where the disk is now. The runs themselves add to the history the typical bandwidth is
taken from, as any run does.

    scripts/checks/check_prediction.py --mem 0.4x,0.6x,0.8x -r 3 -n 32 -o results/prediction_qwen1.5b.csv
    scripts/checks/check_prediction.py --decide --mem 0.8x -r 3 -n 64 -o results/prediction_md_qwen1.5b.csv

--decide runs `run -md` as a user would (speculating or not as it decides) and the target alone, in turn.

Writes a CSV row per run as it goes.
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

from flexoffload import FlexoffloadError
from flexoffload import api
from flexoffload.gguf import catalog
from flexoffload.measure import profiler
from flexoffload.memory import budgets
from flexoffload.bench.sweep import write_csv
from flexoffload.gguf.model import load

DRAFT = "qwen2.5-coder-0.5b-instruct"


def request(model: str, mem: int, n_predict: int, n_ctx: int, draft: str | None = None) -> api.Request:
    return api.Request(model=model, prompt="def quicksort(arr):", n_predict=n_predict, n_ctx=n_ctx, n_batch=64,
                       mem=str(mem), temp=0.0, draft=draft)


def predicted(model: str, mem: int, n_ctx: int, raw: bool) -> tuple[float, bool | None]:
    """The plan's predicted tok/s, and whether `run -md` would speculate (None: the draft does not fit); raw: with
    the profile's own disk measure, as before the runs' history counted."""
    measure = profiler.measure
    if raw:
        measure = profiler.as_measured
    with mock.patch.object(profiler, "measure", measure):
        alone = api.prepare(request(model, mem, 64, n_ctx)).plan.predicted_tok_s
        try:
            with_draft = api.prepare(request(model, mem, 64, n_ctx, DRAFT)).draft is not None
        except FlexoffloadError:
            with_draft = None
    return alone, with_draft


def decide(a, path: str, model) -> None:
    """`run -md` with its own decision, and the target alone, in turn: decode tok/s of each."""
    rows = []
    for round_ in range(1, a.rounds + 1):
        for text in a.mem.split(","):
            mem = budgets.parse_size(text, model.file_size)
            alone = None
            for config, draft in (("alone", None), ("-md", DRAFT)):
                budgets.drop_page_cache()
                out = api.generate(request(path, mem, a.n_predict, a.ctx_size, draft), enforce=True, timeout=600)
                alone = alone or out["tokens"]
                rows.append({"round": round_, "budget": text, "config": config, "speculated": "draft" in out,
                             "same_as_alone": out["tokens"] == alone,
                             "typical_gb_s": profiler.measure(model, 2).disk_bw / 1e9, "tok_s": out["decode_tok_s"],
                             "tokens_per_pass": out["timings"].get("tokens_per_pass", 1.0),
                             "text": out.get("text", "")[:60]})
                write_csv(rows, a.output)
                print(rows[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--mem", default="0.4x,0.6x,0.8x")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--decide", action="store_true", help="run -md as decided, against the target alone")
    a = ap.parse_args()
    path = str(catalog.resolve(a.model))
    model = load(path)
    if a.decide:
        decide(a, path, model)
        return
    rows = []
    for round_ in range(1, a.rounds + 1):
        for text in a.mem.split(","):
            mem = budgets.parse_size(text, model.file_size)
            raw_tok_s, raw_draft = predicted(path, mem, a.ctx_size, raw=True)
            typical_tok_s, typical_draft = predicted(path, mem, a.ctx_size, raw=False)
            budgets.drop_page_cache()
            disk_now = profiler.disk_speed(model, passes=1).bandwidth
            row = {"round": round_, "budget": text, "budget_mb": mem / 2**20,
                   "profile_gb_s": profiler.as_measured(model, 2).disk_bw / 1e9,
                   "typical_gb_s": profiler.measure(model, 2).disk_bw / 1e9,
                   "runs_seen": len(profiler.seen_disk_bw(path)), "disk_now_gb_s": disk_now / 1e9,
                   "predicted_profile": raw_tok_s, "predicted_typical": typical_tok_s,
                   "md_speculates_profile": raw_draft, "md_speculates_typical": typical_draft}
            budgets.drop_page_cache()
            try:
                out = api.generate(request(path, mem, a.n_predict, a.ctx_size), enforce=True, timeout=600)
                t = out["timings"]
                row.update(tok_s=out["decode_tok_s"], read_gb_s=t["stream_read_gb_s"], stall_s=t["stream_stall_s"],
                           error="")
            except Exception as e:  # noqa: BLE001 (a failed run is a row, the rest go on)
                row.update(tok_s=0.0, read_gb_s=0.0, stall_s=0.0, error=str(e).splitlines()[0])
            for key in ("predicted_profile", "predicted_typical"):
                row[f"{key}_over"] = row[key] / row["tok_s"] if row["tok_s"] else 0.0
            rows.append(row)
            write_csv(rows, a.output)
            print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    for key in ("predicted_profile_over", "predicted_typical_over"):
        ratios = [r[key] for r in rows if r[key]]
        if ratios:
            print(f"{key}: median {statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()

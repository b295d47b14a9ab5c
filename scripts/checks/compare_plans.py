#!/usr/bin/env python3
"""Plans against each other in one process, in turn: decode tok/s and stall of each, and the disk's passes.

`flexoffload bench` runs every strategy as a fresh process in a cgroup; this runs the plans of one budget back to
back in one process (no cgroup), so that two resident sets that stream nearly the same bytes meet the disk in the
same state. A plan is a policy name (`none`: nothing but the small tensors resident, as prefetch), or
`balanced-kept` / `balanced-streamed`: balanced with the output matrix kept, or streamed, whatever the cost model's
OUTPUT_MARGIN says; `:wK` after it fixes the window at K instead of the fastest predicted (`balanced:w3`).

    scripts/checks/compare_plans.py --mem 0.5x --plans balanced-kept,balanced-streamed -r 4 -n 20 \
        -o results/plans_05x.csv
    scripts/checks/compare_plans.py --mem 0.4x --plans balanced,balanced:w3,none:w3 -r 3 -n 16 -o results/plans_04x.csv
    scripts/checks/compare_plans.py --disk -o results/disk_qwen1.5b.csv     # the profile's read passes, cold first

Writes a CSV row per run (or per disk pass).
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock

from flexoffload.memory import budgets
from flexoffload.runtime import engine
from flexoffload.gguf import catalog
from flexoffload.plan import planners
from flexoffload.plan import plans
from flexoffload.measure import profiler
from flexoffload.native import stream
from flexoffload.gguf.model import load
from flexoffload.measure import probe
from flexoffload.plan.planners import balanced
from flexoffload.bench.sweep import write_csv


def make(model, prof, mem: int, name: str, n_ctx: int):
    """The plan called name at budget mem."""
    name, _, window = name.partition(":w")
    window = int(window) if window else None
    run = probe.measure(model, n_ctx, 512)
    if name in ("balanced-kept", "balanced-streamed"):
        margin = 1e9 if name.endswith("kept") else -0.99
        with mock.patch.object(balanced, "OUTPUT_MARGIN", margin):
            return planners.plan_budget(model, mem, "balanced", prof, run, window=window)
    return planners.plan_budget(model, mem, name, prof, run, window=window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--mem", default="0.5x")
    ap.add_argument("--plans", default="balanced-kept,balanced-streamed")
    ap.add_argument("-r", "--repetitions", type=int, default=4)
    ap.add_argument("-n", "--n-predict", type=int, default=20)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--disk", action="store_true", help="measure the disk's read passes instead (page cache dropped)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    model = load(catalog.resolve(a.model))
    if a.disk:
        budgets.drop_page_cache()
        disk = profiler.disk_speed(model, passes=5)
        rows = [{"model": model.path.name, "pass": i + 1, "gb_s": rate / 1e9} for i, rate in enumerate(disk.passes)]
    else:
        prof = profiler.measure(model, 2)
        mem = budgets.parse_size(a.mem, model.file_size)
        names = [t.name for t in model.tensors]
        made = {name: make(model, prof, mem, name, a.ctx_size) for name in a.plans.split(",")}
        rows = []
        for rep in range(a.repetitions):
            for name, p in made.items():
                settings = engine.Settings(n_ctx=a.ctx_size, n_threads=2, temp=0.0, strategy="stream", window=p.window,
                                           streamed_patterns=tuple(plans.override_patterns(list(p.streamed), names)))
                with engine.Engine(str(model.path), settings) as e:
                    out = e.generate("def quicksort(arr):", a.n_predict)
                    st = stream.stats()
                rows.append({"model": model.path.name, "budget": a.mem, "plan": name, "rep": rep + 1,
                             "output_streamed": "output.weight" in p.streamed, "window": p.window,
                             "predicted_tok_s": p.predicted_tok_s, "tok_s": out.decode_tok_s,
                             "stall_s": st.t_stall_s, "mib_a_pass": st.bytes_read / max(st.n_passes, 1) / 2**20})
                print(f"{name} #{rep + 1}: {out.decode_tok_s:.2f} tok/s (predicted {p.predicted_tok_s:.2f})",
                      file=sys.stderr, flush=True)
    write_csv(rows, a.output)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Would each layer's own slot count pay? The calibration routing (the trace `profile --experts` caches) replayed
through each layer's cache at every even slot count, then the best split of the same total slots over the layers
(dynamic programming over the layers, exact at that step) against the same count for every layer (what the runtime
takes). Issue 42 asked for slot counts by layer, "early layers touch far more experts"; this says how much hit rate
that is worth on a model before anything is built for it.

    scripts/checks/per_layer_slots.py MODEL.gguf [--slots 20,54] [--policy lfu] -o results/moe_per_layer_slots.csv
"""

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flexoffload.gguf.model import load  # noqa: E402
from flexoffload.measure import tracing  # noqa: E402
from flexoffload.plan import replay  # noqa: E402

STEP = 2  # slot counts tried: every STEP-th


def best_split(curves: dict[int, tuple[int, ...]], n_layer: int, total: int) -> tuple[int, list[int]]:
    """The least misses over all layers with `total` slots split among them in steps of STEP, and the split."""
    inf = float("inf")
    steps = total // STEP
    best = [0.0] + [inf] * steps  # best[b]: least misses of the layers so far using b steps
    choice = []
    for il in range(n_layer):
        new, took = [inf] * (steps + 1), [0] * (steps + 1)
        for b, misses in enumerate(best):
            if misses == inf:
                continue
            for j in range(0, min(max(curves) // STEP, steps - b) + 1):
                v = misses + curves[STEP * j][il]
                if v < new[b + j]:
                    new[b + j], took[b + j] = v, j
        best = new
        choice.append(took)
    b = min(range(steps + 1), key=lambda i: best[i])
    split = []
    for il in reversed(range(n_layer)):
        j = choice[il][b]
        split.append(STEP * j)
        b -= j
    return int(min(best)), split[::-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--slots", default="20,54", help="slots a layer for every layer, a comma list")
    ap.add_argument("--policy", default="lfu")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    model = load(Path(a.model))
    trace = tracing.cached(model)
    if trace is None:
        sys.exit(f"no calibration trace for {model.path.name}: `flexoffload profile --experts -m {a.model}` first")
    curves = {s: replay.simulate(trace, s, a.policy).misses_by_layer for s in range(0, model.n_expert + 1, STEP)}
    requests = replay.simulate(trace, 0, a.policy).requests
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "policy", "slots", "hit_rate_same", "hit_rate_by_layer", "split_min", "split_max",
                    "tokens"])
        for slots in (int(x) for x in a.slots.split(",")):
            same = sum(curves[slots])
            least, split = best_split(curves, model.n_layer, slots * model.n_layer)
            row = [model.path.name, a.policy, slots, round(1 - same / requests, 4), round(1 - least / requests, 4),
                   min(split), max(split), trace.n_tokens]
            w.writerow(row)
            print(f"{slots} slots a layer: hits {1 - same / requests:.2%}; the best split of as many "
                  f"({min(split)}-{max(split)} a layer) {1 - least / requests:.2%}", flush=True)


if __name__ == "__main__":
    main()

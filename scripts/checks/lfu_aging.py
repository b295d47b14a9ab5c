#!/usr/bin/env python3
"""Would an LFU whose counts age hit more? The calibration routing (the trace `profile --experts` caches) replayed
through each layer's cache of `slots` experts: LFU as the runtime keeps it (tokens routed to an expert since the
start, patch 0028; replay.simulate) against counts that age, each token's routing weighing 1/decay times the one
before it (decay 1: plain LFU, computed here again as a check of this replay), and Belady's bound. The first
--prompt tokens are one step, a prompt's pass, uncounted; then a token a step. Item 3 of issue 53 asks for fewer
bytes a token at 4 GiB, where a token costs its reads: this says whether the policy is where they are.

    scripts/checks/lfu_aging.py MODEL.gguf [--slots 20,54] [--prompt 503] -o results/moe_lfu_aging.csv
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flexoffload import native  # noqa: E402
from flexoffload.bench.sweep import write_csv  # noqa: E402
from flexoffload.gguf.model import load  # noqa: E402
from flexoffload.measure import tracing  # noqa: E402
from flexoffload.native import tools  # noqa: E402
from flexoffload.plan import replay  # noqa: E402

DECAYS = (1.0, 0.999, 0.995, 0.99, 0.98, 0.95)


def aged(trace: replay.Trace, slots: int, decay: float, first: int) -> float:
    """The decoded tokens' hit rate with counts that age: an expert's count is the sum over the tokens routed to it
    of (1/decay)^t (t: the token's index), so older tokens weigh less; ties and the kept-while-used rule as the
    runtime's (the experts a step uses are given back last)."""
    growth, hits, requests = 1.0 / decay, 0, 0
    steps = [(0, first)] + [(t, t + 1) for t in range(first, trace.n_tokens)]
    for layer in range(trace.n_layer):
        counts: dict[int, float] = {}
        cached: set[int] = set()
        for s, (t0, t1) in enumerate(steps):
            used: dict[int, int] = {}
            for e in trace.ids[t0:t1, layer].ravel().tolist():
                used[e] = used.get(e, 0) + 1
            weight = growth ** (t1 - 1)
            for e, rows in used.items():
                if s > 0:
                    requests += 1
                    hits += e in cached
                counts[e] = counts.get(e, 0.0) + rows * weight
                cached.add(e)
            over = len(cached) - slots
            if over > 0:
                order = sorted(cached, key=lambda x: (x in used, counts[x]))  # unused and least counted first
                cached.difference_update(order[:over])
    return hits / max(requests, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--slots", default="20,54")
    ap.add_argument("--prompt", type=int, default=503, help="tokens of the prompt's pass (one step, uncounted)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    model = load(a.model)
    trace = tracing.trace(model, None, n_threads=2)
    made = {"commit": tools.commit(), "native": native.key()}  # the build that traced the routing, where not cached
    rows = []
    for slots in (int(s) for s in a.slots.split(",")):
        lfu = replay.simulate(trace, slots, "lfu", first=a.prompt).hit_rate
        belady = replay.simulate(trace, slots, "belady", first=a.prompt).hit_rate
        for decay in DECAYS:
            hit = aged(trace, slots, decay, a.prompt)
            rows.append({"model": Path(a.model).name, "tokens": trace.n_tokens, "prompt": a.prompt, "slots": slots,
                         "decay": decay, "hit_rate": round(hit, 4), "lfu": round(lfu, 4),
                         "belady": round(belady, 4), **made})
            print(f"{slots} slots, decay {decay}: {hit:.2%} (LFU {lfu:.2%}, Belady {belady:.2%})")
    write_csv(rows, a.output)


if __name__ == "__main__":
    main()

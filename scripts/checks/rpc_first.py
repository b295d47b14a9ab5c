#!/usr/bin/env python3
"""A first look at RPC placement: the 1.5B with its last 7, 14, 21 layers on one small machine (scripts/rpc_machines'
kind: its own netns, cgroup and a link held to --rate), two ways, against everything local with mmap: the layers'
weights placed tensor by tensor (tensors.ot; attention stays on the host) and llama.cpp's -ngl (layers with their
KV cache). Decode tok/s, greedy tokens against the local run; in turn, twice.

    scripts/checks/rpc_first.py [--rate 1gbit] [-o results/rpc_first_qwen1.5b.csv]
"""

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from flexoffload import api  # noqa: E402
from flexoffload.gguf import catalog  # noqa: E402
from flexoffload.plan import placement  # noqa: E402
from flexoffload.bench import machines as rpc  # noqa: E402
from flexoffload.memory import budgets  # noqa: E402
from flexoffload.plan import plans  # noqa: E402
from flexoffload.gguf.model import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-o", "--output", default="results/rpc_first_qwen1.5b.csv")
    opts = ap.parse_args()
    path = catalog.resolve("qwen2.5-coder-1.5b-instruct")
    m = load(path)
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp, rpc.Machines(1, memory=1200 << 20, rate=opts.rate) as machines:
        endpoint = machines.endpoints[0]
        configs = {"local mmap": (None, 0)}
        for n in (7, 14, 21):
            last = set(range(m.n_layer - n, m.n_layer))
            directory = plans.write(placement.layers_on(m, last, f"RPC0[{endpoint}]"), Path(tmp) / str(n))
            configs[f"last {n} layers' weights on RPC0 (tensors.ot)"] = (directory, 0)
            configs[f"-ngl {n} (layers with their KV cache)"] = (None, n)
        for rep in range(opts.repeats):
            for name, (directory, ngl) in configs.items():
                request = api.Request(model=str(path), prompt="def quicksort(arr):\n", n_predict=32, temp=0,
                                      n_ctx=512, n_batch=64, strategy="stream" if directory else "mmap",
                                      plan_dir=str(directory) if directory else None,
                                      rpc=endpoint if directory or ngl else None, n_gpu_layers=ngl)
                budgets.drop_page_cache()
                r = api.generate(request)
                base = base or r["tokens"]
                row = dict(config=name, rep=rep, decode_tok_s=round(r["decode_tok_s"], 2), ttft_s=round(r["ttft_s"], 3),
                           tokens_equal=r["tokens"] == base, server_peak_mb=round(max(machines.peaks()) / 2**20))
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    with open(opts.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()

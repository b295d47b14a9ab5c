#!/usr/bin/env python3
"""Does a tree need a native mask? The cost of one target pass over a token tree expressed with sequence ids in a
unified KV cache (what flexoffload does), against a linear batch of the same number of tokens (one sequence: the
cheapest mask llama.cpp builds), on the real 1.5B with all weights in memory, so compute is all there is to see.

    scripts/checks/measure_tree_mask.py [-o results/tree_mask_overhead.csv] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from flexoffload.runtime import engine
from flexoffload.gguf import catalog
from flexoffload.speculation import speculate
from flexoffload.bench.sweep import write_csv


def tree_items(pos0: int, n_tokens: int, n_branches: int, token: int) -> list[tuple[int, int, list[int], bool]]:
    """A root shared by all branches, then n_branches chains of equal length: each node in its branch's sequence."""
    items = [(token, pos0, list(range(n_branches)), True)]
    depth = (n_tokens - 1) // n_branches
    for b in range(n_branches):
        items += [(token, pos0 + 1 + d, [b], True) for d in range(depth)]
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default="results/tree_mask_overhead.csv")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    path = catalog.resolve(catalog.DEFAULT_MODEL)
    settings = speculate.target_settings(engine.Settings(n_ctx=1024, n_batch=64, temp=0.0, strategy="mmap"))
    rows = []
    with engine.Engine(path, settings) as e:
        lib, mem = e.lib, e.lib.llama_get_memory(e.ctx)
        prompt = e.tokenize("def quicksort(arr):\n" * 40)[:300]
        batch = speculate._Batch(lib, 64, speculate.MAX_BRANCHES + 1)
        for i in range(0, len(prompt), e.n_batch):  # once: each pass's cells are removed after it
            e._decode(prompt[i:i + e.n_batch])
        for n_tokens in (9, 17, 33):
            for n_branches in (1, 4, 8, 16):
                if (n_tokens - 1) % n_branches:
                    continue
                times = []
                for _ in range(args.reps):
                    for s in range(1, n_branches):
                        lib.llama_memory_seq_cp(mem, 0, s, -1, -1)
                    batch.fill(tree_items(len(prompt), n_tokens, n_branches, prompt[-1]))
                    t0 = time.perf_counter()
                    if lib.llama_decode(e.ctx, batch.batch) != 0:
                        raise SystemExit("llama_decode failed")
                    times.append(time.perf_counter() - t0)
                    for s in range(speculate.MAX_BRANCHES):
                        lib.llama_memory_seq_rm(mem, s, len(prompt) if s == 0 else -1, -1)
                rows.append({"n_tokens": n_tokens, "n_branches": n_branches, "reps": args.reps,
                             "pass_s_median": statistics.median(times), "pass_s_min": min(times)})
                print(rows[-1], flush=True)
        batch.free()
    write_csv(rows, args.output)


if __name__ == "__main__":
    main()

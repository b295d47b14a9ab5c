#!/usr/bin/env python3
"""The longest prompt upstream llama.cpp runs under a budget, against ours (issue 16, target 4: a first look).

Upstream is llama-completion as a user runs it, mmap and its defaults (-b 2048 -ub 512, flash attention auto, an
f16 KV cache), with -c just large enough for the prompt and 16 tokens (its default -c 0, the trained 32768, cannot
start under 1.0x of the 1.5B: 896 MiB of KV cache). Its need at a length is predicted with the same dry run as ours
(stepmem: its ubatch, its 512 logits rows in the graph, and one layer of page cache, the mmap minimum); then it is
run in the cgroup at its predicted longest and at 25 % more, page cache dropped. Ours: `plan --max-prompt`'s
answer (stepmem.max_prompt), not run here. One run each.

    scripts/upstream_max_prompt.py [--budgets 0.4x,0.6x,0.8x,1.0x] [-o results/max_prompt_qwen1.5b.csv]
"""

import argparse
import csv
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flexoffload import FlexoffloadError, models, native, stepmem  # noqa: E402
from flexoffload import budget as budgets  # noqa: E402
from flexoffload.budget import MiB  # noqa: E402
from flexoffload.footprint import KERNEL_FIXED, measure, smallest_budget  # noqa: E402
from flexoffload.model import load  # noqa: E402
from matrix import long_prompt  # noqa: E402

N_PREDICT = 16
TIMEOUT = 300  # seconds a run may take: past it, it is thrashing (recorded as not finished)
UPSTREAM_UBATCH = 512  # common's -ub


def upstream_need(model, n_prompt: int, n_ubatch: int = UPSTREAM_UBATCH) -> int:
    """The budget llama-completion needs for a prompt at -ub n_ubatch (the graph's logits rows: min(ubatch,
    n_batch), so the ubatch's)."""
    n_ctx = stepmem.cells_for(n_prompt + 64)
    u = min(n_ubatch, n_ctx)
    b = stepmem.buffers(model, [stepmem.Setting(n_ctx, u, "auto", n_outputs=u)])[0]
    base = measure(model, stepmem.CELLS * 2, 64)
    layer = max(model.layer_bytes(i) for i in range(model.n_layer))
    return smallest_budget(b.total + base.heap + base.sampling + base.runtime + base.code + KERNEL_FIXED + layer)


def upstream_longest(model, budget: int) -> int:
    """The longest prompt (to 256 tokens) whose predicted need fits: 0 if none."""
    best, n = 0, stepmem.CELLS
    while n <= model.n_ctx_train - 64 and upstream_need(model, n) <= budget:
        best, n = n, n + stepmem.CELLS
    return best


def run_upstream(path, n_prompt: int, limit: int) -> dict:
    prompt = long_prompt(path, n_prompt)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        cmd = [str(native.tool("llama-completion")), "-m", str(path), "-f", f.name, "-n", str(N_PREDICT),
               "--temp", "0", "-c", str(stepmem.cells_for(n_prompt + 64)), "-t", "2", "--no-warmup", "-no-cnv"]
        budgets.drop_page_cache()
        try:
            r = budgets.run_limited(cmd, limit, timeout=TIMEOUT)
        except FlexoffloadError as e:  # past the timeout: thrashing, not finished
            return {"ok": False, "oom_killed": False, "wall_s": TIMEOUT, "peak_mb": "", "unreclaimable_mb": str(e)[:60]}
    return {"ok": r.returncode == 0, "oom_killed": r.oom_killed, "wall_s": round(r.wall_s, 1),
            "peak_mb": round(r.peak_mem_mb, 1), "unreclaimable_mb": round(r.unreclaimable_mb, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="0.4x,0.6x,0.8x,1.0x")
    ap.add_argument("-o", "--output", default="results/max_prompt_qwen1.5b.csv")
    ap.add_argument("--predict-only", action="store_true", help="the two predictions, no run")
    opts = ap.parse_args()
    path = models.resolve("qwen2.5-coder-1.5b-instruct")
    model = load(path)
    fields = ["budget", "budget_mb", "ours_max_prompt", "ours_ubatch", "upstream_predicted_max", "ratio",
              "tried_tokens", "ok", "oom_killed", "wall_s", "peak_mb", "unreclaimable_mb"]
    with open(opts.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for label in opts.budgets.split(","):
            limit = budgets.parse_size(label, model.file_size)
            ours = stepmem.max_prompt(model, limit, N_PREDICT)
            up = upstream_longest(model, limit)
            base = {"budget": label, "budget_mb": round(limit / MiB), "ours_max_prompt": ours.n_prompt if ours else 0,
                    "ours_ubatch": ours.n_ubatch if ours else "", "upstream_predicted_max": up,
                    "ratio": round(ours.n_prompt / up, 2) if ours and up else ""}
            if opts.predict_only:
                writer.writerow(base)
                f.flush()
                continue
            for tried in ([up, int(up * 1.25)] if up else [stepmem.CELLS]):
                row = {**base, "tried_tokens": tried, **run_upstream(path, tried, limit)}
                print(row, file=sys.stderr, flush=True)
                writer.writerow(row)
                f.flush()


if __name__ == "__main__":
    main()

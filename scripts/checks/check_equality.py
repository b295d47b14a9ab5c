#!/usr/bin/env python3
"""Greedy output of `flexoffload run` (mmap, stream under a budget with the free drafters as `--spec-type auto`
decides, -md with them) against llama-completion with upstream's own attention: a build's llama-completion run
with GGML_CPU_SPLIT_KV=1 (patch 0016 off: upstream splits a lone token's attention across the threads from 512 KV
cells), and with it at flexoffload's 0.

    scripts/checks/check_equality.py -n 64 --problems 6 -o results/equality_qwen1.5b.csv
    scripts/checks/check_equality.py --sparsity 28 ...   # run --sparsity 28 against llama-completion on that
                                                         # level's file (profile --neurons first); no -md run

Below 512 cells both references must equal every run; past it upstream's split may differ at a near tie
(docs/speculation.md). A row per prompt and run; `cells` is the prompt's tokens plus those generated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from flexoffload.prompts import humaneval  # noqa: E402
from flexoffload.gguf import catalog  # noqa: E402
from flexoffload import native  # noqa: E402
from flexoffload.bench.sweep import write_csv  # noqa: E402

RUNS = {"mmap": ["--strategy", "mmap"], "stream 0.6x": ["--mem", "0.6x", "--enforce"],
        "stream 0.4x": ["--mem", "0.4x", "--enforce"],  # --spec-type auto: free drafters where they pay
        "-md 0.8x": ["--mem", "0.8x", "--enforce", "-md", catalog.DRAFT_MODEL]}


def llama_completion(model: str, prompt: str, n: int, ctx: int, split: str) -> str:
    cmd = [str(native.tool("llama-completion")), "-m", model, "-p", prompt, "-n", str(n), "--temp", "0",
           "-c", str(ctx), "-b", "512", "-t", "2", "-lm", "mmap", "--no-repack", "-no-cnv", "--no-display-prompt",
           "--simple-io", "--no-warmup"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                       env={**os.environ, "GGML_CPU_SPLIT_KV": split})
    if r.returncode != 0:
        raise SystemExit(f"llama-completion failed: {r.stderr.strip().splitlines()[-1]}")
    return r.stdout[:-2]  # completion.cpp ends with "\n\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-c", "--ctx-size", type=int, default=2048)
    ap.add_argument("--problems", type=int, default=6, help="HumanEval problems of 40-163, evenly spaced")
    ap.add_argument("--sparsity", type=int, default=None, help="every run with --sparsity K, against that level's file")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    model = str(catalog.resolve(a.model))
    reference, runs = model, RUNS
    if a.sparsity:  # the file run --sparsity K runs (a copy of the grouped file at K) is what llama.cpp must match
        from flexoffload.gguf import moefy
        from flexoffload.gguf.model import load
        from flexoffload.measure import sparsity

        grouped = sparsity.load_cached(load(model))
        if grouped is None:
            sys.exit("no profile --neurons of the model: run it first")
        reference = str(moefy.with_used(grouped.file, a.sparsity))
        runs = {f"{name} --sparsity {a.sparsity}": [*extra, "--sparsity", str(a.sparsity)]
                for name, extra in RUNS.items() if "-md" not in extra}
    rows = []
    for task, prompt in humaneval.prompts(humaneval.evaluation_ids(a.problems)):
        upstream = llama_completion(reference, prompt, a.n_predict, a.ctx_size, "1")
        ours_ref = llama_completion(reference, prompt, a.n_predict, a.ctx_size, "0")
        for name, extra in runs.items():
            cmd = [sys.executable, "-m", "flexoffload", "run", "-m", model, "-p", prompt, "-n", str(a.n_predict),
                   "--temp", "0", "-t", "2", "-c", str(a.ctx_size), "--json", *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
            out = json.loads(r.stdout) if r.returncode == 0 else {}
            text = out.get("text")
            rows.append({"task": task, "run": name, "cells": out.get("n_prompt", 0) + out.get("n_gen", 0),
                         "speculated": ",".join(out.get("spec", {}).get("types", [])) or "none", "equals_upstream_split": text == upstream,
                         "equals_split_off": text == ours_ref, "upstream_split_equals_off": upstream == ours_ref,
                         "error": "" if r.returncode == 0 else r.stderr.strip().splitlines()[-1]})
            write_csv(rows, a.output)
            print(rows[-1], flush=True)


if __name__ == "__main__":
    main()

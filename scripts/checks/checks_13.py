#!/usr/bin/env python3
"""The smaller measurements the issue-13 and -15 notes quote, each to a CSV under results/:

- load_modes: upstream llama-bench, decode of 64 tokens with the weights mmapped, mlocked or read (-lm), 3 reps,
  twice in turn: what keeping every weight resident costs against mmap, in llama.cpp itself;
- predictions: the 1.5B streamed at 0.5x and 0.8x (enforced, cold): predicted against measured tok/s, and what the
  runs read (bytes over the run's time) against the profile's disk bandwidth;
- one_group: the 1.5B with only output.weight streamed (one streaming group), windows 0 and 3: passes and stall;
- ops: `profile --ops` of the 1.5B, per tensor;
- precision: llama-perplexity's KL divergence of the 1.5B requantized to Q3_K_M against the file's own, on a
  calibration text of the standard library's docstrings (-c 512, 6 chunks), with the time each step took.

    scripts/checks/checks_13.py [--only NAME,...]
"""

import argparse
import csv
import pydoc
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from flexoffload import api  # noqa: E402
from flexoffload.gguf import catalog  # noqa: E402
from flexoffload import native  # noqa: E402
from flexoffload.measure import opprofile  # noqa: E402
from flexoffload.memory import budgets  # noqa: E402
from flexoffload.plan import plans  # noqa: E402
from flexoffload.measure import profiler  # noqa: E402
from flexoffload.gguf.model import load  # noqa: E402

RESULTS = REPO / "results"
MODEL = catalog.resolve("qwen2.5-coder-1.5b-instruct")


def write(name: str, rows: list[dict]) -> None:
    with open(RESULTS / name, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"checks: {RESULTS / name}", file=sys.stderr)


def load_modes() -> None:
    rows = []
    for rep in range(2):
        out = subprocess.run([str(native.tool("llama-bench")), "-m", str(MODEL), "-p", "0", "-n", "64", "-t", "2",
                              "-lm", "mmap,mlock,none", "-r", "3", "--repack", "0", "-o", "csv"],
                             capture_output=True, text=True, timeout=900, check=True).stdout
        for r in csv.DictReader(out.splitlines()):
            rows.append({"rep": rep, "load_mode": r["load_mode"], "tok_s": round(float(r["avg_ts"]), 2),
                         "sd": round(float(r["stddev_ts"]), 2)})
    write("llama_bench_load_modes.csv", rows)


def predictions() -> None:
    model = load(MODEL)
    disk = profiler.measure(model, 2).disk_bw
    rows = []
    for rep in range(2):
        for mem in ("0.5x", "0.8x"):
            p = api.prepare(api.Request(model=str(MODEL), prompt="def quicksort(arr):", n_predict=32, temp=0, mem=mem))
            budgets.drop_page_cache()
            res = api.run_in_cgroup(p, p.limit, timeout=900)
            t = res["timings"]
            rows.append({"rep": rep, "budget": mem, "predicted_tok_s": round(p.plan.predicted_tok_s, 2),
                         "measured_tok_s": round(res["decode_tok_s"], 2),
                         "profile_disk_gb_s": round(disk / 1e9, 2), "run_read_gb_s": round(t["stream_read_gb_s"], 2),
                         "read_mib_per_pass": round(t["stream_bytes_read"] / max(t["stream_passes"], 1) / 2**20)})
    write("predictions_qwen1.5b.csv", rows)


def one_group() -> None:
    model = load(MODEL)
    names = tuple(t.name for t in model.tensors)
    kept = tuple(n for n in names if n != "output.weight")
    plan = plans.Plan(model=str(MODEL), policy="hand", budget=0,
                      memory=plans.Memory(resident=sum(t.n_bytes for t in model.tensors if t.name in kept), window=0,
                                          kv_cache=0, compute=0, overhead=0),
                      resident=kept, streamed=("output.weight",), window=3, io_threads=4, predicted_tok_s=0,
                      roofline_tok_s=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plans.write(plan, tmp)
        for rep in range(2):
            for window in (0, 3):
                budgets.drop_page_cache()
                res = api.generate(api.Request(model=str(MODEL), prompt="def quicksort(arr):", n_predict=16, temp=0,
                                               plan_dir=tmp, window=window))
                t = res["timings"]
                rows.append({"rep": rep, "window": window, "decode_tok_s": round(res["decode_tok_s"], 2),
                             "n_gen": res["n_gen"], "stream_passes": t["stream_passes"], "reads": t["stream_reads"],
                             "stall_ms_per_token": round(t["stream_stall_s"] / res["n_gen"] * 1e3, 1)})
    write("one_group_qwen1.5b.csv", rows)


def ops() -> None:
    model = load(MODEL)
    p = opprofile.cached(model, 2, 64, remeasure=True)
    kinds = {t.name: t.kind for t in model.tensors}
    rows = [{"tensor": n, "kind": kinds.get(n, "?"), "decode_ms": round(s * 1e3, 4),
             "ubatch64_ms": round(p.prompt.get(n, 0.0) * 1e3, 3)} for n, s in p.decode.items()]
    rows.append({"tensor": "(other ops)", "kind": "", "decode_ms": round(p.others_decode_s * 1e3, 4), "ubatch64_ms": ""})
    write("ops_qwen1.5b.csv", rows)


def precision() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "calibration.txt"
        text.write_text("\n".join(pydoc.render_doc(__import__(m), renderer=pydoc.plaintext) for m in (
            "json", "collections", "itertools", "functools", "pathlib", "subprocess", "argparse", "dataclasses",
            "textwrap", "statistics")))
        base, q3 = Path(tmp) / "base.kld", Path(tmp) / "q3.gguf"
        common = ["-c", "512", "--chunks", "6", "-t", "2"]
        t0 = time.perf_counter()
        out = subprocess.run([str(native.tool("llama-perplexity")), "-m", str(MODEL), "-f", str(text), *common,
                              "--kl-divergence-base", str(base)], capture_output=True, text=True, timeout=900,
                             check=True)
        t_base = time.perf_counter() - t0
        ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", out.stdout + out.stderr).group(1))
        t0 = time.perf_counter()
        subprocess.run([str(native.tool("llama-quantize")), "--allow-requantize", str(MODEL), str(q3), "Q3_K_M", "2"],
                       capture_output=True, text=True, timeout=900, check=True)
        t_quant = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = subprocess.run([str(native.tool("llama-perplexity")), "-m", str(q3), *common, "--kl-divergence-base",
                              str(base), "--kl-divergence"], capture_output=True, text=True, timeout=900, check=True)
        t_kld = time.perf_counter() - t0
        log = out.stdout + out.stderr
        rows = [{"model": MODEL.name, "type": "Q4_K_M (file)", "size_mib": round(MODEL.stat().st_size / 2**20),
                 "ppl": ppl, "mean_kld": 0.0, "kld_99_9": 0.0, "seconds": round(t_base, 1)},
                {"model": MODEL.name, "type": "Q3_K_M (requantized)", "size_mib": round(q3.stat().st_size / 2**20),
                 "ppl": "", "mean_kld": float(re.search(r"Mean\s+KLD:\s+([\d.]+)", log).group(1)),
                 "kld_99_9": float(re.search(r"99\.9%\s+KLD:\s+([\d.]+)", log).group(1)),
                 "seconds": round(t_quant + t_kld, 1)}]
    write("precision_first_check_qwen1.5b.csv", rows)


CHECKS = {"load_modes": load_modes, "predictions": predictions, "one_group": one_group, "ops": ops,
          "precision": precision}

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(CHECKS))
    for name in ap.parse_args().only.split(","):
        CHECKS[name]()

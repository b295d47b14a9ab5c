#!/usr/bin/env python3
"""The per-step memory estimate against the cgroup (issue 16, item 1): a prefill of a long prompt at each ubatch
size, flash attention on and off, streamed by a plan for the budget whose costs come from llama.cpp's dry run
(measure.stepmem.run_costs). Predicted: the plan's unreclaimable memory; measured: the peak of what the run cannot
give back (anonymous, locked, kernel), in a cgroup with room to spare; one run each.

    scripts/checks/check_stepmem.py [-m MODEL] [--mem 0.5x] [--prompt-tokens 2000] [-o results/stepmem_qwen1.5b.csv]

With --resident, every weight in memory (no budget: nothing for a plan to fill), so the prediction is the estimate
itself: weights + KV cache + the pass's buffers + heap, runtime and kernel, against the run's peak.
--from-ttft CSV predicts the compute-bound rows repro_hypergen measured (512-16384 tokens) the same way.
"""

import argparse
import csv
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for matrix.py

from flexoffload import api  # noqa: E402
from flexoffload.gguf import catalog  # noqa: E402
from flexoffload.runtime import engine  # noqa: E402
from flexoffload.measure.dryrun import run_costs  # noqa: E402
from flexoffload.memory import stepmem  # noqa: E402
from flexoffload.memory import budgets  # noqa: E402
from flexoffload.memory.budgets import MiB  # noqa: E402
from flexoffload.gguf.model import load  # noqa: E402
from matrix import long_prompt, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--mem", default="0.5x")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--ubatches", default="32,128,512,2048")
    ap.add_argument("-o", "--output", default="results/stepmem_qwen1.5b.csv")
    ap.add_argument("--resident", action="store_true", help="every weight resident, no budget (see above)")
    ap.add_argument("--from-ttft", metavar="CSV", help="predict repro_hypergen's compute-bound rows (see above)")
    ap.add_argument("--chosen", action="store_true",
                    help="instead: the ubatch run chooses for the prompt (plan/prefill.py), its predicted and "
                         "measured time to first token (-o results/prefill_chosen_qwen1.5b.csv)")
    opts = ap.parse_args()
    if opts.chosen:
        chosen(opts)
        return
    if opts.resident or opts.from_ttft:
        resident(opts)
        return
    path = catalog.resolve(opts.model)
    model = load(path)
    limit = budgets.parse_size(opts.mem, model.file_size)
    prompt = long_prompt(path, opts.prompt_tokens)
    n_ctx = stepmem.cells_for(opts.prompt_tokens + 64)
    fields = ["n_ubatch", "flash_attn", "n_ctx", "n_prompt", "kv_mb", "compute_mb", "predicted_mb", "measured_mb",
              "predicted_over_measured", "ttft_s", "error"]
    with open(opts.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for fa in ("on", "off"):
            for u in (int(x) for x in opts.ubatches.split(",")):
                request = api.Request(model=str(path), prompt=prompt, n_predict=4, n_ctx=n_ctx, n_batch=max(u, 512),
                                      n_ubatch=u, flash_attn=fa, temp=0, mem=str(limit), strategy="stream")
                row = {"n_ubatch": u, "flash_attn": fa, "n_ctx": n_ctx}
                try:
                    plan = api.prepare(request).plan
                    row.update(kv_mb=round(plan.memory.kv_cache / MiB, 1), compute_mb=round(plan.memory.compute / MiB, 1),
                               predicted_mb=round(plan.memory.unreclaimable / MiB, 1))
                except Exception as e:  # over the budget: recorded
                    row["error"] = str(e)[:160]
                    writer.writerow(row)
                    f.flush()
                    continue
                result, err = run(request, limit + model.file_size + (1 << 30))
                write_measured(row, result, err, writer, f)


def write_measured(row: dict, result: dict | None, err: str, writer, f) -> None:
    """A row with what its run measured (the peak against the prediction), or its error; written at once."""
    if result:
        row.update(n_prompt=result["n_prompt"], measured_mb=round(result["peak_unreclaimable_mb"], 1),
                   ttft_s=round(result["ttft_s"], 2),
                   predicted_over_measured=round(row["predicted_mb"] / result["peak_unreclaimable_mb"], 3))
    row["error"] = err[:160]
    print(row, file=sys.stderr, flush=True)
    writer.writerow(row)
    f.flush()


def predicted_resident(model, setting) -> dict:
    """The estimate of a run with every weight resident: its parts and their sum with the kernel's share (MiB)."""
    from flexoffload.memory.footprint import KERNEL_PER_BYTE

    c = run_costs(model, setting, 0)  # overhead: heap, sampling, runtime, the kernel's fixed part
    need = model.weight_bytes + c["kv_cache"] + c["compute"] + c["overhead"]
    need += int(need * KERNEL_PER_BYTE)
    return {"kv_mb": round(c["kv_cache"] / MiB, 1), "compute_mb": round(c["compute"] / MiB, 1),
            "predicted_mb": round(need / MiB, 1)}


def resident(opts) -> None:
    """--resident and --from-ttft: the estimate against runs with every weight in memory."""
    path = catalog.resolve(opts.model)
    model = load(path)
    fields = ["n_prompt", "n_ubatch", "flash_attn", "cache_type", "n_ctx", "kv_mb", "compute_mb", "predicted_mb",
              "measured_mb", "predicted_over_measured", "ttft_s", "source", "error"]
    with open(opts.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        if opts.from_ttft:
            for r in csv.DictReader(open(opts.from_ttft)):
                if r["config"] != "compute-bound" or not r["unreclaimable_mb"]:
                    continue
                n, cache, u = int(r["n_tokens"]), r["cache_type"], int(r["n_ubatch"])
                setting = stepmem.Setting(stepmem.cells_for(n + 32 + 8), u, "on", cache, cache)  # as repro_hypergen
                row = {"n_prompt": r["n_prompt"], "n_ubatch": u, "flash_attn": "on", "cache_type": cache,
                       "n_ctx": setting.n_ctx, **predicted_resident(model, setting),
                       "measured_mb": float(r["unreclaimable_mb"]), "ttft_s": r["ttft_s"], "source": opts.from_ttft}
                row["predicted_over_measured"] = round(row["predicted_mb"] / row["measured_mb"], 3)
                writer.writerow(row)
            return
        prompt = long_prompt(path, opts.prompt_tokens)
        n_ctx = stepmem.cells_for(opts.prompt_tokens + 64)
        for fa in ("on", "off"):
            for u in (int(x) for x in opts.ubatches.split(",")):
                setting = stepmem.Setting(n_ctx, u, fa)
                request = api.Request(model=str(path), prompt=prompt, n_predict=4, n_ctx=n_ctx, n_batch=max(u, 512),
                                      n_ubatch=u, flash_attn=fa, temp=0, strategy="stream")
                row = {"n_ubatch": u, "flash_attn": fa, "cache_type": "f16", "n_ctx": n_ctx,
                       **predicted_resident(model, setting), "source": "measured"}
                result, err = run(request, 4 * model.file_size + (4 << 30))
                write_measured(row, result, err, writer, f)


def measured(row: dict, request, limit: int, writer, f) -> None:
    """Run the request under the budget (cold), and write its row with what it measured."""
    result, err = run(request, limit)
    if result:
        row.update(n_prompt=result["n_prompt"], ttft_s=round(result["ttft_s"], 2),
                   decode_tok_s=round(result["decode_tok_s"], 2), measured_mb=round(result.get("peak_mem_mb", 0), 1))
    row["error"] = err[:160]
    print(row, file=sys.stderr, flush=True)
    writer.writerow(row)
    f.flush()


def chosen(opts) -> None:
    """The run's own choice of ubatch for a long prompt, at each budget of --mem (comma-separated), in turn."""
    from flexoffload.api.planning import prompt_ubatch
    from flexoffload.measure import profiler

    path = catalog.resolve("qwen2.5-coder-1.5b-instruct")
    model = load(path)
    prompt = long_prompt(path, opts.prompt_tokens)
    fields = ["mem", "config", "n_ctx", "n_prompt", "n_ubatch", "predicted_ttft_s", "ttft_s", "decode_tok_s",
              "predicted_tok_s", "measured_mb", "error"]
    with open(opts.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for mem in opts.mem.split(","):
            limit = budgets.parse_size(mem, model.file_size)
            n_ctx = max(4096, stepmem.cells_for(opts.prompt_tokens + 64))
            request = api.Request(model=str(path), prompt=prompt, n_predict=16, n_ctx=n_ctx, n_batch=512, temp=0,
                                  mem=str(limit), strategy="stream")
            row = {"mem": mem, "config": "chosen", "n_ctx": n_ctx}
            try:
                prepared = api.prepare(request)
                u = prepared.settings.n_ubatch
                _, _, first = prompt_ubatch(model, limit, engine.count_tokens(str(model.path), request.prompt),
                                            dataclasses.replace(request, io_threads=4), profiler.measure(model, 2))
                row.update(n_ubatch=u, predicted_ttft_s=round(first, 2),
                           predicted_tok_s=round(prepared.plan.predicted_tok_s, 2))
            except Exception as e:
                row["error"] = str(e)[:160]
                writer.writerow(row)
                continue
            measured(row, request, limit, writer, f)  # enforced: the budget itself
            for fixed in (int(x) for x in opts.ubatches.split(",")):  # by hand, the same prompt and budget
                hand = dataclasses.replace(request, n_ubatch=fixed, n_batch=max(512, fixed), flash_attn="on")
                row = {"mem": mem, "config": "by hand", "n_ctx": n_ctx, "n_ubatch": fixed}
                try:
                    row["predicted_tok_s"] = round(api.prepare(hand).plan.predicted_tok_s, 2)
                except Exception as e:
                    row["error"] = str(e)[:160]
                    writer.writerow(row)
                    continue
                measured(row, hand, limit, writer, f)


if __name__ == "__main__":
    main()

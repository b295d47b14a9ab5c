#!/usr/bin/env python3
"""The architecture matrix: every model shape at budgets from its minimum to 1.5x, each claim of the budget checked.

For each model (a synthetic shape of flexoffload.gguf.synth, written once into the cache, or a catalog name) and budget:
- below the planner's minimum: `run --mem B --enforce` must refuse in one line naming the minimum;
- otherwise three fresh processes, each after the page cache is dropped:
  1. streamed by the plan for B in a cgroup with room to spare (B + the model's size + 1 GiB): the peak of what the
     run cannot give back (anonymous, locked and kernel memory, sampled from memory.stat) and its peak RSS, against
     the plan's predicted memory;
  2. the same under an enforced cgroup of B: finished or killed, tok/s;
  3. upstream mmap under the same cgroup of B: tok/s, and whether its greedy tokens equal the streamed run's.

    scripts/matrix.py --models gemma3-1b,qwen2-1.5b --budgets min,0.5x,0.8x,1.1x,1.5x -n 16 -o results/matrix.csv

Writes a CSV row per model and budget as it goes, and a markdown table beside it (.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoffload import FlexoffloadError  # noqa: E402
from flexoffload import api  # noqa: E402
from flexoffload.gguf import catalog  # noqa: E402
from flexoffload.measure import probe  # noqa: E402
from flexoffload.plan import planners  # noqa: E402
from flexoffload.gguf import synth  # noqa: E402
from flexoffload.memory import budgets  # noqa: E402
from flexoffload.bench.sweep import DEFAULT_PROMPT  # noqa: E402
from flexoffload.defaults import cache_dir  # noqa: E402
from flexoffload.gguf.model import load  # noqa: E402

MiB = 1 << 20
COLUMNS = ["model", "arch", "size_mb", "n_prompt", "budget", "budget_mb", "minimum_mb", "accepted", "refusal",
           "policy", "window",
           "resident_mb", "streamed_mb", "predicted_mb", "predicted_unreclaimable_mb", "unreclaimable_mb", "rss_mb", "enforced_peak_mb", "killed",
           "error", "strategy", "stream_tok_s", "predicted_tok_s", "mmap_tok_s", "mmap_error", "tokens_equal"]


def model_path(name: str) -> Path:
    """A synthetic shape, written into the cache the first time; else a catalog name or a path."""
    if name not in synth.SHAPES:
        return catalog.resolve(name)
    path = cache_dir() / "synth" / f"{name}-q4_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        print(f"matrix: writing {name} to {path}", file=sys.stderr)
        synth.write(part, synth.SHAPES[name], "Q4_0", seed=0, output_scale=4.0)
        part.replace(path)
    return path


def long_prompt(path: Path, n_batch: int) -> str:
    """The bench prompt repeated until it fills a batch: prompt processing then uses the whole compute buffer the
    plan counts, as a user's long prompt does. Counted with the model's own vocabulary (a vocab-only load)."""
    from flexoffload.runtime import engine

    lib = engine.llama_cpp()
    engine._Log(lib, verbose=False)  # llama.cpp's log kept, not printed
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    vocab = lib.llama_model_get_vocab(model)
    text = DEFAULT_PROMPT
    while True:
        data = text.encode()
        buf = (lib.llama_token * (len(data) + 8))()
        if lib.llama_tokenize(vocab, data, len(data), buf, len(data) + 8, True, True) >= n_batch + 8:
            break
        text += DEFAULT_PROMPT
    lib.llama_model_free(model)
    return text


def run(request: api.Request, limit: int) -> tuple[dict | None, str]:
    """The request in a fresh process in a cgroup of limit bytes, cold: its result, or None and the error."""
    try:
        prepared = api.prepare(request)
        budgets.drop_page_cache()
        return api.run_in_cgroup(prepared, limit, timeout=1800), ""
    except FlexoffloadError as e:
        return None, str(e)


def refused(path: Path, mem: str, n_ctx: int, n_batch: int) -> str:
    """The one-line refusal of a budget below the minimum ('' if the run was accepted)."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "flexoffload", "run", "-m", str(path), "-p", "x", "-n", "1",
                        "-c", str(n_ctx), "-b", str(n_batch), "--mem", mem, "--enforce"],
                       capture_output=True, text=True, timeout=600)
    lines = r.stderr.strip().splitlines()
    return lines[-1] if r.returncode != 0 and len(lines) == 1 else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-gqa-3b,qwen2-1.5b,gemma3-1b,phi3-mini,qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--budgets", default="below,min,0.5x,0.8x,1.1x,1.5x",
                    help="budgets: min (the planner's minimum), below (just under it), sizes, or fractions")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-c", type=int, default=2048)
    ap.add_argument("-b", type=int, default=512)
    ap.add_argument("--long-prompt", action="store_true",
                    help="a prompt of a whole batch (-b) of tokens, so the compute buffers are used whole")
    ap.add_argument("-o", "--output", required=True)
    opts = ap.parse_args()

    out = Path(opts.output)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for name in opts.models.split(","):
            path = model_path(name)
            model = load(path)
            minimum = planners.run_minimum(model, probe.measure(model, opts.c, opts.b))
            prompt = long_prompt(path, opts.b) if opts.long_prompt else DEFAULT_PROMPT
            for label in opts.budgets.split(","):
                limit = {"min": minimum, "below": minimum - 16 * MiB}.get(label) \
                    or budgets.parse_size(label, model.file_size)
                row = {"model": name, "arch": model.arch, "size_mb": round(model.file_size / MiB),
                       "budget": label, "budget_mb": round(limit / MiB), "minimum_mb": round(minimum / MiB)}
                stream = api.Request(model=str(path), prompt=prompt, n_predict=opts.n, n_ctx=opts.c,
                                     n_batch=opts.b, temp=0, mem=str(limit))
                if limit < minimum:
                    row["refusal"] = refused(path, str(limit), opts.c, opts.b)
                    row["accepted"] = False
                    writer.writerow(row)
                    f.flush()
                    continue
                row["accepted"] = True
                roomy, err = run(stream, limit + model.file_size + (1 << 30))
                if roomy:
                    row.update(n_prompt=roomy["n_prompt"], unreclaimable_mb=round(roomy["peak_unreclaimable_mb"]),
                               rss_mb=round(roomy["peak_rss_mb"]))
                if roomy and "plan" in roomy:  # else mmap was predicted faster and ran
                    plan = roomy["plan"]
                    row.update(policy=plan["policy"], window=plan["window"], resident_mb=round(plan["resident_mb"]),
                               streamed_mb=round(plan["streamed_mb"]), predicted_mb=round(plan["memory_mb"]),
                               predicted_unreclaimable_mb=round(plan["unreclaimable_mb"]),
                               predicted_tok_s=round(plan["predicted_tok_s"], 2))
                enforced, err = run(stream, limit)
                row["killed"] = "out of memory" in err
                row["error"] = err
                if enforced:
                    row.update(enforced_peak_mb=round(enforced["peak_mem_mb"]), strategy=enforced["strategy"],
                               stream_tok_s=round(enforced["decode_tok_s"], 2))
                mmap, mmap_err = run(replace(stream, strategy="mmap"), limit)
                row["mmap_error"] = mmap_err
                if mmap:
                    row["mmap_tok_s"] = round(mmap["decode_tok_s"], 2)
                    if enforced:
                        row["tokens_equal"] = enforced["tokens"] == mmap["tokens"]
                writer.writerow(row)
                f.flush()
                print(f"matrix: {json.dumps(row)}", file=sys.stderr)
    write_markdown(out)


def write_markdown(csv_path: Path) -> None:
    rows = list(csv.DictReader(open(csv_path)))
    lines = ["| model | arch | budget | accepted | unreclaimable MiB: predicted | measured | predicted/measured | "
             "rss MiB | enforced peak | stream tok/s | mmap tok/s | tokens equal |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        budget = f"{r['budget']} ({r['budget_mb']} MiB)"
        if r["accepted"] != "True":
            lines.append(f"| {r['model']} | {r['arch']} | {budget} | refused: minimum {r['minimum_mb']} MiB | "
                         f"| | | | | | | |")
            continue
        stream = r["stream_tok_s"] or ("killed" if r["killed"] == "True" else f"failed: {r['error']}")
        if r["strategy"] and r["strategy"] != "stream":
            stream += f" ({r['strategy']}, chosen: predicted as fast)"
        mmap = r["mmap_tok_s"] or f"failed: {r['mmap_error']}"
        predicted, measured = r["predicted_unreclaimable_mb"], r["unreclaimable_mb"]
        ratio = f"{int(predicted) / int(measured):.3f}" if predicted and measured else ""
        lines.append(f"| {r['model']} | {r['arch']} | {budget} | yes | {predicted} | {measured} | {ratio} | "
                     f"{r['rss_mb']} | {r['enforced_peak_mb']} | {stream} | {mmap} | {r['tokens_equal']} |")
    csv_path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

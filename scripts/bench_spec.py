#!/usr/bin/env python3
"""Token-tree speculation with a resident draft (LLMCad) against the target alone and llama.cpp's llama-speculative.

On HumanEval prompts (evaluation: problems 40-163, spread evenly; llama-speculative's draft length is tuned on
problems 0-39), at budgets relative to the target's size, every configuration runs as a fresh process in its own
memory cgroup at the budget after the page cache is dropped:

    stream             the target alone, streamed under the budget (flexoffload run --strategy stream)
    mmap               the target alone, upstream mmap (--strategy mmap)
    llama-speculative  llama.cpp's speculative example with the same draft, its --spec-draft-n-max tuned per budget
    chain              flexoffload, a linear draft chain (-md DRAFT --spec chain)
    auto               flexoffload run -md DRAFT as a user gets it: the target alone where that is predicted faster
    tree               flexoffload, token-tree speculation (-md DRAFT --draft-always)
    tree-no-pacer, tree-no-adaptive   the ablations (LLMCad Figure 15)
    tree-fixed-split   the tree with its branch threshold fixed at --draft-p-split (not moved by what is accepted)
    tree-pipeline      the tree with the speculative generation pipeline on (off by default: slower here)

A configuration refused at a budget (below its minimum), killed by the kernel or timed out is a row with the error.
Every run's output is compared with the target alone's greedy output for the prompt (token ids for flexoffload's
runs, text for llama-speculative's, which runs a few tokens past -n).

    scripts/bench_spec.py [--budgets 0.6x,0.8x,1.0x,1.3x] [--prompts 4] [-n 64] [-c 512] [-b 64] [--tag qwen]
    scripts/bench_spec.py --budgets 0.8x --prompts 6 --plain 6 -c 2048 -b 512 --draft-ns 8,16,32 --tag defaults

--plain N adds N plain-language prompts of flexoffload.prompts.plain's evaluation set (llama-speculative then tunes
on its tuning set too, --plain-tune of them); the summary gives the ratios per kind of prompt as well.
    scripts/bench_spec.py --on-tuning --prompts 8 --configs tree --budgets 0.8x --tag tune   # what a tree yields

Writes results/llmcad_TAG.csv (a row per run; phase "tune" for the tuning runs), results/llmcad_TAG.jsonl (each
run's text and tokens) and results/llmcad_TAG.md (means over the prompts, and the issue's two ratios at 0.8x).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tqdm import tqdm

from flexoffload import FlexoffloadError
from flexoffload import api
from flexoffload.bench import baseline
from flexoffload.prompts import humaneval
from flexoffload.prompts import plain
from flexoffload.memory import budgets
from flexoffload.gguf import catalog
from flexoffload.memory.budgets import MiB
from flexoffload.cli import request_from_args
from flexoffload.gguf.model import load

FLEX = {  # flexoffload run flags per configuration; "{draft}" is the draft model
    "stream": ["--strategy", "stream"],
    "mmap": ["--strategy", "mmap"],
    "auto": ["-md", "{draft}"],  # what `run -md` does by default: speculation only where predicted to pay
    "chain": ["-md", "{draft}", "--draft-always", "--spec", "chain"],
    "tree": ["-md", "{draft}", "--draft-always", "--spec", "tree"],
    "tree-no-pacer": ["-md", "{draft}", "--draft-always", "--spec", "tree", "--no-pacer"],
    "tree-no-adaptive": ["-md", "{draft}", "--draft-always", "--spec", "tree", "--no-adaptive"],
    "tree-fixed-split": ["-md", "{draft}", "--draft-always", "--spec", "tree", "--no-adaptive-split"],
    "tree-pipeline": ["-md", "{draft}", "--draft-always", "--spec", "tree", "--pipeline"],
}
SPECULATIVE = "llama-speculative"
CONFIGS = ("stream", "mmap", SPECULATIVE, "auto", "chain", "tree", "tree-no-pacer", "tree-no-adaptive",
           "tree-fixed-split", "tree-pipeline")
TARGET_ALONE = ("stream", "mmap")  # the reference outputs, stream first
CTX_MARGIN = 64  # context beyond prompt and -n: a speculation tree's nodes past the last accepted token


@dataclass
class Row:
    phase: str  # eval, or tune (llama-speculative's draft length, on problems 0-39)
    budget: str
    budget_mb: float
    config: str
    prompt: str
    n_prompt: int = 0
    n_gen: int = 0
    decode_tok_s: float = 0.0
    ttft_s: float = 0.0
    peak_mb: float = 0.0  # the cgroup's peak, page cache included
    enforced: bool = False
    tokens_per_pass: float = 0.0
    acceptance_rate: float = 0.0
    tree_size_mean: float = 0.0
    tree_size_max: float = 0.0
    n_verify: int = 0
    draft_s: float = 0.0
    target_compute_s: float = 0.0
    io_stall_s: float = 0.0
    pipeline_draft_s: float = 0.0  # drafting during the target's passes (tree-pipeline)
    n_reused: int = 0  # tokens drafted during the target's passes and kept
    draft_n: int = 0  # llama-speculative's --spec-draft-n-max; flexoffload's --draft-max when given
    matches_target: str = ""  # yes / no against the target alone's greedy output; empty when there is none
    wall_s: float = 0.0
    model: str = ""
    draft_model: str = ""
    n_predict: int = 0
    n_ctx: int = 0
    n_batch: int = 0
    error: str = ""


_quiet = None


def prompt_lengths(model_path: Path, texts: list[str]) -> list[int]:
    """Token counts of texts with the model's tokenizer (its vocabulary only is loaded)."""
    from flexoffload.native import llama_cpp

    lib = llama_cpp()
    global _quiet
    _quiet = lib.llama_log_callback(lambda level, text, user_data: None)  # kept alive: llama.cpp keeps calling it
    lib.llama_log_set(_quiet, None)  # its loading log would drown the progress bar
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(str(model_path).encode(), params)
    if not model:
        raise FlexoffloadError(f"cannot read the vocabulary of {model_path}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        counts = []
        for text in texts:
            data = text.encode("utf-8")
            buf = (lib.llama_token * (len(data) + 8))()
            counts.append(lib.llama_tokenize(vocab, data, len(data), buf, len(data) + 8, True, True))
        return counts
    finally:
        lib.llama_model_free(model)


def run_flexoffload(args: list[str], limit: int, timeout: float) -> dict:
    """`flexoffload run ARGS` as a fresh process in its own cgroup, cold; its result with the cgroup's peak."""
    prepared = api.prepare(request_from_args(args))
    budgets.drop_page_cache()
    return api.run_in_cgroup(prepared, limit, timeout=timeout)


def flex_row(row: Row, result: dict) -> tuple[Row, dict]:
    t = result.get("timings") or {}
    row.n_prompt, row.n_gen = result["n_prompt"], result["n_gen"]
    row.decode_tok_s, row.ttft_s = result["decode_tok_s"], result["ttft_s"]
    row.peak_mb, row.enforced, row.wall_s = result["peak_mem_mb"], result["enforced"], result["wall_s"]
    for name in ("tokens_per_pass", "acceptance_rate", "tree_size_mean", "tree_size_max", "n_verify", "draft_s",
                 "target_compute_s", "pipeline_draft_s", "n_reused"):
        setattr(row, name, t.get(name, 0) or 0)
    row.io_stall_s = t.get("io_stall_s", t.get("stream_stall_s", 0)) or 0  # the target alone: its stream stall
    return row, {"text": result["text"], "tokens": result["tokens"], "stop": result.get("stop", "")}


def speculative_row(row: Row, r: baseline.Speculative) -> tuple[Row, dict]:
    row.n_prompt, row.n_gen, row.decode_tok_s, row.ttft_s = r.n_prompt, r.n_gen, r.decode_tok_s, r.encode_s
    row.peak_mb, row.enforced, row.wall_s = r.peak_mem_mb, r.enforced, r.wall_s
    row.tokens_per_pass, row.acceptance_rate, row.n_verify = r.tokens_per_pass, r.acceptance_rate, r.n_verify
    row.draft_n = r.n_draft
    return row, {"text": r.text, "tokens": None, "stop": ""}


def _plain(task: str) -> bool:
    return task.startswith("plain/")


_EOG_TAIL = re.compile(r"(<\|[a-z_]+\|>)+\Z")


def same_output(out: dict, ref: dict) -> bool:
    """Whether a run's output is the target alone's greedy output (token ids where both have them)."""
    if out.get("tokens") is not None:
        return out["tokens"] == ref["tokens"]
    text = out["text"]  # llama-speculative: text, and it runs past -n (and prints the end-of-text token it stops on)
    return _EOG_TAIL.sub("", text) == ref["text"] if ref.get("stop") == "eog" else text.startswith(ref["text"])


def mark_matches(rows: list[Row], outputs: list[dict | None]) -> None:
    refs = {}
    for config in TARGET_ALONE:
        for row, out in zip(rows, outputs):
            if row.phase == "eval" and row.config == config and out is not None:
                refs.setdefault(row.prompt, out)
    for row, out in zip(rows, outputs):
        ref = refs.get(row.prompt)
        row.matches_target = "" if out is None or ref is None else ("yes" if same_output(out, ref) else "no")


def write_csv(rows: list, path: Path, row_type: type = None) -> None:
    """rows (dataclasses of row_type, Row by default) as a CSV, replaced whole (never half written)."""
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(row_type or Row)])
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items()})
    tmp.replace(path)


def _mean(xs):
    return statistics.fmean(xs) if xs else 0.0


def summary(rows: list[Row], configs: list[str], labels: list[str], header: str, tuned: dict) -> str:
    ev = [r for r in rows if r.phase == "eval"]
    ok = lambda b, c: [r for r in ev if r.budget == b and r.config == c and not r.error]  # noqa: E731
    prompts = sorted({r.prompt for r in ev}, key=lambda p: int(p.rpartition("/")[2]))
    lines = [header, "", "Decode tok/s, mean over the prompts (\"-\": no run succeeded; see the detail below):", "",
             "| budget | " + " | ".join(configs) + " |", "| ---: |" + " ---: |" * len(configs)]
    budget_mb = {r.budget: r.budget_mb for r in rows}
    for b in labels:
        cells = [f"{_mean([r.decode_tok_s for r in ok(b, c)]):.2f}" if ok(b, c) else "-" for c in configs]
        lines.append(f"| {b} ({budget_mb.get(b, 0):.0f} MiB) | " + " | ".join(cells) + " |")
    lines += ["", "| budget | config | ok | tok/s | ttft s | peak MiB | tokens/pass | acceptance | tree mean/max | "
              "draft s | target s | stall s | drafted in passes s / kept | identical | error |",
              "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for b in labels:
        for c in configs:
            runs = [r for r in ev if r.budget == b and r.config == c]
            if not runs:
                continue
            good = ok(b, c)
            errors = sorted({r.error for r in runs if r.error})
            speeds = [r.decode_tok_s for r in good]
            sd = f" ± {statistics.stdev(speeds):.2f}" if len(speeds) > 1 else ""
            same = [r.matches_target for r in good if r.matches_target]
            m = lambda name: _mean([getattr(r, name) for r in good])  # noqa: E731
            tree_max = max([r.tree_size_max for r in good], default=0)
            lines.append(
                f"| {b} | {c}{f' (n-max {tuned[b]})' if c == SPECULATIVE and tuned.get(b) else ''} | "
                f"{len(good)}/{len(runs)} | {_mean(speeds):.2f}{sd} | {m('ttft_s'):.2f} | "
                f"{max([r.peak_mb for r in good], default=0):.0f} | {m('tokens_per_pass'):.2f} | "
                f"{m('acceptance_rate'):.2f} | {m('tree_size_mean'):.1f}/{tree_max:.0f} | "
                f"{m('draft_s'):.1f} | {m('target_compute_s'):.1f} | {m('io_stall_s'):.1f} | "
                f"{m('pipeline_draft_s'):.1f} / {m('n_reused'):.1f} | {same.count('yes')}/{len(same)} | {'; '.join(errors)[:160]} |")
    tune = sorted({r.prompt for r in rows if r.phase == "tune"}, key=lambda p: int(p.rpartition("/")[2]))
    if tuned and tune:
        tried = sorted({r.draft_n for r in rows if r.phase == "tune"})
        lines += ["", f"llama-speculative's --spec-draft-n-max, tuned per budget over {', '.join(map(str, tried))} on "
                  f"{', '.join(p for p in tune)} (best mean tok/s): "
                  + ", ".join(f"{b}: {n if n else 'none ran on every prompt'}" for b, n in tuned.items()) + "."]
    elif tuned:
        lines += ["", f"llama-speculative's --spec-draft-n-max: {', '.join(map(str, sorted(set(tuned.values()))))}, "
                  "given (not tuned)."]
    checked = [r for r in ev if r.matches_target]
    wrong = [f"{r.budget} {r.config} {r.prompt}" for r in checked if r.matches_target == "no"]
    lines += ["", f"Greedy output identical to the target alone: {len(checked) - len(wrong)} of {len(checked)} runs"
              + (f"; differs: {', '.join(wrong)}" if wrong else "") + "."]
    kinds = {"code": [p for p in prompts if not _plain(p)], "plain": [p for p in prompts if _plain(p)]}
    if "0.8x" in labels and all(kinds.values()) and SPECULATIVE in configs and "tree" in configs:
        for kind, names in kinds.items():
            def mean_of(c):
                runs = [r for r in ok("0.8x", c) if r.prompt in names]
                return _mean([r.decode_tok_s for r in runs]) if len(runs) == len(names) else 0.0

            tree_k, spec_k = mean_of("tree"), mean_of(SPECULATIVE)
            lines.append(f"At 0.8x, {kind} prompts ({len(names)}): tree / {SPECULATIVE} = {tree_k:.2f} / {spec_k:.2f} = "
                         + (f"{tree_k / spec_k:.2f}." if tree_k and spec_k else "no ratio (a run failed)."))
    if "0.8x" in labels:
        def speed(c):
            return _mean([r.decode_tok_s for r in ok("0.8x", c)]) if len(ok("0.8x", c)) == len(prompts) else 0.0

        tree = speed("tree")
        for base, goal in ((SPECULATIVE, 1.5), ("stream", 2.0)):
            if base in configs and "tree" in configs:
                if tree and speed(base):
                    ratio = tree / speed(base)
                    verdict = "met" if ratio >= goal else "not met"
                    lines.append(f"At 0.8x: tree / {base} = {tree:.2f} / {speed(base):.2f} = {ratio:.2f} "
                                 f"(target at least {goal}: {verdict}).")
                else:
                    lines.append(f"At 0.8x: tree / {base}: not every prompt ran in both, no ratio.")
    return "\n".join(lines) + "\n"


def main() -> None:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-m", "--model", default=env("MODEL", "qwen2.5-coder-1.5b-instruct"))
    ap.add_argument("-md", "--draft", default=env("DRAFT", "qwen2.5-coder-0.5b-instruct"))
    ap.add_argument("--budgets", default=env("BUDGETS", "0.6x,0.8x,1.0x,1.3x"), help="relative to the target's size")
    ap.add_argument("--configs", default=env("CONFIGS", ",".join(CONFIGS)))
    ap.add_argument("--prompts", type=int, default=int(env("PROMPTS", "4")), help="evaluation prompts (of 40-163)")
    ap.add_argument("--on-tuning", action="store_true", default=bool(env("ON_TUNING")),
                    help="measure on the tuning prompts (of 0-39) instead: what speculation yields there")
    ap.add_argument("--tune-prompts", type=int, default=int(env("TUNE_PROMPTS", "2")), help="tuning prompts (of 0-39)")
    ap.add_argument("--plain", type=int, default=int(env("PLAIN", "0")), help="plain-language evaluation prompts")
    ap.add_argument("--plain-tune", type=int, default=int(env("PLAIN_TUNE", "2")),
                    help="plain-language tuning prompts (with --plain)")
    ap.add_argument("--draft-ns", default=env("DRAFT_NS", "2,4,8,16"), help="llama-speculative's n-max values tried")
    ap.add_argument("-n", "--n-predict", type=int, default=int(env("N", "64")))
    ap.add_argument("-c", "--ctx-size", type=int, default=int(env("CTX", "512")))
    ap.add_argument("-b", "--batch-size", type=int, default=int(env("BATCH", "64")))
    ap.add_argument("-t", "--threads", type=int, default=int(env("THREADS", str(os.cpu_count() or 1))))
    ap.add_argument("--timeout", type=float, default=float(env("TIMEOUT", "1200")), help="seconds per run")
    ap.add_argument("--spec-args", default=env("SPEC_ARGS", ""), help="more flags for flexoffload's -md runs")
    ap.add_argument("--tag", default=env("TAG", "qwen"))
    ap.add_argument("-o", "--out-dir", default=env("OUT", "results"))
    a = ap.parse_args()
    try:
        bench(a)
    except FlexoffloadError as e:
        sys.exit(f"bench_spec: {e}")
    except KeyboardInterrupt:
        sys.exit("bench_spec: interrupted (the rows so far are written)")


def bench(a) -> None:
    target_path, draft_path = catalog.resolve(a.model), catalog.resolve(a.draft)
    target = load(target_path)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            raise FlexoffloadError(f"unknown configuration {c!r}: one of {', '.join(CONFIGS)}")
    labels = [b.strip() for b in a.budgets.split(",") if b.strip()]
    limits = {b: budgets.parse_size(b, target.file_size) for b in labels}
    draft_ns = [int(n) for n in a.draft_ns.split(",") if n.strip()]
    evaluation = humaneval.prompts((humaneval.tuning_ids if a.on_tuning else humaneval.evaluation_ids)(a.prompts))
    evaluation += plain.prompts("tuning" if a.on_tuning else "evaluation", a.plain)
    tune = SPECULATIVE in configs and len(draft_ns) > 1  # one value given: nothing to tune
    tuning = humaneval.prompts(humaneval.tuning_ids(a.tune_prompts)) if tune else []
    tuning += plain.prompts("tuning", a.plain_tune) if tune and a.plain else []
    for (task, _), n in zip(evaluation + tuning, prompt_lengths(target_path, [p for _, p in evaluation + tuning])):
        if n + a.n_predict + CTX_MARGIN > a.ctx_size:
            raise FlexoffloadError(f"{task} has {n} tokens: with -n {a.n_predict} it needs -c of at least "
                                   f"{n + a.n_predict + CTX_MARGIN}, not {a.ctx_size}")
    if any(c != SPECULATIVE and c != "mmap" for c in configs):
        from flexoffload.measure import profiler

        profiler.measure(target, a.threads)  # measured once, outside the budget, as `flexoffload bench` does
        profiler.measure(load(draft_path), a.threads)  # the draft's speed: whether speculation pays (auto)
    if not budgets.drop_page_cache():
        print("bench_spec: cannot drop the page cache here (needs root): runs after the first start warm",
              file=sys.stderr)

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, jsonl_path, md_path = (out / f"llmcad_{a.tag}{ext}" for ext in (".csv", ".jsonl", ".md"))
    jsonl_path.write_text("")
    common = ["-m", str(target_path), "-n", str(a.n_predict), "-c", str(a.ctx_size), "-b", str(a.batch_size),
              "-t", str(a.threads), "--temp", "0", "--seed", "0"]
    spec_extra = a.spec_args.split()
    draft_max = next((int(spec_extra[i + 1]) for i, f in enumerate(spec_extra[:-1]) if f == "--draft-max"), 0)
    rows: list[Row] = []
    outputs: list[dict | None] = []
    tuned: dict[str, int] = {}
    header = (f"# Token-tree speculation (LLMCad): {target_path.name} ({target.file_size / MiB:.0f} MiB) with draft "
              f"{draft_path.name}\n\nHumanEval {', '.join(t.rpartition('/')[2] for t, _ in evaluation if not _plain(t))}"
              f"{'; plain-language prompts ' + ', '.join(t.rpartition('/')[2] for t, _ in evaluation if _plain(t)) if a.plain else ''}; -n "
              f"{a.n_predict} -c {a.ctx_size} -b {a.batch_size} -t {a.threads}, greedy; each run a fresh process in "
              f"its own memory cgroup at the budget, page cache dropped before it; {time.strftime('%Y-%m-%d')}.")

    def record(row: Row, output: dict | None) -> None:
        row.model, row.draft_model = target_path.name, draft_path.name
        row.n_predict, row.n_ctx, row.n_batch = a.n_predict, a.ctx_size, a.batch_size
        rows.append(row)
        outputs.append(output)
        mark_matches(rows, outputs)
        write_csv(rows, csv_path)
        with open(jsonl_path, "a") as f:
            f.write(json.dumps({"phase": row.phase, "budget": row.budget, "config": row.config, "prompt": row.prompt,
                                "draft_n": row.draft_n, "error": row.error, **(output or {})}) + "\n")

    def speculative(label: str, task: str, prompt: str, n_draft: int, phase: str) -> Row:
        row = Row(phase=phase, budget=label, budget_mb=limits[label] / MiB, config=SPECULATIVE, prompt=task,
                  draft_n=n_draft)
        try:
            r = baseline.run(target_path, draft_path, prompt, a.n_predict, a.ctx_size, a.batch_size, a.threads,
                             n_draft, budget=limits[label], timeout=a.timeout)
        except FlexoffloadError as e:
            row.error = str(e)
            record(row, None)
            return row
        row, output = speculative_row(row, r)
        record(row, output)
        return row

    total = len(labels) * (len(configs) * len(evaluation) + len(draft_ns) * len(tuning))
    bar = tqdm(total=total, desc="llmcad", unit="run", file=sys.stderr, disable=None)
    try:
        for label in labels:
            limit = limits[label]
            if SPECULATIVE in configs:
                best, best_speed = (draft_ns[0] if len(draft_ns) == 1 else 0), 0.0
                for n_draft in draft_ns if tuning else []:
                    speeds = []
                    for task, prompt in tuning:
                        bar.set_postfix_str(f"{label} tune n-max {n_draft} {task}")
                        row = speculative(label, task, prompt, n_draft, "tune")
                        speeds.append(None if row.error else row.decode_tok_s)
                        bar.update(1)
                    if None not in speeds and _mean(speeds) > best_speed:
                        best, best_speed = n_draft, _mean(speeds)
                tuned[label] = best
            for task, prompt in evaluation:
                for config in configs:
                    bar.set_postfix_str(f"{label} {config} {task}")
                    if config == SPECULATIVE:
                        if tuned[label]:
                            speculative(label, task, prompt, tuned[label], "eval")
                        else:
                            record(Row(phase="eval", budget=label, budget_mb=limit / MiB, config=config, prompt=task,
                                       error="no --spec-draft-n-max ran on every tuning prompt"), None)
                        bar.update(1)
                        continue
                    args = common + ["-p", prompt, "--mem", str(limit)]
                    args += [str(draft_path) if x == "{draft}" else x for x in FLEX[config]]
                    args += spec_extra if "-md" in FLEX[config] else []
                    row = Row(phase="eval", budget=label, budget_mb=limit / MiB, config=config, prompt=task,
                              draft_n=draft_max if "-md" in FLEX[config] else 0)
                    try:
                        row, output = flex_row(row, run_flexoffload(args, limit, a.timeout))
                    except FlexoffloadError as e:
                        row.error, output = str(e), None
                    record(row, output)
                    bar.update(1)
    finally:
        bar.close()
        if rows:
            text = summary(rows, configs, labels, header, tuned)
            md_path.write_text(text)
            print(text)
            print(f"bench_spec: wrote {csv_path}, {jsonl_path} and {md_path}", file=sys.stderr)


if __name__ == "__main__":
    main()

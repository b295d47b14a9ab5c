"""Speculation without a draft model (issue 30): the target alone (streamed), each free drafter, `--spec-type auto`,
and llama.cpp's own n-gram speculation (llama-server --spec-type ngram-*, behind `flexoffload serve` so it streams by
the same plan's -ot lines in the same kind of cgroup), on code (HumanEval 40-163), plain prompts (plain.py's
evaluation set) and edits (prompts/edit.py's evaluation set), at each budget. Every run is cold: the page cache is
dropped before it, and flexoffload's runs are fresh processes in their own enforced cgroup
(memory.budget.MemoryCgroup, via api.run_in_cgroup). Greedy; each output is checked against the target alone's.

Rows go to the CSV as they come (budget x kind x prompt x system): decode tok/s, tokens per pass, acceptance per
drafter, the tree's mean size, the predicted speed (the plan's one-token pass, plus each node past the root at the
cost model's share of a token's compute, over the measured tokens per pass), greedy equality and the peak.

    .venv/bin/python scripts/bench_freedraft.py --budgets 0.4x,0.6x --limit 8 -n 128
    .venv/bin/python scripts/bench_freedraft.py --budgets 0.8x --systems alone,md,md+ngram-simple --limit 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_spec import write_csv  # noqa: E402  (scripts/, this script's folder)
from flexoffload import FlexoffloadError, api  # noqa: E402
from flexoffload.cli import request_from_args  # noqa: E402
from flexoffload.gguf import catalog  # noqa: E402
from flexoffload.memory import budgets  # noqa: E402
from flexoffload.prompts import edit, humaneval, plain  # noqa: E402

FLEX = {  # system -> run's --spec-type
    "alone": "none",
    "ngram-simple": "ngram-simple",
    "ngram-map-k": "ngram-map-k",
    "recycle": "recycle",
    "ngram-simple+recycle": "ngram-simple,recycle",
    "auto": "auto",
    "auto-tiled": "auto",  # verified by the tiled kernels, as llama.cpp verifies (--tiled-verify: not bit-exact)
    "md": "none",  # -md DRAFT: today's model-only tree (--draft-always)
    "md+ngram-simple": "model,ngram-simple",  # the merged tree
    "md+recycle": "model,ngram-simple,recycle",
}
WITH_DRAFT = ("md", "md+ngram-simple", "md+recycle")
DEFAULT_SYSTEMS = ("alone", "ngram-simple", "ngram-map-k", "recycle", "ngram-simple+recycle", "auto") + (
    "llama-ngram-simple", "llama-ngram-map-k", "llama-ngram-mod")
LLAMA = ("llama-ngram-simple", "llama-ngram-map-k", "llama-ngram-mod")  # llama-server --spec-type ngram-*
DRAFTERS = ("model", "ngram-simple", "ngram-map-k", "recycle")


@dataclass
class Row:
    budget: str
    kind: str  # code, plain, edit
    prompt: str
    system: str
    spec_types: str = ""  # what the run speculated with (auto: as decided)
    strategy: str = ""  # how the target ran (stream, stream+tree; mmap where run chose it for the target alone)
    n_prompt: int = 0
    n_gen: int = 0
    decode_tok_s: float = 0.0
    ttft_s: float = 0.0
    tokens_per_pass: float = 0.0
    acceptance_rate: float = 0.0
    acc_model: str = ""
    acc_ngram_simple: str = ""
    acc_ngram_map_k: str = ""
    acc_recycle: str = ""
    tree_size_mean: float = 0.0
    n_verify: int = 0
    predicted_tok_s: float = 0.0
    peak_mb: float = 0.0
    enforced: bool = False
    matches_target: str = ""  # yes / no against the target alone's greedy tokens
    wall_s: float = 0.0
    error: str = ""


def prompt_sets(kinds: list[str], limit: int) -> list[tuple[str, str, str]]:
    """(kind, name, text): HumanEval 40-163 spread evenly, plain.py's evaluation prompts, edit.py's evaluation set."""
    out = []
    for kind in kinds:
        if kind == "code":
            ids = humaneval.evaluation_ids(min(limit, len(humaneval.EVALUATION)))
            out += [("code", task, text) for task, text in humaneval.prompts(ids)]
        elif kind == "plain":
            count = min(limit, len(plain.EVALUATION))
            out += [("plain", name, text) for name, text in plain.prompts("evaluation", count)]
        elif kind == "edit":
            out += [("edit", name, text) for name, text in edit.prompts("evaluation", min(limit, edit.COUNT))]
        else:
            raise SystemExit(f"unknown prompt kind {kind}: code, plain, edit")
    return out


def warm_table(a) -> int:
    """Token Recycling's table (kept between runs, api.recycle_store) made afresh from the tuning prompts only
    (HumanEval 0-39, plain.py's and edit.py's tuning sets): resident runs (the same logits, faster), greedy. The
    measured runs then learn on, in the bench's order, as a user's table would. Returns the prompts run."""
    from flexoffload.gguf.model import load

    api.recycle_store(load(a.model)).unlink(missing_ok=True)
    count = a.warm
    tuning = ([t for _, t in humaneval.prompts(humaneval.tuning_ids(count))] +
              [t for _, t in plain.prompts("tuning", min(count, len(plain.TUNING)))] +
              [t for _, t in edit.prompts("tuning", min(count, edit.COUNT))])
    for text in tuning:
        api.run_in_cgroup(api.prepare(request_from_args(run_args(a, text, "recycle"))), None, timeout=a.timeout)
    return len(tuning)


def run_args(a, text: str, spec_type: str) -> list[str]:
    """`flexoffload run`'s flags for a greedy run of text at the bench's settings."""
    return ["-m", a.model, "-p", text, "-n", str(a.n), "-c", str(a.ctx), "-b", str(a.batch), "--temp", "0",
            "-t", str(a.threads), "--spec-type", spec_type, "--json"]


def run_flex(a, budget: str, system: str, text: str) -> dict:
    args = run_args(a, text, FLEX[system]) + ["--mem", budget]
    if system in WITH_DRAFT:
        args += ["-md", a.draft, "--draft-always"]
    if system.endswith("-tiled"):
        args += ["--tiled-verify"]
    prepared = api.prepare(request_from_args(args))
    budgets.drop_page_cache()
    return api.run_in_cgroup(prepared, prepared.limit, timeout=a.timeout)


def flex_row(row: Row, result: dict) -> None:
    t = result.get("timings") or {}
    row.n_prompt, row.n_gen = result["n_prompt"], result["n_gen"]
    row.decode_tok_s, row.ttft_s = result["decode_tok_s"], result["ttft_s"]
    row.peak_mb, row.enforced, row.wall_s = result["peak_mem_mb"], result["enforced"], result.get("wall_s", 0.0)
    row.spec_types = ",".join(result.get("spec", {}).get("types", [])) or "none"
    row.strategy = result.get("strategy", "")
    row.tokens_per_pass, row.acceptance_rate = t.get("tokens_per_pass", 0.0), t.get("acceptance_rate", 0.0)
    row.tree_size_mean, row.n_verify = t.get("tree_size_mean", 0.0), t.get("n_verify", 0)
    for name, d in (t.get("drafters") or {}).items():
        setattr(row, "acc_" + name.replace("-", "_"), f"{d['n_accepted']}/{d['n_drafted']}")
    plan = result.get("plan") or {}
    pass_s = 1 / plan["predicted_tok_s"] if plan.get("predicted_tok_s") else 0.0
    if pass_s and row.tokens_per_pass:  # a pass over the tree: the plan's pass and each node past the hidden ones
        spec = result.get("spec", {})
        paid = max(row.tree_size_mean - 1 - spec.get("hidden_nodes", 0), 0)
        row.predicted_tok_s = row.tokens_per_pass / (pass_s + paid * spec.get("node_s", 0.0))
    elif pass_s:
        row.predicted_tok_s = 1 / pass_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`flexoffload serve -np 1` (llama-server streaming by the plan for --mem, enforced) with llama.cpp's n-gram
    speculation; one per budget and type, every prompt sent to it with the page cache dropped first."""

    def __init__(self, a, budget: str, spec_type: str):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "flexoffload", "serve", "-m", a.model, "--mem", budget, "--enforce", "-np", "1",
               "-c", str(a.ctx), "-b", str(a.batch), "-t", str(a.threads), "--port", str(self.port), "--",
               "--spec-type", spec_type, "--spec-draft-n-max", str(a.llama_draft_max)]
        self.log = open(a.out.with_suffix(f".serve_{budget}_{spec_type}.log"), "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + a.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise FlexoffloadError(f"flexoffload serve ended ({self.proc.returncode}): see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.close()
        raise FlexoffloadError(f"flexoffload serve did not answer within {a.timeout} s")

    def complete(self, a, text: str) -> dict:
        body = json.dumps({"prompt": text, "n_predict": a.n, "temperature": 0, "top_k": 1, "cache_prompt": False,
                           "return_tokens": True, "seed": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        budgets.drop_page_cache()
        t0 = time.time()
        with urllib.request.urlopen(req, timeout=a.timeout) as r:
            out = json.loads(r.read())
        out["wall_s"] = time.time() - t0
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def llama_row(row: Row, out: dict) -> None:
    t = out.get("timings") or {}
    row.n_prompt, row.n_gen = t.get("prompt_n", 0), t.get("predicted_n", len(out.get("tokens") or []))
    row.decode_tok_s, row.ttft_s = t.get("predicted_per_second", 0.0), t.get("prompt_ms", 0.0) / 1000
    drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
    row.acceptance_rate = accepted / drafted if drafted else 0.0
    row.tokens_per_pass = row.n_gen / max(row.n_gen - accepted, 1)
    row.spec_types, row.wall_s, row.enforced = row.system.removeprefix("llama-"), out["wall_s"], True
    row.strategy = "llama-server"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--budgets", default="0.4x,0.6x")
    ap.add_argument("--kinds", default="code,plain,edit")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help=f"of {', '.join(list(FLEX) + list(LLAMA))} (md*: with -md, for 0.8x)")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="the md systems' draft model")
    ap.add_argument("--limit", type=int, default=8, help="prompts of each kind (code: spread over HumanEval 40-163)")
    ap.add_argument("-n", type=int, default=128, help="tokens to generate")
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("-b", "--batch", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-draft-max", type=int, default=16, help="llama-server's --spec-draft-n-max")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--warm", type=int, default=8,
                    help="Token Recycling's table: made afresh from this many tuning prompts of each kind first "
                         "(0: the table as an earlier round left it)")
    ap.add_argument("--out", type=Path, default=Path("results/freedraft_qwen1.5b.csv"))
    a = ap.parse_args()
    a.model = str(catalog.resolve(a.model))
    systems = [s for s in a.systems.split(",") if s]
    unknown = [s for s in systems if s not in FLEX and s not in LLAMA]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}")
    if "alone" in systems:  # first: the reference every other output is checked against
        systems.remove("alone")
        systems.insert(0, "alone")
    if not budgets.drop_page_cache():
        print("bench_freedraft: cannot drop the page cache (not root?): runs are not cold", file=sys.stderr)
    prompts = prompt_sets([k for k in a.kinds.split(",") if k], a.limit)
    if a.warm > 0 and any("recycle" in FLEX.get(s, "") or s == "auto" for s in systems):
        print(f"bench_freedraft: Token Recycling's table from {warm_table(a)} tuning prompts", file=sys.stderr)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    reference: dict[tuple[str, str], list[int]] = {}
    for budget in [b for b in a.budgets.split(",") if b]:
        for system in systems:
            server = None
            if system in LLAMA:
                try:
                    server = LlamaServer(a, budget, system.removeprefix("llama-"))
                except FlexoffloadError as e:
                    for kind, name, _ in prompts:
                        rows.append(Row(budget, kind, name, system, error=str(e)))
                    write_csv(rows, a.out, Row)
                    continue
            try:
                for kind, name, text in prompts:
                    row = Row(budget, kind, name, system)
                    tokens = None
                    try:
                        if server is not None:
                            out = server.complete(a, text)
                            llama_row(row, out)
                            tokens = out.get("tokens")
                        else:
                            result = run_flex(a, budget, system, text)
                            flex_row(row, result)
                            tokens = result["tokens"]
                    except (FlexoffloadError, OSError, KeyError, ValueError) as e:
                        row.error = str(e)[:300]
                    if system == "alone" and tokens is not None:
                        reference[(budget, name)] = tokens
                    ref = reference.get((budget, name))
                    if tokens is not None and ref is not None:
                        row.matches_target = "yes" if list(tokens)[:len(ref)] == ref else "no"
                    rows.append(row)
                    write_csv(rows, a.out, Row)
                    print(f"{budget} {system} {name}: {row.decode_tok_s:.2f} tok/s, {row.tokens_per_pass:.2f} a pass, "
                          f"same {row.matches_target or '-'} {row.error}", file=sys.stderr, flush=True)
            finally:
                if server is not None:
                    server.close()
    print(f"bench_freedraft: {len(rows)} rows in {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

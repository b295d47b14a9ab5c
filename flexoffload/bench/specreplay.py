"""Realistic speculation pairs, simulated (scripts/spec_replay): the real 0.5B draft's passes with the real 1.5B,
replayed on a synthetic 7B-class target whose file the draft is a tenth of (here it is a third).

Three measurements and a prediction made of them:

- traces: the real pair at 0.8x of the 1.5B, as the headline's md row runs it (the measured decision, no history):
  each pass's rows, tokens kept and draft steps (the run's `timings.passes`) and the acceptance by depth it measured.
- sweep: the 7B with the draft resident beside it (its memory out of the budget, as `run -md` plans it), at each
  budget: a pass over 1, 2, 4, ... rows, a draft step, and the 7B alone's decode in the same memory.
- replay: the 7B verifying a trace's tree shapes, keeping what the real run kept (speculation/replay.py), against the
  7B alone, interleaved, cold, enforced, as the headline measures.

The prediction: a trace's passes priced by the sweep (a pass of r rows at the measured time of r rows, a draft step at
the measured step), and the best chain the acceptance by depth pays for (control.best_depth) at those costs.

The acceptance is the 0.5B's against the 1.5B: a 7B agrees with the 0.5B less often than the 1.5B does, so the
table is an upper bound on what the acceptance gives, exact on what the passes cost.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from flexoffload import FlexoffloadError, native
from flexoffload.memory import budgets
from flexoffload.native import tools
from flexoffload.speculation import control as speccontrol
from flexoffload.speculation import replay
from flexoffload.bench.headline import N_THREADS, Case, Outcome

N_CTX = 1024
SWEEP_ROWS = (1, 2, 4, 8, 16, 32)
SWEEP_REPEAT = 3  # passes of each size a sweep run makes (their median is the size's time)
SWEEP_STEPS = 8  # the draft steps of a sweep's step passes


def request(model: Path, prompt: str, n_predict: int, mem: str | None, draft: Path | None = None, **fields_):
    from flexoffload import api

    return api.Request(model=str(model), prompt=prompt, n_predict=n_predict, n_ctx=N_CTX, n_threads=N_THREADS,
                       temp=0, mem=mem, draft=str(draft) if draft else None, **fields_)


def run(req, limit: int, trace=None, timeout: float = 1800.0) -> dict:
    """Prepare the request here and run it in a child in a cgroup of limit bytes, the page cache dropped first;
    trace: the passes to replay in place of drafting (the request must speculate with -md)."""
    from flexoffload import api

    prepared = api.prepare(req)
    if trace is not None:
        if prepared.tree is None or not prepared.draft:
            raise FlexoffloadError("the replay's request does not speculate with a draft model")
        prepared = replace(prepared, tree=replace(prepared.tree, replay=replay.check(trace)))
    budgets.drop_page_cache()
    return api.run_in_cgroup(prepared, limit, timeout=timeout)


# --- the traces -------------------------------------------------------------------------------------------------

def traces(target: Path, draft: Path, prompts: list[tuple[str, str, str]], mem: str, n_predict: int) -> list[dict]:
    """The real pair's runs: kind, prompt name, text, passes ([rows, kept, steps, draft_s, target_s, other_s]),
    acceptance and reach by depth, and the run's speed."""
    from flexoffload.gguf.model import load

    limit = budgets.parse_size(mem, load(target).file_size)
    out = []
    for kind, name, text in prompts:
        r = run(request(target, text, n_predict, mem, draft, history=False), limit)
        t = r["timings"]
        out.append({"kind": kind, "prompt": name, "text": text, "mem": mem, "decode_tok_s": r["decode_tok_s"],
                    "n_gen": r["n_gen"], "tokens_per_pass": t.get("tokens_per_pass", 0.0),
                    "passes": t.get("passes", []), "control": t.get("control", {})})
    return out


# --- the sweep --------------------------------------------------------------------------------------------------

def sweep_trace(rows_max: int) -> tuple:
    """Passes of each size in SWEEP_ROWS (up to rows_max), SWEEP_REPEAT each, keeping one token; then passes of one
    row after SWEEP_STEPS draft steps."""
    sizes = [r for r in SWEEP_ROWS if r <= rows_max]
    return tuple((r, 1, 0) for r in sizes for _ in range(SWEEP_REPEAT)) + ((1, 1, SWEEP_STEPS),) * SWEEP_REPEAT


@dataclass
class Costs:
    """A budget's measured costs: a pass's seconds by rows (medians), a draft step's, and the target alone's
    decode speed in the same memory."""
    mem: str
    pass_s: dict[int, float]
    step_s: float
    alone_tok_s: float
    overhead_s: float

    def at(self, rows: int) -> float:
        """A pass of rows: between the sizes measured, on the line between them; past the last, on the last two's."""
        sizes = sorted(self.pass_s)
        if rows in self.pass_s:
            return self.pass_s[rows]
        lo = max([s for s in sizes if s < rows], default=sizes[0])
        hi = min([s for s in sizes if s > rows], default=sizes[-1])
        if lo == hi:
            lo, hi = sizes[-2], sizes[-1]
        a, b = self.pass_s[lo], self.pass_s[hi]
        return a + (b - a) * (rows - lo) / (hi - lo)

    def line(self) -> tuple[float, float]:
        """A least-squares line through the sizes: a one-row pass and a further row's seconds."""
        xs, ys = zip(*sorted(self.pass_s.items()))
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return my - slope * (mx - 1), slope


def costs(rows: list[dict], mem: str) -> Costs:
    """A budget's Costs from the sweep's CSV lines (every repetition pooled: medians)."""
    mine = [r for r in rows if r["mem"] == mem]
    by_rows: dict[int, list[float]] = {}
    for r in mine:
        if r["kind"] == "pass" and int(r["steps"]) == 0:
            by_rows.setdefault(int(r["rows"]), []).append(float(r["target_s"]))
    steps = [float(r["draft_s"]) / int(r["steps"]) for r in mine if r["kind"] == "pass" and int(r["steps"])]
    other = [float(r["other_s"]) for r in mine if r["kind"] == "pass"]
    alone = [float(r["tok_s"]) for r in mine if r["kind"] == "alone"]
    if not by_rows or not steps or not alone:
        raise FlexoffloadError(f"the sweep has no passes, steps or target-alone runs at {mem}")
    return Costs(mem, {k: statistics.median(v) for k, v in by_rows.items()}, statistics.median(steps),
                 statistics.median(alone), statistics.median(other))


SWEEP_FIELDS = ("mem", "rep", "kind", "rows", "kept", "steps", "draft_s", "target_s", "other_s", "tok_s", "at",
                "commit", "native")


def sweep(model: Path, draft: Path, mems: list[str], repetitions: int, csv_path: Path, prompt: str,
          n_alone: int = 16) -> None:
    """For each repetition, each budget in turn: the sweep's passes with the draft resident, then the target alone;
    each pass a CSV line (kind "pass"), each alone run one (kind "alone"), written as they end."""
    from flexoffload.gguf.model import load

    size = load(model).file_size
    commit, build = tools.commit(), native.key()
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWEEP_FIELDS)
        w.writeheader()
        for rep in range(repetitions):
            for mem in mems:
                limit = budgets.parse_size(mem, size)
                base = {"mem": mem, "rep": rep, "commit": commit, "native": build}
                trace = sweep_trace(max(SWEEP_ROWS))
                r = run(request(model, prompt, 1 + len(trace), mem, draft, history=False, draft_always=True),
                        limit, trace)
                for rows, kept, steps, draft_s, target_s, other_s in r["timings"]["passes"]:
                    w.writerow({**base, "kind": "pass", "rows": rows, "kept": kept, "steps": steps,
                                "draft_s": draft_s, "target_s": target_s, "other_s": other_s,
                                "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
                f.flush()
                a = run(request(model, prompt, n_alone, mem, spec_type="none"), limit)
                w.writerow({**base, "kind": "alone", "tok_s": a["decode_tok_s"],
                            "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
                f.flush()


# --- the replay -------------------------------------------------------------------------------------------------

def replaying(traces_: list[dict], draft: Path):
    """The headline's System for the replay: the case's prompt's trace on the case's target, with draft resident."""
    by_text = {t["text"]: t for t in traces_}

    def go(case: Case) -> Outcome:
        t0 = time.perf_counter()
        tr = by_text[case.prompt]
        try:
            r = run(request(case.model, case.prompt, case.n_predict, case.mem, draft, history=False,
                            draft_always=True), case.limit, [p[:3] for p in tr["passes"]], case.timeout)
        except FlexoffloadError as e:
            return Outcome(error=str(e)[:200], wall_s=time.perf_counter() - t0)
        t = r["timings"]
        return Outcome(ok=True, decode_tok_s=r["decode_tok_s"], ttft_s=r["ttft_s"], n_prompt=r["n_prompt"],
                       n_gen=r["n_gen"], tokens_per_pass=t.get("tokens_per_pass", 0.0), peak_mb=r["peak_mem_mb"],
                       wall_s=time.perf_counter() - t0)
    return go


# --- the prediction ---------------------------------------------------------------------------------------------

def predicted_trace(trace: dict, c: Costs, n_predict: int = -1) -> float:
    """The trace's tokens a second on the budget's costs: each pass at the sweep's time for its rows, its draft
    steps at the measured step, the replay's bookkeeping; n_predict: only the passes a run of that many tokens
    makes (the first token is the prompt's)."""
    passes, made = [], 1
    for p in trace["passes"]:
        if 0 <= n_predict <= made:
            break
        passes.append(p)
        made += p[1]
    seconds = sum(c.at(p[0]) + p[2] * c.step_s + c.overhead_s for p in passes)
    tokens = sum(p[1] for p in passes)
    if n_predict >= 0:  # what the run counts: the tokens after the first, up to n_predict in all
        tokens = min(tokens, n_predict - 1)
    return tokens / seconds


def measured_of(kind_traces: list[dict]) -> speccontrol.Measured:
    """The acceptance by depth of a kind's traces, pooled (each run's decayed counts, as its history keeps them)."""
    accepted: list[float] = []
    reached: list[float] = []
    for t in kind_traces:
        ctl = t.get("control") or {}
        for d, (a, n) in enumerate(zip(ctl.get("acceptance_by_depth", []), ctl.get("reached_by_depth", []))):
            if d >= len(reached):
                accepted.append(0.0)
                reached.append(0.0)
            accepted[d] += a * n
            reached[d] += n
    return speccontrol.Measured(accepted, reached)


def predicted_best(m: speccontrol.Measured, c: Costs) -> tuple[int, float, float]:
    """The chain depth the acceptance pays for at these costs, its tokens a pass, and its tokens a second."""
    pass_s, row_s = c.line()
    depth, rate = speccontrol.best_depth(m, pass_s, max(row_s, 0.0), c.step_s, c.overhead_s, max(SWEEP_ROWS) - 1)
    return depth, speccontrol.chain_yield(m, depth), rate


def against_prediction(traces_: list[dict], c: Costs, records, n_predict: int) -> list[dict]:
    """The replay against its prediction, a line per prompt: the trace's first n_predict tokens priced by the
    sweep, and the replay's measured median (records: the headline CSV's, of the replay's system)."""
    out = []
    for t in traces_:
        runs = [r.value for r in records if r.prompt == t["prompt"] and r.side == "ours" and r.ok]
        alone = [r.value for r in records if r.prompt == t["prompt"] and r.side == "alone" and r.ok]
        if runs:
            predicted = predicted_trace(t, c, n_predict)
            measured = statistics.median(runs)
            out.append({"prompt": t["prompt"], "predicted_tok_s": round(predicted, 3),
                        "measured_tok_s": round(measured, 3), "error": round(predicted / measured - 1, 3),
                        "alone_tok_s": round(statistics.median(alone), 3) if alone else 0.0})
    return out


def table(traces_: list[dict], all_costs: list[Costs]) -> list[dict]:
    """A line per budget and prompt kind: the costs, the trace shapes' prediction and the best chain's."""
    out = []
    for c in all_costs:
        _, row_s = c.line()
        for kind in sorted({t["kind"] for t in traces_}):
            mine = [t for t in traces_ if t["kind"] == kind]
            shapes = statistics.median(predicted_trace(t, c) for t in mine)
            depth, per_pass, best = predicted_best(measured_of(mine), c)
            out.append({"mem": c.mem, "kind": kind, "alone_tok_s": round(c.alone_tok_s, 3),
                        "pass_1_s": round(c.at(1), 3), "row_s": round(row_s, 4), "step_s": round(c.step_s, 4),
                        "trace_tok_s": round(shapes, 3), "trace_speedup": round(shapes / c.alone_tok_s, 2),
                        "best_depth": depth, "best_tokens_per_pass": round(per_pass, 2),
                        "best_tok_s": round(best, 3), "best_speedup": round(best / c.alone_tok_s, 2)})
    return out


def save_json(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)

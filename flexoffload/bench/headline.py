"""The README's headline, re-measured on the machine at hand (`scripts/headline`).

Each row is one capability: flexoffload's system (what a user runs, first) against its baselines: upstream
llama.cpp at its defaults and at its best flags for the case (the row names them), and where it helps, flexoffload
without the feature. The systems run interleaved (for each repetition, for each prompt: every system in turn, not
one system's runs in a block: the disk's speed drifts over minutes here), each cold (the page cache dropped first),
each in a fresh memory cgroup of the same size, each with the same time limit. Prompts are held out: HumanEval
problems 40-163 and the evaluation sets of prompts/, never the tuning ones.

A row reports the median and the range (min-max) of each system's runs, and against each baseline the median of the
paired ratios (the system over the baseline that ran beside it, same prompt and repetition) with their range. Where
that range holds 1.0 the row says "tie": the gap is inside what this machine's noise gives.

Speculation's state is reset before every run: Token Recycling's table (which outlives a run by design) is copied
back from one warmed on the tuning prompts before each run, so no run reads a continuation an earlier run of the
same prompt left in it.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import shutil
import signal
import socket
import statistics
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from flexoffload import FlexoffloadError, native
from flexoffload.native import tools
from flexoffload.memory import budgets
from flexoffload.memory.budgets import MiB

log = logging.getLogger(__name__)

BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
N_THREADS = 2


@dataclass
class Outcome:
    """One run of one system on one prompt."""
    ok: bool = False
    decode_tok_s: float = 0.0
    ttft_s: float = 0.0
    n_prompt: int = 0
    n_gen: int = 0
    tokens_per_pass: float = 0.0
    acceptance_rate: float = 0.0
    peak_mb: float = 0.0
    wall_s: float = 0.0
    text: str = ""
    error: str = ""


@dataclass(frozen=True)
class Case:
    """What every system of a row is given: the model files, the budget, the prompt."""
    model: Path
    limit: int  # the cgroup's bytes, for every system of the row alike
    mem: str | None  # flexoffload's --mem (None: every weight in memory)
    prompt: str
    n_predict: int
    n_ctx: int
    timeout: float
    draft: Path | None = None


@dataclass(frozen=True)
class System:
    label: str  # as the table shows it
    side: str  # "ours" (the first is the row's system), "alone" (ours without the feature) or "upstream"
    run: Callable[[Case], Outcome]


@dataclass(frozen=True)
class Row:
    name: str  # --rows picks by it
    capability: str  # the table's first column, a link into docs/
    model: str  # what the model is: real or synthetic (and a synthetic MoE's routing)
    setting: str  # the budget and what is asked, in words
    metric: str  # "decode_tok_s" (higher is better) or "ttft_s" (lower is better)
    systems: tuple[System, ...]
    cases: Callable[[], list[tuple[str, Case]]]  # (prompt name, case), made when the row runs


@dataclass
class Record:
    """A CSV line: one run."""
    row: str
    rep: int
    prompt: str
    system: str
    side: str
    value: float  # the row's metric
    ok: bool
    decode_tok_s: float
    ttft_s: float
    n_prompt: int
    n_gen: int
    tokens_per_pass: float
    acceptance_rate: float
    peak_mb: float
    limit_mb: float
    wall_s: float
    same_text: str  # the text agrees with the row's first system's on this prompt and repetition ("" for the first)
    error: str
    at: str
    commit: str = ""  # the flexoffload commit that ran it (a "+" where the tree had changes)
    native: str = ""  # the native build's key (native.key)


# --- the systems ------------------------------------------------------------------------------------------------

def flexoffload(with_draft: bool = False, **fields_) -> Callable[[Case], Outcome]:
    """`flexoffload run` with these request fields (as the API takes them; with_draft: -md the case's draft),
    prepared in this process and run in a child in the case's cgroup, as `run --enforce` does."""
    def run(case: Case) -> Outcome:
        from flexoffload import api

        request = api.Request(model=str(case.model), prompt=case.prompt, n_predict=case.n_predict, n_ctx=case.n_ctx,
                              n_threads=N_THREADS, temp=0, mem=case.mem,
                              draft=str(case.draft) if with_draft else None, **fields_)
        t0 = time.perf_counter()
        try:
            prepared = api.prepare(request)
            if stopped.is_set():  # heard while preparing (in C, in this process): no child started
                _stop()
            budgets.drop_page_cache()
            r = api.run_in_cgroup(prepared, case.limit, timeout=case.timeout)
        except FlexoffloadError as e:
            return Outcome(error=str(e)[:200], wall_s=time.perf_counter() - t0)
        t = r.get("timings", {})
        return Outcome(ok=True, decode_tok_s=r["decode_tok_s"], ttft_s=r["ttft_s"], n_prompt=r["n_prompt"],
                       n_gen=r["n_gen"], tokens_per_pass=t.get("tokens_per_pass", 0.0),
                       acceptance_rate=t.get("acceptance_rate", 0.0), peak_mb=r["peak_mem_mb"],
                       wall_s=time.perf_counter() - t0, text=r["text"])
    return run


_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")
_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def completion(*flags: str) -> Callable[[Case], Outcome]:
    """llama-completion with these flags beside the common ones (greedy, -t 2, no conversation): its decode speed
    and time to the first token from its own timings. The prompt goes in with -p and --no-escape, as run takes it
    (-f would drop its final newline, escapes would rewrite its backslashes)."""
    def run(case: Case) -> Outcome:
        cmd = [str(native.tool("llama-completion")), "-m", str(case.model), "-p", case.prompt, "--no-escape",
               "-n", str(case.n_predict), "--temp", "0", "-c", str(case.n_ctx), "-t", str(N_THREADS), "-no-cnv",
               "--no-display-prompt", "--simple-io", *flags]
        budgets.drop_page_cache()
        try:
            r = budgets.run_limited(cmd, case.limit, timeout=case.timeout)
        except FlexoffloadError as e:
            return Outcome(error=f"llama-completion {e}", wall_s=case.timeout)
        out = Outcome(peak_mb=r.peak_mem_mb, wall_s=r.wall_s)
        decode, prompt = _EVAL.search(r.stderr.split("prompt eval time")[-1]), _PROMPT.search(r.stderr)
        if r.oom_killed:
            out.error = "out of memory at the cgroup's limit"
        elif r.returncode != 0 or not decode or not prompt:
            out.error = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]
        else:
            ms, runs = float(decode.group(1)), int(decode.group(2))
            out.ok, out.n_prompt, out.n_gen = True, int(prompt.group(2)), runs + 1
            out.decode_tok_s = runs / (ms / 1000) if ms > 0 else 0.0
            out.ttft_s = float(prompt.group(1)) / 1000
            out.text = r.stdout.removesuffix("\n\n") if r.stdout.endswith("\n\n") else r.stdout
        return out
    return run


def speculative(defaults: bool, n_draft: int = 16) -> Callable[[Case], Outcome]:
    """llama-speculative with the case's draft: at its defaults (mmap with repacking) or with its best flags for a
    budget (-lm mmap --no-repack, as bench/baseline.py runs it), drafting n_draft tokens a pass."""
    def run(case: Case) -> Outcome:
        from flexoffload.bench import baseline

        try:
            r = baseline.run(case.model, case.draft, case.prompt, case.n_predict, case.n_ctx, 512, N_THREADS, n_draft,
                             budget=case.limit, timeout=case.timeout, defaults=defaults)
        except FlexoffloadError as e:
            return Outcome(error=str(e)[:200], wall_s=case.timeout)
        return Outcome(ok=True, decode_tok_s=r.decode_tok_s, ttft_s=r.encode_s, n_prompt=r.n_prompt, n_gen=r.n_gen,
                       tokens_per_pass=r.tokens_per_pass, acceptance_rate=r.acceptance_rate, peak_mb=r.peak_mem_mb,
                       wall_s=r.wall_s, text=r.text)
    return run


# --- measuring --------------------------------------------------------------------------------------------------

@dataclass
class Reset:
    """Token Recycling's table put back before each run (see the module's docstring). As a context: the user's own
    table is set aside on entering and put back on leaving, whatever the runs did."""
    store: Path | None = None
    warm: Path | None = None

    def __call__(self) -> None:
        if self.store is None:
            return
        if self.warm is not None and self.warm.is_file():
            shutil.copyfile(self.warm, self.store)
        else:
            self.store.unlink(missing_ok=True)

    @property
    def _aside(self) -> Path:
        return self.store.with_name(self.store.name + ".aside")

    def __enter__(self) -> "Reset":
        if self.store is not None and self.store.is_file():
            self.store.rename(self._aside)
        return self

    def __exit__(self, *exc) -> None:
        if self.store is None:
            return
        self.store.unlink(missing_ok=True)
        if self._aside.is_file():
            self._aside.rename(self.store)


def agree(text: str, first: str) -> bool:
    """Two greedy texts agree when the shorter starts the longer: llama-speculative accepts a whole draft at its
    last pass, so it stops a few tokens past -n."""
    short, long_ = sorted((text, first), key=len)
    return bool(short) and long_.startswith(short)


def measure(rows: list[Row], repetitions: int, csv_path: Path, reset: Reset = Reset(), progress=None) -> list[Record]:
    """Run the rows, interleaved, writing each run's line to csv_path as it ends (appending to what is there)."""
    if repetitions < 1:
        raise FlexoffloadError("-r must be at least 1")
    records = []
    if csv_path.exists():  # a row measured again replaces its earlier runs: rows never mix two sessions' runs
        kept = [r for r in read_csv(csv_path) if r.row not in {row.name for row in rows}]
        write_csv(kept, csv_path)
    new = not csv_path.exists() or csv_path.stat().st_size == 0
    commit, build = tools.commit(), native.key()
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(Record)])
        if new:
            writer.writeheader()
            f.flush()
        for row in rows:
            cases = row.cases()
            for rep in range(repetitions):
                for name, case in cases:
                    first = None
                    for system in row.systems:
                        if stopped.is_set():
                            _stop()
                        reset()
                        out = system.run(case)
                        first = out.text if first is None else first
                        rec = Record(row=row.name, rep=rep, prompt=name, system=system.label, side=system.side,
                                     value=getattr(out, row.metric) if out.ok else 0.0, ok=out.ok,
                                     decode_tok_s=round(out.decode_tok_s, 3), ttft_s=round(out.ttft_s, 3),
                                     n_prompt=out.n_prompt, n_gen=out.n_gen,
                                     tokens_per_pass=round(out.tokens_per_pass, 3),
                                     acceptance_rate=round(out.acceptance_rate, 3), peak_mb=round(out.peak_mb, 1),
                                     limit_mb=round(case.limit / MiB, 1), wall_s=round(out.wall_s, 1),
                                     same_text="" if system is row.systems[0]
                                     else str(out.ok and agree(out.text, first)),
                                     error=out.error, at=time.strftime("%Y-%m-%dT%H:%M:%S"), commit=commit,
                                     native=build)
                        writer.writerow(asdict(rec))
                        f.flush()
                        records.append(rec)
                        if progress:
                            progress(rec)
    return records


# --- stopping ---------------------------------------------------------------------------------------------------

GRACE_S = 1.5  # what a stop's own unwind has to end the process before the watcher ends it
stopped = threading.Event()  # SIGTERM heard: no run starts after it


def _stop(*_) -> None:  # SIGTERM's handler, and a run about to start once it was heard
    stopped.set()
    raise SystemExit("headline: stopped")


@contextmanager
def stoppable(cleanup: Callable[[], None] = lambda: None):
    """SIGTERM (`timeout N scripts/headline`) ends the headline promptly, cleanup run once. Python runs a handler
    between the main thread's bytecodes only, not in a long C call (a decode in process: preparing, warming), and a
    ctypes callback (llama.cpp's log, an eval callback) drops the SystemExit raised in it. So a thread hears the
    signal too (the wakeup fd): no run starts after it, and past GRACE_S it cleans up, kills all children, exits."""
    lock, done = threading.Lock(), []

    def clean() -> None:
        with lock:  # the main thread's unwind and the watcher's: the second waits for the first, then skips
            if not done:
                done.append(cleanup())

    def watch() -> None:
        while (heard := ears.recv(1)) and heard[0] != signal.SIGTERM:
            pass
        if heard:  # else the headline ended
            stopped.set()
            time.sleep(GRACE_S)
            try:
                clean()
            finally:
                _kill_children()
                os._exit(128 + signal.SIGTERM)

    ears, mouth = socket.socketpair()
    mouth.setblocking(False)  # the C-level handler must never wait
    old_fd, old = signal.set_wakeup_fd(mouth.fileno(), warn_on_full_buffer=False), signal.signal(signal.SIGTERM, _stop)
    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.set_wakeup_fd(old_fd)
        clean()
        mouth.shutdown(socket.SHUT_WR)  # a watcher that heard nothing ends


def _kill_children() -> None:
    """This process's children and theirs (/proc lists them by thread), killed: none outlives a stop."""
    todo, found = [os.getpid()], []
    while todo:
        for f in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with suppress(OSError):  # gone meanwhile
                found += (kids := [int(x) for x in f.read_text().split()])
                todo += kids
    for pid in found:
        with suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)


# --- the table --------------------------------------------------------------------------------------------------

def read_csv(path: Path) -> list[Record]:
    types = {x.name: x.type for x in fields(Record)}
    cast = {"int": int, "float": float, "bool": lambda s: s == "True", "str": str}
    with path.open() as f:
        return [Record(**{k: cast[types[k]](v) for k, v in line.items()}) for line in csv.DictReader(f)]


def write_csv(records: list[Record], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(Record)])
        writer.writeheader()
        writer.writerows(asdict(r) for r in records)


@dataclass
class Summary:
    """One system of a row: its runs' median and range, and against the row's system, the paired ratios."""
    system: str
    side: str
    runs: int
    failed: int
    median: float = 0.0
    low: float = 0.0
    high: float = 0.0
    ratio: float = 0.0  # the row's system over this one (lower-is-better metrics inverted): above 1 ours is better
    ratio_low: float = 0.0
    ratio_high: float = 0.0
    passes: float = 0.0  # a speculating system's median tokens a target pass (0: it did not speculate)
    errors: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if not self.ratio:
            return ""
        if self.ratio_low <= 1 <= self.ratio_high:
            return "tie"
        return f"{self.ratio:.2f}x"


def summarize(records: list[Record], metric: str) -> list[Summary]:
    """A row's systems in the order they ran, the first being the row's own."""
    order = list(dict.fromkeys(r.system for r in records))
    ours = {(r.rep, r.prompt): r.value for r in records if r.system == order[0] and r.ok}
    out = []
    for name in order:
        runs = [r for r in records if r.system == name]
        values = sorted(r.value for r in runs if r.ok)
        s = Summary(system=name, side=runs[0].side, runs=len(runs), failed=sum(not r.ok for r in runs),
                    errors=sorted({r.error for r in runs if r.error}))
        if values:
            s.median, s.low, s.high = statistics.median(values), values[0], values[-1]
            s.passes = statistics.median(r.tokens_per_pass for r in runs if r.ok)
        if name != order[0]:
            pairs = [(ours[(r.rep, r.prompt)], r.value) for r in runs
                     if r.ok and r.value > 0 and ours.get((r.rep, r.prompt), 0) > 0]
            ratios = sorted(a / b if metric != "ttft_s" else b / a for a, b in pairs)
            if ratios:
                s.ratio, s.ratio_low, s.ratio_high = statistics.median(ratios), ratios[0], ratios[-1]
        out.append(s)
    return out


def _value(s: Summary, metric: str) -> str:
    if not s.runs - s.failed:
        return f"failed ({s.errors[0] if s.errors else '?'})"
    unit = "tok/s" if metric == "decode_tok_s" else "s"
    failed = f", {s.failed} of {s.runs} failed" if s.failed else ""
    passes = f", {s.passes:.2f} tokens a pass" if s.passes > 0 else ""  # whether (and how well) it speculated
    return f"{s.median:.2f} {unit} ({s.low:.2f}-{s.high:.2f}{failed}{passes})"


def table(rows: list[Row], records: list[Record]) -> str:
    """The README's table: a line per row measured (in rows' order), its system's median and range, each baseline
    with its ratio or tie."""
    lines = ["| capability | model | setting | flexoffload | baselines (median, range; ours against each) | build |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        mine = [r for r in records if r.row == row.name]
        if not mine:
            continue
        first, *others = summarize(mine, row.metric)
        cells = [f"{s.system} {_value(s, row.metric)}" + (f": **{s.verdict}**" if s.verdict else "")
                 for s in others]
        prompts, repetitions = len({r.prompt for r in mine}), len({r.rep for r in mine})
        lines.append(f"| {row.capability} | {row.model} | {row.setting}; {prompts} prompts x {repetitions} | "
                     f"{first.system} {_value(first, row.metric)} | {'; '.join(cells)} | {build(mine)} |")
    return "\n".join(lines)


def build(records: list[Record]) -> str:
    """The commits and native builds that made a row's runs (a row's runs before they were recorded: said so)."""
    made = dict.fromkeys(f"{r.commit[:9]}, native {r.native[:8]}" if r.commit else "not recorded" for r in records)
    if list(made) == ["not recorded"]:
        return "not recorded (before patches 0022-0030)"
    return "; ".join(made)


def replace_between(text: str, body: str) -> str:
    """text with what lies between the headline's markers replaced by body."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise FlexoffloadError(f"the README has no {BEGIN} ... {END} markers")
    return text[:start + len(BEGIN)] + "\n" + body + "\n" + text[end:]

"""Running a Prepared: in this process (`run_prepared`), or in a child held to the budget by a memory cgroup
(`run_in_cgroup`: the child receives the Prepared as JSON and runs it without preparing again). The child imports
this module: what it imports is memory the budget holds (the footprint probe measures it).
"""

from __future__ import annotations

import logging
import signal
import sys
import tempfile
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.measure import profiler
from flexoffload.memory import budgets
from flexoffload.memory.budgets import MiB, format_size
from flexoffload.native import devices
from flexoffload.plan import plans
from flexoffload.runtime import chat, engine
from flexoffload.speculation import speculate
from flexoffload.api.prepared import Prepared

log = logging.getLogger(__name__)


def tell(lines) -> None:
    """What the user is told (a Prepared's notes): the package's logger, which the CLI prints on stderr."""
    for line in lines:
        log.info(line.removeprefix("flexoffload: "))


def read_message() -> str:
    """A conversation's next message from stdin (a prompt mark where a person types it)."""
    if sys.stdin.isatty():
        return input("> ")
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


def _report_plan(p: Prepared) -> dict:
    """The plan's part of a run's result."""
    plan, model, settings = p.plan, p.model, p.settings
    out = {"policy": plan.policy, "window": settings.window, "io_threads": settings.io_threads,
           "memory_mb": plan.memory.total / MiB, "unreclaimable_mb": plan.memory.unreclaimable / MiB,
           "resident_mb": plan.memory.resident / MiB, "streamed_mb": plans.streamed_bytes(plan, model) / MiB,
           "predicted_tok_s": plan.predicted_tok_s, "roofline_tok_s": plan.roofline_tok_s}
    if plan.precision is not None:  # the model run is the plan's requantized file (result["model"])
        out["precision"] = {"source": plan.precision.source, "types": plan.precision.types,
                            "predicted_kld": plan.precision.predicted_kld}
    if settings.resident_after_prefill:
        sizes = {t.name: t.n_bytes for t in model.tensors}
        out["after_prefill"] = {"resident_mb": sum(sizes[n] for n in settings.resident_after_prefill) / MiB,
                                "tensors": len(settings.resident_after_prefill), "predicted_tok_s": p.decode_tok_s}
    return out


def run_prepared(p: Prepared, on_text=None, read_line=None, note=None) -> dict:
    """Load and generate in this process; the result as a dict (engine.Result's fields and the run's context).
    A conversation (request.chat) reads its messages with read_line() and says what is not a reply with note(line)."""
    r, model, settings, path = p.request, p.model, p.settings, str(p.model.path)
    if r.chat and p.tree is not None:  # a conversation whose replies the tree speculates
        store = Path(p.store) if p.store else None
        result = speculate.converse(path, settings, p.draft, p.tree, p.free, store, r.prompt.strip() or None,
                                    r.n_predict, read_line or read_message, on_text, note or log.info)
        result["spec"] = {"types": p.spec_type.split(","), "node_s": p.tree.node_s}
    elif r.chat:
        with engine.Engine(path, settings) as eng:
            result = chat.converse(eng, r.prompt.strip() or None, r.n_predict, read_line or read_message, on_text,
                                   note or (lambda line: log.info(line)))
    elif p.tree is not None:
        store = Path(p.store) if p.store else None
        result = speculate.run(path, settings, p.draft, p.tree, r.prompt, r.n_predict, on_text, p.free,
                               store).to_dict()
        if p.draft:
            result["draft"] = {"path": p.draft, "resident_mb": p.draft_bytes / MiB}
        result["spec"] = {"types": p.spec_type.split(","), "node_s": p.tree.node_s,
                          "hidden_nodes": p.tree.hidden_nodes,
                          "table_mb": result["timings"].get("free_table_bytes", 0) / MiB}
    else:
        with engine.Engine(path, settings) as eng:
            result = eng.generate(r.prompt, r.n_predict, on_text, forced=r.forced or None).to_dict()
    timings = result.get("timings", {})
    if "stream_read_gb_s" in timings:
        typical = p.tree is None and settings.window > 0  # a tree's passes are not
        profiler.record_run(path, timings, typical=typical)
        if p.tree is None and timings.get("expert_uses"):  # a tree's passes also wait while the draft drafts
            profiler.record_expert_run(path, timings)
    result.update(peak_mem_mb=budgets.peak_rss() / MiB, peak_source="rss", enforced=False,
                  budget_mb=p.limit / MiB if p.limit else None,
                  model={"path": path, "size": model.file_size, "name": model.name})
    if p.plan:
        result["plan"] = _report_plan(p)
    return result


def run_in_cgroup(p: Prepared, limit: int | None, stream_text: bool = False, timeout: float | None = None) -> dict:
    """Run the Prepared in a fresh process in its own memory cgroup of limit bytes (the budget, or more to measure
    with room to spare; None: no cgroup); its result with the cgroup's peak, faults and the peak of unreclaimable
    memory. The child runs the parent's decision as it is (api/child.py). stream_text: the child writes the text
    to this process's stdout as it comes."""
    with tempfile.TemporaryDirectory(prefix="flexoffload-") as tmp:
        prepared_file, result_file = Path(tmp) / "prepared.json", Path(tmp) / "result.json"
        prepared_file.write_text(p.to_json())
        cmd = [sys.executable, "-m", "flexoffload.api", str(prepared_file), str(result_file)]
        cmd += ["--stream-text"] if stream_text else []
        # a conversation's child reads this terminal; a Ctrl-C is its (it stops a reply), not this process's
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if p.request.chat else None
        try:
            run = budgets.run_limited(cmd, limit, timeout, capture_stdout=not stream_text, interactive=p.request.chat)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if run.returncode != 0 or not result_file.exists():
            if run.oom_killed:
                raise FlexoffloadError(
                    f"out of memory: the kernel stopped the run at the enforced budget of {format_size(limit)}")
            if p.settings.rpc:  # llama.cpp's RPC client aborts when a server stops answering (RPC_STATUS_ASSERT)
                raise FlexoffloadError(devices.failure(list(p.settings.rpc), "the run went on", run.stderr,
                                                       run.returncode))
            last = [line for line in run.stderr.strip().splitlines() if line.strip()][-1:] or [f"exit {run.returncode}"]
            where = " under the cgroup" if limit is not None else ""
            raise FlexoffloadError(f"the run failed{where}: {last[0].removeprefix('flexoffload: ')}")
        import json

        result = json.loads(result_file.read_text())
    if limit is None:  # a child only for its own sake (RPC): its peak is its RSS, as in process
        result["wall_s"] = run.wall_s
        return result
    result.update(peak_rss_mb=result["peak_mem_mb"], peak_mem_mb=run.peak_mem_mb, peak_source="cgroup",
                  enforced=True, faults=run.faults, peak_unreclaimable_mb=run.unreclaimable_mb, wall_s=run.wall_s)
    return result


def enforceable(p: Prepared) -> bool:
    """--enforce: whether a memory cgroup can hold the run at its budget (a run without a budget is refused; where no
    cgroup can be made, the user is told and the run goes unenforced)."""
    if p.limit is None:
        raise FlexoffloadError("--enforce needs a budget: add --mem SIZE")
    unavailable = budgets.cgroup_unavailable()
    if unavailable:
        log.info(f"{unavailable}; running without an enforced budget")
    return not unavailable


def execute(p: Prepared, on_text=None, enforce: bool = False, timeout: float | None = None,
            cgroup_limit: int | None = None) -> dict:
    """Run a Prepared as generate does: its notes told, in this process, or in a child (enforced, or where RPC
    servers could abort the process)."""
    tell(p.notes)
    if not enforce and p.settings.rpc:  # in a child: llama.cpp aborts the process when an RPC server fails
        return planned(p, run_in_cgroup(p, None, stream_text=on_text is not None, timeout=timeout))
    if not enforce or not enforceable(p):
        return planned(p, run_prepared(p, on_text))
    result = run_in_cgroup(p, cgroup_limit or p.limit, stream_text=on_text is not None, timeout=timeout)
    result["budget_mb"] = p.limit / MiB
    return planned(p, result)


def planned(p: Prepared, result: dict) -> dict:
    """The result with the memory the plan predicted for the run (planned_mb), to set beside its measured peak."""
    if p.plan is not None:
        result["planned_mb"] = p.plan.memory.total / MiB
    return result

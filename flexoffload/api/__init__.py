"""The Python API: the one place that wires measurement, planning and the runtime. The CLI, `bench` and the
scripts call it; nothing here prints.

    from flexoffload import api

    model = api.load("qwen2.5-coder-1.5b-instruct")                 # a catalog name or a GGUF path
    plan = api.plan(model, api.Budget(mem="0.5x"))                  # a Plan: read it, edit it, plan.write(DIR)
    result = api.generate(model, "def fib(n):", api.Generation(n_predict=32, temp=0), plan=plan)
    print(result["text"], result["decode_tok_s"], result["peak_mem_mb"])

The arguments come by concern (options.py declares each option once): what to generate (Generation), the budget
and how weights reach memory (Budget), speculation (Draft), RPC servers (Placement), lowered precision (Precision).
`generate(..., enforce=True)` runs in a child process the kernel holds to the budget.

Underneath, a flat Request carries all of them (`request(...)` makes it; `generate(Request)` takes it too).
`prepare` (api/preparing.py) decides what comes before loading as named steps and returns a Prepared, leaving the
request as given; `execute` (api/running.py) runs a Prepared here or in the cgroup's child (api/child.py), which
runs the parent's decision without preparing again.
"""

from __future__ import annotations

import importlib

# What the package exports, and the module of each: imported when first asked for, so that an enforced run's child
# (`python -m flexoffload.api`) loads only what its run needs: its memory is the budget's.
_EXPORTS = {
    "load": "calls", "plan": "calls", "generate": "calls", "tune": "calls", "experts": "calls", "check": "calls",
    "prepare": "preparing", "Prepared": "prepared", "execute": "running", "run_prepared": "running",
    "run_in_cgroup": "running", "enforceable": "running", "tell": "running", "serve": "serving",
    "plan_for_run": "planning", "expert_misses": "planning",
    "FREE_AUTO": "drafting", "FREE_AUTO_MD": "drafting", "recycle_store": "drafting",
    "Request": "calls", "request": "calls", "Generation": "calls", "Budget": "calls", "Draft": "calls",
    "Placement": "calls", "Precision": "calls",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

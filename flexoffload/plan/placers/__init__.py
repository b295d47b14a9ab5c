"""Placers: which weights go to which device (an RPC server, a GPU), and the host's streaming plan for the rest.

A policy is `place(problem) -> Placement`; `solve` then plans the host's tier for what stays on this machine
(planners.plan_budget on the host's view: resident under its budget, the rest streamed from disk) and predicts the
whole (placement.predict). Three tiers, each with its own budget: a device's memory, the host's, and the disk.

- `layers`: llama.cpp's -ngl: the most trailing layers (the output head counting as one) that fit every device,
  split among the devices as upstream does by default (by reported free memory: equal shares here).
- `split`: upstream's --tensor-split in proportion to the devices' budgets, every layer offloaded if they hold it.
- `oato`: OATO's Algorithm 1 (oato.py): operators by transfer-corrected affinity, a 90 % cap per device.
- `auto`, the default (ours.py): the placement the cost model predicts fastest among llama.cpp's layer assignments
  (any split of the trailing layers, the output head on a device or kept home) and the other policies' placements.

A device's budget is what its buffers may take (weights, its layers' KV cache, a compute buffer); the server's own
process needs ~20 MiB more (scripts/repro_oato gives each machine's cgroup 48 MiB beside the budget).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from flexoffload import FlexoffloadError
from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model
from flexoffload.memory.budgets import format_size
from flexoffload.memory.footprint import Footprint, costs
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.placement import DeviceProfile, Placement, device_bytes, to_plan
from flexoffload.plan.placers import layers, oato, ours, split
from flexoffload.plan.placers.common import Problem, evaluate
from flexoffload.plan.plans import Plan

# every policy by name
POLICIES: dict[str, Callable[[Problem], Placement]] = {"auto": ours.place, "oato": oato.place, "layers": layers.place,
                                                       "split": split.place}


def solve(problem: Problem, policy: str) -> Plan:
    """The policy's placement, the host's plan beside it, and the prediction, as a Plan (plans.write writes it)."""
    if policy not in POLICIES:
        raise FlexoffloadError(f"unknown placement {policy!r}: one of {', '.join(POLICIES)}")
    placement = POLICIES[policy](problem)
    if not problem.fits(placement):
        need = device_bytes(problem.model, placement, problem.kv_cache, problem.compute)
        worst = max(range(len(need)), key=lambda i: need[i] - problem.budgets[i])
        raise FlexoffloadError(f"{problem.names[worst]} cannot hold the {policy} placement: it needs "
                               f"{format_size(need[worst])}, its budget is {format_size(problem.budgets[worst])}")
    host, cost = evaluate(problem, placement)
    memory = device_bytes(problem.model, placement, problem.kv_cache, problem.compute)
    return to_plan(problem.model, placement, host, cost, memory, dict(zip(problem.names, problem.budgets)))


# What a server's buffers may take of the memory it reports free: the rest is for what it allocates beside them
# (a tensor's upload in pieces, the graph it is sent, its allocator's slack), so a plan or a profile never takes a
# server to its limit.
SERVER_SHARE = 0.9


def device_budget(named: dict[str, int], index: int, endpoint: str, free: int) -> int:
    """An RPC device's budget: --mem's for it (by its index or its server's address), else SERVER_SHARE of the memory
    it reports free."""
    return named.get(str(index), named.get(endpoint, int(free * SERVER_SHARE)))


def host_memory() -> int:
    """This machine's memory, the host's budget when none is given."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def problem_for(model: Model, devices: list[DeviceProfile], budgets: list[int], host_budget: int | None,
                profile: Profile, run: Footprint, n_ctx: int, n_batch: int, io_threads: int = IO_THREADS) -> Problem:
    """The problem of placing model over devices (each with its budget), the host's run taking run (its Footprint
    at n_ctx, n_batch) beside its weights."""
    host_budget = host_budget or host_memory()
    c = costs(run, budget=host_budget)
    return Problem(model, tuple(devices), tuple(budgets), host_budget, profile, c["kv_cache"], c["compute"], run,
                   io_threads, n_ctx, n_batch)


def parse_mem(spec: str, endpoints: list[str], model: Model) -> tuple[int | None, dict[str, int]]:
    """`--mem` with devices: `cpu=600M,rpc0=700M,10.0.0.2:50052=1G` (the host's budget; a device's by its order
    among the RPC devices or its server's address), or one size, the host's. Returns the host's budget (None if not
    given) and the budgets named, by rpc index ("0") or endpoint."""
    from flexoffload.memory.budgets import parse_size

    if "=" not in spec:
        return parse_size(spec, model.file_size), {}
    host, named = None, {}
    for item in spec.split(","):
        key, sep, size = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise FlexoffloadError(f"--mem {spec!r}: give SIZE or NAME=SIZE,... (cpu, rpc0, HOST:PORT)")
        if key == "cpu":
            host = parse_size(size, model.file_size)
        elif key.startswith("rpc") and key[3:].isdigit():
            if int(key[3:]) >= len(endpoints):
                raise FlexoffloadError(f"--mem names {key}, but --rpc gives {len(endpoints)} server(s)")
            named[key[3:]] = parse_size(size, model.file_size)
        elif key in endpoints:
            named[key] = parse_size(size, model.file_size)
        else:
            raise FlexoffloadError(f"--mem names {key!r}: not cpu, rpcN or one of --rpc's servers")
    return host, named

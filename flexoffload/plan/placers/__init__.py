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
from dataclasses import dataclass, replace

from flexoffload import FlexoffloadError
from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model
from flexoffload.memory.budgets import format_size
from flexoffload.memory.footprint import Footprint, costs
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.placement import (HOST, Cost, DeviceProfile, Placement, device_bytes, host_view, load_bytes,
                                        predict, tensor_devices, to_plan)
from flexoffload.plan.plans import Plan


@dataclass(frozen=True)
class Problem:
    """What every placer sees: the model, the devices as measured, their budgets, and the host's."""

    model: Model
    devices: tuple[DeviceProfile, ...]
    budgets: tuple[int, ...]  # bytes each device's buffers may take
    host_budget: int  # bytes for this whole process
    profile: Profile  # the host's
    kv_cache: int  # all layers' (a device holds its layers' share)
    compute: int  # a compute buffer's bytes (the host's; a device's is taken as large)
    run: Footprint  # what the host's run takes beside weights at n_ctx, n_batch (measure.footprint)
    io_threads: int = IO_THREADS
    n_ctx: int = 512
    n_batch: int = 64

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    def fits(self, placement: Placement) -> bool:
        """Whether every device holds what the placement gives it."""
        need = device_bytes(self.model, placement, self.kv_cache, self.compute)
        return all(n <= b for n, b in zip(need, self.budgets))

    def host_bytes(self, placement: Placement) -> int:
        where = tensor_devices(self.model, placement)
        return sum(t.n_bytes for t in self.model.tensors if where[t.name] == HOST)

    def host_capacity(self, placement: Placement) -> int:
        c = costs(self.run, budget=self.host_budget)
        return (self.host_budget - c["kv_cache"] - c["compute"] - c["overhead"] - c["code"]
                - load_bytes(self.model, placement))

    def quick(self, placement: Placement) -> float:
        """A fast estimate of seconds a token: every host tensor resident, and what the host cannot hold read from
        disk once a token on top (ranks candidates before the host tier is planned for the best few)."""
        where = tensor_devices(self.model, placement)
        resident = {n for n, d in where.items() if d == HOST}
        cost = predict(self.model, placement, list(self.devices), self.profile, resident, 0, self.io_threads)
        missing = max(0, self.host_bytes(placement) - self.host_capacity(placement))
        return cost.seconds_per_token + missing / self.profile.disk_bw


def layer_counts(n_gpu_layers: int, n_devices: int) -> list[list[int]]:
    """Every way of giving n_devices devices the trailing n_gpu_layers layers in order (counts per device)."""
    if n_devices == 1:
        return [[n_gpu_layers]]
    out = []
    for first in range(n_gpu_layers + 1):
        out += [[first] + rest for rest in layer_counts(n_gpu_layers - first, n_devices - 1)]
    return out


def evaluate(problem: Problem, placement: Placement) -> tuple[Plan, Cost]:
    """The host's plan for what the placement leaves it, and the predicted cost of the whole."""
    from flexoffload.plan.planners import plan_budget

    model = problem.model
    where = tensor_devices(model, placement)
    view = host_view(model, [n for n, d in where.items() if d != HOST])
    # the host's tier is planned in what loading the devices' weights leaves it, and that is counted as overhead
    loading = load_bytes(model, placement)
    host = plan_budget(view, problem.host_budget - loading, "balanced", problem.profile, problem.run,
                       io_threads=problem.io_threads)
    host = replace(host, budget=problem.host_budget,
                   memory=replace(host.memory, overhead=host.memory.overhead + loading))
    cost = predict(model, placement, list(problem.devices), problem.profile, host.resident, host.window,
                   problem.io_threads)
    return host, cost


def solve(problem: Problem, policy: str) -> Plan:
    """The policy's placement, the host's plan beside it, and the prediction, as a Plan (plans.write writes it)."""
    from flexoffload.plan.placers import layers, oato, ours, split

    policies: dict[str, Callable[[Problem], Placement]] = {"auto": ours.place, "oato": oato.place,
                                                            "layers": layers.place, "split": split.place}
    if policy not in policies:
        raise FlexoffloadError(f"unknown placement {policy!r}: one of {', '.join(policies)}")
    placement = policies[policy](problem)
    if not problem.fits(placement):
        need = device_bytes(problem.model, placement, problem.kv_cache, problem.compute)
        worst = max(range(len(need)), key=lambda i: need[i] - problem.budgets[i])
        raise FlexoffloadError(f"{problem.names[worst]} cannot hold the {policy} placement: it needs "
                               f"{format_size(need[worst])}, its budget is {format_size(problem.budgets[worst])}")
    host, cost = evaluate(problem, placement)
    memory = device_bytes(problem.model, placement, problem.kv_cache, problem.compute)
    return to_plan(problem.model, placement, host, cost, memory, dict(zip(problem.names, problem.budgets)))


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

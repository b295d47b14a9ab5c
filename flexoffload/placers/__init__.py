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

from .. import FlexoffloadError
from ..budget import format_size
from ..costmodel import Profile
from ..defaults import IO_THREADS
from ..model import Model
from ..placement import (HOST, Cost, DeviceProfile, Placement, device_bytes, host_view, load_bytes, predict,
                         tensor_devices, to_plan)
from ..plan import Plan


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
    host_costs: dict  # planners.run_costs: the host's KV cache, compute, overhead and code
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
        c = self.host_costs
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
    from ..planners import plan_budget

    model = problem.model
    where = tensor_devices(model, placement)
    view = host_view(model, [n for n, d in where.items() if d != HOST])
    # the host's tier is planned in what loading the devices' weights leaves it, and that is counted as overhead
    loading = load_bytes(model, placement)
    host = plan_budget(view, problem.host_budget - loading, "balanced", problem.profile, n_ctx=problem.n_ctx,
                       n_batch=problem.n_batch, io_threads=problem.io_threads)
    host = replace(host, budget=problem.host_budget,
                   memory=replace(host.memory, overhead=host.memory.overhead + loading))
    cost = predict(model, placement, list(problem.devices), problem.profile, host.resident, host.window,
                   problem.io_threads)
    return host, cost


def solve(problem: Problem, policy: str) -> Plan:
    """The policy's placement, the host's plan beside it, and the prediction, as a Plan (plans.write writes it)."""
    from . import layers, oato, ours, split

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
                profile: Profile, n_ctx: int, n_batch: int, io_threads: int = IO_THREADS) -> Problem:
    from ..planners import run_costs

    host_budget = host_budget or host_memory()
    costs = run_costs(model, n_ctx, n_batch, budget=host_budget)
    return Problem(model, tuple(devices), tuple(budgets), host_budget, profile, costs["kv_cache"],
                   costs["compute"], costs, io_threads, n_ctx, n_batch)


def parse_mem(spec: str, endpoints: list[str], model: Model) -> tuple[int | None, dict[str, int]]:
    """`--mem` with devices: `cpu=600M,rpc0=700M,10.0.0.2:50052=1G` (the host's budget; a device's by its order
    among the RPC devices or its server's address), or one size, the host's. Returns the host's budget (None if not
    given) and the budgets named, by rpc index ("0") or endpoint."""
    from ..budget import parse_size

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


def for_endpoints(model: Model, endpoints: list[str], mem: str | None, policy: str, profile: Profile,
                  n_threads: int, n_ctx: int, n_batch: int, io_threads: int = IO_THREADS) -> Plan:
    """A placement plan over RPC servers (each one's first device), every device profiled (cached) and budgeted:
    by --mem where named, else by the memory it reports."""
    from .. import devices, opprofile

    host, named = parse_mem(mem, endpoints, model) if mem else (None, {})
    profiles, budgets = [], []
    for i, endpoint in enumerate(endpoints):
        device = devices.probe_rpc(endpoint)[0]
        budget = named.get(str(i), named.get(endpoint, device.free))
        measured = opprofile.device_cached(model, endpoint, n_threads, budget=budget)
        profiles.append(DeviceProfile.from_dict({**{k: v for k, v in measured.items() if k != "measured"},
                                                 "name": device.name}))
        budgets.append(budget)
    problem = problem_for(model, profiles, budgets, host, profile, n_ctx, n_batch, io_threads)
    return solve(problem, policy)

"""What every placer shares: the problem it sees (`Problem`: the model, the devices and their budgets, the host's),
the ways of splitting layers among devices, and the host's plan and predicted cost of a placement (`evaluate`).

The placers import these from here, and the package's __init__ imports the placers to list them (POLICIES), so no
module imports back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model
from flexoffload.memory.footprint import Footprint, costs
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.placement import (HOST, Cost, DeviceProfile, Placement, device_bytes, host_view, load_bytes,
                                        predict, tensor_devices)
from flexoffload.plan.planners import plan_budget
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
        """The devices' buffer type names, in llama.cpp's order."""
        return tuple(d.name for d in self.devices)

    def fits(self, placement: Placement) -> bool:
        """Whether every device holds what the placement gives it."""
        need = device_bytes(self.model, placement, self.kv_cache, self.compute)
        return all(n <= b for n, b in zip(need, self.budgets))

    def host_bytes(self, placement: Placement) -> int:
        """The weights' bytes the placement leaves on this machine."""
        where = tensor_devices(self.model, placement)
        return sum(t.n_bytes for t in self.model.tensors if where[t.name] == HOST)

    def host_capacity(self, placement: Placement) -> int:
        """The host's memory for weights: its budget less its run's costs and the loading of the devices' weights."""
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

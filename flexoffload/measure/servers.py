"""A placement over RPC servers as measured: each server probed for its device and free memory, each device's
operators profiled (cached), and the placers' problem solved over them (plan/placers)."""

from __future__ import annotations

from flexoffload.defaults import IO_THREADS
from flexoffload.gguf.model import Model
from flexoffload.measure import probe, opprofile
from flexoffload.native import devices
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.placement import DeviceProfile
from flexoffload.plan.placers import parse_mem, problem_for, solve
from flexoffload.plan.plans import Plan

# What a server's buffers may take of the memory it reports free: the rest is for what it allocates beside them
# (a tensor's upload in pieces, the graph it is sent, its allocator's slack), so a plan or a profile never takes a
# server to its limit.
SERVER_SHARE = 0.9


def for_endpoints(model: Model, endpoints: list[str], mem: str | None, policy: str, profile: Profile,
                  n_threads: int, n_ctx: int, n_batch: int, io_threads: int = IO_THREADS) -> Plan:
    """A placement plan over RPC servers (each one's first device), every device profiled (cached) and budgeted:
    by --mem where named, else by SERVER_SHARE of the memory it reports free (its cgroup's, patch 0017)."""
    host, named = parse_mem(mem, endpoints, model) if mem else (None, {})
    profiles, budgets = [], []
    for i, endpoint in enumerate(endpoints):
        device = devices.probe_rpc(endpoint)[0]
        budget = named.get(str(i), named.get(endpoint, int(device.free * SERVER_SHARE)))
        measured = opprofile.device_cached(model, endpoint, n_threads, budget=budget)
        profiles.append(DeviceProfile.from_dict({**{k: v for k, v in measured.items() if k != "measured"},
                                                 "name": device.name}))
        budgets.append(budget)
    run = probe.measure(model, n_ctx, n_batch)
    problem = problem_for(model, profiles, budgets, host, profile, run, n_ctx, n_batch, io_threads)
    return solve(problem, policy)

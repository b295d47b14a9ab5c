"""Small machines on this one, for llama.cpp's RPC: each ggml-rpc-server in its own network namespace and memory
cgroup, joined to the host by a veth pair whose two ends are limited to a LAN's rate (tc tbf).

This is how a user with several small boxes would have it, reproduced on one: a server sees only its own memory
budget and reaches the client only over its link. Not modelled: a LAN's latency (this kernel has no netem; a veth
round trip is tens of microseconds, a switched LAN's a few hundred) and separate CPUs (the servers share this
machine's cores with the client).

    with Machines(2, memory=640 << 20, rate="1gbit") as machines:
        machines.endpoints  # ['10.77.0.2:50052', '10.77.1.2:50052']

Everything made is removed on exit, and by `clean()` after a crash (scripts/rpc_machines down). One set of machines
at a time (a new one clears what an old one left). Needs root.
"""

from __future__ import annotations

import os
import subprocess
import time

from flexoffload import FlexoffloadError
from flexoffload.memory.budgets import MemoryCgroup
from flexoffload.native import SPIN_COUNT
from flexoffload.native.devices import RPC_PORT, probe_rpc

PREFIX = "fo-rpc"  # namespaces fo-rpc0..., host-side veth ends fo-rpc0h..., their peers fo-rpc0n...
SUBNET = "10.77"  # machine i is 10.77.i.2, the host's end of its link 10.77.i.1
START_TIMEOUT = 20.0


def _run(*args: str, netns: str | None = None) -> None:
    """A command (ip, tc), in a network namespace if netns; a one-line error if it fails."""
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FlexoffloadError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


def clean() -> None:
    """Remove every namespace and link a Machines left behind (their servers die with their namespace's kill)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in [n for n in names if n.startswith(PREFIX)]:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


class Machines:
    """n RPC servers, each in a namespace and a memory cgroup of `memory` bytes (or memory[i]), over links of
    `rate`."""

    def __init__(self, n: int, memory: int | list[int], rate: str = "1gbit", threads: int = 1,
                 server: str | None = None):
        from flexoffload import native

        if n < 1 or n > 200:
            raise FlexoffloadError("between 1 and 200 machines")
        self.n, self.memory, self.rate, self.threads = n, memory, rate, threads
        self.server = server or str(native.tool("ggml-rpc-server"))
        self.endpoints: list[str] = []
        self._cgroups: list[MemoryCgroup] = []
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Machines":
        clean()
        try:
            for i in range(self.n):
                self._start(i)
            self._wait()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, i: int) -> None:
        ns, host_end, peer = f"{PREFIX}{i}", f"{PREFIX}{i}h", f"{PREFIX}{i}n"
        host_ip, ip = f"{SUBNET}.{i}.1", f"{SUBNET}.{i}.2"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/24", "dev", host_end)
        _run("ip", "link", "set", host_end, "up")
        _run("ip", "addr", "add", f"{ip}/24", "dev", peer, netns=ns)
        _run("ip", "link", "set", peer, "up", netns=ns)
        _run("ip", "link", "set", "lo", "up", netns=ns)
        # tbf shapes what a device sends: both ends, so each direction is held to the rate
        for dev, where in ((host_end, None), (peer, ns)):
            _run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
                "latency", "100ms", netns=where)
        cgroup = MemoryCgroup(self.memory[i] if isinstance(self.memory, list) else self.memory)
        self._cgroups.append(cgroup)
        # bound to the private link only (RPC is unauthenticated); nsenter enters the network namespace alone, where
        # `ip netns exec` would also mount a fresh /sys and hide /sys/fs/cgroup: the server sees its cgroup, as a
        # container does
        self._procs.append(cgroup.popen(["nsenter", f"--net=/var/run/netns/{ns}", self.server, "-H", ip, "-p",
                                         str(RPC_PORT),
                                         "-t", str(self.threads)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env={**os.environ, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT",
                                                                                           SPIN_COUNT)}))
        self.endpoints.append(f"{ip}:{RPC_PORT}")

    def _wait(self) -> None:
        """Until every server answers a probe (it listens a moment after it starts)."""
        deadline = time.monotonic() + START_TIMEOUT
        for endpoint, proc in zip(self.endpoints, self._procs):
            while True:
                if proc.poll() is not None:
                    raise FlexoffloadError(f"the RPC server for {endpoint} exited with {proc.returncode}")
                try:
                    probe_rpc(endpoint, timeout=1.0)
                    break
                except FlexoffloadError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)

    def peaks(self) -> list[int]:
        """Each machine's peak memory so far (its cgroup's)."""
        return [c.peak() for c in self._cgroups]

    def kill(self, i: int) -> None:
        """Kill machine i's server (a fault, for tests)."""
        self._procs[i].kill()
        self._procs[i].wait()

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for cgroup in self._cgroups:
            cgroup.__exit__(None, None, None)
        self._procs, self._cgroups = [], []
        clean()

"""Small machines on this one, for llama.cpp's RPC: each ggml-rpc-server in its own network namespace and memory
cgroup, joined to the host by a veth pair whose two ends are limited to a LAN's rate (tc tbf).

This is how a user with several small boxes would have it, reproduced on one: a server sees only its own memory
budget and reaches the client only over its link. Not modelled: a LAN's latency (this kernel has no netem; a veth
round trip is tens of microseconds, a switched LAN's a few hundred) and separate CPUs (the servers share this
machine's cores with the client).

    with Machines(2, memory=640 << 20, rate="1gbit") as machines:
        machines.endpoints  # ['10.77.0.2:50052', '10.77.1.2:50052']

Everything made is removed on exit. A namespace's name says which process made it (its pid and start time):
`clean()` (scripts/rpc_machines down) removes those whose maker no longer runs (a crash: no exit ran) and nothing
else, so two sets of machines (two test sessions) live side by side, and a namespace another tool named alike is
left alone. Needs root.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.memory.budgets import MemoryCgroup
from flexoffload.native import SPIN_COUNT, process
from flexoffload.native.devices import RPC_PORT, probe_rpc

# namespaces fo-rpc-PID.START-K-i: the maker's pid and start time, K its process's count of Machines, i the machine
PREFIX = "fo-rpc"
NAMESPACE = re.compile(rf"^{re.escape(PREFIX)}-(?P<pid>\d+)\.(?P<start>\d+)-\d+-\d+$")
SUBNET = "10.77"  # each machine's link a 10.77.k.0/24 no address of the host is in: the host's end .1, the machine .2
START_TIMEOUT = 20.0
_made = itertools.count()  # this process's Machines


def _run(*args: str, netns: str | None = None) -> None:
    """A command (ip, tc), in a network namespace if netns; a one-line error if it fails."""
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    r = process.run(cmd)
    if r.returncode != 0:
        raise FlexoffloadError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


def _owner(pid: int | str) -> str | None:
    """PID.START of a running process (START: when it started, in clock ticks after boot, /proc/PID/stat's 22nd
    field), so that a pid the kernel gave again to another process names another owner; None where none runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}.{stat.rsplit(')', 1)[1].split()[19]}"


def namespaces() -> list[str]:
    """The network namespaces on this machine (`ip netns list`), whoever made them."""
    listed = process.run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _remove(ns: str) -> None:
    """Kill the processes in namespace ns and delete it (its veth pair goes with it)."""
    pids = process.run(["ip", "netns", "pids", ns]).stdout.split()
    for pid in pids:
        process.run(["kill", "-9", pid])
    process.run(["ip", "netns", "del", ns])


def clean() -> list[str]:
    """Remove the namespaces Machines made whose maker no longer runs (killed before its exit), their servers and
    links with them; the names removed. A namespace of a running maker, or named otherwise, is not touched."""
    removed = []
    for ns in namespaces():
        m = NAMESPACE.match(ns)
        if m and _owner(m["pid"]) != f"{m['pid']}.{m['start']}":
            _remove(ns)
            removed.append(ns)
    return removed


def _free_subnet(taken: set[int]) -> int:
    """The first k whose 10.77.k.0/24 no address of the host is in (nor taken)."""
    shown = process.run(["ip", "-o", "-4", "addr", "show"]).stdout
    used = taken | {int(k) for k in re.findall(rf"inet {re.escape(SUBNET)}\.(\d+)\.", shown)}
    for k in range(256):
        if k not in used:
            return k
    raise FlexoffloadError(f"no free {SUBNET}.k.0/24 subnet left for a machine's link")


class Machines:
    """n RPC servers, each in a namespace and a memory cgroup of `memory` bytes (or memory[i]), over links of
    `rate`. names[i]: machine i's (namespace, host's end of its link, its own end)."""

    def __init__(self, n: int, memory: int | list[int], rate: str = "1gbit", threads: int = 1,
                 server: str | None = None):
        from flexoffload import native

        if n < 1 or n > 200:
            raise FlexoffloadError("between 1 and 200 machines")
        self.n, self.memory, self.rate, self.threads = n, memory, rate, threads
        self.server = server or str(native.tool("ggml-rpc-server"))
        self.endpoints: list[str] = []
        self.names: list[tuple[str, str, str]] = []
        self._count = next(_made)
        self._subnets: set[int] = set()
        self._namespaces: list[str] = []  # the ones made, removed on close
        self._cgroups: list[MemoryCgroup] = []
        self._procs: list[process.Popen] = []

    def __enter__(self) -> "Machines":
        clean()  # what a crashed maker left (its links would hold the subnets)
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
        # an interface's name has at most 15 characters: the maker's pid (hex), this Machines' count and i
        ns = f"{PREFIX}-{_owner(os.getpid())}-{self._count}-{i}"
        link = f"fo{os.getpid():x}.{self._count % 256:x}.{i:x}"
        host_end, peer = link + "h", link + "n"
        k = _free_subnet(self._subnets)
        self._subnets.add(k)
        host_ip, ip = f"{SUBNET}.{k}.1", f"{SUBNET}.{k}.2"
        _run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        self.names.append((ns, host_end, peer))
        # the peer made inside the namespace: the pair never exists outside it, and goes when it is deleted
        _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", peer, "netns", ns)
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
                                        stdout=process.DEVNULL, stderr=process.DEVNULL,
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
        """Stop the servers, remove their cgroups and this set's namespaces (their links go with them)."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for cgroup in self._cgroups:
            cgroup.__exit__(None, None, None)
        self._procs, self._cgroups = [], []
        for ns in self._namespaces:  # its own only: another maker's are not this one's to remove
            _remove(ns)
        self._namespaces, self._subnets = [], set()

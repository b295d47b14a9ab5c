"""Backends and RPC machines (native/devices.py, bench/machines.py): devices listed, servers probed before llama.cpp
meets them, tensors placed on a server by a plan and computed there with the same greedy tokens, faults as one-line
errors, links held to their rate."""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import cli
from flexoffload import FlexoffloadError
from flexoffload import api
from flexoffload.native import devices
from flexoffload.plan import placement
from flexoffload.bench import machines as rpc
from flexoffload.gguf import synth
from flexoffload.plan import plans
from flexoffload.gguf.model import load


def test_this_machine_has_a_cpu_device_with_its_memory():
    found = devices.local()
    cpu = next(d for d in found if d.kind == "CPU")
    assert cpu.name == "CPU" and 0 < cpu.free <= cpu.total
    listed = json.loads(cli("devices", "--json", check=True).stdout)
    assert [d["name"] for d in listed] == [d.name for d in found]


@pytest.mark.parametrize("text,endpoints", [("a:1,b", ["a:1", "b:50052"]), (" 10.0.0.2:50052 ", ["10.0.0.2:50052"])])
def test_endpoints_are_read_as_llama_cpp_takes_them(text, endpoints):
    assert devices.parse_endpoints(text) == endpoints


@pytest.mark.parametrize("text", ["a:b", "a:0", ",", "a:70000"])
def test_a_bad_endpoint_is_one_error(text):
    with pytest.raises(FlexoffloadError):
        devices.parse_endpoints(text)


def _serve(handler) -> tuple[str, socket.socket]:
    """A local TCP server answering each connection with handler(conn), in a thread."""
    server = socket.create_server(("127.0.0.1", 0))

    def loop():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            handler(conn)

    threading.Thread(target=loop, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}", server


def _closed_port() -> str:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def test_servers_that_cannot_serve_are_named_in_one_line(tiny_model):
    """Refused, not speaking the protocol, silent: each a one-line error naming the server, within the probe's
    timeout, from `run` before anything is loaded (llama.cpp itself would abort the process)."""
    with pytest.raises(FlexoffloadError, match="refused"):
        devices.probe_rpc(_closed_port())
    http, s1 = _serve(lambda c: (c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"), c.close()))
    with pytest.raises(FlexoffloadError, match="did not answer as ggml-rpc-server"):
        devices.probe_rpc(http)
    held = []
    silent, s2 = _serve(held.append)  # accepts and never answers
    t0 = time.monotonic()
    with pytest.raises(FlexoffloadError, match="did not answer within"):
        devices.probe_rpc(silent, timeout=0.5)
    assert time.monotonic() - t0 < 3
    r = cli("run", "-m", str(tiny_model), "-p", "x", "-n", "1", "--rpc", http)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and http in r.stderr
    s1.close(), s2.close()


def test_a_plan_round_trips_its_placed_tensors(tmp_path, tiny_model):
    m = load(tiny_model)
    p = placement.layers_on(m, {1}, "RPC0[10.77.0.2:50052]")
    assert {n for n, _ in p.placed} == {t.name for t in m.tensors if t.layer == 1}
    assert p.memory.resident == sum(t.n_bytes for t in m.tensors if t.layer != 1)  # this machine's share
    plans.write(p, tmp_path / "p")
    assert (tmp_path / "p" / "tensors.ot").read_text().endswith("=RPC0[10.77.0.2:50052]\n")
    assert plans.read(tmp_path / "p") == p
    # a tensors.ot that places other tensors than plan.json says is refused
    (tmp_path / "p" / "tensors.ot").write_text("^blk\\.0\\..*$=RPC0[10.77.0.2:50052]\n")
    with pytest.raises(FlexoffloadError, match="does not place exactly"):
        plans.read(tmp_path / "p")
    # a placed plan without its servers is refused before loading
    plans.write(p, tmp_path / "p")
    with pytest.raises(FlexoffloadError, match="give their servers with --rpc"):
        api.prepare(api.Request(model=str(tiny_model), prompt="x", plan_dir=str(tmp_path / "p")))


# --- with llama.cpp's ggml-rpc-server, on machines of their own (network namespaces, cgroups) --------------------

def _placed_plan(model_path, directory, endpoint, layers):
    """All resident, the weights of the given layers placed on the server."""
    return plans.write(placement.layers_on(load(model_path), layers, f"RPC0[{endpoint}]"), directory)


@pytest.fixture
def one_machine():
    with rpc.Machines(1, memory=512 << 20, rate="1gbit") as machines:
        yield machines
    assert not {ns for ns, _, _ in machines.names} & set(rpc.namespaces()), "a namespace was left behind"


def test_tensors_placed_on_an_rpc_machine_give_the_same_tokens(tmp_path, one_machine):
    path = synth.write(tmp_path / "qwen2.gguf", synth.SHAPES["qwen2-tiny"])
    endpoint = one_machine.endpoints[0]
    server = devices.probe_rpc(endpoint)
    assert server[0].name == f"RPC0[{endpoint}]" and server[0].total > 0
    listed = cli("devices", "--rpc", endpoint, check=True).stdout
    assert f"RPC0[{endpoint}]" in listed
    plan_dir = _placed_plan(path, tmp_path / "plan", endpoint, layers={1, 2})
    request = api.Request(model=str(path), prompt="a b c d", n_predict=12, temp=0, n_ctx=256, n_batch=32)
    alone = api.generate(dataclasses.replace(request, strategy="mmap"))
    placed = api.generate(dataclasses.replace(request, plan_dir=str(plan_dir), rpc=endpoint))
    assert placed["tokens"] == alone["tokens"]
    assert max(one_machine.peaks()) > 0


def test_layers_offloaded_with_their_kv_cache_give_the_same_tokens(tmp_path, one_machine, tiny_model):
    """-ngl N with --rpc: llama.cpp's own offload of the last N layers, KV cache and all, to the server: the same
    tokens, and at least those layers' weights went over the machine's link (counted at the link, not by the
    server's peak, which an earlier test of the module may have set higher)."""
    path = synth.write(tmp_path / "qwen2.gguf", synth.SHAPES["qwen2-tiny"])
    endpoint = one_machine.endpoints[0]
    request = api.Request(model=str(path), prompt="a b c d", n_predict=12, temp=0, n_ctx=256, n_batch=32)
    alone = api.generate(request)
    host_end = one_machine.names[0][1]
    sent = _link_bytes(host_end)[0]
    offloaded = api.generate(dataclasses.replace(request, rpc=endpoint, n_gpu_layers=2))
    assert offloaded["tokens"] == alone["tokens"]
    layers = sum(t.n_bytes for t in load(path).tensors if t.layer in (1, 2))
    assert _link_bytes(host_end)[0] - sent >= layers  # the last 2 layers' weights went to the server
    r = cli("run", "-m", str(tiny_model), "-p", "x", "-n", "1", "-ngl", "2")
    assert r.returncode == 1 and "add --rpc" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_server_killed_mid_run_ends_the_run_with_one_error(tmp_path, one_machine):
    """Killed once the text has begun: the run ends within seconds with one line naming the servers, no hang."""
    import os
    import sys

    path = synth.write(tmp_path / "qwen2.gguf", synth.SHAPES["qwen2-tiny"])
    endpoint = one_machine.endpoints[0]
    plan_dir = _placed_plan(path, tmp_path / "plan", endpoint, layers={0, 1, 2})
    proc = subprocess.Popen([sys.executable, "-m", "flexoffload", "run", "-m", str(path), "-p", "a b c", "-n", "480",
                             "-c", "512", "--temp", "0", "--plan", str(plan_dir), "--rpc", endpoint],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.read(1), "no text came"
    t0 = time.monotonic()
    one_machine.kill(0)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "stopped answering" in err.decode().strip().splitlines()[-1]
    assert time.monotonic() - t0 < 30


def _link_bytes(device: str) -> tuple[int, int]:
    """The bytes the host's end of a machine's link has sent (to the machine) and received (from it)."""
    stats = Path("/sys/class/net") / device / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def test_a_link_is_held_to_its_rate_both_ways_and_timed_over_it():
    """100 Mbit/s by tc tbf on both ends of the machine's link (each direction held to it); measure_link moves its
    bytes over that link, to the server and back, every repeat, and reports a latency and a bandwidth each way. How
    fast is not checked here: it depends on how busy the machine is (the benchmarks hold speeds)."""
    n_bytes, repeats = 2 << 20, 2
    with rpc.Machines(1, memory=256 << 20, rate="100mbit") as machines:
        endpoint = machines.endpoints[0]
        namespace, host_end, peer = machines.names[0]
        for cmd in (["tc", "qdisc", "show", "dev", host_end],
                    ["ip", "netns", "exec", namespace, "tc", "qdisc", "show", "dev", peer]):
            shown = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            assert "qdisc tbf" in shown and "rate 100Mbit" in shown, shown
        sent, received = _link_bytes(host_end)
        link = devices.measure_link(endpoint, n_bytes, repeats=repeats)
        now_sent, now_received = _link_bytes(host_end)
        assert now_sent - sent >= repeats * n_bytes  # the tensor's data, to the server, each repeat
        assert now_received - received >= repeats * n_bytes  # and read back
        assert link.endpoint == endpoint and link.latency_s > 0 and link.send_bw > 0 and link.recv_bw > 0
        assert devices.probe_rpc(endpoint)  # the server is well after it, its buffer freed
        out = cli("devices", "--rpc", endpoint, "--links", "--json", check=True).stdout
        assert json.loads(out)["links"][0]["endpoint"] == endpoint


def _netns_usable() -> bool:
    """Whether this process may make network namespaces (`ip netns` present, root)."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


@pytest.fixture
def namespaces_not_its_own():
    """Namespaces named like the machines' that Machines did not make, each with a process in it: another tool's
    (fo-rpc0, as machines' were once named; fo-rpc-bench) and another running maker's (pid 1's name: it always
    runs); and one a maker that no longer runs left (this process's pid with another start time: a pid given again),
    which clean() does remove. {name: the process in it}; all removed afterwards."""
    if not _netns_usable():
        pytest.skip("`ip netns` is not usable here (not root, or no iproute2)")
    start = int(rpc._owner(os.getpid()).split(".")[1])
    names = ["fo-rpc0", "fo-rpc-bench", f"{rpc.PREFIX}-{rpc._owner(1)}-0-0",
             f"{rpc.PREFIX}-{os.getpid()}.{start + 1}-0-0"]
    made: dict[str, subprocess.Popen] = {}
    try:
        for ns in names:
            if ns in rpc.namespaces():
                pytest.skip(f"namespace {ns} exists already")
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            made[ns] = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
        yield made
    finally:
        for ns, proc in made.items():
            proc.kill()
            proc.wait()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_clean_removes_only_what_a_maker_that_no_longer_runs_left(namespaces_not_its_own):
    """Machines' exit and clean() (scripts/rpc_machines down) remove the namespaces of their own set and of a maker
    that no longer runs, their processes killed; another tool's namespace and another running maker's, though named
    with the same prefix, are left as they are, their processes running (before: every fo-rpc* namespace's processes
    were killed and the namespace deleted)."""
    *foreign, stale = namespaces_not_its_own
    with rpc.Machines(1, memory=256 << 20, rate="1gbit") as machines:
        own = machines.names[0][0]
        assert devices.probe_rpc(machines.endpoints[0])
        present = rpc.namespaces()
        assert own in present and stale not in present, present  # entering cleared what a dead maker left
        assert all(ns in present for ns in foreign), present
    assert rpc.clean() == []
    present = rpc.namespaces()
    assert own not in present and all(ns in present for ns in foreign), present
    for ns in foreign:
        proc = namespaces_not_its_own[ns]
        assert proc.poll() is None, f"the process in {ns} was killed"
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        assert str(proc.pid) in pids
    killed = namespaces_not_its_own[stale]
    assert killed.wait(timeout=10) == -9  # the dead maker's server, killed with its namespace

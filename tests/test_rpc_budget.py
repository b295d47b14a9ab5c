"""A server held to a small memory cgroup is never given more than it holds (issue 27, item 1): it reports its
cgroup's memory (patch 0017), a plan and a device profile under one host budget place within it, and a server
that dies mid-run is one line naming it."""

import json

import pytest
from conftest import cli

from flexoffload.bench import machines as rpc
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.native.devices import probe_rpc

# it streams the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")

SERVER = 96 << 20
# 16 layers of 1024 wide: about 140 MiB of Q4_0 weights, more than the server's cgroup
SHAPE = synth.Shape(n_layer=16, n_embd=1024, n_ff=4096, n_head=8, n_head_kv=2, n_vocab=4096, n_ctx_train=512)


@pytest.fixture(scope="module")
def server():
    with rpc.Machines(1, memory=SERVER, rate="10gbit", threads=1) as machines:
        yield machines


def test_a_server_reports_its_cgroup_s_memory_not_the_machine_s(server):
    device = probe_rpc(server.endpoints[0])[0]
    assert device.total == SERVER  # the machine has 24 GB
    assert 0 < device.free < SERVER  # less what the server itself already takes


def test_one_host_budget_places_within_the_server_and_kills_none(server, tmp_path):
    path = synth.write(tmp_path / "wide.gguf", SHAPE)
    assert load(path).weight_bytes > SERVER
    args = ["-m", str(path), "-p", "a b c d", "-n", "8", "--temp", "0", "-c", "256", "-b", "32", "-t", "1"]
    alone = json.loads(cli("run", *args, "--strategy", "mmap", "--json", check=True).stdout)
    r = cli("run", *args, "--rpc", server.endpoints[0], "--mem", "0.8x", "--enforce", "--json")
    assert r.returncode == 0, r.stderr
    placed = json.loads(r.stdout)
    assert placed["tokens"] == alone["tokens"]
    assert server._procs[0].poll() is None, "the server was killed"
    assert server.peaks()[0] < SERVER
    probe_rpc(server.endpoints[0])  # still answers


def test_a_child_that_failed_over_a_dead_server_is_one_line_naming_it():
    """What a profile or run over RPC says when its child died: the server that no longer answers, never the
    backtrace llama.cpp's abort prints (the message a user saw: '360 ../csu/libc-start.c: No such file...')."""
    from flexoffload.native import devices

    backtrace = "ggml_abort\n#5 0x7f __libc_start_main\n360 ../csu/libc-start.c: No such file or directory\n"
    line = devices.failure(["127.0.0.1:9"], "its device profile ran", backtrace, -6)  # nothing listens on 9
    assert line.startswith("the RPC server at 127.0.0.1:9 stopped answering while its device profile ran")
    assert "libc" not in line and "\n" not in line

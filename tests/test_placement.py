"""Placement across devices (placement.py, placers/): llama.cpp's layer assignment mirrored, a token's visits to a
device counted, each policy within its device's budget, ours predicted within its tie margin of the best of an
enumeration of placements made here; and over a netns RPC machine, every policy's plan giving llama.cpp's own greedy
tokens."""

import dataclasses
from collections import Counter

import pytest

from conftest import cli
from flexoffload import FlexoffloadError
from flexoffload import api
from flexoffload.plan import placers
from flexoffload.bench import machines as rpc
from flexoffload.gguf import synth
from flexoffload.plan import plans
from flexoffload.plan.costmodel import Profile
from flexoffload.gguf.model import load
from flexoffload.memory.footprint import Footprint
from flexoffload.plan.placement import (HOST, DeviceProfile, Placement, Walk, device_bytes, head_home, layer_devices,
                                        tensor_devices)
from flexoffload.plan.placers import oato
from flexoffload.plan.placers.common import layer_counts

RPC_LIKE = DeviceProfile("RPC0[10.77.0.2:50052]", compute_ratio=1.0, visit_s=0.7e-3, bandwidth=110e6)
# a device 5x faster than the host at every operator, a visit 0.1 ms, 1 GB/s each way: offloading pays
FASTER = DeviceProfile("RPC0[10.77.0.2:50052]", compute_ratio=0.2, visit_s=0.1e-3, bandwidth=1e9)
PROFILE = Profile(disk_bw=2e9, default_sec_per_byte=3e-11, layer_overhead=1e-4, token_overhead=7e-4)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A 28-layer model of the 1.5B's layout, not written out (its tensor table is all the placers read)."""
    path = synth.write(tmp_path_factory.mktemp("m") / "q.gguf", dataclasses.replace(synth.SHAPES["qwen2-tiny"],
                                                                                      n_layer=28))
    return load(path)


def test_layers_go_where_llama_cpp_sends_them():
    # -ngl 7 of 28: blocks 22-27 and the output head (index 28), as src/llama-model.cpp's i_gpu_start
    assert layer_devices(28, 7, (), 1) == [HOST] * 22 + [0] * 7
    assert layer_devices(28, 0, (), 1) == [HOST] * 29
    assert layer_devices(28, 99, (), 2) == [0] * 15 + [1] * 14  # upstream's equal split: positions k/29 < 0.5
    for counts in layer_counts(9, 3):
        got = Counter(layer_devices(28, 9, tuple(map(float, counts)), 3))
        assert [got[d] for d in range(3)] == counts and got[HOST] == 20


def test_a_token_visits_a_device_once_per_contiguous_run(qwen2):
    unit = [RPC_LIKE]
    tail = Walk(qwen2, Placement("t", (RPC_LIKE.name,), 10), unit, PROFILE)
    assert tail.visits == 1 and tail.transfer_bytes == qwen2.n_embd * 4 + qwen2.n_vocab * 4  # in, and the logits
    downs = tuple((t.name, RPC_LIKE.name) for t in qwen2.tensors if t.kind == "ffn_down")
    spread = Walk(qwen2, Placement("t", (RPC_LIKE.name,), 0, (), downs), unit, PROFILE)
    assert spread.visits == qwen2.n_layer and spread.transfer_s > 20 * tail.transfer_s
    home = head_home(qwen2)  # tied embeddings here: token_embd's copy kept home with output_norm
    kept = Walk(qwen2, Placement("t", (RPC_LIKE.name,), 10, (), home), unit, PROFILE)
    assert kept.transfer_bytes == 2 * qwen2.n_embd * 4  # the output head at home: no logits over the link
    assert device_bytes(qwen2, Placement("t", (RPC_LIKE.name,), 10, (), home), 0, 0)[0] < \
        device_bytes(qwen2, Placement("t", (RPC_LIKE.name,), 10), 0, 0)[0]  # the copy is not on the device


def _problem(model, share, device=RPC_LIKE):
    """One device holding share of the weights; the host's run a KV cache of 64 KiB, a compute buffer of 256 KiB and
    1 MiB of heap, its budget 1 TiB (it holds all it has, its slack of 1/512 and 1 % of that included)."""
    weights = model.weight_bytes
    run = Footprint(kv_cache=1 << 16, compute=1 << 18, output=0, heap=1 << 20, sampling=0, runtime=0, code=0)
    return placers.Problem(model, (device,), (int(share * weights) + (1 << 20),), 1 << 40, PROFILE,
                           kv_cache=1 << 16, compute=1 << 18, run=run)


def enumerated(model, name):
    """Placements of one device made here, apart from the placers' own search: every -ngl (the trailing layers
    and the output head, KV caches with them) with the head on the device or kept home; every contiguous run of
    blocks sent by tensor overrides (their KV caches at home); every subset of the layer kinds sent across all
    layers by overrides."""
    out = [Placement("enumerated", (name,), n, (), placed) for n in range(model.n_layer + 2)
           for placed in ((), head_home(model))]
    for first in range(model.n_layer):
        for end in range(first + 1, model.n_layer + 1):
            out.append(Placement("enumerated", (name,), 0, (), tuple(
                (t.name, name) for t in model.tensors if t.layer is not None and first <= t.layer < end)))
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for mask in range(1, 1 << len(kinds)):
        chosen = {k for i, k in enumerate(kinds) if mask >> i & 1}
        out.append(Placement("enumerated", (name,), 0, (), tuple(
            (t.name, name) for t in model.tensors if t.layer is not None and t.kind in chosen)))
    return out


@pytest.mark.parametrize("device", [RPC_LIKE, FASTER], ids=["rpc-like", "faster"])
@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_each_policy_stays_within_its_device_and_ours_is_within_its_tie_of_every_enumerated_placement(
        qwen2, share, device, monkeypatch):
    """Each placer's placement fits the device (oato under its 90 % cap, per operator); ours is predicted no slower
    than the fastest placement of `enumerated` that fits, but for its tie margin (TIE); and over a slow link, faster
    than oato (per-operator visits cost round trips)."""
    problem = _problem(qwen2, share, device)
    from types import SimpleNamespace

    from flexoffload.plan.placers import layers
    from flexoffload.plan.placers import ours
    from flexoffload.plan.placers import split

    # the host keeps all it has (no streaming): the placement alone decides
    monkeypatch.setattr(ours, "evaluate", lambda p, pl: (SimpleNamespace(streamed=(), experts=None), _cost(p, pl)))
    chosen = {}
    for name in ("layers", "split", "oato", "auto"):
        place = {"layers": layers.place, "split": split.place, "oato": oato.place, "auto": ours.place}[name]
        p = place(problem)
        assert problem.fits(p), name
        chosen[name] = _cost(problem, p).seconds_per_token
    o = oato.place(problem)
    assert device_bytes(qwen2, o, problem.kv_cache, problem.compute)[0] <= oato.CAP * problem.budgets[0]
    assert o.n_gpu_layers == 0 and o.placed  # per operator, KV cache at home
    fitting = [p for p in enumerated(qwen2, device.name) if problem.fits(p)]
    assert len(fitting) > 100
    best = min(_cost(problem, p).seconds_per_token for p in fitting)
    assert chosen["auto"] <= best * (1 + ours.TIE)
    if device is RPC_LIKE:
        assert chosen["auto"] < chosen["oato"]  # over a link, per-operator visits cost round trips
    else:  # where offloading pays, ours offloads
        assert chosen["auto"] < _cost(problem, Placement("none", (device.name,), 0)).seconds_per_token


def _cost(problem, p):
    from flexoffload.plan.placement import predict

    where = tensor_devices(problem.model, p)
    return predict(problem.model, p, list(problem.devices), PROFILE, {n for n, d in where.items() if d == HOST}, 0,
                   1)


@pytest.mark.parametrize("spec,host,named", [("cpu=600M,rpc0=700M", 600 << 20, {"0": 700 << 20}),
                                             ("1G", 1 << 30, {}),
                                             ("a:1=1G,cpu=0.5x", None, {"a:1": 1 << 30})])
def test_mem_names_each_device(qwen2, spec, host, named):
    got_host, got = placers.parse_mem(spec, ["a:1", "b:2"], qwen2)
    assert got == named and (host is None or got_host == host)


@pytest.mark.parametrize("spec", ["rpc2=1G", "gpu=1G", "cpu=", "=1G"])
def test_a_bad_device_budget_is_one_error(qwen2, spec):
    with pytest.raises(FlexoffloadError):
        placers.parse_mem(spec, ["a:1", "b:2"], qwen2)


@pytest.fixture
def one_machine():
    with rpc.Machines(1, memory=512 << 20, rate="1gbit", threads=2) as machines:
        yield machines


def test_every_policy_gives_the_same_tokens_over_rpc(tmp_path, one_machine):
    path = synth.write(tmp_path / "qwen2.gguf", synth.SHAPES["qwen2-tiny"])
    endpoint = one_machine.endpoints[0]
    request = api.Request(model=str(path), prompt="a b c d", n_predict=12, temp=0, n_ctx=256, n_batch=32)
    alone = api.generate(dataclasses.replace(request, strategy="mmap"))
    model = load(path)
    device = int(0.6 * model.weight_bytes) + (4 << 20)
    for policy in ("layers", "split", "oato", "auto"):
        directory = tmp_path / policy
        r = cli("plan", "-m", str(path), "--rpc", endpoint, "--mem", f"cpu=1G,rpc0={device}", "--placement", policy,
                "-c", "256", "-b", "32", "-o", str(directory), check=True)
        assert "predicted" in r.stdout
        plan = plans.read(directory)
        assert plan.placement.policy == policy and plan.placement.per_device[0].memory <= device
        placed = api.generate(dataclasses.replace(request, plan_dir=str(directory), rpc=endpoint))
        assert placed["tokens"] == alone["tokens"], policy
    # run --rpc --mem without a saved plan: placed (auto) and run in one step
    r = cli("run", "-m", str(path), "-p", "a b c d", "-n", "12", "--temp", "0", "-c", "256", "-b", "32", "--rpc",
            endpoint, "--mem", f"cpu=1G,rpc0={device}", "--json", check=True)
    import json

    assert json.loads(r.stdout)["tokens"] == alone["tokens"]


def test_a_tensor_bound_for_a_device_loads_in_pieces(tmp_path):
    """Patch 0012: the server's memory while it loads a 56 MiB output matrix grows by the matrix and a piece, not
    by twice the matrix (it received the matrix whole before, beside the copy it keeps)."""
    from flexoffload.defaults import LOAD_PIECE_BYTES

    shape = synth.Shape(n_layer=1, n_embd=512, n_ff=256, n_head=8, n_head_kv=2, n_vocab=196608, n_ctx_train=512)
    path = synth.write(tmp_path / "wide.gguf", shape)
    output = next(t.n_bytes for t in load(path).tensors if t.kind == "output")
    assert output > 3 * LOAD_PIECE_BYTES
    with rpc.Machines(1, memory=1 << 30, rate="10gbit", threads=1) as machines:
        idle = machines.peaks()[0]
        request = api.Request(model=str(path), prompt="a b", n_predict=2, temp=0, n_ctx=64, n_batch=16,
                              rpc=machines.endpoints[0], n_gpu_layers=1, strategy="stream")  # the output head only
        api.generate(request)
        grew = machines.peaks()[0] - idle
    assert output <= grew < output + LOAD_PIECE_BYTES + (24 << 20)  # + its compute buffer and the server's own

"""Synthetic models of every architecture: their tensor tables are what llama.cpp's loaders expect, llama.cpp
loads and generates with them, and the realistic shapes have realistic sizes."""

import pytest

from conftest import cli
from flexoffload.runtime import engine
from flexoffload.gguf import blocks, synth
from flexoffload.gguf.model import load

TINY_SHAPES = ["tiny", "llama-gqa-tiny", "qwen2-tiny", "gemma3-tiny", "gemma3-tiny-256k", "phi3-tiny",
               "llama-moe-tiny", "qwen3moe-tiny", "gpt-oss-tiny"]
REALISTIC_SHAPES = ["llama2-7b", "llama-gqa-3b", "qwen2-1.5b", "gemma3-1b", "phi3-mini", "llama-moe-1b", "qwen3moe-2b"]


def kinds_of_layer(m, layer):
    return sorted(t.kind for t in m.tensors if t.layer == layer)


@pytest.mark.parametrize("name", TINY_SHAPES)
def test_tensor_table(name, tmp_path):
    s = synth.SHAPES[name]
    path = synth.write(tmp_path / f"{name}.gguf", s)
    m = load(path)
    assert (m.arch, m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.n_ff, m.n_vocab) == (
        s.arch, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab)
    assert abs(m.file_size - synth.predicted_size(s)) < 1024
    names = {t.name for t in m.tensors}
    assert ("output.weight" in names) == (not s.tied_embeddings)
    # every layer has the same tensors, and they are the architecture's
    for i in range(1, m.n_layer):
        assert kinds_of_layer(m, i) == kinds_of_layer(m, 0)
    layer = kinds_of_layer(m, 0)
    if s.arch == "gpt-oss":  # q, k, v, output, router and expert biases; the sinks; no ffn_norm
        assert layer == sorted(["norm"] * 2 + ["bias"] * 8 + ["other"] + ["attn_q", "attn_k", "attn_v",
                                                                         "attn_output", "router"] + ["expert"] * 3)
        down = next(t for t in m.tensors if t.name == "blk.0.ffn_down_exps.weight")
        assert down.type == "MXFP4" and down.shape == (s.expert_width, s.n_embd, s.n_expert)
    elif s.n_expert:  # a router and gate, up and down of every expert in place of the FFN (qwen3moe: q/k norms too)
        norms = ["norm"] * (4 if s.arch == "qwen3moe" else 2)
        assert layer == sorted(norms + ["attn_q", "attn_k", "attn_v", "attn_output", "router"] + ["expert"] * 3)
        down = next(t for t in m.tensors if t.name == "blk.0.ffn_down_exps.weight")
        assert down.shape == (s.expert_width, s.n_embd, s.n_expert)  # ggml's order: an expert is ne[2]
    elif s.arch == "llama":
        assert layer == sorted(["norm", "attn_q", "attn_k", "attn_v", "attn_output", "norm",
                                "ffn_gate", "ffn_up", "ffn_down"])
    elif s.arch == "qwen2":
        assert layer == sorted(["norm", "attn_q", "attn_k", "attn_v", "bias", "bias", "bias", "attn_output",
                                "norm", "ffn_gate", "ffn_up", "ffn_down"])
        k_bias = next(t for t in m.tensors if t.name == "blk.0.attn_k.bias")
        assert k_bias.shape == (s.n_head_kv * s.n_embd // s.n_head,)
    elif s.arch == "gemma3":  # attn, q, k, post-attention, ffn and post-ffw norms
        assert layer == sorted(["norm"] * 6 + ["attn_q", "attn_k", "attn_v", "attn_output",
                                               "ffn_gate", "ffn_up", "ffn_down"])
        q = next(t for t in m.tensors if t.name == "blk.0.attn_q.weight")
        assert q.shape == (s.n_embd, s.n_head * s.head_dim)  # wider heads than n_embd / n_head
    elif s.arch == "phi3":  # attn_qkv counts as attn_q; ffn_up holds gate and up
        assert layer == sorted(["norm", "attn_q", "attn_output", "norm", "ffn_up", "ffn_down"])
        qkv = next(t for t in m.tensors if t.name == "blk.0.attn_qkv.weight")
        assert qkv.shape == (s.n_embd, s.n_embd + 2 * s.n_head_kv * s.n_embd // s.n_head)
        up = next(t for t in m.tensors if t.name == "blk.0.ffn_up.weight")
        assert up.shape == (s.n_embd, 2 * s.n_ff)


@pytest.mark.parametrize("name", ["tiny", "qwen2-tiny", "gemma3-tiny"])
def test_control_and_byte_tokens_have_zero_output_rows(name, tmp_path):
    """The output matrix (token_embd where tied) has zero rows for <unk>, <s>, </s> and the bytes, so greedy text is
    whole pieces."""
    s = synth.SHAPES[name]
    m = load(synth.write(tmp_path / f"{name}.gguf", s, output_seed=7, output_scale=2.0))
    out = next(t for t in m.tensors if t.name == ("token_embd.weight" if s.tied_embeddings else "output.weight"))
    row_bytes = out.n_bytes // s.n_vocab
    with open(m.path, "rb") as f:
        f.seek(out.offset)
        data = f.read(row_bytes * (synth.N_SPECIAL + 1))
    assert data[:row_bytes * synth.N_SPECIAL] == bytes(row_bytes * synth.N_SPECIAL)
    assert data[row_bytes * synth.N_SPECIAL:] != bytes(row_bytes)  # the first piece's row is not


@pytest.mark.parametrize("name", TINY_SHAPES)
def test_llama_cpp_generates(name, tmp_path):
    path = synth.write(tmp_path / f"{name}.gguf", synth.SHAPES[name])
    settings = engine.Settings(n_ctx=256, n_batch=32, temp=0, strategy="mmap")
    with engine.Engine(path, settings) as eng:
        first = eng.generate("a b c", 8)
        second = eng.generate("a b c", 8)
    assert len(first.tokens) == 8 or first.stop == "eog"
    assert first.tokens and first.tokens == second.tokens
    assert all(t >= synth.N_SPECIAL for t in first.tokens)  # whole pieces, never a control or byte token


@pytest.mark.parametrize("name", REALISTIC_SHAPES)
def test_realistic_shapes_have_realistic_sizes(name):
    assert 0.3e9 <= synth.predicted_size(synth.SHAPES[name]) <= 4.5e9


@pytest.mark.parametrize("name,qtype,low,high", [("qwen3moe-30b-a3b", "Q4_0", 16.5e9, 18.5e9),
                                                 ("gpt-oss-20b", "Q4_0", 11e9, 13.5e9),
                                                 ("gpt-oss-20b", "Q8_0", 12.05e9, 12.15e9),
                                                 ("gpt-oss-120b", "Q8_0", 63.3e9, 63.45e9),
                                                 ("qwen2-7b", "Q4_0", 4.2e9, 4.4e9)])
def test_the_shapes_people_run_have_their_published_sizes(name, qtype, low, high):
    """Qwen3-30B-A3B about 17-18 GB at 4-bit types; gpt-oss-20b and -120b with MXFP4 experts and the rest at Q8_0
    12.1 and 63.4 GB, the published files (issues 42, 53); Qwen2.5-7B at Q4_0 about 4.3 GB."""
    assert low <= synth.predicted_size(synth.SHAPES[name], qtype) <= high


@pytest.mark.parametrize("name", ["tiny", "gpt-oss-tiny"])
def test_q8_0_files_load_generate_and_have_their_predicted_size(name, tmp_path):
    path = synth.write(tmp_path / f"{name}.gguf", synth.SHAPES[name], qtype="Q8_0")
    assert abs(path.stat().st_size - synth.predicted_size(synth.SHAPES[name], "Q8_0")) < 1024
    types = {t.name: t.type for t in load(path).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0"
    if name == "gpt-oss-tiny":
        assert types["blk.0.ffn_up_exps.weight"] == "MXFP4"
    settings = engine.Settings(n_ctx=256, n_batch=32, temp=0, strategy="mmap")
    with engine.Engine(path, settings) as eng:
        first = eng.generate("a b c", 8)
    assert first.tokens and all(t >= synth.N_SPECIAL for t in first.tokens)


def test_q8_0_blocks_round_as_ggml_does():
    import gguf
    import numpy as np

    x = np.random.default_rng(0).normal(0, 1, (4, 64)).astype(np.float32)
    ours = blocks.q8_0_of(x)
    assert ours.tobytes() == gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).tobytes()


def test_shapes_are_the_architectures_asked_for():
    shapes = synth.SHAPES
    assert shapes["tiny"] is synth.TINY and shapes["llama2-7b"] is synth.LLAMA2_7B
    for name in ["llama-gqa-tiny", "llama-gqa-3b"]:
        assert shapes[name].arch == "llama" and shapes[name].n_head == 8 * shapes[name].n_head_kv
    assert shapes["gemma3-tiny-256k"].n_vocab == shapes["gemma3-1b"].n_vocab == 262144
    assert shapes["gemma3-tiny-256k"].n_embd <= 256
    assert {s.arch for s in shapes.values()} == set(synth.ARCHS)
    with pytest.raises(ValueError, match="arch"):
        synth.Shape(n_layer=1, n_embd=64, n_ff=128, n_head=4, n_head_kv=4, n_vocab=384, arch="mamba")


def test_cli_writes_every_shape_by_name(tmp_path):
    out = tmp_path / "gemma3.gguf"
    r = cli("models", "synth", "gemma3-tiny", "-o", str(out), check=True)
    assert str(out) in r.stdout and load(out).arch == "gemma3"
    r = cli("models", "synth", "mamba-tiny", "-o", str(out))
    assert r.returncode != 0 and "qwen2-1.5b" in r.stderr  # the choices are synth.SHAPES

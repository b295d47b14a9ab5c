import pytest

from flexoffload import FlexoffloadError
from flexoffload.gguf import synth
from flexoffload.gguf.model import load, tensor_kind


def test_tensor_table_of_a_synthetic_model(tiny_model):
    m = load(tiny_model)
    s = synth.TINY
    assert (m.arch, m.n_layer, m.n_embd, m.n_head, m.n_head_kv, m.n_ff, m.n_vocab) == (
        "llama", s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_vocab)
    assert len(m.tensors) == 3 + 9 * s.n_layer
    q = next(t for t in m.tensors if t.name == "blk.1.attn_q.weight")
    assert (q.kind, q.layer, q.type, q.shape) == ("attn_q", 1, "Q4_0", (64, 64))
    assert q.n_bytes == 64 * 64 // 32 * 18
    # offsets are absolute, ascending, inside the file and 32-byte aligned (GGUF's default alignment)
    offsets = [t.offset for t in m.tensors]
    assert offsets == sorted(offsets) and all(o % 32 == 0 for o in offsets)
    assert m.tensors[-1].offset + m.tensors[-1].n_bytes <= m.file_size
    with open(tiny_model, "rb") as f:  # the bytes at an offset are the tensor's: norms are all 1.0f
        norm = next(t for t in m.tensors if t.name == "blk.0.attn_norm.weight")
        f.seek(norm.offset)
        assert f.read(8) == b"\x00\x00\x80\x3f" * 2
    assert sum(m.layer_bytes(i) for i in range(m.n_layer)) + sum(
        t.n_bytes for t in m.layer_tensors(None)) == m.weight_bytes


@pytest.mark.parametrize("name,kind,layer", [
    ("token_embd.weight", "token_embd", None),
    ("output.weight", "output", None),
    ("output_norm.weight", "norm", None),
    ("blk.12.attn_k.weight", "attn_k", 12),
    ("blk.3.attn_q.bias", "bias", 3),
    ("blk.0.ffn_down.weight", "ffn_down", 0),
    ("blk.7.attn_output.weight", "attn_output", 7),
    ("blk.2.ffn_norm.weight", "norm", 2),
    ("rope_freqs.weight", "other", None),
    ("blk.4.ffn_up_exps.weight", "expert", 4),
    ("blk.4.ffn_gate_inp.weight", "router", 4),
    ("blk.4.ffn_down_shexp.weight", "ffn_down", 4),  # a shared expert: every token's dense FFN
])
def test_tensor_kind(name, kind, layer):
    assert tensor_kind(name) == (kind, layer)


def test_missing_file(tmp_path):
    with pytest.raises(FlexoffloadError, match="not found"):
        load(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(FlexoffloadError, match="not a GGUF"):
        load(p)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_truncated(tiny_model, tmp_path, keep):
    data = tiny_model.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(FlexoffloadError, match="truncated|damaged"):
        load(p)

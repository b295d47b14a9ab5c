"""MoEfication (gguf/moefy.py, measure/coactivation.py) on a tiny synthetic dense qwen2: the co-activation capture is
the FFN's real activation, the written glm4moe file loads in llama.cpp, with every expert used it computes the dense
model's logits (the split, the router's near-uniform weights and the down scaling reproduce the FFN), and with fewer
it runs and differs."""

from __future__ import annotations

import numpy as np
import pytest

from flexoffload import FlexoffloadError
from flexoffload.gguf import moefy, synth
from flexoffload.measure import coactivation

SHAPE = synth.SHAPES["qwen2-tiny"]  # n_embd 128, n_ff 256, tied embeddings
N_EXPERT, N_SHARED = 6, 64  # 6 experts of 32 neurons: one Q8_0 block along ffn_down's rows
TEXT = ("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n"
        "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat\n") * 3


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("moefy") / "dense.gguf", SHAPE, qtype="Q4_0", output_scale=4.0)


@pytest.fixture(scope="module")
def capture(dense):
    return coactivation.collect(str(dense), TEXT, n_ctx=64, n_threads=1)


@pytest.fixture(scope="module")
def splits(dense, capture):
    norms = coactivation.down_norms(str(dense), SHAPE.n_layer)
    return [coactivation.split(capture.inputs[il], capture.activations[il], norms[il], N_EXPERT, N_SHARED)[0]
            for il in range(SHAPE.n_layer)]


def _weights(path, name):
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def _logits(path, tokens: list[int]) -> np.ndarray:
    """Every token's logits, decoded in one batch from an empty cache."""
    from flexoffload.runtime import engine

    settings = engine.Settings(n_ctx=128, n_batch=len(tokens), n_outputs=len(tokens), n_threads=1, temp=0)
    with engine.Engine(str(path), settings) as e:
        lib = e.lib
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
                batch.seq_id[i][0] = 0
            assert lib.llama_decode(e.ctx, batch) == 0
        finally:
            lib.llama_batch_free(batch)
        n_vocab = lib.llama_vocab_n_tokens(e.vocab)
        return np.ctypeslib.as_array(lib.llama_get_logits(e.ctx), shape=(len(tokens), n_vocab)).copy()


def _tokens(path, limit: int = 48) -> list[int]:
    from flexoffload.runtime import engine

    with engine.Engine(str(path), engine.Settings(n_ctx=128, n_threads=1, temp=0)) as e:
        return e.tokenize(TEXT, add_special=False)[:limit]


def test_capture_is_the_ffn_activation(dense, capture):
    """The recorded activation is silu(gate x) * up x of the recorded input, by the file's own weights (to within
    llama.cpp quantizing x to 8 bits for the Q4_0 matmuls and the float16 store)."""
    # more than one chunk of n_ctx, and every token kept: each chunk's, and the last layer's every row
    n_tokens = capture.n_tokens
    assert n_tokens == len(_tokens(dense, limit=10**6)) > 64
    for il in range(SHAPE.n_layer):
        x, h = capture.inputs[il].astype(np.float32), capture.activations[il].astype(np.float32)
        assert x.shape == (n_tokens, SHAPE.n_embd) and h.shape == (n_tokens, SHAPE.n_ff)
        g = x @ _weights(dense, f"blk.{il}.ffn_gate.weight").T
        u = x @ _weights(dense, f"blk.{il}.ffn_up.weight").T
        expected = g / (1 + np.exp(-g)) * u
        assert np.linalg.norm(h - expected) < 0.03 * np.linalg.norm(expected)


def test_balanced_kmeans_finds_planted_groups():
    rng = np.random.default_rng(1)
    directions = np.eye(16)[:4]
    points = np.repeat(directions, 8, axis=0) + rng.normal(0, 0.05, (32, 16))
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    order = rng.permutation(32)
    assign = coactivation.balanced_kmeans(points[order], 4)
    truth = np.repeat(np.arange(4), 8)[order]
    assert sorted(np.bincount(assign)) == [8, 8, 8, 8]
    for c in range(4):  # each found cluster is one planted group
        assert len(set(truth[assign == c])) == 1


def test_split_layout_and_quality(dense, capture):
    norms = coactivation.down_norms(str(dense), SHAPE.n_layer)
    layer, quality = coactivation.split(capture.inputs[0], capture.activations[0], norms[0], N_EXPERT, N_SHARED,
                                        used=(1, N_EXPERT))
    assert layer.experts.shape == (N_EXPERT, (SHAPE.n_ff - N_SHARED) // N_EXPERT)
    assert layer.router.shape == (N_EXPERT, SHAPE.n_embd)
    everything = np.sort(np.concatenate([layer.shared, layer.experts.ravel()]))
    assert np.array_equal(everything, np.arange(SHAPE.n_ff))
    one, every = quality
    assert every.routed == pytest.approx(1.0) and every.oracle == pytest.approx(1.0)  # all experts: all the mass
    assert 0 < one.routed <= one.oracle + 1e-6 < 1


def test_all_experts_reproduce_the_dense_model(tmp_path, dense, splits):
    moe = moefy.write(dense, tmp_path / "moe.gguf", splits, n_expert_used=N_EXPERT)
    tokens = _tokens(dense)
    want = _logits(dense, tokens)
    got = _logits(moe, tokens)
    # what differs: ffn_down requantized to Q8_0 from Q4_0 values (and its input quantized in other blocks), each
    # chosen expert's weight 2 * sigmoid(tiny logit) within 0.1 % of 1, the order of the sums
    spread = np.linalg.norm(want - want.mean(axis=1, keepdims=True))
    assert np.linalg.norm(got - want) < 0.02 * spread  # measured 0.8 %; one expert of 6 left out: 4.8 %
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() > 0.95

    few = moefy.write(dense, tmp_path / "moe-2.gguf", splits, n_expert_used=2)
    partial = _logits(few, tokens)
    assert np.isfinite(partial).all()
    assert np.linalg.norm(partial - want) > 5 * np.linalg.norm(got - want)  # 2 of 6 experts: measured 15x


def test_written_file_is_a_glm4moe(tmp_path, dense, splits):
    import gguf

    moe = moefy.write(dense, tmp_path / "moe.gguf", splits, n_expert_used=3)
    r = gguf.GGUFReader(moe)
    assert r.fields["general.architecture"].contents() == "glm4moe"
    assert r.fields["glm4moe.expert_count"].contents() == N_EXPERT
    assert r.fields["glm4moe.expert_used_count"].contents() == 3
    assert r.fields["glm4moe.expert_shared_count"].contents() == N_SHARED // 32
    names = {t.name: t for t in r.tensors}
    assert "blk.0.ffn_gate.weight" not in names and "blk.0.ffn_norm.weight" not in names
    assert "blk.0.post_attention_norm.weight" in names  # glm4moe's name for the FFN's norm
    for name in moefy.expert_tensors(0):
        assert name in names
    down = names["blk.0.ffn_down_exps.weight"]
    assert [int(d) for d in down.shape] == [32, SHAPE.n_embd, N_EXPERT]  # ggml order: one slice an expert
    # an expert's gate rows are the dense rows of its neurons, as stored
    dense_gate = next(t for t in gguf.GGUFReader(dense).tensors if t.name == "blk.0.ffn_gate.weight")
    assert np.array_equal(names["blk.0.ffn_gate_exps.weight"].data[2], dense_gate.data[splits[0].experts[2]])


def test_bad_inputs_are_refused(tmp_path, dense, splits, tiny_model):
    with pytest.raises(FlexoffloadError, match="only a dense qwen2"):
        moefy.write(tiny_model, tmp_path / "x.gguf", splits, 2)
    broken = [moefy.LayerSplit(shared=s.shared, experts=s.experts[:, ::-1].copy(), router=s.router)
              for s in splits]
    broken[1] = moefy.LayerSplit(shared=splits[1].shared[:-1], experts=splits[1].experts, router=splits[1].router)
    with pytest.raises(FlexoffloadError):
        moefy.write(dense, tmp_path / "x.gguf", broken, 2)
    with pytest.raises(FlexoffloadError, match="between 1 and"):
        moefy.write(dense, tmp_path / "x.gguf", splits, N_EXPERT + 1)
    assert not (tmp_path / "x.gguf").exists()

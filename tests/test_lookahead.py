"""Lookahead (issue 42, item 3): the recall worked by hand, and on tiny synthetic qwen3moe files the predicted ids,
the routed ids against tracing's, each layer's own router giving back its choice (the input read is the one the
router multiplies), and text routing's next layer predicted through the right router."""

import dataclasses

import numpy as np
import pytest

from flexoffload import FlexoffloadError
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import lookahead, tracing

N_TOKENS = 48
N_UBATCH = 16  # three ubatches: the ids are joined across them
SHAPE = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=4)  # two layers ahead of two


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The 4-layer tiny qwen3moe with text and random routing."""
    folder = tmp_path_factory.mktemp("lookahead")
    return {routing: load(synth.write(folder / f"{routing}.gguf", SHAPE, routing=routing))
            for routing in synth.ROUTINGS}


@pytest.fixture(scope="module")
def measured(models):
    return {routing: lookahead.measure(m, tracing.calibration_text(), 2, max_tokens=N_TOKENS, n_ubatch=N_UBATCH)
            for routing, m in models.items()}


def rewrite_norm_weights(path, change) -> None:
    """Every ffn_norm weight of the file (F32 in synth's files) replaced in place by change(weight)."""
    with open(path, "r+b") as f:
        for t in load(path).tensors:
            if t.name.endswith("ffn_norm.weight"):
                f.seek(t.offset)
                weight = change(np.frombuffer(f.read(t.n_bytes), dtype=np.float32))
                f.seek(t.offset)
                f.write(np.asarray(weight, dtype=np.float32).tobytes())


def test_recall_worked_by_hand():
    predicted = np.array([[0, 1, 2], [3, 4, 5], [-1, -1, -1]])
    actual = np.array([[2, 1, 7], [6, 7, 8], [0, 1, 2]])
    got = lookahead.recall(predicted, actual)
    assert got[:2].tolist() == [2 / 3, 0.0] and np.isnan(got[2])


def test_a_router_applies_its_logit_bias_then_its_gating_then_its_selection_bias():
    """Three experts reading one dimension each, logits 3, 2, 0, one chosen: the logits' top without biases; with a
    selection bias of 0.1 on expert 1, sigmoid(2) + 0.1 beats sigmoid(3) but softmax's 0.26 + 0.1 does not beat its
    0.71; a logit bias of 2 on expert 1 wins under any gating."""
    x = np.array([[3.0, 2.0, 0.0]], dtype=np.float32)
    weight = np.eye(3, dtype=np.float32)
    bias = np.array([0.0, 0.1, 0.0], dtype=np.float32)
    assert lookahead.Router(weight, 1).choose(x).tolist() == [[0]]
    assert lookahead.Router(weight, 1, selection_bias=bias, gating=lookahead.SIGMOID).choose(x).tolist() == [[1]]
    assert lookahead.Router(weight, 1, selection_bias=bias, gating=lookahead.SOFTMAX).choose(x).tolist() == [[0]]
    assert lookahead.Router(weight, 1, logit_bias=np.array([0.0, 2.0, 0.0])).choose(x).tolist() == [[1]]
    assert sorted(lookahead.Router(weight, 2).choose(x)[0].tolist()) == [0, 1]


def test_by_layer_scores_each_column_against_its_own_reference():
    """Two layers, k = 2, three tokens: each column worked by hand."""
    actual = np.array([[[0, 1], [2, 3]],
                       [[0, 2], [2, 4]],
                       [[1, 3], [5, 6]]])
    nothing = np.full((3, 1, 2), -1)
    result = lookahead.Lookahead(actual, {
        0: actual.copy(),
        1: np.concatenate([nothing, [[[2, 9]], [[9, 8]], [[5, 6]]]], axis=1),  # halves, none, all of layer 1
        2: np.full((3, 2, 2), -1)})
    [row] = lookahead.by_layer(result)
    assert row["layer"] == 1
    assert row["recall_next"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert np.isnan(row["recall_next2"])  # layer 1 has no layer two before it
    assert row["recall_prev_token"] == pytest.approx((0.5 + 0) / 2)  # {2,3}->{2,4}, {2,4}->{5,6}
    assert row["recall_same_token_prev_layer"] == pytest.approx((0 + 0.5 + 0) / 3)  # {0,1}/{2,3}, {0,2}/{2,4}, ...
    assert row["recall_own_router"] == 1.0
    assert np.isnan(row["recall_next_renormed"])  # none made
    assert lookahead.means([row, {**row, "recall_next2": 0.25}])["recall_next2"] == 0.25  # NaN left out


def test_the_predicted_ids_are_k_distinct_experts_for_every_token_and_layer_ahead(measured):
    for result in measured.values():
        assert set(result.predicted) == {0, 1, 2}
        for d, ids in result.predicted.items():
            assert ids.shape == (N_TOKENS, SHAPE.n_layer, SHAPE.n_expert_used)
            assert (ids[:, :d] == -1).all()  # no layer d before the first d
            ahead = np.sort(ids[:, d:], axis=-1)
            assert ahead.min() >= 0 and ahead.max() < SHAPE.n_expert
            assert (np.diff(ahead, axis=-1) > 0).all()


def test_the_routed_ids_are_tracings(models, measured):
    for routing, m in models.items():
        trace = tracing.measure(m, tracing.calibration_text(), 2, max_tokens=N_TOKENS, n_ubatch=N_UBATCH)
        assert np.array_equal(measured[routing].actual, trace.ids)


def test_each_layers_own_router_on_the_input_read_gives_back_its_choice(measured):
    """The input read is what the router multiplies (ffn_norm's output in qwen3moe) and the weights are the file's:
    put through the layer's own router it chooses what llama.cpp chose (up to the rounding of near ties)."""
    for result in measured.values():
        assert result.router_input == "ffn_norm" and result.norm_weight == "ffn_norm.weight"
        own = lookahead.recall(result.predicted[0], result.actual)
        assert np.nanmean(own) >= 0.99


def test_with_norm_weights_the_input_read_is_the_normed_and_weighted_one_and_renormed_swaps_them(tmp_path):
    """Norm weights of ones scale a token's input by one number, which no router's order sees; with random ones the
    input before the norm routes elsewhere (own router 0.72-0.76 measured that way), and the own-router check
    catches it. Text routing with them: layer l's weight distorts the token's slice layer l+1 reads, and swapping
    it for layer l+1's gives back layer l+1's choice."""
    path = synth.write(tmp_path / "weighted.gguf", SHAPE, routing="text")
    rng = np.random.default_rng(0)
    rewrite_norm_weights(path, lambda w: rng.uniform(0.2, 3.0, w.shape))
    result = lookahead.measure(load(path), tracing.calibration_text(), 2, max_tokens=N_TOKENS, n_ubatch=N_UBATCH)
    assert result.norm_weight == "ffn_norm.weight"
    assert np.nanmean(lookahead.recall(result.predicted[0], result.actual)) >= 0.99
    mean = lookahead.means(lookahead.by_layer(result))
    assert mean["recall_next_renormed"] >= 0.97 and mean["recall_next2_renormed"] >= 0.97
    assert mean["recall_next"] <= mean["recall_next_renormed"] - 0.2  # 0.63 measured


def test_ties_in_the_scores_llama_cpp_sorts_are_counted_and_cost_the_own_router(tmp_path, measured):
    """Norm weights of 1e-7 make every logit tiny, so the softmax probabilities llama.cpp sorts in F32 round to
    equal: the k-th and k+1-th tie for nearly every token, and llama.cpp's choice among them follows its sort's order,
    not the logits; with weights of ones nothing ties and the own router gives back every choice."""
    path = synth.write(tmp_path / "flat.gguf", SHAPE, routing="text")
    rewrite_norm_weights(path, lambda w: w * 1e-7)
    flat = lookahead.measure(load(path), tracing.calibration_text(), 2, max_tokens=N_TOKENS, n_ubatch=N_UBATCH)
    assert flat.tied.shape == (N_TOKENS, SHAPE.n_layer)
    assert flat.tied.mean() >= 0.9
    assert lookahead.means(lookahead.by_layer(flat))["recall_own_router"] <= 0.8
    for result in measured.values():
        assert result.tied.shape == (N_TOKENS, SHAPE.n_layer) and not result.tied.any()


def test_text_routing_predicts_the_next_layers_experts_through_its_router(measured):
    """Text routing: every router reads the token's slice of the residual stream, which the norm only scales, so
    layer l's input through layer l+1's router (or l+2's) chooses what layer l+1 chooses; through layer l's own router
    it would choose layer l's experts, which overlap layer l+1's only by chance (the same-token baseline)."""
    rows = lookahead.by_layer(measured["text"])
    mean = lookahead.means(rows)
    assert min(r["recall_next"] for r in rows) >= 0.97
    assert mean["recall_next_renormed"] == mean["recall_next"]  # norm weights of ones: the same input
    assert mean["recall_next2"] >= 0.97
    assert mean["recall_same_token_prev_layer"] <= 0.5
    assert mean["recall_next"] - mean["recall_same_token_prev_layer"] >= 0.4


def test_a_dense_model_is_refused(tiny_model):
    with pytest.raises(FlexoffloadError, match="not a mixture of experts"):
        lookahead.measure(load(tiny_model), "some text", 2)

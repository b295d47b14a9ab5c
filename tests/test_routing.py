"""Synthetic mixtures of experts routed as text routes (issue 42, items 1-2): with `routing="text"` every layer
routes a token by the token alone, as llama.cpp itself runs the file; a real model's vocabulary copied, so a real
prompt tokenizes as it does for that model; the shapes people run, at one layer, load and generate under
llama-completion with our greedy text; and the locality figures measured on traces whose answer is known."""

import dataclasses
import math

import numpy as np
import pytest
from conftest import cli
from test_equality import llama_completion

from flexoffload import FlexoffloadError
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import tracing
from flexoffload.plan import locality
from flexoffload.plan.replay import Trace, simulate
from flexoffload.runtime import engine

TEXT = tracing.calibration_text()[:2500]


def _routed_by_token(path, tokens) -> np.ndarray:
    """tokens x layers x used: the experts each layer's router picks from the token's embedding alone (its route
    dimensions), from the file's weights."""
    return tracing.by_code(load(path), tokens)


def _check_routed_by_token(path):
    m = load(path)
    with engine.Engine(path, engine.Settings(n_ctx=512, n_threads=2, strategy="mmap")) as e:
        tokens = e.tokenize(TEXT)[:300]
    traced = tracing.measure(m, tokens, 2, max_tokens=300).ids
    want = tracing.computed(m, tokens, max_tokens=300).ids
    same = [set(a) == set(b) for a, b in zip(traced.reshape(-1, m.n_expert_used), want.reshape(-1, m.n_expert_used))]
    assert all(same), f"{sum(same)} of {len(same)} choices are the token's"
    return traced


def test_text_routing_routes_each_token_by_the_token_alone(tmp_path):
    """gpt-oss (a biased router, MXFP4 experts) with text routing: llama.cpp's own choice at every layer, for every
    token of a text, is the top-k of the router over the token's embedding (its route dimensions) alone: nothing
    the layers compute reaches the router. With random routing the same model does not route so."""
    shape = synth.SHAPES["gpt-oss-tiny"]
    traced = _check_routed_by_token(synth.write(tmp_path / "text.gguf", shape, routing="text"))
    assert len(np.unique(traced[:, 1])) > shape.n_expert_used  # tokens differ, so their experts do
    random = synth.write(tmp_path / "random.gguf", shape, routing="random")
    with pytest.raises(FlexoffloadError, match="routed by the token"):  # nothing to compute it from
        tracing.computed(load(random), TEXT)
    with engine.Engine(random, engine.Settings(n_ctx=512, n_threads=2, strategy="mmap")) as e:
        tokens = e.tokenize(TEXT)[:300]
    assert not np.array_equal(np.sort(tracing.measure(load(random), tokens, 2, max_tokens=300).ids, axis=2),
                              np.sort(_routed_by_token(random, tokens), axis=2))


@pytest.mark.integration
def test_a_real_vocabulary_makes_real_token_statistics(tmp_path, real_model):
    """qwen3moe (64 experts, 8 used) with the real Qwen2.5 vocabulary and its embeddings as routing codes: a text
    tokenizes as it does for the real model, routing is the token's, and greedy text is never a silent token
    (control, unused, or a piece of a UTF-8 character). Real text routes with locality (an LRU cache of a quarter of
    the experts hits far more often than on uniformly random tokens, which route as uniform routing does: a token
    shares k/n of its experts with the one before)."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_vocab=151936, n_expert=64, n_expert_used=8)
    path = synth.write(tmp_path / "qwen.gguf", shape, routing="text", tokenizer=real_model)
    settings = engine.Settings(n_ctx=512, n_threads=2, strategy="mmap", temp=0)
    with engine.Engine(real_model, settings) as real, engine.Engine(path, settings) as synthetic:
        assert synthetic.tokenize(TEXT) == real.tokenize(TEXT)
        generated = synthetic.generate("def fib(n):\n", 16).tokens
    silent = synth.copied_vocab(real_model, shape.n_vocab).silent()
    assert generated and not any(silent[t] for t in generated)
    text = _check_routed_by_token(path)
    uniform = tracing.measure(load(path), list(np.random.default_rng(0).integers(0, 151643, 300)), 2).ids
    text, uniform = (Trace(shape.n_layer, shape.n_expert, shape.n_expert_used, ids) for ids in (text, uniform))
    assert locality.lru_hits(text)["16/64"] > locality.lru_hits(uniform)["16/64"] + 0.15
    assert abs(locality.mean(locality.by_layer(uniform)).repeat - 8 / 64) < 0.05


@pytest.mark.integration
@pytest.mark.parametrize("name", ["qwen3moe-30b-a3b", "gpt-oss-20b"])
def test_the_shapes_people_run_generate_as_llama_completion_does(name, tmp_path, real_model):
    """Qwen3-30B-A3B's and gpt-oss-20b's shapes at one layer (every width as published, the real vocabulary, text
    routing): the file is the size predicted, and our greedy text (mmap) is llama-completion's."""
    shape = dataclasses.replace(synth.SHAPES[name], n_layer=1)
    path = synth.write(tmp_path / f"{name}.gguf", shape, routing="text", tokenizer=real_model)
    assert abs(path.stat().st_size - synth.predicted_size(shape, tokenizer=real_model)) < 1024
    with engine.Engine(path, engine.Settings(n_ctx=256, n_batch=32, n_threads=2, temp=0, strategy="mmap")) as e:
        ours = e.generate("def fib(n):\n", 12).text
    assert ours and ours == llama_completion(path, "def fib(n):\n", 12, ctx=256, batch=32)


def test_locality_figures_on_traces_whose_answer_is_known():
    n_tokens, n_expert, k = 200, 16, 4
    same = Trace(1, n_expert, k, np.tile(np.arange(k), (n_tokens, 1, 1)))  # every token the same 4 experts
    [row] = locality.by_layer(same)
    assert row.touched == k / n_expert and row.repeat == 1.0
    assert math.isclose(row.entropy, math.log2(k) / math.log2(n_expert))
    rotate = Trace(1, n_expert, k, np.array([[(np.arange(k) + k * t) % n_expert] for t in range(n_tokens)]))
    [row] = locality.by_layer(rotate, window=2)  # disjoint neighbours, an even load over all experts
    assert row.repeat == 0.0 and math.isclose(row.entropy, 1.0) and row.touched == 2 * k / n_expert
    hits = locality.lru_hits(rotate)  # a cycle through all 16 experts misses every time under LRU at 4 or 8 slots
    assert hits == {"2/16": 0.0, "4/16": 0.0, "8/16": 0.0}
    assert locality.lru_hits(same)["4/16"] > 0.99
    # a prompt's pass first: it fills the cache, uncounted, so the decoded tokens after it all hit
    after = simulate(same, 4, "lru", first=10)
    assert (after.n_tokens, after.n_steps, after.requests, after.hit_rate) == (190, 190, 190 * k, 1.0)
    assert simulate(same, 4, "lru").misses == k  # counted from cold, the first token misses


def test_slots_by_layer_go_where_a_layer_touches_more_experts():
    """Layer 0 cycles through 4 experts, layer 1 through 8, 2 a token: with 6 slots a layer in all, LRU hits every
    use after the first cycle with 4 and 8 (and none with fewer), so the split is 4 and 8; replayed on the second
    half it misses only the first cycles where 6 each miss layer 1's every use."""
    n_tokens, k = 400, 2
    ids = np.array([[(np.arange(k) + k * t) % 4, (np.arange(k) + k * t) % 8] for t in range(n_tokens)])
    trace = Trace(2, 8, k, ids)
    assert locality.slots_by_layer(trace, 6, step=2) == [4, 8]
    split = locality.split(trace, 6, step=2)
    uses = 200 * k * 2  # the second half's, both layers; each cache starts cold there
    assert split.lru == pytest.approx((200 * k - 4) / uses)  # layer 0 hits at 6, layer 1's cycle of 8 never
    assert split.by_layer == pytest.approx(1 - (4 + 8) / uses)
    assert split.pool == pytest.approx(1 - (4 + 8) / uses)  # one pool of 12 holds both cycles too
    # nothing gains (every token the same 2 experts): the room spread evenly, a layer at most every expert
    same = Trace(2, 8, k, np.tile(np.arange(k), (n_tokens, 2, 1)))
    assert locality.slots_by_layer(same, 6, step=2) == [6, 6]
    assert locality.slots_by_layer(same, 8, step=2) == [8, 8]


def test_cli_writes_text_routing_and_refuses_it_for_a_dense_shape(tmp_path):
    out = tmp_path / "oss.gguf"
    r = cli("models", "synth", "gpt-oss-tiny", "--routing", "text", "-o", str(out), check=True)
    assert load(out).arch == "gpt-oss" and "100 %" in r.stderr
    r = cli("models", "synth", "tiny", "--routing", "text", "-o", str(tmp_path / "dense.gguf"))
    assert r.returncode != 0 and "mixture of experts" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "dense.gguf").exists() and not (tmp_path / "dense.gguf.part").exists()


def test_a_forced_text_is_decoded_in_place_of_the_sampled_tokens(tmp_path):
    """Teacher forcing (Request.forced): the run decodes the text's tokens, one a pass, and reports them, streamed
    in a child under a budget as unbudgeted in this process; with a tree it is refused in one line."""
    from flexoffload import FlexoffloadError, api

    from flexoffload.measure import probe
    from flexoffload.plan.planners import run_minimum

    shape = dataclasses.replace(synth.SHAPES["gpt-oss-tiny"], n_embd=512, n_ff_expert=256, n_vocab=4096)
    path = synth.write(tmp_path / "oss.gguf", shape, routing="text")
    forced = " ab ac ad ae af ag ah"
    with engine.Engine(path, engine.Settings(n_ctx=256, n_threads=2, strategy="mmap")) as e:
        want = e.tokenize(forced, add_special=False)[:5]
    request = api.Request(model=str(path), prompt="a b", n_predict=5, n_ctx=256, n_batch=32, n_threads=2, temp=0,
                          forced=forced)
    free = api.generate(request)
    assert free["tokens"] == want and free["timings"]["forced"] and free["n_gen"] == 5
    budget = run_minimum(load(path), probe.measure(load(path), 256, 32))  # the experts and more stream
    streamed = api.generate(dataclasses.replace(request, mem=str(budget), strategy="stream"), enforce=True)
    assert streamed["tokens"] == want and streamed["enforced"] and streamed["plan"]["streamed_mb"] > 0
    with pytest.raises(FlexoffloadError, match="forced"):
        api.prepare(dataclasses.replace(request, spec_type="ngram-simple"))


def test_a_long_first_measurement_says_how_far_it_is_and_how_long_to_go(tmp_path, caplog):
    """Tracing a text's experts logs its progress as it goes (at most a line a tenth, the time to go extrapolated
    from the tokens done), the last line the whole."""
    import logging

    path = synth.write(tmp_path / "moe.gguf", synth.SHAPES["qwen3moe-tiny"], routing="text")
    with caplog.at_level(logging.INFO, logger="flexoffload"):
        tokens = [259 + i * 7 % 125 for i in range(360)]  # pieces of the 384-token vocabulary
        trace = tracing.measure(load(path), tokens, 2, max_tokens=360, n_ubatch=32)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tracing experts:")]
    assert trace.n_tokens == 360 and 5 <= len(lines) <= 10
    assert "to go" in lines[0] and lines[-1].startswith("tracing experts: 360 of 360 tokens")


def test_a_text_routed_file_too_large_for_memory_is_traced_by_computing(tmp_path, monkeypatch, private_cache):
    """Where a prompt through the file under mmap would read it whole a ubatch (larger than half the memory), its
    trace is computed from its weights (what llama.cpp's own trace gives: the test above) and cached as a measured
    one is; a file routed otherwise is still run."""
    from flexoffload.measure import profiler

    path = synth.write(tmp_path / "text.gguf", synth.SHAPES["gpt-oss-tiny"], routing="text")
    monkeypatch.setattr(profiler, "memory_bytes", lambda: path.stat().st_size)  # the file is "too large"
    monkeypatch.setattr(tracing, "measure", lambda *a, **k: pytest.fail("ran the model"))
    got = tracing.trace(load(path), TEXT, max_tokens=200)
    assert "computed from the weights" in got.source and got.n_tokens == 200
    assert np.array_equal(got.ids, tracing.computed(load(path), TEXT, max_tokens=200).ids)
    assert tracing.trace(load(path), TEXT, max_tokens=200).source == got.source  # cached
    random = synth.write(tmp_path / "random.gguf", synth.SHAPES["gpt-oss-tiny"], routing="random")
    with pytest.raises(pytest.fail.Exception, match="ran the model"):
        tracing.trace(load(random), TEXT, max_tokens=200)

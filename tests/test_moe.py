"""Mixtures of experts, synthetic (random weights, real shapes; their routing is not uniform: docs/experts.md):
written as llama.cpp loads them, read with their experts as a kind of their own, refused in one line where header
and tensors disagree, and run under a budget whose mmap minimum counts one token's routed experts; expert tensors
stream by expert (patches 0018-0019) with a per-layer cache whose size the plan chooses (issue 28)."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import cli

from flexoffload import FlexoffloadError, api
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import probe, tracing
from flexoffload.memory import budgets
from flexoffload.plan import expertcache, replay
from flexoffload.plan.planners import run_minimum

MOE = ["llama-moe-tiny", "qwen3moe-tiny"]


@pytest.mark.parametrize("name", MOE)
def test_experts_are_their_own_kind_and_a_token_reads_its_routed_share(name, tmp_path):
    s = synth.SHAPES[name]
    m = load(synth.write(tmp_path / f"{name}.gguf", s))
    assert (m.n_expert, m.n_expert_used) == (s.n_expert, s.n_expert_used)
    experts = [t for t in m.tensors if t.kind == "expert"]
    assert len(experts) == 3 * s.n_layer and [t for t in m.tensors if t.kind == "router"]
    # Q4_0: 18 bytes a 32 weights; an expert of gate, up and down is 3 x width x n_embd weights
    one_expert = 3 * s.expert_width * s.n_embd // 32 * 18
    assert sum(t.n_bytes for t in experts) == s.n_layer * s.n_expert * one_expert
    dense = m.weight_bytes - sum(t.n_bytes for t in experts)
    assert m.routed_bytes == dense + s.n_layer * s.n_expert_used * one_expert


# embeddings and output of 1.1 MiB (above the 1 MiB that always stays resident), so a plan streams them
STREAMED = {"llama-moe-tiny": dict(n_embd=512, n_ff=512, n_vocab=4096),
            "qwen3moe-tiny": dict(n_embd=512, n_ff_expert=256, n_vocab=4096)}


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("slots", [None, 0, 1])
def test_a_moe_streamed_by_expert_gives_mmap_s_tokens(name, slots, tmp_path):
    """At the least budget it runs in, the plan streams every expert tensor (by expert) and the rest as for a dense
    model; greedy tokens are mmap's whatever the cache keeps (none, one expert a layer, the plan's choice), and the
    runtime reads experts only as the routing asks: a cache of s slots a layer, per pass, finds at most s of a
    token's k routed experts, and reads the others. What it finds is what an LRU cache of s slots finds on the run's
    own routing (traced, replayed: plan/replay.py), and what it holds fits in the memory the plan gave the experts."""
    path = synth.write(tmp_path / f"{name}.gguf", dataclasses.replace(synth.SHAPES[name], **STREAMED[name]))
    m = load(path)
    request = api.Request(model=str(path), prompt="a b c d", n_predict=12, temp=0, n_ctx=256, n_batch=32)
    alone = api.generate(dataclasses.replace(request, strategy="mmap"))
    # the least it runs in, and room for the slots asked for (the slack grows with the budget)
    extra = expertcache.memory(m, slots or 0) - expertcache.memory(m, 0)
    mem = run_minimum(m, probe.measure(m, 256, 32)) + 2 * extra
    # by expert (routed), as this test is about; left to the plan, a slow moment's profile can choose whole reads,
    # which the test below covers
    prepared = api.prepare(dataclasses.replace(request, mem=str(mem), strategy="stream", expert_slots=slots,
                                               expert_reads="routed"))
    experts = {t.name for t in m.tensors if t.kind == "expert"}
    assert experts <= set(prepared.plan.streamed) and not experts & set(prepared.plan.resident)
    streamed = api.run_prepared(prepared)
    assert streamed["tokens"] == alone["tokens"]
    t = streamed["timings"]
    passes = t["stream_passes"]
    assert t["expert_uses"] >= m.n_layer * m.n_expert_used * (passes - 1)  # every decode pass: k per layer
    # the experts' memory the plan counted holds what the runtime's cache held at its peak (a prompt batch's experts)
    assert 0 < t["expert_cached_peak"] <= prepared.plan.memory.experts
    one = sum(x.n_bytes for x in m.tensors if x.kind == "expert") // m.n_expert // m.n_layer
    hits = round(t["expert_uses"] * t["expert_hit_rate"])
    assert t["expert_bytes_read"] == (t["expert_uses"] - hits) * one  # every miss read once, nothing else
    if slots == 0:
        assert hits == 0
    if slots is not None:  # a layer's hits: at most its slots of a token's experts
        assert t["expert_hit_rate"] <= slots / m.n_expert_used + 1e-9
    # The decode passes' routing, traced one token a ubatch as decode computes it (the prompt, then every generated
    # token but the last, which is not decoded), replayed through LRU caches of the plan's slots starting empty. The
    # run's cache starts with what the prompt batch left (at most `slots` a layer): an LRU cache holding more never
    # hits less (what the empty one holds, the other holds too), and each unit it starts with adds at most one hit.
    # So the run hits at least what the replay does, and at most slots a layer more (the prompt pass, cold, hits
    # none): a cache that never hit, or hit by another policy, fails on this routing, where the replay hits.
    assert prepared.plan.experts.policy == "lru"
    cold = _replayed(m, request.prompt, streamed["tokens"][:-1], prepared.plan.experts.slots)
    assert cold.hits <= hits <= cold.hits + prepared.plan.experts.slots * m.n_layer
    if slots:
        assert cold.hits > 0  # the bound is not vacuous: random weights route most tokens alike (docs/experts.md)


# random routers, and routing by the token (a prompt of repeated words: some experts chosen by many of its tokens;
# "uneven": LFU counting a prompt's passes, not its tokens, hits 77 where the replay hits 76: patch 0028)
ROUTINGS = {"random": ("llama-moe-tiny", "random", 3, "a b c d e f g"),
            "text": ("qwen3moe-tiny", "text", 4, "the cat the dog the cat the end of it the"),
            "uneven": ("qwen3moe-tiny", "text", 6, "dog cat a of is dog cat is dog dog dog dog")}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("policy", expertcache.POLICIES)
def test_the_runtime_s_cache_hits_what_its_policy_s_replay_hits(policy, routing, tmp_path):
    """From an empty cache, the prompt one pass (it hits nothing), then a token a pass: the runtime's cache of a few
    slots a layer under each policy (Settings.expert_policy, as a plan sets it) finds exactly what the replay of
    that policy finds on the run's own routing, so a plan that chooses the policy by its replay chooses what the
    runtime does; and where a prompt's tokens route unevenly, it keeps the experts the prompt routed most to, as
    the replay does (patch 0026), and LFU counts the tokens routed to each (0028). The tokens are the same under
    either. The cache alone: no layer reads the next one's predicted experts (test_moe_paths has lookahead)."""
    name, routed, slots, prompt = ROUTINGS[routing]
    path = synth.write(tmp_path / f"{name}.gguf", dataclasses.replace(synth.SHAPES[name], **STREAMED[name]),
                       routing=routed)
    m = load(path)
    mem = run_minimum(m, probe.measure(m, 256, 32)) + 2 * (expertcache.memory(m, slots) - expertcache.memory(m, 0))
    request = api.Request(model=str(path), prompt=prompt, n_predict=12, temp=0, n_ctx=256, n_batch=32,
                          mem=str(mem), strategy="stream", expert_slots=slots, expert_reads="routed")
    prepared = api.prepare(request)
    prepared = dataclasses.replace(prepared, settings=dataclasses.replace(prepared.settings, expert_policy=policy,
                                                                          expert_lookahead=False))
    run = api.run_prepared(prepared)
    assert run["tokens"] == api.generate(dataclasses.replace(request, mem=None, strategy="mmap"))["tokens"]
    t = run["timings"]
    from flexoffload.runtime import engine

    with engine.Engine(str(path), engine.Settings(n_ctx=256, n_threads=1, temp=0)) as e:
        prompt_tokens = e.tokenize(request.prompt)
    n = len(prompt_tokens)
    assert n == run["n_prompt"]
    # routed as the run routes: the prompt one ubatch, whose last layer computes its output row alone (llama.cpp's
    # inp_out_ids: the replay counts that row alone there, and the prompt's uses below), then a token a ubatch
    ids = np.concatenate([tracing.measure(m, prompt_tokens, 2, n_ubatch=n).ids,
                          tracing.measure(m, prompt_tokens + run["tokens"][:-1], 2, n_ubatch=1).ids[n:]])
    ids[:n, -1] = ids[n - 1, -1]
    replayed = replay.simulate(replay.Trace(m.n_layer, m.n_expert, m.n_expert_used, ids), slots, policy, first=n)
    prompt = sum(len(set(ids[:n, il].ravel())) for il in range(m.n_layer))  # the prompt's pass: counted, no hit
    assert t["expert_uses"] == replayed.requests + prompt
    assert round(t["expert_uses"] * t["expert_hit_rate"]) == replayed.hits > 0


def _replayed(m, prompt: str, decoded: list[int], slots: int):
    """An LRU cache of `slots` a layer replayed on the experts the decode passes after `prompt` route to, starting
    empty: one token a step."""
    from flexoffload.runtime import engine

    with engine.Engine(str(m.path), engine.Settings(n_ctx=256, n_threads=1, temp=0)) as e:
        prompt_tokens = e.tokenize(prompt)
    trace = tracing.measure(m, prompt_tokens + decoded, 2, n_ubatch=1)
    decode = replay.Trace(trace.n_layer, trace.n_expert, trace.n_used, trace.ids[len(prompt_tokens):])
    return replay.simulate(decode, slots, "lru")


@pytest.mark.parametrize("name", MOE)
def test_expert_tensors_streamed_whole_give_mmap_s_tokens_and_every_pass_reads_them_all(name, tmp_path):
    """--expert-reads whole (patch 0021): the plan streams expert tensors whole by the window, like dense ones; the
    same greedy tokens, nothing read by expert, and each pass reads every streamed expert tensor whole."""
    path = synth.write(tmp_path / f"{name}.gguf", dataclasses.replace(synth.SHAPES[name], **STREAMED[name]))
    m = load(path)
    request = api.Request(model=str(path), prompt="a b c d", n_predict=8, temp=0, n_ctx=256, n_batch=32)
    alone = api.generate(dataclasses.replace(request, strategy="mmap"))
    # the least it runs in (the least for its experts read whole, as a dense model's tensors, may be less)
    run = probe.measure(m, 256, 32)
    mem = max(run_minimum(m, run), run_minimum(dataclasses.replace(m, n_expert=0, n_expert_used=0), run))
    prepared = api.prepare(dataclasses.replace(request, mem=str(mem), strategy="stream", expert_reads="whole"))
    streamed = {t.name for t in m.tensors if t.kind == "expert"} & set(prepared.plan.streamed)
    assert prepared.plan.experts.whole and streamed
    whole = api.run_prepared(prepared)
    assert whole["tokens"] == alone["tokens"]
    t = whole["timings"]
    assert not t.get("expert_uses") and not t.get("expert_bytes_read")  # no expert counted: none read by expert
    assert t["stream_bytes_read"] >= t["stream_passes"] * sum(x.n_bytes for x in m.tensors if x.name in streamed)
    # and the next model loaded streams its experts by expert again
    routed = api.run_prepared(api.prepare(dataclasses.replace(prepared.request, expert_reads="routed")))
    assert routed["tokens"] == alone["tokens"] and routed["timings"]["expert_uses"] > 0


def test_the_mmap_minimum_counts_one_token_s_experts(tmp_path):
    m = load(synth.write(tmp_path / "moe.gguf", synth.SHAPES["llama-moe-tiny"]))
    run = probe.measure(m, 256, 32)
    whole = max(m.layer_bytes(i) for i in range(m.n_layer))
    routed = max(sum(m.token_bytes(t) for t in m.layer_tensors(i)) for i in range(m.n_layer))
    assert routed < whole / 2  # 2 of 8 experts
    assert budgets.minimum(m, run) == budgets.holding(m, routed, run) < budgets.holding(m, whole, run)


@pytest.mark.parametrize("hparams, message", [
    ({"expert_used_count": 9}, "expert_used_count must be between 1 and expert_count"),
    ({"expert_count": 6}, "is not 6 equal slices"),
])
def test_a_moe_whose_header_and_tensors_disagree_is_one_line_before_loading(tmp_path, hparams, message):
    path = _bad_header(tmp_path, hparams)
    with pytest.raises(FlexoffloadError, match=message):
        load(path)
    r = cli("info", "-m", str(path))
    assert r.returncode != 0 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _bad_header(tmp_path, hparams):
    """The tiny MoE with its expert counts replaced in the header."""
    shape = synth.SHAPES["llama-moe-tiny"]
    add = synth._add_hparams

    def replaced(w, s):
        real = dataclasses.replace(s)
        object.__setattr__(real, "n_expert", hparams.get("expert_count", s.n_expert))
        object.__setattr__(real, "n_expert_used", hparams.get("expert_used_count", s.n_expert_used))
        add(w, real)

    synth._add_hparams = replaced
    try:
        return synth.write(tmp_path / "bad.gguf", shape)
    finally:
        synth._add_hparams = add


def test_info_shows_the_experts_and_what_a_token_reads(tmp_path):
    path = synth.write(tmp_path / "moe.gguf", synth.SHAPES["qwen3moe-tiny"])
    text = cli("info", "-m", str(path), check=True).stdout
    assert "4 of 16 experts a token" in text and "\nexpert " in text and "a token reads" in text
    data = json.loads(cli("info", "-m", str(path), "--json", check=True).stdout)
    assert data["n_expert"] == 16 and data["routed_bytes"] == load(path).routed_bytes
    assert {t["kind"] for t in data["tensors"]} >= {"expert", "router"}

"""Expert routing measured and replayed (issue 28, items 2-3): the cache simulation against traces worked by hand,
Belady's bound against LRU and LFU, a prompt batch's union, the pool's cyclic worst case, the prediction against
an independent sum, and the trace recorded from llama.cpp's ffn_moe_topk nodes on tiny synthetic MoEs."""

import json

import numpy as np
import pytest
from conftest import cli

from flexoffload import FlexoffloadError
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import tracing
from flexoffload.plan import expertcache, replay
from flexoffload.plan.costmodel import Profile, compute_seconds
from flexoffload.plan.replay import Trace, simulate


def one_layer(sequence, n_expert=4):
    """A trace of one layer, one expert a token."""
    return Trace(1, n_expert, 1, np.array(sequence).reshape(-1, 1, 1))


def uniform(rng, n_tokens, n_layer, n_expert, n_used):
    ids = np.stack([np.stack([rng.choice(n_expert, n_used, replace=False) for _ in range(n_layer)])
                    for _ in range(n_tokens)])
    return Trace(n_layer, n_expert, n_used, ids)


# 0 1 2 0 1 3 0 1 through 2 slots, worked by hand (what a step uses is kept; the victim is among the others):
# LRU evicts what comes back next every time: no hit.
# LFU (counts kept, ties to the least recent): 2 evicts 0 (1:1 against 1:1, older), 0 evicts 1, 1 evicts 2 (count 1
#   against 2), 3 evicts 0 (2 against 2, older), 0 evicts 3 (count 1); then 1 hits.
# Belady: 2 evicts 1 (0 comes back sooner), 0 hits, 1 evicts 2 (never used again), 3 evicts 1 (0 comes back
#   sooner), 0 hits, 1 misses: two hits.
@pytest.mark.parametrize("policy,hits", [("lru", 0), ("lfu", 1), ("belady", 2)])
def test_hits_worked_by_hand(policy, hits):
    r = simulate(one_layer([0, 1, 2, 0, 1, 3, 0, 1]), 2, policy)
    assert (r.requests, r.hits, r.misses_by_layer) == (8, hits, (8 - hits,))
    assert r.misses_per_token == (8 - hits) / 8


def test_lru_keeps_what_was_used_last_and_lfu_what_was_used_most():
    # 0 0 0 1 2 0: LRU's 2 evicts 0 (1 was used later), so 0 misses; LFU's 2 evicts 1 (used once), so 0 hits
    trace = one_layer([0, 0, 0, 1, 2, 0])
    assert simulate(trace, 2, "lru").hits == 2
    assert simulate(trace, 2, "lfu").hits == 3


def test_lfu_counts_the_tokens_a_prompt_routed_to_an_expert():
    """A prompt of 0 0 0 1 (one step), then 1 2 0 decoded through 2 slots (patch 0028), at the first of two layers.
    LFU counts 0 three times and 1 once, so 2 evicts 1 (twice by then against three times) and 0 hits: 2 of 3.
    Counting steps, 0 and 1 had one each, 1 two by then, and 2 evicted 0; LRU (the prompt's most routed, 0, used
    last in it) evicts 0 too: 1 of 3. The last layer computes the prompt's last token alone (llama.cpp outputs
    only its row): the prompt leaves it 1, so 1 hits and 2 and 0 find room."""
    sequence = [0, 0, 0, 1, 1, 2, 0]
    trace = Trace(2, 4, 1, np.array([[[e], [e]] for e in sequence]))
    assert simulate(trace, 2, "lfu", first=4).misses_by_layer == (1, 2)
    assert simulate(trace, 2, "lru", first=4).misses_by_layer == (2, 2)


def test_no_slots_reads_every_routed_expert_and_all_slots_only_the_first_use():
    trace = uniform(np.random.default_rng(1), 50, 3, 8, 2)
    for policy in replay.POLICIES:
        assert simulate(trace, 0, policy).misses_per_token == 3 * 2
        assert simulate(trace, 8, policy).misses == len({(l, e) for l in range(3) for e in trace.ids[:, l].ravel()})


def test_a_batch_reads_the_union_of_its_tokens_experts_pinned_then_trimmed():
    # tokens [0 1] [1 2] | [2 3] [0 1], 2 slots, steps of 2 tokens:
    # step 1 uses 0, 1, 2 (all read, all kept while the layer computes: 3 units in 2 slots), then LRU trims 0 (used
    # first: one token routed to it, as to 2, and the lower id); step 2 uses 0, 1, 2, 3: 1 and 2 hit, 0 and 3 read
    trace = Trace(1, 4, 2, np.array([[0, 1], [1, 2], [2, 3], [0, 1]]).reshape(4, 1, 2))
    r = simulate(trace, 2, "lru", batch=2)
    assert (r.n_steps, r.requests, r.misses) == (2, 7, 5)
    assert r.misses_per_step == 2.5 and r.misses_per_token == 5 / 4
    # one token a step: 0 1 | 1 2 | 2 3 | 0 1: 1 and 2 hit
    assert simulate(trace, 2, "lru").misses == 6


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_prompt_leaves_the_cache_the_experts_it_routed_most_to(policy):
    # a prompt of 4 tokens, one pass: 0 and 1 chosen by three tokens each, 2 and 3 by one; its pass uses all four
    # (2 slots: held while the layer computes, then trimmed). Within the pass those more tokens chose count as used
    # later (patch 0026), so 0 and 1 stay, not the higher ids: the next two tokens, routed to 0 and 1, hit (at the
    # first of two layers: the last computes the prompt's last token alone)
    ids = np.array([[0, 3], [0, 1], [1, 0], [2, 1], [0, 1], [1, 0]]).reshape(6, 1, 2)
    r = simulate(Trace(2, 4, 2, np.repeat(ids, 2, axis=1)), 2, policy, first=4)
    assert r.requests == 8 and r.misses_by_layer[0] == 0


def test_layers_have_caches_of_their_own_and_one_lru_pool_thrashes_on_the_cycle_of_layers():
    # every token routes to experts 0 and 1 in all three layers; one slot a layer
    trace = Trace(3, 4, 2, np.tile([0, 1], (20, 3, 1)))
    per_layer = simulate(trace, 1, "lru")
    assert per_layer.hits == 19 * 3  # each layer keeps the expert it used last: one hit a token a layer
    # a pool of 3 units holds a layer's 2 but not a token's 6: what LRU keeps is the layers just visited, and the
    # next layer is the one visited longest ago
    assert simulate(trace, 1, "lru", pool=True).hits == 0
    assert simulate(trace, 1, "belady", pool=True).hits > 0  # the same pool can hit
    assert simulate(trace, 2, "lru", pool=True).hits == 19 * 6  # a pool that holds a token's experts: all hit


@pytest.mark.parametrize("seed", range(4))
def test_belady_is_the_bound_and_more_slots_never_miss_more(seed):
    rng = np.random.default_rng(seed)
    n_expert = 12
    # skewed routing, as real routers are: a few experts most of the time
    p = 1 / np.arange(1, n_expert + 1)
    ids = np.stack([np.stack([rng.choice(n_expert, 3, replace=False, p=np.roll(p / p.sum(), layer))
                              for layer in range(3)]) for _ in range(300)])
    trace = Trace(3, n_expert, 3, ids)
    for batch in (1, 4):
        for slots in (1, 3, 6, 9):
            best = simulate(trace, slots, "belady", batch=batch).misses
            assert best <= simulate(trace, slots, "lru", batch=batch).misses
            assert best <= simulate(trace, slots, "lfu", batch=batch).misses
    for policy in ("lru", "belady"):  # stack algorithms: a bigger cache holds what a smaller one would
        misses = [simulate(trace, slots, policy).misses for slots in range(0, n_expert + 1)]
        assert misses == sorted(misses, reverse=True)


def test_uniform_routing_hits_as_often_as_the_cache_is_a_share_of_the_experts():
    # tokens routed independently and uniformly: whatever LRU holds, a request hits with probability slots/n_expert
    trace = uniform(np.random.default_rng(7), 1500, 4, 16, 2)
    for slots in (2, 4, 8, 12):
        assert simulate(trace, slots, "lru").hit_rate == pytest.approx(slots / 16, abs=0.03)


def test_a_trace_round_trips_and_refuses_ids_out_of_range(tmp_path):
    trace = uniform(np.random.default_rng(3), 40, 2, 300, 4)  # over 256 experts: two bytes an id
    trace.write(tmp_path / "t.json")
    back = Trace.read(tmp_path / "t.json")
    assert np.array_equal(back.ids, trace.ids) and (back.n_layer, back.n_expert, back.n_used) == (2, 300, 4)
    with pytest.raises(ValueError):
        Trace(1, 4, 1, np.array([[[4]]]))
    with pytest.raises(ValueError):
        Trace(2, 4, 1, np.zeros((3, 1, 1), dtype=int))
    with pytest.raises(FlexoffloadError):
        simulate(trace, 2, "fifo")


@pytest.fixture(scope="module")
def moe_tiny(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("moe") / "llama-moe-tiny.gguf", synth.SHAPES["llama-moe-tiny"])


def test_the_prediction_adds_the_missed_experts_reads_to_the_in_memory_token(moe_tiny):
    m = load(moe_tiny)
    s = synth.SHAPES["llama-moe-tiny"]
    unit = 3 * s.expert_width * s.n_embd // 32 * 18  # Q4_0: gate, up, down slices of one expert
    assert replay.unit_bytes(m) == [unit] * s.n_layer
    profile = Profile(disk_bw=1e8, io_latency=1e-4, default_sec_per_byte=1e-10)
    trace = uniform(np.random.default_rng(0), 200, s.n_layer, s.n_expert, s.n_expert_used)
    none = replay.predict(m, trace, 0, "lru", profile, io_threads=4)
    reads = s.n_layer * s.n_expert_used  # every routed expert: a layer's burst of 3 requests each over 4 threads
    rounds = s.n_layer * -(-3 * s.n_expert_used // 4)
    routed = reads * unit * 1e-10  # the routed experts' compute, beside the dense weights'
    assert compute_seconds(m, profile) == pytest.approx(compute_seconds(expertcache.dense(m), profile) + routed)
    expected = compute_seconds(m, profile) + reads * unit / 1e8 + rounds * 1e-4
    assert none.units_per_token == reads and none.bytes_per_token == reads * unit
    assert none.compute_s == pytest.approx(compute_seconds(m, profile))
    assert none.tok_s == pytest.approx(1 / expected)
    half = replay.predict(m, trace, 4, "belady", profile, io_threads=4)
    assert half.cache_bytes == 4 * s.n_layer * unit
    assert none.tok_s < half.tok_s < 1 / compute_seconds(m, profile)
    wrong = Trace(s.n_layer + 1, s.n_expert, s.n_expert_used, np.zeros((1, s.n_layer + 1, s.n_expert_used)))
    with pytest.raises(FlexoffloadError, match="layers"):
        replay.predict(m, wrong, 1, "lru", profile)


# --- the trace, measured ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-moe-tiny", "qwen3moe-tiny"])
def test_the_trace_gives_each_token_its_routed_experts_every_layer_the_same_each_run(name, tmp_path, monkeypatch):
    s = synth.SHAPES[name]
    m = load(synth.write(tmp_path / f"{name}.gguf", s))
    text = tracing.calibration_text()
    first = tracing.trace(m, text, 2, max_tokens=300, n_ubatch=64)
    assert first.ids.shape == (300, s.n_layer, s.n_expert_used)
    assert first.ids.min() >= 0 and first.ids.max() < s.n_expert
    distinct = np.sort(first.ids, axis=-1)
    assert (np.diff(distinct, axis=-1) > 0).all()  # no expert twice in a token's layer
    again = tracing.trace(m, text, 2, max_tokens=300, n_ubatch=64, remeasure=True)
    assert np.array_equal(first.ids, again.ids)
    assert tracing.cache_path(m, text, 300, tracing.CTX, 64).is_file()

    def measured(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tracing, "measure", measured)
    assert np.array_equal(tracing.trace(m, text, 2, max_tokens=300, n_ubatch=64).ids, first.ids)


def test_decoding_token_by_token_routes_as_the_prompt_does(moe_tiny):
    """Teacher forcing: one token a ubatch (decode) and 64 (a prompt) choose the same experts, up to the rounding of
    a batch's kernels on near ties; a misaligned or partial trace would agree on few."""
    m = load(moe_tiny)
    text = tracing.calibration_text()
    one = tracing.measure(m, text, 2, max_tokens=200, n_ubatch=1)
    batched = tracing.measure(m, text, 2, max_tokens=200, n_ubatch=64)
    same = (np.sort(one.ids, -1) == np.sort(batched.ids, -1)).all(-1)
    assert same.mean() >= 0.95


def test_a_dense_model_has_no_experts_to_trace(tiny_model):
    with pytest.raises(FlexoffloadError, match="not a mixture of experts"):
        tracing.trace(load(tiny_model), "some text", 2)


def test_profile_experts_replays_the_trace_for_each_slot_count(moe_tiny):
    r = cli("profile", "--experts", "-m", str(moe_tiny), "-t", "2", "--slots", "0,2,8", "--json", check=True)
    out = json.loads(r.stdout)
    s = synth.SHAPES["llama-moe-tiny"]
    rows = {(row["slots"], row["policy"]): row for row in out["rows"]}
    assert set(rows) == {(n, p) for n in (0, 2, 8) for p in replay.POLICIES}
    assert rows[(0, "lru")]["units_per_token"] == s.n_layer * s.n_expert_used
    for n in (0, 2, 8):
        assert rows[(n, "belady")]["hit_rate"] >= max(rows[(n, "lru")]["hit_rate"], rows[(n, "lfu")]["hit_rate"])
    assert out["tokens"] > 1000
    layers = out["locality"]  # a line a layer, then their mean (layer -1), each a share in [0, 1]
    assert [x["layer"] for x in layers] == list(range(s.n_layer)) + [-1]
    assert all(0 < x[k] <= 1 for x in layers for k in ("touched", "entropy"))
    assert all(0 <= x["repeat"] <= 1 for x in layers)
    assert set(out["lru_hits"]) == {"1/8", "2/8", "4/8"}
    text = cli("profile", "--experts", "-m", str(moe_tiny), "-t", "2", "--slots", "2", check=True).stdout
    assert "belady" in text and "units/ubatch" in text and "touched/100" in text
    assert "LRU hits at 1/8 slots" in text and "2/8 slots" in text
    bad = cli("profile", "--experts", "-m", str(moe_tiny), "--slots", "9")
    assert bad.returncode != 0 and "0 to 8 slots" in bad.stderr and "Traceback" not in bad.stderr

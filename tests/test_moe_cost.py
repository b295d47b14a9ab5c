"""The cost of a mixture of experts' misses (issue 28, target 6: predicted tok/s within 20 % of measured): a layer's
missed experts are read as one burst after its router has run, at the speed the profile measured for bursts of
expert slices (measure/profiler.py, expert_reads), not at the large reads' bandwidth; what a cache misses per layer
comes from a replayed trace or, unmeasured, from uniform routing (plan/replay.py: Misses, cost). Pure Python, but
for the burst test, which reads a tiny synthetic MoE file."""

import dataclasses
import math

import numpy as np
import pytest

from flexoffload import FlexoffloadError
from flexoffload.defaults import SMALL_BYTES, cache_dir
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import profiler
from flexoffload.plan import expertcache, plans, replay
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.replay import Misses, Trace, simulate
from flexoffload.plan.planners import make_plan, minimum_budget


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The tiny synthetic Mixtral-style MoE: 2 layers, 2 of 8 experts a token."""
    return load(synth.write(tmp_path_factory.mktemp("moe") / "llama-moe-tiny.gguf", synth.SHAPES["llama-moe-tiny"]))


BIG = Profile(disk_bw=2e9, io_latency=50e-6, default_sec_per_byte=1e-10)  # large overlapped reads only
SLICES = Profile(disk_bw=2e9, io_latency=50e-6, default_sec_per_byte=1e-10, expert_read_bw=0.6e9,
                 expert_read_latency=300e-6)  # as measured for bursts of expert slices


def test_a_burst_of_expert_slices_takes_its_latency_and_its_bytes_at_the_measured_speed():
    assert SLICES.expert_read_seconds(6_000_000, 12, 4) == pytest.approx(300e-6 + 6_000_000 / 0.6e9)
    assert SLICES.expert_read_seconds(0, 0, 4) == 0
    # unmeasured: a stage's reads (bandwidth, and the request latency a round of io_threads)
    assert BIG.expert_read_seconds(6_000_000, 12, 4) == pytest.approx(6_000_000 / 2e9 + 3 * 50e-6)


def test_a_profile_calibrated_from_a_moe_s_speed_in_memory_gives_that_speed_back(moe):
    """The in-memory speed a MoE's profile was calibrated from is what compute_seconds says again: the routed
    experts' compute counted (profile's "with every weight in memory" and predict's compute once, not without it
    nor twice)."""
    from flexoffload.plan.costmodel import compute_seconds, expert_seconds

    profile = Profile.calibrated(moe, tok_s=50.0, disk_bw=2e9)
    assert compute_seconds(moe, profile) == pytest.approx(1 / 50.0)
    assert 0 < expert_seconds(moe, profile) < compute_seconds(moe, profile)
    trace = Trace(moe.n_layer, moe.n_expert, moe.n_expert_used,
                  np.tile(np.arange(moe.n_expert_used), (16, moe.n_layer, 1)), "one choice")
    predicted = replay.predict(moe, trace, moe.n_expert_used, "lru", profile)
    assert predicted.compute_s == pytest.approx(1 / 50.0)
    assert predicted.tok_s == pytest.approx(1 / (predicted.compute_s + predicted.read_s))


def test_misses_cost_more_at_the_slices_speed_than_at_the_large_reads_and_hits_the_same(moe):
    s = synth.SHAPES["llama-moe-tiny"]
    none_big = replay.cost(moe, 0, Misses.uniform(moe, 0), BIG)
    none_slices = replay.cost(moe, 0, Misses.uniform(moe, 0), SLICES)
    unit = replay.unit_bytes(moe)[0]
    assert none_slices.units_per_token == none_big.units_per_token == s.n_layer * s.n_expert_used
    # every layer misses its k units in one burst
    assert none_slices.read_s == pytest.approx(s.n_layer * (300e-6 + s.n_expert_used * unit / 0.6e9))
    assert none_slices.read_s > none_big.read_s
    assert none_slices.compute_s == none_big.compute_s > 0
    every = replay.cost(moe, s.n_expert, Misses.uniform(moe, s.n_expert), SLICES)
    assert every.read_s == 0 and every.seconds == replay.cost(moe, s.n_expert, Misses.uniform(moe, s.n_expert),
                                                               BIG).seconds


def test_the_plan_predicts_fewer_tokens_a_second_with_the_slices_speed(moe):
    budget = 64 << 20
    big = make_plan(moe, budget, "balanced", BIG, slots=0)
    slices = make_plan(moe, budget, "balanced", SLICES, slots=0)
    assert slices.predicted_tok_s < big.predicted_tok_s
    gap = 1 / slices.predicted_tok_s - 1 / big.predicted_tok_s
    reads = replay.cost(moe, 0, Misses.uniform(moe, 0), SLICES).read_s \
        - replay.cost(moe, 0, Misses.uniform(moe, 0), BIG).read_s
    assert gap == pytest.approx(reads)
    # the planner's expert cost is replay.cost's, for any misses it is handed
    traced = Misses(0.5, ((0.5, 0.5, 0.0), (0.0, 0.0, 1.0)))
    assert expertcache.cost(moe, 3, SLICES, lambda slots, policy: traced, 4) == replay.cost(moe, 3, traced, SLICES, 4)


def test_the_plan_takes_the_policy_whose_replay_misses_less(moe):
    """Experts 0 and 1 every third token, the other three pairs scanned between: at 4 slots (two pairs) LRU has
    given 0 and 1 back by the time they come again and never hits; LFU keeps them (a third of the uses hit at
    least). The plan sized by LRU asks LFU at the same size and takes it, its hits and cost; uniform routing, alike
    for both, stays LRU."""
    s = synth.SHAPES["llama-moe-tiny"]
    scan = [[2, 3], [4, 5], [6, 7]]
    pairs = [p for i in range(100) for p in ([0, 1], scan[2 * i % 3], scan[(2 * i + 1) % 3])]
    trace = Trace(s.n_layer, s.n_expert, s.n_expert_used, np.array([[p] * s.n_layer for p in pairs]))
    assert simulate(trace, 4, "lru").hit_rate < 0.01 and simulate(trace, 4, "lfu").hit_rate > 0.3

    def misses(slots, policy="lru"):
        return Misses.replayed(simulate(trace, slots, policy))

    plan = make_plan(moe, 64 << 20, "balanced", SLICES, slots=4, misses=misses)
    assert plan.experts.policy == "lfu" and plan.experts.slots == 4
    assert plan.experts.hit_rate == pytest.approx(simulate(trace, 4, "lfu").hit_rate)
    assert plan.experts.seconds == pytest.approx(expertcache.cost(moe, 4, SLICES, misses, 4, "lfu").seconds)
    assert make_plan(moe, 64 << 20, "balanced", SLICES, slots=4).experts.policy == "lru"


def test_one_layer_missing_several_pays_one_latency_where_several_layers_pay_one_each(moe):
    unit = replay.unit_bytes(moe)[0]
    one_layer = replay.cost(moe, 0, Misses(0.5, ((0.0, 0.0, 1.0), (1.0,))), SLICES)  # 2 units in layer 0
    two_layers = replay.cost(moe, 0, Misses(0.5, ((0.0, 1.0), (0.0, 1.0))), SLICES)  # 1 unit in each
    assert one_layer.bytes_per_token == two_layers.bytes_per_token == 2 * unit
    assert two_layers.read_s - one_layer.read_s == pytest.approx(300e-6)


def test_uniform_misses_are_binomial_and_a_traced_cache_misses_what_the_replay_counted(moe):
    s = synth.SHAPES["llama-moe-tiny"]
    k, n = s.n_expert_used, s.n_expert
    u = Misses.uniform(moe, 2)
    assert u.hit_rate == 2 / n
    for layer in u.shares:
        assert sum(layer) == pytest.approx(1)
        assert layer[k] == pytest.approx((1 - 2 / n) ** k)
    assert u.per_layer() == pytest.approx([k * (1 - 2 / n)] * s.n_layer)
    # routing that keeps to the same experts: the replay finds them all after the first token, uniform does not
    same = Trace(s.n_layer, n, k, np.tile(np.array([[0, 1]] * s.n_layer), (100, 1, 1)))
    traced = Misses.replayed(simulate(same, 2, "lru"))
    assert traced.hit_rate == pytest.approx(1 - 2 * s.n_layer / (100 * s.n_layer * k))
    assert traced.shares == ((0.99, 0.0, 0.01) + (0.0,) * (n - k),) * s.n_layer  # the first token misses both
    assert replay.cost(moe, 2, traced, SLICES).read_s < replay.cost(moe, 2, u, SLICES).read_s


def test_the_replay_counts_the_steps_by_the_units_they_miss():
    # 0 1 2 0 1 3 0 1 through 2 slots, LRU: every step misses its one unit
    r = simulate(Trace(1, 4, 1, np.array([0, 1, 2, 0, 1, 3, 0, 1]).reshape(-1, 1, 1)), 2, "lru")
    assert r.steps_by_misses == ((0, 8, 0, 0, 0),)
    # two units a token, alternating pairs, 2 slots: each step misses both (LRU) ...
    pairs = Trace(1, 4, 2, np.array([[0, 1], [2, 3]] * 4).reshape(-1, 1, 2))
    assert simulate(pairs, 2, "lru").steps_by_misses == ((0, 0, 8, 0, 0),)
    # ... and with all 4 slots only the first two steps miss
    assert simulate(pairs, 4, "lru").steps_by_misses == ((6, 0, 2, 0, 0),)
    with pytest.raises(FlexoffloadError, match="one token a step"):
        Misses.replayed(simulate(pairs, 2, "lru", batch=2))


def test_the_bursts_fit_recovers_latency_and_speed():
    bursts = [(b, 200e-6 + b / 0.7e9) for b in (600_000, 1_200_000, 2_400_000, 4_800_000) for _ in range(3)]
    bw, latency = profiler.fit_bursts(bursts)
    assert bw == pytest.approx(0.7e9) and latency == pytest.approx(200e-6)
    # one size only: no slope to fit, the mean speed with no latency
    assert profiler.fit_bursts([(1_000_000, 0.002)] * 4) == (pytest.approx(0.5e9), 0.0)
    with pytest.raises(FlexoffloadError):
        profiler.fit_bursts([])


def test_the_profile_times_bursts_of_a_layer_s_expert_slices(moe):
    s = synth.SHAPES["llama-moe-tiny"]
    assert profiler.burst_sizes(moe) == [1, 2]
    slice_bytes = replay.unit_bytes(moe)[0] // 3
    requests = profiler.unit_requests(moe, 1, 5)
    assert len(requests) == 3  # gate, up, down
    for (offset, length), t in zip(requests, [t for t in moe.layer_tensors(1) if t.kind == "expert"]):
        start = t.offset + 5 * slice_bytes
        assert offset % 4096 == 0 and length % 4096 == 0
        assert offset <= start and start + slice_bytes <= offset + length < start + slice_bytes + 2 * 4096
    r = profiler.expert_reads(moe, io_threads=2, seconds=60, max_bursts=3)  # three rounds, however slow
    one = {sum(n for _, n in profiler.unit_requests(moe, il, e)) for il in range(s.n_layer) for e in range(8)}
    assert len(r.bursts) == 3 * 2
    for units, (n_bytes, seconds) in zip([1, 2] * 3, r.bursts):
        assert seconds > 0 and min(one) * units <= n_bytes <= max(one) * units
    assert r.bandwidth > 0 and r.latency >= 0 and math.isfinite(r.bandwidth)


def test_a_moe_s_profile_is_kept_apart_from_profiles_without_burst_reads(moe, tiny_model):
    assert profiler._cache_path(moe, 2).name.endswith("-v7.json")
    assert profiler._cache_path(load(tiny_model), 2).name.endswith("-v5.json")
    old = Profile.from_dict({k: v for k, v in SLICES.to_dict().items() if not k.startswith("expert_")})
    assert old.expert_read_bw == 0 and old.expert_read_seconds(1000, 1, 4) == BIG.expert_read_seconds(1000, 1, 4)


def test_a_moe_run_s_reads_do_not_set_the_disk_speed_dense_plans_use(tmp_path, monkeypatch):
    """In a cache of the test's own (the session's models still read through it): the slow disk speed recorded here
    is the device's, and the session's later plans on this disk would plan with it."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * 4096)
    session, seen = cache_dir(), profiler.seen_disk_bw(path)
    own = tmp_path / "cache"
    own.mkdir()
    (own / "models").symlink_to(session / "models")
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(own))
    timings = {"stream_bytes_read": 2 << 30, "stream_direct": 900, "stream_reads": 900, "stream_read_gb_s": 0.7,
               "stream_stall_s": 2.0}
    assert profiler.seen_disk_bw(path) == []
    profiler.record_run(path, {**timings, "expert_uses": 4000})
    assert profiler.seen_disk_bw(path) == []
    profiler.record_run(path, timings)  # the same reads without experts: a pass's, the disk set the pace
    assert profiler.seen_disk_bw(path) == [pytest.approx(0.7e9)]
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(session))
    assert profiler.seen_disk_bw(path) == seen  # the session's plans on this disk see none of it


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """llama-moe-tiny with expert tensors of 2.25 MiB (above the size that always stays resident)."""
    shape = dataclasses.replace(synth.SHAPES["llama-moe-tiny"], n_embd=512, n_ff=1024, n_vocab=4096)
    return load(synth.write(tmp_path_factory.mktemp("moe") / "llama-moe-wide.gguf", shape))


SLOW_SLICES = dataclasses.replace(SLICES, expert_read_bw=0.1e9, expert_read_latency=2e-3)
FAST_SLICES = dataclasses.replace(SLICES, expert_read_bw=2e9, expert_read_latency=10e-6)


def test_the_plan_streams_expert_tensors_whole_where_that_is_predicted_faster(wide):
    """Reading a token's routed experts waits for its router and overlaps nothing; expert tensors streamed whole go
    ahead of compute at the large reads' speed (patch 0021). The plan takes whichever it predicts faster: whole where
    bursts of slices are slow (a quarter of the bytes at a twentieth of the speed), the routed experts where they
    are as fast as large reads."""
    budget = wide.weight_bytes * 3 // 4
    whole = make_plan(wide, budget, "balanced", SLOW_SLICES)
    routed = make_plan(wide, budget, "balanced", SLOW_SLICES, whole=False)
    assert whole.experts.whole and not routed.experts.whole
    assert whole.predicted_tok_s > routed.predicted_tok_s
    # streamed whole: no cache, and every streamed expert tensor read whole each token
    expert_names = {t.name for t in wide.tensors if t.kind == "expert"}
    streamed = expert_names & set(whole.streamed)
    assert streamed and whole.memory.experts == 0 and whole.experts.slots == 0
    assert whole.experts.bytes_per_token == sum(t.n_bytes for t in wide.tensors if t.name in streamed)
    assert whole.memory.total <= budget
    fast = make_plan(wide, budget, "balanced", FAST_SLICES)
    assert not fast.experts.whole
    assert fast.predicted_tok_s >= make_plan(wide, budget, "balanced", FAST_SLICES, whole=True).predicted_tok_s


def test_the_plan_looks_ahead_where_a_token_s_experts_fit_in_the_slots(moe):
    """A decoded token's layer reads the next layer's predicted experts into that layer's slots (patch 0029), so
    the plan turns lookahead on where the slots hold a token's k experts, off where they do not (the runtime would
    not act on it), as given where given; never with expert tensors read whole."""
    k = moe.n_expert_used
    assert make_plan(moe, 64 << 20, "balanced", SLICES, slots=k).experts.lookahead
    assert not make_plan(moe, 64 << 20, "balanced", SLICES, slots=k - 1).experts.lookahead
    assert not make_plan(moe, 64 << 20, "balanced", SLICES, slots=k, lookahead=False).experts.lookahead
    assert make_plan(moe, 64 << 20, "balanced", SLICES, slots=k, lookahead=False).experts.slots == k
    with pytest.raises(FlexoffloadError, match="lookahead"):
        make_plan(moe, 64 << 20, "balanced", SLICES, whole=True, lookahead=True)
    plan = make_plan(moe, 64 << 20, "balanced", SLICES, slots=k)
    assert plans.Plan.from_dict(plan.to_dict()).experts.lookahead  # a saved plan keeps it


def test_a_moe_s_routers_stay_resident_at_every_budget(tmp_path):
    """Lookahead (patch 0029) predicts only with a router in memory, and every token reads each layer's router
    whole: a plan keeps the routers resident however short the budget, also where one is over SMALL_BYTES (the
    30B-A3B shape's are 1 MiB each; a plan that streamed them predicted nothing at all)."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_embd=2048, n_expert=128, n_expert_used=8,
                                n_ff_expert=32)
    m = load(synth.write(tmp_path / "routers.gguf", shape))
    routers = {t.name for t in m.tensors if t.kind == "router"}
    assert len(routers) == shape.n_layer and all(t.n_bytes >= SMALL_BYTES for t in m.tensors if t.name in routers)
    low = minimum_budget(m)
    for budget in (low, low + (4 << 20), low + (16 << 20), low + (64 << 20)):
        plan = make_plan(m, budget, "balanced", SLICES)
        assert not routers & set(plan.streamed) and routers <= set(plan.resident)
    plan = make_plan(m, low + (64 << 20), "balanced", SLICES, slots=shape.n_expert_used)
    assert plan.experts.lookahead and not routers & set(plan.streamed)


def test_lookahead_pipelines_the_layers_reads_over_one_disk(moe):
    """With lookahead, the share of a layer's misses the layer before predicts (the measured recall) is queued at
    that layer's router: where a layer computes longer than its burst reads, that share is hidden and the rest (and
    the first layer's whole burst: no layer predicts it) is waited for; where reads outlast compute, the disk never
    idles and the token takes its reads' time plus one layer's compute. No recall measured, or lookahead off: every
    burst waited for. The plan counts it in its prediction."""
    slots, k = 2, moe.n_expert_used
    plain = replay.Misses.uniform(moe, slots)
    half = dataclasses.replace(plain, recall=(0.5,) * moe.n_layer)
    base = replay.cost(moe, slots, plain, SLICES)
    assert replay.cost(moe, slots, plain, SLICES, lookahead=True).read_s == base.read_s  # no recall measured
    assert replay.cost(moe, slots, half, SLICES).read_s == base.read_s  # lookahead off
    # a layer computes longer than its burst reads: half of each burst but the first's hidden
    assert replay.compute_seconds(moe, SLICES) / moe.n_layer > base.read_s / moe.n_layer
    burst = base.read_s / moe.n_layer  # uniform routing: every layer's expected burst alike
    assert moe.n_layer > 1 and all(len(layer) > 1 for layer in plain.shares)
    assert replay.cost(moe, slots, half, SLICES, lookahead=True).read_s == \
        pytest.approx(burst + (base.read_s - burst) / 2)
    # bursts read a thousand times slower, each longer than a layer computes, every one predicted: the reads' time
    # and one layer's compute (its attention before the first burst, its experts after the last)
    slow = dataclasses.replace(SLICES, expert_read_bw=0.6e6)
    layer_s = replay.compute_seconds(moe, slow) / moe.n_layer
    every = dataclasses.replace(plain, recall=(1.0,) * moe.n_layer)
    serial = replay.cost(moe, slots, plain, slow).read_s
    assert serial / moe.n_layer > layer_s
    assert replay.cost(moe, slots, every, slow, lookahead=True).read_s == \
        pytest.approx(serial - (moe.n_layer - 1) * layer_s)
    planned = make_plan(moe, 64 << 20, "balanced", SLICES, slots=k, misses=lambda s, p="lru": dataclasses.replace(
        replay.Misses.uniform(moe, s), recall=(1.0,) * moe.n_layer))
    unplanned = make_plan(moe, 64 << 20, "balanced", SLICES, slots=k, lookahead=False,
                          misses=lambda s, p="lru": replay.Misses.uniform(moe, s))
    assert planned.experts.lookahead and planned.predicted_tok_s > unplanned.predicted_tok_s


def test_expert_slots_are_refused_with_expert_tensors_read_whole(wide):
    with pytest.raises(FlexoffloadError, match="expert slots"):
        make_plan(wide, wide.weight_bytes * 3 // 4, "balanced", SLICES, slots=2, whole=True)
    # slots given: the routed experts are read, whatever is faster
    assert not make_plan(wide, wide.weight_bytes * 3 // 4, "balanced", SLOW_SLICES, slots=0).experts.whole


def test_the_plan_gives_the_experts_the_memory_its_dense_part_leaves(tmp_path):
    """64 experts a layer: the slot counts the planner tries go in steps of 5 (4, 9, 14, ...). At a budget that holds
    the dense weights resident and 12, 20 or 30 slots a layer (and a prompt batch's experts beyond them), the plan
    takes exactly that many, not the step below it: the memory the dense part leaves goes to slots."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=8, n_embd=256, n_expert=64, n_expert_used=4,
                                n_ff_expert=512)
    m = load(synth.write(tmp_path / "wide.gguf", shape))
    assert 12 not in expertcache.candidates(m) and 20 not in expertcache.candidates(m)
    roomy = make_plan(m, 1 << 30, "balanced", SLICES, slots=0)
    dense = roomy.memory.total - roomy.memory.experts
    for slots in (12, 20, 30):
        plan = make_plan(m, dense + expertcache.memory(m, slots) + 1000, "balanced", SLICES)
        assert plan.experts.slots == slots and plan.memory.experts == expertcache.memory(m, slots)
        assert not set(plan.streamed) - {t.name for t in m.tensors if t.kind == "expert"}  # the dense part resident


def test_the_experts_memory_counts_a_layer_s_last_huge_page_where_its_slot_array_holds_one(moe, tmp_path):
    """A layer's slots are one array with room for all its experts, from a huge page boundary (patch 0025): the huge
    page its last slot in use ends in may be committed whole, but only where the array reaches past it. The tiny
    model's array is under 2 MiB (no rounding: a prompt's batch holds every expert of one layer beside the others'
    slots); a 64-expert model's is 15 MiB (a huge page a layer beside its slots, none for the batch's full layer)."""
    u, n = expertcache.slot_bytes(moe)[0], moe.n_expert
    assert n * u < expertcache.HUGE_PAGE
    assert expertcache.memory(moe, 2) == moe.n_layer * n * u + (n - 2) * u
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=8, n_embd=256, n_expert=64, n_expert_used=4,
                                n_ff_expert=512)
    wide = load(synth.write(tmp_path / "wide.gguf", shape))
    u, n = expertcache.slot_bytes(wide)[0], wide.n_expert
    assert (n - 12) * u > expertcache.HUGE_PAGE
    assert expertcache.memory(wide, 12) == 8 * (12 * u + expertcache.HUGE_PAGE) + (n - 12) * u
    assert expertcache.memory(wide, 0) == (n * u)  # no slots kept: the batch's layer alone, every expert, whole


def test_a_prompt_pass_reads_the_experts_its_tokens_route_to_that_the_cache_lacks(tmp_path):
    """A prefill pass of many tokens names nearly every expert of every layer (4 of 64 a token: 256 tokens miss an
    expert with probability (15/16)^256), so it reads all those its cache lacks, one burst a layer; a pass of one
    token reads about its own misses. Two passes read them twice: a prompt of 500 tokens in ubatches of 256 takes a
    round of every layer's reads more than in one of 512. Expert tensors streamed whole are streamed tensors, not
    counted here."""
    from flexoffload.plan import prefill

    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=8, n_embd=256, n_expert=64, n_expert_used=4,
                                n_ff_expert=512)
    m = load(synth.write(tmp_path / "wide.gguf", shape))
    plan = make_plan(m, 1 << 30, "balanced", SLICES, slots=12)
    sizes, reads = replay.unit_bytes(m), replay.unit_reads(m)
    full = prefill.expert_read_seconds(m, plan, 256, SLICES)
    assert full == pytest.approx(sum(SLICES.expert_read_seconds(52 * b, 52 * r, plan.io_threads)
                                     for b, r in zip(sizes, reads) if r), rel=1e-3)
    one = prefill.expert_read_seconds(m, plan, 1, SLICES)
    assert one == pytest.approx(sum(SLICES.expert_read_seconds(int(4 * 52 / 64 * b), math.ceil(4 * 52 / 64 * r),
                                                               plan.io_threads) for b, r in zip(sizes, reads) if r))
    assert prefill.expert_read_seconds(m, plan, 512, SLICES) == pytest.approx(full, rel=1e-3)
    rate = {256: 1.0, 512: 2.0}  # compute by the token: the ubatch changes only the reads
    assert (prefill.ttft(m, plan, 500, 256, SLICES, rate) - prefill.ttft(m, plan, 500, 512, SLICES, rate)
            == pytest.approx(prefill.expert_read_seconds(m, plan, 244, SLICES)
                             + (plans.streamed_bytes(plan, m) - plan.experts.bytes_per_token) / SLICES.disk_bw))
    whole = dataclasses.replace(plan, experts=dataclasses.replace(plan.experts, whole=True))
    assert prefill.expert_read_seconds(m, whole, 256, SLICES) == 0

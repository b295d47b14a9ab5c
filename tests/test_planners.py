from dataclasses import replace
from pathlib import Path

import pytest

from flexoffload import FlexoffloadError
from flexoffload.gguf import catalog
from flexoffload.gguf import synth
from flexoffload.plan.costmodel import Pipeline, Profile
from flexoffload.gguf.model import ATTENTION_KINDS as ATTENTION, FFN_KINDS as FFN, Model, Tensor, load, tensor_kind
from flexoffload.measure import probe
from flexoffload.plan.planners import POLICIES, always_resident, is_small, make_plan, memory_for, minimum_budget
from flexoffload.plan.planners.common import by_kind, layer_pool

# 8 layers, F32: attn_q/attn_output 1 MiB, attn_k/v 256 KiB (small), FFN 3 MiB each, token_embd/output 2 MiB
SHAPE = synth.Shape(n_layer=8, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)
BASELINES = [p for p in POLICIES if p != "balanced"]


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "eight.gguf", SHAPE, "F32"))


@pytest.fixture(scope="module")
def qwen():
    """The real Qwen2.5-Coder-1.5B's tensor table (Q4_K_M: types mixed per layer, GQA, a big vocabulary)."""
    path = catalog.model_path(catalog.CATALOG[catalog.DEFAULT_MODEL])
    if not path.exists():  # an integration test: `make test` fetches it; a missing model fails, it is not skipped
        pytest.fail(f"{path} is not fetched: run `flexoffload models fetch`")
    return load(path)


def shaped(shape: synth.Shape, qtype: str = "Q4_0") -> Model:
    """A tensor table of a llama shape (matrices Q4_0 or F32, norms F32), without writing the file."""
    kv = shape.n_embd // shape.n_head * shape.n_head_kv
    dims = [("token_embd.weight", (shape.n_embd, shape.n_vocab))]
    for i in range(shape.n_layer):
        dims += [(f"blk.{i}.attn_norm.weight", (shape.n_embd,)), (f"blk.{i}.ffn_norm.weight", (shape.n_embd,))]
        dims += [(f"blk.{i}.attn_{x}.weight", (shape.n_embd, n)) for x, n in
                 (("q", shape.n_embd), ("k", kv), ("v", kv), ("output", shape.n_embd))]
        dims += [(f"blk.{i}.ffn_{x}.weight", d) for x, d in
                 (("gate", (shape.n_embd, shape.n_ff)), ("up", (shape.n_embd, shape.n_ff)),
                  ("down", (shape.n_ff, shape.n_embd)))]
    dims += [("output_norm.weight", (shape.n_embd,)), ("output.weight", (shape.n_embd, shape.n_vocab))]
    tensors, offset = [], 0
    for name, d in dims:
        if len(d) == 1 or qtype == "F32":
            ty, n_bytes = "F32", 4 * d[0] * (d[1] if len(d) > 1 else 1)
        else:
            ty, n_bytes = "Q4_0", d[0] * d[1] // 32 * 18
        tensors.append(Tensor(name, *tensor_kind(name), ty, d, n_bytes, offset))
        offset += n_bytes
    return Model(Path("shaped.gguf"), offset, "llama", "shaped", shape.n_layer, shape.n_embd,
                 shape.n_head, shape.n_head_kv, shape.n_ff, shape.n_vocab, shape.n_ctx_train, tensors)


def measured_like(model: Model, tok_s: float) -> Profile:
    """This machine's numbers: 1.2 GB/s O_DIRECT, and the full-memory decode speed."""
    return Profile.calibrated(model, tok_s=tok_s, disk_bw=1.2e9)


def names_of(model, pred):
    return {t.name for t in model.tensors if pred(t)}


def check_plan(model, resident, capacity, window):
    assert memory_for(model, resident, window) <= capacity, "resident + window over capacity"
    assert always_resident(model) <= resident
    names = {t.name for t in model.tensors}
    assert resident <= names


@pytest.mark.parametrize("window", [0, 1, 3])
def test_every_policy_fits_and_keeps_small_tensors(eight, window):
    prof = measured_like(eight, 100.0)
    floor = minimum_budget(eight, window)
    for capacity in range(floor, eight.weight_bytes + (4 << 20), 3 << 20):
        for name, policy in POLICIES.items():
            check_plan(eight, policy(eight, capacity, prof, window, 2), capacity, window)
    with pytest.raises(FlexoffloadError):
        POLICIES["balanced"](eight, floor - 1, prof, window, 2)


@pytest.mark.integration
def test_small_tensors_are_the_norms_biases_and_the_gqa_kv(eight, qwen):
    assert names_of(eight, is_small) == names_of(eight, lambda t: t.kind in ("norm", "attn_k", "attn_v"))
    assert names_of(qwen, is_small) == names_of(qwen, lambda t: t.kind in ("norm", "bias", "attn_k", "attn_v"))


@pytest.mark.integration
def test_token_embd_and_output_stay_unless_forced_and_token_embd_goes_first(qwen):
    """The shared rule (the baselines): both stay while they fit with everything else streamed, token_embd goes
    first. Ours streams token_embd (read by rows: a row a token) whenever something streams: its bytes buy more
    of the layers than the one small read a token costs; and the output too here: read in chunks, it holds two of
    them in window (32 MiB), so streaming it gives its other 151 MiB to the layers."""
    prof, window = measured_like(qwen, 11.4), 3
    pipe = Pipeline(qwen, prof, 4)
    small = always_resident(qwen)
    both = small | {"token_embd.weight", "output.weight"}
    just_output = small | {"output.weight"}
    for name, policy in POLICIES.items():
        if name == "none":  # keeps nothing by definition (Prefetch only / Sync Read)
            continue
        r = policy(qwen, memory_for(qwen, both, window), prof, window, 4)
        if name == "balanced":
            assert "token_embd.weight" not in r
            assert pipe.seconds(r, window) < min(pipe.seconds(POLICIES[p](qwen, memory_for(qwen, both, window), prof,
                                                                          window, 4), window) for p in BASELINES)
        else:
            assert {"token_embd.weight", "output.weight"} <= r, name
        r = policy(qwen, memory_for(qwen, both, window) - 1, prof, window, 4)
        assert "token_embd.weight" not in r, name
        assert ("output.weight" in r) or name == "balanced", name
        r = policy(qwen, memory_for(qwen, just_output, window) - 1, prof, window, 4)
        assert "output.weight" not in r, name
    # all of it fits: nothing streams, token_embd neither
    everything = {t.name for t in qwen.tensors}
    assert POLICIES["balanced"](qwen, qwen.weight_bytes, prof, window, 4) == everything


@pytest.mark.integration
def test_streamed_token_embd_costs_its_rows_not_its_size(qwen):
    """Read by rows: its window memory is a lookup's pages, a decode pass reads one row of it."""
    from flexoffload.plan import costmodel
    from flexoffload.plan import plans

    embd = next(t for t in qwen.tensors if t.name == "token_embd.weight")
    assert costmodel.reads_rows(qwen, embd) and costmodel.row_bytes(embd) == 1536 // 256 * 144  # Q4_K
    window = 1
    everything = {t.name for t in qwen.tensors}
    assert memory_for(qwen, everything - {embd.name}, window) == qwen.weight_bytes - embd.n_bytes \
        + costmodel.ROWS_CHUNK * 2 * costmodel.PAGE
    # the minimum budget no longer holds all of token_embd in the window
    small = always_resident(qwen)
    assert minimum_budget(qwen, window) == memory_for(qwen, small, window)
    assert minimum_budget(qwen, window) < memory_for(qwen, small | {embd.name}, window) - embd.n_bytes // 2
    plan = make_plan(qwen, memory_for(qwen, small, window) + (200 << 20), "balanced", measured_like(qwen, 11.4),
                     window=window)
    assert embd.name in plan.streamed
    assert plans.streamed_bytes(plan, qwen) == sum(t.n_bytes for t in qwen.tensors
                                                   if t.name in plan.streamed and t is not embd) + 864


def fully_resident_kinds(model, resident):
    return {k for k in ATTENTION + FFN if all(t.name in resident for t in model.tensors if t.kind == k)}


@pytest.mark.integration
@pytest.mark.parametrize("window", [1, 3])
def test_flexinfer_follows_algorithm_1(qwen, window):
    prof = measured_like(qwen, 11.4)
    base = always_resident(qwen) | {"token_embd.weight", "output.weight"}
    pool = layer_pool(qwen, base)
    ffn, attention = by_kind(pool, FFN), by_kind(pool, ATTENTION)
    assert [k[0].kind for k in ffn] == ["ffn_gate", "ffn_up", "ffn_down"]  # ffn_down is partly Q6_K: the biggest
    assert [k[0].kind for k in attention] == ["attn_q", "attn_output"]  # K and V are small, hence resident

    def need(*kinds):
        return memory_for(qwen, base | {t.name for kind in kinds for t in kind}, window)

    def plan(capacity):
        return POLICIES["flexinfer"](qwen, capacity, prof, window, 4)

    smallest_kind = {"ffn_gate"} | {"attn_k", "attn_v"}
    # below one FFN kind across all layers: no FFN tensor; attention one by one (smallest kind first, layers in
    # order), each that still fits
    for capacity, some in ((need() + sum(t.n_bytes for t in attention[0]) // 2, True), (need(ffn[0]) - 1, False)):
        r = plan(capacity)
        expected = set(base)
        for t in attention[0] + attention[1]:
            if memory_for(qwen, expected | {t.name}, window) <= capacity:
                expected.add(t.name)
        assert r == expected
        kept = [t.name in r for t in attention[0]]
        assert 0 < sum(kept) < len(kept) if some else all(kept)
        assert kept[:sum(kept) // 2] == [True] * (sum(kept) // 2), "q kept from the first layer on"
    # one FFN kind, then attention
    r = plan(need(ffn[0]))
    assert fully_resident_kinds(qwen, r) >= smallest_kind and "ffn_up" not in fully_resident_kinds(qwen, r)
    # two FFN kinds; with all three but not half the attention: still two, and the rest is left unused
    for capacity in (need(ffn[0], ffn[1]), need(*ffn, attention[0]) - 1):
        r = plan(capacity)
        assert fully_resident_kinds(qwen, r) & set(FFN) == {"ffn_gate", "ffn_up"}
        assert not any(t.name in r for t in ffn[2])
    assert need(*ffn) < need(*ffn, attention[0]) - 1  # the case above really has room for all FFN
    # all FFN and two attention tensors per layer: all FFN, then attention one by one
    r = plan(need(*ffn, attention[0], attention[1]))
    assert fully_resident_kinds(qwen, r) >= set(FFN) | {"attn_q", "attn_output"}


@pytest.mark.parametrize("window", [1, 3])
def test_attn_first_and_ffn_first_keep_their_kinds_first(eight, window):
    prof = measured_like(eight, 100.0)
    base = always_resident(eight) | names_of(eight, lambda t: t.layer is None)
    attention = names_of(eight, lambda t: t.kind in ATTENTION)
    ffn = names_of(eight, lambda t: t.kind in FFN)
    r = POLICIES["attn-first"](eight, memory_for(eight, base | attention, window), prof, window, 2)
    assert attention <= r and not ffn & r
    r = POLICIES["ffn-first"](eight, memory_for(eight, base | ffn, window), prof, window, 2)
    assert ffn <= r and not (attention - always_resident(eight)) & r


@pytest.mark.integration
@pytest.mark.parametrize("window", [0, 3])
def test_layer_keeps_a_prefix_of_whole_layers(qwen, window):
    prof = measured_like(qwen, 11.4)
    floor = minimum_budget(qwen, window)
    layers = [{t.name for t in qwen.layer_tensors(layer)} for layer in range(qwen.n_layer)]
    for i in range(1, 12):
        capacity = floor + (qwen.weight_bytes - floor) * i // 11
        r = POLICIES["layer"](qwen, capacity, prof, window, 4)
        prefix = always_resident(qwen) | {t.name for t in qwen.tensors if t.layer is None and t.name in r}
        for n_whole, layer in enumerate(layers + [None]):
            if layer is None or memory_for(qwen, prefix | layer, window) > capacity:
                break
            prefix |= layer
        whole = [layer <= r for layer in layers]
        assert all(whole[:n_whole]) and (n_whole == qwen.n_layer or not whole[n_whole])
        streamed = [t for t in qwen.tensors if t.name not in r]
        assert all(memory_for(qwen, r | {t.name}, window) > capacity for t in streamed), "memory left unused"
        if i == 6:
            assert 0 < n_whole < qwen.n_layer


def compare(model, prof, window, capacities):
    """Each policy's plan predicted at each capacity. That balanced is no slower than any baseline holds by
    construction (the baselines are among its candidates): checked here only as a sanity check of that."""
    pipe = Pipeline(model, prof, 4)
    for capacity in capacities:
        times = {name: pipe.seconds(policy(model, capacity, prof, window, 4), window)
                 for name, policy in POLICIES.items()}
        for name in BASELINES:
            assert times["balanced"] <= times[name] * (1 + 1e-12), (capacity, name, times)
        yield capacity, times


@pytest.mark.integration
@pytest.mark.parametrize("window", [1, 3])
def test_balanced_beats_whole_layers_and_the_best_baseline_where_reads_and_compute_are_near_even(qwen, window):
    """On the real table, at capacities of 80-95 % of the weights: balanced is predicted over 10 % faster than
    keeping whole layers everywhere, and over 5 % faster than the best of the paper's heuristics somewhere."""
    prof = measured_like(qwen, 11.4)
    floor = minimum_budget(qwen, window)
    capacities = [floor + (qwen.weight_bytes - floor) * i // 11 for i in range(12)]
    results = list(compare(qwen, prof, window, capacities))
    near_even = [times for capacity, times in results if 0.8 * qwen.weight_bytes < capacity < 0.95 * qwen.weight_bytes]
    assert near_even and all(t["balanced"] < 0.9 * t["layer"] for t in near_even)
    assert any(t["balanced"] < 0.95 * min(t[name] for name in BASELINES) for t in near_even)


# 4 layers, F32, 256 wide: only the FFN matrices (1.5 MiB each) are not small; everything else is always resident but
# token_embd (512 KiB), which a policy may stream by rows. So the resident sets are the 2^13 subsets of those: few
# enough to predict every one.
ENUMERABLE = synth.Shape(n_layer=4, n_embd=256, n_ff=1536, n_head=4, n_head_kv=2, n_vocab=512, n_ctx_train=512)
# balanced is a heuristic: at most 3.9 % behind the best set here (window 1, reading the weights taking 2x a token's
# compute, a capacity of 85 % of the weights), and on the best set itself in 30 to 36 of each window's 36 cases
ENUMERATED_TOLERANCE = 0.05


@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_balanced_is_within_5_percent_of_the_best_of_every_resident_set_that_fits(window):
    """Every resident set enumerated (the always-resident tensors and any subset of the FFN matrices and
    token_embd), those whose bytes and window fit the capacity each predicted by the cost model: balanced's plan
    fits and is predicted within ENUMERATED_TOLERANCE of the fastest of them, at capacities from the minimum to all
    the weights, with reading all the weights taking 1x, 2x and 8x a token's compute."""
    model = shaped(ENUMERABLE, "F32")
    free = [t for t in model.tensors if not is_small(t) or t.kind == "token_embd"]
    assert len(free) == 13 and {t.kind for t in free} == set(FFN) | {"token_embd"}
    kept = {t.name for t in model.tensors} - {t.name for t in free}
    sets = [kept | {t.name for i, t in enumerate(free) if mask >> i & 1} for mask in range(1 << len(free))]
    memory = [memory_for(model, r, window) for r in sets]
    floor = minimum_budget(model, window)
    exact = 0
    for disk_vs_compute in (1, 2, 8):
        prof = Profile.calibrated(model, tok_s=100.0, disk_bw=model.weight_bytes * 100.0 / disk_vs_compute)
        pipe = Pipeline(model, prof, 2)
        seconds: dict[int, float] = {}
        for i in range(12):
            capacity = floor + (model.weight_bytes - floor) * i // 11
            fitting = [k for k, m in enumerate(memory) if m <= capacity]
            for k in fitting:
                if k not in seconds:
                    seconds[k] = pipe.seconds(sets[k], window)
            best = min(seconds[k] for k in fitting)
            chosen = POLICIES["balanced"](model, capacity, prof, window, 2)
            assert kept <= chosen and memory_for(model, chosen, window) <= capacity
            got = pipe.seconds(chosen, window)
            assert got <= best * (1 + ENUMERATED_TOLERANCE), (disk_vs_compute, capacity, got / best)
            exact += got <= best * (1 + 1e-9)
    assert exact >= 3 * 12 * 3 // 4  # on the best set itself in most cases


# The 1.5B's tensors a window holds, worked out from its table (Q4_K rows of 1536: 864 bytes; output Q6_K 1536 x
# 151936, 1260-byte rows, 191 MB): the runtime reads a streamed tensor over 16 MiB in row chunks (patch 0007: 16 MiB
# holds 13315 rows, 13312 rounded down to 64; 151936 rows take 12 chunks; 12662 rows each, 12672 rounded up to 64)
# and holds two of them; every other tensor of the 1.5B is under 16 MiB and held whole. A streamed token_embd is read
# by rows: 32 rows at a time (patch 0006), each in the two 4 KiB pages a row of 864 bytes may straddle, outside the
# prefetch ring (its stage is in the ring, holding nothing).
QWEN_OUTPUT_HELD = 2 * 12672 * 1260
QWEN_EMBD_ROW = 1536 // 256 * 144
QWEN_EMBD_ROWS_PAGES = 32 * 2 * 4096


def qwen_window_by_hand(model, resident, window):
    """The 1.5B's prefetch window from its tensor table: the largest sum, over window+1 consecutive stages of the
    runtime's ring (token_embd, the layers, the output head: those that stream; wrapping), of the bytes their
    streamed tensors hold; and the rows' pages of a streamed token_embd."""
    ring = []
    if "token_embd.weight" not in resident:
        ring.append(0)
    for layer in range(model.n_layer):
        streamed = [t for t in model.tensors if t.layer == layer and t.name not in resident]
        if streamed:
            ring.append(sum(t.n_bytes for t in streamed))
    if "output.weight" not in resident:
        ring.append(QWEN_OUTPUT_HELD)
    span = min(window + 1, len(ring))
    held = max((sum(ring[(i + j) % len(ring)] for j in range(span)) for i in range(len(ring))), default=0)
    return held + (QWEN_EMBD_ROWS_PAGES if "token_embd.weight" not in resident else 0)


@pytest.mark.integration
def test_make_plan_accounts_the_whole_budget(qwen):
    """Every policy's plan keeps within the budget, its parts the KV cache, compute and overhead given and the window
    its streamed tensors hold (worked out from the 1.5B's table); its roofline is the profile's 11.4 tok/s in memory
    or the bytes that cannot be in memory at the best disk bandwidth the device has shown (the profile's peak)."""
    peak_disk_bw = 2.4e9  # above the profile's 1.2 GB/s
    prof = replace(measured_like(qwen, 11.4), peak_disk_bw=peak_disk_bw)
    embd = next(t for t in qwen.tensors if t.name == "token_embd.weight")
    extra = dict(kv_cache=28 << 20, compute=60 << 20, overhead=40 << 20)
    floor = minimum_budget(qwen, 3, **extra)
    assert floor == minimum_budget(qwen, 3) + (128 << 20)
    with pytest.raises(FlexoffloadError, match="too small.*the minimum is"):
        make_plan(qwen, floor - 1, "balanced", prof, window=3, **extra)
    with pytest.raises(FlexoffloadError, match="unknown policy"):
        make_plan(qwen, floor, "random", prof, **extra)
    for budget in (floor, int(qwen.file_size * 0.7), qwen.file_size):
        capacity = budget - (128 << 20)
        # what cannot be in memory: all but the capacity, a looked-up token_embd's rows but one aside
        missing = qwen.weight_bytes - (embd.n_bytes - QWEN_EMBD_ROW) - capacity
        for policy in POLICIES:
            p = make_plan(qwen, budget, policy, prof, window=3, **extra)
            assert p.memory.total <= budget and p.memory.kv_cache == 28 << 20 and p.window == 3
            assert set(p.resident) | set(p.streamed) == {t.name for t in qwen.tensors}
            assert not set(p.resident) & set(p.streamed)
            assert p.memory.window == qwen_window_by_hand(qwen, set(p.resident), 3), policy
            # the roofline's disk: the best this device has shown, where above the profile's
            assert p.roofline_tok_s == pytest.approx(min(11.4, peak_disk_bw / missing) if missing > 0 else 11.4)
            assert p.roofline_tok_s >= (min(11.4, 1.2e9 / missing) if missing > 0 else 11.4) - 1e-9
            assert p.predicted_tok_s <= p.roofline_tok_s


@pytest.mark.integration
def test_make_plan_chooses_the_window(qwen):
    prof = measured_like(qwen, 11.4)
    # below what window 1 needs, only synchronous reading (window 0) runs
    sync_only = minimum_budget(qwen, 1) - 1
    assert minimum_budget(qwen) == minimum_budget(qwen, 0) <= sync_only
    assert make_plan(qwen, sync_only, "layer", prof).window == 0
    for fraction in (0.5, 0.9):
        budget = int(qwen.file_size * fraction)
        fixed = {w: make_plan(qwen, budget, "flexinfer", prof, window=w).predicted_tok_s for w in range(5)}
        chosen = make_plan(qwen, budget, "flexinfer", prof)
        assert chosen.predicted_tok_s == max(fixed.values()) and fixed[chosen.window] == chosen.predicted_tok_s


@pytest.mark.integration
def test_a_streamed_output_holds_two_chunks_not_itself(qwen):
    """The output matrix (183 MiB) is read in 12 chunks of 15 MiB, two in flight: streamed, it costs 30 MiB of
    window instead of itself, so the minimum budget of the 1.5B drops by some 150 MiB and 0.3x of it plans, with
    everything streamed but the small tensors."""
    from flexoffload.plan import costmodel
    from flexoffload.plan.planners import plan_budget

    out = next(t for t in qwen.tensors if t.name == "output.weight")
    assert costmodel.read_requests(out) == 12 and costmodel.held_bytes(out) < out.n_bytes / 5
    small = always_resident(qwen)
    whole = Pipeline(qwen, chunk_bytes=0)
    for window in range(4):
        # the output's stage set the window; now window+1 layers (~30 MiB each) or the output's 30 MiB beside them
        assert whole.window_bytes(small, window) - Pipeline(qwen).window_bytes(small, window) > 140 << 20
    assert minimum_budget(qwen, 0) < memory_for(qwen, small | {out.name}, 0)
    prof = measured_like(qwen, 11.4)
    budget = int(0.3 * qwen.file_size)
    p = plan_budget(qwen, budget, "balanced", prof, probe.measure(qwen, 2048, 512))
    assert p.memory.total <= budget and out.name in p.streamed
    assert p.memory.window == Pipeline(qwen).window_bytes(set(p.resident), p.window) < 64 << 20
    # the ledger a policy fills keeps the same account as the pipeline
    from flexoffload.plan.planners.common import base

    ledger = base(qwen, memory_for(qwen, small, 1) + (100 << 20), 1)
    assert out.name not in ledger.resident
    ledger._refresh()
    assert ledger.used + ledger.window_bytes == memory_for(qwen, ledger.resident, 1)


@pytest.mark.integration
def test_balanced_streams_a_keepable_output_only_by_a_margin(qwen, monkeypatch):
    """Where the budget could keep the output, balanced streams it only if the cost model predicts that
    OUTPUT_MARGIN faster than its best plan keeping it (streamed, it measured slower than predicted)."""
    from flexoffload.plan.planners import balanced

    prof, window = measured_like(qwen, 22.4), 1  # compute as measured here on 2026-11-23
    pipe = Pipeline(qwen, prof, 4)
    for share in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        capacity = int(qwen.weight_bytes * share)
        chosen = balanced.plan(qwen, capacity, prof, window, 4)
        monkeypatch.setattr(balanced, "OUTPUT_MARGIN", -0.99)  # any streamed-output plan wins
        streamed = balanced.plan(qwen, capacity, prof, window, 4)
        monkeypatch.setattr(balanced, "OUTPUT_MARGIN", 10.0)  # none does
        kept = balanced.plan(qwen, capacity, prof, window, 4)
        monkeypatch.undo()
        assert "output.weight" not in streamed and "output.weight" in kept
        gain = pipe.seconds(kept, window) / pipe.seconds(streamed, window) - 1
        assert chosen == (streamed if gain > balanced.OUTPUT_MARGIN else kept), share


def test_the_policy_names_are_the_planners():
    from flexoffload import defaults
    from flexoffload.plan import planners

    assert set(planners.POLICIES) == set(defaults.POLICIES) | {"none"}

import math
import random

import pytest

from flexoffload.plan import costmodel
from flexoffload.gguf import synth
from flexoffload.plan.costmodel import Pipeline, Profile, window_bytes_of
from flexoffload.plan.pipeline import Stage, simulate
from flexoffload.gguf.model import load
from flexoffload.plan.planners import always_resident

# 8 layers, F32: attn_q/attn_output 1 MiB, attn_k/v 256 KiB (small), FFN 3 MiB each, token_embd/output 2 MiB
SHAPE = synth.Shape(n_layer=8, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "eight.gguf", SHAPE, "F32"))


def disk_bound(model) -> Profile:
    """Reading the whole model takes ~8x its compute."""
    return Profile.calibrated(model, tok_s=100.0, disk_bw=model.weight_bytes * 100 / 8)


def compute_bound(model) -> Profile:
    """Reading the whole model takes ~1/4 of its compute."""
    return Profile.calibrated(model, tok_s=100.0, disk_bw=model.weight_bytes * 100 * 4)


def stages(reads, computes):
    return [Stage(f"s{i}", c, r, int(r * 1000), 1 if r else 0) for i, (r, c) in enumerate(zip(reads, computes))]


@pytest.mark.parametrize("window,period", [(0, 7.0), (1, 4.0), (3, 4.0)])
def test_simulation_by_hand(window, period):
    # A and C read 2 and compute 1, B (resident) computes 1. Window 0: every read when compute needs it (2+1+1+2+1).
    # Window 1: the runtime's ring is A, C (B streams nothing): C is queued when compute reaches A, the next A when
    # it reaches C, so the disk never waits: 4, the reads' time. A bigger window changes nothing.
    p = simulate(stages([2.0, 0.0, 2.0], [1.0, 1.0, 1.0]), window)
    assert p.seconds_per_token == pytest.approx(period)
    assert [s.stage.name for s in p.stages] == ["s0", "s1", "s2"]
    assert p.stages[-1].compute_end == pytest.approx(period)  # relative to the previous token's end


def test_one_streaming_stage_reads_on_demand():
    # a ring of one group: the runtime caps the window at 0, so A is read when compute reaches it (2+1+1)
    for window in (0, 1, 5):
        assert simulate(stages([2.0, 0.0], [1.0, 1.0]), window).seconds_per_token == pytest.approx(4.0)


def test_simulation_is_max_plus_steady_state():
    # random pipelines: the steady time lies between the two obvious bounds, and window 0 is their sum
    rng = random.Random(1)
    for _ in range(50):
        n = rng.randint(1, 12)
        reads = [rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(n)]
        computes = [rng.uniform(0.1, 2) for _ in range(n)]
        st = stages(reads, computes)
        assert simulate(st, 0).seconds_per_token == pytest.approx(sum(reads) + sum(computes))
        times = [simulate(st, w).seconds_per_token for w in range(0, n + 2)]
        assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), "a bigger window is never slower"
        assert min(times) >= max(sum(reads), sum(computes)) * (1 - 1e-12)
        # the runtime's window spans at most the other streaming stages: a bigger one changes nothing
        ring = sum(1 for r in reads if r)
        assert times[max(ring - 1, 0):] == pytest.approx([times[-1]] * (len(times) - max(ring - 1, 0)))
        if ring == n and n > 1 and max(reads) <= min(computes):
            # each read is queued as compute reaches the next stage, and done before that stage's compute is
            assert times[-1] == pytest.approx(sum(computes))


def test_all_resident_is_compute_bound(model):
    prof = disk_bound(model)
    everything = {t.name for t in model.tensors}
    for window in (0, 1, 3):
        p = costmodel.predict(model, everything, prof, window, io_threads=4)
        assert p.seconds_per_token == pytest.approx(costmodel.compute_seconds(model, prof))
        assert p.read_s == 0 and all(s.stall_s == 0 for s in p.stages)
    assert costmodel.compute_seconds(model, prof) == pytest.approx(1 / 100.0)  # the calibration


@pytest.mark.parametrize("profile", [disk_bound, compute_bound])
def test_nothing_resident_with_a_huge_window_overlaps_fully(model, profile):
    prof = profile(model)
    small = always_resident(model)
    p = costmodel.predict(model, small, prof, window=100, io_threads=4)
    # token_embd is read by rows, when compute needs them: not prefetched
    streamed = sum(t.n_bytes for t in model.tensors if t.name not in small and t.kind != "token_embd")
    assert p.read_s >= streamed / prof.disk_bw
    assert p.seconds_per_token == pytest.approx(max(p.compute_s, p.read_s))
    # the stages: token_embd and the output head stream, so they are stages of their own
    assert [s.stage.name for s in p.stages] == ["token_embd"] + [f"blk.{i}" for i in range(8)] + ["output"]


def test_sync_is_formula_3_and_never_faster(model):
    prof = disk_bound(model)
    rng = random.Random(2)
    names = [t.name for t in model.tensors]
    for _ in range(10):
        resident = always_resident(model) | set(rng.sample(names, rng.randint(0, len(names))))
        sync = costmodel.predict(model, resident, prof, 0, io_threads=2)
        assert sync.seconds_per_token == pytest.approx(sync.compute_s + sync.read_s)
        for window in (1, 2, 3, 8):
            assert costmodel.predict(model, resident, prof, window, 2).seconds_per_token <= \
                sync.seconds_per_token * (1 + 1e-12)


@pytest.mark.parametrize("profile", [disk_bound, compute_bound])
def test_more_resident_never_predicts_slower(model, profile):
    prof = profile(model)
    pipe = Pipeline(model, prof, io_threads=2)
    rng = random.Random(3)
    for window in (0, 1, 2, 3, 20):
        resident = set(always_resident(model))
        order = [t.name for t in model.tensors if t.name not in resident]
        rng.shuffle(order)
        before, ring = pipe.seconds(resident, window), len([s for s in pipe.stages(resident) if s.n_streamed])
        for name in order:
            resident.add(name)
            now = pipe.seconds(resident, window)
            # while as many stages stream; one that stops streaming leaves the runtime's ring, which can
            # shorten the window (a ring of one stage is read on demand: test_one_streaming_stage_reads_on_demand)
            if len([s for s in pipe.stages(resident) if s.n_streamed]) == ring:
                assert now <= before * (1 + 1e-12), f"making {name} resident slowed window {window}"
            before, ring = now, len([s for s in pipe.stages(resident) if s.n_streamed])


def test_the_head_is_a_stage_only_when_it_streams(model):
    pipe = Pipeline(model, disk_bound(model), 1)
    everything = {t.name for t in model.tensors}
    names = [s.name for s in pipe.stages(everything)]
    assert names == [f"blk.{i}" for i in range(8)]
    assert [s.name for s in pipe.stages(everything - {"output.weight"})][-1] == "output"
    assert [s.name for s in pipe.stages(everything - {"token_embd.weight"})][0] == "token_embd"
    # its compute moves, it does not vanish
    assert sum(s.compute_s for s in pipe.stages(everything)) == pytest.approx(
        sum(s.compute_s for s in pipe.stages(everything - {"output.weight"})))


def test_latency_is_overlapped_across_io_threads(model):
    prof = Profile(disk_bw=1e9, io_latency=1e-3)
    assert prof.read_seconds(0, 0, 4) == 0
    assert prof.read_seconds(10**9, 5, 4) == pytest.approx(1 + 2e-3)
    assert prof.read_seconds(10**9, 4, 4) == pytest.approx(1 + 1e-3)
    small = always_resident(model)
    one, four = (costmodel.predict(model, small, prof, 0, n).read_s for n in (1, 4))
    assert one > four


def test_window_bytes_is_the_largest_run_of_window_plus_one_stages(model):
    rng = random.Random(4)
    for _ in range(100):
        streamed = [rng.randint(0, 100) for _ in range(rng.randint(1, 10))]
        window = rng.randint(0, 12)
        n, span = len(streamed), window + 1
        runs = [sum(streamed[(i + j) % n] for j in range(min(span, n))) for i in range(n)]
        assert window_bytes_of(streamed, window) == max(runs)
    small = always_resident(model)
    sizes = {t.name: t.n_bytes for t in model.tensors}
    layer = sum(t.n_bytes for t in model.tensors if t.layer == 0 and t.name not in small)
    everything_but_layers = {t.name for t in model.tensors if t.layer is None} | small
    assert costmodel.window_bytes(model, everything_but_layers, 0) == layer
    assert costmodel.window_bytes(model, everything_but_layers, 2) == 3 * layer
    # streamed token_embd and output sit next to each other in the ring (the window wraps to the next token); the
    # output (2 MiB: not larger than a chunk) takes a buffer as big as itself, token_embd only the pages of the rows
    # a lookup reads, besides
    head = {"token_embd.weight", "output.weight"}
    everything_but_head = {t.name for t in model.tensors} - head
    embd = next(t for t in model.tensors if t.name == "token_embd.weight")
    rows = costmodel.rows_memory(embd)
    assert rows == costmodel.ROWS_CHUNK * 2 * costmodel.PAGE < sizes["token_embd.weight"]  # 2 KiB rows
    for window in (0, 1, 3):
        assert costmodel.window_bytes(model, everything_but_head, window) == sizes["output.weight"] + rows
        assert costmodel.window_bytes(model, everything_but_head | {"output.weight"}, window) == rows


def test_chunks_split_as_the_runtime_does():
    """As patch 0007 splits: as few chunks of at most the chunk size as will do, about equal, whole rows, a multiple
    of 64 rows when a chunk holds 64; a tensor not larger than a chunk (or not 2-D, or chunking off) is whole."""
    from flexoffload.gguf.model import Tensor

    # the real 1.5B's output: 151936 rows of 1536 Q6_K (1260 bytes a row), 183 MiB
    out = Tensor("output.weight", "output", None, "Q6_K", (1536, 151936), 151936 * 1260, 0)
    assert costmodel.CHUNK_BYTES == 16 << 20 and costmodel.CHUNKS_IN_FLIGHT == 2
    # at most 13315 rows fit 16 MiB, 13312 in 64s: 12 chunks of 12672 rows (15.2 MiB), the last 12544
    assert costmodel.chunk_rows(out) == 12672 and costmodel.read_requests(out) == 12
    assert 11 * 12672 < 151936 <= 12 * 12672 and 12672 * 1260 <= costmodel.CHUNK_BYTES
    assert costmodel.held_bytes(out) == 2 * 12672 * 1260  # 30.5 MiB instead of 183
    # small chunks: fewer than 64 rows are not rounded
    assert costmodel.chunk_rows(out, 50 * 1260) == 50 and costmodel.read_requests(out, 50 * 1260) == 3039
    assert costmodel.chunk_rows(out, 100 * 1260) == 64  # 100 rows fit: 64 of them
    # a tensor of two chunks holds both
    two = Tensor("blk.0.ffn_down.weight", "ffn_down", 0, "Q4_0", (8960, 1536), 1536 * 5040, 0)
    assert costmodel.read_requests(two, two.n_bytes - 1) == 2
    assert costmodel.held_bytes(two, two.n_bytes - 1) == 2 * 768 * 5040 == two.n_bytes
    for chunk in (0, out.n_bytes, out.n_bytes + 1):
        assert costmodel.chunk_rows(out, chunk) is None and costmodel.read_requests(out, chunk) == 1
        assert costmodel.held_bytes(out, chunk) == out.n_bytes
    vec = Tensor("output_norm.weight", "norm", None, "F32", (1 << 23,), 1 << 25, 0)
    assert costmodel.chunk_rows(vec) is None


def test_a_chunked_tensor_holds_its_chunks_in_flight_and_reads_all(model):
    """With chunks of 512 KiB the 2 MiB output holds two of them in window, and still reads all of itself a pass in
    four requests."""
    prof = disk_bound(model)
    pipe, whole = Pipeline(model, prof, 4, chunk_bytes=512 << 10), Pipeline(model, prof, 4, chunk_bytes=0)
    sizes = {t.name: t.n_bytes for t in model.tensors}
    embd = next(t for t in model.tensors if t.name == "token_embd.weight")
    rows = costmodel.rows_memory(embd)
    everything_but_head = {t.name for t in model.tensors} - {"token_embd.weight", "output.weight"}
    for window in (0, 1, 3):
        assert pipe.window_bytes(everything_but_head, window) == (1 << 20) + rows
        assert whole.window_bytes(everything_but_head, window) == sizes["output.weight"] + rows
    head = [s for s in pipe.stages(everything_but_head) if s.name == "output"][0]
    assert head.streamed_bytes == sizes["output.weight"] and head.held_bytes == 1 << 20
    # the two chunks it holds are read ahead; the other two only while it computes, one as one before is done
    half = sizes["output.weight"] // 2
    assert head.read_s == pytest.approx(prof.read_seconds(half, 2, 4))
    assert head.late_read_s == pytest.approx(prof.read_seconds(half, 2, 2))
    assert pipe.predict(everything_but_head, 1).read_s == pytest.approx(
        sum(s.read_s + s.late_read_s for s in pipe.stages(everything_but_head)))
    # everything streamed: gate and up (3 MiB, 1536 rows of 2 KiB) hold two chunks of 256 rows, down (512 rows of
    # 6 KiB) two of 64, attention q and output (1 MiB) two halves: all of them
    small = always_resident(model)
    layer = sum(t.n_bytes for t in model.tensors if t.layer == 0 and t.name not in small)
    assert pipe.window_bytes(small, 0) == layer - 3 * (3 << 20) + 2 * (1 << 20) + 2 * 64 * 6144 + rows
    assert whole.window_bytes(small, 0) == layer + rows
    # what a pass reads does not change
    assert [s.streamed_bytes for s in pipe.stages(small)] == [s.streamed_bytes for s in whole.stages(small)]


def test_roofline(model):
    prof = disk_bound(model)
    w = model.weight_bytes
    compute = costmodel.compute_seconds(model, prof)
    assert costmodel.roofline(model, prof, w) == pytest.approx(1 / compute)
    # token_embd can stream for a row a token: all but that row is not missing
    embd = next(t for t in model.tensors if t.kind == "token_embd")
    missing = w - (embd.n_bytes - costmodel.row_bytes(embd)) - w // 2
    assert costmodel.roofline(model, prof, w // 2) == pytest.approx(prof.disk_bw / missing)
    # no resident set beats it
    rng = random.Random(5)
    for _ in range(20):
        resident = set(rng.sample([t.name for t in model.tensors], rng.randint(0, len(model.tensors))))
        held = sum(t.n_bytes for t in model.tensors if t.name in resident)
        p = costmodel.predict(model, resident, prof, rng.randint(0, 4), 4)
        assert p.tok_s <= costmodel.roofline(model, prof, held) * (1 + 1e-9)


def test_breakdown_adds_up(model):
    prof = disk_bound(model)
    resident = always_resident(model) | {t.name for t in model.tensors if t.kind == "ffn_down"}
    p = costmodel.predict(model, resident, prof, 2, 4)
    for s in p.stages:
        assert s.read_end - s.read_start == pytest.approx(s.stage.read_s)
        assert s.compute_end - s.compute_start == pytest.approx(s.stage.compute_s)
        assert s.compute_start >= s.read_end - 1e-12 and s.stall_s >= 0
    # the streamed token_embd's row is read when compute needs it: its read is compute's time
    embd = next(t for t in model.tensors if t.kind == "token_embd")
    row_read = prof.read_seconds(costmodel.row_bytes(embd), 1, 1)
    assert p.stages[0].stage.name == "token_embd" and p.stages[0].stage.read_s == 0
    assert p.compute_s == pytest.approx(costmodel.compute_seconds(model, prof) + row_read)
    assert p.stages[-1].compute_end == pytest.approx(p.seconds_per_token)


def test_profile_round_trips_and_types_cost_their_own():
    prof = Profile(disk_bw=1e9, sec_per_byte={"Q6_K": 2e-10}, default_sec_per_byte=1e-10)
    assert Profile.from_dict(prof.to_dict()) == prof
    assert math.isclose(prof.seconds_per_byte("Q6_K"), 2e-10) and math.isclose(prof.seconds_per_byte("Q4_0"), 1e-10)


def test_late_reads_are_not_hidden_behind_other_stages():
    """A stage's late reads start with its compute: a big window hides its ahead read behind the other stages'
    compute, never its late one, and the disk reads nothing else meanwhile."""
    computes = [1.0, 1.0, 1.0]
    # s0 streams a row-read tensor (no read ahead): the ring is s0, s2, so s2 is queued when compute reaches s0
    ahead = [Stage("s0", 1.0, 0.0, 0, 1), Stage("s1", 1.0, 0.0, 0, 0), Stage("s2", 1.0, 2.0, 2000, 1)]
    late = ahead[:2] + [Stage("s2", 1.0, 0.0, 2000, 1, 0, 2.0)]
    assert simulate(ahead, 2).seconds_per_token == pytest.approx(sum(computes))
    assert simulate(late, 2).seconds_per_token == pytest.approx(sum(computes) + 1.0)  # max(compute, late) for s2
    p = simulate(late, 2)
    s2 = p.stages[2]
    assert s2.read_end == pytest.approx(s2.compute_start + 2.0) and s2.compute_end == pytest.approx(s2.read_end)


# tied embeddings (no output.weight): token_embd F32 of 1024 x 16384 rows = 64 MiB, 4 chunks at the 16 MiB default
TIED = synth.Shape(n_layer=2, n_embd=1024, n_ff=1024, n_head=8, n_head_kv=2, n_vocab=16384, n_ctx_train=512,
                   arch="qwen2", tied_embeddings=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "tied.gguf", TIED, "F32"))


def test_a_streamed_tied_token_embd_is_looked_up_by_rows_and_read_by_chunks_for_the_output(tied):
    """Its lookup reads a row in stage 0 (no window); the output's matmul reads all of it in the head, holding two
    chunks of window, as an output matrix would."""
    embd = next(t for t in tied.tensors if t.kind == "token_embd")
    assert tied.tied_embeddings and costmodel.chunk_rows(embd) is not None
    pipe = Pipeline(tied, disk_bound(tied))
    layers = always_resident(tied) | {t.name for t in tied.tensors if t.layer is not None}  # resident; embd streams
    by_name = {s.name: s for s in pipe.stages(layers)}
    assert by_name["token_embd"].streamed_bytes == 0 and by_name["token_embd"].n_streamed == 1
    head = by_name["output"]
    assert head.streamed_bytes == embd.n_bytes
    assert head.held_bytes == costmodel.held_bytes(embd) < embd.n_bytes and head.late_read_s > 0
    # resident: no stage of its own, nothing read for it
    kept = pipe.stages(layers | {embd.name})
    assert [s.name for s in kept] == [f"blk.{i}" for i in range(2)]
    assert pipe.window_bytes(layers, 0) == costmodel.held_bytes(embd) + costmodel.rows_memory(embd)
    # the roofline does not count it as missing only by a row: the output reads it all
    assert costmodel.roofline(tied, disk_bound(tied), tied.weight_bytes - embd.n_bytes) < \
        costmodel.roofline(tied, disk_bound(tied), tied.weight_bytes)


def test_planners_may_stream_a_tied_token_embd_and_count_what_it_holds(tied):
    from flexoffload.plan.planners import make_plan, minimum_budget

    embd = next(t for t in tied.tensors if t.kind == "token_embd")
    low = minimum_budget(tied, 1)
    small = sum(t.n_bytes for t in tied.tensors if t.name in always_resident(tied))
    assert low < small + embd.n_bytes  # it need not stay
    plan = make_plan(tied, low, "balanced", disk_bound(tied), window=1)
    assert embd.name in plan.streamed and plan.memory.total <= low
    roomy = make_plan(tied, tied.weight_bytes * 2, "balanced", disk_bound(tied))
    assert embd.name in roomy.resident and not roomy.streamed


def test_mmap_is_compute_bound_where_the_page_cache_holds_a_token_and_reads_it_all_again_where_not(model, tied):
    prof = disk_bound(model)
    embd = next(t for t in model.tensors if t.kind == "token_embd")
    touched = costmodel.mmap_touched(model)
    assert touched == model.weight_bytes - embd.n_bytes + costmodel.row_bytes(embd)  # a lookup touches a row
    assert costmodel.mmap_touched(tied) == tied.weight_bytes  # the tied output's matmul touches all of it
    compute = costmodel.compute_seconds(model, prof)
    assert costmodel.mmap_seconds(model, prof, touched) == pytest.approx(compute)
    assert costmodel.mmap_seconds(model, prof, touched - 1) == pytest.approx(compute + touched / prof.disk_bw)
    # where it does not fit, streaming everything but the small tensors with a window is predicted faster
    small = always_resident(model)
    for window in (1, 3):
        assert costmodel.predict(model, small, prof, window, 1).seconds_per_token < \
            costmodel.mmap_seconds(model, prof, touched - 1)

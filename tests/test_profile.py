"""The disk profile reads as the streaming runtime does."""

import json

import pytest

from flexoffload.plan import costmodel
from flexoffload.measure import profiler
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.plan.planners import is_small

# 8 layers, F32: attn_q/attn_output 1 MiB, FFN 3 MiB each, token_embd/output 2 MiB; attn_k/v 256 KiB (small)
SHAPE = synth.Shape(n_layer=8, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "eight.gguf", SHAPE, "F32"))


def test_pass_requests_cover_every_streamable_tensor_aligned(model):
    chunk = 512 << 10  # the 2 MiB output then reads in four chunks, as the runtime would
    requests = profiler.pass_requests(model, max_bytes=1 << 30, chunk_bytes=chunk)
    assert all(off % profiler.ALIGN == 0 and n % profiler.ALIGN == 0 and off + n < model.file_size + profiler.ALIGN
               for off, n in requests)
    matmul = [t for t in model.tensors if t.kind in costmodel.MATMUL_KINDS and not is_small(t)]
    assert {t.kind for t in matmul} == {"attn_q", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"}
    for t in matmul:  # every byte of every tensor a matmul reads is in a request
        covered = [(off, n) for off, n in requests if off < t.offset + t.n_bytes and t.offset < off + n]
        assert covered and min(o for o, _ in covered) <= t.offset
        assert max(o + n for o, n in covered) >= t.offset + t.n_bytes
        assert len(covered) >= costmodel.read_requests(t, chunk)
    output = next(t for t in model.tensors if t.kind == "output")
    inside = [n for off, n in requests if output.offset <= off < output.offset + output.n_bytes]
    assert len(inside) >= 3 and max(inside) <= chunk + 2 * profiler.ALIGN
    # small tensors (resident in every plan) and token_embd (read by rows) are not read
    for t in model.tensors:
        if is_small(t) and t.n_bytes > 2 * profiler.ALIGN:
            assert not any(t.offset + profiler.ALIGN <= off < t.offset + t.n_bytes - profiler.ALIGN for off, _ in requests)
    embd = next(t for t in model.tensors if t.kind == "token_embd")
    assert not any(embd.offset + profiler.ALIGN <= off < embd.offset + embd.n_bytes - profiler.ALIGN
                   for off, _ in requests)


def test_pass_requests_sample_the_file_within_max_bytes(model):
    everything = profiler.pass_requests(model, max_bytes=1 << 30)
    some = profiler.pass_requests(model, max_bytes=sum(n for _, n in everything) // 3)
    assert 0 < sum(n for _, n in some) < sum(n for _, n in everything)
    assert max(off for off, _ in some) > model.file_size // 2  # spread over the file, not its start


def test_disk_speed_measures_the_file(model, tiny_model):
    disk = profiler.disk_speed(model, passes=2)
    assert disk.bandwidth > 1e6 and 0 < disk.latency < 1
    tiny = load(tiny_model)  # every tensor small: it reads them all the same
    assert len(profiler.pass_requests(tiny, 1 << 30)) == sum(t.kind in costmodel.MATMUL_KINDS for t in tiny.tensors)
    assert profiler.disk_speed(tiny, passes=1).bandwidth > 0


def test_the_best_bandwidth_is_kept_per_device_and_only_raised(tmp_path, monkeypatch):
    """The roofline's disk figure: the best a profile pass or a run has shown on the model's device."""
    from dataclasses import replace

    from flexoffload.plan import planners
    from flexoffload.plan.costmodel import Profile

    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    assert profiler.best_disk_bw(f) == 0.0
    profiler.record_disk_bw(f, 1.5e9, "profile")
    profiler.record_disk_bw(f, 1.2e9, "run")  # lower: kept as it was
    assert profiler.best_disk_bw(f) == 1.5e9
    profiler.record_disk_bw(f, 2.1e9, "run")
    assert profiler.best_disk_bw(f) == 2.1e9
    assert profiler.best_disk_bw(tmp_path / "missing.gguf") == 0.0

    # a profile carries the device's best (measure sets it from best_disk_bw); the roofline's is the higher
    slow = Profile(disk_bw=1.0e9, peak_disk_bw=profiler.best_disk_bw(f))
    assert planners.ceiling(slow) == replace(slow, disk_bw=2.1e9)
    assert planners.ceiling(Profile(disk_bw=3e9, peak_disk_bw=profiler.best_disk_bw(f))).disk_bw == 3e9


def _timings(gb_s: float, stall_share: float, n_bytes: int = 1 << 30, buffered: int = 0) -> dict:
    """A streamed run's timings (engine.stream_timings' keys) that read n_bytes at gb_s, compute waiting
    stall_share of the time."""
    return {"stream_bytes_read": n_bytes, "stream_reads": 100, "stream_direct": 100 - buffered,
            "stream_read_gb_s": gb_s, "stream_stall_s": stall_share * n_bytes / (gb_s * 1e9)}


def test_runs_the_disk_paced_set_the_bandwidth_plans_predict_with(tmp_path, monkeypatch):
    """This disk drifts over minutes: a profile's passes are one sample, the recent runs that waited on the disk
    are the rest, and plans predict with their median. A run that mostly computed, a speculative run (its disk
    idles while the draft drafts), one that does not read ahead, a short one and one read through the page cache
    say nothing of the disk."""
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    assert profiler.typical_disk_bw(f, 3e9) == 3e9
    profiler.record_run(f, _timings(1.0, 0.05))  # compute-bound
    profiler.record_run(f, _timings(1.0, 0.9), typical=False)  # speculative, or window 0
    profiler.record_run(f, _timings(1.0, 0.9, n_bytes=profiler.SUSTAINED_BYTES - 1))
    profiler.record_run(f, _timings(1.0, 0.9, buffered=1))
    assert profiler.seen_disk_bw(f) == []
    assert profiler.best_disk_bw(f) == 1e9  # the ceiling: any long O_DIRECT run, alone or not
    for gb_s in (2.0, 1.8, 1.9):
        profiler.record_run(f, _timings(gb_s, 0.5))
    assert profiler.seen_disk_bw(f) == pytest.approx([2.0e9, 1.8e9, 1.9e9])
    assert profiler.typical_disk_bw(f, 3e9) == pytest.approx(1.95e9)  # median of 3.0, 2.0, 1.9, 1.8
    for i in range(profiler.SEEN_KEEP):
        profiler.record_run(f, _timings(1.0 + i / 100, 0.5))
    assert profiler.seen_disk_bw(f)[0] == pytest.approx(1.0e9)  # the oldest go
    assert len(profiler.seen_disk_bw(f)) == profiler.SEEN_KEEP


def test_a_profile_plans_with_the_typical_bandwidth(tiny_model, tmp_path, monkeypatch):
    """The profile's own measure stays in its cache; what planning gets is the median with the runs since."""
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))
    m = load(tiny_model)
    measured = profiler.measure(m, 1).disk_bw
    for _ in range(2):
        profiler.record_run(tiny_model, _timings(measured / 4e9, 0.5))
    assert profiler.measure(m, 1).disk_bw == pytest.approx(measured / 4)
    assert json.loads(profiler._cache_path(m, 1).read_text())["disk_bw"] == measured


def test_a_compute_speed_measured_beside_other_work_says_so(model, caplog):
    """Measured on a busy machine the in-memory speed is low, and every plan's prediction with it: the measure
    warns (it happened: a 17 GB MoE's profile measured beside another run said 1.6 tok/s against 9 quiet)."""
    import subprocess
    import sys

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        with caplog.at_level("WARNING", logger=profiler.log.name):
            assert profiler.compute_speed(model.path, 2, n_tokens=64) > 0
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert any("busy" in r.getMessage() and "--remeasure" in r.getMessage() for r in caplog.records)

"""The rate a mixture of experts' expert reads met, recorded by the runs they set the pace of (measure/diskrecord.py,
record_expert_run) and planned with (profiler.measure: typical_expert_bw, the median of the profile's bursts and the
recent runs'), as the dense disk record is (issue 53, item 5). Each test has a cache of its own (private_cache): the
records are per device, and the session's plans on this disk must not see these."""

import dataclasses
import json

import pytest
from conftest import set_profile

from flexoffload import api
from flexoffload.defaults import write_atomic
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import diskrecord, probe, profiler
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.planners import run_minimum

# expert slices of 216 KiB (above the size that always stays resident), so a plan streams them by expert
SHAPE = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_embd=512, n_ff_expert=256, n_vocab=4096)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("moe") / "qwen3moe-streamed.gguf", SHAPE))


def _request(m, **kw) -> api.Request:
    mem = run_minimum(m, probe.measure(m, 256, 32))  # the least it runs in: every expert tensor streamed
    return api.Request(model=str(m.path), prompt="a b c d", n_predict=24, temp=0, n_ctx=256, n_batch=32,
                       n_threads=1, mem=str(mem), strategy="stream", expert_slots=0, expert_reads="routed", **kw)


def _timings(rate: float = 1e9, stall_share: float = 0.5, n_bytes: int = 1 << 30, **kw) -> dict:
    """A MoE run's timings whose expert reads (all it read) met rate over its waits, compute waiting stall_share
    of its time, which is twice its waits."""
    stall = n_bytes / rate
    elapsed = stall / stall_share
    return {"stream_bytes_read": n_bytes, "stream_reads": 900, "stream_direct": 900, "stream_stall_s": stall,
            "stream_read_gb_s": n_bytes / elapsed / 1e9, "expert_uses": 4000, "expert_bytes_read": n_bytes,
            "expert_ahead": 0, "expert_predicted": 0, **kw}


def test_a_streamed_moe_run_records_the_rate_its_expert_reads_met(moe, private_cache, monkeypatch):
    """A tiny model reads far less than a rate worth keeping (EXPERT_BYTES), and whether compute waited on it for a
    fifth of its time is the moment's: both set aside here, the run's own numbers make the record."""
    monkeypatch.setattr(diskrecord, "EXPERT_BYTES", 1)
    monkeypatch.setattr(diskrecord, "IO_BOUND_SHARE", 0.0)
    set_profile(moe.path, 1, 200.0, 1e9)  # no burst fit: the runs' rates alone are planned with
    assert profiler.seen_expert_bw(moe.path) == [] and profiler.measure(moe, 1).expert_read_bw == 0
    result = api.run_prepared(api.prepare(_request(moe)))
    t = result["timings"]
    assert t["expert_bytes_read"] > 0 and t["stream_direct"] == t["stream_reads"]
    elapsed = t["stream_bytes_read"] / (t["stream_read_gb_s"] * 1e9)
    assert t["expert_predicted"] == 0  # no lookahead at 0 slots: a run that looks ahead records nothing
    waited = elapsed if t["expert_ahead"] else t["stream_stall_s"]
    rate = t["expert_bytes_read"] / waited
    assert profiler.seen_expert_bw(moe.path) == [pytest.approx(rate)]
    record = json.loads(diskrecord._expert_path(moe.path).read_text())
    assert record["file"] == str(moe.path) and record["bytes_per_s"] == [pytest.approx(rate)]
    assert profiler.measure(moe, 1).expert_read_bw == pytest.approx(rate)
    assert profiler.seen_disk_bw(moe.path) == []  # nor does it join the dense runs' record


def test_only_runs_their_expert_reads_paced_count():
    f = diskrecord.expert_run_bw
    assert f(_timings(1e9)) == pytest.approx(1e9)  # the expert bytes over the waits
    assert f(_timings(1e9, stall_share=0.1)) == 0  # compute-bound: the waits say little of the disk
    assert f(_timings(1e9, n_bytes=diskrecord.EXPERT_BYTES - 1)) == 0  # too few bytes to say a rate
    assert f(_timings(1e9, stream_direct=899)) == 0  # a buffered read may have come from the page cache
    assert f({**_timings(1e9), "expert_bytes_read": 0.4 * (1 << 30)}) == 0  # the waits mostly dense tensors'
    assert f({k: v for k, v in _timings().items() if not k.startswith("expert")}) == 0  # a dense run
    # a prompt's batch read ahead: reads hidden under its compute, so over the run's time, a lower bound
    assert f(_timings(1e9, expert_ahead=40)) == pytest.approx(0.5e9)
    assert f(_timings(1e9, expert_predicted=300)) == 0  # lookahead, no decode told apart: no time is the reads'


def test_a_run_that_looks_ahead_records_what_its_decode_read_over_its_time():
    """Lookahead hides reads under compute, so a run's waits are not its reads' time; where its decode waited on
    reads for a fifth of its time or more, decode's bytes (after the first token) over decode's time are the rate
    its reads met at least."""
    f, n = diskrecord.expert_run_bw, 8 << 30
    decode = dict(expert_predicted=300, stream_prompt_bytes_read=n - (4 << 30), stream_decode_s=2.0)
    assert f(_timings(1e9, n_bytes=n, stream_prompt_stall_s=1.0, **decode)) == pytest.approx((4 << 30) / 2.0)
    waits = n / 1e9  # _timings' stall: the prompt's 1.0 s of it leaves decode waiting nearly all its time
    assert f(_timings(1e9, n_bytes=n, stream_prompt_stall_s=waits - 0.3, **decode)) == 0  # decode waited 15 %
    assert f(_timings(1e9, n_bytes=n, stream_prompt_stall_s=1.0,
                      **{**decode, "stream_prompt_bytes_read": n - 1000})) == 0  # too few bytes decoding
    # a long prompt computing while the whole run's waits are a twentieth of its time: decode's share decides
    assert f(_timings(1e9, n_bytes=n, stall_share=0.05, stream_prompt_stall_s=1.0, **decode)) > 0


def test_the_last_runs_are_kept_and_a_corrupt_record_is_ignored(moe, private_cache):
    path = moe.path
    record = diskrecord._expert_path(path)
    record.parent.mkdir(parents=True, exist_ok=True)
    for corrupt in ("{not json", "[1, 2]", '{"bytes_per_s": 5}', '{"bytes_per_s": ["fast"]}', '{"other": []}'):
        record.write_text(corrupt)
        assert profiler.seen_expert_bw(path) == [] and profiler.typical_expert_bw(path, 2e9) == 2e9
    assert profiler.record_expert_run(path, _timings(0.8e9)) == pytest.approx(0.8e9)  # written afresh
    assert profiler.seen_expert_bw(path) == [pytest.approx(0.8e9)]
    assert profiler.record_expert_run(path, _timings(0.8e9, stall_share=0.1)) == 0  # not kept
    for i in range(diskrecord.SEEN_KEEP + 3):
        profiler.record_expert_run(path, _timings(1e9 + i * 1e6))
    seen = profiler.seen_expert_bw(path)
    assert len(seen) == diskrecord.SEEN_KEEP and seen[-1] == pytest.approx(1e9 + (diskrecord.SEEN_KEEP + 2) * 1e6)
    assert profiler.typical_expert_bw(path, 0.0) == pytest.approx(sorted(seen)[len(seen) // 2])


def test_the_plan_predicts_slower_when_runs_met_slower_expert_reads(moe, private_cache):
    """The profile's bursts at 2 GB/s; three runs since met 0.05 GB/s: the plan reads at their median."""
    profile = dataclasses.replace(Profile.calibrated(moe, tok_s=200.0, disk_bw=1e9), expert_read_bw=2e9,
                                  expert_read_latency=20e-6)
    write_atomic(profiler._cache_path(moe, 1), json.dumps(profile.to_dict()))
    request = _request(moe)
    limit = int(request.mem)
    before = api.plan_for_run(moe, request, limit)
    assert profiler.measure(moe, 1).expert_read_bw == 2e9
    for _ in range(3):
        assert profiler.record_expert_run(moe.path, _timings(0.05e9)) > 0
    assert profiler.measure(moe, 1).expert_read_bw == pytest.approx(0.05e9)
    assert profiler.measure(moe, 1).expert_read_latency == 20e-6  # the fit's latency kept
    after = api.plan_for_run(moe, request, limit)
    assert after.experts.slots == before.experts.slots == 0
    assert after.predicted_tok_s < 0.8 * before.predicted_tok_s

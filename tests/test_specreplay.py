"""A real run's passes replayed on another target (speculation/replay.py): each pass does the trace's work, one
pass over the streamed weights, and the caches keep what the trace kept."""

from dataclasses import replace

import pytest

from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.runtime import engine
from flexoffload.speculation import replay, speculate
from flexoffload.speculation.tree import Options

TRACE = ((5, 3, 4), (1, 1, 0), (8, 8, 7), (3, 1, 2), (2, 2, 1))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay")
    target = synth.write(d / "target.gguf", seed=3)
    draft = synth.write(d / "draft.gguf", shape=replace(synth.TINY, n_layer=2), seed=5)
    return target, draft


@pytest.mark.parametrize("strategy", ["mmap", "prefetch"])
def test_a_replay_does_each_pass_of_the_trace_and_keeps_what_it_kept(pair, strategy):
    target, draft = pair
    streamed = (r"blk\..*",) if strategy == "prefetch" else ()
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy=strategy, streamed_patterns=streamed,
                               window=1 if streamed else 0)
    with engine.Engine(draft, speculate.draft_settings(settings, load(draft))) as d, \
            engine.Engine(target, speculate.target_settings(settings, 8)) as t:
        alone_first = t.generate("hello world", 1).tokens[0]
        spec = speculate.Speculator(t, d, Options(replay=TRACE))
        got = spec.generate("hello world", -1)
        n_prompt = len(t.tokenize("hello world"))
        lib = spec.lib
        # the target's cache: the prompt, then each pass's kept rows (the last pass's own token is not decoded yet)
        assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(t.ctx), 0) == n_prompt + sum(k for _, k, _ in
                                                                                              TRACE) - 1
        assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(d.ctx), 0) <= n_prompt + sum(k for _, k, _ in
                                                                                              TRACE) - 2
    assert got.tokens[0] == alone_first  # the prompt's pass is the target's own
    assert got.n_gen == 1 + sum(k for _, k, _ in TRACE)
    tm = got.timings
    assert [p[:3] for p in tm["passes"]] == [list(p) for p in TRACE]
    assert tm["replayed"] == len(TRACE) == tm["n_verify"]
    assert all(p[3] > 0 for p in tm["passes"] if p[2]) and all(p[3] == 0 for p in tm["passes"] if not p[2])
    assert tm["tokens_per_pass"] == pytest.approx(got.n_gen / len(TRACE))
    if strategy == "prefetch":  # one pass over the streamed weights a replayed pass, as a tree's
        assert tm["stream_passes"] == len(TRACE) + 1 and tm["stream_rereads"] == 0


def test_a_replay_stops_at_n_predict(pair):
    target, draft = pair
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    got = speculate.run(target, settings, draft, Options(replay=TRACE), "hello world", 6)
    assert got.n_gen == 6
    assert len(got.timings["passes"]) == 3  # 1 + 3 + 1 + 8 passes the sixth token in the third


@pytest.mark.parametrize("trace", [[], [(2, 3, 0)], [(2, 0, 1)], [(2, 1, -1)]])
def test_a_trace_that_is_not_one_is_refused(trace):
    with pytest.raises(ValueError):
        replay.check(trace)

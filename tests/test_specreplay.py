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


# --- the prediction (bench/specreplay.py): pure -----------------------------------------------------------------

def _costs():
    from flexoffload.bench import specreplay as sr

    return sr.Costs("0.5x", {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.7}, step_s=0.02, alone_tok_s=1.25, overhead_s=0.0)


def test_a_pass_is_priced_between_and_past_the_sizes_measured():
    c = _costs()
    assert c.at(4) == 1.3
    assert c.at(3) == pytest.approx(1.2)
    assert c.at(16) == pytest.approx(1.7 + 0.1 * 8)  # on the last two sizes' line
    pass_s, row_s = c.line()
    assert row_s == pytest.approx(0.1) and pass_s == pytest.approx(1.0)


def test_a_trace_is_priced_pass_by_pass():
    from flexoffload.bench import specreplay as sr

    c = _costs()
    trace = {"passes": [[4, 3, 3, 0, 0, 0], [1, 1, 0, 0, 0, 0], [8, 8, 7, 0, 0, 0]]}
    seconds = (1.3 + 3 * 0.02) + 1.0 + (1.7 + 7 * 0.02)
    assert sr.predicted_trace(trace, c) == pytest.approx(12 / seconds)


def test_a_draft_always_right_goes_deep_and_one_always_wrong_is_off():
    from flexoffload.bench import specreplay as sr

    c = _costs()
    right = sr.measured_of([{"control": {"acceptance_by_depth": [1.0] * 31, "reached_by_depth": [50.0] * 31}}])
    depth, per_pass, rate = sr.predicted_best(right, c)
    assert depth >= 7 and per_pass == pytest.approx(1 + depth, rel=0.05) and rate > 1 / c.at(1)
    wrong = sr.measured_of([{"control": {"acceptance_by_depth": [0.0] * 4, "reached_by_depth": [50.0] * 4}}])
    assert sr.predicted_best(wrong, c)[0] == 0


def test_the_sweep_lines_make_a_budgets_costs():
    from flexoffload.bench import specreplay as sr

    rows = [{"mem": "0.5x", "kind": "pass", "rows": str(r), "steps": "0", "draft_s": "0", "target_s": str(t),
             "other_s": "0.001", "tok_s": ""} for r, t in ((1, 1.0), (1, 1.2), (1, 0.9), (4, 1.5))]
    rows.append({"mem": "0.5x", "kind": "pass", "rows": "1", "steps": "8", "draft_s": "0.16", "target_s": "1",
                 "other_s": "0.001", "tok_s": ""})
    rows.append({"mem": "0.5x", "kind": "alone", "rows": "", "steps": "", "draft_s": "", "target_s": "",
                 "other_s": "", "tok_s": "1.1"})
    c = sr.costs(rows, "0.5x")
    assert c.pass_s == {1: 1.0, 4: 1.5} and c.step_s == pytest.approx(0.02) and c.alone_tok_s == 1.1
    with pytest.raises(Exception, match="no passes"):
        sr.costs(rows, "0.3x")

"""Speculation without a draft model (speculation/drafters.py): the drafters' proposals, Token Recycling's table, the
merge under the node budget, and losslessness: greedy output with each free drafter equal to the target alone."""

import json
from dataclasses import replace

import numpy as np
import pytest

from flexoffload.gguf import synth
from flexoffload.prompts import edit
from flexoffload.runtime import engine
from flexoffload.speculation import drafters, speculate
from flexoffload.speculation.drafters import NgramMapK, NgramSimple, Proposal, Recycle
from flexoffload.speculation.tree import Options

from conftest import cli, tail_logits_apart

# its real model's profiles and streamed runs record the disk: in a cache of the module's own (conftest)
pytestmark = pytest.mark.usefixtures("module_cache")


# --- the drafters, in pure Python -------------------------------------------------------------------------------

def test_ngram_simple_proposes_what_followed_the_last_tokens_most_recent_first():
    d = NgramSimple(length=3)
    #          0  1  2  3  4  5  6  7  8  9  10 11
    history = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    got = d.propose(history, 16)
    # (2, 5, 6) never occurred before; (5, 6) did twice, followed by 7 both times: the most recent occurrence's
    # continuation, once (a branch per distinct first token)
    assert [p.tokens for p in got] == [[7, 1, 2]]
    assert got[0].kinds == [2, 2, 2] and got[0].source == "ngram-simple"


def test_ngram_simple_prefers_the_longest_key_and_fills_in_with_shorter_ones():
    d = NgramSimple(length=2)
    history = [1, 2, 3, 4, 9, 2, 3, 7, 8, 1, 2, 3]
    got = d.propose(history, 16)
    assert got[0].tokens == [4, 9] and got[0].kinds == [3, 3]  # (1, 2, 3) was followed by 4
    assert [7, 8] in [p.tokens for p in got]  # (2, 3) also by 7: a branch from the shorter key
    assert all(p.tokens[0] != 4 for p in got[1:])


def test_ngram_simple_proposes_nothing_without_a_match_and_keeps_within_the_budget():
    d = NgramSimple()
    assert d.propose([1, 2, 3, 4], 16) == []
    d = NgramSimple(length=10)
    history = list(range(20)) + [0, 1, 2]
    got = d.propose(history, 4)
    assert sum(len(p.tokens) for p in got) <= 4 and got[0].tokens == [3, 4, 5, 6]


def test_ngram_simple_indexes_a_growing_history():
    d = NgramSimple(length=2)
    history = [1, 2, 3, 4]
    assert d.propose(history, 8) == []
    history += [1, 2]
    assert d.propose(history, 8)[0].tokens == [3, 4]
    d.reset()
    assert d.propose([7, 8], 8) == []


def test_ngram_map_k_takes_the_continuation_seen_most_often():
    d = NgramMapK(size=2, length=2)
    history = [1, 2, 5, 6, 1, 2, 5, 7, 1, 2, 8, 9, 1, 2]
    got = d.propose(history, 8)
    assert len(got) == 1 and got[0].tokens == [5, 7]  # 5 followed (1, 2) twice, 8 once; the latest 5 wins
    assert NgramMapK(size=2, min_hits=3).propose(history, 8) == []


def test_recycle_table_holds_the_top_k_of_each_row_the_target_computed():
    r = Recycle(n_vocab=10, k=3)
    logits = np.zeros((2, 10), dtype=np.float32)
    logits[0, [4, 7, 1]] = [3.0, 5.0, 1.0]
    logits[1, [2, 3, 9]] = [1.0, 2.0, 3.0]
    r.learn([6, 0], logits)
    assert r.table[6].tolist() == [7, 4, 1]  # by logit, highest first
    assert r.table[0].tolist() == [9, 3, 2]
    assert (r.table[[1, 2, 3, 4, 5, 7, 8, 9]] == -1).all()
    logits[0] = 0
    logits[0, [5, 6, 8]] = [1.0, 2.0, 3.0]
    r.learn([6], logits[:1])  # a later pass overwrites the row
    assert r.table[6].tolist() == [8, 6, 5]
    assert r.table_bytes == 10 * 3 * 4
    assert Recycle(n_vocab=151936, k=8).table_bytes == 151936 * 8 * 4
    # and what learning holds while it runs: LEARN_ROWS rows of logits and their top-k's indices
    assert drafters.table_bytes(["recycle"], 151936) == 151936 * (8 * 4 + drafters.LEARN_ROWS * 12)


def test_recycle_draws_a_tree_from_the_table_best_first_under_the_budget():
    r = Recycle(n_vocab=10, k=2)
    r.table[1] = [2, 3]
    r.table[2] = [4, 5]
    r.table[3] = [6, -1]
    r.table[4] = [7, 8]
    got = r.propose([9, 1], 4)  # rank 0 is likelier than rank 1 by the prior: 2, 4, 3, 7 before 5, 6 and 8
    paths = {tuple(p.tokens) for p in got}
    assert paths == {(2, 4, 7), (3,)}
    assert {tuple(p.kinds) for p in got} == {(0, 0, 0), (1,)}
    assert r.propose([9, 0], 4) == []  # a row the target never computed, nor the history showed


def test_recycle_starts_rows_from_the_history_until_the_target_computes_them():
    r = Recycle(n_vocab=10, k=2)
    got = r.propose([1, 2, 3, 1], 4)
    assert [p.tokens for p in got] == [[2, 3, 1, 2]]  # 1 -> 2 -> 3 -> 1, four nodes


def test_recycle_store_keeps_the_table_and_rates_for_the_next_run_and_ignores_one_that_does_not_fit(tmp_path):
    store = tmp_path / "recycle" / "m.npz"
    r = Recycle(n_vocab=10, k=2, store=store)
    assert (r.table == -1).all()  # no store yet: an empty table
    r.table[1] = [2, 3]
    for _ in range(10):
        r.judge(0, True)
    r.save()
    assert [p.name for p in store.parent.iterdir()] == ["m.npz"]  # no part file left
    again = Recycle(n_vocab=10, k=2, store=store)
    assert again.table[1].tolist() == [2, 3] and again.rate(0) == r.rate(0) > Recycle(10, 2).rate(0)
    assert (Recycle(n_vocab=11, k=2, store=store).table == -1).all()  # another vocabulary: not this table
    assert (Recycle(n_vocab=10, k=3, store=store).table == -1).all()
    store.write_bytes(b"not a table")
    assert (Recycle(n_vocab=10, k=2, store=store).table == -1).all()
    Recycle(n_vocab=10, k=2).save()  # no store: nothing written, no error


def test_a_drafter_learns_its_chance_of_acceptance_per_kind():
    d = NgramSimple()
    before = d.rate(3)
    for _ in range(20):
        d.judge(3, True)
    assert d.rate(3) > before and d.rate(3) > 0.9
    for _ in range(40):
        d.judge(1, False)
    assert d.rate(1) < 0.05


def test_merge_takes_the_most_confident_nodes_with_their_parents_under_the_budget():
    a, b = NgramSimple(), NgramMapK()
    a.counts = {3: [9.0, 10.0]}  # 0.9 a token
    b.counts = {0: [5.0, 10.0]}  # 0.5
    proposals = [(a, Proposal([1, 2, 3, 4], [3] * 4, a.name)), (b, Proposal([1, 5, 6], [0] * 3, b.name))]
    paths = drafters.merge(proposals, n_nodes=5, n_leaves=4)
    got = [[p.token for p in path] for path in paths]
    # 1 (0.9), 2 (.81), 3 (.73), 4 (.66), then 5 (0.9 * 0.5): the shared first token is one node, of both drafters
    assert got == [[1, 2, 3, 4], [1, 5]]
    assert {d.name for d, _ in paths[0][0].origins} == {"ngram-simple", "ngram-map-k"}
    assert drafters.merge(proposals, n_nodes=10, n_leaves=1) == drafters.merge(proposals, n_nodes=10, n_leaves=1)[:1]
    assert [[p.token for p in q] for q in drafters.merge(proposals, 10, 1)] == [[1, 2, 3, 4]]
    # a node must pay for itself: nothing below the minimum confidence
    assert [[p.token for p in q] for q in drafters.merge(proposals, 10, 4, min_conf=0.7)] == [[1, 2, 3]]
    # the first n_hidden nodes cost the pass nothing (its reads hide their compute): only the floor applies
    got = [[p.token for p in q] for q in drafters.merge(proposals, 10, 4, min_conf=0.7, n_hidden=5)]
    assert got == [[1, 2, 3, 4], [1, 5]]
    got = [[p.token for p in q] for q in drafters.merge(proposals, 10, 4, 0.7, n_hidden=6)]
    assert got == [[1, 2, 3, 4], [1, 5, 6]]
    b.counts = {0: [1.0, 100.0]}  # 0.01 a token: under the floor even where hidden
    assert [[p.token for p in q] for q in drafters.merge(proposals, 10, 4, 0.7, n_hidden=6)] == [[1, 2, 3, 4]]


def test_spec_types_are_checked():
    from flexoffload import FlexoffloadError, rules

    assert rules.spec_types("ngram-simple,recycle", None) == ["ngram-simple", "recycle"]
    assert rules.spec_types("auto", None) == ["auto"]
    assert rules.spec_types("none", None) == []
    assert rules.spec_types("model,recycle", "x") == ["recycle"]
    for bad in ("ngram-cache", "auto,recycle", "model", "layers", "recycle,layers"):
        with pytest.raises(FlexoffloadError):
            rules.spec_types(bad, None)


# --- on the native library --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A synthetic target with peaked next-token distributions (its greedy text repeats, as the tests need), and a
    shallower draft with its vocabulary."""
    d = tmp_path_factory.mktemp("freedraft")
    target = synth.write(d / "target.gguf", seed=3, output_seed=4, output_scale=10)
    draft = synth.write(d / "draft.gguf", shape=replace(synth.TINY, n_layer=2), seed=3, output_seed=4,
                        output_scale=10)
    return target, draft


def _alone(path, settings, prompt, n):
    with engine.Engine(path, settings) as e:
        return e.generate(prompt, n)


@pytest.mark.parametrize("names", [("ngram-simple",), ("ngram-map-k",), ("recycle",),
                                   ("ngram-simple", "ngram-map-k", "recycle")])
@pytest.mark.parametrize("strategy", ["mmap", "prefetch"])
def test_greedy_output_with_free_drafters_equals_the_target_alone(peaked, names, strategy):
    target = peaked[0]
    streamed = (r"blk\..*",) if strategy == "prefetch" else ()
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy=strategy, streamed_patterns=streamed,
                               window=1 if streamed else 0)
    for prompt in ("hello world", "abc abc abc abc", "The quick brown fox"):
        ref = _alone(target, settings, prompt, 48)
        got = speculate.run(target, settings, None, Options(), prompt, 48, free_drafters=names)
        assert got.tokens == ref.tokens, (names, prompt)
        t = got.timings
        assert t["tokens_per_pass"] > 1  # the synthetic target's text repeats: the drafters find it
        assert set(t["drafters"]) <= set(names) and t["drafters"]
        if strategy == "prefetch":  # one pass over the streamed weights a verification
            assert t["stream_rereads"] == 0 and t["stream_passes"] == t["n_verify"] + 1


@pytest.mark.parametrize("pipeline", [False, True])
def test_greedy_output_of_a_draft_tree_with_free_drafters_merged_equals_the_target_alone(peaked, pipeline):
    target, draft = peaked
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    for prompt in ("hello world", "abc abc abc abc"):
        ref = _alone(target, settings, prompt, 48)
        got = speculate.run(target, settings, draft, Options(pipeline=pipeline), prompt, 48,
                            free_drafters=("ngram-simple", "recycle"))
        assert got.tokens == ref.tokens, prompt
        assert "model" in got.timings["drafters"] and "recycle" in got.timings["drafters"]


def test_sampled_output_with_free_drafters_is_the_target_alones_with_the_same_seed(peaked):
    """Sampled, the walk draws each token with the target's own sampler chain from logits equal to a one-token
    pass's, one draw a token: with the same seed, the same tokens as the target alone."""
    target = peaked[0]
    for seed in (1, 7, 42):
        settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.8, seed=seed, strategy="mmap")
        ref = _alone(target, settings, "abc abc abc", 32)
        got = speculate.run(target, settings, None, Options(), "abc abc abc", 32,
                            free_drafters=("ngram-simple", "recycle"))
        assert got.tokens == ref.tokens, seed
        assert got.timings["tokens_per_pass"] > 1


@pytest.mark.parametrize("tiled", [False, True])
def test_verification_passes_use_the_per_row_kernels_unless_tiled_verify(peaked, tiled, monkeypatch):
    """Bit-exact verification turns the tiled kernels off for each target pass over a tree (and back to the
    environment's choice after); --tiled-verify (an ablation) leaves them as llama.cpp has them."""
    from flexoffload import native

    modes = []
    real = native.set_tiled_matmul
    monkeypatch.setattr(native, "set_tiled_matmul", lambda mode: (modes.append(mode), real(mode)))
    got = speculate.run(peaked[0], engine.Settings(n_ctx=256, n_batch=64, temp=0.0), None, Options(tiled=tiled),
                        "abc abc abc", 24, free_drafters=("ngram-simple",))
    assert got.timings["n_verify"] > 0
    during = modes[0::2]
    assert len(during) == got.timings["n_verify"] and set(modes[1::2]) == {-1}
    assert set(during) == ({-1} if tiled else {0})


def test_run_takes_tiled_verify():
    from flexoffload.cli.run import request_from_args

    assert request_from_args(["-p", "x", "--tiled-verify"]).tiled_verify
    assert not request_from_args(["-p", "x"]).tiled_verify


def test_no_draft_engine_is_loaded_without_a_draft(peaked, monkeypatch):
    loaded = []
    real = engine.Engine.__init__

    def counting(self, path, settings, *args, **kwargs):
        loaded.append(str(path))
        real(self, path, settings, *args, **kwargs)

    monkeypatch.setattr(speculate.Engine, "__init__", counting)
    speculate.run(peaked[0], engine.Settings(n_ctx=256, n_batch=64, temp=0.0), None, Options(), "abc abc", 8,
                  free_drafters=("ngram-simple",))
    assert loaded == [str(peaked[0])]


def test_recycle_run_leaves_its_table_for_the_next_run_of_the_model(peaked):
    from flexoffload import api
    from flexoffload.gguf.model import load

    store = api.recycle_store(load(peaked[0]))
    store.unlink(missing_ok=True)
    common = ("run", "-m", str(peaked[0]), "-p", "abc abc abc abc", "-n", "24", "--temp", "0", "-c", "256", "-b",
              "64", "--json")
    cli(*common, "--spec-type", "ngram-simple", check=True)
    assert not store.exists()  # only Token Recycling keeps a table
    first = json.loads(cli(*common, "--spec-type", "recycle", check=True).stdout)
    with np.load(store) as f:
        learned = (f["table"] >= 0).any(axis=1).sum()
    assert learned > 0
    second = json.loads(cli(*common, "--spec-type", "recycle", check=True).stdout)
    assert second["tokens"] == first["tokens"]  # lossless either way
    assert second["timings"]["drafters"]["recycle"]["n_drafted"] > 0


def test_run_spec_type_reports_tokens_per_pass_and_acceptance_per_drafter(peaked):
    common = ("run", "-m", str(peaked[0]), "-p", "abc abc abc abc", "-n", "32", "--temp", "0", "-c", "256", "-b",
              "64", "--json")
    alone = json.loads(cli(*common, "--spec-type", "none", check=True).stdout)
    free = json.loads(cli(*common, "--spec-type", "ngram-simple,recycle", check=True).stdout)
    assert free["tokens"] == alone["tokens"]
    assert free["spec"]["types"] == ["ngram-simple", "recycle"] and free["timings"]["tokens_per_pass"] > 1
    assert set(free["timings"]["drafters"]) <= {"ngram-simple", "recycle"}
    assert "spec" not in alone
    r = cli(*common, "--spec-type", "model")
    assert r.returncode != 0 and "-md" in r.stderr and "Traceback" not in r.stderr


# --- on the real model ------------------------------------------------------------------------------------------

@pytest.mark.integration
def test_real_edit_prompt_ngram_simple_is_lossless_and_takes_several_tokens_a_pass(real_model):
    """An edit prompt repeats its input: prompt lookup must find it (more than a token a pass), and the greedy
    tokens stay the target's own."""
    _, prompt = edit.prompts("tuning", 2)[1]
    settings = engine.Settings(n_ctx=1024, n_batch=512, temp=0.0, strategy="mmap")
    ref = _alone(real_model, settings, prompt, 40)
    for names in (("ngram-simple",), ("recycle",)):
        got = speculate.run(real_model, settings, None, Options(), prompt, 40, free_drafters=names)
        assert got.tokens == ref.tokens, names
        if names == ("ngram-simple",):
            assert got.timings["tokens_per_pass"] > 1.5
            assert got.timings["drafters"]["ngram-simple"]["n_accepted"] > 0


def test_the_plan_counts_the_free_drafters_rows_and_table(tiny_model):
    from flexoffload import api
    from flexoffload.speculation import speculate as spec

    base = dict(model=str(tiny_model), prompt="a b c", n_predict=4, temp=0, n_ctx=256, mem="300M", strategy="stream")
    free = api.prepare(api.Request(**base, spec_type="recycle"))
    assert free.spec_type == "recycle" and free.draft_bytes == drafters.table_bytes(["recycle"], 384) > 0
    assert free.plan is not None and free.plan.budget == api.prepare(api.Request(**base)).plan.budget
    # decided in the parent, the child (an enforced run) prepares the same request again, not deciding anew
    assert api.prepare(free.request).spec_type == "recycle"
    assert spec.FREE_NODES_MAX >= spec.FREE_NODES
    # nothing streams for this tiny model under 300M: auto runs the target alone
    assert api.prepare(api.Request(**base, spec_type="auto")).spec_type == "none"


@pytest.mark.integration
def test_real_auto_speculates_where_the_plan_streams_and_not_without_a_budget(real_model, monkeypatch):
    """auto decides by the measured profile (is the plan's pass disk-bound?); the machine's measured compute is
    set here on both sides of the rule, so the test does not depend on how busy the CPU was when it measured."""
    from flexoffload import api
    from flexoffload.plan import costmodel

    _, prompt = edit.prompts("tuning", 1)[0]
    request = api.Request(model=str(real_model), prompt=prompt, temp=0, mem="0.4x", spec_type="auto")
    monkeypatch.setattr(costmodel, "compute_seconds", lambda model, profile: 1e-3)  # the disk sets the pass
    tight = api.prepare(request)
    assert tight.spec_type == ",".join(api.FREE_AUTO) and tight.plan is not None
    assert tight.draft_bytes == drafters.table_bytes(["recycle"], tight.model.n_vocab) > 4 << 20
    monkeypatch.setattr(costmodel, "compute_seconds", lambda model, profile: 10.0)  # compute sets it
    assert api.prepare(request).spec_type == "none"
    monkeypatch.undo()
    assert api.prepare(api.Request(model=str(real_model), prompt=prompt, spec_type="auto")).spec_type == "none"


# --- auto, where the disk or compute sets the pass ----------------------------------------------------------------

# tensors over the 1 MiB that always stays resident (an FFN matrix is 1.6 MiB at Q4_0), so a budget under the file
# streams most of them; the peaked target's seeds and output scale, so its greedy text repeats and drafts are accepted
STREAMABLE = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=384, n_ctx_train=1024)
AUTO_TOK_S = 50.0  # the compute set for the profiles below: 20 ms a token with every weight in memory


def test_run_spec_type_auto_speculates_where_the_disk_sets_the_pass_and_not_where_compute_does(tmp_path,
                                                                                               private_cache):
    """`run --spec-type auto` (run's default) on a synthetic model streamed by a plan, the machine's profile set in
    this test's own cache (not measured): where reading what a token streams takes ten times its compute, the run
    speculates with the free drafters (the --json shows the drafters, their drafted and accepted tokens, more than a
    token a pass); where it takes a tenth, the same run at the same budget runs the target alone; without a budget
    nothing streams and it runs alone too. The tokens are the same every way (greedy, lossless)."""
    from flexoffload import api
    from flexoffload.cli import request_from_args
    from flexoffload.gguf.model import load
    from flexoffload.measure import probe
    from flexoffload.plan.planners import run_minimum

    from conftest import set_profile

    assert request_from_args(["-p", "x"]).spec_type == "auto"  # run's default
    path = synth.write(tmp_path / "streamable.gguf", STREAMABLE, seed=3, output_seed=4, output_scale=10)
    m = load(path)
    budget = int(run_minimum(m, probe.measure(m, 256, 32)) * 1.02)  # most of the FFN matrices stream
    common = ["run", "-m", str(path), "-p", "abc abc abc abc", "-n", "20", "--temp", "0", "-c", "256", "-b", "32",
              "-t", "2", "--strategy", "stream", "--json"]

    def run(*extra: str) -> dict:
        return json.loads(cli(*common, *extra, check=True).stdout)

    set_profile(path, 2, AUTO_TOK_S, disk_bw=m.weight_bytes * AUTO_TOK_S / 10)  # all weights: 10x compute
    disk_bound = run("--mem", str(budget), "--spec-type", "auto")
    assert disk_bound["plan"]["streamed_mb"] > 0.5 * m.weight_bytes / 2**20
    assert disk_bound["spec"]["types"] == list(api.FREE_AUTO) and disk_bound["strategy"] == "stream+tree"
    t = disk_bound["timings"]
    assert t["n_verify"] > 0 and t["tokens_per_pass"] > 1
    assert sum(d["n_drafted"] for d in t["drafters"].values()) > 0
    assert sum(d["n_accepted"] for d in t["drafters"].values()) > 0

    set_profile(path, 2, AUTO_TOK_S, disk_bw=m.weight_bytes * AUTO_TOK_S * 10)  # all weights: a tenth of compute
    compute_bound = run("--mem", str(budget), "--spec-type", "auto")
    assert "spec" not in compute_bound and compute_bound["strategy"] == "stream"
    assert compute_bound["plan"]["streamed_mb"] > 0 and "drafters" not in compute_bound["timings"]
    unbudgeted = json.loads(cli(*[a for a in common if a not in ("--strategy", "stream")], "--spec-type", "auto",
                                check=True).stdout)
    assert "spec" not in unbudgeted and unbudgeted["strategy"] == "mmap"
    assert disk_bound["tokens"] == compute_bound["tokens"] == unbudgeted["tokens"]


# --- with -ub, -fa, -ctk, -ctv, and tensors on RPC servers --------------------------------------------------------

@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """The peaked target with 32-wide attention heads (a quantized KV cache needs rows of whole 32-value blocks)."""
    shape = replace(synth.TINY, n_head=2, n_head_kv=1)
    return synth.write(tmp_path_factory.mktemp("wide") / "target.gguf", shape=shape, seed=3, output_seed=4,
                       output_scale=10)


@pytest.mark.parametrize("kinds", [dict(n_ubatch=4), dict(flash_attn="on", type_k="q8_0", type_v="q8_0"),
                                   dict(n_ubatch=8, type_k="q4_0", type_v="q4_0"), dict(flash_attn="off")])
def test_greedy_free_drafters_with_ubatch_and_kv_types_equal_the_target_alone(wide_heads, kinds):
    """Streamed: each verification is one pass over the streamed weights, whatever the ubatch (the tree stays
    within it); the prompt takes a pass per ubatch, as the target alone's."""
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="prefetch", streamed_patterns=(r"blk\..*",),
                               window=1, **kinds)
    ubatch = settings.n_ubatch or settings.n_batch
    for prompt in ("abc abc abc abc", "The quick brown fox"):
        ref = _alone(wide_heads, settings, prompt, 48)
        got = speculate.run(wide_heads, settings, None, Options(), prompt, 48,
                            free_drafters=("ngram-simple", "recycle"))
        assert got.tokens == ref.tokens, (kinds, prompt)
        t = got.timings
        assert t["tokens_per_pass"] > 1 and t["tree_size_max"] <= ubatch
        assert t["stream_rereads"] == 0 and t["stream_passes"] == t["n_verify"] + -(-got.n_prompt // ubatch)


@pytest.fixture(scope="module")
def rpc_server():
    """llama.cpp's ggml-rpc-server on loopback (a free port), as `--rpc 127.0.0.1:PORT` names it; stopped after."""
    import socket
    import subprocess
    import time

    from flexoffload import FlexoffloadError, native
    from flexoffload.native import devices

    probe = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    server = subprocess.Popen([str(native.tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p",
                               endpoint.split(":")[1], "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                devices.probe_rpc(endpoint, timeout=1.0)
                break
            except FlexoffloadError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.1)
        yield endpoint
    finally:
        server.kill()
        server.wait()


def _in_a_child(function, *args: str) -> None:
    """function(*args) of this module in a fresh interpreter: a run with --rpc registers its server in ggml's
    registry for the process's life, and a server gone from it aborts whatever lists the devices after (test_rpc)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = f"import test_freedraft; test_freedraft.{function.__name__}(*{args!r})"
    tests = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200, cwd=tests,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]


def _free_drafters_over_rpc(directory: str, endpoint: str) -> None:
    from flexoffload import FlexoffloadError

    path = synth.write(f"{directory}/qwen2.gguf", synth.SHAPES["qwen2-tiny"], seed=3, output_seed=4, output_scale=10)
    base = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap", rpc=(endpoint,))
    whole_layer = ((r"blk\.1\..*", f"RPC0[{endpoint}]"),)
    for settings in (replace(base, n_gpu_layers=2), replace(base, placed_patterns=whole_layer, flash_attn="on")):
        for prompt in ("abc abc abc abc", "hello world"):
            ref = _alone(path, settings, prompt, 40)
            got = speculate.run(path, settings, None, Options(), prompt, 40, free_drafters=("ngram-simple", "recycle"))
            assert got.tokens == ref.tokens, (settings, prompt)
            assert 1 < got.timings["tokens_per_pass"] and got.timings["tree_size_max"] <= speculate.RPC_NODES
    with pytest.raises(FlexoffloadError, match="give -fa on"):
        speculate.run(path, replace(base, placed_patterns=whole_layer), None, Options(), "abc", 8,
                      free_drafters=("ngram-simple",))
    # an engine without --rpc after them stays on this machine (the server is in ggml's registry now)
    with engine.Engine(path, replace(base, rpc=())) as e:
        assert not [line for line in e.log.lines if "RPC0" in line]


def test_free_drafters_with_tensors_on_an_rpc_server_give_the_target_alones_tokens(tmp_path, rpc_server):
    """--rpc: layers offloaded with their KV cache (-ngl), or tensors placed on the server by a plan. The server's
    kernels are its own (no switch from here for its tiled ones), so a tree stays under their 8 rows; a placement
    that makes llama.cpp's auto turn flash attention off is refused (-fa on runs it)."""
    _in_a_child(_free_drafters_over_rpc, str(tmp_path), rpc_server)


def _real_rpc_passes(model_path: str, endpoint: str) -> None:
    settings = speculate.target_settings(engine.Settings(n_ctx=512, n_batch=64, temp=0.0, strategy="mmap",
                                                         rpc=(endpoint,), n_gpu_layers=4))
    _, prompt = edit.prompts("tuning", 1)[0]
    with engine.Engine(model_path, settings) as e:
        toks = e.tokenize(prompt)[:200]

        def apart(n_pass: int) -> float:
            return tail_logits_apart(e, toks, len(toks) - n_pass)

        assert apart(speculate.RPC_NODES) == 0
        assert apart(speculate.RPC_NODES + 1) > 0


@pytest.mark.integration
def test_real_rpc_server_verifies_7_tokens_a_pass_as_one_token_passes_and_not_8(real_model, rpc_server):
    """The structural reason for RPC_NODES: the 1.5B's last 4 layers on the server, a token's logits from a pass of
    7 tokens (tiled kernels off here) equal one-token passes', from a pass of 8 (the server's tiled K-quant kernels)
    they do not."""
    _in_a_child(_real_rpc_passes, str(real_model), rpc_server)


def _real_edit_over_rpc(model_path: str, endpoint: str) -> None:
    _, prompt = edit.prompts("tuning", 2)[1]
    settings = engine.Settings(n_ctx=1024, n_batch=512, temp=0.0, strategy="mmap", rpc=(endpoint,), n_gpu_layers=4)
    ref = _alone(model_path, settings, prompt, 40)
    got = speculate.run(model_path, settings, None, Options(), prompt, 40, free_drafters=("ngram-simple",))
    assert got.tokens == ref.tokens
    assert got.timings["tokens_per_pass"] > 1.5


@pytest.mark.integration
def test_real_edit_prompt_free_drafters_over_rpc_equal_the_target_alone(real_model, rpc_server):
    _in_a_child(_real_edit_over_rpc, str(real_model), rpc_server)

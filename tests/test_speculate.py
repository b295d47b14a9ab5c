"""Token-tree speculation: the pacer and the fallback threshold, and losslessness: greedy output equal to the target
alone, sampled output distributed as the target's."""

import json
import math
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from flexoffload.speculation import drafters
from flexoffload.runtime import engine
from flexoffload.gguf import catalog
from flexoffload.speculation import speculate
from flexoffload.speculation import settings as specsettings
from flexoffload.speculation import state as specstate
from flexoffload.speculation import tree as spectree
from flexoffload.speculation import verify
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.speculation.tree import Options

from conftest import cli, tail_logits_apart

# its real model's profiles and streamed runs record the disk: in a cache of the module's own (conftest)
pytestmark = pytest.mark.usefixtures("module_cache")

ALL_OPTIONS = {
    "measured": Options(),
    "measured chain": Options(tree=False),
    "llmcad": Options(control="llmcad"),
    "chain": Options(control="llmcad", tree=False),
    "no-pacer": Options(control="llmcad", pacer=False),
    "no-adaptive": Options(control="llmcad", adaptive=False, max_nodes=12),
    "pipeline": Options(control="llmcad", pipeline=True),
}


# --- on the native library --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A synthetic target with peaked next-token distributions, and drafts with its vocabulary: the target itself
    (it agrees at every node: long accepted paths, branches where a second candidate is likely) and its first two
    layers under the same embeddings and output (it mostly disagrees: rejections)."""
    d = tmp_path_factory.mktemp("spec")
    target = synth.write(d / "target.gguf", seed=3, output_seed=4, output_scale=10)
    shallow = synth.write(d / "draft.gguf", shape=replace(synth.TINY, n_layer=2), seed=3, output_seed=4,
                          output_scale=10)
    return target, {"same": target, "shallow": shallow}


def _alone(path, settings, prompt, n):
    with engine.Engine(path, settings) as e:
        return e.generate(prompt, n)


@pytest.mark.parametrize("name", list(ALL_OPTIONS))
@pytest.mark.parametrize("strategy", ["mmap", "prefetch"])
@pytest.mark.parametrize("which", ["same", "shallow"])
def test_greedy_tree_output_equals_the_target_alone(tiny_pair, name, strategy, which):
    target, draft = tiny_pair[0], tiny_pair[1][which]
    streamed = (r"blk\..*",) if strategy == "prefetch" else ()
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy=strategy, streamed_patterns=streamed,
                               window=1 if streamed else 0)
    for prompt in ("hello world", "abc abc abc", "The quick brown fox"):
        ref = _alone(target, settings, prompt, 40)
        got = speculate.run(target, settings, draft, ALL_OPTIONS[name], prompt, 40)
        assert got.tokens == ref.tokens, (name, strategy, prompt)
        assert got.text == ref.text
        t = got.timings
        assert t["n_verify"] >= 1 and t["n_drafted"] >= t["n_accepted"] >= 0
        assert t["tokens_per_pass"] == pytest.approx(len(got.tokens) / t["n_verify"])
        if name == "chain":
            assert t["tree_size_max"] <= spectree.MAX_NODES
        if strategy == "prefetch":  # one pass over the streamed weights per verification, none read twice
            assert t["stream_rereads"] == 0
            assert t["stream_passes"] == t["n_verify"] + 1  # + the prompt


def test_a_draft_step_the_pipeline_aborts_leaves_the_draft_cache_as_it_was(tiny_pair):
    """When the target's pass ends, the pipeline aborts the draft's step under way: its tokens leave no cells."""
    target, draft = tiny_pair[0], tiny_pair[1]["shallow"]
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    with engine.Engine(draft, speculate.draft_settings(settings, load(draft))) as d, \
            engine.Engine(target, speculate.target_settings(settings, 8)) as t:
        spec = speculate.Speculator(t, d, Options(pipeline=True, max_nodes=8))
        spec.generate("hello world", 8)  # sets up the batches and the history
        lib = spec.lib
        mem = lib.llama_get_memory(d.ctx)
        before = lib.llama_memory_seq_pos_max(mem, 0)
        tokens = d.tokenize("a b c d e")
        spec.call.dbatch = specstate._Batch(lib, d.n_batch, 1)  # generate freed its own
        lib.llama_set_abort_callback(d.ctx, spec.verifier.abort, None)
        try:
            spec.verifier.target_done = True  # the target's pass is over
            assert spec.grower.draft_decode(spec.call, tokens, before + 1, 0) is None
            assert lib.llama_memory_seq_pos_max(mem, 0) == before
            spec.verifier.target_done = False  # a pass under way: the step runs
            assert spec.grower.draft_decode(spec.call, tokens, before + 1, 0) is not None
            assert lib.llama_memory_seq_pos_max(mem, 0) == before + len(tokens)
        finally:
            lib.llama_set_abort_callback(d.ctx, lib.ggml_abort_callback(), None)
            spec.call.dbatch.free()


def test_the_pipeline_thread_goes_idle_and_back():
    before = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
    saved = verify._idle_thread()
    try:
        assert saved == before and os.sched_getscheduler(0) == os.SCHED_IDLE
    finally:
        verify._restore_thread(saved)
    assert (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) == before


def test_trees_branch_and_the_draft_is_accepted(tiny_pair):
    target, draft = tiny_pair[0], tiny_pair[1]["same"]
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    # a fixed node budget: by default it follows measured pass times, which on a tiny model are mostly noise
    got = speculate.run(target, settings, draft, Options(control="llmcad", threshold=0.01, max_nodes=16),
                        "hello world", 40)
    t = got.timings
    assert t["n_accepted"] > len(got.tokens) // 2  # fewer target passes than tokens
    assert t["tokens_per_pass"] > 2
    assert t["tree_size_max"] > t["n_accepted"] / t["n_verify"] + 1  # more nodes than the accepted path: branches


def test_measured_chains_go_deep_where_the_draft_is_always_right(tiny_pair):
    """The draft is the target (every token accepted) and kept on (--draft-always): the measured rule drafts on
    while the path stays likely, so chains reach the node budget, and the output is the target's own."""
    target, draft = tiny_pair[0], tiny_pair[1]["same"]
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    ref = _alone(target, settings, "hello world", 60)
    got = speculate.run(target, settings, draft, Options(tree=False, always=True, max_nodes=24), "hello world", 60)
    assert got.tokens == ref.tokens
    t = got.timings
    assert t["tree_size_max"] >= 16 and t["tokens_per_pass"] >= 8
    control = t["control"]
    assert control["draft_off_passes"] == 0 and min(control["acceptance_by_depth"][:8]) > 0.9


def test_no_node_is_drafted_past_the_tokens_asked_for(tiny_pair):
    """A draft always right, asked for 6 tokens: the prompt's pass gives the first, so one pass drafting 4 nodes
    gives the rest; drafting deeper would cost steps and rows for tokens thrown away."""
    target, draft = tiny_pair[0], tiny_pair[1]["same"]
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    ref = _alone(target, settings, "hello world", 6)
    got = speculate.run(target, settings, draft, Options(tree=False, always=True), "hello world", 6)
    assert got.tokens == ref.tokens
    passes = got.timings["passes"]
    assert len(passes) == 1 and passes[0][2] <= 4 and passes[0][1] == 5, passes


def test_measured_control_turns_a_losing_draft_off_and_probes_it(tiny_pair):
    """A draft that mostly disagrees with the target (its first two layers): the run measures its acceptance and
    turns it off for most passes, probing it again every few; the output is the target's own."""
    target, draft = tiny_pair[0], tiny_pair[1]["shallow"]
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap")
    ref = _alone(target, settings, "The quick brown fox", 60)
    got = speculate.run(target, settings, draft, Options(), "The quick brown fox", 60)
    assert got.tokens == ref.tokens
    control = got.timings["control"]
    assert control["draft_off_passes"] > control["passes"] // 2
    drafted = [p for p in got.timings["passes"] if p[2] > 0]  # passes the draft drafted in: the probes among them
    assert len(drafted) >= 2


def _chi2_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's chi-square statistic that two samples come from one distribution, and its degrees of freedom
    (rare categories pooled so every expected count is at least 5)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    cells, rest = [], [0, 0]
    for k in keys:
        if (a[k] + b[k]) * min(n_a, n_b) / (n_a + n_b) >= 5:
            cells.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for obs, n in ((x, n_a), (y, n_b)):
            exp = total * n / (n_a + n_b)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at a normal quantile z (3.09: p = 0.001), by Wilson and Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tree_output_is_distributed_as_the_target(tiny_pair):
    """At temperature 1 the first three tokens of 400 speculative runs and 400 target runs (different seeds) pass
    a chi-square homogeneity test; a walk that kept the draft's token where the target disagreed would not."""
    target, draft = tiny_pair[0], tiny_pair[1]["same"]
    base = engine.Settings(n_ctx=128, n_batch=64, temp=1.0, strategy="mmap")
    n = 400
    spec, alone = Counter(), Counter()
    with engine.Engine(draft, speculate.draft_settings(base, load(draft))) as d, \
            engine.Engine(target, speculate.target_settings(base)) as t:
        s = speculate.Speculator(t, d, Options(threshold=0.05))
        accepted = 0
        for seed in range(n):
            t.settings.seed = seed
            r = s.generate("hello", 6)  # the first three of six: a pass drafts no deeper than the tokens asked for
            spec[tuple(r.tokens[:3])] += 1
            accepted += r.timings["n_accepted"]
    assert accepted > n // 4  # the walk does descend into the tree
    with engine.Engine(target, base) as t:
        for seed in range(n):
            t.settings.seed = 10_000 + seed
            alone[tuple(t.generate("hello", 3).tokens)] += 1
    stat, df = _chi2_homogeneity(spec, alone)
    assert df >= 3
    assert stat < _chi2_critical(df), (stat, df)


# --- the real models --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_model():
    entry = catalog.CATALOG["qwen2.5-coder-0.5b-instruct"]
    if not catalog.is_present(entry):
        pytest.fail(f"{entry.name} is not fetched: run `flexoffload models fetch` (make test does)")
    return catalog.model_path(entry)


PROMPTS = (
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same backwards."""\n',
    "from typing import List\n\n\ndef mean(xs: List[float]) -> float:\n",
)


@pytest.mark.integration
def test_real_greedy_speculation_equals_the_target_streaming_alone(real_model, draft_model):
    for prompt in PROMPTS:
        common = ["-m", str(real_model), "-p", prompt, "-n", "40", "-c", "512", "-b", "64", "--temp", "0",
                  "--mem", "1.0x", "--json"]
        alone = json.loads(cli("run", *common, check=True).stdout)
        # no history: an earlier prompt's measurements would make the choice between the heads differ by prompt
        tree = json.loads(cli("run", *common, "-md", str(draft_model), "--draft-always", "--no-history",
                              check=True).stdout)
        assert tree["tokens"] == alone["tokens"]
        assert tree["strategy"] == "stream+tree"
        t = tree["timings"]
        for key in ("tokens_per_pass", "acceptance_rate", "tree_size_mean", "n_verify", "draft_s",
                    "target_compute_s", "io_stall_s"):
            assert key in t
        assert t["tokens_per_pass"] > 1.5  # the 0.5B agrees with the 1.5B on code most of the time
        # by default the draft's copy with its head cut to the frequent tokens (predicted faster without a history):
        # resident, 110 MiB less than the whole head's 449
        assert tree["draft"]["path"].endswith(f"-head32768-spare1024-py{sys.version_info[0]}{sys.version_info[1]}.gguf")
        assert 300 < tree["draft"]["resident_mb"] < 400


@pytest.mark.integration
def test_real_speculation_refuses_a_budget_the_draft_leaves_too_little_of(real_model, draft_model):
    """Where the draft leaves the target too little of the budget, -md runs the target alone and says why;
    --draft-always refuses instead, naming the minimum."""
    r = cli("run", "-m", str(real_model), "-md", str(draft_model), "-p", "x", "-n", "2", "--mem", "0.5x", "--json")
    assert r.returncode == 0 and "does not fit beside the target" in r.stderr and "draft" not in json.loads(r.stdout)
    r = cli("run", "-m", str(real_model), "-md", str(draft_model), "-p", "x", "--mem", "0.5x", "--draft-always")
    assert r.returncode != 0
    assert "minimum" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.integration
def test_real_verification_pass_without_tiled_kernels_equals_one_token_passes(real_model):
    """Patch 0009: with the tiled K-quant kernels off, the logits of a token verified in a pass of 9 equal those of
    a one-token pass, bit for bit; with them on (the default from 8 tokens) they differ on this model."""
    settings = speculate.target_settings(engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap"))
    with engine.Engine(real_model, settings) as e:
        toks = e.tokenize(PROMPTS[0])
        toks += e.generate(PROMPTS[0], 10).tokens
        assert tail_logits_apart(e, toks, len(toks) - 9) == 0
        assert tail_logits_apart(e, toks, len(toks) - 9, tiled=-1) > 0


@pytest.mark.parametrize("name,qtype", [("qwen2-tiny", "F32"), ("qwen3moe-tiny", "F32"), ("qwen2-tiny", "Q4_0"),
                                        ("qwen3moe-tiny", "Q4_0"), ("gpt-oss-tiny", "Q4_0")])
def test_a_pass_with_the_batch_kernels_off_equals_one_token_passes(name, qtype, tmp_path):
    """Patch 0023: from 2 tokens a pass, F32, F16, Q8_0 and Q4_0 weights (a MoE's routers are F32 whatever its
    type) are computed by llamafile's sgemm; the switch that turns the tiled kernels off turns it off too, so a pass
    of 3 tokens gives the last one's logits bit for bit as one-token passes do (the MoE test bed's speculation
    differed from its target alone without it). With the switch as upstream has it, F32 weights round otherwise in
    the pass (sgemm's Q4_0 kernel sums as vec_dot does: equal either way)."""
    path = synth.write(tmp_path / f"{name}.gguf", synth.SHAPES[name], qtype=qtype)
    settings = speculate.target_settings(engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap"))
    with engine.Engine(path, settings) as e:
        toks = e.tokenize("a b c d e")
        toks += e.generate("a b c d e", 4).tokens
        assert tail_logits_apart(e, toks, len(toks) - 3) == 0
        if qtype == "F32":
            assert tail_logits_apart(e, toks, len(toks) - 3, tiled=-1) > 0


@pytest.mark.integration
def test_real_draft_reads_its_token_embd_by_rows(draft_model):
    """The 0.5B draft has an output matrix of its own, so its token_embd (89 MiB) is only looked up: it is read a
    row per token, never kept, and the draft's tokens are those of the draft loaded whole."""
    from flexoffload.measure import probe
    from flexoffload.native import stream
    from flexoffload.plan import costmodel
    from flexoffload.plan.planners import resident_bytes

    model = load(draft_model)
    assert specsettings.draft_by_rows(model) == ["token_embd.weight"]
    embd = next(t for t in model.tensors if t.name == "token_embd.weight")
    run = probe.measure(model, 512, 64, 16)
    kept = resident_bytes(model, run) - resident_bytes(model, run, by_rows=[embd.name])
    assert kept == embd.n_bytes - costmodel.rows_memory(embd)
    base = engine.Settings(n_ctx=512, n_batch=64, temp=0.0, strategy="mmap")
    ref = _alone(draft_model, base, PROMPTS[0], 16)
    stream.reset_stats()
    got = _alone(draft_model, speculate.draft_settings(base, model), PROMPTS[0], 16)
    assert got.tokens == ref.tokens
    read = stream.stats().bytes_read
    rows = got.n_prompt + got.n_gen - 1  # every token the draft decoded was looked up once
    assert read == rows * costmodel.row_bytes(embd)


@pytest.mark.integration
@pytest.mark.parametrize("max_nodes", [4, 8, 16])
def test_real_greedy_speculation_equals_the_target_at_any_tree_size(real_model, draft_model, max_nodes):
    """Tree sizes change which kernels and which KV cells a verification uses: output stays the target's."""
    settings = engine.Settings(n_ctx=512, n_batch=64, temp=0.0, strategy="mmap")
    for prompt in PROMPTS:
        ref = _alone(real_model, settings, prompt, 40)
        got = speculate.run(real_model, settings, draft_model, Options(max_nodes=max_nodes, pipeline=False),
                            prompt, 40)
        assert got.tokens == ref.tokens, (max_nodes, prompt)


@pytest.mark.integration
def test_real_speculation_runs_the_target_alone_where_its_history_predicts_that_faster(real_model, draft_model):
    """A stored history of this pair in which the target rejected nearly every drafted token: `run -md` says so and
    runs the target alone; --no-history (or --draft-always) loads the draft all the same, to the same tokens; a
    history that cannot be read is ignored with a note. The session's history file is put back as it was."""
    from flexoffload.api import drafting
    from flexoffload.speculation import history, control as speccontrol

    common = ["-m", str(real_model), "-md", str(draft_model), "-p", "def f():", "-n", "8", "-c", "512", "-b", "64",
              "--temp", "0", "--mem", "0.8x", "--json", "--draft-head", "full"]
    where = drafting.history_file(real_model, draft_model)
    kept = where.read_bytes() if where.is_file() else None
    try:
        history.save(where, history.kind("def f():"), speccontrol.Measured([0.2] * 4, [20.0] * 4, [0.1, 20.0],
                                                                          0.05, 0.05))
        alone = cli("run", *common, "--enforce", check=True)  # decided before the cgroup's run, which has no -md
        assert "the target alone is predicted faster" in alone.stderr and str(where) in alone.stderr
        alone_out = json.loads(alone.stdout)
        assert alone_out["enforced"] and "draft" not in alone_out  # (the free drafters may speculate at 0.8x)
        for flag in ("--no-history", "--draft-always"):
            forced = cli("run", *common, flag, check=True)
            assert "predicted faster" not in forced.stderr
            forced_out = json.loads(forced.stdout)
            assert forced_out["draft"]["path"] == str(draft_model) and forced_out["timings"]["n_verify"] >= 1
            assert forced_out["tokens"] == alone_out["tokens"]
        where.write_text('{"pair": "' + where.stem + '", "kinds": {"code": {"accepted": [1.0, ')  # truncated
        broken = cli("run", *common, check=True)
        assert "ignoring the speculation history" in broken.stderr
        assert json.loads(broken.stdout)["timings"]["n_verify"] >= 1
        assert history.load(where, "code", []) is not None  # the run stored its own in its place
    finally:
        if kept is None:
            where.unlink(missing_ok=True)
        else:
            where.write_bytes(kept)


# --- speculation with -ub, -fa and the KV cache's types ---------------------------------------------------------

@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A synthetic target and a shallower draft with 32-wide attention heads (a quantized KV cache needs rows of
    whole 32-value blocks; synth.TINY's heads are 16 wide)."""
    d = tmp_path_factory.mktemp("spec32")
    shape = replace(synth.TINY, n_head=2, n_head_kv=1)
    target = synth.write(d / "target.gguf", shape=shape, seed=3, output_seed=4, output_scale=10)
    draft = synth.write(d / "draft.gguf", shape=replace(shape, n_layer=2), seed=3, output_seed=4, output_scale=10)
    return target, draft


CONTEXT_KINDS = {
    "ubatch 4": dict(n_ubatch=4),
    "ubatch 16": dict(n_ubatch=16),
    "flash attention on": dict(flash_attn="on"),
    "q8_0 cache": dict(type_k="q8_0", type_v="q8_0"),
    "q4_0 cache, ubatch 8": dict(type_k="q4_0", type_v="q4_0", n_ubatch=8),
    "q8_0 K, bf16 V": dict(type_k="q8_0", type_v="bf16"),
    "flash attention off": dict(flash_attn="off"),
    "flash attention off, ubatch 4": dict(flash_attn="off", n_ubatch=4),
}


@pytest.mark.parametrize("kind", list(CONTEXT_KINDS))
def test_greedy_tree_with_ubatch_flash_attention_and_kv_types_equals_the_target_alone(wide_heads, kind):
    """-ub, -fa on, -ctk and -ctv reach both models' contexts; each verification stays within one ubatch (one pass
    over the weights) and the greedy tokens are the target's alone with the same settings."""
    target, draft = wide_heads
    settings = engine.Settings(n_ctx=256, n_batch=64, temp=0.0, strategy="mmap", **CONTEXT_KINDS[kind])
    for prompt in ("hello world", "abc abc abc"):
        ref = _alone(target, settings, prompt, 40)
        for draft_path, names in ((draft, ()), (None, ("ngram-simple", "recycle"))):
            got = speculate.run(target, settings, draft_path, Options(), prompt, 40, free_drafters=names)
            assert got.tokens == ref.tokens, (kind, prompt, names)
            assert got.timings["tree_size_max"] <= (settings.n_ubatch or settings.n_batch)


def test_the_engines_of_a_speculation_take_the_context_settings(wide_heads):
    target, draft = wide_heads
    settings = engine.Settings(n_ctx=256, n_batch=64, n_ubatch=8, flash_attn="on", type_k="q8_0", type_v="q8_0")
    for made in (speculate.target_settings(settings), speculate.draft_settings(settings, load(draft))):
        assert (made.n_ubatch, made.flash_attn, made.type_k, made.type_v) == (8, "on", "q8_0", "q8_0")
    with engine.Engine(target, speculate.target_settings(settings)) as t:
        assert speculate.Speculator(t, None, Options(), drafters.make(["ngram-simple"], 384)).n_nodes_max == 8


def test_speculation_refuses_what_it_cannot_verify_bit_exactly(wide_heads):
    """Without flash attention a server's pass of several tokens rounds otherwise than one-token passes (see the
    integration test below): -fa off with --rpc refused before loading by check_settings, and by the Speculator
    where llama.cpp's auto turned it off (a layer's attention on another device). On this CPU -fa off verifies."""
    from flexoffload import FlexoffloadError

    target = wide_heads[0]
    with pytest.raises(FlexoffloadError, match="flash attention"):
        specsettings.check_settings(engine.Settings(flash_attn="off", rpc=("127.0.0.1:50052",)))
    with pytest.raises(FlexoffloadError, match="-ub at least 2"):
        specsettings.check_settings(engine.Settings(n_ubatch=1))
    specsettings.check_settings(engine.Settings(flash_attn="auto", n_ubatch=2, type_k="q4_0", type_v="q4_0"))
    specsettings.check_settings(engine.Settings(flash_attn="off"))
    with engine.Engine(target, speculate.target_settings(engine.Settings(n_ctx=256, flash_attn="off"))) as t:
        assert not t.flash_attention
        speculate.Speculator(t, None, Options(), drafters.make(["ngram-simple"], 384))  # asked for: verifies
        t.settings = replace(t.settings, flash_attn="auto")  # as if auto had turned it off
        with pytest.raises(FlexoffloadError, match="flash attention"):
            speculate.Speculator(t, None, Options(), drafters.make(["ngram-simple"], 384))
    with engine.Engine(target, engine.Settings(n_ctx=256)) as t:
        assert t.flash_attention  # auto: on for this CPU backend


@pytest.mark.integration
def test_real_verification_is_bit_exact_with_and_without_flash_attention(real_model):
    """On the 1.5B, a token's logits from a pass of 2 tokens (per-row kernels) equal a one-token pass's with flash
    attention (f16 or q8_0 cache, any ubatch) and without it (its K*Q and V*softmax matmuls row by row: patch
    0023 turns llamafile's sgemm off with the tiled kernels); with sgemm on (the switch as upstream has it) the pass
    without flash attention rounds otherwise (what a server's process does: -fa off with --rpc stays refused)."""

    def logits_apart(tiled: int = 0, **kinds) -> float:
        settings = speculate.target_settings(engine.Settings(n_ctx=512, n_batch=64, temp=0.0, strategy="mmap",
                                                             **kinds))
        with engine.Engine(real_model, settings) as e:
            toks = e.tokenize(PROMPTS[0])
            toks += e.generate(PROMPTS[0], 8).tokens
            return tail_logits_apart(e, toks, len(toks) - 2, tiled)

    assert logits_apart() == 0
    assert logits_apart(type_k="q8_0", type_v="q8_0", n_ubatch=2) == 0
    assert logits_apart(flash_attn="off") == 0
    assert logits_apart(-1, flash_attn="off") > 0


@pytest.mark.integration
def test_real_greedy_speculation_with_ubatch_and_quantized_cache_equals_the_target_alone(real_model, draft_model):
    settings = engine.Settings(n_ctx=512, n_batch=64, n_ubatch=16, temp=0.0, strategy="mmap", flash_attn="on",
                               type_k="q8_0", type_v="q8_0")
    for prompt in PROMPTS:
        ref = _alone(real_model, settings, prompt, 40)
        # the draft kept on: with every weight in memory the measured decision may rightly turn it off
        got = speculate.run(real_model, settings, draft_model, Options(always=True), prompt, 40)
        assert got.tokens == ref.tokens, prompt
        assert got.timings["tokens_per_pass"] > 1.5 and got.timings["tree_size_max"] <= 16


def test_bad_drafting_input_is_one_line_before_loading(tiny_pair, tmp_path):
    """A draft with another vocabulary, a draft larger than the budget, a --draft-max below 1 (or below 2 with
    -md), an unknown --spec-type and a -md that is not a GGUF: each one line and a non-zero exit, nothing loaded."""
    target = tiny_pair[0]
    other = synth.write(tmp_path / "other-vocab.gguf", shape=replace(synth.TINY, n_vocab=512), seed=3)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    common = ["-m", str(target), "-p", "hello", "-n", "4", "--temp", "0"]
    cases = {("-md", str(other)): "another vocabulary",
             ("-md", str(target), "--mem", "64K"): "larger than the whole budget",
             ("-md", str(tiny_pair[1]["shallow"]), "--draft-max", "1"): "--draft-max must be",
             ("--draft-max", "0"): "--draft-max must be",
             ("--draft-max", "-3"): "--draft-max must be",
             ("--spec-type", "bogus"): "unknown --spec-type",
             ("-md", str(text)): "not a GGUF file"}
    for flags, said in cases.items():
        r = cli("run", *common, *flags)
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
        assert len(lines) == 1, (flags, r.stderr)


def test_the_draft_s_q4_0_copy_is_made_once_cached_and_chosen_by_measured_acceptance(private_cache, tmp_path):
    """A draft at F32 beside a Q4_0 target: --draft-quant q4_0 makes its Q4_0 copy once into the cache and reuses
    it; auto runs the file as given until the copy has a history of its own, then the one whose measured acceptance
    predicts it faster; own runs the file. Greedy output is the target's own throughout."""
    from flexoffload.api import drafting
    from flexoffload.speculation import control, history

    shape = synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=1024)
    target = synth.write(tmp_path / "target.gguf", shape, seed=1, output_seed=2, output_scale=10)
    draft = synth.write(tmp_path / "draft.gguf", replace(shape, n_layer=1), qtype="F32", seed=1, output_seed=2,
                        output_scale=10)
    prompt = "def add(a, b):"
    common = ["-m", str(target), "-md", str(draft), "-p", prompt, "-n", "24", "--temp", "0", "-c", "256",
              "--mem", "300M", "--json"]
    alone = json.loads(cli("run", *common[:2], *common[4:], "--spec-type", "none", check=True).stdout)
    made = cli("run", *common, "--draft-quant", "q4_0", "--no-history", check=True)
    assert "making the draft's Q4_0 copy" in made.stderr
    copy = Path(json.loads(made.stdout)["draft"]["path"])
    assert copy.parent == private_cache / "mixed" and copy.is_file()
    assert load(copy).file_size < load(draft).file_size / 4
    assert json.loads(made.stdout)["tokens"] == alone["tokens"]
    again = cli("run", *common, "--draft-quant", "q4_0", "--no-history", check=True)
    assert "making the draft's" not in again.stderr and json.loads(again.stdout)["draft"]["path"] == str(copy)
    first = json.loads(cli("run", *common, check=True).stdout)  # the copy has no history: the file runs
    assert first["draft"]["path"] == str(draft) and first["tokens"] == alone["tokens"]

    def measured(rate):
        # steps and rows nearly free, so the acceptance decides (a tiny model computes as fast as it reads)
        return control.Measured([rate * 20] * 6, [20.0] * 6, [0.1, 20.0], 1e-7, 1e-7)

    kind = history.kind(prompt)
    for file_rate, copy_rate, chosen in ((0.95, 0.1, draft), (0.1, 0.95, copy)):
        history.save(drafting.history_file(target, draft), kind, measured(file_rate))
        history.save(drafting.history_file(target, copy), kind, measured(copy_rate))
        r = cli("run", *common, check=True)
        assert "measured acceptance" in r.stderr, r.stderr
        out = json.loads(r.stdout)
        assert out["draft"]["path"] == str(chosen) and out["tokens"] == alone["tokens"]
    own = json.loads(cli("run", *common, "--draft-quant", "own", check=True).stdout)
    assert own["draft"]["path"] == str(draft) and own["tokens"] == alone["tokens"]

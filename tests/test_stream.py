"""The streaming runtime: every strategy and plan gives the same greedy tokens as upstream mmap, reads each
streamed tensor once per forward pass, and stays inside its budget."""

import json
import os
import shutil

import pytest

from conftest import cli
from flexoffload.gguf import synth
from flexoffload.gguf.model import load

# its real model's profiles and streamed runs record the disk: in a cache of the module's own (conftest)
pytestmark = pytest.mark.usefixtures("module_cache")

# big enough that the FFN tensors are not "small" (always resident), small enough to write in a second
STREAMABLE = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=384, n_ctx_train=1024)
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def streamable_model(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("models") / "streamable.gguf", STREAMABLE)


def run_json(model, prompt, n, *extra):
    """`run --json`, the target alone (no speculation tree: these tests are of its streaming)."""
    r = cli("run", "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0", "-c", "512", "--json",
            "--spec-type", "none", *extra, check=True)
    return json.loads(r.stdout)


def streamed_bytes(model, out):
    m = load(model)
    return sum(t.n_bytes for t in m.tensors if t.n_bytes >= 1 << 20)


@pytest.mark.parametrize("strategy", ["prefetch", "sync"])
def test_stream_everything_matches_mmap(streamable_model, strategy):
    base = run_json(streamable_model, "a b c", 12, "--strategy", "mmap")
    out = run_json(streamable_model, "a b c", 12, "--strategy", strategy)
    assert out["tokens"] == base["tokens"] and out["n_gen"] == 12
    t = out["timings"]
    # every forward pass (the prompt, then one per generated token but the last) reads every streamed tensor once
    passes = 1 + (out["n_gen"] - 1)
    assert t["stream_rereads"] == 0
    per_pass = streamed_bytes(streamable_model, out)
    if strategy == "sync":
        assert t["stream_bytes_read"] == passes * per_pass
    else:  # the prefetcher may already be reading the next pass's first layers when the run ends
        assert passes * per_pass <= t["stream_bytes_read"] < (passes + 1) * per_pass
    assert out["plan"]["window"] == (0 if strategy == "sync" else 3)


@pytest.mark.parametrize("policy", ["balanced", "flexinfer", "attn-first", "ffn-first", "layer"])
def test_every_policy_matches_mmap_under_a_budget(streamable_model, policy):
    m = load(streamable_model)
    base = run_json(streamable_model, "a b c", 8, "--strategy", "mmap")
    from flexoffload.measure import probe
    from flexoffload.memory import budgets

    # runtime, KV cache and compute buffers, then half the weights for resident tensors and the window
    budget = budgets.holding(m, m.weight_bytes // 2, probe.measure(m, 512, 512))
    out = run_json(streamable_model, "a b c", 8, "--mem", str(budget), "--policy", policy)
    assert out["strategy"] == "stream" and out["plan"]["policy"] == policy
    assert out["tokens"] == base["tokens"]
    assert 0 < out["plan"]["streamed_mb"] < m.weight_bytes / 2**20


def test_saved_plan_runs_and_matches(streamable_model, tmp_path):
    plan_dir = tmp_path / "plan"
    cli("plan", "-m", str(streamable_model), "--mem", "200M", "--strategy", "stream", "-c", "512", "-o", str(plan_dir),
        check=True)
    base = run_json(streamable_model, "a b c", 8, "--strategy", "mmap")
    out = run_json(streamable_model, "a b c", 8, "--plan", str(plan_dir))
    assert out["tokens"] == base["tokens"] and out["strategy"] == "stream"


def test_prompt_processing_streams_too(streamable_model):
    """A multi-token batch (the prompt, in ubatches of 16) reads each streamed tensor once per ubatch."""
    prompt = " ".join("abcdefghijklmnopqrstuvwxyz") * 3
    base = run_json(streamable_model, prompt, 4, "--strategy", "mmap", "-b", "16")
    out = run_json(streamable_model, prompt, 4, "--strategy", "prefetch", "-b", "16")
    assert out["tokens"] == base["tokens"]
    ubatches = -(-out["n_prompt"] // 16)
    assert out["timings"]["stream_passes"] == ubatches + out["n_gen"] - 1


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ["stream", "prefetch", "sync"])
def test_real_model_greedy_matches_mmap(real_model, strategy):
    base = run_json(real_model, PROMPT, 16, "--strategy", "mmap")
    out = run_json(real_model, PROMPT, 16, "--strategy", strategy, "--mem", "0.5x")
    assert out["tokens"] == base["tokens"]


@pytest.mark.integration
def test_real_model_stream_under_enforced_budget_records_what_it_read(real_model):
    """At 0.4x, enforced: the run stays in its budget, reads nothing twice, all with O_DIRECT, and reports what it
    read to the disk's record: its bandwidth (its bytes over its read time) raises the device's best, and joins the
    runs plans predict with exactly when its compute waited on reads for IO_BOUND_SHARE of that time. Which of the
    two it was depends on how busy the machine is, so either is accepted, each checked for what it implies."""
    from flexoffload.measure import profiler

    size_mb = real_model.stat().st_size / 2**20
    before = profiler.seen_disk_bw(real_model)
    # streaming asked for: with the file in the page cache (another process's run) the plan may say mmap is as fast
    out = run_json(real_model, PROMPT, 16, "--mem", "0.4x", "--enforce", "--strategy", "stream")
    assert out["enforced"] and out["strategy"] == "stream"
    # the cgroup holds it at the budget whatever the plan, its page cache up to the limit: what the run could not
    # give back is set against the plan's prediction instead
    assert out["peak_unreclaimable_mb"] <= out["planned_mb"] + 1 and out["planned_mb"] <= 0.4 * size_mb + 1
    t = out["timings"]
    assert t["stream_rereads"] == 0 and t["stream_direct"] == t["stream_reads"] > 0
    assert t["stream_bytes_read"] >= profiler.SUSTAINED_BYTES  # long enough to say something of the disk
    read_bw = t["stream_read_gb_s"] * 1e9
    assert profiler.best_disk_bw(real_model) >= read_bw * (1 - 1e-9)
    if t["stream_stall_s"] >= profiler.IO_BOUND_SHARE * t["stream_bytes_read"] / read_bw:
        assert profiler.seen_disk_bw(real_model) == pytest.approx((before + [read_bw])[-profiler.SEEN_KEEP:])
    else:
        assert profiler.seen_disk_bw(real_model) == before


@pytest.mark.integration
def test_real_model_sync_run_does_not_count_toward_the_typical_disk(real_model):
    """sync reads each tensor as compute reaches it (window 0): its compute waits on every read, but its bytes over
    its time are below what the disk gives with reads ahead, so plans do not predict with them."""
    from flexoffload.measure import profiler

    before = profiler.seen_disk_bw(real_model)
    t = run_json(real_model, PROMPT, 4, "--strategy", "sync", "--mem", "0.5x")["timings"]
    assert t["stream_bytes_read"] >= profiler.SUSTAINED_BYTES and t["stream_direct"] == t["stream_reads"]
    assert t["stream_stall_s"] > 0
    assert profiler.seen_disk_bw(real_model) == before


LONG_PROMPT = " ".join("abcdefghijklmnopqrstuvwxyz") * 3 + " aa ab ac ad"  # > 2 chunks of rows in one ubatch


def test_logits_are_bit_exact(streamable_model):
    """Streamed tensors go through the same kernels on the same bytes: logits equal mmap's to the bit. token_embd
    streams too, read by rows (a prompt of more than two chunks of rows, then a row a token)."""
    import numpy as np

    from flexoffload.runtime import engine
    from flexoffload.plan import plans
    from flexoffload.plan.planners import always_resident

    m = load(streamable_model)
    streamed = [t.name for t in m.tensors if t.name not in always_resident(m) or t.kind == "token_embd"]
    patterns = tuple(plans.override_patterns(streamed, [t.name for t in m.tensors]))
    logits = {}
    for strategy, window in (("mmap", 0), ("stream", 3), ("stream", 0)):
        settings = engine.Settings(n_ctx=512, temp=0.0, strategy=strategy, window=window,
                                   streamed_patterns=patterns if strategy == "stream" else ())
        with engine.Engine(streamable_model, settings) as eng:
            eng.generate(LONG_PROMPT, 5)
            logits[strategy, window] = eng.last_logits()
    assert np.array_equal(logits["mmap", 0], logits["stream", 3])
    assert np.array_equal(logits["mmap", 0], logits["stream", 0])


@pytest.mark.parametrize("window", [0, 2])
def test_streamed_token_embd_reads_only_its_rows(streamable_model, window):
    """A streamed token_embd is never read whole: each pass reads the rows it looks up (the prompt's distinct
    tokens, per chunk of 32, then one a token), nothing is read twice, and its pages are not kept."""
    import ctypes

    from flexoffload.plan import costmodel
    from flexoffload.runtime import engine
    from flexoffload.plan import plans
    from flexoffload.native import stream
    from flexoffload.plan.planners import always_resident

    m = load(streamable_model)
    embd = next(t for t in m.tensors if t.kind == "token_embd")
    ffn = [t for t in m.tensors if t.name not in always_resident(m)]
    patterns = tuple(plans.override_patterns([embd.name] + [t.name for t in ffn], [t.name for t in m.tensors]))
    settings = engine.Settings(n_ctx=512, temp=0.0, strategy="stream", window=window, streamed_patterns=patterns)
    with engine.Engine(streamable_model, settings) as eng:
        prompt = eng.tokenize(LONG_PROMPT)
        out = eng.generate(LONG_PROMPT, 6)
        outside = stream.LayerStats()  # the tensors outside the layers: token_embd alone here
        assert stream.api().llama_stream_get_layer_stats(-1, ctypes.byref(outside))
    t = out.timings
    chunks = [prompt[i:i + costmodel.ROWS_CHUNK] for i in range(0, len(prompt), costmodel.ROWS_CHUNK)]
    rows = sum(len(set(c)) for c in chunks) + out.n_gen - 1
    passes = 1 + out.n_gen - 1
    per_pass = sum(x.n_bytes for x in ffn)
    assert len(chunks) >= 3 and t["stream_passes"] == passes and t["stream_rereads"] == 0
    assert outside.bytes_read == rows * costmodel.row_bytes(embd)
    if window == 0:
        assert t["stream_bytes_read"] == passes * per_pass + rows * costmodel.row_bytes(embd)
    else:  # the prefetcher may already be reading the next pass's first layers when the run ends
        assert passes * per_pass <= t["stream_bytes_read"] - rows * costmodel.row_bytes(embd) < (passes + 1) * per_pass
    # the window holds FFN tensors, never token_embd's 216 KiB (its row pages come and go within a lookup)
    assert t["stream_committed_peak"] < (window + 1) * 3 * max(x.n_bytes for x in ffn) + embd.n_bytes // 2


# Loads a copy of the model streaming, generates, truncates the file just past the start of the tensor data
# and generates again; then restores the file and generates once more. Prints what happened as JSON.
_TRUNCATE_MID_RUN = r"""
import json, os, shutil, sys
from flexoffload import FlexoffloadError
from flexoffload.gguf.model import load
from flexoffload.plan import plans
from flexoffload.plan.planners import always_resident
from flexoffload.runtime import engine

src, path, window = sys.argv[1], sys.argv[2], int(sys.argv[3])
shutil.copyfile(src, path)
m = load(path)
streamed = [t.name for t in m.tensors if t.name not in always_resident(m) or t.kind == "token_embd"]
patterns = tuple(plans.override_patterns(streamed, [t.name for t in m.tensors]))
settings = engine.Settings(n_ctx=512, temp=0.0, strategy="stream", window=window, streamed_patterns=patterns)
out = {"streamed": streamed}
with engine.Engine(path, settings) as eng:
    out["before"] = eng.generate("a b c", 3).tokens
    os.truncate(path, min(t.offset for t in m.tensors) + 1)
    try:
        eng.generate("a b c", 3)
        out["error"] = None
    except FlexoffloadError as e:
        out["error"] = str(e)
    shutil.copyfile(src, path)  # same inode, whole again: after the reset the runtime reads it again
    out["after"] = eng.generate("a b c", 3).tokens
print(json.dumps(out))
"""


@pytest.mark.parametrize("window", [3, 0])
def test_read_error_mid_run_is_reported_not_fatal(streamable_model, tmp_path, window):
    """A streamed tensor that cannot be read (file truncated mid-run) raises FlexoffloadError naming the
    tensor and the file: no abort, no hang (the prefetcher, and window 0's synchronous reads)."""
    import subprocess
    import sys

    path = tmp_path / "copy.gguf"
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_MID_RUN, str(streamable_model), str(path), str(window)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    err = out["error"]
    assert err is not None, "the generation on the truncated file did not fail"
    assert str(path) in err and "file is shorter than expected" in err
    assert any(f"'{name}'" in err for name in out["streamed"]), err
    assert len(out["before"]) == 3 and out["after"] == out["before"]


# Loads the model with its large tensors streamed and reports the locked memory (VmLck) after loading and after
# a generation, what the resident and streamed tensors weigh, and the run's resident_locked.
_LOCKED = r"""
import json, resource, sys
from flexoffload.gguf.model import load
from flexoffload.native import stream
from flexoffload.plan import plans
from flexoffload.plan.planners import always_resident
from flexoffload.runtime import engine

def vmlck():
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024

path = sys.argv[1]
m = load(path)
streamed = [t for t in m.tensors if t.name not in always_resident(m)]
patterns = tuple(plans.override_patterns([t.name for t in streamed], [t.name for t in m.tensors]))
settings = engine.Settings(n_ctx=512, temp=0.0, strategy="stream", window=1, streamed_patterns=patterns)
out = {"before": vmlck(), "streamed": sum(t.n_bytes for t in streamed)}
out["resident"] = m.weight_bytes - out["streamed"]
with engine.Engine(path, settings) as eng:
    out["loaded"] = vmlck()
    r = eng.generate("a b c", 3)
    out["after"] = vmlck()
    out["tokens"], out["resident_locked"] = r.tokens, r.timings["resident_locked"]
    out["pool"] = stream.stats().bytes_committed_peak
    out["anon_huge"] = next(int(line.split()[1]) * 1024 for line in open("/proc/self/smaps_rollup")
                            if line.startswith("AnonHugePages:"))
out["memlock_soft"] = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
print(json.dumps(out))
"""


def _locked_run(model, *prefix):
    import subprocess
    import sys

    r = subprocess.run([*prefix, sys.executable, "-c", _LOCKED, str(model)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_resident_tensors_are_locked_streamed_ones_not(streamable_model):
    out = _locked_run(streamable_model)
    assert out["before"] == 0 and out["streamed"] > 4 * out["resident"] / 10
    # the resident tensors' buffer (plus its alignment padding), none of the streamed tensors, window or pool
    assert out["resident"] <= out["loaded"] < out["resident"] + (1 << 20)
    assert out["after"] == out["loaded"]
    assert out["resident_locked"] is True


# Two models streaming in one process (a target and a draft): each has its own statistics, the process's are
# the sum. Only the first one decodes.
_TWO_MODELS = r"""
import json, sys, time
from flexoffload.gguf.model import load
from flexoffload.native import stream
from flexoffload.plan import plans
from flexoffload.plan.planners import always_resident
from flexoffload.runtime import engine

path = sys.argv[1]
m = load(path)
streamed = [t.name for t in m.tensors if t.name not in always_resident(m)]
patterns = tuple(plans.override_patterns(streamed, [t.name for t in m.tensors]))
settings = engine.Settings(n_ctx=512, temp=0.0, strategy="stream", window=1, streamed_patterns=patterns)
with engine.Engine(path, settings) as first, engine.Engine(path, settings) as second:
    r = first.generate("a b c", 4)
    # the I/O threads go on reading the next pass's window after generate returns: read once they are done
    last = None
    for _ in range(200):
        now = {name: vars(stream.stats(e.model)) for name, e in (("first", first), ("second", second))}
        now["process"] = vars(stream.stats())
        if now == last:
            break
        last = now
        time.sleep(0.05)
    out = {**now, "timings": r.timings}
print(json.dumps(out))
"""


def test_statistics_are_per_model(streamable_model):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _TWO_MODELS, str(streamable_model)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    first, second, process = out["first"], out["second"], out["process"]
    assert first["bytes_read"] >= streamed_bytes(streamable_model, None) and first["n_passes"] >= 4
    assert second["bytes_read"] == 0 and second["n_reads"] == 0 and second["t_stall_s"] == 0
    assert process["bytes_read"] == first["bytes_read"] and process["n_reads"] == first["n_reads"]
    assert 0 < out["timings"]["stream_bytes_read"] <= first["bytes_read"]  # the run's, before the read-ahead
    assert sum(first["layer_stall_s"]) <= first["t_stall_s"] + 1e-9 and not any(second["layer_stall_s"])


def _thp_mode() -> str:
    try:
        return open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    except OSError:
        return "never"


@pytest.mark.skipif(_thp_mode() == "never", reason="the kernel has transparent huge pages off")
def test_the_read_pool_is_huge_pages(streamable_model):
    """Patch 0011: the pool the streamed tensors are read into is 2 MiB pages, all but a last part smaller than
    one (O_DIRECT reads into scattered 4 KiB pages go out in block requests of under 1 MiB)."""
    out = _locked_run(streamable_model)
    huge = 2 << 20
    assert out["pool"] >= 2 * huge
    assert out["anon_huge"] >= out["pool"] // huge * huge


_SETPRIV = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]  # root without CAP_IPC_LOCK


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"),
                    reason="needs root, setpriv and prlimit to run without CAP_IPC_LOCK under a memlock limit")
def test_memlock_limit_raised_or_lock_failure_recorded(streamable_model):
    """Without CAP_IPC_LOCK, RLIMIT_MEMLOCK caps what can be locked: the engine raises the soft limit to the
    hard one; where even that is too small, llama.cpp only warns, the run goes on and records it."""
    import resource

    base = _locked_run(streamable_model)
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]  # may only be lowered here
    if hard != resource.RLIM_INFINITY and hard < base["loaded"]:
        pytest.skip(f"the hard RLIMIT_MEMLOCK ({hard} bytes) is below what the resident tensors lock")
    hard_arg = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    raised = _locked_run(streamable_model, "prlimit", f"--memlock=65536:{hard_arg}", *_SETPRIV)
    assert raised["memlock_soft"] == hard
    assert raised["resident_locked"] is True and raised["loaded"] >= raised["resident"]
    capped = _locked_run(streamable_model, "prlimit", "--memlock=65536:65536", *_SETPRIV)
    assert capped["resident_locked"] is False and capped["loaded"] < capped["resident"]
    assert capped["tokens"] == raised["tokens"] == base["tokens"]


# A vocabulary big enough that token_embd and output (8192 x 1024 Q4_0, 4.5 MiB each) are the largest tensors, as
# in real models; with 1 MiB chunks the output is read in 5 chunks of 1792 rows (the last 1024), the FFN tensors
# (1.5 MiB) in 2, the attention ones (<= 576 KiB) whole.
CHUNKY = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=8192, n_ctx_train=1024)
CHUNK = 1 << 20


@pytest.fixture(scope="module")
def chunky_model(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("models") / "chunky.gguf", CHUNKY, output_scale=4.0)


def _decode_all_logits(eng, tokens):
    """Decode tokens as one batch asking logits of every one of them (a multi-column output matmul); a copy."""
    import numpy as np

    lib = eng.lib
    lib.llama_memory_clear(lib.llama_get_memory(eng.ctx), True)
    batch = lib.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert lib.llama_decode(eng.ctx, batch) == 0
        n_vocab = lib.llama_vocab_n_tokens(eng.vocab)
        return np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(eng.ctx, i), shape=(n_vocab,)).copy()
                         for i in range(len(tokens))])
    finally:
        lib.llama_batch_free(batch)


def _chunked_run(model, strategy, window, streamed, chunk_bytes, n_batch_tokens):
    """Greedy generation (the prompt, then decodes of one token), the last logits, the logits of a batch of
    n_batch_tokens tokens each with its own output row, and the stats of the generation."""
    import ctypes

    from flexoffload.runtime import engine
    from flexoffload.plan import plans
    from flexoffload.native import stream

    m = load(model)
    patterns = tuple(plans.override_patterns(streamed, [t.name for t in m.tensors]))
    settings = engine.Settings(n_ctx=512, temp=0.0, strategy=strategy, window=window, chunk_bytes=chunk_bytes,
                               n_outputs=n_batch_tokens, streamed_patterns=patterns if strategy == "stream" else ())
    with engine.Engine(model, settings) as eng:
        out = eng.generate(LONG_PROMPT, 6)
        last = eng.last_logits()
        outside = stream.LayerStats()  # the tensors outside the layers
        if strategy == "stream":
            assert stream.api().llama_stream_get_layer_stats(-1, ctypes.byref(outside))
            assert stream.params().chunk_bytes == chunk_bytes
        prompt = eng.tokenize(LONG_PROMPT)
        batch = _decode_all_logits(eng, prompt[:n_batch_tokens])
    return out, last, batch, outside, prompt


@pytest.mark.parametrize("window", [0, 2])
def test_chunked_output_is_bit_exact_and_holds_a_few_chunks(chunky_model, window):
    """The output matrix streamed in chunks (token_embd too, read by rows): logits equal mmap's to the bit, for
    decode (one column) and a batch of 48 tokens each with logits (a speculation tree's worth of columns); each
    pass reads the whole output once, nothing twice, and its memory is two chunks, not the tensor."""
    import numpy as np

    from flexoffload.plan import costmodel

    m = load(chunky_model)
    output = next(t for t in m.tensors if t.kind == "output")
    embd = next(t for t in m.tensors if t.kind == "token_embd")
    rows = costmodel.chunk_rows(output, CHUNK)
    assert rows == 1664 and costmodel.read_requests(output, CHUNK) == 5
    base, base_last, base_batch, *_ = _chunked_run(chunky_model, "mmap", 0, [], CHUNK, 48)
    out, last, batch, outside, prompt = _chunked_run(chunky_model, "stream", window, [embd.name, output.name], CHUNK,
                                                     48)
    assert out.tokens == base.tokens and out.n_gen == 6
    assert np.array_equal(last, base_last)
    assert np.array_equal(batch, base_batch)
    t = out.timings
    passes = 1 + out.n_gen - 1
    assert t["stream_passes"] == passes and t["stream_rereads"] == 0
    # each pass reads the output whole, once (5 chunk reads), and token_embd's rows (as in the test above)
    rows = sum(len(set(prompt[i:i + costmodel.ROWS_CHUNK])) for i in range(0, len(prompt), costmodel.ROWS_CHUNK)) \
        + out.n_gen - 1
    assert t["stream_bytes_read"] == passes * output.n_bytes + rows * costmodel.row_bytes(embd)
    assert outside.bytes_read == t["stream_bytes_read"] and t["stream_reads"] >= passes * 5
    # the read pool holds two chunks (and their alignment pages), the row pages come and go: not the 4.5 MiB
    assert t["stream_committed_peak"] <= costmodel.held_bytes(output, CHUNK) + 4 * 4096 + costmodel.rows_memory(embd)
    assert t["stream_committed_peak"] < output.n_bytes / 2


# The same with the output tied to token_embd (no output.weight), as gemma3 and the small qwen2 are
TIED_CHUNKY = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=8192, n_ctx_train=1024,
                          arch="qwen2", tied_embeddings=True)


@pytest.mark.parametrize("window", [0, 2])
def test_a_tied_token_embd_streams_by_rows_and_chunks(tmp_path, window):
    """token_embd tied to the output, streamed: lookups read its rows, the output's matmul its chunks (patches
    0004, 0006, 0007); logits equal mmap's to the bit; a pass reads it whole once (the output) and the rows it looks
    up, nothing twice; it holds two chunks and a lookup's pages, as the cost model counts it."""
    import numpy as np

    from flexoffload.plan import costmodel
    from flexoffload.plan.costmodel import Pipeline

    model = synth.write(tmp_path / "tied.gguf", TIED_CHUNKY, output_scale=4.0)
    m = load(model)
    embd = next(t for t in m.tensors if t.kind == "token_embd")
    assert m.tied_embeddings and costmodel.read_requests(embd, CHUNK) == 5
    base, base_last, base_batch, *_ = _chunked_run(model, "mmap", 0, [], CHUNK, 48)
    out, last, batch, outside, prompt = _chunked_run(model, "stream", window, [embd.name], CHUNK, 48)
    assert out.tokens == base.tokens and np.array_equal(last, base_last) and np.array_equal(batch, base_batch)
    t = out.timings
    passes = out.n_gen
    assert t["stream_passes"] == passes and t["stream_rereads"] == 0
    rows = sum(len(set(prompt[i:i + costmodel.ROWS_CHUNK])) for i in range(0, len(prompt), costmodel.ROWS_CHUNK)) \
        + out.n_gen - 1
    assert t["stream_bytes_read"] == passes * embd.n_bytes + rows * costmodel.row_bytes(embd)
    resident = {x.name for x in m.tensors} - {embd.name}
    held = Pipeline(m, chunk_bytes=CHUNK).window_bytes(resident, window)
    assert held == costmodel.held_bytes(embd, CHUNK) + costmodel.rows_memory(embd)
    assert t["stream_committed_peak"] <= held + 4 * 4096 and t["stream_committed_peak"] < embd.n_bytes / 2


@pytest.mark.parametrize("window", [0, 3])
def test_everything_chunked_is_bit_exact(chunky_model, window):
    """Every streamable tensor streamed, the FFN ones and the output in chunks: same logits as mmap for a prompt
    batch (many columns through chunked FFN matmuls), decode and a batch of 48 outputs; each pass reads every
    streamed tensor's bytes once."""
    import numpy as np

    from flexoffload.plan import costmodel
    from flexoffload.plan.planners import always_resident

    m = load(chunky_model)
    streamed = [t for t in m.tensors if t.name not in always_resident(m) or t.kind == "token_embd"]
    assert sum(costmodel.chunk_rows(t, CHUNK) is not None for t in streamed) == 3 * CHUNKY.n_layer + 2
    base, base_last, base_batch, *_ = _chunked_run(chunky_model, "mmap", 0, [], CHUNK, 48)
    out, last, batch, *_ = _chunked_run(chunky_model, "stream", window, [t.name for t in streamed], CHUNK, 48)
    assert out.tokens == base.tokens
    assert np.array_equal(last, base_last) and np.array_equal(batch, base_batch)
    t = out.timings
    passes = 1 + out.n_gen - 1
    per_pass = sum(x.n_bytes for x in streamed if x.kind != "token_embd")
    assert t["stream_passes"] == passes and t["stream_rereads"] == 0
    if window == 0:
        assert passes * per_pass < t["stream_bytes_read"] < passes * per_pass + (1 << 20)
    else:  # the prefetcher may already be reading the next pass's first layers when the run ends
        assert passes * per_pass < t["stream_bytes_read"] < (passes + 1) * per_pass
    # the pool is sized by what the planner counts: the held bytes of window+1 layers
    from flexoffload.plan.costmodel import Pipeline

    held = Pipeline(m, chunk_bytes=CHUNK).window_bytes({x.name for x in m.tensors} - {x.name for x in streamed},
                                                       window)
    assert t["stream_committed_peak"] <= held + (1 << 20)


def test_the_window_reaches_past_a_resident_layer(chunky_model):
    """The first and last layers kept resident, window 1: the runtime's ring has no group for a resident layer, so
    the layer before the last and the output (read whole) are in flight together; the planner counts that."""
    from flexoffload.plan.costmodel import Pipeline

    m = load(chunky_model)
    last, whole = CHUNKY.n_layer - 1, 64 << 20
    streamed = [t.name for t in m.tensors if t.kind == "output" or (t.kind.startswith("attn_") and 0 < t.layer < last
                                                                     and t.kind != "attn_norm")]
    out, *_ = _chunked_run(chunky_model, "stream", 1, streamed, whole, 1)
    pipe = Pipeline(m, chunk_bytes=whole)
    resident = {t.name for t in m.tensors} - set(streamed)
    held = pipe.window_bytes(resident, 1)
    output = next(t for t in m.tensors if t.kind == "output")
    assert held == output.n_bytes + pipe.stages(resident)[last - 1].held_bytes  # blk.0 .. blk.3, output
    assert held - 16 * 4096 <= out.timings["stream_committed_peak"] <= held + 16 * 4096


@pytest.mark.integration
def test_real_model_chunked_logits_are_bit_exact(real_model):
    """The real 1.5B's K-quants (the tiled kernels for 8 or more columns): with 4 MiB chunks the output (Q6_K) and
    the FFN down matrices (Q6_K/Q4_K, 8-11 MiB) stream in chunks; logits of a batch of 48 tokens each with its own
    output row, and the last decoded token's, equal mmap's to the bit."""
    import numpy as np

    m = load(real_model)
    streamed = [t.name for t in m.tensors if t.kind in ("output", "ffn_down")]
    runs = {}
    for strategy in ("mmap", "stream"):
        out, last, batch, *_ = _chunked_run(real_model, strategy, 1, streamed, 4 << 20, 48)
        runs[strategy] = out.tokens, last, batch
    assert runs["stream"][0] == runs["mmap"][0]
    assert np.array_equal(runs["stream"][1], runs["mmap"][1]) and np.array_equal(runs["stream"][2], runs["mmap"][2])


@pytest.mark.integration
def test_real_model_plans_and_runs_at_0_3x(real_model, tmp_path):
    """The output matrix (183 MiB) streams in chunks, two in flight: 0.3x of the 1.5B (320 MiB; the minimum was
    430 MiB with it read whole) plans, and runs under the enforced budget with mmap's greedy tokens, reading every
    streamed tensor once a pass."""
    r = cli("plan", "-m", str(real_model), "--mem", "0.3x", "-o", str(tmp_path / "plan"), "--json", check=True)
    plan = json.loads(r.stdout)
    assert "output.weight" in plan["streamed"] and plan["memory"]["total"] <= plan["budget"]
    base = run_json(real_model, PROMPT, 8, "--strategy", "mmap")
    out = run_json(real_model, PROMPT, 8, "--mem", "0.3x", "--enforce", "--strategy", "stream")  # whatever is cached
    size_mb = real_model.stat().st_size / 2**20
    assert out["enforced"] and out["strategy"] == "stream" and out["tokens"] == base["tokens"]
    assert out["peak_unreclaimable_mb"] <= out["planned_mb"] + 1 and out["planned_mb"] <= 0.3 * size_mb + 1
    t = out["timings"]
    assert t["stream_rereads"] == 0 and t["stream_passes"] == out["n_gen"]
    assert t["stream_committed_peak"] < 80 << 20  # the window of the plan, not the 183 MiB output

"""The streaming runtime: every strategy and plan gives the same greedy tokens as upstream mmap, reads each
streamed tensor once per forward pass, and stays inside its budget."""

import json
import os
import shutil

import pytest

from conftest import cli
from flexoffload import synth
from flexoffload.model import load

# big enough that the FFN tensors are not "small" (always resident), small enough to write in a second
STREAMABLE = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=384, n_ctx_train=1024)
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def streamable_model(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("models") / "streamable.gguf", STREAMABLE)


def run_json(model, prompt, n, *extra):
    r = cli("run", "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0", "-c", "512", "--json", *extra,
            check=True)
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
    from flexoffload import budget as budgets

    # runtime, KV cache and compute buffers, then half the weights for resident tensors and the window
    budget = budgets.RUNTIME_OVERHEAD + m.kv_cache_bytes(512) + budgets.compute_buffer_bytes(m, 512, 512) \
        + m.weight_bytes // 2
    out = run_json(streamable_model, "a b c", 8, "--mem", str(budget), "--policy", policy)
    assert out["strategy"] == "stream" and out["plan"]["policy"] == policy
    assert out["tokens"] == base["tokens"]
    assert 0 < out["plan"]["streamed_mb"] < m.weight_bytes / 2**20


def test_saved_plan_runs_and_matches(streamable_model, tmp_path):
    plan_dir = tmp_path / "plan"
    cli("plan", "-m", str(streamable_model), "--mem", "200M", "-c", "512", "-o", str(plan_dir), check=True)
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
def test_real_model_stream_under_enforced_budget(real_model):
    out = run_json(real_model, PROMPT, 16, "--mem", "0.4x", "--enforce")
    size_mb = real_model.stat().st_size / 2**20
    assert out["enforced"] and out["strategy"] == "stream"
    assert out["peak_mem_mb"] <= 0.4 * size_mb + 1
    assert out["timings"]["stream_rereads"] == 0 and out["timings"]["stream_direct"] > 0


LONG_PROMPT = " ".join("abcdefghijklmnopqrstuvwxyz") * 3 + " aa ab ac ad"  # > 2 chunks of rows in one ubatch


def test_logits_are_bit_exact(streamable_model):
    """Streamed tensors go through the same kernels on the same bytes: logits equal mmap's to the bit. token_embd
    streams too, read by rows (a prompt of more than two chunks of rows, then a row a token)."""
    import numpy as np

    from flexoffload import engine, plan as plans
    from flexoffload.planners import always_resident

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

    from flexoffload import costmodel, engine, plan as plans, stream
    from flexoffload.planners import always_resident

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
from flexoffload import FlexoffloadError, engine, plan as plans
from flexoffload.model import load
from flexoffload.planners import always_resident

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
from flexoffload import engine, plan as plans
from flexoffload.model import load
from flexoffload.planners import always_resident

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

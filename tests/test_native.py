"""The native build itself: prompt processing with upstream's defaults (weight repacking on, AMX where the
CPU has it) must not crash; GCC 12 used to drop the AMX tile config's stores (patch 0001)."""

import subprocess

import pytest

from flexoffload import native

# it streams or profiles the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")

PROMPT = "def add(a, b):\n    return a + b\n" * 20  # ~240 tokens: several ubatches of matmuls


@pytest.mark.integration
def test_prompt_processing_with_repacking_does_not_crash(real_model):
    cmd = [str(native.tool("llama-completion")), "-m", str(real_model), "-p", PROMPT, "-n", "4", "--temp", "0",
           "-c", "1024", "-t", "2", "-no-cnv", "--simple-io", "-v"]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    repacked = [line for line in r.stderr.splitlines()
                if "model buffer size" in line and ("AMX" in line or "REPACK" in line)]
    assert repacked and not any(" 0.00 MiB" in line for line in repacked[-1:]), "weights were not repacked"
    assert "prompt eval time" in r.stderr


# a token's logits decoded alone, and decoded beside the token before it, after a history of HISTORY tokens
LOGITS_ALONE_AND_IN_A_PAIR = """
import sys
import numpy as np
from flexoffload.runtime import engine
s = engine.Settings(n_ctx=1024, n_batch=1024, temp=0.0, n_threads=2, strategy="mmap")
with engine.Engine(sys.argv[1], s) as e:
    history = [10 + i % 300 for i in range({history})]
    out = []
    for passes in ([[7], [8]], [[7, 8]]):
        e.lib.llama_memory_clear(e.lib.llama_get_memory(e.ctx), True)
        for tokens in [history] + passes:
            e._decode(tokens)
        out.append(e.last_logits())
print(float(np.abs(out[0] - out[1]).max()))
"""

# a lone token's logits after a history of HISTORY tokens, computed with 1 thread and with 2
LOGITS_ON_ONE_THREAD_AND_TWO = """
import sys
import numpy as np
from flexoffload.runtime import engine
out = []
for n_threads in (1, 2):
    s = engine.Settings(n_ctx=1024, n_batch=1024, temp=0.0, n_threads=n_threads, strategy="mmap")
    with engine.Engine(sys.argv[1], s) as e:
        for tokens in ([10 + i % 300 for i in range({history})], [7], [8]):
            e._decode(tokens)
        out.append(e.last_logits())
print(float(np.abs(out[0] - out[1]).max()))
"""


def _max_difference(script: str, model, split: str) -> float:
    """What script prints for model, run in a child with GGML_CPU_SPLIT_KV=split (read once per process)."""
    import os
    import sys

    r = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "GGML_CPU_SPLIT_KV": split})
    assert r.returncode == 0, r.stderr[-2000:]
    return float(r.stdout.split()[-1])


def _small_model(tmp_path):
    from flexoffload.gguf import synth

    return synth.write(tmp_path / "m.gguf", synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                                                        n_vocab=384, n_ctx_train=1024))


@pytest.mark.parametrize("history", [200, 600])
def test_a_token_s_logits_do_not_depend_on_the_tokens_sharing_its_pass(tmp_path, history):
    """Speculation verifies many tokens in one pass and must give a one-token-at-a-time run's output bit for bit.
    From 512 KV cells upstream splits a lone token's attention across the threads, which rounds differently
    (patch 0016): flexoffload turns that off; with it on (GGML_CPU_SPLIT_KV=1) the same check sees the difference."""
    model, script = _small_model(tmp_path), LOGITS_ALONE_AND_IN_A_PAIR.format(history=history)
    assert _max_difference(script, model, "0") == 0.0
    if history + 2 > 256:  # the KV view (padded to 256 cells) is 512 or more: upstream's split rounds otherwise
        assert _max_difference(script, model, "1") > 0.0


def test_a_token_s_logits_do_not_depend_on_the_thread_count(tmp_path):
    """Upstream's split gives each thread a share of the cells, so past 512 cells its output depends on -t as well;
    without the split it does not."""
    model, script = _small_model(tmp_path), LOGITS_ON_ONE_THREAD_AND_TWO.format(history=600)
    assert _max_difference(script, model, "0") == 0.0
    assert _max_difference(script, model, "1") > 0.0

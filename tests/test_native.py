"""The native build itself: prompt processing with upstream's defaults (weight repacking on, AMX where the
CPU has it) must not crash; GCC 12 used to drop the AMX tile config's stores (patch 0001)."""

import subprocess

import pytest

from flexoffload import native

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

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexoffload.gguf import models
from flexoffload.gguf import synth


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 3-layer llama-shaped Q4_0 GGUF with random weights and a 384-token vocabulary (~100 KB)."""
    return synth.write(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real Qwen2.5-Coder-1.5B-Instruct; `make test` fetches it first."""
    entry = models.CATALOG[models.DEFAULT_MODEL]
    if not models.is_present(entry):
        pytest.fail(f"{entry.name} is not fetched: run `flexoffload models fetch` (make test does)")
    return models.model_path(entry)


def cli(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """`flexoffload ARGS` in a fresh process, as a user runs it."""
    r = subprocess.run([sys.executable, "-m", "flexoffload", *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and r.returncode != 0:
        raise AssertionError(f"flexoffload {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def write_gguf(path: Path, arch: str, tensors: bool = True) -> Path:
    """A minimal GGUF of architecture arch: one F32 token_embd (or no tensor at all: a vocabulary-only file)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    tokens, scores, types = synth._vocab(300)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if tensors:
        w.add_tensor("token_embd.weight", np.zeros((300, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

"""A model's first layers as a GGUF of their own (gguf/slices.py), and the compute of a model too large for memory
timed on two of them (measure/profiler.sliced_speed)."""

import os

import gguf
import numpy as np
import pytest

from flexoffload.gguf import slices, synth
from flexoffload.gguf.model import load
from flexoffload.measure import profiler
from flexoffload.runtime import engine


@pytest.mark.parametrize("name", ["qwen2-tiny", "gemma3-tiny", "gpt-oss-tiny"])
def test_a_slice_is_the_models_first_layers_and_runs(name, tmp_path):
    src = synth.write(tmp_path / "m.gguf", synth.SHAPES[name])
    n = synth.SHAPES[name].n_layer
    part = slices.write(src, tmp_path / "part.gguf", n - 1)
    whole, cut = load(src), load(part)
    assert cut.n_layer == n - 1 and cut.arch == whole.arch and cut.n_vocab == whole.n_vocab
    want = {t.name for t in whole.tensors if t.layer is None or t.layer < n - 1}
    assert {t.name for t in cut.tensors} == want
    a = {t.name: t for t in gguf.GGUFReader(str(src)).tensors}
    for t in gguf.GGUFReader(str(part)).tensors:  # the same bytes
        assert np.array_equal(np.asarray(t.data), np.asarray(a[t.name].data))
    with engine.Engine(part, engine.Settings(n_ctx=128, temp=0, strategy="mmap")) as e:
        assert e.generate("a b", 4).tokens
    for bad in (0, n + 1):
        with pytest.raises(ValueError, match="layers"):
            slices.write(src, tmp_path / "bad.gguf", bad)


def test_a_model_too_large_for_memory_is_timed_on_two_slices(tmp_path, monkeypatch):
    """A slice's token "takes" 10 ms plus 2 ms a layer (a fake in place of the in-memory timing): the whole token
    is the rest plus every layer's, and the slices are gone afterwards."""
    src = synth.write(tmp_path / "m.gguf", synth.SHAPES["llama-moe-tiny"])
    n = synth.SHAPES["llama-moe-tiny"].n_layer
    timed = []

    def fake(path, n_threads, n_tokens=24):
        depth = load(path).n_layer
        timed.append(depth)
        return 0.010 + 0.002 * depth

    monkeypatch.setattr(profiler, "token_seconds", fake)
    monkeypatch.setattr(profiler, "memory_bytes", lambda: 10 * os.path.getsize(src))
    assert profiler.sliced_speed(src, 2) == pytest.approx(1.0 / (0.010 + 0.002 * n))
    assert len(timed) == 2 and timed[0] < timed[1] <= n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # the slices removed


def test_depths_fit_the_room_and_a_model_that_cannot_is_refused(tmp_path):
    m = load(synth.write(tmp_path / "m.gguf", synth.SHAPES["tiny"]))
    layer = sum(t.n_bytes for t in m.tensors if t.layer == 0)
    rest = sum(t.n_bytes for t in m.tensors if t.layer is None)
    assert slices.depths(m, rest + 2 * layer) == (1, 2)
    assert slices.depths(m, rest + 10 * layer) == (m.n_layer // 2, m.n_layer)
    with pytest.raises(ValueError, match="not even two"):
        slices.depths(m, rest + layer)

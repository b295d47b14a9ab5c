"""A model's first layers as a GGUF of their own (gguf/slices.py), and the compute of a model too large for memory
timed on one of them and scaled by the cost model (measure/profiler.sliced_speed)."""

import dataclasses
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


@pytest.mark.parametrize("share", [10, 1.4])  # room for every layer; for about two thirds of them
def test_a_model_too_large_for_memory_is_timed_on_a_slice_and_scaled(tmp_path, monkeypatch, share):
    """A slice's token "takes" 10 ms plus 2 ms a layer (a fake in place of the in-memory timing): the slice as deep
    as half the memory holds is timed, once, and the cost model calibrated on it gives the whole model's token
    (the slice the whole model: its own time); the slice is gone afterwards."""
    from flexoffload.plan.costmodel import Profile, compute_seconds

    shape = dataclasses.replace(synth.SHAPES["llama-moe-tiny"], n_layer=6)
    src = synth.write(tmp_path / "m.gguf", shape)
    n = shape.n_layer
    timed = []

    def fake(path, n_threads, n_tokens=24):
        depth = load(path).n_layer
        timed.append(depth)
        return 0.010 + 0.002 * depth

    monkeypatch.setattr(profiler, "token_seconds", fake)
    monkeypatch.setattr(profiler, "memory_bytes", lambda: int(share * os.path.getsize(src)))
    got = profiler.sliced_speed(src, 2)
    [deep] = timed
    assert (deep == n) == (share == 10)
    if deep == n:
        assert got == pytest.approx(1.0 / (0.010 + 0.002 * n))
    else:
        (tmp_path / "part").mkdir()
        part = load(slices.write(src, tmp_path / "part" / "p.gguf", deep))
        calibrated = Profile.calibrated(part, tok_s=1.0 / (0.010 + 0.002 * deep), disk_bw=1.0)
        assert got == pytest.approx(1.0 / compute_seconds(load(src), calibrated)) and got < 1.0 / fake(part.path, 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["m.gguf"]  # the slice removed


def test_a_long_prompt_of_a_model_too_large_for_memory_is_timed_on_two_slices(tmp_path, monkeypatch):
    """A slice's prompt "takes" 3 s plus 0.5 s a layer (a fake in place of the in-memory timing): two slices are
    timed, their slope a layer's seconds, and the whole model's prompt is the deeper slice's plus a slope for each
    layer below it; a file that fits is timed whole; the slices are gone afterwards."""
    shape = dataclasses.replace(synth.SHAPES["llama-moe-tiny"], n_layer=8)
    src = synth.write(tmp_path / "m.gguf", shape)
    timed = []

    def fake(path, n_threads, prompt, times=3):
        depth = load(path).n_layer
        timed.append(depth)
        return 3.0 + 0.5 * depth

    monkeypatch.setattr(profiler, "first_token_seconds", fake)
    monkeypatch.setattr(profiler, "memory_bytes", lambda: int(1.2 * os.path.getsize(src)))
    assert profiler.prompt_seconds(src, 2, "a b c") == pytest.approx(3.0 + 0.5 * shape.n_layer)
    shallow, deep = timed
    assert 1 <= shallow < deep < shape.n_layer  # two slices, neither the whole model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    monkeypatch.setattr(profiler, "memory_bytes", lambda: 10 * os.path.getsize(src))
    assert profiler.prompt_seconds(src, 2, "a b c") == pytest.approx(3.0 + 0.5 * shape.n_layer)
    assert timed[2:] == [shape.n_layer]


def test_depths_fit_the_room_and_a_model_that_cannot_is_refused(tmp_path):
    m = load(synth.write(tmp_path / "m.gguf", synth.SHAPES["tiny"]))
    layer = sum(t.n_bytes for t in m.tensors if t.layer == 0)
    rest = sum(t.n_bytes for t in m.tensors if t.layer is None)
    assert slices.depths(m, rest + 2 * layer) == (1, 2)
    assert slices.depths(m, rest + 10 * layer) == (m.n_layer // 2, m.n_layer)
    with pytest.raises(ValueError, match="not even two"):
        slices.depths(m, rest + layer)


def test_prefill_rates_of_a_model_too_large_for_memory_come_from_two_slices(tmp_path, monkeypatch, private_cache):
    """A pass of u tokens "takes" u * (1 ms + 0.25 ms a layer) on a slice (a fake in place of the in-memory
    timing): the rates of a file over half the memory are timed on two slices and scaled to every layer, exactly
    for passes that grow with the layers so; the slices are gone afterwards, the rates cached."""
    from flexoffload.measure import ubatches

    shape = dataclasses.replace(synth.SHAPES["llama-moe-tiny"], n_layer=8)
    src = synth.write(tmp_path / "m.gguf", shape)
    timed = []

    def fake(path, sizes, n_threads):
        depth = load(path).n_layer
        timed.append(depth)
        return {u: u * (1e-3 + 0.25e-3 * depth) for u in sizes}

    monkeypatch.setattr(ubatches, "_timed", fake)
    monkeypatch.setattr(profiler, "memory_bytes", lambda: int(1.2 * os.path.getsize(src)))
    rates = ubatches.rates(load(src), 2, up_to=128)
    assert len(timed) == 2 and max(timed) < shape.n_layer
    assert rates and all(r == pytest.approx(u * (1e-3 + 0.25e-3 * shape.n_layer)) for u, r in rates.items())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "private-cache") == ["m.gguf"]
    assert ubatches.rates(load(src), 2, up_to=128) == rates and len(timed) == 2  # cached

"""A context's memory beside the weights, as llama.cpp reports it (footprint.py)."""

import pytest

from flexoffload import FlexoffloadError, footprint
from flexoffload.model import load


def test_kv_cache_is_what_llama_cpp_allocates(tiny_model):
    """K and V, f16, for every layer of the tiny llama: n_ctx (padded to 256 by llama.cpp) x n_head_kv x head_dim."""
    m = load(tiny_model)
    fp = footprint.probe(str(tiny_model), 256, 32, 1, 1)
    logged = 0.01 * (1 << 20)  # llama.cpp logs its sizes to 0.01 MiB; footprint rounds them up
    assert 0 <= fp.kv_cache - 2 * 3 * 256 * 2 * 16 * 2 <= logged
    assert 0 <= footprint.probe(str(tiny_model), 512, 32, 1, 1).kv_cache - 2 * 3 * 512 * 2 * 16 * 2 <= logged
    # one f32 logits row of the vocabulary (llama.cpp rounds its buffers up, so at least that)
    assert fp.output >= 4 * m.n_vocab
    assert fp.compute > 0 and fp.vocab >= 0


def test_more_outputs_and_a_larger_batch_take_more(tiny_model):
    one = footprint.probe(str(tiny_model), 256, 32, 1, 1)
    assert footprint.probe(str(tiny_model), 256, 32, 128, 1).output >= 128 * 4 * load(tiny_model).n_vocab
    assert footprint.probe(str(tiny_model), 256, 256, 1, 1).compute > one.compute


def test_measure_caches_per_model_and_settings(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path))
    m = load(tiny_model)
    first = footprint.measure(m, 256, 32)
    assert list((tmp_path / "footprints").glob("*.json"))
    assert footprint.measure(m, 256, 32) == first  # from the cache, the same
    assert footprint.measure(m, 512, 32).kv_cache > first.kv_cache


def test_a_model_llama_cpp_cannot_load_is_one_error(tmp_path):
    """A GGUF whose architecture llama.cpp does not know: the probe's error names the model, no traceback."""
    from conftest import write_gguf

    path = write_gguf(tmp_path / "unknown.gguf", "no-such-arch")
    with pytest.raises(FlexoffloadError, match="unknown.gguf"):
        footprint.measure(load(path), 256, 32)

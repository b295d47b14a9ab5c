"""A context's memory beside the weights, as llama.cpp reports it (measure/probe.py's probe, memory/probe.py's
Footprint)."""

import ctypes
import re

import pytest

from flexoffload import FlexoffloadError
from flexoffload import native
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import probe
from flexoffload.memory.footprint import KERNEL_FIXED

# its streamed runs over a 256k vocabulary can read past diskrecord.SUSTAINED_BYTES, which records the disk: what it
# records is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")


def sampling_bytes(n_vocab: int) -> int:
    """A sampled token's scratch, from llama.cpp's own types: its candidate array (a llama_token_data, as the
    bindings declare it from llama.h, a token) and a copy of the logits (a float a token)."""
    lib = native.llama_cpp()
    return n_vocab * (ctypes.sizeof(lib.llama_token_data) + ctypes.sizeof(ctypes.c_float))


def test_kv_cache_output_and_sampling_are_what_llama_cpp_allocates(tiny_model):
    """K and V, f16, for every layer of the tiny llama: n_ctx (padded to 256 by llama.cpp) x n_head_kv x head_dim;
    a logits row of the vocabulary; the sampling scratch of llama.cpp's types for its 384 tokens."""
    m = load(tiny_model)
    fp = probe.probe(str(tiny_model), 256, 32, 1, 1)
    logged = 0.01 * (1 << 20)  # llama.cpp logs its sizes to 0.01 MiB; footprint rounds them up
    assert 0 <= fp.kv_cache - 2 * 3 * 256 * 2 * 16 * 2 <= logged
    assert 0 <= probe.probe(str(tiny_model), 512, 32, 1, 1).kv_cache - 2 * 3 * 512 * 2 * 16 * 2 <= logged
    # one f32 logits row of the vocabulary (llama.cpp rounds its buffers up, so at least that)
    assert fp.output >= 4 * m.n_vocab
    # the heap of a model this small may fit in what the allocator already had (grown by nothing): heap_grows_with...
    assert fp.compute > 0 and fp.heap >= 0 and fp.runtime > 0 and fp.code > 0
    assert fp.sampling == sampling_bytes(synth.TINY.n_vocab)


def test_more_outputs_and_a_larger_batch_take_more(tiny_model):
    one = probe.probe(str(tiny_model), 256, 32, 1, 1)
    assert probe.probe(str(tiny_model), 256, 32, 128, 1).output >= 128 * 4 * load(tiny_model).n_vocab
    assert probe.probe(str(tiny_model), 256, 256, 1, 1).compute > one.compute


def test_the_heap_grows_with_the_vocabulary(tmp_path, monkeypatch):
    """A 256k-token vocabulary's token texts, map and scores are tens of MiB of heap; a 32-token one's nearly none.
    Probed in a fresh process as a plan does: in pytest's, the allocator may hand back what earlier tests freed,
    and the heap would seem to grow by nothing."""
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path))
    big = probe.measure(load(synth.write(tmp_path / "big.gguf", synth.SHAPES["gemma3-tiny-256k"])), 256, 32)
    small = probe.measure(load(synth.write(tmp_path / "small.gguf", synth.SHAPES["qwen2-tiny"])), 256, 32)
    n_vocab = synth.SHAPES["gemma3-tiny-256k"].n_vocab
    assert big.heap > small.heap + 16 * n_vocab  # at least the 16 bytes a token's score and type take
    assert big.sampling == sampling_bytes(n_vocab)


def test_measure_caches_per_model_and_settings(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path))
    m = load(tiny_model)
    first = probe.measure(m, 256, 32)
    assert list((tmp_path / "footprints").glob("*.json"))
    assert probe.measure(m, 256, 32) == first  # from the cache, the same
    assert probe.measure(m, 512, 32).kv_cache > first.kv_cache


def test_a_model_llama_cpp_cannot_load_is_one_error(tmp_path):
    """A GGUF whose architecture llama.cpp does not know: the probe's error names the model, no traceback."""
    from conftest import write_gguf

    path = write_gguf(tmp_path / "unknown.gguf", "no-such-arch")
    with pytest.raises(FlexoffloadError, match="unknown.gguf"):
        probe.measure(load(path), 256, 32)


@pytest.mark.parametrize("shape,spec_type", [("qwen2-tiny", "none"), ("gemma3-tiny-256k", "none"),
                                             ("phi3-tiny", "none"), ("gemma3-tiny-256k", "ngram-simple,recycle")])
def test_the_plan_predicts_what_the_run_cannot_give_back(tmp_path, shape, spec_type):
    """Streamed at its minimum budget and at a roomier one, in a cgroup with room to spare: the cgroup's own peak
    counter (v2 memory.peak, v1 memory.max_usage_in_bytes: the kernel's, which no short peak escapes, as a sampler
    polling every 20 ms can on a busy machine) is never above the plan's prediction of what the run cannot give
    back, and within 10 % of it (and the fixed kernel reserve: 7 % of these 30 MiB runs; scripts/matrix.py checks
    the 10 % at realistic sizes). The counter holds page cache too: the model file is read into the page cache
    first by this process, so its pages are charged here, not to the run's cgroup (a run's load reads the resident
    tensors through the page cache, then gives it back), and the counter holds what the run itself held."""
    from flexoffload import api
    from flexoffload.bench.sweep import DEFAULT_PROMPT
    from flexoffload.measure import profiler
    from flexoffload.plan import planners

    path = synth.write(tmp_path / f"{shape}.gguf", synth.SHAPES[shape])
    m = load(path)
    floor = planners.run_minimum(m, probe.measure(m, 512, 64))
    if spec_type != "none":  # a tree's logits rows and sequences, and the drafters' tables, on top: the minimum the
        # refusal of a smaller budget names
        with pytest.raises(FlexoffloadError, match=r"the minimum is \d+ MiB") as refused:
            api.prepare(api.Request(model=str(path), prompt=DEFAULT_PROMPT * 2, n_ctx=512, n_batch=64, mem=str(floor),
                                    strategy="stream", spec_type=spec_type))
        floor = int(re.search(r"the minimum is (\d+) MiB", str(refused.value)).group(1)) << 20
    for budget in (floor, floor + m.weight_bytes // 2):
        # the target alone, and with the free drafters' trees over a 256k vocabulary (32 logits rows a pass, Token
        # Recycling learning from them): --spec-type auto chooses by the machine's profile, so each is given
        request = api.Request(model=str(path), prompt=DEFAULT_PROMPT * 2, n_predict=8, n_ctx=512, n_batch=64,
                              temp=0, mem=str(budget), strategy="stream", spec_type=spec_type)
        prepared = api.prepare(request)
        predicted = prepared.plan.memory.unreclaimable
        profiler.warm_page_cache(path)  # the previous run gave the file's cache back: charged here again
        result = api.run_in_cgroup(prepared, budget + (512 << 20), timeout=300)
        assert result["peak_source"] == "cgroup"
        peak, sampled = result["peak_mem_mb"] * (1 << 20), result["peak_unreclaimable_mb"] * (1 << 20)
        assert sampled <= peak  # the counter is the cgroup's, of everything charged to it (the sampler's may miss)
        # with trees, never above: the logits rows are counted whole, and a short run's trees touch fewer of them
        closest = 1.1 * peak + KERNEL_FIXED if spec_type == "none" else float("inf")
        assert peak <= predicted <= closest, \
            (shape, budget, predicted / (1 << 20), peak / (1 << 20), sampled / (1 << 20))

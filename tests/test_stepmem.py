"""Per-step memory (memory/stepmem.py, measure/dryrun.py): llama.cpp's dry run reports what a real context
allocates, ubatch and attention path change the compute buffer as the graph says, the longest prompt a budget holds
is the last that fits, and a prefill in ubatches of 16 and of 32 gives the greedy tokens of one pass over the whole
prompt."""

import dataclasses
import json

import pytest

from conftest import cli
from flexoffload import api
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import probe
from flexoffload.measure import dryrun as measured_stepmem
from flexoffload.memory import stepmem


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """qwen2-tiny trained for 32768 tokens: 384 bytes of KV cache a token, so the budget sets the longest prompt."""
    shape = dataclasses.replace(synth.SHAPES["qwen2-tiny"], n_ctx_train=32768)
    return load(synth.write(tmp_path_factory.mktemp("m") / "qwen2.gguf", shape))


def test_the_dry_run_reports_what_a_real_context_allocates(qwen2):
    real = probe.measure(qwen2, 256, 64)  # a context made for real, weights streamed
    dry = measured_stepmem.buffers(qwen2, [stepmem.Setting(256, 64, "auto")])[0]
    assert (dry.kv_cache, dry.compute) == (real.kv_cache, real.compute)


def test_ubatch_and_attention_path_size_the_compute_buffer(qwen2):
    small, large, off = measured_stepmem.buffers(qwen2, [stepmem.Setting(512, 32, "on"),
                                                          stepmem.Setting(512, 256, "on"),
                                                          stepmem.Setting(512, 256, "off")])
    assert small.kv_cache == large.kv_cache == off.kv_cache  # the cache is the context's, whatever the ubatch
    assert small.compute < large.compute < off.compute  # without flash attention the scores are held whole
    assert stepmem.work_bytes(qwen2, 256, 512, False) >= 2 * 512 * 256 * qwen2.n_head > \
        stepmem.work_bytes(qwen2, 256, 512, True)
    steps = {s["step"]: s for s in stepmem.steps(qwen2, 64, 512, flash_attn=False)}
    assert steps["attention scores"]["peak"] > steps["QKV"]["peak"]  # HyperGen's s^2 term, here u x n_kv a head


def test_the_longest_prompt_is_the_last_that_fits(qwen2):
    floor = measured_stepmem.minimum(qwen2, stepmem.Setting(stepmem.CELLS, 32))
    sizes = [floor + (2 << 20), floor + (5 << 20), floor + (9 << 20)]
    assert measured_stepmem.max_prompt(qwen2, floor - (1 << 20)) is None
    found = [measured_stepmem.max_prompt(qwen2, b) for b in sizes]
    assert all(f is not None for f in found)
    lengths = [f.n_prompt for f in found]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    for budget, f in zip(sizes, found):
        assert f.minimum <= budget
        if f.n_prompt + stepmem.CELLS <= qwen2.n_ctx_train:
            longer = stepmem.Setting(f.n_prompt + stepmem.CELLS, 32)
            assert measured_stepmem.minimum(qwen2, longer, measured_stepmem.run_costs(qwen2, longer, budget)) > budget
    r = cli("plan", "-m", str(qwen2.path), "--max-prompt", "--mem", str(sizes[1]), "--json", check=True)
    assert json.loads(r.stdout)["longest"]["n_prompt"] == lengths[1]
    r = cli("plan", "-m", str(qwen2.path), "--prompt-len", str(qwen2.n_ctx_train + 1), "--mem", "80M")
    assert r.returncode == 1 and "trained context" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_quantized_kv_cache_holds_a_longer_prompt(tmp_path):
    """-ctk/-ctv q8_0 halves the cache's cells' bytes (about): the same budget holds a longer prompt; a quantized V
    without flash attention is one error, before anything loads."""
    from flexoffload.gguf import synth
    from flexoffload.gguf.model import load

    # heads of 128 (q8_0's blocks are 32 values)
    shape = synth.Shape(n_layer=4, n_embd=512, n_ff=1024, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=4096)
    model = load(synth.write(tmp_path / "heads128.gguf", shape))
    floor = measured_stepmem.minimum(model, stepmem.Setting(stepmem.CELLS, 32))
    budget = floor + (5 << 20)
    f16 = measured_stepmem.max_prompt(model, budget)
    q8 = measured_stepmem.max_prompt(model, budget, type_k="q8_0", type_v="q8_0")
    assert q8.kv_cache < f16.kv_cache * q8.n_prompt / f16.n_prompt
    assert q8.n_prompt > f16.n_prompt or q8.n_prompt + stepmem.CELLS > model.n_ctx_train
    r = cli("plan", "-m", str(model.path), "--max-prompt", "--mem", str(budget), "-ctk", "q8_0", "-ctv", "q8_0",
            "--json", check=True)
    assert json.loads(r.stdout)["longest"]["n_prompt"] == q8.n_prompt
    r = cli("run", "-m", str(model.path), "-p", "a b", "-n", "1", "-ctv", "q8_0", "-fa", "off")
    assert r.returncode == 1 and "needs flash attention" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_prefill_in_ubatches_of_16_and_of_32_gives_the_tokens_of_one_whole_batch(tmp_path, qwen2):
    """The prompt (over 64 tokens) computed in one pass (batch and ubatch of 256), and in batches of 64 split into
    ubatches of 16 and of 32, with mmap and streamed under 60M: the same greedy tokens."""
    prompt = " ".join(f"w{i}" for i in range(60))
    whole = api.generate(api.Request(model=str(qwen2.path), prompt=prompt, n_predict=8, temp=0, n_ctx=256, n_batch=256,
                                     n_ubatch=256, flash_attn="on", strategy="mmap"))
    assert 64 < whole["n_prompt"] <= 256 - 8 and len(whole["tokens"]) == 8
    for ubatch in (16, 32):
        base = api.Request(model=str(qwen2.path), prompt=prompt, n_predict=8, temp=0, n_ctx=256, n_batch=64,
                           n_ubatch=ubatch, flash_attn="on")
        mmap = api.generate(dataclasses.replace(base, strategy="mmap"))
        streamed = api.generate(dataclasses.replace(base, strategy="stream", mem="60M"))
        assert streamed["tokens"] == mmap["tokens"] == whole["tokens"], ubatch
        assert streamed["n_prompt"] == whole["n_prompt"] > 64


def test_a_prompt_too_long_is_refused_before_loading(qwen2, tmp_path):
    long = " ".join(f"w{i}" for i in range(300))
    r = cli("run", "-m", str(qwen2.path), "-p", long, "-n", "1", "-c", "128", "--mem", "1M")
    # named with both lengths, and before the budget (1M: far too small) is even considered
    assert r.returncode == 1 and "longer than the context of 128" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    r = cli("run", "-m", str(qwen2.path), "-f", str(bad), "-n", "1")
    assert r.returncode == 1 and "not UTF-8" in r.stderr


def test_a_long_prompt_gets_its_ubatch_chosen_and_the_same_tokens(qwen2, monkeypatch):
    from flexoffload.api import preparing
    from flexoffload.measure import ubatches

    monkeypatch.setattr(preparing, "LONG_PROMPT", 32)
    prompt = " ".join(f"w{i}" for i in range(150))
    request = api.Request(model=str(qwen2.path), prompt=prompt, n_predict=6, temp=0, n_ctx=512, n_batch=64,
                          mem="60M", strategy="stream", spec_type="none")
    prepared = api.prepare(request)
    u = prepared.settings.n_ubatch
    assert u in stepmem.UBATCHES and prepared.settings.n_batch >= u and prepared.settings.flash_attn == "on"
    assert any("ubatches of" in n for n in prepared.notes)
    rate = ubatches.rates(qwen2, request.n_threads)
    assert set(rate) == set(stepmem.UBATCHES) and all(s > 0 for s in rate.values())
    chosen = api.run_prepared(prepared)
    same = api.generate(api.Request(model=str(qwen2.path), prompt=prompt, n_predict=6, temp=0, n_ctx=512,
                                    n_batch=max(64, u), n_ubatch=u, flash_attn="on", strategy="mmap"))
    assert chosen["tokens"] == same["tokens"]


def test_a_speculating_run_reads_a_long_prompt_in_the_target_alones_ubatches(qwen2, monkeypatch):
    """A tree's prompt is read in the ubatches the target alone chose (a pass's rows decide its kernels, so a prompt
    read otherwise rounds otherwise: on the MoE test bed a near tie flipped), and its greedy tokens are the alone
    run's."""
    from flexoffload.api import preparing

    monkeypatch.setattr(preparing, "LONG_PROMPT", 32)
    prompt = " ".join(f"w{i}" for i in range(150))
    # room for a tree's compute buffers at -b 512 (60M, the least the target alone runs in, may not be)
    request = api.Request(model=str(qwen2.path), prompt=prompt, n_predict=12, temp=0, n_ctx=1024, n_batch=512,
                          mem="100M", strategy="stream", spec_type="none")
    alone = api.prepare(request)
    tree = api.prepare(dataclasses.replace(request, spec_type="ngram-simple"))
    assert list(tree.free) == ["ngram-simple"] and alone.settings.n_ubatch  # the prompt's ubatch chosen
    assert tree.settings.n_ubatch == alone.settings.n_ubatch and tree.settings.n_batch == 512
    assert any("as the target alone would" in n for n in tree.notes)
    assert api.run_prepared(tree)["tokens"] == api.run_prepared(alone)["tokens"]


def test_mmap_is_checked_with_the_kv_types_given(tmp_path):
    """mmap's minimum under -ctk/-ctv counts the cache at those types: a budget just under f16's minimum takes a q8_0
    cache."""
    import re

    from flexoffload import FlexoffloadError
    from flexoffload.gguf import synth

    shape = synth.Shape(n_layer=4, n_embd=512, n_ff=1024, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=8192)
    path = synth.write(tmp_path / "heads128.gguf", shape)
    request = api.Request(model=str(path), prompt="a b", n_ctx=8192, n_batch=64, flash_attn="on", strategy="mmap",
                          mem="1M")
    with pytest.raises(FlexoffloadError) as refused:
        api.prepare(request)
    f16_minimum = float(re.search(r"the minimum is ([\d.]+) MiB", str(refused.value)).group(1))
    just_under = f"{int(f16_minimum) - 1}M"
    with pytest.raises(FlexoffloadError, match="KV f16/f16"):
        api.prepare(dataclasses.replace(request, mem=just_under))
    q8 = api.prepare(dataclasses.replace(request, mem=just_under, cache_type_k="q8_0", cache_type_v="q8_0"))
    assert q8.strategy == "mmap" and q8.plan is None

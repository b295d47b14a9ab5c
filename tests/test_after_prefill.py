"""Decode's memory after a long prompt (issue 16; patches 0013-0015): the context's ubatch shrinks after the
prefill, its compute buffers with it, and streamed tensors become resident, read once; the tokens do not change."""

import re

import pytest

from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import dryrun as measured_stepmem
from flexoffload.memory import stepmem
from flexoffload.native import stream
from flexoffload.plan import prefill
from flexoffload.runtime import engine

# it streams or profiles the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")

SHAPE = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=384, n_ctx_train=1024)
PROMPT = " ".join(f"w{i}" for i in range(120))
FFN = r"^blk\.\d+\.ffn_(up|gate|down)\.weight$"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("models") / "after-prefill.gguf", SHAPE)


def settings(**kw) -> engine.Settings:
    base = dict(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=2, temp=0.0, strategy="stream",
                streamed_patterns=(FFN,), flash_attn="on", window=1)
    return engine.Settings(**{**base, **kw})


def compute_mib(log_lines) -> list[float]:
    """The CPU compute buffer sizes llama.cpp reported, in order (one per reserve)."""
    sizes = []
    for line in log_lines:
        m = re.search(r"CPU compute buffer size = +([\d.]+) MiB", line)
        if m:
            sizes.append(float(m.group(1)))
    return sizes


def test_decode_after_prefill_equals_streaming_throughout(model):
    names = tuple(t.name for t in load(model).tensors if re.match(FFN, t.name) and t.layer in (1, 2))
    with engine.Engine(str(model), settings()) as e:
        stream.reset_stats()
        base = e.generate(PROMPT, 12)
    with engine.Engine(str(model), settings(decode_ubatch=1, resident_after_prefill=names)) as e:
        stream.reset_stats()
        after = e.generate(PROMPT, 12)
        sizes = compute_mib(e.log.lines)
    made = sum(t.n_bytes for t in load(model).tensors if t.name in names)
    assert after.tokens == base.tokens and after.n_gen == 12
    assert after.timings["made_resident"] == len(names) == 6
    # the compute buffers were reserved again, smaller, when decode started
    assert len(sizes) >= 2 and sizes[-1] < sizes[0]
    # the decode passes no longer read what was made resident (a pass of slack: the prefetcher runs ahead)
    passes = after.n_gen - 1
    assert after.timings["stream_bytes_read"] <= base.timings["stream_bytes_read"] - (passes - 1) * made


def test_make_resident_skips_what_is_not_streamed(model):
    with engine.Engine(str(model), settings()) as e:
        e.generate("a b", 2)
        assert stream.make_resident(e.model, ["token_embd.weight", "no.such.tensor"]) == 0
        assert stream.make_resident(e.model, ["blk.0.ffn_up.weight"]) == 1
        assert stream.make_resident(e.model, ["blk.0.ffn_up.weight"]) == 0  # once: it is resident now


def test_after_prefill_fills_what_the_compute_buffers_give_back(model):
    """The chosen tensors fit in the memory the buffers give back, go to the layers streaming the most first, and
    the predicted decode is no slower."""
    from flexoffload.measure import profiler
    from flexoffload.plan.planners import make_plan

    m = load(model)
    setting = stepmem.Setting(512, 256, "on")
    wide, narrow = measured_stepmem.buffers(m, [setting, stepmem.Setting(512, prefill.DECODE_UBATCH, "on")])
    costs = measured_stepmem.run_costs(m, setting)
    budget = measured_stepmem.minimum(m, setting, costs) + 4 * (1 << 20)
    plan = make_plan(m, budget, "balanced", profiler.measure(m, 2), **costs)
    names, tok_s = prefill.after_prefill(m, plan, measured_stepmem.room(m, setting), profiler.measure(m, 2))
    sizes = {t.name: t.n_bytes for t in m.tensors}
    assert names and set(names) <= set(plan.streamed)
    assert sum(sizes[n] for n in names) <= wide.compute - narrow.compute
    assert tok_s >= plan.predicted_tok_s * (1 - 1e-12)  # equal where the moved tensors were not the bottleneck
    # nothing to give back at the decode's own ubatch
    assert prefill.after_prefill(m, plan, measured_stepmem.room(m, stepmem.Setting(512, 1, "on")),
                                 profiler.measure(m, 2)) == ((), plan.predicted_tok_s)


def test_run_moves_memory_back_and_equals_llama_completion(model):
    """`run --mem -ub`: decode after the prompt keeps more weights resident than the prefill could, and the text is
    llama-completion's at the same -b, -ub and -fa."""
    from test_equality import flexoffload_run, llama_completion

    m = load(model)
    setting = stepmem.Setting(512, 256, "on")
    budget = measured_stepmem.minimum(m, setting) + 6 * (1 << 20)
    ours = flexoffload_run(model, PROMPT, 16, "-c", "512", "-b", "256", "-ub", "256", "-fa", "on", "--mem",
                           str(budget), "--strategy", "stream")
    assert ours["timings"]["made_resident"] == ours["plan"]["after_prefill"]["tensors"] > 0
    assert llama_completion(model, PROMPT, 16, ctx=512, batch=256, ubatch=256, flash_attn="on") == ours["text"]

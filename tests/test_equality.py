"""Greedy output equals that of llama-completion, the CLI of this native build (llama.cpp with our patches), for the
same model, prompt and settings: run on llama.cpp's own paths (mmap, no repacking, no -ot unless a plan's overrides are
given), with GGML_CPU_SPLIT_KV as this process has it, i.e. inherited (flexoffload.native sets it to 0 unless the user
set it: patch 0016's switch, upstream's split of a lone token's attention off)."""

import json
import os
import subprocess

import pytest

from conftest import cli
from flexoffload import native

# its real model's profiles and streamed runs record the disk: in a cache of the module's own (conftest)
pytestmark = pytest.mark.usefixtures("module_cache")

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def llama_completion(model, prompt, n, ctx=2048, batch=512, threads=2, prompt_file=None, overrides=(), ubatch=None,
                     flash_attn=None) -> str:
    """The text this build's llama-completion generates greedily (mmap, no repacking: upstream's plain path, on our
    patched tree), GGML_CPU_SPLIT_KV inherited from this process; the prompt from prompt_file (-f) instead where one
    is given; overrides: `-ot` lines (a plan's tensors.ot: STREAMED ones, which only the patched build takes)."""
    source = ["-f", str(prompt_file)] if prompt_file else ["-p", prompt]
    source += ["-ot", ",".join(overrides)] if overrides else []
    source += ["-fa", flash_attn] if flash_attn else []
    cmd = [str(native.tool("llama-completion")), "-m", str(model), *source, "-n", str(n), "--temp", "0",
           "-c", str(ctx), "-b", str(batch), "-ub", str(ubatch or batch), "-t", str(threads), "-lm", "mmap", "--no-repack",
           "-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup"]
    env = {**os.environ, "GGML_CPU_SPLIT_KV": os.environ["GGML_CPU_SPLIT_KV"]}  # inherited (flexoffload.native set it)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # completion.cpp ends its output with LOG("\n\n"): all of it was written (patch 0010)
    assert r.stdout.endswith("\n\n"), f"llama-completion's output was cut short: {r.stdout!r}"
    return r.stdout[:-2]


def flexoffload_run(model, prompt, n, *extra):
    r = cli("run", "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0", "-t", "2", "--json", *extra,
            check=True)
    return json.loads(r.stdout)


def test_greedy_equals_llama_completion_tiny(tiny_model):
    ours = flexoffload_run(tiny_model, "a b c d", 24)
    assert ours["n_gen"] > 0
    assert llama_completion(tiny_model, "a b c d", 24) == ours["text"]


@pytest.mark.integration
def test_greedy_equals_llama_completion_real(real_model):
    ours = flexoffload_run(real_model, PROMPT, 48)
    assert ours["n_gen"] == 48
    theirs = llama_completion(real_model, PROMPT, 48)
    assert theirs == ours["text"]
    assert "return" in ours["text"]  # a real model writes real code


@pytest.mark.integration
def test_enforced_budget_on_the_real_model(real_model):
    """At 0.7x of the model's size with mmap the kernel holds the run to the budget, and output is unchanged."""
    ours = flexoffload_run(real_model, PROMPT, 16, "--strategy", "mmap", "--mem", "0.7x", "--enforce")
    size_mb = real_model.stat().st_size / 2**20
    assert ours["enforced"] and ours["peak_source"] == "cgroup" and ours["strategy"] == "mmap"
    assert ours["peak_mem_mb"] <= 0.7 * size_mb + 1
    assert ours["budget_mb"] == pytest.approx(0.7 * size_mb, rel=1e-3)
    free = flexoffload_run(real_model, PROMPT, 16)
    assert ours["tokens"] == free["tokens"]


def test_prompt_file_is_read_as_llama_completion_reads_it(tiny_model, tmp_path):
    """llama.cpp's -f drops one trailing newline of the file (and only one): the same file gives the same text."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"a b c d\n\n")
    ours = json.loads(cli("run", "-m", str(tiny_model), "-f", str(prompt), "-n", "16", "--temp", "0", "-t", "2",
                          "--json", check=True).stdout)
    as_given = flexoffload_run(tiny_model, "a b c d\n\n", 16)
    dropped = flexoffload_run(tiny_model, "a b c d\n", 16)
    assert ours["n_prompt"] == dropped["n_prompt"] and ours["tokens"] == dropped["tokens"]
    assert as_given["n_prompt"] != dropped["n_prompt"]  # the newline is a token: dropping it is seen
    assert llama_completion(tiny_model, None, 16, prompt_file=prompt) == ours["text"]


def test_every_strategy_equals_llama_completion_with_the_same_overrides(tmp_path):
    """A plan's tensors.ot given to this build's llama-completion (-ot) streams the same tensors: its greedy text is
    flexoffload's for the plan, for prefetch and sync (everything streamable streamed), and its own with mmap."""
    from flexoffload.gguf import synth
    from flexoffload.gguf.model import load
    from flexoffload.measure import probe
    from flexoffload.memory import budgets
    from flexoffload.plan import plans
    from flexoffload.plan.planners import always_resident

    shape = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=384, n_ctx_train=1024)
    model = synth.write(tmp_path / "streamable.gguf", shape)
    m = load(model)
    budget = budgets.holding(m, m.weight_bytes * 3 // 4, probe.measure(m, 512, 512))
    plan_dir = tmp_path / "plan"
    cli("plan", "-m", str(model), "--mem", str(budget), "--strategy", "stream", "-c", "512", "-b", "512", "-o", str(plan_dir),
        check=True)
    planned = (plan_dir / "tensors.ot").read_text().split()
    names = [t.name for t in m.tensors]
    everything = [f"{p}={plans.STREAMED_BUFT}" for p in plans.override_patterns(
        [n for n in names if n not in always_resident(m)], names)]
    assert planned and planned != everything  # the plan keeps some of what prefetch streams

    mmap = llama_completion(model, "a b c d", 16, ctx=512)
    assert mmap
    assert llama_completion(model, "a b c d", 16, ctx=512, overrides=planned) == mmap
    assert llama_completion(model, "a b c d", 16, ctx=512, overrides=everything) == mmap
    for extra in (("--plan", str(plan_dir)), ("--strategy", "prefetch"), ("--strategy", "sync")):
        # the strategy alone: --spec-type auto would add a tree where the pass is disk-bound
        ours = flexoffload_run(model, "a b c d", 16, "-c", "512", "--spec-type", "none", *extra)
        assert ours["text"] == mmap and ours["strategy"] in ("stream", "prefetch", "sync")


def test_greedy_equals_llama_completion_with_a_smaller_ubatch(tiny_model):
    """-ub and -fa as llama.cpp takes them: a prompt over several ubatches, streamed under a budget, gives
    llama-completion's text at the same -b, -ub and -fa."""
    prompt = " ".join(f"w{i}" for i in range(60))
    ours = flexoffload_run(tiny_model, prompt, 16, "-c", "256", "-b", "64", "-ub", "16", "-fa", "on", "--mem", "60M",
                           "--strategy", "stream")
    assert ours["n_prompt"] > 16 and ours["n_gen"] > 0
    assert llama_completion(tiny_model, prompt, 16, ctx=256, batch=64, ubatch=16, flash_attn="on") == ours["text"]

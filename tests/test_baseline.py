"""llama.cpp's llama-speculative as a baseline: its output parsed, its command fair, a real run under a cgroup;
and the benchmark script's comparison of outputs and its summary."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import cli
from flexoffload import FlexoffloadError
from flexoffload.bench import baseline
from flexoffload.prompts import humaneval
from flexoffload.gguf import catalog
from flexoffload import native
from flexoffload.memory.budgets import MiB

# it streams or profiles the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")

FIXTURE = Path(__file__).parent / "fixtures" / "llama_speculative_humaneval2.json"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def captured():
    fix = json.loads(FIXTURE.read_text())
    (task, prompt), = humaneval.prompts([2])
    assert task == fix["task_id"]
    return fix, prompt


def test_parse_a_real_run(captured):
    fix, prompt = captured
    r = baseline.parse(fix["stdout"], fix["stderr"], prompt)
    assert r.text == "    return number - int(number)\n\n# Check function to verify the correctness of the solution"
    assert (r.n_gen, r.n_prompt, r.n_draft, r.n_drafted, r.n_accept) == (17, 80, 4, 20, 11)
    assert (r.encode_s, r.decode_s, r.reported_tok_s) == (12.123, 14.82, 1.147)
    assert r.decode_tok_s == pytest.approx(16 / 14.82)  # tokens after the first, as flexoffload counts
    assert r.acceptance_rate == pytest.approx(0.55)
    assert r.n_verify == 5 and r.tokens_per_pass == pytest.approx(17 / 5)  # 5 passes of 4 drafts: n_drafted 20


def test_parse_refuses_incomplete_or_foreign_output(captured):
    fix, prompt = captured
    with pytest.raises(baseline.Incomplete):
        baseline.parse(fix["stdout"][:-4], fix["stderr"], prompt)  # the trailer cut off
    with pytest.raises(baseline.Incomplete):
        baseline.parse(fix["stdout"][:30], fix["stderr"], prompt)  # stopped inside the prompt
    with pytest.raises(baseline.Incomplete):
        baseline.parse(fix["stdout"], fix["stderr"].split("n_draft")[0], prompt)  # timings missing
    with pytest.raises(FlexoffloadError, match="did not echo the prompt"):
        baseline.parse(fix["stdout"], fix["stderr"], "def other():\n")


def test_command_is_greedy_mmap_without_repacking():
    if not (native.build_dir() / "llama-speculative").is_file():
        pytest.skip("llama-speculative is not built")
    cmd = baseline.command("t.gguf", "d.gguf", "def f():\n", 32, 512, 64, 2, 8)
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["-m"] == "t.gguf" and flags["-md"] == "d.gguf" and flags["-p"] == "def f():\n"
    assert "--no-escape" in cmd and "--no-repack" in cmd
    args = " ".join(cmd)
    for part in ("-n 32", "-c 512", "-b 512", "-ub 64", "-t 2", "--temp 0", "--spec-draft-n-max 8", "-lm mmap"):
        assert part in args


@pytest.mark.integration
def test_real_run_under_a_budget_is_the_target_greedy_output(real_model):
    draft = catalog.CATALOG["qwen2.5-coder-0.5b-instruct"]
    if not catalog.is_present(draft) or not (native.build_dir() / "llama-speculative").is_file():
        pytest.skip("the draft model or llama-speculative is missing")
    (_, prompt), = humaneval.prompts([40])
    budget = 2 * real_model.stat().st_size  # ample: both models fit
    try:
        r = baseline.run(real_model, catalog.model_path(draft), prompt, 6, 512, 64, 2, 4, budget=budget, timeout=600)
    except FlexoffloadError as e:
        if "cgroup" in str(e):
            pytest.skip(str(e))
        raise
    assert r.enforced and 0 < r.peak_mem_mb <= budget / MiB + 1
    assert r.n_gen >= 6 and r.decode_tok_s > 0 and 0 <= r.acceptance_rate <= 1
    ours = json.loads(cli("run", "-m", str(real_model), "-p", prompt, "-n", "6", "-c", "512", "-b", "64", "-t", "2",
                          "--temp", "0", "--strategy", "mmap", "--json", check=True).stdout)
    assert ours["n_gen"] == 6 and r.text.startswith(ours["text"])


# --- scripts/bench_spec.py ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def bench_spec():
    spec = importlib.util.spec_from_file_location("bench_spec", REPO / "scripts" / "bench_spec.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_spec"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_outputs_are_compared_with_the_target_alone(bench_spec):
    ref = {"text": "ab", "tokens": [1, 2], "stop": "limit"}
    assert bench_spec.same_output({"text": "ab", "tokens": [1, 2]}, ref)
    assert not bench_spec.same_output({"text": "ab", "tokens": [1, 3]}, ref)
    assert bench_spec.same_output({"text": "abc", "tokens": None}, ref)  # llama-speculative runs past -n
    assert not bench_spec.same_output({"text": "ac", "tokens": None}, ref)
    eog = {"text": "ab", "tokens": [1, 2], "stop": "eog"}
    assert bench_spec.same_output({"text": "ab<|endoftext|>", "tokens": None}, eog)
    assert not bench_spec.same_output({"text": "abc", "tokens": None}, eog)


def test_summary_gives_the_ratios_at_0_8x(bench_spec):
    Row = bench_spec.Row
    rows, outputs = [], []
    for prompt, toks in (("HumanEval/40", [1, 2]), ("HumanEval/64", [3, 4])):
        for config, speed, out in (("stream", 1.0, toks), ("llama-speculative", 1.5, None), ("tree", 3.0, toks),
                                   ("chain", 2.0, [9, 9])):
            rows.append(Row(phase="eval", budget="0.8x", budget_mb=853, config=config, prompt=prompt, n_gen=2,
                            decode_tok_s=speed))
            outputs.append({"text": "x", "tokens": out, "stop": "limit"})
    rows.append(Row(phase="eval", budget="0.8x", budget_mb=853, config="tree-no-pacer", prompt="HumanEval/40",
                    error="budget 853 MiB is too small for x: the minimum is 900 MiB"))
    outputs.append(None)
    bench_spec.mark_matches(rows, outputs)
    assert [r.matches_target for r in rows[:4]] == ["yes", "yes", "yes", "no"] and rows[-1].matches_target == ""
    text = bench_spec.summary(rows, ["stream", "llama-speculative", "chain", "tree", "tree-no-pacer"], ["0.8x"],
                              "# t", {"0.8x": 4})
    assert "| 0.8x (853 MiB) | 1.00 | 1.50 | 2.00 | 3.00 | - |" in text
    assert "tree / llama-speculative = 3.00 / 1.50 = 2.00 (target at least 1.5: met)" in text
    assert "tree / stream = 3.00 / 1.00 = 3.00 (target at least 2.0: met)" in text
    assert "6 of 8 runs; differs: 0.8x chain HumanEval/40, 0.8x chain HumanEval/64" in text
    assert "too small" in text

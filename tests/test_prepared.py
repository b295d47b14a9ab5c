"""Decisions apart from requests (issue 40, items 2 and 3): prepare leaves the request as given and returns what it
decided as a Prepared; the enforced child runs the parent's Prepared without preparing again; `plan -o D` writes
what `run` with the same flags would run, so `run --plan D` runs the same plan and gives the same greedy tokens as
`run --mem`."""

import copy
import dataclasses
import json

import pytest
from conftest import cli

from flexoffload import api
from flexoffload.cli import request_from_args
from flexoffload.defaults import cache_dir
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import diskrecord, probe, profiler
from flexoffload.plan.planners import run_minimum

# its real model's profiles and streamed runs record the disk: in a cache of the module's own (conftest)
pytestmark = pytest.mark.usefixtures("module_cache")

# tensors over the 1 MiB that always stays resident, so a budget under the file streams some
DENSE = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=2, n_vocab=4096, n_ctx_train=512)
MOE = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_embd=512, n_ff_expert=256, n_vocab=4096)
SETTING = ["-c", "256", "-b", "32", "-t", "2"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache (profiles, recorded disk speeds) with the native build linked in: the test changes what the
    session's other tests plan with otherwise."""
    native = cache_dir() / "native"
    path = tmp_path / "cache"
    path.mkdir()
    if native.is_dir():
        (path / "native").symlink_to(native)
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(path))
    return path


def _streaming_budget(model) -> int:
    """A budget just over the least the model runs in: the plan streams most of its tensors."""
    return int(run_minimum(model, probe.measure(model, 256, 32)) * 1.02)


def test_prepare_leaves_the_request_as_given(cache, tmp_path):
    m = load(synth.write(tmp_path / "dense.gguf", DENSE))
    request = request_from_args(["-m", str(m.path), "-p", "a b c d", "--mem", str(_streaming_budget(m)),
                                 "--temp", "0", *SETTING])
    given = copy.deepcopy(request)
    p = api.prepare(request)
    assert request == given and p.request is request  # nothing written back: no strategy, no spec type, no draft
    assert request.strategy is None and request.spec_type == "auto"
    assert p.strategy in ("mmap", "stream") and p.settings.strategy == p.strategy  # decided, in the Prepared
    assert p.spec_type in ("none", ",".join(api.FREE_AUTO))  # decided: a spec type, not auto


def test_a_prepared_survives_json_whole(cache, tmp_path):
    m = load(synth.write(tmp_path / "dense.gguf", DENSE))
    p = api.prepare(request_from_args(["-m", str(m.path), "-p", "a b", "--mem", str(_streaming_budget(m)),
                                       "--spec-type", "ngram-simple", *SETTING]))
    back = api.Prepared.from_json(p.to_json())
    assert back.settings == p.settings and back.plan == p.plan and back.tree == p.tree
    assert (back.limit, back.free, back.draft, back.request) == (p.limit, p.free, p.draft, p.request)


def test_the_child_runs_the_parents_decision_when_the_recorded_disk_speed_changes(cache, tmp_path):
    """The parent prepares; then runs record a disk ten times slower, so a new prepare decides another plan; the
    enforced child runs the parent's plan and settings as they were (it does not prepare again)."""
    m = load(synth.write(tmp_path / "dense.gguf", DENSE))
    request = request_from_args(["-m", str(m.path), "-p", "a b c d", "-n", "6", "--temp", "0", "--spec-type",
                                 "none", "--strategy", "stream", "--mem", str(_streaming_budget(m)), *SETTING])
    p = api.prepare(request)
    seen = diskrecord._seen_path(m.path)
    slow = profiler.as_measured(m, 2).disk_bw / 10
    seen.parent.mkdir(parents=True, exist_ok=True)
    seen.write_text(json.dumps({"bytes_per_s": [slow] * 5, "file": str(m.path)}))
    again = api.prepare(request)
    assert again.plan.predicted_tok_s < p.plan.predicted_tok_s  # what a second prepare would decide
    result = api.run_in_cgroup(p, p.limit, timeout=300)
    assert result["plan"]["predicted_tok_s"] == p.plan.predicted_tok_s
    assert (result["plan"]["window"], result["plan"]["io_threads"]) == (p.settings.window, p.settings.io_threads)
    assert result["plan"]["streamed_mb"] * 2**20 == pytest.approx(sum(
        t.n_bytes for t in m.tensors if t.name in set(p.plan.streamed) and t.name != "token_embd.weight"), abs=2**20)


STREAM = ["--strategy", "stream"]


@pytest.mark.parametrize("shape,extra", [(DENSE, []), (DENSE, STREAM), (DENSE, [*STREAM, "-ub", "16", "-fa", "on",
                                                                               "-ctk", "q8_0"]),
                                         (MOE, STREAM)], ids=["dense", "dense-stream", "dense-ub-fa-kv", "moe"])
def test_plan_then_run_by_it_is_run_under_the_budget(shape, extra, cache, tmp_path):
    """plan -o D with run's flags writes the plan run --mem would stream by (the same plan.json: expert slots and
    reads, the ubatch's and KV types' costs, the drafters' memory), and run --plan D gives run --mem's greedy
    tokens."""
    m = load(synth.write(tmp_path / "model.gguf", shape))
    flags = ["-m", str(m.path), "--mem", str(_streaming_budget(m)), *SETTING, *extra]
    out = tmp_path / "plan"
    made = cli("plan", *flags, "-o", str(out))
    assert made.returncode == 0, made.stderr
    direct = api.prepare(request_from_args([*flags, "-p", "a b c d"]))
    assert json.loads((out / "plan.json").read_text()) == (direct.plan or direct.mmap_plan).to_dict()
    if shape is MOE and direct.plan:
        assert direct.plan.experts is not None and direct.plan.experts.slots >= 0
    run = ["-p", "a b c d", "-n", "8", "--temp", "0", "--json"]
    by_plan = cli("run", "--plan", str(out), *flags, *run)
    under_budget = cli("run", *flags, *run)
    assert by_plan.returncode == 0 and under_budget.returncode == 0, by_plan.stderr + under_budget.stderr
    a, b = json.loads(by_plan.stdout), json.loads(under_budget.stdout)
    assert a["tokens"] == b["tokens"] and a["strategy"] == b["strategy"]
    if direct.plan:
        assert a["plan"]["policy"] == b["plan"]["policy"] and a["plan"]["window"] == b["plan"]["window"]


WIDE = synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=1024)


def test_a_precision_plan_then_run_by_it_is_run_with_precision_auto(cache, tmp_path):
    """plan --precision auto -o D writes the plan run --precision auto streams by (its requantized file, types and
    residency; plan also measures the file's quality), and run --plan D gives the same greedy tokens."""
    m = load(synth.write(tmp_path / "wide.gguf", WIDE))
    flags = ["-m", str(m.path), "--mem", "120M", "--precision", "auto", "--max-kld", "0.01", "-t", "2"]
    out = tmp_path / "plan"
    made = cli("plan", *flags, "-o", str(out))
    assert made.returncode == 0, made.stderr
    direct = api.prepare(request_from_args([*flags, "-p", "a b c d"])).plan.to_dict()
    written = json.loads((out / "plan.json").read_text())
    written["precision"].pop("measured", None)  # plan measures the requantized file's quality too
    direct["precision"].pop("measured", None)
    assert written == direct
    run = ["-p", "a b c d", "-n", "8", "--temp", "0", "--json"]
    by_plan = cli("run", "--plan", str(out), "-m", str(m.path), "--mem", "120M", "-t", "2", *run)
    under_budget = cli("run", *flags, *run)
    assert by_plan.returncode == 0 and under_budget.returncode == 0, by_plan.stderr + under_budget.stderr
    a, b = json.loads(by_plan.stdout), json.loads(under_budget.stdout)
    assert a["tokens"] == b["tokens"] and a["model"]["path"] == b["model"]["path"] != str(m.path)


@pytest.mark.integration
def test_the_real_model_s_plan_then_run_by_it_is_run_under_the_budget(real_model, tmp_path):
    flags = ["-m", str(real_model), "--mem", "0.4x", "-c", "512", "-t", "2"]
    out = tmp_path / "plan"
    made = cli("plan", *flags, "-o", str(out))
    assert made.returncode == 0, made.stderr
    direct = api.prepare(request_from_args([*flags, "-p", "def f(x):"]))
    assert json.loads((out / "plan.json").read_text()) == direct.plan.to_dict()
    run = ["-p", "def fibonacci(n):", "-n", "16", "--temp", "0", "--json"]
    a = json.loads(cli("run", "--plan", str(out), *flags, *run, check=True).stdout)
    b = json.loads(cli("run", *flags, *run, check=True).stdout)
    assert a["tokens"] == b["tokens"] and a["plan"]["policy"] == b["plan"]["policy"]
    assert a.get("spec", {}).get("types") == b.get("spec", {}).get("types")  # the drafting decided the same


def _minimum(flags: list[str]) -> str:
    """The least --mem the run with these flags accepts, as its refusals name it (from 1 MiB up: a long prompt's
    ubatch check names a smaller need than its plan's, which then names its own)."""
    import re

    from flexoffload import FlexoffloadError

    mem = "1M"
    for _ in range(3):
        try:
            api.prepare(request_from_args([*flags, "--mem", mem]))
            return mem
        except FlexoffloadError as e:
            found = re.search(r"(?:the minimum is|it needs) ([0-9.]+ [MG]iB)", str(e))
            assert found, str(e)
            mem = found.group(1).replace(" MiB", "M").replace(" GiB", "G")
    raise AssertionError(f"no budget found for {flags}")


@pytest.mark.parametrize("shape,prompt", [
    (DENSE, "a b c d"),  # a dense model
    (synth.SHAPES["gemma3-tiny-256k"], "a b c d"),  # tied embeddings and a 256k vocabulary: large logits rows
    (DENSE, " ".join(f"w{i}" for i in range(120))),  # a long prompt (over 256 tokens): its ubatch chosen under the budget
], ids=["dense", "tied-256k", "long-prompt"])
def test_the_default_never_refuses_a_budget_the_run_alone_accepts(shape, prompt, cache, tmp_path):
    """At the least budget the run without speculation accepts, the default (--spec-type auto) runs too: alone,
    saying why on stderr, where the drafters' rows and tables do not fit (the 256k-vocabulary model's logits rows
    alone are 1 MiB each)."""
    m = load(synth.write(tmp_path / "model.gguf", shape))
    flags = ["-m", str(m.path), "-p", prompt, "-c", "512", "-t", "2", "--strategy", "stream"]
    least = _minimum([*flags, "--spec-type", "none"])
    alone = api.prepare(request_from_args([*flags, "--spec-type", "none", "--mem", least]))
    auto = api.prepare(request_from_args([*flags, "--mem", least]))  # the default: must not refuse
    assert auto.limit == alone.limit and auto.plan is not None
    if auto.spec_type == "none":
        assert auto.plan.memory.total <= auto.limit
    else:  # where they fit, their rows and tables are in the plan
        assert auto.draft_bytes > 0 and auto.plan.memory.total <= auto.limit

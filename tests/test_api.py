"""The Python API the CLI, bench and scripts share (api.py)."""

import json
from dataclasses import asdict

import pytest

from conftest import cli
from flexoffload import FlexoffloadError
from flexoffload import api
from flexoffload.cli import request_from_args


def test_generate_in_process_and_enforced_give_the_same_tokens(tiny_model):
    request = api.Request(model=str(tiny_model), prompt="a b c", n_predict=8, temp=0, mem="300M", n_ctx=256,
                          strategy="stream")
    pieces = []
    alone = api.generate(request, on_text=pieces.append)
    assert alone["strategy"] == "stream" and not alone["enforced"] and "".join(pieces) == alone["text"]
    held = api.generate(request, enforce=True)
    assert held["enforced"] and held["peak_source"] == "cgroup" and held["tokens"] == alone["tokens"]
    assert 0 < held["peak_unreclaimable_mb"] <= held["peak_mem_mb"] <= 300
    assert held["plan"]["memory_mb"] <= 300


def test_the_cli_and_the_api_read_the_same_request(tiny_model):
    request = request_from_args(["-m", str(tiny_model), "-p", "x y", "-n", "5", "--temp", "0", "--mem", "0.5x",
                                 "--no-pacer", "--pipeline", "--json"])
    # run's --spec-type is auto; the API's Request defaults to none (plan --tune, bench and serve must not speculate)
    assert request == api.Request(model=str(tiny_model), prompt="x y", n_predict=5, temp=0.0, mem="0.5x",
                                  pacer=False, pipeline=True, spec_type="auto")
    assert api.Request(**json.loads(json.dumps(asdict(request)))) == request  # what an enforced child receives
    out = json.loads(cli("run", "-m", str(tiny_model), "-p", "x y", "-n", "5", "--temp", "0", "--json",
                         check=True).stdout)
    assert api.generate(api.Request(model=str(tiny_model), prompt="x y", n_predict=5, temp=0))["tokens"] == out["tokens"]


@pytest.mark.parametrize("field,value,words", [("strategy", "teleport", "unknown strategy"),
                                               ("n_ctx", 8, "-c must be"), ("prompt", "", "no prompt"),
                                               ("mem", "lots", "cannot read memory size")])
def test_bad_requests_are_refused_before_loading(tiny_model, field, value, words):
    request = api.Request(model=str(tiny_model), **{"prompt": "x", field: value})
    with pytest.raises(FlexoffloadError, match=words):
        api.prepare(request)


def test_mmap_runs_where_the_cost_model_predicts_it_as_fast(tmp_path, monkeypatch):
    """A budget whose page cache holds the model: mmap is predicted compute-bound, so a run without --strategy says
    so and runs mmap (a plan that streams everything all the more); --strategy stream streams; a budget whose cache
    cannot hold it streams."""
    from flexoffload.plan import plans
    from flexoffload.plan import planners
    from flexoffload.gguf import synth
    from flexoffload.gguf.model import load

    shape = synth.Shape(n_layer=4, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)
    path = synth.write(tmp_path / "four.gguf", shape, "F32")
    request = api.Request(model=str(path), prompt="a b c", n_predict=4, temp=0, mem="4x", n_ctx=256, n_batch=64,
                          spec_type="none")  # the strategy alone: no drafters deciding beside it
    roomy = api.prepare(request)
    assert roomy.strategy == "mmap" and roomy.plan is None and "predicted as fast" in roomy.notes[0]
    monkeypatch.setitem(planners.POLICIES, "balanced", planners.POLICIES["none"])
    switched = api.prepare(request)
    assert switched.strategy == "mmap" and switched.plan is None
    monkeypatch.undo()
    from flexoffload.measure import probe
    from flexoffload.memory import budgets

    m = load(path)
    half = budgets.holding(m, m.weight_bytes // 2, probe.measure(m, 256, 64))
    small = api.prepare(api.Request(**{**asdict(request), "mem": str(half)}))
    assert small.strategy == "stream" and not small.notes
    assert plans.streamed_bytes(small.plan, load(path)) > 0
    assert api.prepare(api.Request(**{**asdict(request), "strategy": "stream"})).strategy == "stream"
    assert api.generate(request)["tokens"] == api.generate(api.Request(**{**asdict(request), "strategy": "stream"}))[
        "tokens"]

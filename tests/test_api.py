"""The Python API the CLI, bench and scripts share (api.py)."""

import json
from dataclasses import asdict

import pytest

from conftest import cli
from flexoffload import FlexoffloadError, api
from flexoffload.cli import request_from_args


def test_generate_in_process_and_enforced_give_the_same_tokens(tiny_model):
    request = api.Request(model=str(tiny_model), prompt="a b c", n_predict=8, temp=0, mem="300M", n_ctx=256)
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
    assert request == api.Request(model=str(tiny_model), prompt="x y", n_predict=5, temp=0.0, mem="0.5x",
                                  pacer=False, pipeline=True)
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

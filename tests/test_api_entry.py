"""The API's entry points (issue 26, item 3): load, plan, generate with the concerns as arguments, and the older
flat Request; both forms run the same request."""

from dataclasses import asdict

import pytest

from flexoffload import FlexoffloadError, api
from flexoffload.gguf import synth
from flexoffload.measure import probe
from flexoffload.memory import budgets
from flexoffload.plan import plans

# it plans from measured profiles and streams: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")


def test_the_concerns_make_the_flat_request_field_for_field():
    r = api.request("m.gguf", "p", api.Generation(n_predict=3, temp=0, n_ctx=256, n_batch=64, n_threads=1),
                    api.Budget(mem="0.5x", window=2, io_threads=3), api.Draft(model="d.gguf", max=8, always=True),
                    api.Placement(rpc="127.0.0.1:1", n_gpu_layers=2), api.Precision(mode="auto", max_kld=0.1))
    flat = api.Request(model="m.gguf", prompt="p", n_predict=3, temp=0, n_ctx=256, n_batch=64, n_threads=1,
                       mem="0.5x", window=2, io_threads=3, draft="d.gguf", draft_max=8, draft_always=True,
                       rpc="127.0.0.1:1", n_gpu_layers=2, precision="auto", max_kld=0.1)
    assert asdict(r) == asdict(flat)
    assert asdict(api.request(None, "p")) == asdict(api.Request(prompt="p"))  # every default the same


def test_plan_then_generate_by_it_equals_generate_under_the_budget(tmp_path):
    shape = synth.Shape(n_layer=4, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)
    path = synth.write(tmp_path / "four.gguf", shape, "F32")
    model = api.load(str(path))
    mem = str(budgets.holding(model, model.weight_bytes // 2, probe.measure(model, 256, 64)))
    gen, budget = api.Generation(n_predict=8, temp=0, n_ctx=256, n_batch=64, n_threads=1), api.Budget(mem=mem)
    plan = api.plan(model, budget, gen)
    assert plan is not None and plan.streamed and plan.budget == int(mem)
    assert plans.read(plan.write(tmp_path / "plan")).resident == plan.resident
    by_plan = api.generate(model, "def f(x):", gen, budget, plan=plan)
    direct = api.generate(model, "def f(x):", gen, budget)
    old = api.generate(api.Request(model=str(path), prompt="def f(x):", n_predict=8, temp=0, n_ctx=256,
                                   n_batch=64, n_threads=1, mem=mem))
    assert by_plan["tokens"] == direct["tokens"] == old["tokens"] and len(direct["tokens"]) == 8
    assert by_plan["plan"]["streamed_mb"] > 0


def test_a_budget_too_small_is_one_error_before_loading(tiny_model):
    with pytest.raises(FlexoffloadError, match="too small"):
        api.plan(api.load(str(tiny_model)), api.Budget(mem="1M"), api.Generation(n_ctx=256, n_batch=64))

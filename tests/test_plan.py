import json
import re

import pytest

from flexoffload import FlexoffloadError
from flexoffload.plan import plans
from flexoffload.plan.dimensions import Experts, Placed, Precision
from flexoffload.gguf import synth
from flexoffload.plan.costmodel import Profile
from flexoffload.gguf.model import load
from flexoffload.plan.planners import POLICIES, make_plan

# 12 layers, so that blk.1 and blk.11 both exist: a pattern for one must not catch the other
SHAPE = synth.Shape(n_layer=12, n_embd=512, n_ff=1024, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "twelve.gguf", SHAPE, "F32"))


def profile(model) -> Profile:
    return Profile.calibrated(model, tok_s=50.0, disk_bw=model.weight_bytes * 5.0)


def streamed_by_file(directory, names):
    """What llama.cpp would stream: each name tried against each pattern with regex_search, first match wins."""
    lines = (directory / plans.OVERRIDES_FILE).read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines]
    return [n for n in names if next((b for p, b in pairs if re.search(p, n)), None) == plans.STREAMED_BUFT]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("fraction", [0.45, 0.7, 0.9])
def test_round_trip(model, tmp_path, policy, fraction):
    p = make_plan(model, int(model.weight_bytes * fraction), policy, profile(model), window=2, io_threads=3,
                  kv_cache=1 << 20, compute=2 << 20, overhead=3 << 20)
    assert p.streamed and p.resident
    plans.write(p, tmp_path / "plan")
    assert plans.read(tmp_path / "plan") == p
    names = [t.name for t in model.tensors]
    assert streamed_by_file(tmp_path / "plan", names) == [n for n in names if n in set(p.streamed)]
    for line in (tmp_path / "plan" / plans.OVERRIDES_FILE).read_text().splitlines():
        pattern, buft = line.split("=", 1)
        assert buft == plans.STREAMED_BUFT and pattern.startswith("^") and pattern.endswith("$") and "," not in pattern
    doc = json.loads((tmp_path / "plan" / plans.PLAN_FILE).read_text())
    assert doc["policy"] == policy and doc["memory"]["total"] == p.memory.total <= p.budget


def test_patterns_are_exact_and_short(model):
    names = [t.name for t in model.tensors]
    cases = [
        ["blk.1.ffn_up.weight"],  # not blk.11
        ["blk.11.ffn_up.weight", "blk.1.attn_q.weight"],
        [n for n in names if ".ffn_" in n and "norm" not in n],  # every layer's FFN: one line
        [n for n in names if re.match(r"blk\.(1|3|10)\.(ffn_gate|ffn_down|attn_output)", n)] + ["output.weight"],
        ["token_embd.weight"],
        [],
    ]
    for streamed in cases:
        patterns = plans.override_patterns(streamed, names)
        matched = [n for n in names if any(re.search(p, n) for p in patterns)]
        assert matched == [n for n in names if n in set(streamed)], patterns
    assert plans.override_patterns(cases[2], names) == [r"^blk\.\d+\.(ffn_gate|ffn_up|ffn_down)\.weight$"]
    assert plans.override_patterns(cases[3], names) == [
        r"^output\.weight$", r"^blk\.(1|3|10)\.(attn_output|ffn_gate|ffn_down)\.weight$"]


def test_patterns_escape_what_the_override_parser_splits_on():
    names = ["a,b=c.weight", "blk.0.x+y.weight", "blk.1.x+y.weight"]
    patterns = plans.override_patterns(["a,b=c.weight", "blk.0.x+y.weight"], names)
    assert all("," not in p and "=" not in p for p in patterns)
    assert [n for n in names if any(re.search(p, n) for p in patterns)] == names[:2]


def test_nothing_streamed_writes_an_empty_override_file(model, tmp_path):
    p = make_plan(model, model.weight_bytes * 2, "balanced", profile(model))
    assert p.streamed == () and p.memory.window == 0
    plans.write(p, tmp_path)
    assert (tmp_path / plans.OVERRIDES_FILE).read_text() == ""
    assert plans.read(tmp_path) == p


def test_read_rejects_overrides_that_disagree_with_the_plan(model, tmp_path):
    p = make_plan(model, int(model.weight_bytes * 0.6), "flexinfer", profile(model))
    plans.write(p, tmp_path)
    ot = tmp_path / plans.OVERRIDES_FILE
    lines = ot.read_text().splitlines()
    ot.write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(FlexoffloadError, match="does not stream exactly"):
        plans.read(tmp_path)
    ot.write_text("\n".join(lines + [r"^blk\.0\.attn_norm\.weight$=STREAMED"]) + "\n")
    with pytest.raises(FlexoffloadError, match="does not stream exactly"):
        plans.read(tmp_path)
    with pytest.raises(FlexoffloadError, match="not a plan directory"):
        plans.read(tmp_path / "nothing")


# the three records as plan.json has always held them (placement across devices, precision, a MoE's experts)
PLACEMENT = {"policy": "oato", "devices": ["RPC0[10.77.0.2:50052]"], "n_gpu_layers": 3, "tensor_split": [1.0],
             "placed": [["blk.0.attn_q.weight", "RPC0[10.77.0.2:50052]"]],
             "cost": {"seconds_per_token": 0.0917, "device_compute_s": [0.0156], "host_compute_s": 0.068, "visits": 9,
                      "transfer_s": 0.000135, "transfer_bytes": 9216},
             "per_device": [{"name": "RPC0[10.77.0.2:50052]", "budget": 4355430, "memory": 415569,
                             "compute_s": 0.0156}],
             "llama_args": ["-ngl", "3", "-ts", "1"]}
PRECISION = {"source": "/models/wide.gguf", "original": None,
             "types": {"blk.1.attn_q.weight": "Q2_K", "output.weight": "Q3_K"},
             "steps": [["attn_q@1-1:Q4_0", "Q2_K"], ["output:Q4_0", "Q3_K"]], "weight_bytes": 466688,
             "source_weight_bytes": 779264, "predicted_kld": 0.00956, "predicted_uqest_delta": -0.0968,
             "walk_tok_s": 11415.9, "own_types_tok_s": 7277.6,
             "alternatives": [{"type": "Q3_K", "predicted_kld": 0.008, "weight_bytes": 596480,
                               "predicted_tok_s": 9241.4}],
             "bound": {"max_kld": 0.01, "min_tok_s": None},
             "measured": {"kld": 0.008159, "held_out_kld": 0.008535, "held_out_ppl": 1002.05, "same_top": 0.68}}
ROUTED = {"slots": 5, "policy": "lru", "hit_rate": 0.3125, "bytes_per_token": 1216512.0, "seconds": 0.004}
WHOLE = {"slots": 0, "policy": "lru", "whole": True, "hit_rate": 0.0, "bytes_per_token": 0, "seconds": 4.3e-05}


@pytest.mark.parametrize("experts", [ROUTED, WHOLE])
def test_a_plan_json_s_records_load_typed_and_write_back_the_same(model, tmp_path, experts):
    """plan.json keeps placement, precision and experts under the keys and in the form it always had: a plan folder
    written before they were typed records loads (as Placed, Precision, Experts), and writes back the same JSON."""
    p = make_plan(model, int(model.weight_bytes * 0.7), "balanced", profile(model))
    old = {**p.to_dict(), "placement": PLACEMENT, "precision": PRECISION, "experts": experts}
    plans.write(p, tmp_path)
    (tmp_path / plans.PLAN_FILE).write_text(json.dumps(old, indent=1) + "\n")
    loaded = plans.read(tmp_path)
    assert isinstance(loaded.placement, Placed) and isinstance(loaded.precision, Precision)
    assert isinstance(loaded.experts, Experts)
    assert loaded.placement.n_gpu_layers == 3 and loaded.placement.tensor_split == (1.0,)
    assert loaded.placement.cost.visits == 9 and loaded.placement.per_device[0].memory == 415569
    assert loaded.placement.llama_args() == PLACEMENT["llama_args"]
    assert loaded.precision.types == PRECISION["types"] and loaded.precision.steps[1] == ("output:Q4_0", "Q3_K")
    assert loaded.precision.max_kld == 0.01 and loaded.precision.measured["kld"] == 0.008159
    assert loaded.experts.whole == bool(experts.get("whole")) and loaded.experts.slots == experts["slots"]
    assert loaded.to_dict() == old
    plans.write(loaded, tmp_path / "again")
    assert (tmp_path / "again" / plans.PLAN_FILE).read_text() == (tmp_path / plans.PLAN_FILE).read_text()
    assert plans.read(tmp_path / "again") == loaded
    # a precision record not measured has no "measured" key, as before; nor a plan without the records any of them
    unmeasured = {k: v for k, v in PRECISION.items() if k != "measured"}
    assert Precision.from_dict(unmeasured).to_dict() == unmeasured
    bare = {k: v for k, v in p.to_dict().items() if k not in ("placement", "precision", "experts")}
    assert plans.Plan.from_dict(bare) == p

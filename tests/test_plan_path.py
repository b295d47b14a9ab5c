"""One planning path (issue 54, item 1): `plan -o DIR` writes what `run` with the same flags would run, and `run
--plan DIR` runs it: the same plan.json as run's own plan, the same greedy tokens as `run --mem`. On a dense model, a
mixture of experts, a precision plan and a draft model (tiny synthetic shapes, random weights; each module's own
cache, so its profiles are its own)."""

import dataclasses
import json

import pytest

from conftest import cli, set_profile
from flexoffload import api
from flexoffload.cli import request_from_args
from flexoffload.gguf import synth

DENSE = synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=4096, n_ctx_train=1024)
MOE = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_embd=512, n_ff_expert=256, n_vocab=4096)
SETTING = ["-c", "256", "-b", "32", "-t", "2", "--temp", "0", "-n", "8", "-p", "def add(a, b):"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan-path")
    return {"dense": synth.write(d / "dense.gguf", DENSE), "moe": synth.write(d / "moe.gguf", MOE, seed=1),
            "draft": synth.write(d / "draft.gguf", dataclasses.replace(DENSE, n_layer=1), seed=1)}


def _case(name, models) -> list[str]:
    """The flags of a case: a budget under which something streams (set by the module's profile)."""
    if name == "dense":
        return ["-m", str(models["dense"]), "--mem", "72M", "--spec-type", "none"]
    if name == "moe":
        return ["-m", str(models["moe"]), "--mem", "80M", "--spec-type", "none", "--strategy", "stream"]
    if name == "md":
        return ["-m", str(models["dense"]), "--mem", "80M", "-md", str(models["draft"]), "--draft-always"]
    return ["-m", str(models["dense"]), "--mem", "72M", "--precision", "auto", "--max-kld", "0.05",
            "--spec-type", "none"]


@pytest.mark.parametrize("name", ["dense", "moe", "md", "precision"])
def test_plan_then_run_plan_is_run_mem(name, models, tmp_path, private_cache):
    for key in ("dense", "moe", "draft"):
        set_profile(models[key], 2, 200.0, disk_bw=2e8)  # a slow disk: the plans stream
    flags = _case(name, models)
    made = cli("plan", *[f for f in flags if f != "--draft-always"], *SETTING[:6], *SETTING[-2:], "-o",
               str(tmp_path / "plan"), "--json")
    assert made.returncode == 0, made.stderr
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    prepared = api.prepare(request_from_args([*flags, *SETTING]))
    assert saved == json.loads(json.dumps(prepared.plan.to_dict()))
    assert saved["streamed"], "the case streams nothing: it says nothing of the path"
    direct = json.loads(cli("run", *flags, *SETTING, "--json", check=True).stdout)
    draft = ["-md", str(models["draft"])] if name == "md" else []
    by_plan = json.loads(cli("run", "--plan", str(tmp_path / "plan"), "-m", flags[1], *draft, *SETTING, "--json",
                             check=True).stdout)
    assert by_plan["tokens"] == direct["tokens"]
    assert ("spec" in by_plan) == ("spec" in direct)  # the drafting decided with the plan, run again

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

DENSE = synth.Shape(n_layer=4, n_embd=512, n_ff=4096, n_head=4, n_head_kv=2, n_vocab=8192, n_ctx_train=1024)
MOE = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=4, n_embd=512, n_ff_expert=256, n_vocab=4096)
SETTING = ["-c", "256", "-b", "32", "-t", "2", "--temp", "0", "-n", "8", "-p", "def add(a, b):"]
ROOM = 3 << 20  # above the least budget: some tensors resident, the rest (over 1 MiB each) streamed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan-path")
    return {"dense": synth.write(d / "dense.gguf", DENSE), "moe": synth.write(d / "moe.gguf", MOE, seed=1),
            "draft": synth.write(d / "draft.gguf", dataclasses.replace(DENSE, n_layer=1, n_ff=512), seed=1)}


def _case(name, models, setting=SETTING[:6]) -> list[str]:
    """The flags of a case, its budget the least one for setting (-c, -b, -t) plus ROOM: something streams."""
    model = models["moe" if name == "moe" else "dense"]
    flags = ["-m", str(model), "--strategy", "stream"]
    flags += {"dense": ["--spec-type", "none"], "moe": ["--spec-type", "none"], "md": ["-md", str(models["draft"]), "--draft-always"],
              "precision": ["--precision", "auto", "--max-kld", "0.05", "--spec-type", "none"]}[name]
    own_types = flags[:flags.index("--precision")] if name == "precision" else flags  # lower types take less
    refused = cli("plan", *own_types, *setting, "--mem", "8M", "-o", "unused")  # a draft is 6 MiB
    assert "the minimum is" in refused.stderr, refused.stderr
    least = float(refused.stderr.split("the minimum is ")[1].split()[0])
    return flags + ["--mem", f"{int(least * 2**20) + ROOM}"]


def _plan(d: dict) -> dict:
    """A plan.json's content but the quality plan --precision measures of its file (run does not measure it)."""
    if d.get("precision"):
        d = {**d, "precision": {k: v for k, v in d["precision"].items() if k != "measured"}}
    return d


@pytest.mark.parametrize("name", ["dense", "moe", "md", "precision"])
def test_plan_then_run_plan_is_run_mem(name, models, tmp_path, private_cache):
    for key in ("dense", "moe", "draft"):
        set_profile(models[key], 2, 200.0, disk_bw=2e8)  # a slow disk: the plans stream
    flags = _case(name, models)
    made = cli("plan", *flags, *SETTING[:6], *SETTING[-2:], "-o", str(tmp_path / "plan"), "--json")
    assert made.returncode == 0, made.stderr
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    run_flags = [*flags, *SETTING]
    prepared = api.prepare(request_from_args(run_flags))
    assert _plan(saved) == _plan(json.loads(json.dumps(prepared.plan.to_dict())))
    assert saved["streamed"], "the case streams nothing: it says nothing of the path"
    direct = json.loads(cli("run", *run_flags, "--json", check=True).stdout)
    draft = ["-md", str(models["draft"])] if name == "md" else []
    by_plan = json.loads(cli("run", "--plan", str(tmp_path / "plan"), "-m", flags[1], *draft, *SETTING, "--json",
                             check=True).stdout)
    assert by_plan["tokens"] == direct["tokens"]
    assert ("spec" in by_plan) == ("spec" in direct)  # the drafting decided with the plan, run again
    # run.json beside the plan is the whole Prepared: the settings and the drafting run decides with these flags
    decided = json.loads((tmp_path / "plan" / "run.json").read_text())
    own = json.loads(prepared.to_json())
    for d in (decided, own):  # run's sampling (--temp, --seed) was not given to plan
        d["settings"] = {k: v for k, v in d["settings"].items() if k not in ("temp", "seed")}
    assert {k: decided[k] for k in ("settings", "draft", "free", "tree", "limit")} == \
        {k: own[k] for k in ("settings", "draft", "free", "tree", "limit")}


def test_prompt_len_with_o_writes_the_plan_of_a_prompt_that_long(models, tmp_path, private_cache):
    """`plan --prompt-len L -o DIR` plans for a prompt of L tokens: its ubatch is the one run chooses for such a
    prompt under the budget, and run --plan DIR computes the prompt in it."""
    set_profile(models["dense"], 2, 200.0, disk_bw=2e8)
    setting = ["-c", "1024", "-t", "2"]
    flags = [*_case("dense", models, setting), *setting]  # the least budget of this context: its cache is 4x
    made = cli("plan", *flags, "--prompt-len", "400", "-o", str(tmp_path / "plan"))
    assert made.returncode == 0, made.stderr
    assert "ubatch" in made.stdout  # the table of each ubatch's memory, as without -o
    decided = json.loads((tmp_path / "plan" / "run.json").read_text())
    assert decided["request"]["n_ctx"] >= 400  # a context that holds the prompt
    from flexoffload.runtime.engine import count_tokens

    assert count_tokens(flags[1], decided["request"]["prompt"]) == 400
    prepared = api.prepare(request_from_args([*flags, "-p", decided["request"]["prompt"]]))
    assert prepared.settings.n_ubatch > 1 and decided["settings"]["n_ubatch"] == prepared.settings.n_ubatch


def test_plan_without_o_prints_the_plan_and_writes_nothing(models, tmp_path, private_cache):
    """`plan` without -o describes the plan run would run (the same prediction as the one written with -o) and
    writes no file; with --json, the plan's JSON."""
    set_profile(models["dense"], 2, 200.0, disk_bw=2e8)
    flags = [*_case("dense", models), *SETTING[:6]]
    made = cli("plan", *flags, "-o", str(tmp_path / "plan"), "--json", check=True)
    shown = cli("plan", *flags, check=True)
    assert "not written" in shown.stdout and "predicted" in shown.stdout
    assert json.loads(cli("plan", *flags, "--json", check=True).stdout) == json.loads(made.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan", "private-cache"]

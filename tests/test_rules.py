"""Every refusal of what the user asked is a rule of rules.py, checked in one place: each fires on a minimal request
(and model, for the rules that read its header), and the CLI says it in one line with a non-zero exit before
anything loads; the guards below rules.py say their rule's text; and the CLI raises no refusal of its own but those
listed here, each with why it is not a rule."""

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import cli
from flexoffload import FlexoffloadError, rules
from flexoffload.cli.run import request_from_args
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.options import Request
from test_cli import assert_one_line_error

CLI = Path(__file__).resolve().parent.parent / "flexoffload" / "cli"
RPC = "127.0.0.1:50052"  # never reached: a rule refuses before any server is asked

# each rule on the request alone: the command and flags that break it alone (the model is a file that is not there:
# refused first, the rule is said before anything is read); None: the option has no flag (the API's)
REQUEST_CASES = {
    "prompt": ("run", []),
    "precision-alone": ("run", ["-p", "x", "--precision", "auto"]),
    "sparsity-alone": ("run", ["-p", "x", "--sparsity", "4", "-md", "d.gguf"]),
    "spec-rpc-flash": ("run", ["-p", "x", "--spec-type", "ngram-simple", "--rpc", RPC, "-fa", "off"]),
    "spec-rows": ("run", ["-p", "x", "--spec-type", "ngram-simple", "-ub", "1"]),
    "forced-alone": None,
    "tune-alone": ("plan", ["--tune", "-o", "out"]),
    "rpc-draft": ("run", ["-p", "x", "--rpc", RPC, "-md", "d.gguf"]),
    "whole-slots": ("run", ["-p", "x", "--expert-reads", "whole", "--expert-slots", "2"]),
    "whole-lookahead": ("run", ["-p", "x", "--expert-reads", "whole", "--expert-lookahead", "on"]),
}
MODEL_CASES = ("draft-vocabulary", "sparsity-dense")

# the refusals the CLI keeps, by the start of their message: none is a rule (each is of a command's own flag, which
# is no Request field, or a failure of a file, a measure or a tokenizer); a new one fails here until it is a rule
# or listed with its reason
CLI_OWN = {
    ("common.py", "give the prompt with -p or -f, not both"): "-f is run's and plan's own flag, read into the prompt",
    ("common.py", "cannot read prompt file "): "a file that cannot be read: not a combination of options",
    ("common.py", "prompt file is not UTF-8 text"): "a file's content",
    ("run.py", "-sys is the system message of a conversation"): "-sys is run's own flag, no Request field",
    ("run.py", "give the system message with -sys, -p or -f"): "-sys, -f: run's own flags",
    ("plan.py", "{format_size(budget)} holds no prompt of "): "a measured fit (the dry run's minimum)",
    ("plan.py", "--prompt-len {prompt_len}: between 1 and the trained"): "--prompt-len is plan's own flag",
    ("plan.py", "--prompt-len {n}: no text of "): "the tokenizer found no text of that length",
    ("serve.py", "-np must be at least 1 and --queue at least 0"): "-np and --queue: serve's own flags",
    ("serve.py", "--port must be between 0 and 65535"): "--port: serve's own flag",
    ("models.py", "unknown model '{name}'"): "models fetch's argument",
    ("models.py", "--routing text is for a mixture of experts"): "models synth's own flags (no Request)",
    ("models.py", "cannot write {output}"): "a file that cannot be written",
    ("profile.py", "{name} has no dot product in the CPU backend"): "profile's own --types",
    ("profile.py", "--groups must be between 1 and the model"): "profile's own --groups",
    ("profile.py", "--slots takes slot counts a layer"): "profile's own --slots",
    ("profile.py", "cannot read the text file "): "a file that cannot be read",
    ("profile.py", "the text file is not UTF-8"): "a file's content",
    ("profile.py", "--levels takes whole numbers"): "profile's own --levels",
    ("profile.py", "--rpc profiles the servers' devices with --ops"): "profile's own --ops",
    ("profile.py", "--slots and -f go with --experts"): "profile's own --experts",
    ("profile.py", "--neuron-groups and --levels go with --neurons"): "profile's own --neurons",
}


def test_every_rule_has_a_case_here_a_name_and_a_reason():
    assert set(REQUEST_CASES) | set(MODEL_CASES) == set(rules.BY_NAME)
    assert len(rules.BY_NAME) == len(rules.RULES) and all(r.reason and r.message for r in rules.RULES)
    assert {r.name for r in rules.RULES if r.needs_model} == set(MODEL_CASES)


@pytest.mark.parametrize("name", [n for n, case in REQUEST_CASES.items() if case])
def test_a_request_rule_is_one_line_from_the_cli_before_the_model_is_read(name, tmp_path):
    command, flags = REQUEST_CASES[name]
    rule = rules.BY_NAME[name]
    missing = str(tmp_path / "missing.gguf")
    if command == "run":
        with pytest.raises(FlexoffloadError) as e:
            rules.check(request_from_args(["-m", missing, *flags]))
        assert str(e.value) == rule.message
    assert_one_line_error(cli(command, "-m", missing, *flags), rule.message)


def test_the_forced_rule_refuses_the_api_s_request_before_the_model_is_read(tmp_path):
    from flexoffload import api

    with pytest.raises(FlexoffloadError) as e:
        api.prepare(Request(model=str(tmp_path / "missing.gguf"), prompt="x", forced="y", spec_type="ngram-simple"))
    assert str(e.value) == rules.BY_NAME["forced-alone"].message


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A llama target, a draft of another vocabulary, a mixture of experts."""
    d = tmp_path_factory.mktemp("rules")
    return {"target": synth.write(d / "target.gguf", seed=1),
            "other": synth.write(d / "other-vocab.gguf", replace(synth.TINY, n_vocab=512), seed=2),
            "moe": synth.write(d / "moe.gguf", synth.SHAPES["qwen3moe-tiny"], seed=3)}


def test_the_model_rules_read_the_headers_and_name_the_files(models):
    target, other, moe = (models[k] for k in ("target", "other", "moe"))
    r = Request(model=str(target), prompt="x", draft=str(other))
    with pytest.raises(FlexoffloadError) as e:
        rules.check_model(r, load(target))
    assert str(e.value) == ("the draft other-vocab.gguf has another vocabulary (512 tokens, the target 384): a draft "
                            "must share the target's tokens")
    rules.check_model(replace(r, draft=str(target)), load(target))  # the same vocabulary: no refusal
    for path, kind in ((target, "llama"), (moe, "qwen3moe with experts")):
        with pytest.raises(FlexoffloadError) as e:
            rules.check_model(Request(model=str(path), prompt="x", sparsity="4"), load(path))
        assert str(e.value) == f"{path.name} is {kind}: predicted neurons are built for a dense qwen2 model"
    rules.check_model(Request(model=str(moe), prompt="x"), load(moe))  # no --sparsity: no refusal


def test_prepare_checks_the_model_rules_before_the_prompt_is_tokenized(models, monkeypatch):
    """prepare's model step comes right after its files: nothing of llama.cpp (not even the tokenizer) runs first."""
    from flexoffload import api
    from flexoffload.api import preparing

    def never(*a, **k):
        raise AssertionError("the prompt was tokenized before the model rules")

    monkeypatch.setattr(preparing, "count_tokens", never)
    with pytest.raises(FlexoffloadError, match="another vocabulary"):
        api.prepare(Request(model=str(models["target"]), prompt="x", draft=str(models["other"])))
    with pytest.raises(FlexoffloadError, match="predicted neurons are built for a dense"):
        api.prepare(Request(model=str(models["moe"]), prompt="x", sparsity="4", mem="1G"))


@pytest.mark.parametrize("flags,said", [(["-md", "{other}"], "another vocabulary (512 tokens, the target 384)"),
                                        (["--sparsity", "4", "-m", "{moe}"], "moe.gguf is qwen3moe with experts")])
def test_a_model_rule_is_one_line_from_the_cli(models, flags, said):
    flags = [f.format(**{k: str(v) for k, v in models.items()}) for f in flags]
    r = cli("run", "-m", str(models["target"]), "-p", "x", "-n", "2", *flags)
    assert_one_line_error(r, said)
    assert "llama.cpp" not in r.stderr  # ours, from the header: not the loader's


def test_the_guards_below_the_rules_say_their_rule_s_text(models):
    """What protects the API deeper down (the Speculator's settings, the planners, the precision walk, profile
    --neurons) raises the text its rule says: written once."""
    from flexoffload.measure import sparsity
    from flexoffload.plan import mixed, planners
    from flexoffload.runtime.settings import Settings
    from flexoffload.speculation import settings as specsettings

    for settings, name in ((Settings(flash_attn="off", rpc=(RPC,)), "spec-rpc-flash"),
                           (Settings(n_ubatch=1), "spec-rows")):
        with pytest.raises(FlexoffloadError) as e:
            specsettings.check_settings(settings)
        assert str(e.value) == rules.BY_NAME[name].message
    assert rules.BY_NAME["whole-slots"].message == planners.WHOLE_SLOTS_REFUSED
    assert rules.BY_NAME["whole-lookahead"].message == planners.WHOLE_LOOKAHEAD_REFUSED
    with pytest.raises(FlexoffloadError, match=mixed.BOTH_BOUNDS):
        rules.check(request_from_args(["-p", "x", "--precision", "auto", "--mem", "1G", "--max-kld", "0.1",
                                       "--min-tok-s", "2"]))
    moe = load(models["moe"])
    with pytest.raises(FlexoffloadError) as e:
        sparsity.check(moe)
    rule = rules.BY_NAME["sparsity-dense"]
    assert str(e.value) == rule.says(Request(prompt="x", sparsity="4"), rules.Headers(moe))


def _cli_raises() -> list[tuple[str, str]]:
    """(file, the start of the message) of each `raise FlexoffloadError(...)` in cli/: the text up to the first
    placeholder's end, as the source writes it."""
    found = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) \
                    and getattr(node.exc.func, "id", None) == "FlexoffloadError":
                found.append((path.name, ast.get_source_segment(path.read_text(), node.exc.args[0])))
    return found


def test_the_cli_raises_no_refusal_that_is_a_rule():
    raised = _cli_raises()
    messages = [r.message for r in rules.RULES]
    for file, source in raised:
        assert not any(m in source for m in messages), f"cli/{file} raises a rule's refusal: {source}"
        text = source.lstrip("f").strip("(\"'")
        assert any(file == f and text.startswith(start) for f, start in CLI_OWN), \
            f"cli/{file}: a refusal that is no rule and not listed in CLI_OWN (make it a rule): {source}"
    assert len(raised) == len(CLI_OWN)  # a listed one removed: take it out of the list

"""Options declared once (issue 40, item 1): one table gives each command its flags and the API its Request and
per-concern configs, with one default per option; each concern checks itself and the checks across concerns are
the table of refusals docs/options.md lists."""

from pathlib import Path

import pytest

from flexoffload import FlexoffloadError, options
from flexoffload.cli import request_from_args
from flexoffload.cli.bench import bench
from flexoffload.cli.plan import plan
from flexoffload.cli.profile import profile
from flexoffload.cli.run import run
from flexoffload.cli.serve import serve

COMMANDS = {"run": run, "plan": plan, "serve": serve, "bench": bench, "profile": profile}
DOC = Path(__file__).parent.parent / "docs" / "options.md"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_takes_exactly_the_table_s_options(name):
    command = COMMANDS[name]
    declared = {o.name: o for o in options.OPTIONS if name in o.commands and o.flags}
    params = {p.name: p for p in command.params}
    taken = {n for n in params if n in options.BY_NAME}
    assert taken == set(declared)
    for n, o in declared.items():
        flags = set(params[n].opts) | set(params[n].secondary_opts)
        assert flags == {f for decl in o.flags for f in decl.split("/")}
        assert params[n].default == o.default_for(name)


def test_the_api_and_the_command_line_have_the_same_defaults():
    assert request_from_args(["-p", "x"]) == options.Request(prompt="x")
    for cls in options.CONCERN_CLASSES.values():
        assert cls().check() is None  # every default passes its own check


def test_the_concerns_split_and_join_a_request_field_for_field():
    r = request_from_args(["-p", "x", "-n", "3", "--mem", "0.4x", "-md", "d.gguf", "--draft-max", "9", "--rpc",
                           "127.0.0.1:1", "--placement", "oato", "--precision", "auto", "--max-kld", "0.1"])
    parts = r.concerns()
    assert parts["draft"].model == "d.gguf" and parts["draft"].max == 9 and parts["placement"].policy == "oato"
    assert options.request(r.model, r.prompt, *parts.values(), ) == options.Request(
        **{**r.__dict__, "chat": False})


@pytest.mark.parametrize("args,words", [
    (["-c", "8"], "-c must be at least 16"),
    (["-ub", "600"], "-ub must be between"),
    (["-ctv", "q8_0", "-fa", "off"], "needs flash attention"),
    (["--strategy", "magic"], "unknown strategy"),
    (["--strategy", "sync", "--window", "2"], "does not apply to sync"),
    (["--spec-type", "nope"], "unknown --spec-type"),
    (["--spec-type", "auto,recycle"], "stand alone"),
    (["--spec-type", "model"], "give it with -md"),
    (["-ngl", "3"], "add --rpc"),
    (["--max-kld", "0.1"], "go with --precision auto"),
    (["--sparsity", "0"], "--sparsity takes auto"),
    (["--precision", "auto"], "--precision auto plans"),
    (["--sparsity", "4", "-md", "d.gguf"], "--sparsity: not with"),
])
def test_a_bad_combination_is_one_line_from_its_concern_or_a_rule(args, words):
    with pytest.raises(FlexoffloadError, match=words.replace("-", r"\-")) as e:
        options.check(request_from_args(["-p", "x", *args]))
    assert "\n" not in str(e.value)


def test_every_remaining_refusal_is_documented_with_its_reason():
    text = DOC.read_text()
    assert options.refusals_table() in text, "docs/options.md: run scripts/options_doc to refresh it"
    assert options.options_table() in text, "docs/options.md: run scripts/options_doc to refresh it"
    assert all(rule.reason for rule in options.RULES)

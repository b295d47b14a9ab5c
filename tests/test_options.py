"""Options declared once (issue 40, item 1): one table gives each command its flags and the API its Request and
per-concern configs, with one default per option; each concern checks itself and the checks across concerns are
the table of refusals docs/options.md lists."""

from pathlib import Path

import pytest

from flexoffload import FlexoffloadError, options, rules
from flexoffload.cli import request_from_args
from flexoffload.cli.bench import bench
from flexoffload.cli.plan import plan
from flexoffload.cli.profile import profile
from flexoffload.cli.run import run
from flexoffload.cli.serve import serve

COMMANDS = {"run": run, "plan": plan, "serve": serve, "bench": bench, "profile": profile}
DOC = Path(__file__).parent.parent / "docs" / "options.md"


def every_command(group=None, prefix=""):
    """Each command of the command line by its table name ("run", "models synth"), walked from the top group."""
    import click

    from flexoffload.cli import main

    group = group or main
    for name in group.list_commands(None):
        command = group.get_command(None, name)
        if isinstance(command, click.Group):
            yield from every_command(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_every_command_is_in_the_table():
    assert {name for name, _ in every_command()} == set(options.COMMANDS + options.TOOLS) | {"models fetch"}


@pytest.mark.parametrize("name,command", list(every_command()), ids=[name for name, _ in every_command()])
def test_each_command_takes_exactly_the_table_s_options(name, command):
    """Every flag of every command is a row of the table, with the table's flags and default: a click option
    declared anywhere else fails here."""
    import click

    declared = {o.name: o for o in options.OPTIONS if name in o.commands and o.flags}
    params = {p.name: p for p in command.params if isinstance(p, click.Option)}
    assert set(params) == set(declared), "declare the option in flexoffload/options.py"
    for n, o in declared.items():
        flags = set(params[n].opts) | set(params[n].secondary_opts)
        assert flags == {f for decl in o.flags for f in decl.split("/")}
        assert params[n].default == o.default_for(name)


def test_a_flag_means_one_thing_in_a_command():
    """Two rows may share a flag (-o: a plan's folder, a CSV file) but never a command."""
    seen = {}
    for o in options.OPTIONS:
        for flag in (f for decl in o.flags for f in decl.split("/")):
            for c in o.commands:
                assert (c, flag) not in seen, f"{flag} twice in {c}: {seen[(c, flag)]} and {o.name}"
                seen[(c, flag)] = o.name


def test_the_table_is_typed_data():
    """The concern classes and Request are typed by the table; a command's own flags are not Request fields."""
    fields = options.Request.__dataclass_fields__
    assert fields["n_ctx"].type is int and fields["window"].type == (int | None) and "as_json" not in fields
    assert options.Draft.__dataclass_fields__["max"].type == (int | None)
    assert all(f.type is not object for cls in options.CONCERN_CLASSES.values()
               for f in cls.__dataclass_fields__.values())


def test_the_api_and_the_command_line_have_the_same_defaults():
    assert request_from_args(["-p", "x"]) == options.Request(prompt="x")
    for cls in options.CONCERN_CLASSES.values():
        assert rules.check_concern(cls()) is None  # every default passes its own check


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
        rules.check(request_from_args(["-p", "x", *args]))
    assert "\n" not in str(e.value)


def test_every_remaining_refusal_is_documented_with_its_reason():
    text = DOC.read_text()
    assert rules.refusals_table() in text, "docs/options.md: run scripts/options_doc to refresh it"
    assert options.options_table() in text, "docs/options.md: run scripts/options_doc to refresh it"
    assert all(rule.reason for rule in rules.RULES)


def test_a_command_s_own_defaults_reach_the_api_the_same_way():
    """serve -c is 4096 on the command line and through options.request_for("serve"); -c given wins."""
    assert options.BY_NAME["n_ctx"].default_for("serve") == 4096
    assert options.request_for("serve").n_ctx == 4096 and options.request_for("serve", n_ctx=512).n_ctx == 512
    assert options.request_for("run").n_ctx == options.Request().n_ctx == 2048
    assert options.request_for("plan").n_predict == 0

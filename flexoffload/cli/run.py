"""`flexoffload run`: text from a prompt, streamed under a budget, speculated with a resident draft model or free
drafters, or a conversation (-cnv). Its options come from options.py's table."""

from __future__ import annotations

import sys

import click

from flexoffload import FlexoffloadError, options
from flexoffload.cli.common import _errors_as_one_line, click_options, _read_prompt, _report


def request_from_args(args: list[str]):
    """The Request `flexoffload run` arguments make, as the command line reads them (for scripts)."""
    ctx = run.make_context("run", list(args))
    return _request(ctx.params, ctx)


def _request(params: dict, ctx: click.Context):
    """The Request from run's parsed flags: the prompt read from -p/-f as llama.cpp reads it; with -cnv, -p, -f or
    -sys are the system message and a reply runs to the end of its turn (llama-cli's)."""
    prompt, prompt_file, system = params.get("prompt"), params.get("prompt_file"), params.get("system_prompt")
    fields = options.request_fields(params)
    if system is not None and not fields["chat"]:
        raise FlexoffloadError("-sys is the system message of a conversation: add -cnv")
    if fields["chat"]:
        if system is not None and (prompt is not None or prompt_file is not None):
            raise FlexoffloadError("give the system message with -sys, -p or -f, not two of them")
        if system is None and (prompt is not None or prompt_file is not None):
            system = _read_prompt(prompt, prompt_file)
        fields["prompt"] = system or " "
        if ctx.get_parameter_source("n_predict").name == "DEFAULT":
            fields["n_predict"] = -1
    else:
        fields["prompt"] = _read_prompt(prompt, prompt_file)
    return options.Request(**fields)


@click.command()
@click_options("run")
@_errors_as_one_line
def run(**params):
    """Generate text from a prompt (with -md: speculation by a resident draft model; -cnv: a conversation)."""
    from flexoffload import api
    from flexoffload.runtime.chat import HELP

    request = _request(params, click.get_current_context())
    as_json = params["as_json"]
    if request.chat and not as_json and sys.stdin.isatty():
        click.echo(f"flexoffload: a conversation ({HELP})", err=True)
    on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = api.generate(request, on_text=on_text, enforce=params["enforce"])
    _report(result, as_json)

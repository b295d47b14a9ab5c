"""What several commands share: the options table as click options, the one-line error, the prompt read as llama.cpp
reads it, and a run's report."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from flexoffload import FlexoffloadError, options


def _click_type(o: options.Option):
    """The click type of a table option (None: click's from the default)."""
    if o.choices is not None:
        return click.Choice(list(o.choices))
    if o.minimum is not None:
        return click.IntRange(min=o.minimum)
    if o.path == "dir":
        return click.Path(file_okay=False)
    if o.path == "file":
        return click.Path(exists=True, dir_okay=False)
    if o.path == "new":
        return click.Path(dir_okay=False)
    return o.type


def click_options(command: str):
    """A decorator giving a click command (a name of options.COMMANDS or TOOLS) every option options.OPTIONS gives
    it, in the table's order; each keeps its Request field's name as its parameter."""
    def decorate(f):
        for o in reversed([o for o in options.OPTIONS if command in o.commands and o.flags]):
            default = o.default_for(command)
            kwargs = dict(help=o.help_for(command), default=default, required=command in o.required_by)
            if o.is_flag:
                kwargs.update(is_flag=True)
                if o.flag_value is not None:
                    kwargs.update(flag_value=o.flag_value)
            else:
                if _click_type(o) is not None:
                    kwargs.update(type=_click_type(o))
                if o.flag_value is not None:  # a value that may be left off: --tune is --tune 3
                    kwargs.update(is_flag=False, flag_value=o.flag_value)
            if o.metavar:
                kwargs["metavar"] = o.metavar
            if o.envvar:
                kwargs.update(envvar=o.envvar, show_envvar=True)
            if default is not None and not o.is_flag and o.name != "model":
                kwargs["show_default"] = True
            f = click.option(*o.flags, o.name, **kwargs)(f)
        return f
    return decorate


def _errors_as_one_line(f):
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except FlexoffloadError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("flexoffload: interrupted", err=True)
            sys.exit(130)
    return wrapper


def _read_prompt(prompt: str | None, file: str | None) -> str:
    if prompt is not None and file is not None:
        raise FlexoffloadError("give the prompt with -p or -f, not both")
    if file is not None:
        try:
            # bytes as they are (no newline translation), and, as llama.cpp's -f, one trailing newline dropped:
            # the same file gives llama-completion's tokens
            text = Path(file).read_bytes().decode("utf-8")
            return text[:-1] if text.endswith("\n") else text
        except OSError as e:
            raise FlexoffloadError(f"cannot read prompt file {file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise FlexoffloadError(f"prompt file is not UTF-8 text: {file}") from None
    return "" if prompt is None else prompt  # none: rules.py's "prompt" refuses it, as an empty one


def _report(result: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo()
    peak = f"{result['peak_mem_mb']:.0f} MiB ({result['peak_source']})"
    budget = f", budget {result['budget_mb']:.0f} MiB" if result.get("budget_mb") else ""
    click.echo(
        f"flexoffload: {result['strategy']}: prompt {result['n_prompt']} tokens at {result['prompt_tok_s']:.1f} tok/s, "
        f"first token {result['ttft_s']:.2f} s, decode {result['n_gen']} tokens at {result['decode_tok_s']:.2f} tok/s, "
        f"peak {peak}{budget}",
        err=True,
    )

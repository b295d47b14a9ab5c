"""What several commands share: the one-line error, the prompt read as llama.cpp reads it, and a run's report."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from flexoffload import FlexoffloadError


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
    if prompt is None:
        raise FlexoffloadError("no prompt: give one with -p TEXT or -f FILE")
    return prompt


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

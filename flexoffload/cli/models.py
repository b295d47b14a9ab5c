"""`flexoffload models`: the catalog's real models (list, fetch) and synthetic ones (synth)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from flexoffload import FlexoffloadError
from flexoffload.cli.common import _errors_as_one_line, click_options
from flexoffload.gguf import catalog
from flexoffload.gguf import synth  # synth's choices are its shapes; cheap to import (no numpy until it writes)
from flexoffload.memory.budgets import format_size


@click.group()
def models():
    """The real models fetched from the package registry."""


@models.command("list")
@click_options("models list")
def models_list(as_json):
    """Names, sizes, paths and whether each is present."""
    rows = [{"name": e.name, "description": e.description, "size": e.size, "path": str(catalog.model_path(e)),
             "present": catalog.is_present(e)} for e in catalog.CATALOG.values()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(f"{'name':<30} {'size':>10}  {'present':<8} path")
    for r in rows:
        click.echo(f"{r['name']:<30} {format_size(r['size']):>10}  {'yes' if r['present'] else 'no':<8} {r['path']}")


@models.command("fetch")
@click.argument("names", nargs=-1)
@_errors_as_one_line
def models_fetch(names):
    """Download, assemble and verify models (all of them if none is named)."""
    for name in names or catalog.CATALOG:
        if name not in catalog.CATALOG:
            raise FlexoffloadError(f"unknown model '{name}': one of {', '.join(catalog.CATALOG)}")
        path = catalog.fetch(catalog.CATALOG[name])
        click.echo(f"{name}: {path}")


@models.command("synth")
@click.argument("shape", type=click.Choice(list(synth.SHAPES)))
@click_options("models synth")
@_errors_as_one_line
def models_synth(shape, output, qtype, seed, routing, tokenizer):
    """Write a synthetic GGUF with random weights and a real shape (its text is noise, its timing is real)."""
    target = Path(output)
    tmp = target.with_name(target.name + ".part")
    s = synth.SHAPES[shape]
    if routing == "text" and not s.n_expert:
        raise FlexoffloadError(f"--routing text is for a mixture of experts: {shape} has none")
    vocab = catalog.resolve(tokenizer) if tokenizer else None
    click.echo(f"{shape}: writing {format_size(synth.predicted_size(s, qtype, vocab))} to {target}", err=True)
    try:
        synth.write(tmp, s, qtype, seed, routing=routing, tokenizer=vocab, progress=_Progress(shape))
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FlexoffloadError(f"cannot write {output}: {e.strerror}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(target)  # whole or not at all
    click.echo(f"{shape}: {target} ({format_size(target.stat().st_size)})")


class _Progress:
    """A line on stderr at every tenth of the file written."""

    def __init__(self, what: str):
        self.what, self.shown = what, 0

    def __call__(self, done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > self.shown:
            self.shown = tenth
            click.echo(f"{self.what}: {tenth * 10} % ({format_size(done)} of {format_size(total)})", err=True)

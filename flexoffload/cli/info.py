"""`flexoffload info`: a model's tensor table, by layer and kind."""

from __future__ import annotations

import json

import click

from flexoffload.cli.common import _errors_as_one_line, click_options
from flexoffload.gguf import catalog
from flexoffload.memory.budgets import format_size


@click.command()
@click_options("info")
@_errors_as_one_line
def info(model, as_json):
    """The tensor table, grouped by layer and kind, with types, sizes and file offsets."""
    from flexoffload.gguf.model import KINDS, load

    model = load(catalog.resolve(model, fetch_missing=False))
    layers = sorted({t.layer for t in model.tensors if t.layer is not None})
    if as_json:
        click.echo(json.dumps({
            "path": str(model.path), "name": model.name, "arch": model.arch, "file_size": model.file_size,
            "weight_bytes": model.weight_bytes, "n_layer": model.n_layer, "n_embd": model.n_embd,
            "n_head": model.n_head, "n_head_kv": model.n_head_kv, "n_ff": model.n_ff, "n_vocab": model.n_vocab,
            "n_ctx_train": model.n_ctx_train, "n_expert": model.n_expert, "n_expert_used": model.n_expert_used,
            "routed_bytes": model.routed_bytes,
            "layers": {str(i): model.layer_bytes(i) for i in layers},
            "tensors": [{"name": t.name, "layer": t.layer, "kind": t.kind, "type": t.type, "shape": list(t.shape),
                         "bytes": t.n_bytes, "offset": t.offset} for t in model.tensors],
        }))
        return
    order = {k: i for i, k in enumerate(KINDS)}
    click.echo(f"{model.name} ({model.arch}): {model.path}")
    click.echo(f"{model.n_layer} layers, n_embd {model.n_embd}, heads {model.n_head} (kv {model.n_head_kv}), "
               f"n_ff {model.n_ff}, vocab {model.n_vocab}, trained context {model.n_ctx_train}")
    if model.n_expert:
        click.echo(f"a mixture of experts: {model.n_expert_used} of {model.n_expert} experts a token, per layer; "
                   f"one token reads {format_size(model.routed_bytes)} of {format_size(model.weight_bytes)}")
    click.echo(f"{'tensor':<28} {'kind':<12} {'type':<6} {'shape':<16} {'size':>12} {'offset':>12}")
    for layer in [None, *layers]:
        tensors = sorted(model.layer_tensors(layer), key=lambda t: (order[t.kind], t.name))
        if not tensors:
            continue
        click.echo(f"-- {'outside the layers' if layer is None else f'layer {layer}'}: "
                   f"{format_size(sum(t.n_bytes for t in tensors))}")
        for t in tensors:
            shape = "x".join(str(d) for d in t.shape)
            click.echo(f"{t.name:<28} {t.kind:<12} {t.type:<6} {shape:<16} {t.n_bytes:>12,} {t.offset:>12,}")
    click.echo("-- by kind")
    for kind in KINDS:
        n = sum(t.n_bytes for t in model.tensors if t.kind == kind)
        if n:
            click.echo(f"{kind:<28} {format_size(n):>12}")
    click.echo(f"total: {len(model.tensors)} tensors, {format_size(model.weight_bytes)} of weights, "
               f"file {format_size(model.file_size)}"
               + (f"; a token reads {format_size(model.routed_bytes)}" if model.n_expert else ""))

"""`flexoffload profile`: disk bandwidth and compute speed for the cost model; with --ops each weight's operator,
with --precision the harm of each lower type, with --experts the experts a text routes to and what an expert cache
would read (measure/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from flexoffload import FlexoffloadError
from flexoffload.cli.common import _errors_as_one_line, click_options
from flexoffload.gguf import catalog
from flexoffload.plan.qtypes import LADDER


def _profile_ops(model, threads: int, n_batch: int, remeasure: bool, as_json: bool, rpc: str | None) -> None:
    """`profile --ops`: the operator table, by kind (summed over the layers) and in all; with --rpc, each server's
    device profile after it."""
    from flexoffload.measure import opprofile
    from flexoffload.native import devices

    endpoints = devices.parse_endpoints(rpc) if rpc else []
    for endpoint in endpoints:
        devices.probe_rpc(endpoint)
    p = opprofile.cached(model, threads, n_batch, remeasure)
    measured = {e: opprofile.device_cached(model, e, threads, remeasure) for e in endpoints}
    if as_json:
        click.echo(json.dumps({**p.to_dict(), "devices": measured}))
        return
    kinds = {t.name: t.kind for t in model.tensors}
    decode, prompt = {}, {}
    for name, seconds in p.decode.items():
        decode[kinds.get(name, "?")] = decode.get(kinds.get(name, "?"), 0.0) + seconds
        prompt[kinds.get(name, "?")] = prompt.get(kinds.get(name, "?"), 0.0) + p.prompt.get(name, 0.0)
    click.echo(f"{model.path.name}: the CPU backend's operators, {threads} threads (ms; a ubatch of {p.n_batch})")
    click.echo(f"{'kind':<14} {'decode':>10} {'ubatch':>10}")
    for kind in sorted(decode, key=decode.get, reverse=True):
        click.echo(f"{kind:<14} {decode[kind] * 1e3:>10.3f} {prompt[kind] * 1e3:>10.2f}")
    total = sum(p.decode.values()) + p.others_decode_s
    click.echo(f"{'other ops':<14} {p.others_decode_s * 1e3:>10.3f}")
    click.echo(f"a decoded token: {total * 1e3:.2f} ms ({1 / total:.2f} tok/s); a ubatch: "
               f"{sum(p.prompt.values()) * 1e3:.1f} ms in its weights' operators; {len(p.decode)} tensors")
    for endpoint, d in measured.items():
        click.echo(f"RPC server {endpoint}: compute {d['compute_ratio']:.2f}x this CPU's time, "
                   f"{d['visit_s'] * 1e3:.2f} ms a visit, link {d['bandwidth'] / 1e6:.0f} MB/s (round trip "
                   f"{d['measured']['latency_s'] * 1e6:.0f} us)")


def _profile_precision(model, threads, n_groups, ladder, remeasure, as_json) -> None:
    """profile --precision: sensitivity.measure with a progress bar on stderr, then its table (or --json)."""
    from dataclasses import asdict

    from tqdm import tqdm

    from flexoffload.measure import sensitivity
    from flexoffload.plan import qtypes

    types = tuple(qtypes.qtype(x.strip()).name for x in ladder.split(",") if x.strip())
    for name in types:
        if not qtypes.cpu_can_run(name):
            raise FlexoffloadError(f"{name} has no dot product in the CPU backend: --types takes types it runs "
                                   f"({', '.join(LADDER)}, IQ types)")
    if n_groups < 1 or n_groups > model.n_layer:
        raise FlexoffloadError(f"--groups must be between 1 and the model's {model.n_layer} layers, not {n_groups}")
    bar = tqdm(desc="precision", unit="group", file=sys.stderr, disable=None)

    def on_row(row, done, total):
        bar.total = total
        bar.n = done
        bar.set_postfix_str(f"{row.group} {row.type}: KLD {row.kld:.4f}")

    result = sensitivity.measure(model, n_groups, types, threads, remeasure, on_row)
    bar.close()
    if as_json:
        click.echo(json.dumps(asdict(result)))
        return
    click.echo(f"{model.path.name}: UQEst {result.base_uqest:.3f} nats, perplexity {result.base_ppl:.3f} on the "
               f"calibration text (HumanEval 0-39)")
    click.echo(f"{'group':<24} {'type':<6} {'MiB saved':>9} {'KLD':>9} {'UQEst +':>8} {'same top':>8}")
    for r in sorted(result.rows, key=lambda r: r.kld / max(r.bytes_saved, 1)):
        click.echo(f"{r.group:<24} {r.type:<6} {r.bytes_saved / 2**20:9.1f} {r.kld:9.5f} {r.uqest_delta:+8.3f} "
                   f"{r.same_top:8.1%}")


def _slot_counts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise FlexoffloadError(f"--slots takes slot counts a layer, N,N,...: not {text!r}") from None


def _read_text(file: str | None) -> str | None:
    if file is None:
        return None
    try:
        return Path(file).read_text(encoding="utf-8")
    except OSError as e:
        raise FlexoffloadError(f"cannot read the text file {file}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise FlexoffloadError(f"the text file is not UTF-8: {file}") from None


def _profile_experts(model, threads, slots, file, batch, remeasure, as_json) -> None:
    """profile --experts: api.experts's table (or --json)."""
    from flexoffload import api

    r = api.experts(model, _slot_counts(slots), _read_text(file), threads, batch, remeasure)
    if as_json:
        click.echo(json.dumps(r))
        return
    unit = sum(r["unit_bytes"]) / len(r["unit_bytes"])
    click.echo(f"{r['name']}, traced on {r['source']}; {r['n_layer']} layers, {r['n_used']} of {r['n_expert']} "
               f"experts a token, an expert {unit / 2**20:.2f} MiB (its slices of the layer's expert tensors); disk "
               f"{r['disk_bw'] / 1e9:.2f} GB/s, {r['resident_tok_s']:.2f} tok/s with every weight in memory")
    click.echo(f"{'slots':>5} {'cache MiB':>9} {'policy':<7} {'hit':>6} {'pool hit':>8} {'units/tok':>9} "
               f"{'MB/tok':>7} {'tok/s':>7} {'units/ubatch':>12}")
    for row in r["rows"]:
        click.echo(f"{row['slots']:>5} {row['cache_bytes'] / 2**20:>9.1f} {row['policy']:<7} "
                   f"{row['hit_rate']:>6.1%} {row['pool_hit_rate']:>8.1%} {row['units_per_token']:>9.2f} "
                   f"{row['bytes_per_token'] / 1e6:>7.2f} {row['tok_s']:>7.2f} {row['units_per_ubatch']:>12.1f}")
    click.echo(f"slots: expert units cached a layer (pool hit: as many units shared by all layers); belady: the "
               f"bound no policy of slots a layer beats; units/ubatch: read by a prompt ubatch of {batch} tokens; "
               f"tok/s: decode, the misses read at the disk's bandwidth, none overlapping compute (docs/experts.md)")
    click.echo(f"{'layer':>5} {'touched/100':>11} {'entropy':>7} {'repeat':>6}")
    for x in r["locality"]:
        click.echo(f"{'mean' if x['layer'] < 0 else x['layer']:>5} {x['touched']:>11.1%} {x['entropy']:>7.3f} "
                   f"{x['repeat']:>6.1%}")
    click.echo("touched/100: the share of a layer's experts 100 tokens in a row use; entropy: of its load, 1 "
               "uniform; repeat: the share of a token's experts the token before used too; LRU hits at "
               + ", ".join(f"{k} slots {v:.1%}" for k, v in r["lru_hits"].items()) + " (plan/locality.py)")
    recall = [v for v in r["lookahead_recall"] or () if v > 0]
    if recall:
        mean = sum(recall) / len(recall)
        click.echo(f"lookahead: a layer's router input through the next layer's router predicts {mean:.1%} of that "
                   f"layer's experts on average ({min(recall):.1%}-{max(recall):.1%} by layer): the share of its "
                   f"misses the plan counts as read while the layer before computes")


def _profile_neurons(model, threads: int, n_group: int | None, levels: str | None, as_json: bool) -> None:
    """profile --neurons: measure/sparsity.py's grouped file and levels, progress on stderr, then the table."""
    from flexoffload.measure import sparsity

    try:
        used = tuple(int(k) for k in levels.split(",")) if levels else None
    except ValueError:
        raise FlexoffloadError(f"--levels takes whole numbers, a comma list, not {levels}") from None
    s = sparsity.measure(model, used, n_group or sparsity.GROUPS, say=lambda m: click.echo(f"flexoffload: {m}", err=True),
                         n_threads=threads)
    if as_json:
        click.echo(json.dumps(s.to_dict()))
        return
    click.echo(f"{model.path.name}: {s.n_hot} hot neurons and {s.n_group} groups of {s.group_width} a layer "
               f"({Path(s.file).name}); KL divergence against the file on held-out text, the predictor on held-out "
               f"calibration tokens")
    click.echo(f"{'groups':>7} {'FFN read':>9} {'weights':>8} {'KLD':>14} {'same top':>9} {'ppl':>7} "
               f"{'mass':>6} {'best':>6} {'recall':>7}")
    for x in s.levels:
        click.echo(f"{x.n_used:>7} {x.ffn_share:>9.1%} {x.read_share:>8.1%} {x.kld:>7.4f} ±{x.kld_err:.4f} "
                   f"{x.same_top:>9.1%} {x.ppl:>7.3f} {x.mass:>6.3f} {x.best_mass:>6.3f} {x.recall:>7.3f}")
    click.echo(f"dense perplexity {s.levels[0].ppl_dense:.3f}; mass: the share of a token's FFN output the hot set "
               "and the predicted groups hold (best: the best groups'); recall: of the best groups, the share "
               "predicted")


@click.command()
@click_options("profile")
@_errors_as_one_line
def profile(model, n_threads, remeasure, ops, n_batch, rpc, sensitivity, n_groups, ladder, experts, slots,
            prompt_file, neurons, neuron_groups, levels, as_json):
    """Measure disk bandwidth and compute speed for the cost model (cached per model file)."""
    from flexoffload.gguf.model import load
    from flexoffload.measure import profiler
    from flexoffload.plan.costmodel import compute_seconds

    threads = n_threads
    model = load(catalog.resolve(model))
    if rpc and not ops:
        raise FlexoffloadError("--rpc profiles the servers' devices with --ops")
    if (slots or prompt_file) and not experts:
        raise FlexoffloadError("--slots and -f go with --experts")
    if (levels or neuron_groups is not None) and not neurons:
        raise FlexoffloadError("--neuron-groups and --levels go with --neurons")
    if neurons:
        _profile_neurons(model, threads, neuron_groups, levels, as_json)
        return
    if experts:
        _profile_experts(model, threads, slots, prompt_file, n_batch or 512, remeasure, as_json)
        return
    if sensitivity:
        _profile_precision(model, threads, n_groups, ladder, remeasure, as_json)
        return
    if ops:
        _profile_ops(model, threads, n_batch or 64, remeasure, as_json, rpc)
        return
    p = profiler.measure(model, threads, remeasure=remeasure)
    tok_s = 1.0 / compute_seconds(model, p)
    runs = len(profiler.seen_disk_bw(model.path))
    if as_json:  # disk_bw: what plans use; the profile's own passes and the runs' count beside it
        click.echo(json.dumps({**p.to_dict(), "compute_tok_s": tok_s, "disk_runs": runs,
                               "disk_bw_profile": profiler.as_measured(model, threads).disk_bw}))
        return
    typical = f" (the median of the profile's and {runs} streamed runs')" if runs else ""
    click.echo(f"{model.path.name}: disk {p.disk_bw / 1e9:.2f} GB/s with O_DIRECT{typical}, "
               f"{p.io_latency * 1e6:.0f} us a small read; decode {tok_s:.2f} tok/s with every weight in memory "
               f"({threads} threads)")

"""The `flexoffload` command line: run, bench, profile, plan, info, models.

Text goes to stdout, timings and progress to stderr, `--json` prints one object for scripts. Bad input
is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click

from flexoffload import FlexoffloadError, __version__
from flexoffload.memory import budget as budgets
from flexoffload.gguf import models as catalog
from flexoffload.plan.precision import LADDER

PLACEMENTS = ("auto", "oato", "layers", "split")  # placers.solve's policies
from flexoffload.memory.budget import MiB, format_size
from flexoffload.runtime.engine import KV_TYPES


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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="flexoffload")
def main():
    """Run GGUF models larger than the memory you give them, at the speed the disk allows."""


# --- run --------------------------------------------------------------------------------------

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


def _precision_options(f):
    """run's and plan's --precision auto, its bounds and the original weights (mixed.py)."""
    f = click.option("--original", type=click.Path(exists=True, dir_okay=False), default=None, metavar="GGUF",
                     help="with --precision auto: the model's original F16/BF16 weights, quantized from instead of "
                          "requantizing the file (a second rounding loses more)")(f)
    f = click.option("--min-tok-s", type=float, default=None,
                     help="with --precision auto: instead, the least harm that reaches this predicted tok/s")(f)
    f = click.option("--max-kld", type=float, default=None,
                     help="with --precision auto: the fastest plan whose summed KL divergence is at most this "
                          "[0.05]")(f)
    return click.option("--precision", type=click.Choice(["auto"]), default=None,
                        help="with --mem: lower some tensors' types where it costs the least quality per byte saved "
                             "(profile --precision measures it) [default: the file's own types]")(f)


@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("-p", "--prompt", help="prompt text")
@click.option("-f", "--file", "prompt_file", metavar="FILE", help="read the prompt from FILE")
@click.option("-n", "--n-predict", default=128, show_default=True, help="tokens to generate (-1: until end of text)")
@click.option("-c", "--ctx-size", default=2048, show_default=True, help="context size in tokens")
@click.option("-b", "--batch-size", default=512, show_default=True, help="prompt tokens per llama_decode call")
@click.option("-ub", "--ubatch-size", "n_ubatch", default=0,
              help="prompt tokens per forward pass [default: -b; under --mem, chosen for a prompt over 256 tokens]")
@click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
              show_default=True, help="llama.cpp's attention path")
@click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(KV_TYPES), default="f16", show_default=True,
              help="the KV cache's K type")
@click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(KV_TYPES), default="f16", show_default=True,
              help="the KV cache's V type (quantized: with flash attention)")
@click.option("-t", "--threads", default=os.cpu_count() or 1, show_default=True)
@click.option("--temp", default=0.8, show_default=True, help="temperature; 0 is greedy")
@click.option("--seed", default=-1, show_default=True, help="sampling seed (-1: random)")
@click.option("--mem", help="memory budget for the whole process: 400M, 1.5G, or 0.4x of the model's size")
@click.option("--enforce", is_flag=True, help="hold the run to --mem with a memory cgroup and report its peak")
@click.option("--strategy", default=None,
              help="stream (the default with --mem or --plan), mmap (upstream; the default otherwise), prefetch, sync")
@click.option("--policy", default="balanced", show_default=True,
              help="what stays resident under --mem: balanced, flexinfer, attn-first, ffn-first, layer")
@click.option("--plan", "plan_dir", type=click.Path(file_okay=False), help="stream by a saved plan (flexoffload plan)")
@click.option("--window", type=int, default=None, help="prefetch window in layers [default: the plan's]")
@click.option("--io-threads", type=int, default=None, help="threads reading streamed weights [default: the plan's, 4]")
@click.option("-md", "--model-draft", "draft_spec", metavar="MODEL",
              help="a draft model kept resident: token-tree speculation (same vocabulary as the target)")
@click.option("--draft-max", type=int, default=None,
              help="node budget of a speculation tree [default: from the measured target pass and draft token]")
@click.option("--draft-p-split", default=0.3, show_default=True, help="a draft candidate this likely opens a branch")
@click.option("--spec", "spec_mode", type=click.Choice(["tree", "chain"]), default="tree", show_default=True,
              help="speculation shape: a token tree, or a linear chain")
@click.option("--no-pacer", is_flag=True, help="grow branches in turn, not by confidence (ablation)")
@click.option("--no-adaptive", is_flag=True, help="verify only at the node budget, not on low confidence (ablation)")
@click.option("--no-adaptive-split", is_flag=True,
              help="keep --draft-p-split as given, not moved by which branches the target accepts (ablation)")
@click.option("--pipeline/--no-pipeline", default=False, show_default=True,
              help="draft on while the target verifies, under SCHED_IDLE (within noise on 2 cores: off by default)")
@click.option("--draft-always", is_flag=True,
              help="speculate even where the target alone is predicted faster at --mem [default: run it alone]")
@click.option("--tuned/--untuned", default=True, show_default=True,
              help="stream by the plan `plan --tune` made for this model, budget and -c/-b, where there is one")
@click.option("--rpc", "rpc", metavar="HOST:PORT,...",
              help="RPC servers (ggml-rpc-server) to place weights on: by --plan, by -ngl, or placed now with "
                   "--mem (cpu=SIZE,rpc0=SIZE,...)")
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", default=0, show_default=True,
              help="with --rpc: the last layers to offload to the servers, each with its KV cache (llama.cpp's -ngl)")
@click.option("--placement", type=click.Choice(PLACEMENTS), default="auto", show_default=True,
              help="with --rpc and --mem: how weights are placed across the devices")
@_precision_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text and timings")
@click.option("-v", "--verbose", is_flag=True, help="show llama.cpp's log")
@_errors_as_one_line
def run(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, n_ubatch, flash_attn, cache_type_k,
        cache_type_v, threads, temp, seed,
        mem, enforce, strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max, draft_p_split, spec_mode,
        no_pacer, no_adaptive, no_adaptive_split, pipeline, draft_always, tuned, rpc, n_gpu_layers, placement,
        precision, max_kld, min_tok_s, original, as_json, verbose):
    """Generate text from a prompt (with -md: speculation by a resident draft model)."""
    from flexoffload import api

    request = request_from_flags(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, threads, temp,
                                 seed, mem, strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max,
                                 draft_p_split, spec_mode, no_pacer, no_adaptive, no_adaptive_split, pipeline,
                                 draft_always, tuned, verbose, rpc, n_gpu_layers, placement, n_ubatch, flash_attn,
                                 cache_type_k, cache_type_v, precision, max_kld, min_tok_s, original)
    on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = api.generate(request, on_text, enforce=enforce, echo=lambda msg: click.echo(msg, err=True))
    _report(result, as_json)


def request_from_flags(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, threads, temp, seed, mem,
                       strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max, draft_p_split,
                       spec_mode, no_pacer, no_adaptive, no_adaptive_split, pipeline, draft_always, tuned, verbose,
                       rpc=None, n_gpu_layers=0, placement="auto", n_ubatch=0, flash_attn="auto",
                       cache_type_k="f16", cache_type_v="f16", precision=None, max_kld=None, min_tok_s=None,
                       original=None):
    """api.Request from `run`'s flags (the prompt read from -f as llama.cpp reads it)."""
    from flexoffload import api

    return api.Request(
        model=model_spec, prompt=_read_prompt(prompt, prompt_file), n_predict=n_predict, n_ctx=ctx_size,
        n_batch=batch_size, n_threads=threads, temp=temp, seed=seed, mem=mem, strategy=strategy, policy=policy,
        plan_dir=plan_dir, window=window, io_threads=io_threads, draft=draft_spec, draft_max=draft_max,
        draft_p_split=draft_p_split, spec=spec_mode, pacer=not no_pacer, adaptive=not no_adaptive,
        adaptive_split=not no_adaptive_split, pipeline=pipeline, draft_always=draft_always, tuned=tuned,
        verbose=verbose, rpc=rpc, n_gpu_layers=n_gpu_layers, placement=placement, n_ubatch=n_ubatch,
        flash_attn=flash_attn, cache_type_k=cache_type_k, cache_type_v=cache_type_v, precision=precision,
        max_kld=max_kld, min_tok_s=min_tok_s, original=original)


def request_from_args(args: list[str]):
    """api.Request from `flexoffload run` arguments, as the command line would read them (for scripts)."""
    ctx = run.make_context("run", list(args))
    params = dict(ctx.params)
    params.pop("enforce")
    params.pop("as_json")
    return request_from_flags(**params)


# --- bench ------------------------------------------------------------------------------------

@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("--mem", "mems", required=True, help="comma-separated budgets: 400M,0.5x,1.0x")
@click.option("--strategies", default="mmap", show_default=True, help="comma-separated strategies")
@click.option("-r", "--repetitions", default=3, show_default=True)
@click.option("-n", "--n-predict", default=32, show_default=True)
@click.option("-p", "--prompt", default=None, help="prompt text [default: a fixed code prompt]")
@click.option("-c", "--ctx-size", default=2048, show_default=True)
@click.option("-t", "--threads", default=os.cpu_count() or 1, show_default=True)
@click.option("-o", "--output", "csv_path", type=click.Path(dir_okay=False), help="write the table as CSV")
@_errors_as_one_line
def bench(model_spec, mems, strategies, repetitions, n_predict, prompt, ctx_size, threads, csv_path):
    """Measure decode speed and peak memory per budget and strategy, each run in its own cgroup."""
    from flexoffload.bench import sweep as benchmark

    rows = benchmark.run(
        model_spec=model_spec, mems=[m.strip() for m in mems.split(",") if m.strip()],
        strategies=[s.strip() for s in strategies.split(",") if s.strip()], repetitions=repetitions,
        n_predict=n_predict, prompt=prompt, n_ctx=ctx_size, n_threads=threads,
        echo=lambda msg: click.echo(msg, err=True))
    click.echo(benchmark.markdown(rows))
    if csv_path:
        benchmark.write_csv(rows, csv_path)
        click.echo(f"flexoffload: wrote {csv_path}", err=True)


# --- profile and plan -------------------------------------------------------------------------

@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("-t", "--threads", default=os.cpu_count() or 1, show_default=True)
@click.option("--remeasure", is_flag=True, help="measure again even if a profile is cached")
@click.option("--ops", is_flag=True,
              help="time every weight's operator (MUL_MAT, GET_ROWS) for a decoded token and a prompt ubatch")
@click.option("-b", "--batch-size", default=64, show_default=True, help="with --ops: the prompt ubatch timed")
@click.option("--rpc", "rpc", metavar="HOST:PORT,...",
              help="with --ops: each RPC server's device as well (its compute against this CPU's, a visit's cost, "
                   "its link), from whole tokens with layers placed on it")
@click.option("--precision", is_flag=True,
              help="measure the harm of each lower type per group of tensors (KL divergence, UQEst) for "
                   "plan --precision auto")
@click.option("--groups", "n_groups", default=4, show_default=True, help="with --precision: layer groups per kind")
@click.option("--types", "ladder", default=",".join(LADDER),
              show_default=True, help="with --precision: the lower types a tensor may take")
@click.option("--json", "as_json", is_flag=True)
@_errors_as_one_line
def profile(model_spec, threads, remeasure, ops, batch_size, rpc, precision, n_groups, ladder, as_json):
    """Measure disk bandwidth and compute speed for the cost model (cached per model file)."""
    from flexoffload.measure import profile as profiler
    from flexoffload.plan.costmodel import compute_seconds
    from flexoffload.gguf.model import load

    model = load(catalog.resolve(model_spec))
    if rpc and not ops:
        raise FlexoffloadError("--rpc profiles the servers' devices with --ops")
    if precision:
        _profile_precision(model, threads, n_groups, ladder, remeasure, as_json)
        return
    if ops:
        _profile_ops(model, threads, batch_size, remeasure, as_json, rpc)
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


def _profile_precision(model, threads, n_groups, ladder, remeasure, as_json) -> None:
    """profile --precision: sensitivity.measure with a progress bar on stderr, then its table (or --json)."""
    from dataclasses import asdict

    from tqdm import tqdm

    from flexoffload.plan import precision
    from flexoffload.measure import sensitivity

    types = tuple(precision.qtype(x.strip()).name for x in ladder.split(",") if x.strip())
    for name in types:
        if not precision.cpu_can_run(name):
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


@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("--mem", required=True, help="memory budget for the whole process: 400M, 1.5G or 0.4x; with --rpc "
                                           "also per device: cpu=600M,rpc0=700M")
@click.option("--policy", default="balanced", show_default=True,
              help="balanced, flexinfer, attn-first, ffn-first or layer")
@click.option("--rpc", "rpc", metavar="HOST:PORT,...", help="RPC servers whose devices the plan places weights on")
@click.option("--placement", type=click.Choice(PLACEMENTS), default="auto", show_default=True,
              help="with --rpc: how weights are placed across the devices")
@click.option("-c", "--ctx-size", default=2048, show_default=True)
@click.option("-b", "--batch-size", default=512, show_default=True)
@click.option("-t", "--threads", default=os.cpu_count() or 1, show_default=True)
@click.option("--window", type=int, default=None, help="prefetch window in layers [default: the fastest predicted]")
@click.option("--io-threads", default=4, show_default=True)
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False),
              help="directory for tensors.ot and plan.json")
@click.option("--tune", "tune_best", type=int, default=None, is_flag=False, flag_value=3, metavar="[N]",
              help="measure the N best predicted plans (3) and every baseline policy under the enforced budget, "
                   "keep the fastest (run --mem then uses it)")
@click.option("--tune-rounds", default=2, show_default=True, help="runs of each candidate, in turn")
@click.option("--max-prompt", is_flag=True,
              help="report the longest prompt --mem holds (and the ubatch it needs), instead of writing a plan")
@click.option("--prompt-len", type=int, default=None, metavar="L",
              help="report a prefill of L tokens step by step at each ubatch (memory: its peak and what it leaves)")
@click.option("-n", "--n-predict", default=0, show_default=True, help="with --max-prompt: tokens to generate after it")
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="with --max-prompt or --prompt-len: llama.cpp's attention path")
@click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(KV_TYPES), default="f16", show_default=True,
              help="with --max-prompt or --prompt-len: the KV cache's K type")
@click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(KV_TYPES), default="f16", show_default=True,
              help="with --max-prompt or --prompt-len: the KV cache's V type")
@_precision_options
@click.option("--json", "as_json", is_flag=True)
@_errors_as_one_line
def plan(model_spec, mem, policy, rpc, placement, ctx_size, batch_size, threads, window, io_threads, out_dir, tune_best,
         tune_rounds, max_prompt, prompt_len, n_predict, flash_attn, cache_type_k, cache_type_v, precision, max_kld,
         min_tok_s, original, as_json):
    """Choose which tensors stay resident under a budget; write tensors.ot and plan.json."""
    from flexoffload.plan import mixed
    from flexoffload.plan import plan as plans
    from flexoffload.measure import profile as profiler
    from flexoffload.gguf.model import load
    from flexoffload.plan.planners import plan_budget

    model = load(catalog.resolve(model_spec))
    if max_prompt or prompt_len is not None:
        _plan_prompt(model, mem, max_prompt, prompt_len, n_predict, flash_attn, (cache_type_k, cache_type_v), as_json)
        return
    if out_dir is None:
        raise FlexoffloadError("plan writes its files to -o DIR")
    mixed.check_options(precision, max_kld, min_tok_s, original)
    profile = profiler.measure(model, threads)
    if precision:
        if rpc or tune_best is not None or policy != "balanced" or window is not None:
            raise FlexoffloadError("--precision auto plans with the balanced policy: not with --rpc, --tune, "
                                   "--policy or --window, for now")
        _plan_precision(model, budgets.parse_size(mem, model.file_size), profile, ctx_size, batch_size, threads,
                        io_threads, max_kld, min_tok_s, original, out_dir, as_json)
        return
    if rpc:
        _plan_placement(model, rpc, mem, placement, profile, threads, ctx_size, batch_size, io_threads, out_dir,
                        as_json)
        return
    budget = budgets.parse_size(mem, model.file_size)
    if tune_best is not None:
        from flexoffload.measure import tune

        if tune_best < 1 or tune_rounds < 1 or policy != "balanced" or window is not None:
            raise FlexoffloadError("--tune takes N >= 1 and --tune-rounds >= 1; it chooses the policy and window")
        p = tune.tune(model, budget, profile, ctx_size, batch_size, tune_best, tune_rounds,
                      echo=None if as_json else lambda msg: click.echo(msg, err=True))
    else:
        p = plan_budget(model, budget, policy, profile, n_ctx=ctx_size, n_batch=batch_size, window=window,
                        io_threads=io_threads)
    plans.write(p, out_dir)
    if as_json:
        click.echo(json.dumps(p.to_dict()))
        return
    m = p.memory
    streamed = plans.streamed_bytes(p, model)
    click.echo(f"{model.path.name}: {p.policy} plan for {format_size(p.budget)}, written to {out_dir}")
    click.echo(f"  resident {m.resident / MiB:.0f} MiB ({len(p.resident)} tensors); streamed {streamed / MiB:.0f} MiB "
               f"per token ({len(p.streamed)} tensors) through a window of {p.window} ({m.window / MiB:.0f} MiB)")
    click.echo(f"  KV cache {m.kv_cache / MiB:.0f} MiB, compute buffers {m.compute / MiB:.0f} MiB, "
               f"runtime {m.overhead / MiB:.0f} MiB: {m.total / MiB:.0f} of {p.budget / MiB:.0f} MiB")
    click.echo(f"  predicted {p.predicted_tok_s:.2f} tok/s; roofline {p.roofline_tok_s:.2f} tok/s")
    if p.tuning:
        from flexoffload.measure import tune

        click.echo("  tuned: the candidates, measured under the budget\n" + tune.describe(p))


def _plan_precision(model, budget, profile, ctx_size, batch_size, threads, io_threads, max_kld, min_tok_s, original,
                    out_dir, as_json):
    """plan --precision auto: precision and residency together (mixed.py), the requantized file's quality measured."""
    from tqdm import tqdm

    from flexoffload.plan import mixed
    from flexoffload.plan import plan as plans

    bar = tqdm(desc="precision", unit="group", file=sys.stderr, disable=None)

    def on_row(row, done, total):
        bar.total, bar.n = total, done
        bar.set_postfix_str(f"{row.group} {row.type}")

    p, walk = mixed.plan(model, budget, profile, ctx_size, batch_size, max_kld, min_tok_s, threads, io_threads,
                         original=Path(original) if original else None, on_row=on_row)
    bar.close()
    plans.write(p, out_dir)
    if as_json:
        click.echo(json.dumps({**p.to_dict(), "walk": [
            {"steps": len(x.steps), "kld": x.kld, "weight_bytes": x.weight_bytes,
             "predicted_tok_s": x.predicted_tok_s} for x in walk.points]}))
        return
    r = p.precision
    click.echo(f"{model.path.name}: {len(r['types'])} tensors lowered ({len(r['steps'])} steps), weights "
               f"{format_size(r['source_weight_bytes'])} -> {format_size(r['weight_bytes'])}, written to {p.model}"
               + (f" (quantized from {Path(original).name})" if original else ""))
    click.echo(f"  predicted {p.predicted_tok_s:.2f} tok/s at {format_size(budget)} (the file's own types: "
               f"{r['own_types_tok_s']:.2f}); KL divergence summed over the groups {r['predicted_kld']:.4f}")
    if "measured" in r:
        q = r["measured"]
        click.echo(f"  measured: KL divergence {q['kld']:.4f} (calibration), {q['held_out_kld']:.4f} (held out); "
                   f"held-out perplexity {q['held_out_ppl']:.3f} vs {q['held_out_ppl_base']:.3f}; UQEst "
                   f"{q['uqest']:.3f} vs {q['uqest_base']:.3f}")
    click.echo(f"  plan written to {out_dir}: run it with flexoffload run --plan {out_dir}")


def _plan_prompt(model, mem, max_prompt, prompt_len, n_predict, flash_attn, cache_types, as_json):
    """`plan --max-prompt` and `plan --prompt-len L`: long prompts under a budget (stepmem.py)."""
    from flexoffload.memory import stepmem

    budget = budgets.parse_size(mem, model.file_size)
    if max_prompt:
        if cache_types != ("f16", "f16") and flash_attn != "on":
            raise FlexoffloadError("a quantized KV cache needs flash attention (-fa on)")
        found = stepmem.max_prompt(model, budget, n_predict, flash_attn, *cache_types)
        if as_json:
            click.echo(json.dumps({"budget": budget, "longest": None if found is None else found.__dict__}))
            return
        if found is None:
            least = stepmem.minimum(model, stepmem.Setting(stepmem.CELLS, min(stepmem.UBATCHES), flash_attn,
                                                           *cache_types))
            raise FlexoffloadError(f"{format_size(budget)} holds no prompt of {model.path.name}: the minimum is "
                                   f"{format_size(least, up=True)}")
        click.echo(f"{model.path.name} at {format_size(budget)}: prompts up to {found.n_prompt} tokens"
                   f"{f' (and {n_predict} generated)' if n_predict else ''}, with a ubatch of {found.n_ubatch}: "
                   f"KV cache {found.kv_cache / MiB:.0f} MiB, compute {found.compute / MiB:.0f} MiB, the run needs "
                   f"{format_size(found.minimum, up=True)} (flash attention {flash_attn}, KV cache "
                   f"{'/'.join(dict.fromkeys(cache_types))})")
        return
    if prompt_len < 1 or prompt_len > model.n_ctx_train:
        raise FlexoffloadError(f"--prompt-len {prompt_len}: between 1 and the trained context, {model.n_ctx_train}")
    n_ctx = stepmem.cells_for(prompt_len + n_predict)
    rows = []
    for u in stepmem.UBATCHES:
        setting = stepmem.Setting(n_ctx, min(u, n_ctx), flash_attn, *cache_types)
        costs = stepmem.run_costs(model, setting, budget)
        rows.append({"n_ubatch": setting.n_ubatch, "passes": -(-prompt_len // setting.n_ubatch),
                     "minimum": stepmem.minimum(model, setting, costs), "kv_cache": costs["kv_cache"],
                     "compute": costs["compute"],
                     "steps": stepmem.steps(model, setting.n_ubatch, n_ctx, flash_attn == "on")})
    if as_json:
        click.echo(json.dumps({"budget": budget, "n_ctx": n_ctx, "ubatches": rows}))
        return
    click.echo(f"{model.path.name}: a prefill of {prompt_len} tokens, {n_ctx} cells, flash attention {flash_attn}; "
               f"MiB")
    names = "  ".join(step["step"] for step in rows[0]["steps"])
    click.echo(f"{'ubatch':>6} {'passes':>6} {'KV':>6} {'compute':>8} {'minimum':>8}  {names} (a layer's "
               f"activations at each step's peak)")
    for r in rows:
        fits = "" if r["minimum"] <= budget else "  (over the budget)"
        peaks = "  ".join(f"{x['peak'] / MiB:.1f}" for x in r["steps"])
        click.echo(f"{r['n_ubatch']:>6} {r['passes']:>6} {r['kv_cache'] / MiB:>6.0f} {r['compute'] / MiB:>8.1f} "
                   f"{r['minimum'] / MiB:>8.0f}  "
                   f"{peaks}{fits}")


def _plan_placement(model, rpc, mem, placement, profile, threads, n_ctx, n_batch, io_threads, out_dir, as_json):
    """`plan --rpc`: weights placed across the servers' devices, the host's share planned under its budget."""
    from flexoffload.native import devices
    from flexoffload.plan import placers
    from flexoffload.plan import plan as plans

    endpoints = devices.parse_endpoints(rpc)
    for endpoint in endpoints:
        devices.probe_rpc(endpoint)
    p = placers.for_endpoints(model, endpoints, mem, placement, profile, threads, n_ctx, n_batch, io_threads)
    plans.write(p, out_dir)
    if as_json:
        click.echo(json.dumps(p.to_dict()))
        return
    at = p.placement
    cost = at["cost"]
    click.echo(f"{model.path.name}: {at['policy']} placement, written to {out_dir} (llama.cpp: "
               f"{' '.join(at['llama_args'])} -ot tensors.ot)")
    click.echo(f"  this machine: resident {p.memory.resident / MiB:.0f} MiB, streamed "
               f"{plans.streamed_bytes(p, model) / MiB:.0f} MiB a token, {p.memory.total / MiB:.0f} of "
               f"{p.budget / MiB:.0f} MiB; compute {cost['host_compute_s'] * 1e3:.1f} ms a token")
    for d in at["per_device"]:
        click.echo(f"  {d['name']}: {d['memory'] / MiB:.0f} of {d['budget'] / MiB:.0f} MiB; compute "
                   f"{d['compute_s'] * 1e3:.1f} ms a token")
    click.echo(f"  {cost['visits']} visit(s) to the devices a token, {cost['transfer_bytes'] / 1024:.0f} KiB over the "
               f"links, {cost['transfer_s'] * 1e3:.1f} ms; predicted {p.predicted_tok_s:.2f} tok/s")


# --- info -------------------------------------------------------------------------------------

@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("--json", "as_json", is_flag=True, help="print the table as JSON")
@_errors_as_one_line
def info(model_spec, as_json):
    """The tensor table, grouped by layer and kind, with types, sizes and file offsets."""
    from flexoffload.gguf.model import KINDS, load

    model = load(catalog.resolve(model_spec, fetch_missing=False))
    layers = sorted({t.layer for t in model.tensors if t.layer is not None})
    if as_json:
        click.echo(json.dumps({
            "path": str(model.path), "name": model.name, "arch": model.arch, "file_size": model.file_size,
            "weight_bytes": model.weight_bytes, "n_layer": model.n_layer, "n_embd": model.n_embd,
            "n_head": model.n_head, "n_head_kv": model.n_head_kv, "n_ff": model.n_ff, "n_vocab": model.n_vocab,
            "n_ctx_train": model.n_ctx_train,
            "layers": {str(i): model.layer_bytes(i) for i in layers},
            "tensors": [{"name": t.name, "layer": t.layer, "kind": t.kind, "type": t.type, "shape": list(t.shape),
                         "bytes": t.n_bytes, "offset": t.offset} for t in model.tensors],
        }))
        return
    order = {k: i for i, k in enumerate(KINDS)}
    click.echo(f"{model.name} ({model.arch}): {model.path}")
    click.echo(f"{model.n_layer} layers, n_embd {model.n_embd}, heads {model.n_head} (kv {model.n_head_kv}), "
               f"n_ff {model.n_ff}, vocab {model.n_vocab}, trained context {model.n_ctx_train}")
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
               f"file {format_size(model.file_size)}")


def _profile_ops(model, threads: int, n_batch: int, remeasure: bool, as_json: bool, rpc: str | None) -> None:
    """`profile --ops`: the operator table, by kind (summed over the layers) and in all; with --rpc, each server's
    device profile after it."""
    from flexoffload.native import devices
    from flexoffload.measure import opprofile

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


# --- devices ----------------------------------------------------------------------------------

@main.command()
@click.option("--rpc", "rpc", metavar="HOST:PORT,...", help="RPC servers (ggml-rpc-server) to ask as well")
@click.option("--links", is_flag=True, help="with --rpc: time each server's link (round trip, MB/s each way)")
@click.option("--json", "as_json", is_flag=True, help="print the devices as JSON")
@_errors_as_one_line
def devices(rpc, links, as_json):
    """The backends a plan can place tensors on, with their memory: this machine's, and RPC servers'."""
    from flexoffload.native import devices as backends

    found = backends.local()
    endpoints = backends.parse_endpoints(rpc) if rpc else []
    for endpoint in endpoints:
        found += backends.probe_rpc(endpoint)
    timed = [backends.measure_link(e) for e in endpoints] if links else []
    if as_json:
        click.echo(json.dumps({"devices": [d.to_dict() for d in found], "links": [t.to_dict() for t in timed]}
                              if links else [d.to_dict() for d in found]))
        return
    click.echo(f"{'device':<28} {'kind':<6} {'free':>10} {'total':>10}  description")
    for d in found:
        click.echo(f"{d.name:<28} {d.kind:<6} {format_size(d.free):>10} {format_size(d.total):>10}  {d.description}")
        for buft in d.buffer_types:
            click.echo(f"  buffer type {buft} (weights repacked for its kernels: in host memory)")
    for t in timed:
        click.echo(f"link to {t.endpoint}: round trip {t.latency_s * 1e6:.0f} us, {t.send_bw / 1e6:.1f} MB/s there, "
                   f"{t.recv_bw / 1e6:.1f} MB/s back")
    if any(d.kind == "RPC" for d in found):
        click.echo("(an RPC server reports its machine's memory, not a cgroup's: give --mem per device)", err=True)


# --- models -----------------------------------------------------------------------------------

@main.group()
def models():
    """The real models fetched from the package registry."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True)
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


from flexoffload.gguf import synth  # beside its command, whose choices are its shapes; cheap to import (no numpy until it writes)


@models.command("synth")
@click.argument("shape", type=click.Choice(list(synth.SHAPES)))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="where to write the GGUF")
@click.option("--qtype", type=click.Choice(["Q4_0", "F32"]), default="Q4_0", show_default=True)
@click.option("--seed", default=0, show_default=True)
@_errors_as_one_line
def models_synth(shape, output, qtype, seed):
    """Write a synthetic GGUF with random weights and a real shape (its text is noise, its timing is real)."""
    target = Path(output)
    tmp = target.with_name(target.name + ".part")
    try:
        synth.write(tmp, synth.SHAPES[shape], qtype, seed)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise FlexoffloadError(f"cannot write {output}: {e.strerror}") from None
    tmp.replace(target)  # whole or not at all
    click.echo(f"{shape}: {target} ({format_size(target.stat().st_size)})")

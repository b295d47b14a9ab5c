"""The `flexoffload` command line: run, bench, profile, plan, info, models.

Text goes to stdout, timings and progress to stderr, `--json` prints one object for scripts. Bad input
is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from . import FlexoffloadError, __version__
from . import budget as budgets
from . import models as catalog
from .budget import MiB, format_size


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


def plan_for_run(model, strategy: str, policy: str, plan_dir: str | None, budget: int | None, n_ctx: int,
                 n_batch: int, n_threads: int, window: int | None, io_threads: int, n_outputs: int = 1,
                 n_seq_max: int = 1, draft: int = 0):
    """The plan a run streams by, or None for mmap (and for `stream` with neither budget nor plan: all resident).

    prefetch and sync stream every tensor but the small ones (policy none), with window 3 and 0. draft: the bytes a
    resident draft model takes out of the budget.
    """
    from . import plan as plans
    from . import profile as profiler
    from .planners import plan_budget

    if budget is not None:  # llama.cpp's own report of the context: refuses a model it cannot load, first
        budgets.context_bytes(model, n_ctx, n_batch, n_outputs, n_seq_max)
    if strategy == "mmap":
        if budget is not None:
            budgets.check(model, budget - draft, n_ctx, n_batch)
        return None
    if plan_dir:
        return plans.read(plan_dir)
    if strategy in ("prefetch", "sync"):
        policy, window = "none", 0 if strategy == "sync" else (3 if window is None else window)
    elif budget is None:
        return None
    return plan_budget(model, budget if budget is not None else 4 * model.file_size + (1 << 30), policy,
                       profiler.measure(model, n_threads), n_ctx=n_ctx, n_batch=n_batch, window=window,
                       io_threads=io_threads, n_outputs=n_outputs, n_seq_max=n_seq_max, draft=draft)


@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("-p", "--prompt", help="prompt text")
@click.option("-f", "--file", "prompt_file", metavar="FILE", help="read the prompt from FILE")
@click.option("-n", "--n-predict", default=128, show_default=True, help="tokens to generate (-1: until end of text)")
@click.option("-c", "--ctx-size", default=2048, show_default=True, help="context size in tokens")
@click.option("-b", "--batch-size", default=512, show_default=True, help="prompt tokens per forward pass")
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
@click.option("--io-threads", default=4, show_default=True)
@click.option("-md", "--model-draft", "draft_spec", metavar="MODEL",
              help="a draft model kept resident: token-tree speculation (same vocabulary as the target)")
@click.option("--draft-max", type=int, default=None,
              help="node budget of a speculation tree [default: from the measured target pass and draft token]")
@click.option("--draft-p-split", default=0.3, show_default=True, help="a draft candidate this likely opens a branch")
@click.option("--spec", "spec_mode", type=click.Choice(["tree", "chain"]), default="tree", show_default=True,
              help="speculation shape: a token tree, or a linear chain")
@click.option("--no-pacer", is_flag=True, help="grow branches in turn, not by confidence (ablation)")
@click.option("--no-adaptive", is_flag=True, help="verify only at the node budget, not on low confidence (ablation)")
@click.option("--pipeline/--no-pipeline", default=False, show_default=True,
              help="draft on while the target verifies, under SCHED_IDLE (within noise on 2 cores: off by default)")
@click.option("--draft-always", is_flag=True,
              help="speculate even where the target alone is predicted faster at --mem [default: run it alone]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text and timings")
@click.option("-v", "--verbose", is_flag=True, help="show llama.cpp's log")
@click.option("--result-file", hidden=True, help="(internal) write the result here instead of reporting it")
@_errors_as_one_line
def run(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, threads, temp, seed, mem, enforce,
        strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max, draft_p_split, spec_mode, no_pacer,
        no_adaptive, pipeline, draft_always, as_json, verbose, result_file):
    """Generate text from a prompt (with -md: speculation by a resident draft model)."""
    from . import engine
    from . import plan as plans
    from .model import load

    prompt_text = _read_prompt(prompt, prompt_file)
    strategy = strategy or ("stream" if mem or plan_dir else "mmap")
    if strategy not in engine.STRATEGIES:
        raise FlexoffloadError(f"unknown strategy {strategy!r}: one of {', '.join(engine.STRATEGIES)}")
    if ctx_size < 16 or batch_size < 1 or threads < 1 or io_threads < 1 or (window is not None and window < 0):
        raise FlexoffloadError("-c must be at least 16, -b, -t and --io-threads at least 1, --window at least 0")
    path = catalog.resolve(model_spec)
    model = load(path)
    limit = budgets.parse_size(mem, model.file_size) if mem else None
    if enforce and limit is None:
        raise FlexoffloadError("--enforce needs a budget: add --mem SIZE")
    draft_model, draft_bytes, spec, n_outputs, n_seq_max = None, 0, None, 1, 1
    if draft_spec:
        from . import speculate

        if draft_max is not None and not 2 <= draft_max <= speculate.MAX_NODES:
            raise FlexoffloadError(f"--draft-max must be between 2 and {speculate.MAX_NODES}")
        if not 0 < draft_p_split <= 1:
            raise FlexoffloadError("--draft-p-split must be in (0, 1]")
        draft_model = load(catalog.resolve(draft_spec))
        draft_bytes = budgets.resident_bytes(draft_model, ctx_size, batch_size, speculate.MAX_BRANCHES,
                                             speculate.MAX_BRANCHES, speculate.draft_by_rows(draft_model))
        spec = speculate.Options(tree=spec_mode == "tree", pacer=not no_pacer, adaptive=not no_adaptive,
                                 pipeline=pipeline, threshold=draft_p_split, max_nodes=draft_max)
        # a logits row per tree node (the node budget is memory), and llama.cpp keeps one per sequence
        n_outputs = max(draft_max or speculate.MAX_NODES, speculate.MAX_BRANCHES + 1)
        n_seq_max = speculate.MAX_BRANCHES + 1  # speculate.target_settings
    plan = plan_for_run(model, strategy, policy, plan_dir, limit, ctx_size, batch_size, threads, window, io_threads,
                        n_outputs, n_seq_max, draft_bytes)
    if spec and plan and limit is not None and not plan_dir and not draft_always:
        # the draft's memory makes the target stream more: speculate only where that is predicted to pay
        from . import profile as profiler
        from .costmodel import compute_seconds

        alone = plan_for_run(model, strategy, policy, None, limit, ctx_size, batch_size, threads, window, io_threads)
        draft_token_s = compute_seconds(draft_model, profiler.measure(draft_model, threads))
        target_token_s = compute_seconds(model, profiler.measure(model, threads))
        with_draft = speculate.predicted_tok_s(1 / plan.predicted_tok_s, draft_token_s, target_token_s)
        if alone.predicted_tok_s > with_draft:
            if result_file is None:
                click.echo(f"flexoffload: the target alone is predicted faster at this budget "
                           f"({alone.predicted_tok_s:.2f} tok/s, with the draft {with_draft:.2f}): running without "
                           f"-md (--draft-always speculates anyway)", err=True)
            draft_model, draft_bytes, spec, n_outputs, n_seq_max, plan = None, 0, None, 1, 1, alone

    if enforce and result_file is None:
        cgroup = budgets.enforce_or_warn(limit, lambda msg: click.echo(msg, err=True))
        if cgroup is not None:
            args = ["-m", str(path), "-p", prompt_text, "-n", str(n_predict), "-c", str(ctx_size),
                    "-b", str(batch_size), "-t", str(threads), "--temp", str(temp), "--seed", str(seed),
                    "--mem", mem, "--strategy", strategy, "--policy", policy, "--io-threads", str(io_threads)]
            args += ["--plan", plan_dir] if plan_dir else []
            args += ["--window", str(window)] if window is not None else []
            args += ["--json"] if as_json else []
            args += ["--verbose"] if verbose else []
            if draft_model:
                args += ["-md", str(draft_model.path), "--draft-p-split", str(draft_p_split), "--spec", spec_mode]
                args += ["--draft-max", str(draft_max)] if draft_max is not None else []
                args += [flag for flag, on in (("--no-pacer", no_pacer), ("--no-adaptive", no_adaptive),
                                               ("--pipeline", pipeline)) if on]
                args += ["--draft-always"]  # decided above: speculation pays here, or was asked for
            with cgroup:
                result = run_in_cgroup(cgroup, args)
            result["budget_mb"] = limit / MiB
            _report(result, as_json)
            return

    names = [t.name for t in model.tensors]
    settings = engine.Settings(
        n_ctx=ctx_size, n_batch=batch_size, n_threads=threads, temp=temp, seed=seed & 0xFFFFFFFF, strategy=strategy,
        streamed_patterns=tuple(plans.override_patterns(list(plan.streamed), names)) if plan else (),
        window=(window if window is not None else plan.window) if plan else 0,
        io_threads=plan.io_threads if plan else io_threads, verbose=verbose)
    on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    if spec:
        result = speculate.run(path, settings, draft_model.path, spec, prompt_text, n_predict, on_text).to_dict()
        result["draft"] = {"path": str(draft_model.path), "resident_mb": draft_bytes / MiB}
    else:
        with engine.Engine(path, settings) as eng:
            result = eng.generate(prompt_text, n_predict, on_text).to_dict()
    result.update(peak_mem_mb=budgets.peak_rss() / MiB, peak_source="rss", enforced=False,
                  budget_mb=limit / MiB if limit else None,
                  model={"path": str(path), "size": model.file_size, "name": model.name})
    if plan:
        result["plan"] = {"policy": plan.policy, "window": settings.window, "io_threads": settings.io_threads,
                          "memory_mb": plan.memory.total / MiB, "resident_mb": plan.memory.resident / MiB,
                          "streamed_mb": plans.streamed_bytes(plan, model) / MiB,
                          "predicted_tok_s": plan.predicted_tok_s, "roofline_tok_s": plan.roofline_tok_s}
    if result_file:
        Path(result_file).write_text(json.dumps(result))
        return
    _report(result, as_json)


def run_in_cgroup(cgroup, run_args: list[str], quiet: bool = False) -> dict:
    """`flexoffload run` in a child process inside the cgroup; its result with the cgroup's peak."""
    with tempfile.TemporaryDirectory(prefix="flexoffload-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "flexoffload", "run", *run_args, "--result-file", str(result_file)]
        out = subprocess.DEVNULL if quiet else None
        proc = cgroup.popen(cmd, stdout=out, stderr=subprocess.PIPE if quiet else None, text=True)
        unreclaimable = 0
        while True:  # the peak of what the run cannot give back, sampled (the kernel keeps no peak of it)
            unreclaimable = max(unreclaimable, cgroup.unreclaimable())
            try:
                _, err = proc.communicate(timeout=0.02)
                break
            except subprocess.TimeoutExpired:
                pass
        if proc.returncode != 0 or not result_file.exists():
            if cgroup.oom_killed() or proc.returncode == -9:
                raise FlexoffloadError(
                    f"out of memory: the kernel stopped the run at the enforced budget of {format_size(cgroup.limit)}")
            last = (err or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            raise FlexoffloadError(f"the run failed under the cgroup: {last[0].removeprefix('Error: ')}")
        result = json.loads(result_file.read_text())
    result.update(peak_mem_mb=cgroup.peak() / MiB, peak_source="cgroup", enforced=True, faults=cgroup.faults(),
                  peak_rss_mb=result["peak_mem_mb"], peak_unreclaimable_mb=unreclaimable / MiB)
    return result


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
    from . import bench as benchmark

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
@click.option("--json", "as_json", is_flag=True)
@_errors_as_one_line
def profile(model_spec, threads, remeasure, as_json):
    """Measure disk bandwidth and compute speed for the cost model (cached per model file)."""
    from . import profile as profiler
    from .costmodel import compute_seconds
    from .model import load

    model = load(catalog.resolve(model_spec))
    p = profiler.measure(model, threads, remeasure=remeasure)
    tok_s = 1.0 / compute_seconds(model, p)
    if as_json:
        click.echo(json.dumps({**p.to_dict(), "compute_tok_s": tok_s}))
        return
    click.echo(f"{model.path.name}: disk {p.disk_bw / 1e9:.2f} GB/s with O_DIRECT, {p.io_latency * 1e6:.0f} us "
               f"a small read; decode {tok_s:.2f} tok/s with every weight in memory ({threads} threads)")


@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("--mem", required=True, help="memory budget for the whole process: 400M, 1.5G or 0.4x")
@click.option("--policy", default="balanced", show_default=True,
              help="balanced, flexinfer, attn-first, ffn-first or layer")
@click.option("-c", "--ctx-size", default=2048, show_default=True)
@click.option("-b", "--batch-size", default=512, show_default=True)
@click.option("-t", "--threads", default=os.cpu_count() or 1, show_default=True)
@click.option("--window", type=int, default=None, help="prefetch window in layers [default: the fastest predicted]")
@click.option("--io-threads", default=4, show_default=True)
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="directory for tensors.ot and plan.json")
@click.option("--json", "as_json", is_flag=True)
@_errors_as_one_line
def plan(model_spec, mem, policy, ctx_size, batch_size, threads, window, io_threads, out_dir, as_json):
    """Choose which tensors stay resident under a budget; write tensors.ot and plan.json."""
    from . import plan as plans
    from . import profile as profiler
    from .model import load
    from .planners import plan_budget

    model = load(catalog.resolve(model_spec))
    p = plan_budget(model, budgets.parse_size(mem, model.file_size), policy, profiler.measure(model, threads),
                    n_ctx=ctx_size, n_batch=batch_size, window=window, io_threads=io_threads)
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


# --- info -------------------------------------------------------------------------------------

@main.command()
@click.option("-m", "--model", "model_spec", metavar="MODEL", help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("--json", "as_json", is_flag=True, help="print the table as JSON")
@_errors_as_one_line
def info(model_spec, as_json):
    """The tensor table, grouped by layer and kind, with types, sizes and file offsets."""
    from .model import KINDS, load

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


from . import synth  # beside its command, whose choices are its shapes; cheap to import (no numpy until it writes)


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

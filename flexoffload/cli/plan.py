"""`flexoffload plan`: which tensors stay resident under a budget (tensors.ot and plan.json); with --tune the best
candidates measured, with --rpc a placement across devices, with --precision auto lower types chosen too, with
--max-prompt or --prompt-len the longest prompt a budget holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from flexoffload import FlexoffloadError
from flexoffload import options
from flexoffload.cli.common import _errors_as_one_line, _read_prompt, click_options
from flexoffload.measure import tuning
from flexoffload.plan import plans
from flexoffload.gguf import catalog
from flexoffload.memory import budgets
from flexoffload.memory.budgets import MiB, format_size


def _plan_prompt(model, mem, max_prompt, prompt_len, n_predict, flash_attn, cache_types, as_json):
    """`plan --max-prompt` and `plan --prompt-len L`: long prompts under a budget (memory/stepmem.py, as measured
by measure/dryrun.py)."""
    from flexoffload.measure import dryrun as measured
    from flexoffload.memory import stepmem

    budget = budgets.parse_size(mem, model.file_size)
    if max_prompt:
        if cache_types != ("f16", "f16") and flash_attn != "on":
            raise FlexoffloadError("a quantized KV cache needs flash attention (-fa on)")
        found = measured.max_prompt(model, budget, n_predict, flash_attn, *cache_types)
        if as_json:
            click.echo(json.dumps({"budget": budget, "longest": None if found is None else found.__dict__}))
            return
        if found is None:
            least = measured.minimum(model, stepmem.Setting(stepmem.CELLS, min(stepmem.UBATCHES), flash_attn,
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
        costs = measured.run_costs(model, setting, budget)
        rows.append({"n_ubatch": setting.n_ubatch, "passes": -(-prompt_len // setting.n_ubatch),
                     "minimum": measured.minimum(model, setting, costs), "kv_cache": costs["kv_cache"],
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


def _describe_placement(model, p, out_dir) -> None:
    """`plan --rpc`: weights placed across the servers' devices, the host's share planned under its budget."""
    at = p.placement
    cost = at.cost
    click.echo(f"{model.path.name}: {at.policy} placement, written to {out_dir} (llama.cpp: "
               f"{' '.join(at.llama_args())} -ot tensors.ot)")
    click.echo(f"  this machine: resident {p.memory.resident / MiB:.0f} MiB, streamed "
               f"{plans.streamed_bytes(p, model) / MiB:.0f} MiB a token, {p.memory.total / MiB:.0f} of "
               f"{p.budget / MiB:.0f} MiB; compute {cost.host_compute_s * 1e3:.1f} ms a token")
    for d in at.per_device:
        click.echo(f"  {d.name}: {d.memory / MiB:.0f} of {d.budget / MiB:.0f} MiB; compute "
                   f"{d.compute_s * 1e3:.1f} ms a token")
    click.echo(f"  {cost.visits} visit(s) to the devices a token, {cost.transfer_bytes / 1024:.0f} KiB over the "
               f"links, {cost.transfer_s * 1e3:.1f} ms; predicted {p.predicted_tok_s:.2f} tok/s")


def _plan_precision(model, budget, profile, ctx_size, batch_size, threads, io_threads, max_kld, min_tok_s, original,
                    out_dir, as_json):
    """plan --precision auto: precision and residency together (measure/precision.py), the requantized file's quality
    measured."""
    from tqdm import tqdm

    from flexoffload.measure import precision

    bar = tqdm(desc="precision", unit="group", file=sys.stderr, disable=None)

    def on_row(row, done, total):
        bar.total, bar.n = total, done
        bar.set_postfix_str(f"{row.group} {row.type}")

    p, walk = precision.plan(model, budget, profile, ctx_size, batch_size, max_kld, min_tok_s, threads, io_threads,
                         original=Path(original) if original else None, on_row=on_row)
    bar.close()
    plans.write(p, out_dir)
    if as_json:
        click.echo(json.dumps({**p.to_dict(), "walk": [
            {"steps": len(x.steps), "kld": x.kld, "weight_bytes": x.weight_bytes,
             "predicted_tok_s": x.predicted_tok_s} for x in walk.points]}))
        return
    r = p.precision
    click.echo(f"{model.path.name}: {len(r.types)} tensors lowered ({len(r.steps)} steps), weights "
               f"{format_size(r.source_weight_bytes)} -> {format_size(r.weight_bytes)}, written to {p.model}"
               + (f" (quantized from {Path(original).name})" if original else ""))
    click.echo(f"  predicted {p.predicted_tok_s:.2f} tok/s at {format_size(budget)} (the file's own types: "
               f"{r.own_types_tok_s:.2f}); KL divergence summed over the groups {r.predicted_kld:.4f}")
    if r.measured is not None:
        q = r.measured
        click.echo(f"  measured: KL divergence {q['kld']:.4f} (calibration), {q['held_out_kld']:.4f} (held out); "
                   f"held-out perplexity {q['held_out_ppl']:.3f} vs {q['held_out_ppl_base']:.3f}; UQEst "
                   f"{q['uqest']:.3f} vs {q['uqest_base']:.3f}")
    click.echo(f"  plan written to {out_dir}: run it with flexoffload run --plan {out_dir}")


@click.command()
@click_options("plan")
@_errors_as_one_line
def plan(out_dir, tune_best, tune_rounds, max_prompt, prompt_len, as_json, prompt_file, **params):
    """Choose which tensors stay resident under a budget; write tensors.ot and plan.json: what `run` with the same
    flags would run (run --plan DIR then runs it)."""
    from flexoffload import api
    from flexoffload.gguf.model import load
    from flexoffload.measure import profiler

    fields = options.request_fields(params)
    text = fields.pop("prompt")  # -p or -f: planned for that prompt (its ubatch); neither: one token's
    r = options.Request(prompt=_read_prompt(text, prompt_file) if text is not None or prompt_file else " ", **fields)
    model = load(catalog.resolve(r.model))
    if max_prompt or prompt_len is not None:
        attention = "on" if r.flash_attn == "auto" else r.flash_attn
        _plan_prompt(model, r.mem, max_prompt, prompt_len, r.n_predict, attention,
                     (r.cache_type_k, r.cache_type_v), as_json)
        return
    if out_dir is None:
        raise FlexoffloadError("plan writes its files to -o DIR")
    api.check(r)
    # what can be refused is refused before anything is measured
    if r.precision and (r.rpc or tune_best is not None or r.policy != "balanced" or r.window is not None):
        raise FlexoffloadError("--precision auto plans with the balanced policy: not with --rpc, --tune, "
                               "--policy or --window, for now")
    if r.precision and r.original:
        from flexoffload.measure import requantize

        requantize.check_original(model, Path(r.original))
    if tune_best is not None and (tune_best < 1 or tune_rounds < 1 or r.policy != "balanced" or r.window is not None):
        raise FlexoffloadError("--tune takes N >= 1 and --tune-rounds >= 1; it chooses the policy and window")
    if r.precision:
        budget = budgets.parse_size(r.mem, model.file_size)
        _plan_precision(model, budget, profiler.measure(model, r.n_threads), r.n_ctx, r.n_batch, r.n_threads,
                        r.io_threads, r.max_kld, r.min_tok_s, r.original, out_dir, as_json)
        return
    if tune_best is not None:
        from flexoffload.measure import probe
        from flexoffload.plan.planners import check_budget

        budget = budgets.parse_size(r.mem, model.file_size)
        check_budget(model, budget, probe.measure(model, r.n_ctx, r.n_batch), r.window)
        p = api.tune(model, budget, profiler.measure(model, r.n_threads), r.n_ctx, r.n_batch, tune_best,
                     tune_rounds)
        plans.write(p, out_dir)
    else:  # the one planning path: what run with these flags would run
        prepared = api.prepare(r)
        api.tell(prepared.notes)
        prepared.write(out_dir)
        p = prepared.plan or prepared.mmap_plan
    if as_json:
        click.echo(json.dumps(p.to_dict()))
        return
    if p.placement is not None:
        _describe_placement(model, p, out_dir)
        return
    if p.policy == tuning.MMAP:
        click.echo(f"{model.path.name}: at {format_size(p.budget)} run runs upstream mmap (the page cache holds what "
                   f"a token reads), written to {out_dir} (--strategy stream plans streaming)")
        return
    m = p.memory
    streamed = plans.streamed_bytes(p, model)
    click.echo(f"{model.path.name}: {p.policy} plan for {format_size(p.budget)}, written to {out_dir}")
    click.echo(f"  resident {m.resident / MiB:.0f} MiB ({len(p.resident)} tensors); streamed {streamed / MiB:.0f} MiB "
               f"per token ({len(p.streamed)} tensors) through a window of {p.window} ({m.window / MiB:.0f} MiB)")
    click.echo(f"  KV cache {m.kv_cache / MiB:.0f} MiB, compute buffers {m.compute / MiB:.0f} MiB, "
               f"runtime {m.overhead / MiB:.0f} MiB: {m.total / MiB:.0f} of {p.budget / MiB:.0f} MiB")
    x = p.experts
    if x is not None and x.whole:
        click.echo(f"  experts: streamed whole by the window ({x.bytes_per_token / MiB:.0f} MiB a token): "
                   f"predicted faster than reading the routed ones")
    elif x is not None:
        out = {"lru": "least recently used out", "lfu": "least frequently used out"}.get(x.policy, x.policy)
        click.echo(f"  experts: {x.slots} of {model.n_expert} cached a layer, {out} ({m.experts / MiB:.0f} MiB with a "
                   f"batch's{' and the next layer read ahead' if x.ahead else ''}), predicted hit rate "
                   f"{x.hit_rate:.0%}, {x.bytes_per_token / MiB:.1f} MiB read a token"
                   f"{', the next layer predicted and read ahead' if x.lookahead else ''}")
    click.echo(f"  predicted {p.predicted_tok_s:.2f} tok/s; roofline {p.roofline_tok_s:.2f} tok/s")
    if p.tuning:
        click.echo("  tuned: the candidates, measured under the budget\n" + tuning.describe(p))

"""`flexoffload plan`: which tensors stay resident under a budget (tensors.ot and plan.json); with --tune the best
candidates measured, with --rpc a placement across devices, with --precision auto lower types chosen too, with
--max-prompt or --prompt-len the longest prompt a budget holds."""

from __future__ import annotations

import json
from pathlib import Path

import click

from flexoffload import FlexoffloadError
from flexoffload import options
from flexoffload.cli.common import _errors_as_one_line, _read_prompt, click_options
from flexoffload.plan import candidates
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


def _written(out_dir) -> str:
    """Where the plan was written: plan without -o prints it and writes nothing."""
    return f", written to {out_dir}" if out_dir is not None else " (not written: -o DIR writes it for run --plan)"


def _describe_placement(model, p, out_dir) -> None:
    """`plan --rpc`: weights placed across the servers' devices, the host's share planned under its budget."""
    at = p.placement
    cost = at.cost
    click.echo(f"{model.path.name}: {at.policy} placement{_written(out_dir)} (llama.cpp: "
               f"{' '.join(at.llama_args())} -ot tensors.ot)")
    click.echo(f"  this machine: resident {p.memory.resident / MiB:.0f} MiB, streamed "
               f"{plans.streamed_bytes(p, model) / MiB:.0f} MiB a token, {p.memory.total / MiB:.0f} of "
               f"{p.budget / MiB:.0f} MiB; compute {cost.host_compute_s * 1e3:.1f} ms a token")
    for d in at.per_device:
        click.echo(f"  {d.name}: {d.memory / MiB:.0f} of {d.budget / MiB:.0f} MiB; compute "
                   f"{d.compute_s * 1e3:.1f} ms a token")
    click.echo(f"  {cost.visits} visit(s) to the devices a token, {cost.transfer_bytes / 1024:.0f} KiB over the "
               f"links, {cost.transfer_s * 1e3:.1f} ms; predicted {p.predicted_tok_s:.2f} tok/s")


def _describe_precision(model, p, out_dir) -> None:
    """plan --precision auto: the lowered types chosen with the residency, and the requantized file's quality."""
    r = p.precision
    click.echo(f"{Path(r.source).name}: {len(r.types)} tensors lowered ({len(r.steps)} steps), weights "
               f"{format_size(r.source_weight_bytes)} -> {format_size(r.weight_bytes)}, written to {p.model}"
               + (f" (quantized from {Path(r.original).name})" if r.original else ""))
    click.echo(f"  predicted {p.predicted_tok_s:.2f} tok/s at {format_size(p.budget)} (the file's own types: "
               f"{r.own_types_tok_s:.2f}); KL divergence summed over the groups {r.predicted_kld:.4f}")
    if r.measured is not None:
        q = r.measured
        click.echo(f"  measured: KL divergence {q['kld']:.4f} (calibration), {q['held_out_kld']:.4f} (held out); "
                   f"held-out perplexity {q['held_out_ppl']:.3f} vs {q['held_out_ppl_base']:.3f}; UQEst "
                   f"{q['uqest']:.3f} vs {q['uqest_base']:.3f}")
    if out_dir is not None:
        click.echo(f"  plan written to {out_dir}: run it with flexoffload run --plan {out_dir}")


def _prompt_of(model, n: int) -> str:
    """A text of n tokens for the model's tokenizer (counted as a run counts a prompt): `--prompt-len L -o` plans
    for a prompt of that length."""
    from flexoffload.runtime.engine import count_tokens

    units = n
    for _ in range(8):
        got = count_tokens(str(model.path), " a" * units)
        if got == n:
            return " a" * units
        units = max(1, units + n - got)
    raise FlexoffloadError(f"--prompt-len {n}: no text of {n} tokens found for {model.path.name}'s tokenizer")


@click.command()
@click_options("plan")
@_errors_as_one_line
def plan(out_dir, max_prompt, prompt_len, as_json, prompt_file, **params):
    """Choose which tensors stay resident under a budget; write tensors.ot and plan.json, and run.json beside them:
    what `run` with the same flags would run (run --plan DIR then runs it)."""
    from dataclasses import replace

    from flexoffload import api
    from flexoffload.api import precision
    from flexoffload.gguf.model import load

    fields = options.request_fields(params)
    text = fields.pop("prompt")  # -p or -f: planned for that prompt (its ubatch); neither: one token's
    r = options.Request(prompt=_read_prompt(text, prompt_file) if text is not None or prompt_file else " ", **fields)
    api.check(r)  # what can be refused is refused before anything is measured (a quantized V cache with -fa off, ...)
    model = load(catalog.resolve(r.model))
    if max_prompt or prompt_len is not None:
        attention = "on" if r.flash_attn == "auto" else r.flash_attn
        _plan_prompt(model, r.mem, max_prompt, prompt_len, r.n_predict, attention,
                     (r.cache_type_k, r.cache_type_v), as_json)
        if max_prompt or out_dir is None:
            return
        # and with -o, the plan a prompt of that length runs by (its ubatch), in a context that holds it
        from flexoffload.memory import stepmem

        r = replace(r, prompt=_prompt_of(model, prompt_len),
                    n_ctx=max(r.n_ctx, stepmem.cells_for(prompt_len + max(r.n_predict, 1))))
        as_json = False  # the table was the output
    if r.precision and r.original:
        from flexoffload.measure import requantize

        requantize.check_original(model, Path(r.original))
    prepared = api.prepare(r)  # the one planning path: what run with these flags would run
    api.tell(prepared.notes)
    if prepared.plan is not None and prepared.plan.precision is not None:  # its quality, measured once written
        prepared = replace(prepared, plan=precision.with_quality(prepared.plan, r.n_threads))
    if out_dir is not None:
        prepared.write(out_dir)
    p = prepared.plan or prepared.mmap_plan
    if as_json:
        extra = {"walk": list(p.precision.walk)} if p.precision is not None else {}
        click.echo(json.dumps({**p.to_dict(), **extra}))
        return
    if p.precision is not None:
        _describe_precision(model, p, out_dir)
        return
    if p.placement is not None:
        _describe_placement(model, p, out_dir)
        return
    if p.policy == candidates.MMAP:
        click.echo(f"{model.path.name}: at {format_size(p.budget)} run runs upstream mmap (the page cache holds what "
                   f"a token reads){_written(out_dir)} (--strategy stream plans streaming)")
        return
    m = p.memory
    streamed = plans.streamed_bytes(p, model)
    click.echo(f"{model.path.name}: {p.policy} plan for {format_size(p.budget)}{_written(out_dir)}")
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
        click.echo("  tuned: the candidates, measured under the budget\n" + candidates.describe(p))

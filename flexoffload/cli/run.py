"""`flexoffload run`: text from a prompt, streamed under a budget, speculated with a resident draft model."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import click

from flexoffload.cli.common import PLACEMENTS, _errors_as_one_line, _precision_options, _read_prompt, _report
from flexoffload.gguf import catalog
from flexoffload.plan.expertcache import READS as EXPERT_READS
from flexoffload.runtime.chat import HELP as chat_help
from flexoffload.runtime.engine import KV_TYPES


def request_from_flags(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, threads, temp, seed, mem,
                       strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max, draft_p_split,
                       spec_mode, no_pacer, no_adaptive, no_adaptive_split, pipeline, draft_always, tuned, verbose,
                       rpc=None, n_gpu_layers=0, placement="auto", n_ubatch=0, flash_attn="auto",
                       cache_type_k="f16", cache_type_v="f16", precision=None, max_kld=None, min_tok_s=None,
                       original=None, expert_slots=None, spec_type="auto", expert_reads="auto", tiled_verify=False,
                       sparsity=None):
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
        max_kld=max_kld, min_tok_s=min_tok_s, original=original, expert_slots=expert_slots, spec_type=spec_type,
        expert_reads=expert_reads, tiled_verify=tiled_verify, sparsity=sparsity)


def request_from_args(args: list[str]):
    """api.Request from `flexoffload run` arguments, as the command line would read them (for scripts)."""
    ctx = run.make_context("run", list(args))
    params = dict(ctx.params)
    params.pop("enforce")
    params.pop("as_json")
    params.pop("system_prompt")
    chat = params.pop("conversation")
    return replace(request_from_flags(**params), chat=chat)


@click.command()
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
@click.option("--expert-slots", type=click.IntRange(min=0), default=None,
              help="a mixture of experts: experts each layer keeps cached [default: the plan's]")
@click.option("--expert-reads", type=click.Choice(list(EXPERT_READS)), default="auto", show_default=True,
              help="a mixture of experts: read the routed experts once the router has chosen, or the expert tensors "
                   "whole ahead of compute (faster where a token uses a large share of them); auto: the plan's")
@click.option("-md", "--model-draft", "draft_spec", metavar="MODEL",
              help="a draft model kept resident: token-tree speculation (same vocabulary as the target)")
@click.option("--draft-max", type=int, default=None,
              help="node budget of a speculation tree [default: from the measured target pass and draft token]")
@click.option("--draft-p-split", default=0.3, show_default=True, help="a draft candidate this likely opens a branch")
@click.option("--spec", "spec_mode", type=click.Choice(["tree", "chain"]), default="tree", show_default=True,
              help="speculation shape: a token tree, or a linear chain")
@click.option("--spec-type", "spec_type", default="auto", show_default=True, metavar="LIST",
              help="free drafters for a speculation tree, a comma list: ngram-simple, ngram-map-k, recycle (no "
                   "memory but a table), model (-md, in the tree whenever given); none; auto: with -md "
                   "model,ngram-simple, without it ngram-simple,recycle where the plan streams and its pass is "
                   "disk-bound (docs/speculation.md)")
@click.option("--no-pacer", is_flag=True, help="grow branches in turn, not by confidence (ablation)")
@click.option("--no-adaptive", is_flag=True, help="verify only at the node budget, not on low confidence (ablation)")
@click.option("--no-adaptive-split", is_flag=True,
              help="keep --draft-p-split as given, not moved by which branches the target accepts (ablation)")
@click.option("--tiled-verify", is_flag=True,
              help="verify with the tiled kernels from 8 tree nodes, as llama.cpp does: cheaper nodes, but greedy "
                   "output may differ from the target alone's at near ties (ablation)")
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
@click.option("--sparsity", default=None, metavar="auto|K",
              help="predicted neurons: each FFN's hot neurons and the K of its groups a predictor picks (auto: the "
                   "fewest within --max-kld, where that is predicted faster than the dense model); profile "
                   "--neurons measures them [default: dense]")
@click.option("-cnv", "--conversation", is_flag=True,
              help="chat at the terminal in the model's chat template, the history kept (-p, -f or -sys: the "
                   "system message; -n: each reply's limit, to the end of its turn by default)")
@click.option("-sys", "--system-prompt", "system_prompt", metavar="TEXT", help="with -cnv: the system message")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of text and timings")
@click.option("-v", "--verbose", is_flag=True, help="show llama.cpp's log")
@_errors_as_one_line
def run(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, n_ubatch, flash_attn, cache_type_k,
        cache_type_v, threads, temp, seed,
        mem, enforce, strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max, draft_p_split, spec_mode,
        no_pacer, no_adaptive, no_adaptive_split, pipeline, draft_always, tuned, rpc, n_gpu_layers, placement,
        precision, max_kld, min_tok_s, original, expert_slots, expert_reads, conversation, system_prompt, as_json,
        verbose, spec_type, tiled_verify, sparsity):
    """Generate text from a prompt (with -md: speculation by a resident draft model; -cnv: a conversation)."""
    from flexoffload import FlexoffloadError, api

    if system_prompt is not None and not conversation:
        raise FlexoffloadError("-sys is the system message of a conversation: add -cnv")
    if conversation:  # llama-cli's: -p is the system message, and a reply runs to the end of its turn
        if system_prompt is not None and (prompt is not None or prompt_file is not None):
            raise FlexoffloadError("give the system message with -sys, -p or -f, not two of them")
        if system_prompt is None and (prompt is not None or prompt_file is not None):
            system_prompt = _read_prompt(prompt, prompt_file)
        prompt, prompt_file = (system_prompt or " "), None
        if click.get_current_context().get_parameter_source("n_predict").name == "DEFAULT":
            n_predict = -1
    request = request_from_flags(model_spec, prompt, prompt_file, n_predict, ctx_size, batch_size, threads, temp,
                                 seed, mem, strategy, policy, plan_dir, window, io_threads, draft_spec, draft_max,
                                 draft_p_split, spec_mode, no_pacer, no_adaptive, no_adaptive_split, pipeline,
                                 draft_always, tuned, verbose, rpc, n_gpu_layers, placement, n_ubatch, flash_attn,
                                 cache_type_k, cache_type_v, precision, max_kld, min_tok_s, original,
                                 expert_slots=expert_slots, spec_type=spec_type, expert_reads=expert_reads,
                                 tiled_verify=tiled_verify, sparsity=sparsity)
    request = replace(request, chat=conversation)
    if conversation and not as_json and sys.stdin.isatty():
        click.echo(f"flexoffload: a conversation ({chat_help})", err=True)
    on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = api.generate(request, on_text=on_text, enforce=enforce, echo=lambda msg: click.echo(msg, err=True))
    _report(result, as_json)

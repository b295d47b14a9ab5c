"""`flexoffload serve`: an OpenAI-compatible server under a memory budget, planned for N sequences decoded together."""

from __future__ import annotations

import os

import click

from flexoffload.cli.common import PLACEMENTS, _errors_as_one_line
from flexoffload.gguf import catalog


@click.command(context_settings={"show_default": True})
@click.option("-m", "--model", "model_spec", metavar="MODEL", show_default=False,
              help=f"GGUF path or catalog name [default: {catalog.DEFAULT_MODEL}]")
@click.option("--mem", help="memory budget for the whole server: 400M, 1.5G, or 0.4x of the model's size (per device "
                            "with --rpc: cpu=SIZE,rpc0=SIZE,...)")
@click.option("--enforce", is_flag=True, help="hold the server to --mem with a memory cgroup")
@click.option("-np", "--parallel", "n_parallel", default=4, help="sequences decoded together (requests beyond wait)")
@click.option("-c", "--ctx-size", default=4096, help="context cells, shared by the sequences: each has -c / -np")
@click.option("-b", "--batch-size", default=512, help="prompt tokens per llama_decode call")
@click.option("-t", "--threads", default=os.cpu_count() or 1, show_default=True)
@click.option("--host", default="127.0.0.1", help="address(es) to listen on, comma-separated")
@click.option("--port", default=8080, help="port to listen on (0: any free one)")
@click.option("--api-key", envvar="FLEXOFFLOAD_API_KEY", show_envvar=True, default=None,
              help="every endpoint but /health needs `Authorization: Bearer KEY`")
@click.option("--queue", default=32, help="requests that may wait for a sequence; beyond, 503")
@click.option("--strategy", default=None,
              help="stream (the default with --mem or --plan), mmap (upstream; the default otherwise), prefetch, sync")
@click.option("--policy", default="balanced", help="what stays resident under --mem (as run's)")
@click.option("--plan", "plan_dir", type=click.Path(file_okay=False), help="stream by a saved plan (flexoffload plan)")
@click.option("--window", type=int, default=None, help="prefetch window in layers [default: the plan's]")
@click.option("--io-threads", type=int, default=None, help="threads reading streamed weights [default: the plan's]")
@click.option("--rpc", "rpc", metavar="HOST:PORT,...", help="RPC servers to place weights on (as run's)")
@click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", default=0, help="with --rpc: the last layers offloaded")
@click.option("--placement", type=click.Choice(PLACEMENTS), default="auto", help="with --rpc and --mem: how weights "
                                                                                  "are placed across the devices")
@click.option("-v", "--verbose", is_flag=True, help="show llama-server's log")
@click.argument("llama_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- LLAMA_SERVER_FLAGS...]")
@_errors_as_one_line
def serve(model_spec, mem, enforce, n_parallel, ctx_size, batch_size, threads, host, port, api_key, queue, strategy,
          policy, plan_dir, window, io_threads, rpc, n_gpu_layers, placement, verbose, llama_args):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics) under a budget.

    Plans for -np sequences decoded together: each decode pass reads the streamed weights once for every active
    request. Runs until Ctrl-C or SIGTERM. Flags after `--` go to llama-server as they are (--jinja,
    --chat-template NAME, --alias, ...)."""
    from flexoffload import FlexoffloadError, api
    from flexoffload.memory.budgets import format_size
    from flexoffload.runtime import server

    if n_parallel < 1 or queue < 0:
        raise FlexoffloadError("-np must be at least 1 and --queue at least 0")
    if not 0 <= port <= 65535:
        raise FlexoffloadError(f"--port must be between 0 and 65535, not {port}")
    request = api.Request(model=model_spec, prompt=" ", n_ctx=ctx_size, n_batch=batch_size, n_threads=threads,
                          mem=mem, strategy=strategy, policy=policy, plan_dir=plan_dir, window=window,
                          io_threads=io_threads, rpc=rpc, n_gpu_layers=n_gpu_layers, placement=placement,
                          verbose=verbose)
    hosts = tuple(h.strip() for h in host.split(",") if h.strip())
    listen = server.Listen(hosts=hosts, port=port, api_key=api_key or None, queue=queue)

    def ready(bound_port: int, load_s: float, prepared, enforced: bool) -> None:
        plan = prepared.plan
        how = prepared.request.strategy
        if plan is not None:
            how += f" (resident {format_size(plan.memory.resident)}, predicted {plan.predicted_tok_s:.2f} tok/s a pass)"
        budget = f", budget {format_size(prepared.limit)}" if prepared.limit else ""
        held = " enforced" if enforced else ""
        url_host = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]
        name = os.path.basename(prepared.request.model)
        click.echo(f"flexoffload: serving {name} on http://{url_host}:{bound_port}/v1 ({n_parallel} sequences of "
                   f"{ctx_size // n_parallel} tokens, {how}{budget}{held}; loaded in {load_s:.1f} s)", err=True)

    served = api.serve(request, n_parallel, listen, enforce, tuple(llama_args),
                       echo=lambda msg: click.echo(msg, err=True), on_ready=ready)
    click.echo(f"flexoffload: stopped after {served.requests} requests ({served.cancelled} cancelled, "
               f"{served.rejected} refused: queue full), peak {served.peak_mem_mb:.0f} MiB", err=True)

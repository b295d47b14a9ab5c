"""`flexoffload serve`: an OpenAI-compatible server under a memory budget, planned for N sequences decoded together."""

from __future__ import annotations


import click

from flexoffload import options
from flexoffload.cli.common import _errors_as_one_line, click_options


@click.command()
@click_options("serve")
@click.argument("llama_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- LLAMA_SERVER_FLAGS...]")
@_errors_as_one_line
def serve(enforce, n_parallel, host, port, api_key, queue, tiled, llama_args, **params):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics) under a budget.

    Plans for -np sequences decoded together: each decode pass reads the streamed weights once for every active
    request. Runs until Ctrl-C or SIGTERM. Flags after `--` go to llama-server as they are (--jinja,
    --chat-template NAME, --alias, ...)."""
    from flexoffload import FlexoffloadError, api
    from flexoffload.api.serving import speculation
    from flexoffload.memory.budgets import format_size
    from flexoffload.runtime import server

    if n_parallel < 1 or queue < 0:
        raise FlexoffloadError("-np must be at least 1 and --queue at least 0")
    if not 0 <= port <= 65535:
        raise FlexoffloadError(f"--port must be between 0 and 65535, not {port}")
    request = options.request_for("serve", prompt=" ", **options.request_fields(params))
    ctx_size = request.n_ctx
    hosts = tuple(h.strip() for h in host.split(",") if h.strip())
    listen = server.Listen(hosts=hosts, port=port, api_key=api_key or None, queue=queue)

    def ready(bound_port: int, load_s: float, prepared, enforced: bool, n_parallel: int) -> None:
        plan = prepared.plan
        how = prepared.strategy
        if plan is not None:
            how += f" (resident {format_size(plan.memory.resident)}, predicted {plan.predicted_tok_s:.2f} tok/s a pass)"
        budget = f", budget {format_size(prepared.limit)}" if prepared.limit else ""
        spec = speculation(prepared)
        how += f", {spec.describe()}" if spec else ", no speculation"
        held = " enforced" if enforced else ""
        url_host = f"[{hosts[0]}]" if ":" in hosts[0] else hosts[0]
        name = prepared.model.path.name
        click.echo(f"flexoffload: serving {name} on http://{url_host}:{bound_port}/v1 ({n_parallel} sequences of "
                   f"{ctx_size // n_parallel} tokens, {how}{budget}{held}; loaded in {load_s:.1f} s)", err=True)

    served = api.serve(request, n_parallel, listen, enforce, tuple(llama_args), on_ready=ready, tiled=tiled)
    click.echo(f"flexoffload: stopped after {served.requests} requests ({served.cancelled} cancelled, "
               f"{served.rejected} refused: queue full), peak {served.peak_mem_mb:.0f} MiB", err=True)

"""`flexoffload devices`: the backends a plan can place tensors on, this machine's and RPC servers'."""

from __future__ import annotations

import json

import click

from flexoffload.cli.common import _errors_as_one_line, click_options
from flexoffload.memory.budgets import format_size


@click.command()
@click_options("devices")
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

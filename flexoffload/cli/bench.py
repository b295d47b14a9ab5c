"""`flexoffload bench`: decode speed and peak memory per budget and strategy, each run in its own cgroup."""

from __future__ import annotations

import os

import click

from flexoffload.cli.common import _errors_as_one_line
from flexoffload.gguf import catalog


@click.command()
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

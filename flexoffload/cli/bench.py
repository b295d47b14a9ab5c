"""`flexoffload bench`: decode speed and peak memory per budget and strategy, each run in its own cgroup."""

from __future__ import annotations

import click

from flexoffload.cli.common import _errors_as_one_line, click_options


@click.command()
@click_options("bench")
@click.option("--mem", "mems", required=True, help="comma-separated budgets: 400M,0.5x,1.0x")
@click.option("--strategies", default="mmap", show_default=True, help="comma-separated strategies")
@click.option("-r", "--repetitions", default=3, show_default=True)
@click.option("-p", "--prompt", "text", default=None, help="prompt text [default: a fixed code prompt]")
@click.option("-o", "--output", "csv_path", type=click.Path(dir_okay=False), help="write the table as CSV")
@_errors_as_one_line
def bench(model, mems, strategies, repetitions, n_predict, text, n_ctx, n_threads, csv_path):
    """Measure decode speed and peak memory per budget and strategy, each run in its own cgroup."""
    from flexoffload.bench import sweep as benchmark

    rows = benchmark.run(
        model_spec=model, mems=[m.strip() for m in mems.split(",") if m.strip()],
        strategies=[s.strip() for s in strategies.split(",") if s.strip()], repetitions=repetitions,
        n_predict=n_predict, prompt=text, n_ctx=n_ctx, n_threads=n_threads)
    click.echo(benchmark.markdown(rows))
    if csv_path:
        benchmark.write_csv(rows, csv_path)
        click.echo(f"flexoffload: wrote {csv_path}", err=True)

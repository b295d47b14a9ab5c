"""`flexoffload bench`: decode speed and peak memory per budget and strategy, each run in its own cgroup."""

from __future__ import annotations

import click

from flexoffload.cli.common import _errors_as_one_line, click_options


@click.command()
@click_options("bench")
@_errors_as_one_line
def bench(model, mem, strategies, repetitions, n_predict, prompt, n_ctx, n_threads, output):
    """Measure decode speed and peak memory per budget and strategy, each run in its own cgroup."""
    from flexoffload.bench import sweep as benchmark

    rows = benchmark.run(
        model_spec=model, mems=[m.strip() for m in mem.split(",") if m.strip()],
        strategies=[s.strip() for s in strategies.split(",") if s.strip()], repetitions=repetitions,
        n_predict=n_predict, prompt=prompt, n_ctx=n_ctx, n_threads=n_threads)
    click.echo(benchmark.markdown(rows))
    if output:
        benchmark.write_csv(rows, output)
        click.echo(f"flexoffload: wrote {output}", err=True)

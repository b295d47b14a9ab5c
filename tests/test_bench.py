"""`flexoffload bench`: every run in its own cgroup, the table and the CSV."""

import csv

import pytest

from conftest import cli

# it streams or profiles the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")


def test_bench_two_strategies_on_the_tiny_model(tiny_model, tmp_path):
    out = tmp_path / "bench.csv"
    r = cli("bench", "-m", str(tiny_model), "--mem", "300M,400M", "--strategies", "mmap,balanced", "-r", "2", "-n", "4",
            "-c", "256", "-o", str(out), check=True)
    rows = list(csv.DictReader(open(out)))
    columns = ["model", "size_mb", "budget", "budget_mb", "strategy", "runs", "tok_s_mean", "tok_s_sd", "ttft_s_mean",
               "peak_mb", "enforced", "predicted_tok_s", "roofline_tok_s", "read_gb_s", "error"]
    assert list(rows[0]) == columns
    assert [(row["budget"], row["strategy"]) for row in rows] == [
        (b, s) for b in ("300M", "400M") for s in ("mmap", "balanced", "roofline")]
    for row in rows:
        if row["strategy"] == "roofline":
            assert row["runs"] == "0" and float(row["tok_s_mean"]) == float(row["roofline_tok_s"]) > 0
            continue
        assert row["runs"] == "2" and row["error"] == "" and row["enforced"] == "True"
        assert float(row["tok_s_mean"]) > 0 and 0 < float(row["peak_mb"]) <= float(row["budget_mb"])
    assert all(float(row["predicted_tok_s"]) > 0 for row in rows if row["strategy"] == "balanced")
    assert "| mmap |" in r.stdout and "| balanced |" in r.stdout  # the markdown table

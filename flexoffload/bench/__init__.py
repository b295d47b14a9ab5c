"""Benchmarks: sweeps over budgets and strategies, baselines, small machines for RPC."""

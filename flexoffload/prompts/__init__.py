"""Prompt sets for benchmarks and calibration: HumanEval and plain-language prompts."""

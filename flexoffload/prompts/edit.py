"""Editing prompts: ask to rewrite, annotate or fix a given function, so the answer repeats much of its input (where
speculation from the context pays most). Each is a HumanEval problem's code (its prompt and canonical solution)
under one of a few instructions, ending where the rewritten code starts. Tuning prompts come from HumanEval 0-39,
evaluation ones from 40-163 (humaneval.py's split)."""

from __future__ import annotations

from flexoffload.prompts import humaneval

INSTRUCTIONS = (
    "Add type hints and a docstring to this function:",
    "Rename the variables of this function to descriptive names, changing nothing else:",
    "Add a comment above each step of this function:",
    "Rewrite this function to follow PEP 8, keeping its behaviour:",
    "Add input validation to this function, raising ValueError on bad input:",
)
COUNT = 10  # prompts in each set


def text(number: int, instruction: str) -> str:
    """The editing prompt for HumanEval problem number under an instruction."""
    (task_id, prompt), = humaneval.prompts([number])
    code = prompt + humaneval._problems()[number][2]
    return f"{instruction}\n\n```python\n{code.strip()}\n```\n\nThe rewritten code:\n\n```python\n"


def prompts(which: str, count: int = COUNT) -> list[tuple[str, str]]:
    """(name, text) of count editing prompts of a set ("tuning": HumanEval 0-39, "evaluation": 40-163), problems
    evenly spread, the instructions in turn; named edit/N (N the problem)."""
    pool = humaneval.TUNING if which == "tuning" else humaneval.EVALUATION
    ids = humaneval.spread(pool, count)
    return [(f"edit/{n}", text(n, INSTRUCTIONS[i % len(INSTRUCTIONS)])) for i, n in enumerate(ids)]

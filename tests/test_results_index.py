"""scripts/checks/results_index.py: every file under results/ is named in docs/results.md. It passes on the repository
and fails, naming the file, where a results folder holds one the index does not name."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "checks" / "results_index.py"


def check(*args: str) -> subprocess.CompletedProcess:
    """The script's run with these arguments."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


INDEX = """# Results

- **[`serve.csv`](../results/serve.csv)** (`.md`, `.png`): a serve bench.
- **[`matrix.csv`](../results/matrix.csv)**: the matrix; also results/sub/deep.csv by its path.

Every run's text is in `llmcad_*.jsonl`.
"""

NAMED = ["serve.csv", "serve.md", "serve.png", "matrix.csv", "sub/deep.csv", "llmcad_a.jsonl", "llmcad_b.jsonl"]


def test_the_repository_index_names_every_file():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("results index: all ")


def test_each_way_of_naming_a_file_counts(tmp_path):
    write(tmp_path, {"docs/results.md": INDEX, **{f"results/{name}": "x" for name in NAMED}})
    r = check("--results", str(tmp_path / "results"), "--index", str(tmp_path / "docs/results.md"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"results index: all {len(NAMED)} files named"


def test_an_unnamed_file_fails_naming_it(tmp_path):
    unnamed = [
        "extra.csv",  # in no entry
        "matrix_large.csv",  # matrix.csv is named, not a longer name beginning with it
        "matrix.md",  # a sibling, but no bare `.md` in matrix.csv's bullet
        "serve.jsonl",  # serve's bullet names .md and .png, not .jsonl
        "llmcad_a.csv",  # the glob is *.jsonl
        "other/deep.csv",  # sub/deep.csv is named, not another folder's deep.csv
    ]
    write(tmp_path, {"docs/results.md": INDEX, **{f"results/{name}": "x" for name in NAMED + unnamed}})
    r = check("--results", str(tmp_path / "results"), "--index", str(tmp_path / "docs/results.md"))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == (f"results index: {len(unnamed)} of {len(NAMED) + len(unnamed)} files not named in "
                        f"{tmp_path / 'docs/results.md'}")
    assert lines[1:] == sorted(unnamed)


def test_the_repository_results_with_one_more_file_fail(tmp_path):
    """The repository's own index against a copy of results/ with an extra file: only that file is reported."""
    results = tmp_path / "results"
    for f in (REPO / "results").rglob("*"):
        if f.is_file():
            (results / f.relative_to(REPO / "results")).parent.mkdir(parents=True, exist_ok=True)
            (results / f.relative_to(REPO / "results")).write_bytes(b"")
    (results / "unindexed_run.csv").write_text("a,b\n")
    r = check("--results", str(results))
    assert r.returncode == 1
    assert r.stdout.splitlines()[1:] == ["unindexed_run.csv"]

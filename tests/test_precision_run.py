"""run --precision auto as a user runs it (issue 27, items 5 and 6): enforced end to end, the request checked once
by the parent; a relative budget is of the model the user named, not of the plan's requantized file."""

import json

import pytest
from conftest import cli

from flexoffload import api
from flexoffload.gguf import synth
from flexoffload.gguf.model import load

# as test_precision.py's: 256-wide rows take K-quants, a profile of seconds
SHAPE = synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=1024)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Requantized files and profiles in this module's own cache (the native build linked in)."""
    import os

    from flexoffload.defaults import cache_dir

    native = cache_dir() / "native"
    path = tmp_path_factory.mktemp("cache")
    if native.is_dir():
        (path / "native").symlink_to(native)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("FLEXOFFLOAD_CACHE", str(path))
        assert os.environ["FLEXOFFLOAD_CACHE"] == str(path)
        yield path


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "wide.gguf", SHAPE))


def test_run_precision_auto_enforced_runs_the_mixed_file(wide, cache):
    r = cli("run", "-m", str(wide.path), "--mem", "120M", "--enforce", "--precision", "auto", "--max-kld", "0.01",
            "-p", "def add(a, b):", "-n", "8", "--temp", "0", "-t", "2", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["enforced"] and result["n_gen"] == 8
    assert result["plan"]["precision"]["source"] == str(wide.path) != result["model"]["path"]
    # what the user is told before and while the profiles run (issue 27, item 2): each long measurement first says
    # what it measures, about how long, and how to do it ahead; the sensitivity profile says how far it is
    lines = r.stderr.splitlines()
    disk = next(i for i, x in enumerate(lines) if x.startswith("flexoffload: measuring this machine's disk"))
    notice = next(i for i, x in enumerate(lines) if x.startswith("flexoffload: measuring how wide.gguf takes lower"))
    progress = [i for i, x in enumerate(lines) if x.startswith("flexoffload: precision ")]
    assert "flexoffload profile -m" in lines[disk]
    assert "flexoffload profile --precision -m" in lines[notice] and " left, about " in lines[notice]
    assert progress and notice < progress[0]
    total = int(lines[progress[-1]].split()[2].rstrip(":").split("/")[1])
    assert len(progress) == total and f"precision {total}/{total}:" in lines[progress[-1]]
    again = cli("run", "-m", str(wide.path), "--mem", "120M", "--precision", "auto", "--max-kld", "0.01", "-p", "x",
                "-n", "1", "--temp", "0", "-t", "2")
    assert again.returncode == 0 and "measuring" not in again.stderr  # cached: nothing measured again
    assert "the plan decided before for this budget and bound" in again.stderr  # nor the walk planned again


def test_a_relative_budget_is_of_the_model_the_user_named(wide, cache, tmp_path):
    times = f"{(120 << 20) / wide.file_size:.1f}x"  # about 120 MiB of the source
    out = tmp_path / "plan"
    plan = json.loads(cli("plan", "-m", str(wide.path), "--mem", times, "--precision", "auto", "--max-kld", "0.01",
                          "-t", "2", "-o", str(out), "--json", check=True).stdout)
    mixed = load(plan["model"])
    assert mixed.file_size < wide.file_size
    prepared = api.prepare(api.Request(model=str(wide.path), prompt="x", plan_dir=str(out), mem=times))
    assert prepared.limit == int(float(times[:-1]) * wide.file_size)  # not of the mixed file's size
    r = cli("run", "--plan", str(out), "--mem", times, "--enforce", "-p", "def add(a, b):", "-n", "4", "--temp", "0",
            "-t", "2", "--json")
    assert r.returncode == 0, r.stderr
    small = cli("run", "--plan", str(out), "--mem", f"{float(times[:-1]) / 4:.1f}x", "-p", "x", "-n", "1")
    assert small.returncode != 0 and f"of {wide.path.name}" in small.stderr, small.stderr

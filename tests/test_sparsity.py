"""Predicted neurons (issue 31: measure/sparsity.py, plan/levels.py, run --sparsity, profile --neurons) on a tiny
synthetic dense qwen2 (random weights): the grouped file is built once and cached, each level's quality is measured,
a level's file differs from the grouped one in its expert_used_count alone, and a run at a level writes what
llama-completion writes for that file, in memory and streamed under a budget."""

from __future__ import annotations

import json

import pytest

from conftest import cli
from test_equality import llama_completion
from flexoffload import FlexoffloadError
from flexoffload.gguf import moefy, synth
from flexoffload.gguf.model import load
from flexoffload.measure import sparsity
from flexoffload.plan import levels

SHAPE = synth.SHAPES["qwen2-tiny"]  # n_ff 256: 6 groups of 32 and 64 hot neurons
N_GROUP = 6
PROMPT = "a b c d"  # where the tiny model's greedy text at 2 of 6 groups differs from the dense one's


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("sparsity") / "dense.gguf", SHAPE, qtype="Q4_0", output_scale=4.0)


@pytest.fixture(scope="module")
def profiled(dense):
    r = cli("profile", "-m", str(dense), "--neurons", "--neuron-groups", str(N_GROUP), "--levels", "2,4,6", "-t",
            "2", "--json", check=True)
    return sparsity.Sparsity.from_dict(json.loads(r.stdout)), r.stderr


def test_layout():
    assert sparsity.layout(8960) == (256, 768)  # the 1.5B's: 32 groups of 256, 768 hot (8.6 %)
    assert sparsity.layout(256, N_GROUP) == (32, 64)
    width, hot = sparsity.layout(18944)  # a 7B's FFN
    assert width % sparsity.BLOCK == 0 and 18944 % width == 0 and hot >= sparsity.HOT_SHARE * 18944
    with pytest.raises(FlexoffloadError):
        sparsity.layout(256, 16)  # groups of 32 leave no hot set


def test_profile_measures_each_level(dense, profiled):
    s, log = profiled
    assert "writing" in log and "KL divergence" in log  # the progress of a first build
    assert (s.n_group, s.group_width, s.n_hot) == (N_GROUP, 32, 64)
    assert [x.n_used for x in s.levels] == [2, 4, 6]
    by = {x.n_used: x for x in s.levels}
    assert by[2].ffn_share == pytest.approx((64 + 2 * 32) / 256)
    assert by[6].ffn_share == 1.0
    # fewer groups read fewer bytes and hold less of the FFN's output; all of them: the whole output
    assert by[2].read_share < by[4].read_share < by[6].read_share
    assert by[2].mass < by[4].mass < by[6].mass == pytest.approx(1.0)
    assert by[6].recall == 1.0 and 0 < by[2].recall <= 1 and by[2].mass <= by[2].best_mass + 1e-9
    # every group used is the dense FFN but for ffn_down's requantization: far closer than reading a third of them
    assert by[6].kld < 0.01 and by[6].kld < by[2].kld
    # cached: a second profile measures nothing again and says the same
    again = cli("profile", "-m", str(dense), "--neurons", "--neuron-groups", str(N_GROUP), "--levels", "2,4,6",
                "--json", check=True)
    assert "KL divergence against" not in again.stderr.replace("groups a token: KL divergence against", "")
    assert sparsity.Sparsity.from_dict(json.loads(again.stdout)) == s
    table = cli("profile", "-m", str(dense), "--neurons", "--neuron-groups", str(N_GROUP), "--levels", "2,4,6",
                check=True).stdout
    assert "recall" in table and len(table.strip().splitlines()) == 2 + 3 + 1


def test_a_level_is_the_grouped_file_with_another_k(tmp_path, profiled):
    s, _ = profiled
    grouped = s.file
    level = moefy.with_used(grouped, 3, tmp_path / "k3.gguf")
    assert moefy.used(level) == 3 and moefy.used(grouped) == N_GROUP
    a, b = open(grouped, "rb").read(), level.read_bytes()
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1  # 6 -> 3: one byte of the header
    mtime = level.stat().st_mtime_ns
    assert moefy.with_used(grouped, 3, level) == level and level.stat().st_mtime_ns == mtime  # made once
    assert load(level).n_expert_used == 3
    with pytest.raises(FlexoffloadError):
        moefy.with_used(grouped, N_GROUP + 1, tmp_path / "k7.gguf")


def test_choose():
    def level(k, kld):
        return levels.Level(k, k / 8, k / 8, kld, 0, 0, 0, 0, 0, 0, 0)

    s = levels.Sparsity("m", "f", 8, 32, 64, [level(2, 0.9), level(4, 0.2), level(6, 0.04), level(8, 0.001)])
    assert levels.choose(s).n_used == 6  # the default bound, 0.05
    assert levels.choose(s, 0.3).n_used == 4
    assert levels.choose(s, 0.01) is None  # only every group: that is the dense model
    assert levels.parse("auto") == "auto" and levels.parse("5") == 5 and levels.parse(None) is None
    for bad in ("0", "x", "-2", "1.5"):
        with pytest.raises(FlexoffloadError):
            levels.parse(bad)


def test_run_at_a_level_equals_llama_completion(tmp_path, dense, profiled):
    s, _ = profiled
    theirs = llama_completion(moefy.with_used(s.file, 2, tmp_path / "k2.gguf"), PROMPT, 24, ctx=512)
    for extra in ([], ["--mem", "64M"]):
        r = cli("run", "-m", str(dense), "-p", PROMPT, "-n", "24", "--temp", "0", "-c", "512", "-t", "2",
                "--sparsity", "2", "--json", *extra, check=True)
        ours = json.loads(r.stdout)
        assert "predicted neurons: 2 of 6 groups" in r.stderr
        assert ours["model"]["path"].endswith("-k2.gguf") and ours["text"] == theirs
    dense_text = json.loads(cli("run", "-m", str(dense), "-p", PROMPT, "-n", "24", "--temp", "0", "-c", "512",
                                "-t", "2", "--json", check=True).stdout)["text"]
    assert dense_text != theirs  # a third of the routed neurons: a different model


def test_sparsity_auto_follows_the_bound(dense, profiled):
    s, _ = profiled
    loose = cli("run", "-m", str(dense), "-p", PROMPT, "-n", "4", "--temp", "0", "-c", "512", "--sparsity", "auto",
                "--max-kld", "1000", "--json", check=True)
    assert "predicted neurons: 2 of 6 groups" in loose.stderr  # every level fits: the fewest groups
    assert json.loads(loose.stdout)["model"]["path"].endswith("-k2.gguf")
    tight = cli("run", "-m", str(dense), "-p", PROMPT, "-n", "4", "--temp", "0", "-c", "512", "--sparsity", "auto",
                "--max-kld", "0", "--json", check=True)
    assert "running the dense model" in tight.stderr
    assert json.loads(tight.stdout)["model"]["path"] == str(dense)


@pytest.mark.parametrize("args, message", [
    (["--sparsity", "0"], "--sparsity takes auto"),
    (["--sparsity", "many"], "--sparsity takes auto"),
    (["--sparsity", "7"], "has 6 groups a layer"),
    (["--sparsity", "2", "--max-kld", "0.1"], "--max-kld goes with --sparsity auto"),
    (["--sparsity", "2", "--precision", "auto", "--mem", "0.5x"], "not with --precision"),
])
def test_bad_sparsity_is_one_line(dense, profiled, args, message):
    r = cli("run", "-m", str(dense), "-p", PROMPT, "-n", "4", *args)
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_only_a_dense_qwen2_is_grouped(tiny_model):
    r = cli("run", "-m", str(tiny_model), "-p", PROMPT, "-n", "4", "--sparsity", "2")  # a llama
    assert r.returncode != 0 and "dense qwen2" in r.stderr and "Traceback" not in r.stderr
    r = cli("profile", "-m", str(tiny_model), "--levels", "2")
    assert r.returncode != 0 and "go with --neurons" in r.stderr

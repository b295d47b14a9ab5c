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
    """In memory (mmap); streamed under a budget: test_a_level_streamed_under_a_budget_reads_its_groups_from_disk."""
    s, _ = profiled
    theirs = llama_completion(moefy.with_used(s.file, 2, tmp_path / "k2.gguf"), PROMPT, 24, ctx=512)
    r = cli("run", "-m", str(dense), "-p", PROMPT, "-n", "24", "--temp", "0", "-c", "512", "-t", "2",
            "--sparsity", "2", "--json", check=True)
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


# --- groups that stream: a dense qwen2 whose FFN matrices are over the 1 MiB that always stays resident ------------

# two layers (the grouping's capture and split take about a minute), an FFN of 4096 (1.1 MiB a matrix at Q4_0: 6
# groups of 512 and 1024 hot neurons), its own output matrix: random weights whose greedy text after WIDE_PROMPT at
# 2 of 6 groups is not one token repeated, and not the dense model's
WIDE = synth.Shape(n_layer=2, n_embd=512, n_ff=4096, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=512,
                   arch="qwen2", rope_freq_base=1000000.0)
WIDE_PROMPT = "hello world"
WIDE_SETTING = ["-c", "256", "-b", "32", "-t", "2"]
TOK_S = 50.0  # the dense model's compute the profiles below set; a level's a fifth slower (its router, Q8_0 down)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The dense file and its grouped file (every group used; built once, not measured: a test sets its levels)."""
    path = synth.write(tmp_path_factory.mktemp("wide") / "wide.gguf", WIDE, qtype="Q4_0", output_scale=4.0)
    grouped, _ = sparsity.build(load(path), N_GROUP, n_threads=2)
    return path, grouped


def _level_2(wide):
    """The grouped file's levels as `profile --neurons` would leave them in this test's cache, set rather than
    measured (2 of 6 groups at a KL divergence of 0.01: what auto chooses), and every file's profile set: a disk
    that reads the dense model's weights in ten times its compute. (dense, the level's file) as Models."""
    from flexoffload.defaults import write_atomic

    from conftest import set_profile

    path, grouped = wide
    dense, (width, hot) = load(path), sparsity.layout(WIDE.n_ff, N_GROUP)
    level = load(moefy.with_used(grouped, 2))
    found = [levels.Level(k, (hot + k * width) / WIDE.n_ff, load(moefy.with_used(grouped, k)).routed_bytes /
                          dense.weight_bytes, kld, 0, 0, 0, 0, 0, 0, 0) for k, kld in ((2, 0.01), (N_GROUP, 0.0))]
    s = levels.Sparsity(str(path), str(grouped), N_GROUP, width, hot, found)
    write_atomic(sparsity.profile_path(dense), json.dumps(s.to_dict()))
    assert sparsity.load_cached(dense) == s
    disk = dense.weight_bytes * TOK_S / 10
    set_profile(dense.path, 2, TOK_S, disk)
    set_profile(level.path, 2, 0.8 * TOK_S, disk)
    return dense, level


def _run(path, *extra, prompt: str = PROMPT) -> tuple[dict, str]:
    r = cli("run", "-m", str(path), "-p", prompt, "-n", "24", "--temp", "0", *WIDE_SETTING, "--spec-type", "none",
            "--strategy", "stream", "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def _minimum(m) -> int:
    from flexoffload.measure import probe
    from flexoffload.plan.planners import run_minimum

    return run_minimum(m, probe.measure(m, 256, 32))


def _said(log: str) -> str:
    """The one line --sparsity auto said."""
    said = [line for line in log.splitlines() if "--sparsity auto" in line]
    assert len(said) == 1, log
    return said[0]


def test_a_level_streamed_under_a_budget_reads_its_groups_from_disk(wide, private_cache):
    """--sparsity 2 streamed by a plan near the level's least budget, no group cached between tokens: each decoded
    token reads from disk exactly its 2 groups of each layer (the prompt's pass, up to all 6), as the --json's reads
    say; and the greedy text is what llama-completion writes for the level's file, not the dense file's."""
    dense, level = _level_2(wide)
    budget = int(max(_minimum(dense), _minimum(level)) * 1.02)
    ours, log = _run(dense.path, "--sparsity", "2", "--mem", str(budget), "--expert-reads", "routed",
                     "--expert-slots", "0", prompt=WIDE_PROMPT)
    assert "predicted neurons: 2 of 6 groups" in log and ours["model"]["path"] == str(level.path)
    assert ours["strategy"] == "stream"
    t = ours["timings"]
    unit = sum(x.n_bytes for x in level.tensors if x.kind == "expert") // N_GROUP // WIDE.n_layer  # one group
    decoded = ours["n_gen"] - 1  # the last token is not decoded
    assert t["stream_passes"] == decoded + 1 and t["expert_hit_rate"] == 0
    assert WIDE.n_layer * (2 * decoded + 2) <= t["expert_uses"] <= WIDE.n_layer * (2 * decoded + N_GROUP)
    assert t["stream_bytes_read"] == t["expert_bytes_read"] == t["expert_uses"] * unit
    theirs = llama_completion(level.path, WIDE_PROMPT, 24, ctx=256, batch=32)
    assert len(set(theirs.split())) >= 2  # a text that shows a wrong group read
    assert ours["text"] == theirs
    assert theirs != llama_completion(dense.path, WIDE_PROMPT, 24, ctx=256, batch=32)


def test_sparsity_auto_under_a_budget_takes_a_level_only_where_it_is_predicted_faster(wide, private_cache):
    """--sparsity auto under a budget, a level within the bound, the disk slow: near the least budget the dense
    model streams most of its FFN and reading 2 of 6 groups a token is predicted faster, so the run takes the
    level; with room for the dense model's weights whole, the dense model computes faster than the level (set a
    fifth slower) and runs, said in one line."""
    dense, level = _level_2(wide)
    tight = int(max(_minimum(dense), _minimum(level)) * 1.01)
    faster, log = _run(dense.path, "--sparsity", "auto", "--mem", str(tight))
    assert "predicted neurons: 2 of 6 groups a token (KL divergence 0.010" in log
    assert faster["model"]["path"] == str(level.path) and faster["timings"]["expert_uses"] > 0
    roomy = _minimum(dense) + dense.weight_bytes
    slower, log = _run(dense.path, "--sparsity", "auto", "--mem", str(roomy))
    said = _said(log)
    assert "2 of 6 groups a token is predicted" in said and said.endswith("running the dense model")
    assert slower["model"]["path"] == str(dense.path) and "expert_uses" not in slower["timings"]


def test_sparsity_auto_where_the_level_does_not_fit_runs_the_dense_model_and_says_why(wide, private_cache):
    """A budget the dense model fits and the level's file does not (a prompt's batch holds every group it routes
    to, beside the hot set kept resident): the run goes on with the dense model and one line says the level does
    not fit, naming its minimum; below both, the run is refused in one line."""
    dense, level = _level_2(wide)
    low, high = _minimum(dense), _minimum(level)
    assert low < high  # what this test is about: the level needs more than the dense model
    ran, log = _run(dense.path, "--sparsity", "auto", "--mem", str((low + high) // 2))
    said = _said(log)
    assert "2 of 6 groups a token does not fit" in said and "the minimum is" in said
    assert said.endswith("running the dense model")
    assert ran["model"]["path"] == str(dense.path) and ran["timings"]["stream_bytes_read"] > 0
    r = cli("run", "-m", str(dense.path), "-p", PROMPT, "-n", "4", *WIDE_SETTING, "--sparsity", "auto", "--mem",
            str(low - (1 << 20)), "--strategy", "stream")
    assert r.returncode != 0 and "the minimum is" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


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

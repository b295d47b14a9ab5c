"""The command line as a user meets it: one-line errors for bad input, JSON for scripts."""

import json

import pytest

from conftest import cli


def assert_one_line_error(r, *words):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_version_and_help():
    r = cli("--version", check=True)
    assert r.stdout.startswith("flexoffload, version ")
    r = cli("run", "--help", check=True)
    for flag in ("-m, --model", "-p, --prompt", "-f, --file", "-n, --n-predict", "-c, --ctx-size", "--temp",
                 "--seed", "-t, --threads", "--mem", "--enforce", "--json"):
        assert flag in r.stdout


def test_missing_model_file(tmp_path):
    assert_one_line_error(cli("run", "-m", str(tmp_path / "missing.gguf"), "-p", "x"), "not found")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am text")
    assert_one_line_error(cli("run", "-m", str(p), "-p", "x"), "not a GGUF")
    assert_one_line_error(cli("info", "-m", str(p)), "not a GGUF")


def test_truncated_gguf(tiny_model, tmp_path):
    p = tmp_path / "cut.gguf"
    p.write_bytes(tiny_model.read_bytes()[:-1000])
    assert_one_line_error(cli("run", "-m", str(p), "-p", "x"), "truncated")


@pytest.mark.parametrize("extra", [(), ("--mem", "1G", "--enforce"), ("--mem", "1G", "--strategy", "prefetch"),
                                   ("--strategy", "mmap", "--mem", "1G", "--enforce")])
def test_architecture_llama_cpp_does_not_know(tmp_path, extra):
    """Refused in one line by llama.cpp's own load (with a budget: by the memory probe, before any cgroup)."""
    from conftest import write_gguf

    p = write_gguf(tmp_path / "alien.gguf", "no-such-arch")
    r = cli("run", "-m", str(p), "-p", "x", *extra)
    assert_one_line_error(r, "alien.gguf")
    assert "cgroup" not in r.stderr


def test_vocabulary_only_gguf(tmp_path):
    from conftest import write_gguf

    p = write_gguf(tmp_path / "vocab.gguf", "llama", tensors=False)
    assert_one_line_error(cli("run", "-m", str(p), "-p", "x", "--mem", "1G", "--enforce"), "no tensors")


def test_unknown_model_name():
    assert_one_line_error(cli("run", "-m", "llama-9000b", "-p", "x"), "unknown model", "qwen2.5-coder-1.5b-instruct")
    assert_one_line_error(cli("models", "fetch", "llama-9000b"), "unknown model")


def test_no_prompt_and_bad_prompt_file(tiny_model, tmp_path):
    assert_one_line_error(cli("run", "-m", str(tiny_model)), "no prompt")
    assert_one_line_error(cli("run", "-m", str(tiny_model), "-f", str(tmp_path / "none.txt")), "cannot read")


def test_budget_too_small_names_the_minimum(tiny_model):
    r = cli("run", "-m", str(tiny_model), "-p", "x", "--mem", "1M")
    assert_one_line_error(r, "too small", "minimum")


def test_bad_budget_text(tiny_model):
    assert_one_line_error(cli("run", "-m", str(tiny_model), "-p", "x", "--mem", "lots"), "cannot read memory size")


def test_prompt_longer_than_context(tiny_model):
    r = cli("run", "-m", str(tiny_model), "-p", "a b c d e f g h " * 60, "-c", "32", "-n", "4")
    assert_one_line_error(r, "longer than the context")


def test_run_json(tiny_model):
    r = cli("run", "-m", str(tiny_model), "-p", "a b c", "-n", "8", "--temp", "0", "--json", check=True)
    out = json.loads(r.stdout)
    for key in ("text", "tokens", "n_prompt", "n_gen", "ttft_s", "decode_tok_s", "peak_mem_mb", "strategy", "model"):
        assert key in out
    assert out["n_gen"] == len(out["tokens"]) <= 8
    assert out["strategy"] == "mmap" and out["model"]["size"] == tiny_model.stat().st_size
    assert out["n_prompt"] >= 4  # BOS + three words
    assert out["peak_source"] == "rss" and out["peak_mem_mb"] > 0


def test_run_text_streams_to_stdout_timings_to_stderr(tiny_model, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("a b c")
    r = cli("run", "-m", str(tiny_model), "-f", str(prompt), "-n", "8", "--temp", "0", check=True)
    j = json.loads(cli("run", "-m", str(tiny_model), "-p", "a b c", "-n", "8", "--temp", "0", "--json").stdout)
    assert r.stdout.rstrip("\n") == j["text"].rstrip("\n")
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout


def test_sampling_is_seeded(tiny_model):
    def tokens(seed):
        r = cli("run", "-m", str(tiny_model), "-p", "a b", "-n", "16", "--temp", "1.5", "--seed", str(seed), "--json")
        return json.loads(r.stdout)["tokens"]
    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2) or tokens(3) != tokens(1)


def test_enforced_run_reports_the_cgroup_peak(tiny_model):
    r = cli("run", "-m", str(tiny_model), "-p", "a b c", "-n", "4", "--temp", "0", "--mem", "600M", "--enforce",
            "--json", check=True)
    out = json.loads(r.stdout)
    assert out["enforced"] is True and out["peak_source"] == "cgroup"
    assert 0 < out["peak_mem_mb"] <= 600
    # memory.stat's faults, small for a tiny model far below its budget
    assert set(out["faults"]) == {"major_faults", "refaults_file"}
    assert all(0 <= n < 10_000 for n in out["faults"].values())


def test_info(tiny_model):
    out = json.loads(cli("info", "-m", str(tiny_model), "--json", check=True).stdout)
    assert out["n_layer"] == 3 and len(out["tensors"]) == 30
    assert sum(out["layers"].values()) + sum(t["bytes"] for t in out["tensors"] if t["layer"] is None) == out["weight_bytes"]
    text = cli("info", "-m", str(tiny_model), check=True).stdout
    assert "-- layer 2" in text and "blk.2.ffn_down.weight" in text and "total: 30 tensors" in text


def test_models_list():
    rows = json.loads(cli("models", "list", "--json", check=True).stdout)
    assert {r["name"] for r in rows} == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}


def test_profile_and_plan(tiny_model, tmp_path, monkeypatch):
    """profile measures and reports the disk bandwidth plans use: the median of its own passes and the runs the disk
    paced on this device (two set up here at 1.234 GB/s: the median is theirs, whatever the passes measured); plan
    writes tensors.ot and plan.json that agree with each other."""
    from flexoffload.measure import profiler

    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))  # this test's own record of the disk
    disk_paced = {"stream_bytes_read": profiler.SUSTAINED_BYTES, "stream_reads": 10, "stream_direct": 10,
                  "stream_read_gb_s": 1.234, "stream_stall_s": 1.0}  # compute waited on every read
    for _ in range(2):
        profiler.record_run(tiny_model, disk_paced)
    prof = json.loads(cli("profile", "-m", str(tiny_model), "--json", check=True).stdout)
    assert prof["disk_bw_profile"] > 0 and prof["compute_tok_s"] > 0
    assert prof["disk_runs"] == 2
    assert prof["disk_bw"] == pytest.approx(1.234e9)
    out = tmp_path / "plan"
    r = cli("plan", "-m", str(tiny_model), "--mem", "400M", "--strategy", "stream", "-c", "256", "-o", str(out), check=True)
    assert "predicted" in r.stdout and "roofline" in r.stdout
    from flexoffload.plan import plans

    p = plans.read(out)
    assert p.policy == "balanced" and p.memory.total <= p.budget
    assert not p.streamed  # 400 MiB holds a 100 KB model whole
    assert_one_line_error(cli("plan", "-m", str(tiny_model), "--mem", "1M", "-o", str(out)), "minimum")
    assert_one_line_error(cli("plan", "-m", str(tiny_model), "--mem", "400M", "--policy", "magic", "-o", str(out)),
                          "unknown policy")


def test_models_synth_writes_a_model_that_runs(tmp_path):
    out = tmp_path / "tiny.gguf"
    r = cli("models", "synth", "tiny", "-o", str(out), check=True)
    assert str(out) in r.stdout and not out.with_name("tiny.gguf.part").exists()
    info = json.loads(cli("info", "-m", str(out), "--json", check=True).stdout)
    assert info["n_layer"] == 3
    run = json.loads(cli("run", "-m", str(out), "-p", "hello", "-n", "4", "--temp", "0", "--json", check=True).stdout)
    assert run["n_gen"] == 4


def test_models_synth_refuses_an_unwritable_path(tmp_path):
    r = cli("models", "synth", "tiny", "-o", str(tmp_path / "missing" / "x.gguf"))
    assert r.returncode != 0 and "cannot write" in r.stderr and "Traceback" not in r.stderr


def test_a_plan_must_fit_the_model_and_the_budget(tiny_model, tmp_path):
    """A saved plan made for another model, or larger than --mem, is refused in one line; --window is no sync
    flag."""
    from flexoffload.gguf import synth

    other = synth.write(tmp_path / "other.gguf", synth.SHAPES["llama-gqa-tiny"])
    plan_dir = tmp_path / "plan"
    cli("plan", "-m", str(other), "--mem", "300M", "--strategy", "stream", "-c", "256", "-o", str(plan_dir), check=True)
    assert_one_line_error(cli("run", "-m", str(tiny_model), "-p", "x", "--plan", str(plan_dir)),
                          "made for another model")
    assert_one_line_error(cli("run", "-m", str(other), "-p", "x", "-c", "256", "--plan", str(plan_dir), "--mem", "50M"),
                          "more than the budget")
    r = cli("run", "-m", str(other), "-p", "x", "-n", "2", "-c", "256", "--plan", str(plan_dir), "--json", check=True)
    assert json.loads(r.stdout)["plan"]["io_threads"] == 4
    r = cli("run", "-m", str(other), "-p", "x", "-n", "2", "-c", "256", "--plan", str(plan_dir), "--io-threads", "2",
            "--json", check=True)
    assert json.loads(r.stdout)["plan"]["io_threads"] == 2  # the flag, not the plan's
    assert_one_line_error(cli("run", "-m", str(tiny_model), "-p", "x", "--strategy", "sync", "--window", "2"),
                          "--window does not apply to sync")

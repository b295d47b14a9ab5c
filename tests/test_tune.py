"""plan --tune: candidates measured under the enforced budget, the fastest kept and used by run --mem."""

import json

from conftest import cli
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import probe
from flexoffload.measure import tuning
from flexoffload.plan import candidates
from flexoffload.memory import budgets

STREAMABLE = synth.Shape(n_layer=4, n_embd=1024, n_ff=2816, n_head=8, n_head_kv=4, n_vocab=384, n_ctx_train=1024)


def test_tune_measures_the_candidates_keeps_the_fastest_and_run_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))  # the children inherit it
    path = synth.write(tmp_path / "streamable.gguf", STREAMABLE)
    m = load(path)
    mem = budgets.holding(m, m.weight_bytes * 3 // 4, probe.measure(m, 512, 512))
    out = json.loads(cli("plan", "-m", str(path), "--mem", str(mem), "-c", "512", "-o", str(tmp_path / "plan"),
                         "--tune", "2", "--tune-rounds", "1", "--json", check=True).stdout)
    tried = out["tuning"]
    assert len(tried) >= 2 and all(t["error"] == "" and t["measured_tok_s"] > 0 for t in tried)
    best = tried[candidates.pick([t["measured_tok_s"] for t in tried])]
    assert (out["policy"], out["window"]) == (best["policy"], best["window"])
    assert tried[-1]["policy"] == "mmap"  # upstream mmap under the same budget is a candidate too
    assert tuning.cached(m, mem, 512, 512) is not None

    # the target alone: where --spec-type auto finds free drafters pay (by the profile this machine measured), the
    # run speculates by a plan counting the tree's rows, which tuning (one-token passes) did not measure
    alone = ("--spec-type", "none")
    tuned = json.loads(cli("run", "-m", str(path), "-p", "a b c", "-n", "4", "--temp", "0", "-c", "512",
                           "--mem", str(mem), *alone, "--json", check=True).stdout)
    untuned = json.loads(cli("run", "-m", str(path), "-p", "a b c", "-n", "4", "--temp", "0", "-c", "512",
                             "--mem", str(mem), "--untuned", *alone, "--json", check=True).stdout)
    if best["policy"] == "mmap":
        assert tuned["strategy"] == "mmap" and "plan" not in tuned
    else:
        assert (tuned["plan"]["policy"], tuned["plan"]["window"]) == (best["policy"], best["window"])
    assert tuned["tokens"] == untuned["tokens"]
    other = json.loads(cli("run", "-m", str(path), "-p", "a b c", "-n", "4", "--temp", "0", "-c", "256",
                           "--mem", str(mem), "--strategy", "stream", *alone, "--json", check=True).stdout)
    assert other["plan"]["policy"] == "balanced"  # tuned for -c 512, not 256


def test_pick_keeps_the_predicted_best_unless_another_is_clearly_faster():
    assert candidates.pick([10.0, 10.2, 9.0]) == 0  # 2% faster: within the drift
    assert candidates.pick([10.0, 10.5, 9.0]) == 1  # 5% faster
    assert candidates.pick([10.0, 10.5, 11.0]) == 2
    assert candidates.pick([0.0, 3.0, 4.0]) == 2  # the predicted best failed
    assert candidates.pick([10.0, 10.5], margin=0.1) == 0


def test_a_run_whose_tuned_choice_is_mmap_says_so_and_runs_mmap(tmp_path, monkeypatch):
    from dataclasses import replace

    from flexoffload import api
    from flexoffload.plan import plans
    from flexoffload.measure.profiler import measure

    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))
    path = synth.write(tmp_path / "streamable.gguf", STREAMABLE)
    m = load(path)
    run = probe.measure(m, 512, 512)
    mem = budgets.holding(m, m.weight_bytes * 3 // 4, run)
    best = candidates.candidates(m, mem, measure(m, 2), run, 1)[0]
    measured = ({"policy": best.policy, "window": best.window, "predicted_tok_s": best.predicted_tok_s,
               "measured_tok_s": 2.0, "runs": [2.0], "error": ""},
              {"policy": "mmap", "window": 0, "predicted_tok_s": 0.0, "measured_tok_s": 3.0, "runs": [3.0], "error": ""})
    plans.write(replace(candidates.mmap_candidate(m, mem, best), tuning=measured), tuning.cache_path(m, mem, 512, 512))
    request = api.Request(model=str(path), prompt="a b c", n_predict=4, n_ctx=512, temp=0, mem=str(mem))
    p = api.prepare(request)
    assert p.strategy == "mmap" and p.plan is None
    assert p.notes and "mmap measured faster" in p.notes[0] and "3.00" in p.notes[0] and "2.00" in p.notes[0]
    assert api.prepare(replace(request, tuned=False)).strategy == "stream"
    r = cli("run", "-m", str(path), "-p", "a b c", "-n", "4", "--temp", "0", "-c", "512", "--mem", str(mem),
            "--json", check=True)
    assert json.loads(r.stdout)["strategy"] == "mmap" and "mmap measured faster" in r.stderr
    # the same plan saved by `plan --tune -o DIR` and given back with --plan
    r = cli("run", "-m", str(path), "-p", "a b c", "-n", "4", "--temp", "0", "-c", "512", "--mem", str(mem),
            "--plan", str(tuning.cache_path(m, mem, 512, 512)), "--json", check=True)
    assert json.loads(r.stdout)["strategy"] == "mmap" and "mmap measured faster" in r.stderr

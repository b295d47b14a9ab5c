"""`timeout N scripts/headline` stops it (issue 52): SIGTERM ends the headline within seconds, with a failing status,
its finished runs on disk and no child left, both where the main thread waits on a run's child (the handler's exit
unwinds) and where it decodes in process with a ctypes callback, which drops the handler's SystemExit (the watcher
of bench/headline.py's stoppable ends the process). The runner below is scripts/headline's measuring, hl.measure
inside hl.stoppable, with systems of its own on the tiny synthetic model."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from flexoffload.bench import headline as hl

RUNNER = r'''
import sys, time
from pathlib import Path
from flexoffload import native
from flexoffload.bench import headline as hl
from flexoffload.memory import budgets
from flexoffload.runtime import engine

model, out, mode, token = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
sleeper = [sys.executable, "-c", "import time; time.sleep(120)", token]  # found by its token if it outlives us


def quick(case):
    return hl.Outcome(ok=True, decode_tok_s=1.0, text="x")


def in_a_child(case):  # as ours and llama.cpp's systems run: a child in a memory cgroup, waited on in Python
    (out / "started").write_text("")
    limit = None if budgets.cgroup_unavailable() else 256 << 20
    budgets.run_limited(sleeper, limit, timeout=120)
    return hl.Outcome(ok=True, decode_tok_s=1.0, text="x")


def in_process(case):  # as preparing and warming do: llama.cpp decoding here, calling back into Python
    import subprocess
    subprocess.Popen(sleeper)  # a child beside it (a probe's), which must not outlive the stop either
    lib = native.llama_cpp()
    callback = lib.ggml_backend_sched_eval_callback(lambda t, ask, data: time.sleep(0.002) or False)
    settings = engine.Settings(n_ctx=256, n_threads=1, temp=0)
    with engine.Engine(str(model), settings, eval_callback=callback) as eng:
        (out / "started").write_text("")
        while True:
            eng.generate("Once upon a time", 32)


system = {"child": in_a_child, "decode": in_process}[mode]
case = hl.Case(model=model, limit=256 << 20, mem=None, prompt="p", n_predict=1, n_ctx=8, timeout=120)
row = hl.Row("sig", "cap", "m", "s", "decode_tok_s", (hl.System("quick", "ours", quick),
                                                      hl.System(mode, "upstream", system)), lambda: [("p", case)])
with hl.stoppable(lambda: (out / "cleaned").write_text("")):
    hl.measure([row], 3, out / "h.csv")
'''


def _alive(token: str) -> list[int]:
    """Processes whose command line holds token, not yet ended (a zombie has ended)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and token.encode() in (d / "cmdline").read_bytes() \
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(d.name))
        except OSError:  # ended meanwhile
            pass
    return found


@pytest.mark.parametrize("mode", ["child", "decode"])
def test_sigterm_stops_the_headline_within_seconds_and_leaves_no_child(mode, tiny_model, tmp_path):
    token = f"headline-signal-{uuid.uuid4().hex}"
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    proc = subprocess.Popen([sys.executable, str(runner), str(tiny_model), str(tmp_path), mode, token],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():  # the first run done and written, the second under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # well inside it: the child started, or decoding
        assert _alive(token)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=hl.GRACE_S + 10)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0 and took < hl.GRACE_S + 5, (proc.returncode, took, err[-2000:])
    assert (tmp_path / "cleaned").exists()
    records = hl.read_csv(tmp_path / "h.csv")  # what ended before the stop, kept
    assert [(r.system, r.ok) for r in records] == [("quick", True)]
    time.sleep(0.2)  # a killed child's end is the kernel's
    assert _alive(token) == [], "a child outlived the headline"
    if mode == "decode":  # the case of issue 52: the handler's SystemExit raised inside llama.cpp's callback
        assert "ctypes callback" in err
    if mode == "child":
        assert os.path.exists(tmp_path / "h.csv") and "headline: stopped" in err  # the handler's own exit

import subprocess
import sys
from pathlib import Path

import pytest

from flexoffload import FlexoffloadError
from flexoffload.memory import budgets
from flexoffload.memory.budgets import MemoryCgroup, MiB, parse_size


@pytest.mark.parametrize("text,expected", [
    ("400M", 400 * MiB), ("1.5G", int(1.5 * 1024 * MiB)), ("512MiB", 512 * MiB), ("2g", 2048 * MiB),
    ("1048576", 1048576), ("64K", 65536), ("0.4x", 400), ("1x", 1000), (".5X", 500),
])
def test_parse_size(text, expected):
    assert parse_size(text, model_size=1000) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1G", "0", "0x", "12Q", "1.2.3G"])
def test_parse_size_rejects(text):
    with pytest.raises(FlexoffloadError):
        parse_size(text, model_size=1000)


def test_fraction_needs_a_model():
    with pytest.raises(FlexoffloadError, match="relative"):
        parse_size("0.5x")


def _child(alloc_mb: int, hold_s: float = 0.0) -> list[str]:
    # touches alloc_mb of anonymous memory, holds it hold_s seconds, then reports success
    return [sys.executable, "-c", f"import time; b = bytearray({alloc_mb} << 20); b[::4096] = b'x' * len(b[::4096]); "
                                  f"time.sleep({hold_s}); print('ok')"]


def test_cgroup_holds_a_process_to_its_budget():
    with MemoryCgroup(200 * MiB) as cg:
        path = cg.path
        ok = cg.popen(_child(100), stdout=subprocess.PIPE, text=True)
        assert ok.communicate()[0].strip() == "ok" and ok.returncode == 0
        assert 100 * MiB <= cg.peak() <= 200 * MiB
        assert not cg.oom_killed()
        over = cg.popen(_child(400), stdout=subprocess.PIPE, text=True)
        over.communicate()
        assert over.returncode == -9  # the kernel's OOM killer
        assert cg.oom_killed()
        assert cg.peak() <= 200 * MiB
    assert not path.exists()  # removed afterwards


def test_the_measured_runtime_is_within_a_real_runs_peak(tiny_model):
    """A cold run of a tiny model, whose peak is nearly all runtime, fits in the estimated minimum."""
    import json

    from conftest import cli
    from flexoffload.gguf.model import load
    from flexoffload.measure import probe
    from flexoffload.memory import budgets

    budgets.drop_page_cache()
    r = cli("run", "-m", str(tiny_model), "-p", "a b c", "-n", "4", "--temp", "0", "--mem", "512M", "--enforce",
            "--json", check=True)
    peak = json.loads(r.stdout)["peak_mem_mb"] * MiB
    m = load(tiny_model)
    run = probe.measure(m, 2048, 512)
    assert run.runtime < peak <= budgets.minimum(m, run) + m.weight_bytes


def test_minimum_is_refused_below_and_named(tiny_model):
    from flexoffload.gguf.model import load
    from flexoffload.measure import probe
    from flexoffload.memory import budgets

    m = load(tiny_model)
    run = probe.measure(m, 2048, 512)
    need = budgets.minimum(m, run)
    assert need > run.runtime + run.code + run.kv_cache
    budgets.check(m, need, run, 2048, 512)
    with pytest.raises(FlexoffloadError, match="minimum is"):
        budgets.check(m, need - 1, run, 2048, 512)


def test_run_limited_charges_the_child_and_samples_what_it_cannot_give_back():
    """The one way to run a child under a budget: moved into its cgroup before it execs (no preexec_fn), its
    anonymous memory seen by the sampled peak, the kernel's OOM kill reported."""
    from flexoffload.memory.budgets import run_limited

    ok = run_limited(_child(100, hold_s=0.5), 300 * MiB)  # held long enough for the 20 ms samples to see it
    assert ok.returncode == 0 and ok.stdout.strip() == "ok" and ok.enforced and not ok.oom_killed
    assert 90 <= ok.unreclaimable_mb <= 300 and 100 <= ok.peak_mem_mb <= 300
    over = run_limited(_child(400), 200 * MiB)
    assert over.oom_killed and over.returncode == -9
    free = run_limited(_child(10), None)
    assert free.returncode == 0 and not free.enforced and free.peak_mem_mb == 0


def test_run_limited_stops_a_child_past_its_timeout():
    from flexoffload.memory.budgets import run_limited

    with pytest.raises(FlexoffloadError, match="timed out"):
        run_limited([sys.executable, "-c", "import time; time.sleep(30)"], 200 * MiB, timeout=1)


@pytest.mark.timeout(300, method="thread")  # its own SIGALRM stops the wait
def test_a_run_stopped_from_outside_leaves_no_child_behind(tmp_path):
    """A Ctrl-C or SIGTERM (as an exception) while waiting for the child kills it and removes its cgroup."""
    import signal

    pid_file = tmp_path / "pid"

    def stop(*_):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, stop)
    signal.alarm(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            budgets.run_limited(["sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"], 64 * MiB, timeout=120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert pid_file.is_file()
    assert not Path(f"/proc/{int(pid_file.read_text())}").exists()

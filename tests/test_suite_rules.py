"""The suite's own rules, as pyproject.toml sets them, hold: a test that hangs fails by its timeout instead of
hanging `make test`, a marker nobody registered is an error, and an xfail that passes fails."""

import subprocess
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "pyproject.toml"


def pytest_on(tmp_path, source: str, *extra: str) -> subprocess.CompletedProcess:
    """pytest under this project's configuration on one test file of source."""
    (tmp_path / "test_probe.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(CONFIG), "--rootdir", str(tmp_path),
                           "-p", "no:cacheprovider", *extra, str(tmp_path / "test_probe.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_every_test_has_a_timeout(request):
    assert float(request.config.getini("timeout")) > 0


def test_a_hanging_test_fails_by_its_timeout(tmp_path):
    r = pytest_on(tmp_path, "import time\n\ndef test_hangs():\n    time.sleep(600)\n", "-o", "timeout=2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Timeout" in r.stdout + r.stderr


def test_an_unregistered_marker_is_an_error(tmp_path):
    r = pytest_on(tmp_path, "import pytest\n\n@pytest.mark.integraton\ndef test_typo():\n    pass\n")
    assert r.returncode != 0 and "integraton" in r.stdout + r.stderr


def test_an_xfail_that_passes_fails(tmp_path):
    r = pytest_on(tmp_path, "import pytest\n\n@pytest.mark.xfail(reason='x')\ndef test_passes():\n    pass\n")
    assert r.returncode == 1 and "XPASS(strict)" in r.stdout, r.stdout


WRITES_THE_DISK_RECORD = '''from flexoffload.measure import profiler

def test_records_a_streamed_run({fixture}tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"\\0" * 4096)
    profiler.record_run(f, {{"stream_bytes_read": profiler.SUSTAINED_BYTES, "stream_reads": 10, "stream_direct": 10,
                            "stream_read_gb_s": 1.0, "stream_stall_s": 1.0}})
'''


def test_a_module_that_records_the_disk_in_the_session_s_cache_fails(tmp_path):
    """The disk's record is one a device, read by every module's plans: conftest fails a module that changes the
    session cache's, and passes one that records in a cache of its own."""
    import shutil

    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    r = pytest_on(tmp_path, WRITES_THE_DISK_RECORD.format(fixture=""))
    assert r.returncode == 1 and "changed the session cache's disk record" in r.stdout, r.stdout + r.stderr
    r = pytest_on(tmp_path, WRITES_THE_DISK_RECORD.format(fixture="private_cache, "))
    assert r.returncode == 0, r.stdout + r.stderr

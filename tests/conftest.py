import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flexoffload import FlexoffloadError
from flexoffload import native
from flexoffload.defaults import cache_dir
from flexoffload.gguf import catalog
from flexoffload.gguf import synth

# What the session's own cache borrows from the user's, read only: the fetched models (file by file, so nothing is
# added to the user's models/ folder), the native build, and the pinned source test_build_native builds from.
_BORROWED = ("native", "sdist")
SESSION_CACHE: Path | None = None  # the session's cache (pytest_configure)


def pytest_configure(config):
    """Every cache a test touches is the session's own: FLEXOFFLOAD_CACHE is a fresh temporary folder, set before any
    test runs and inherited by every child (cli, enforced runs, probes), so no test reads or writes the user's
    profiles/, footprints/, tuned/, precision/, ... The real models and the native build are linked into it from the
    user's cache, and FLEXOFFLOAD_NATIVE names the build (native.build_dir) found before the switch."""
    user = cache_dir()
    try:
        build = native.build_dir()
    except FlexoffloadError:  # tests that need it fail as they would without a build
        build = None
    session = Path(tempfile.mkdtemp(prefix="flexoffload-test-cache-"))
    (session / "models").mkdir()
    for entry in catalog.CATALOG.values():
        real = user / "models" / entry.file_name
        if real.is_file():
            (session / "models" / entry.file_name).symlink_to(real)
    for name in _BORROWED:
        if (user / name).is_dir():
            (session / name).symlink_to(user / name)
    os.environ["FLEXOFFLOAD_CACHE"] = str(session)
    global SESSION_CACHE
    SESSION_CACHE = session
    if build is not None:
        os.environ["FLEXOFFLOAD_NATIVE"] = str(build)
    config._flexoffload_cache = session


def _link_borrowed(cache: Path, session: Path) -> None:
    """cache made as the session's is: its models (the real ones, linked) and the borrowed folders, through the
    session's links."""
    (cache / "models").symlink_to(session / "models")
    for name in _BORROWED:
        if (session / name).exists():
            (cache / name).symlink_to((session / name).resolve())


# The disk as runs and profiles have shown it (measure/diskrecord.py): one record a device, read by every plan of
# every model on that device (the session's synthetic files and real models share one), so a module that writes it
# in the session's cache changes other modules' plans. These are its files in a cache's profiles/.
DISK_RECORDS = ("disk-*.json", "*-seen-*.json")


def disk_records(cache: Path) -> dict[str, str]:
    """The disk records in cache (name -> text)."""
    found = {}
    for pattern in DISK_RECORDS:
        for f in (cache / "profiles").glob(pattern):
            try:
                found[f.name] = f.read_text()
            except OSError:
                pass
    return found


@pytest.fixture(scope="module", autouse=True)
def session_disk_record_untouched(request):
    """Each module leaves the session cache's disk record as it found it: a module whose runs or profiles record the
    disk (a streamed run's reads, a profile's passes of at least SUSTAINED_BYTES: the real models', a large synthetic
    file's) or remove it (set_profile) takes a cache of its own (module_cache, private_cache)."""
    session = request.config._flexoffload_cache
    before = disk_records(session)
    yield
    after = disk_records(session)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, (f"{request.module.__name__} changed the session cache's disk record ({', '.join(changed)}), "
                         "which other modules' plans read: give it module_cache or private_cache")


def pytest_unconfigure(config):
    session = getattr(config, "_flexoffload_cache", None)
    if session is not None:
        shutil.rmtree(session, ignore_errors=True)  # the links go, not what they point to


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 3-layer llama-shaped Q4_0 GGUF with random weights and a 384-token vocabulary (~100 KB)."""
    return synth.write(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The real Qwen2.5-Coder-1.5B-Instruct (the user's, linked into the session's cache); `make test` fetches it
    first."""
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    if not catalog.is_present(entry):
        pytest.fail(f"{entry.name} is not fetched: run `flexoffload models fetch` (make test does)")
    return catalog.model_path(entry)


def cli(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """`flexoffload ARGS` in a fresh process, as a user runs it."""
    r = subprocess.run([sys.executable, "-m", "flexoffload", *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if check and r.returncode != 0:
        raise AssertionError(f"flexoffload {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def write_gguf(path: Path, arch: str, tensors: bool = True) -> Path:
    """A minimal GGUF of architecture arch: one F32 token_embd (or no tensor at all: a vocabulary-only file)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    vocab = synth._vocab(300)
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if tensors:
        w.add_tensor("token_embd.weight", np.zeros((300, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tail_logits_apart(e, toks: list[int], n: int, tiled: int = 0) -> float:
    """How far the last token's logits from one pass over toks[n:] (the batch kernels off, as a verification pass
    runs: native.set_tiled_matmul's mode `tiled`) lie from those of one-token passes over the same tokens; toks[:n]
    decoded first in passes of 64."""
    import numpy as np

    from flexoffload.speculation import speculate

    lib, mem = e.lib, e.lib.llama_get_memory(e.ctx)

    def prefix() -> None:
        lib.llama_memory_clear(mem, True)
        for i in range(0, n, 64):
            e._decode(toks[i:min(i + 64, n)])

    prefix()
    for t in toks[n:]:
        e._decode([t])
    single = e.last_logits()
    prefix()
    batch = speculate._Batch(lib, len(toks) - n, 1)
    batch.fill([(t, n + i, [0], True) for i, t in enumerate(toks[n:])])
    native.set_tiled_matmul(tiled)
    try:
        assert lib.llama_decode(e.ctx, batch.batch) == 0
    finally:
        native.set_tiled_matmul(-1)
        batch.free()
    return float(np.abs(e.last_logits() - single).max())


# --- a test's own cache, and a machine profile set rather than measured -------------------------------------------

@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    """A cache of the test's own (FLEXOFFLOAD_CACHE, which cli children inherit): profiles, recorded disk speeds and
    tables written there are seen by no other test, and none of the session's are seen here. The native build is
    linked in as in the session's."""
    native = cache_dir() / "native"
    path = tmp_path / "private-cache"
    path.mkdir()
    if native.is_dir():
        (path / "native").symlink_to(native.resolve())
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def module_cache(request, tmp_path_factory) -> Path:
    """A cache of the module's own, made as the session's is (the real models and the native build linked): what
    its tests measure and record (profiles, the disk's record, footprints, tuned plans) is shared among them, as the
    session's cache would share it, and with no other module. For a module whose tests measure or record the disk
    (the real models' profiles and streamed runs) or plan from what they measured: `pytestmark =
    pytest.mark.usefixtures("module_cache")`, or a module fixture that measures asks for it first."""
    path = tmp_path_factory.mktemp("module-cache")
    _link_borrowed(path, request.config._flexoffload_cache)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("FLEXOFFLOAD_CACHE", str(path))
        yield path


def set_profile(model_path, n_threads: int, tok_s: float, disk_bw: float):
    """The machine's profile for model_path at -t n_threads, set here instead of measured: compute at tok_s with
    every weight in memory, O_DIRECT reads at disk_bw bytes/s. Written where profiler.measure looks for it (the cache
    FLEXOFFLOAD_CACHE names: give a test its private_cache first). The disk speeds streamed runs recorded on the
    file's device (profiler.record_run: the best, the recent ones plans take the median with; the expert reads' too)
    are removed, so plans use disk_bw as it is. Returns the Profile."""
    import json

    from flexoffload.defaults import write_atomic
    from flexoffload.gguf.model import load
    from flexoffload.measure import diskrecord, profiler
    from flexoffload.plan.costmodel import Profile

    assert cache_dir() != SESSION_CACHE, "set_profile writes where plans read: give the test a cache of its own"
    model = load(model_path)
    device = diskrecord._best_path(model.path).name.rsplit("-", 1)[1]  # the records' files end in the device's id
    for pattern in DISK_RECORDS:  # the best, the dense runs' and the expert reads' ones
        for recorded in (cache_dir() / "profiles").glob(pattern):
            if recorded.name.endswith(f"-{device}"):
                recorded.unlink(missing_ok=True)
    profile = Profile.calibrated(model, tok_s=tok_s, disk_bw=disk_bw)
    write_atomic(profiler._cache_path(model, n_threads), json.dumps(profile.to_dict(), indent=1))
    assert profiler.measure(model, n_threads) == profile  # what a plan reads: this profile, no recorded run beside it
    return profile

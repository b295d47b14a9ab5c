"""The patch mechanism: patches/series applies in order, and a patch that does not apply stops the build."""

import os
import shutil
import subprocess
from pathlib import Path

from flexoffload.gguf.catalog import cache_dir

REPO = Path(__file__).resolve().parent.parent
SDIST = "llama_cpp_python-0.3.36.tar.gz"


def _scratch_repo(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of scripts/ and patches/ with its own cache holding the already-downloaded pinned source."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    shutil.copytree(REPO / "patches", repo / "patches")
    cache = tmp_path / "cache"
    (cache / "sdist").mkdir(parents=True)
    os.link(cache_dir() / "sdist" / SDIST, cache / "sdist" / SDIST)
    return repo, {**os.environ, "FLEXOFFLOAD_CACHE": str(cache)}


def test_a_patch_that_does_not_apply_stops_the_build(tmp_path):
    repo, env = _scratch_repo(tmp_path)
    bad = repo / "patches" / "0999-does-not-apply.patch"
    bad.write_text("Description: test\n---\n--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,1 +1,1 @@\n"
                   "-this line is not in llama.cpp\n+neither is this one\n")
    with open(repo / "patches" / "series", "a") as f:
        f.write("0999-does-not-apply.patch\n")
    r = subprocess.run(["bash", str(repo / "scripts" / "build_native")], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "0999-does-not-apply.patch does not apply" in r.stderr
    assert "applied 0001-amx-tile-config.patch" in r.stderr  # the ones before it did, in order
    assert not (repo / "vendor" / "llama.cpp" / ".flexoffload-key").exists()  # not marked as a good tree
    assert not list((tmp_path / "cache").glob("native/*/.complete"))


def test_the_pinned_tree_carries_our_patches():
    mmq = REPO / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    assert '__asm__ volatile("ldtilecfg %0" :: "m"(tc));' in mmq.read_text()
    assert (REPO / "build" / "native" / ".complete").exists()


def test_the_cached_build_is_made_from_its_own_copy_of_the_tree():
    """Every clone shares the cached build, and cmake re-reads its source when a target is added later
    (scripts/upstream_tests builds the test programs): that source is the cache's copy, not the vendor/ of
    whichever clone built it first, which may be gone (CI deletes its clone)."""
    native = REPO / "build" / "native"
    cache = (native / "build" / "CMakeCache.txt").read_text()
    [source] = [line.split("=", 1)[1] for line in cache.splitlines() if line.startswith("CMAKE_HOME_DIRECTORY:")]
    assert os.path.samefile(source, native / "src")
    assert (native / "src" / "tests" / "CMakeLists.txt").exists()


STUB_CMAKE = """#!/usr/bin/env bash
# a stand-in for cmake: records each call; a configure writes the cache a real one would, naming its source
echo "$*" >> "$CMAKE_CALLS"
if [ "$1" = -S ]; then
    mkdir -p "$4"
    echo "CMAKE_HOME_DIRECTORY:INTERNAL=$2" > "$4/CMakeCache.txt"
fi
"""


def test_the_build_is_redone_exactly_when_its_key_or_its_state_says_so(tmp_path):
    """build_native's rules, with cmake stubbed (its calls counted): a first run configures and builds; a second
    with nothing changed only checks the key; a build left half done (no .complete) or configured from another
    tree is redone; a change to patches/series is a new key, a new build beside the old one."""
    repo, env = _scratch_repo(tmp_path)
    stub = tmp_path / "bin" / "cmake"
    stub.parent.mkdir()
    stub.write_text(STUB_CMAKE)
    stub.chmod(0o755)
    calls = tmp_path / "calls"
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir()
    (wheels / "llama_cpp_python-0.3.36-py3-none-any.whl").write_text("")  # the bindings' wheel: not this test's
    env = {**env, "PATH": f"{stub.parent}:{env['PATH']}", "CMAKE_CALLS": str(calls)}

    def build() -> list[str]:
        calls.write_text("")
        r = subprocess.run(["bash", str(repo / "scripts" / "build_native")], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr
        return calls.read_text().splitlines()

    def configured_and_built(lines: list[str]) -> bool:
        return len(lines) == 2 and lines[0].startswith("-S") and lines[1].startswith("--build")

    assert configured_and_built(build())
    def builds() -> list:
        return [p for p in (tmp_path / "cache" / "native").iterdir() if p.name != "current"]

    [out] = builds()
    assert (out / ".complete").is_file() and (repo / "build" / "native").resolve() == out.resolve()
    assert build() == []  # nothing changed: the key checked, nothing run
    (out / ".complete").unlink()  # a build stopped half way
    assert configured_and_built(build())
    (out / "build" / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={tmp_path}/elsewhere\n")
    assert configured_and_built(build())  # configured from a clone's tree, since deleted
    with open(repo / "patches" / "series", "a") as f:
        f.write("# a change to the series is a new key\n")
    assert configured_and_built(build())
    assert len(builds()) == 2
    assert (repo / "build" / "native").resolve() != out.resolve()

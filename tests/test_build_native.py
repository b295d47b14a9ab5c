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

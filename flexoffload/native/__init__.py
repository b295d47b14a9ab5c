"""The patched llama.cpp build: where it is, its tools, and the llama-cpp-python bindings loaded on it.

scripts/build_native builds one native tree into the cache and links it as build/native in the repo
(and native/current in the cache). The bindings are installed without a native build of their own and
find our libllama.so through LLAMA_CPP_LIB_PATH, which must be set before llama_cpp is imported. tools.py runs the
build's tools to their end (llama-quantize, llama-imatrix, llama-perplexity) with one-line errors; process.py
starts every process flexoffload starts, those tools' and its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir

REPO = Path(__file__).resolve().parent.parent.parent

# One attention for a token whether it is decoded alone or beside others, as speculation's verification decodes
# it: upstream splits a lone token's KV across the threads from 512 cells and rounds differently (patch 0016).
# Set before any context computes, for this process and every llama.cpp tool or server it starts (a user's own
# GGML_CPU_SPLIT_KV=1 is kept: upstream's attention, and speculation then only nearly lossless).
os.environ.setdefault("GGML_CPU_SPLIT_KV", "0")


# OpenMP threads (ggml's CPU backend) spin for a while after their work before they sleep: GOMP_SPINCOUNT's default
# is 300000 rounds. On separate machines that costs nothing; on shared cores, a client's and a server's spinning
# threads take the cores the other is computing on, and a token split between them measured 51-58 ms against
# 39-42 ms for either side alone (the 1.5B, 2 threads each). 3000 rounds measured 42.6 ms split, and no loss
# alone (38.7 against 39.2 ms). Set for RPC servers on this machine and for a client that uses RPC (unless set).
SPIN_COUNT = "3000"


def spin_briefly() -> None:
    """Set GOMP_SPINCOUNT for this process before llama.cpp (and libgomp) loads, unless the user set it."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


def build_dir() -> Path:
    """The folder holding libllama.so and the tools (llama-completion, llama-bench, ...)."""
    candidates = []
    if os.environ.get("FLEXOFFLOAD_NATIVE"):
        candidates.append(Path(os.environ["FLEXOFFLOAD_NATIVE"]))
    candidates += [REPO / "build" / "native" / "build" / "bin", cache_dir() / "native" / "current" / "build" / "bin"]
    for c in candidates:
        if (c / "libllama.so").is_file():
            return c
    raise FlexoffloadError("the native llama.cpp build is missing: run `make setup` (scripts/build_native)")


def key() -> str:
    """The native build's key (scripts/build_native: the patches and the pinned source), as its folder names it: a
    new build may round differently, so caches of what it computed and benchmark records carry it."""
    return build_dir().resolve().parent.parent.name


def tool(name: str) -> Path:
    p = build_dir() / name
    if not p.is_file():
        raise FlexoffloadError(f"{name} is not in the native build ({p.parent}): run `make setup`")
    return p


_llama_cpp = None


def llama_cpp():
    """The llama_cpp bindings module, loaded on our native build, with the backend initialised once."""
    global _llama_cpp
    if _llama_cpp is None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(build_dir())
        import llama_cpp as lib

        lib.llama_backend_init()
        _llama_cpp = lib
    return _llama_cpp


def ggml(name: str):
    """One of the build's ggml libraries ("ggml-base", "ggml-cpu", ...), as a ctypes library: the copy libllama
    loaded (loaded first), opened once."""
    import ctypes

    if name not in _ggml_libs:
        llama_cpp()
        _ggml_libs[name] = ctypes.CDLL(str(build_dir() / f"lib{name}.so"))
    return _ggml_libs[name]


_ggml_libs: dict = {}


def graph_tensors():
    """libggml-base with what an eval callback reads of a graph's tensors bound: name, data, size, a copy out, and
    operator names."""
    import ctypes

    base, p = ggml("ggml-base"), ctypes.c_void_p
    base.ggml_get_name.argtypes, base.ggml_get_name.restype = [p], ctypes.c_char_p
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [p], p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [p], ctypes.c_size_t
    base.ggml_backend_tensor_get.argtypes = [p, p, ctypes.c_size_t, ctypes.c_size_t]
    base.ggml_backend_tensor_get.restype = None
    base.ggml_op_name.argtypes, base.ggml_op_name.restype = [ctypes.c_int], ctypes.c_char_p
    return base


def set_tiled_matmul(mode: int) -> None:
    """ggml_cpu_set_tiled_matmul (patch 0009): -1 as the environment says, 0 off, 1 on. Process wide."""
    import ctypes

    cpu = ggml("ggml-cpu")
    cpu.ggml_cpu_set_tiled_matmul.argtypes, cpu.ggml_cpu_set_tiled_matmul.restype = [ctypes.c_int], None
    cpu.ggml_cpu_set_tiled_matmul(mode)

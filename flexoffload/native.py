"""The patched llama.cpp build: where it is, its tools, and the llama-cpp-python bindings loaded on it.

scripts/build_native builds one native tree into the cache and links it as build/native in the repo
(and native/current in the cache). The bindings are installed without a native build of their own and
find our libllama.so through LLAMA_CPP_LIB_PATH, which must be set before llama_cpp is imported.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import FlexoffloadError
from .defaults import cache_dir

REPO = Path(__file__).resolve().parent.parent

# One attention for a token whether it is decoded alone or beside others, as speculation's verification decodes
# it: upstream splits a lone token's KV across the threads from 512 cells and rounds differently (patch 0016).
# Set before any context computes, for this process and every llama.cpp tool or server it starts (a user's own
# GGML_CPU_SPLIT_KV=1 is kept: upstream's attention, and speculation then only nearly lossless).
os.environ.setdefault("GGML_CPU_SPLIT_KV", "0")


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


def set_tiled_matmul(mode: int) -> None:
    """ggml_cpu_set_tiled_matmul (patch 0009): -1 as the environment says, 0 off, 1 on. Process wide."""
    import ctypes

    global _ggml_cpu
    if _ggml_cpu is None:
        llama_cpp()  # loads libggml-cpu.so with libllama; this opens the same copy
        _ggml_cpu = ctypes.CDLL(str(build_dir() / "libggml-cpu.so"))
        _ggml_cpu.ggml_cpu_set_tiled_matmul.argtypes = [ctypes.c_int]
        _ggml_cpu.ggml_cpu_set_tiled_matmul.restype = None
    _ggml_cpu.ggml_cpu_set_tiled_matmul(mode)


_ggml_cpu = None

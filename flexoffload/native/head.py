"""ctypes bindings for a cut output head's C API (include/llama-head.h, patch 0032): its rows, and pointing some
of them at other tokens."""

from __future__ import annotations

import ctypes

from flexoffload.native import llama_cpp

_api = None


def api():
    """The bound functions of llama-head.h, from the libllama the bindings loaded (None: a build without them)."""
    global _api
    if _api is None:
        llama_cpp()
        from llama_cpp.llama_cpp import _lib as lib
        if not hasattr(lib, "llama_head_set_rows"):
            return None
        lib.llama_head_n_rows.restype, lib.llama_head_n_rows.argtypes = ctypes.c_int32, [ctypes.c_void_p]
        lib.llama_head_set_rows.restype = ctypes.c_bool
        lib.llama_head_set_rows.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                            ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p]
        _api = lib
    return _api


def n_rows(model) -> int:
    """The rows of the model's cut head (0: a whole head, or a build without patch 0032)."""
    lib = api()
    return lib.llama_head_n_rows(model) if lib else 0


def set_rows(model, first: int, ids: list[int], data: bytes) -> bool:
    """Point rows first.. of the model's cut head at tokens ids, their weights data (the rows' bytes in order)."""
    lib = api()
    arr = (ctypes.c_int32 * len(ids))(*ids)
    return bool(lib and lib.llama_head_set_rows(model, first, len(ids), arr, data))

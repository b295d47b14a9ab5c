"""ctypes bindings for the streaming runtime's C API (include/llama-stream.h, patches 0002-0008, 0014) and
llama_set_n_ubatch (include/llama-ubatch.h, 0015).

The patched libllama streams the tensors given the STREAMED buffer type: I/O threads read the next
`window` layers' tensors while the current layer computes, and give each tensor's memory back after use.
A tensor larger than the chunk size (the output matrix) is read in row chunks, each given back as soon as its
part of the matrix multiplication is done (patch 0007), so it never needs memory as big as itself.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from flexoffload import FlexoffloadError
from flexoffload.defaults import CHUNK_BYTES
from flexoffload.native import llama_cpp


class StreamParams(ctypes.Structure):
    _fields_ = [("window", ctypes.c_int32), ("n_io_threads", ctypes.c_int32), ("direct_io", ctypes.c_bool),
                ("verbose", ctypes.c_bool), ("chunk_bytes", ctypes.c_int64)]


class StreamStats(ctypes.Structure):
    _fields_ = [
        ("n_reads", ctypes.c_uint64), ("bytes_read", ctypes.c_uint64), ("n_direct", ctypes.c_uint64),
        ("n_buffered", ctypes.c_uint64), ("t_read_s", ctypes.c_double), ("t_stall_s", ctypes.c_double),
        ("n_stalls", ctypes.c_uint64), ("n_uses", ctypes.c_uint64), ("n_rereads", ctypes.c_uint64),
        ("n_passes", ctypes.c_uint64), ("bytes_committed", ctypes.c_int64), ("bytes_committed_peak", ctypes.c_int64),
        ("n_tensors", ctypes.c_uint64), ("bytes_streamed", ctypes.c_uint64),
    ]


class LayerStats(ctypes.Structure):
    _fields_ = [("n_reads", ctypes.c_uint64), ("bytes_read", ctypes.c_uint64), ("t_read_s", ctypes.c_double),
                ("t_stall_s", ctypes.c_double), ("t_wall_s", ctypes.c_double)]


class ExpertsConfig(ctypes.Structure):
    _fields_ = [("slots", ctypes.c_int32), ("policy", ctypes.c_int32), ("whole", ctypes.c_int32),
                ("ahead", ctypes.c_int32), ("lookahead", ctypes.c_int32), ("router", ctypes.c_int32)]


class ExpertsStats(ctypes.Structure):
    _fields_ = [("n_uses", ctypes.c_uint64), ("n_hits", ctypes.c_uint64), ("n_reads", ctypes.c_uint64),
                ("bytes_read", ctypes.c_uint64), ("n_evictions", ctypes.c_uint64), ("bytes_cached", ctypes.c_int64),
                ("bytes_cached_peak", ctypes.c_int64), ("n_ahead", ctypes.c_uint64), ("n_spilled", ctypes.c_uint64),
                ("n_predicted", ctypes.c_uint64), ("n_predicted_used", ctypes.c_uint64), ("n_routed", ctypes.c_uint64)]


EXPERT_POLICIES = ("lru", "lfu")  # enum ggml_cpu_streamed_experts_policy, in order

_api = None
_cpu = None


def api():
    """The bound functions of llama-stream.h, from the libllama the bindings loaded."""
    global _api
    if _api is None:
        llama_cpp()  # loads libllama from our build
        from llama_cpp.llama_cpp import _lib as lib
        try:
            f = lib.llama_stream_buffer_type
        except AttributeError:
            raise FlexoffloadError("this libllama has no streaming runtime: run `make setup` to rebuild it") from None
        f.restype, f.argtypes = ctypes.c_void_p, []
        lib.llama_stream_default_params.restype = StreamParams
        lib.llama_stream_get_params.restype, lib.llama_stream_get_params.argtypes = ctypes.c_bool, [ctypes.POINTER(StreamParams)]
        lib.llama_stream_set_params.restype, lib.llama_stream_set_params.argtypes = ctypes.c_bool, [ctypes.POINTER(StreamParams)]
        lib.llama_stream_get_stats.restype, lib.llama_stream_get_stats.argtypes = ctypes.c_bool, [ctypes.POINTER(StreamStats)]
        lib.llama_stream_n_layers.restype = ctypes.c_int32
        lib.llama_stream_get_layer_stats.restype = ctypes.c_bool
        lib.llama_stream_get_layer_stats.argtypes = [ctypes.c_int32, ctypes.POINTER(LayerStats)]
        lib.llama_stream_get_model_stats.restype = ctypes.c_bool
        lib.llama_stream_get_model_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(StreamStats)]
        lib.llama_stream_get_model_layer_stats.restype = ctypes.c_bool
        lib.llama_stream_get_model_layer_stats.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(LayerStats)]
        lib.llama_stream_reset_stats.restype, lib.llama_stream_reset_stats.argtypes = None, []
        lib.llama_stream_get_error.restype, lib.llama_stream_get_error.argtypes = ctypes.c_char_p, []
        lib.llama_stream_make_resident.restype = ctypes.c_bool
        lib.llama_stream_make_resident.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.llama_set_n_ubatch.restype, lib.llama_set_n_ubatch.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_uint32]
        _api = lib
    return _api


def buffer_type() -> int:
    buft = api().llama_stream_buffer_type()
    if not buft:
        raise FlexoffloadError("streaming is not supported by this build")
    return buft


def configure(window: int, io_threads: int, direct_io: bool = True, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Set the runtime's parameters. chunk_bytes: tensors larger than this are read in row chunks of at most this
    many bytes (0: whole); it applies to the models loaded afterwards."""
    if chunk_bytes < 0:
        raise FlexoffloadError(f"the chunk size must be >= 0, not {chunk_bytes}")
    p = api().llama_stream_default_params()
    p.window, p.n_io_threads, p.direct_io, p.chunk_bytes = window, io_threads, direct_io, chunk_bytes
    if not api().llama_stream_set_params(ctypes.byref(p)):
        raise FlexoffloadError("streaming is not supported by this build")


def _cpu_lib():
    """The CPU backend's library (ggml-cpu-streamed-experts.h is a ggml C API: libllama does not re-export it)."""
    global _cpu
    if _cpu is None:
        from flexoffload.native import ggml

        lib = ggml("ggml-cpu")
        try:
            lib.ggml_backend_cpu_streamed_experts_set_config.argtypes = [ctypes.POINTER(ExpertsConfig)]
        except AttributeError:
            raise FlexoffloadError("this build streams no experts: run `make setup` to rebuild it") from None
        lib.ggml_backend_cpu_streamed_experts_set_config.restype = None
        lib.ggml_backend_cpu_streamed_experts_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ExpertsStats)]
        lib.ggml_backend_cpu_streamed_experts_get_stats.restype = None
        _cpu = lib
    return _cpu


def configure_experts(slots: int, policy: str = "lru", whole: bool = False, ahead: bool = False,
                      lookahead: bool = False, router: bool = True) -> None:
    """A mixture of experts' expert cache: experts each layer keeps between tokens (-1: all it has read), and which
    to give back first (lru, lfu), from the next layer computed. whole: the expert tensors of models loaded from now
    on stream whole, by the window, as dense tensors do (patch 0021), not by expert. ahead: a prompt batch naming
    three quarters of a layer's experts reads the next layer's ahead (patch 0022). lookahead: a layer's router input
    through the next layer's router predicts that layer's experts, read while this layer computes (patch 0029).
    router: a layer's reads are queued at its router's choice (its argsort), not at its first expert op (patch 0031)."""
    if policy not in EXPERT_POLICIES:
        raise FlexoffloadError(f"unknown expert cache policy {policy!r}: one of {', '.join(EXPERT_POLICIES)}")
    c = ExpertsConfig(slots=max(-1, slots), policy=EXPERT_POLICIES.index(policy), whole=int(whole),
                      ahead=int(ahead), lookahead=int(lookahead), router=int(router))
    _cpu_lib().ggml_backend_cpu_streamed_experts_set_config(ctypes.byref(c))


def expert_stats() -> dict:
    """The expert cache's counters since the last reset, for the process: uses (routed experts, per layer and
    pass), hits, slices read and their bytes, evictions, bytes cached now and at peak, experts read ahead, experts
    a batch held beyond its layer's cache (in the spill array the layers share, patch 0027), and experts read on a
    prediction and of those the ones their router chose (patch 0029), and experts whose reads were queued at their
    router's choice (patch 0031)."""
    s = ExpertsStats()
    _cpu_lib().ggml_backend_cpu_streamed_experts_get_stats(None, ctypes.byref(s))
    return {name: getattr(s, name) for name, _ in ExpertsStats._fields_}


def params() -> StreamParams:
    """The runtime's current parameters."""
    p = StreamParams()
    api().llama_stream_get_params(ctypes.byref(p))
    return p


@dataclass
class Stats:
    bytes_read: int
    n_reads: int
    n_direct: int
    t_read_s: float
    t_stall_s: float
    n_passes: int
    n_rereads: int
    bytes_committed_peak: int
    layer_stall_s: list[float]
    bytes_committed: int = 0  # now: the read pool, tensors read into their own ranges, the experts' slots


def stats(model=None, layers: bool = True) -> Stats:
    """The runtime's statistics since the last reset: of one model's streamed tensors (model: its llama_model
    pointer; a draft's reads are not its target's), or of the whole process (None). layers False: without the
    per-layer stalls (a call per layer; speculation reads the totals every target pass)."""
    lib, s = api(), StreamStats()
    if model is None:
        lib.llama_stream_get_stats(ctypes.byref(s))
    else:
        lib.llama_stream_get_model_stats(model, ctypes.byref(s))
    layer_stall_s = []
    for il in range(lib.llama_stream_n_layers() if layers else 0):
        ls = LayerStats()
        if model is None:
            lib.llama_stream_get_layer_stats(il, ctypes.byref(ls))
        else:
            lib.llama_stream_get_model_layer_stats(model, il, ctypes.byref(ls))
        layer_stall_s.append(ls.t_stall_s)
    return Stats(bytes_read=s.bytes_read, n_reads=s.n_reads, n_direct=s.n_direct, t_read_s=s.t_read_s,
                 t_stall_s=s.t_stall_s, n_passes=s.n_passes, n_rereads=s.n_rereads,
                 bytes_committed_peak=s.bytes_committed_peak, layer_stall_s=layer_stall_s,
                 bytes_committed=s.bytes_committed)


def make_resident(model, names) -> int:
    """Stop streaming the model's tensors of these names (model: its llama_model pointer): each is read once into
    its own memory and computed from there on. Between llama_decode calls. Returns the number made resident (a name
    not streamed is skipped)."""
    lib = api()
    return sum(bool(lib.llama_stream_make_resident(model, name.encode())) for name in names)


def set_n_ubatch(ctx, n_ubatch: int) -> int:
    """Set a context's ubatch; its compute buffers are freed and reserved for the new size at the next decode."""
    return api().llama_set_n_ubatch(ctx, n_ubatch)


def reset_stats() -> None:
    """Zero the counters and forget a read error (the runtime reads again)."""
    api().llama_stream_reset_stats()


def error() -> str | None:
    """The first read error since the last reset (tensor, offset, file, reason), None if none.

    A streamed tensor that cannot be read does not end the process: the runtime records the error, hands
    compute zeros and stops reading, so the llama_decode it happened in returns with meaningless outputs.
    """
    e = api().llama_stream_get_error()
    return e.decode("utf-8", "replace") if e else None

"""The settings of a run (Settings) and the llama.cpp context they make (context_params, uses_flash_attention).

Apart from the engine because more than the engine reads them: footprint's probe and dryrun make the same context
without an Engine, llama-server's process is started from them (server.py), and options.py checks the KV types.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexoffload.defaults import CHUNK_BYTES, IO_THREADS, KV_TYPES, WINDOW  # noqa: F401  (KV_TYPES: importable here)
from flexoffload.options import BY_NAME


def _default(name: str):
    """The options table's default (one default for every command and the API)."""
    return BY_NAME[name].default


@dataclass
class Settings:
    n_ctx: int = _default("n_ctx")
    n_batch: int = _default("n_batch")
    n_threads: int = _default("n_threads")
    temp: float = _default("temp")
    seed: int = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed
    strategy: str = "mmap"
    streamed_patterns: tuple[str, ...] = ()  # regexes (tensors.ot) of the tensors to stream
    window: int = WINDOW
    io_threads: int = IO_THREADS
    chunk_bytes: int = CHUNK_BYTES  # streamed tensors larger than this are read in row chunks
    expert_slots: int = -1  # a mixture of experts: experts each layer keeps between tokens (-1: all it read)
    expert_policy: str = "lru"  # which of them it gives back first: least recently (lru) or frequently (lfu) used
    expert_whole: bool = False  # its expert tensors stream whole, by the window, not by expert
    expert_ahead: bool = False  # a prompt batch naming most of a layer's experts reads the next layer's ahead
    expert_lookahead: bool = False  # the next layer's experts, predicted from this layer's router input, read ahead
    expert_router: bool = True  # a layer's reads queued at its router's choice, not at its first expert op
    n_outputs: int = 1  # logits rows one forward pass returns (a speculation tree needs one per node)
    n_seq_max: int = 1  # sequences in the KV cache (a speculation tree: one per branch, in one unified cache)
    n_ubatch: int = 0  # tokens a forward pass computes at once (llama.cpp's -ub); 0: n_batch
    flash_attn: str = _default("flash_attn")  # on, off, or auto (llama.cpp decides: on for this CPU backend)
    type_k: str = _default("cache_type_k")  # the KV cache's types (-ctk, -ctv); a quantized V needs flash attention
    type_v: str = _default("cache_type_v")
    decode_ubatch: int = 0  # after the prompt: the ubatch decode runs with (its compute buffers sized for it); 0: same
    resident_after_prefill: tuple[str, ...] = ()  # streamed tensors made resident when decode starts (prefill.py)
    rpc: tuple[str, ...] = ()  # RPC servers (HOST:PORT) whose devices tensors may be placed on
    n_gpu_layers: int = 0  # with rpc: the last layers llama.cpp offloads to those devices, KV cache with them (-ngl)
    tensor_split: tuple[float, ...] = ()  # with rpc: their shares of those layers per device (-ts); () upstream's
    placed_patterns: tuple[tuple[str, str], ...] = ()  # (regex, buffer type name) of tensors on another device
    verbose: bool = False


FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type


def context_params(lib, settings: Settings):
    """llama.cpp's context parameters for a run with these settings (footprint's probe makes the same context)."""
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = settings.n_ctx
    cparams.n_batch = settings.n_batch
    cparams.n_ubatch = settings.n_ubatch or settings.n_batch
    cparams.flash_attn_type = FLASH_ATTN[settings.flash_attn]
    cparams.type_k, cparams.type_v = KV_TYPES[settings.type_k], KV_TYPES[settings.type_v]
    # generation reads only the last token's logits: reserving 1 output instead of n_batch shrinks the
    # compute buffer (measured for the 1.5B at -b 512: 303 MiB down to 67 MiB)
    cparams.n_outputs_max = settings.n_outputs
    cparams.n_seq_max = settings.n_seq_max
    cparams.kv_unified = True  # one cache of n_ctx cells that all sequences share (tree branches share prefixes)
    # sliding-window layers keep only their window's cells, as llama.cpp's tools do (the C default keeps n_ctx);
    # a speculation tree keeps the full cache: its rejected cells are removed after later ones were written
    cparams.swa_full = settings.n_seq_max > 1
    cparams.n_threads = settings.n_threads
    cparams.n_threads_batch = settings.n_threads
    return cparams


def uses_flash_attention(settings: Settings, context_log: list[str]) -> bool:
    """Whether a context computes attention with flash attention: as -fa says, or where it is auto as llama.cpp
    resolved it (context_log: what it logged making the context). It turns auto off where a layer's attention would
    run on another device than the layer (a tensor placed on an RPC server draws the attention there)."""
    if settings.flash_attn != "auto":
        return settings.flash_attn == "on"
    return not any("Flash Attention not supported" in line for line in context_log)

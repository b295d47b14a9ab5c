"""Names and defaults shared across flexoffload's modules (and with the native runtime): one home for each.

Nothing here imports anything of flexoffload's, so every module can import it.
"""

from __future__ import annotations

import os
from pathlib import Path

# How weights reach memory (engine.Engine): upstream mmap; stream by a plan; every streamable tensor streamed with a
# window (FlexInfer's "Prefetch only") or without one ("Sync Read").
STRATEGIES = ("mmap", "stream", "prefetch", "sync")

# Resident-set policies (planners.POLICIES holds their functions); "none" keeps only the always-resident tensors.
POLICIES = ("balanced", "flexinfer", "attn-first", "ffn-first", "layer")

# A streamed tensor larger than this is read in row chunks, each given back after its part of the matmul (patch
# 0007: GGML_CPU_STREAMED_CHUNK_BYTES is the runtime's default, llama_stream_params.chunk_bytes (0008) sets it).
# A tensor bound for a device loads in pieces of at most this many bytes (patch 0012's LLAMA_LOAD_PIECE_BYTES):
# what its load holds beside the weights, on the host and on an RPC server.
LOAD_PIECE_BYTES = 16 << 20
CHUNK_BYTES = 16 << 20

# Layers read ahead of compute by the prefetch strategy (FlexInfer's default); plans choose their own.
WINDOW = 3

# A mixture of experts' expert tensors: read by expert once the router has chosen ("routed": False), whole by the
# window ("whole": True), or as the plan chooses ("auto": None) (plan/expertcache.py).
EXPERT_READS = {"auto": None, "routed": False, "whole": True}
# Whether a decoded token's layer reads the next layer's experts its router is predicted to choose (patch 0029): as
# the plan decides ("auto": None), or on, or off.
EXPERT_LOOKAHEAD = {"auto": None, "on": True, "off": False}

# Threads issuing the streamed reads (the runtime's pool, and the disk profile's reads in flight).
IO_THREADS = 4

# The KV cache's types, -ctk/-ctv's choices (enum ggml_type: what llama.cpp's context parameters take).
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}

# The lower types a precision plan may choose, highest precision first. K-quants and IQ types need rows of 256
# weights; the 32-weight types are for the rest (Qwen2.5-0.5B's 896-wide rows). IQ types are left to --types: the
# CPU runs them more slowly than K-quants of the same size, and a plan should ask for that trade.
LADDER = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K", "Q2_K")

# Tensors under this (and every norm and bias) are always resident: about 1% of a model, and a read request each a
# token if streamed (HyperGen's size-aware caching).
SMALL_BYTES = 1 << 20


def file_key(path: Path) -> str:
    """A model file in cache keys (profiles, footprints, tuned plans): its name, size and modification time, so an
    edited or replaced file is measured again."""
    st = path.stat()
    return f"{path.name}-{st.st_size}-{int(st.st_mtime)}"


def content_key(*parts: str) -> str:
    """A short name for a cached result made from these inputs (texts, settings, types): the same inputs, the same
    name."""
    import hashlib

    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def write_atomic(path: Path, text: str) -> None:
    """Write a cache file whole or not at all (a part file renamed over it), its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.part")
    tmp.write_text(text)
    tmp.replace(path)


def cache_dir() -> Path:
    """Where models, the native build, profiles and footprints are kept: $FLEXOFFLOAD_CACHE or
    ~/.cache/flexoffload."""
    return Path(os.environ.get("FLEXOFFLOAD_CACHE") or Path.home() / ".cache" / "flexoffload")

# The n-gram drafters' keys, shared by run's own (speculation/drafters.py) and llama-server's of the same names
# (runtime/server.py passes them on): ngram-simple's lookup lengths, longest first, and ngram-map-k's.
NGRAM_SIZES = (3, 2, 1)
MAP_K_SIZE = 4

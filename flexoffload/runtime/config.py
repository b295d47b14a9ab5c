"""The streaming runtime's configuration of a run (StreamConfig), the one translation of engine Settings for it.

An in-process run (engine.Engine) applies it through the C API (native/stream.py: configure, configure_experts);
llama-server (server.environment) gets the same object as the LLAMA_STREAM_* variables the patched llama.cpp reads
once at first use (patches 0002, 0008, 0018, 0021, 0022, 0029, 0031). One object for both, so a run and a serve of
the same plan stream alike.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from flexoffload.runtime.settings import Settings


@dataclass(frozen=True)
class StreamConfig:
    window: int  # layers read ahead of the one computing
    io_threads: int
    chunk_bytes: int  # tensors larger than this are read in row chunks (0: whole)
    expert_slots: int  # a mixture of experts: experts each layer keeps between tokens (-1: all it read)
    expert_policy: str  # lru or lfu
    expert_whole: bool  # expert tensors stream whole, by the window
    expert_ahead: bool  # a prompt batch naming most of a layer's experts reads the next layer's ahead
    expert_lookahead: bool  # the next layer's experts, predicted from this layer's router input, read ahead
    expert_router: bool  # a layer's reads queued at its router's choice (patch 0031), not at its first expert op

    def apply(self) -> None:
        """Set it in this process's native runtime, for the models loaded afterwards. direct_io is left at the
        C API's default (on), as llama-server's environment leaves it."""
        from flexoffload.native import stream

        stream.configure(self.window, self.io_threads, chunk_bytes=self.chunk_bytes)
        stream.configure_experts(self.expert_slots, self.expert_policy, whole=self.expert_whole,
                                 ahead=self.expert_ahead, lookahead=self.expert_lookahead,
                                 router=self.expert_router)

    def environment(self) -> dict[str, str]:
        """The LLAMA_STREAM_* variables that set it in a child's native runtime (a flag as 0 or 1, as the patches
        read it with atoi)."""
        return {VARIABLES[f.name]: _text(getattr(self, f.name)) for f in fields(self)}


# each field's variable, as the patches' getenv calls name it
VARIABLES = {
    "window": "LLAMA_STREAM_WINDOW",
    "io_threads": "LLAMA_STREAM_IO_THREADS",
    "chunk_bytes": "LLAMA_STREAM_CHUNK_BYTES",
    "expert_slots": "LLAMA_STREAM_EXPERT_SLOTS",
    "expert_policy": "LLAMA_STREAM_EXPERT_POLICY",
    "expert_whole": "LLAMA_STREAM_EXPERT_WHOLE",
    "expert_ahead": "LLAMA_STREAM_EXPERT_AHEAD",
    "expert_lookahead": "LLAMA_STREAM_EXPERT_LOOKAHEAD",
    "expert_router": "LLAMA_STREAM_EXPERT_ROUTER",
}


def _text(value) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def stream_config(settings: Settings) -> StreamConfig | None:
    """The streaming runtime's configuration of a run with these settings; None for one that streams nothing
    (mmap: the native runtime is left as it is)."""
    if settings.strategy == "mmap":
        return None
    return StreamConfig(**{f.name: getattr(settings, f.name) for f in fields(StreamConfig)})

"""One translation of a run's Settings into the streaming runtime's configuration (runtime/config.py): what an
in-process run sets through the C API and what llama-server reads from its environment are the same object."""

from __future__ import annotations

from dataclasses import fields

import pytest

from flexoffload.runtime import config, server
from flexoffload.runtime.settings import Settings

# a streaming MoE run with every field away from its default, so a field dropped on either side shows
STREAMING = Settings(strategy="stream", window=3, io_threads=5, chunk_bytes=4 << 20, expert_slots=6,
                     expert_policy="lfu", expert_whole=True, expert_ahead=True, expert_lookahead=True,
                     expert_router=False)


def test_every_field_has_its_variable():
    """Each field of the configuration has the variable the patches read it from, and no other field does."""
    assert list(config.VARIABLES) == [f.name for f in fields(config.StreamConfig)]
    assert all(v.startswith("LLAMA_STREAM_") for v in config.VARIABLES.values())
    assert len(set(config.VARIABLES.values())) == len(config.VARIABLES)


def test_in_process_and_server_configurations_are_one(monkeypatch):
    """What StreamConfig.apply sets through native/stream.py and what server.environment gives llama-server, for a
    streaming Settings with experts: equal field by field, both from stream_config(settings)."""
    from flexoffload.native import stream

    applied = {}
    monkeypatch.setattr(stream, "configure", lambda window, io_threads, direct_io=True, chunk_bytes=0:
                        applied.update(window=window, io_threads=io_threads, chunk_bytes=chunk_bytes,
                                       direct_io=direct_io))
    monkeypatch.setattr(stream, "configure_experts", lambda slots, policy="lru", whole=False, ahead=False,
                        lookahead=False, router=True: applied.update(expert_slots=slots, expert_policy=policy,
                                                                     expert_whole=whole, expert_ahead=ahead,
                                                                     expert_lookahead=lookahead, expert_router=router))
    made = config.stream_config(STREAMING)
    made.apply()
    env = server.environment(STREAMING)
    for f in fields(config.StreamConfig):
        own = getattr(STREAMING, f.name)
        assert applied[f.name] == own == getattr(made, f.name), f.name
        # as the patches read it: atoi for numbers and flags, the policy by name
        text = env[config.VARIABLES[f.name]]
        assert (text if f.name == "expert_policy" else int(text)) == own, f.name
    assert applied["direct_io"] is True  # the C API's default, which llama-server's environment leaves too
    assert "LLAMA_STREAM_DIRECT_IO" not in env
    assert {k: v for k, v in env.items() if k.startswith("LLAMA_STREAM_")} == made.environment()


def test_mmap_configures_nothing():
    """A run that streams nothing has no configuration: no LLAMA_STREAM_* variable, nothing set in process."""
    assert config.stream_config(Settings(strategy="mmap")) is None
    assert not any(k.startswith("LLAMA_STREAM_") for k in server.environment(Settings(strategy="mmap")))


class _Applied(Exception):
    pass


def test_the_engine_applies_the_translation(monkeypatch):
    """engine.Engine, loading a streaming run, applies stream_config(settings) before it loads (stopped there)."""
    seen = []

    def apply(self):
        seen.append(self)
        raise _Applied

    monkeypatch.setattr(config.StreamConfig, "apply", apply)
    from flexoffload.runtime.engine import Engine

    with pytest.raises(_Applied):
        Engine("/nonexistent/model.gguf", STREAMING)
    assert seen == [config.stream_config(STREAMING)]

"""What a model's context takes beside its weights, as llama.cpp itself reports it.

A run's memory beside the weights depends on the architecture in ways no formula over a few header fields gets
right: sliding-window layers keep a smaller KV cache, some models keep K and V for only some layers, the compute
graph differs per architecture, the vocabulary's heap grows with its merges and token texts. So the plan asks
llama.cpp: a probe, in a child process, loads the model with every weight streamed (so none is read), makes a
context with exactly the run's settings (engine.context_params), and reads the sizes llama.cpp logs as it
allocates: its KV buffers, its compute buffer and its output buffer. A vocab-only load before that gives the
vocabulary's heap (the growth of the resident set). The result is cached per model file and settings.

The C API has no call for these sizes (llama_get_memory_breakdown is C++ and returns a std::map), so the log is
the public report; its lines are parsed below (to their 0.01 MiB, rounded up) and a probe that finds none of them
is an error, not a zero.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import FlexoffloadError
from .budget import MiB
from .defaults import cache_dir, file_key

# "llama_kv_cache:        CPU KV buffer size =    28.00 MiB" (one line per cache: an ISWA model has two),
# "llama_context:        CPU compute buffer size =    67.01 MiB", "llama_context:        CPU  output buffer size = ..."
_SIZES = {
    "kv_cache": re.compile(r"KV buffer size =\s*([0-9.]+) MiB"),
    "compute": re.compile(r"compute buffer size =\s*([0-9.]+) MiB"),
    "output": re.compile(r"output buffer size =\s*([0-9.]+) MiB"),
}


@dataclass(frozen=True)
class Footprint:
    """Bytes a context takes beside the weights, as llama.cpp allocated them for one model and setting."""
    kv_cache: int  # K and V of every layer that keeps them (sliding-window layers: their window's cells)
    compute: int  # the compute buffer, reserved for a ubatch of n_batch tokens
    output: int  # logits (and embeddings) of n_outputs rows
    vocab: int  # the vocabulary in llama.cpp's heap: token texts, the token map, merges

    @property
    def total(self) -> int:
        return self.kv_cache + self.compute + self.output + self.vocab


def _cache_path(model, n_ctx: int, n_batch: int, n_outputs: int, n_seq_max: int) -> Path:
    key = f"{file_key(model.path)}-c{n_ctx}-b{n_batch}-o{n_outputs}-s{n_seq_max}-v1"
    return cache_dir() / "footprints" / f"{key}.json"


def measure(model, n_ctx: int, n_batch: int, n_outputs: int = 1, n_seq_max: int = 1) -> Footprint:
    """The footprint of a context for model at these settings (cached; probed in a child process)."""
    path = _cache_path(model, n_ctx, n_batch, n_outputs, n_seq_max)
    try:
        return Footprint(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    cmd = [sys.executable, "-m", "flexoffload.footprint", str(model.path), str(n_ctx), str(n_batch), str(n_outputs),
           str(n_seq_max)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise FlexoffloadError(f"llama.cpp's memory probe of {model.path.name} did not finish in 300 s") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise FlexoffloadError(last.removeprefix("flexoffload: "))  # the engine's error names the model
    footprint = Footprint(**json.loads(r.stdout))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.part")
    tmp.write_text(json.dumps(asdict(footprint)))
    tmp.replace(path)
    return footprint


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe(model_path: str, n_ctx: int, n_batch: int, n_outputs: int, n_seq_max: int) -> Footprint:
    """In this process: a vocab-only load, then a context with every weight streamed; the sizes llama.cpp logs."""
    from . import engine

    lib = engine.llama_cpp()
    log = engine._Log(lib, verbose=False, keep=None)
    mparams = lib.llama_model_default_params()
    mparams.vocab_only = True
    before = _rss()
    vocab_model = lib.llama_model_load_from_file(model_path.encode(), mparams)
    if not vocab_model:
        raise FlexoffloadError(f"llama.cpp could not load {model_path}: {log.last_error()}")
    vocab = max(_rss() - before, 0)
    lib.llama_model_free(vocab_model)

    settings = engine.Settings(n_ctx=n_ctx, n_batch=n_batch, n_threads=1, strategy="stream",
                               streamed_patterns=(".*",), window=0, io_threads=1, n_outputs=n_outputs,
                               n_seq_max=n_seq_max)
    log.lines.clear()
    with engine.Engine(model_path, settings, log=log) as eng:
        n_vocab = lib.llama_vocab_n_tokens(eng.vocab)
        sizes = {}
        for name, pattern in _SIZES.items():
            found = [float(m.group(1)) for line in log.lines for m in [pattern.search(line)] if m]
            if not found and name != "kv_cache":  # a model without attention layers keeps no KV cache
                raise FlexoffloadError(f"llama.cpp did not report its {name.replace('_', ' ')} size for {model_path}")
            # logged to 0.01 MiB: each size rounded up to the bound, so the plan never counts less than allocated
            sizes[name] = int(sum(size + 0.005 for size in found) * MiB)
    # the output buffer is made for n_seq_max rows and grows at the first decode that asks for more
    # (llama_context::output_reserve): an f32 logits row of the vocabulary each
    sizes["output"] = max(sizes["output"], 4 * n_vocab * max(n_outputs, n_seq_max))
    return Footprint(vocab=vocab, **sizes)


def main() -> None:
    model_path, *numbers = sys.argv[1:]
    try:
        footprint = probe(model_path, *(int(n) for n in numbers))
    except FlexoffloadError as e:
        print(f"flexoffload: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(asdict(footprint)))


if __name__ == "__main__":
    main()

"""The footprint probe: what a run takes beside its weights, as llama.cpp itself reports it and the process measures it.

A run's memory beside the weights depends on the architecture in ways no formula over a few header fields gets
right: sliding-window layers keep a smaller KV cache, some models keep K and V for only some layers, the compute
graph differs per architecture, the vocabulary's heap grows with its merges and token texts. So the plan asks
llama.cpp: a probe, in a child process that imports what a run imports, loads the model with every weight streamed
(so none is read), makes a context with exactly the run's settings (engine.context_params), and reads the sizes
llama.cpp logs as it allocates: its KV buffers, its compute buffer and its output buffer. The process's own
counters give the rest: its anonymous memory before the model (Python, flexoffload, libllama: the runtime), what
loading the model and making the context added beyond the KV cache (the vocabulary, tensor metadata, the
context's bookkeeping: the heap), and the file pages it maps (its code). The result is cached per model file and
settings.

The C API has no call for these sizes (llama_get_memory_breakdown is C++ and returns a std::map), so the log is
the public report; its lines are parsed below (to their 0.01 MiB, rounded up) and a probe that finds none of them
is an error, not a zero.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, file_key, write_atomic
from flexoffload.memory.budgets import MiB
from flexoffload.memory.footprint import Footprint
from flexoffload.native import process

# The probe's process is a run's: it loads what an enforced run's child (`python -m flexoffload.api`, api/child.py)
# has loaded by the time llama.cpp loads the model (by name, as `python -m` does), so the runtime it measures is a
# run's. (v5: the child runs the parent's Prepared; it no longer prepares)
RUN_MODULES = ("flexoffload.api.child", "flexoffload.plan.planners", "flexoffload.measure.profiler",
               "flexoffload.plan.plans", "flexoffload.speculation.drafters")
PYTHON_ARENA = 1 << 20  # obmalloc's arena (Python 3.10 on)

# "llama_kv_cache:        CPU KV buffer size =    28.00 MiB" (one line per cache: an ISWA model has two),
# "llama_context:        CPU compute buffer size =    67.01 MiB", "llama_context:        CPU  output buffer size = ..."
# "load_tensors:   CPU_REPACK model buffer size =   864.00 MiB": weights llama.cpp loaded into a buffer of its own
# although the probe streams every tensor, because the streamed buffer type does not take their operator (an expert
# tensor's MUL_MAT_ID; a norm's): weights, which a plan counts as resident tensors, not the heap
_LOADED = re.compile(r"load_tensors:\s+(?!STREAMED|CPU_Mapped)(\S+) model buffer size =\s*([0-9.]+) MiB")
_SIZES = {
    "kv_cache": re.compile(r"KV buffer size =\s*([0-9.]+) MiB"),
    "compute": re.compile(r"compute buffer size =\s*([0-9.]+) MiB"),
    "output": re.compile(r"output buffer size =\s*([0-9.]+) MiB"),
}


def _cache_path(model, n_ctx: int, n_batch: int, n_outputs: int, n_seq_max: int) -> Path:
    key = f"{file_key(model.path)}-c{n_ctx}-b{n_batch}-o{n_outputs}-s{n_seq_max}-v5"
    return cache_dir() / "footprints" / f"{key}.json"


def measure(model, n_ctx: int, n_batch: int, n_outputs: int = 1, n_seq_max: int = 1) -> Footprint:
    """The footprint of a context for model at these settings (cached; probed in a child process)."""
    path = _cache_path(model, n_ctx, n_batch, n_outputs, n_seq_max)
    try:
        return Footprint(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    cmd = [sys.executable, "-m", "flexoffload.measure.probe", str(model.path), str(n_ctx), str(n_batch),
           str(n_outputs),
           str(n_seq_max)]
    footprint = Footprint(**child_json(cmd, f"llama.cpp's memory probe of {model.path.name}", 300))
    write_atomic(path, json.dumps(asdict(footprint)))
    return footprint


def child_json(cmd: list[str], what: str, timeout: int) -> dict:
    """The JSON a child process prints (a probe of llama.cpp, which may abort the process); its last stderr line as
    the error if it fails (the engine's errors name the model)."""
    r = process.run(cmd, timeout, what=what)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise FlexoffloadError(last.removeprefix("flexoffload: "))
    return json.loads(r.stdout)


def _code(model_path: str) -> int:
    """The resident file pages this process maps, but the model's (smaps: libraries, Python, its modules)."""
    model = os.path.realpath(model_path)
    total, path = 0, ""
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header: range perms offset dev inode [path]
                fields = line.split()
                path = fields[5] if len(fields) > 5 and fields[5].startswith("/") else ""
            elif first == "Rss:" and path and path != model:
                total += int(line.split()[1]) * 1024
    return total


def probe(model_path: str, n_ctx: int, n_batch: int, n_outputs: int, n_seq_max: int) -> Footprint:
    """In this process: the model with every weight streamed and a context; the sizes llama.cpp logs, and what the
    process's memory grew by."""
    from flexoffload.gguf.model import load
    from flexoffload.memory.budgets import status_bytes
    from flexoffload.runtime import engine

    for name in RUN_MODULES:
        importlib.import_module(name)

    lib = engine.llama_cpp()
    log = engine._Log(lib, verbose=False, keep=None)
    load(model_path)  # a run reads the model's header in Python first (its tensors, for the plan)
    # resident anonymous memory, and what a run's Python allocates after loading (tokens, timings, its result):
    # one more of Python's 1 MiB object arenas (a synthetic qwen2-tiny run's peak rose 0.85 MiB in 1 of 4 runs)
    runtime = status_bytes("RssAnon") + PYTHON_ARENA
    settings = engine.Settings(n_ctx=n_ctx, n_batch=n_batch, n_threads=1, strategy="stream",
                               streamed_patterns=(".*",), window=0, io_threads=1, n_outputs=n_outputs,
                               n_seq_max=n_seq_max)
    with engine.Engine(model_path, settings, log=log) as eng:
        grown = status_bytes("RssAnon") - runtime
        code = _code(model_path)
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
    # llama.cpp clears the KV cache as it makes it (llama_kv_cache::clear), so its pages are in what the load grew
    # by; the compute and output buffers are not touched yet
    loaded = int(sum(float(m.group(2)) for line in log.lines for m in [_LOADED.search(line)] if m) * MiB)
    heap = max(grown - sizes["kv_cache"] - loaded, 0)
    sampling = (12 + 4) * n_vocab
    return Footprint(heap=heap, sampling=sampling, runtime=runtime, code=code, **sizes)


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

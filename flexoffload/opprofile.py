"""Operator profiles: the time of each weight-bearing operator (every MUL_MAT and GET_ROWS of a model, by its
weight tensor) as llama.cpp's scheduler runs it, for a decoded token and for a prompt ubatch (OATO's operator parser).

The scheduler's eval callback (ggml_backend_sched_eval_callback) is asked of every node; answering "yes" to all makes
the scheduler compute the graph one node at a time and synchronize the backend after each, so the time between two
observations is one node's compute (plus, for the first node of a split, the copy of its inputs from the other
backend: a transfer). Each node then also pays a graph launch; the median time of the nodes that compute nothing
(views, reshapes) is that launch, and is taken off. Weights are resident for the profile (mmap, warmed by a first
pass): the profile is of compute, the disk has its own (profile.py).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import time
from dataclasses import asdict, dataclass

from . import FlexoffloadError
from .defaults import cache_dir, file_key

# struct ggml_tensor in the pinned ggml.h: type (4, padded to 8), buffer (8), ne (4 x 8), nb (4 x 8), op (4),
# op_params (64), flags (4), src (10 x 8), ...
_OFFSET_OP = 8 + 8 + 32 + 32
_OFFSET_SRC = _OFFSET_OP + 4 + 64 + 4
NO_COMPUTE = ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")
WEIGHT_OPS = ("MUL_MAT", "GET_ROWS", "MUL_MAT_ID")


@dataclass(frozen=True)
class OpProfile:
    """Seconds each weight tensor's operator takes on the CPU backend (the median over the timed passes)."""
    decode: dict[str, float]  # one decoded token
    prompt: dict[str, float]  # one ubatch of n_batch prompt tokens
    n_batch: int
    launch_s: float  # what one node's graph launch and sync cost (taken off each time above)
    others_decode_s: float  # everything else a decoded token computes (norms, attention, ...), launches taken off

    def to_dict(self) -> dict:
        return asdict(self)


class _Timer:
    def __init__(self, lib_base):
        self.base = lib_base
        self.samples: dict[str, list[float]] = {}
        self.no_compute: list[float] = []
        self.others = 0.0
        self.last = time.perf_counter()

    def reset(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, t, ask, _user_data) -> bool:
        if ask:
            return True
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        op = self.base.ggml_op_name(ctypes.c_int.from_address(t + _OFFSET_OP).value).decode()
        if op in NO_COMPUTE:
            self.no_compute.append(dt)
            return True
        src0 = ctypes.c_void_p.from_address(t + _OFFSET_SRC).value
        name = self.base.ggml_get_name(src0).decode() if src0 else ""
        if op in WEIGHT_OPS and name.endswith(".weight"):
            self.samples.setdefault(name, []).append(dt)
        else:
            self.others += dt
        return True


def measure(model_path: str, n_threads: int, n_batch: int = 64, n_tokens: int = 8) -> OpProfile:
    """Time the operators in this process: a prompt ubatch of n_batch tokens, then n_tokens decoded ones."""
    from . import engine, native

    lib = native.llama_cpp()
    base = ctypes.CDLL(str(native.build_dir() / "libggml-base.so"))
    base.ggml_op_name.argtypes, base.ggml_op_name.restype = [ctypes.c_int], ctypes.c_char_p
    base.ggml_get_name.argtypes, base.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    timer = _Timer(base)
    callback = lib.ggml_backend_sched_eval_callback(timer)
    settings = engine.Settings(n_ctx=max(256, n_batch + n_tokens + 16), n_batch=n_batch, n_threads=n_threads,
                               strategy="mmap", temp=0)
    with engine.Engine(model_path, settings, eval_callback=callback) as eng:
        n_vocab = lib.llama_vocab_n_tokens(eng.vocab)
        prompt = [i % n_vocab for i in range(1, n_batch + 1)]
        eng._decode(prompt)  # warm: every page of the weights read in once
        lib.llama_memory_clear(lib.llama_get_memory(eng.ctx), True)
        timer.samples.clear()
        timer.reset()
        eng._decode(prompt)
        prompt_times = {k: v[-1] for k, v in timer.samples.items()}
        timer.samples.clear()
        timer.no_compute.clear()
        timer.others = 0.0
        for i in range(n_tokens):
            timer.reset()
            eng._decode([(7 * i + 3) % n_vocab])
    if not timer.samples:
        raise FlexoffloadError(f"no weight operator was seen while timing {model_path}")
    launch = statistics.median(timer.no_compute) if timer.no_compute else 0.0
    decode = {k: max(statistics.median(v) - launch, 0.0) for k, v in timer.samples.items()}
    prompt_times = {k: max(v - launch, 0.0) for k, v in prompt_times.items()}
    return OpProfile(decode=decode, prompt=prompt_times, n_batch=n_batch, launch_s=launch,
                     others_decode_s=timer.others / n_tokens)


def cached(model, n_threads: int, n_batch: int = 64, remeasure: bool = False) -> OpProfile:
    """measure() in a child process (a model of its own), cached per model file, threads and batch."""
    import subprocess
    import sys

    path = cache_dir() / "ops" / f"{file_key(model.path)}-t{n_threads}-b{n_batch}-v1.json"
    if path.exists() and not remeasure:
        return OpProfile(**json.loads(path.read_text()))
    r = subprocess.run([sys.executable, "-m", "flexoffload.opprofile", str(model.path), str(n_threads), str(n_batch)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        last = [line for line in r.stderr.splitlines() if line.strip()][-1:] or [f"exit {r.returncode}"]
        raise FlexoffloadError(f"timing the operators of {model.path.name} failed: {last[0]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(r.stdout)
    return OpProfile(**json.loads(r.stdout))


def main() -> None:
    import sys

    model_path, n_threads, n_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    try:
        print(json.dumps(measure(model_path, n_threads, n_batch).to_dict()))
    except FlexoffloadError as e:
        print(f"flexoffload: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

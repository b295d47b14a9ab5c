"""Lower precisions for weight tensors, and the requantized GGUF a choice of them makes (M2Cache, issue 17).

Under a memory budget every streamed byte is disk time, so a tensor given a lower llama.cpp type is speed: fewer
bytes read per token, or room for more resident tensors. This module says which lower types a tensor can take
(`candidates`), checks a choice (`check`: the CPU backend must run the type, the tensor's rows must be whole blocks of
it) and writes the mixed file with the native `llama-quantize` (`requantize`), content-addressed in the cache.

Requantizing an already quantized file loses more than quantizing from the original weights: the first rounding's
error stays and a second one is added on top. The models here ship quantized (Q4_K_M, the original F16 weights are
not reachable), so they are requantized; where the original F16/BF16 file is at hand, pass it as `original`
(`plan --precision auto --original FILE`) and every tensor is quantized from it instead: the plan's tensors to their
types, the rest to the file's own.

An importance matrix (`llama-imatrix` on a calibration text, `imatrix`) weighs the rounding by how much each input
column matters; the lowest types (IQ2_XXS, IQ2_XS, IQ1_*) refuse to quantize without one.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flexoffload import FlexoffloadError, native
from flexoffload.defaults import cache_dir, content_key, file_key
from flexoffload.gguf.model import Model, Tensor

# The lower types a plan may choose, highest precision first. K-quants and IQ types need rows of 256 weights;
# the 32-weight types are for the rest (Qwen2.5-0.5B's 896-wide rows). IQ types are left to --types: the CPU runs
# them more slowly than K-quants of the same size, and a plan should ask for that trade.
LADDER = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K", "Q2_K")
QUANTIZE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class QType:
    name: str
    block: int  # weights per block: a row must be a whole number of them
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / self.block

    def row_bytes(self, n_per_row: int) -> int:
        return n_per_row // self.block * self.block_bytes


def qtype(name: str) -> QType:
    """The ggml type by name (Q4_K, IQ3_S, F16, ...), its block and size; a one-line error if there is none."""
    import gguf

    try:
        t = gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        raise FlexoffloadError(f"{name} is not a ggml type (e.g. {', '.join(LADDER)})") from None
    block, block_bytes = gguf.GGML_QUANT_SIZES[t]
    return QType(t.name, block, block_bytes)


def _type_id(name: str) -> int:
    import gguf

    return int(gguf.GGMLQuantizationType[name])


def cpu_can_run(name: str) -> bool:
    """Whether the CPU backend has a dot product for the type (ggml_get_type_traits_cpu's vec_dot)."""

    class TraitsCpu(ctypes.Structure):  # struct ggml_type_traits_cpu, ggml-cpu.h
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                    ("nrows", ctypes.c_int64)]

    native.llama_cpp()  # loads libggml-cpu.so; this opens the same copy
    cpu = ctypes.CDLL(str(native.build_dir() / "libggml-cpu.so"))
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCpu)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    return bool(cpu.ggml_get_type_traits_cpu(_type_id(qtype(name).name)).contents.vec_dot)


def requires_imatrix(name: str) -> bool:
    """Whether llama.cpp refuses to quantize to the type without an importance matrix."""
    native.llama_cpp()
    base = ctypes.CDLL(str(native.build_dir() / "libggml-base.so"))
    base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    base.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    return bool(base.ggml_quantize_requires_imatrix(_type_id(qtype(name).name)))


def quantizable(t: Tensor) -> bool:
    """The tensors llama-quantize re-types: 2-D weight matrices (norms, biases and 1-D tensors stay as they are)."""
    return len(t.shape) >= 2 and t.name.endswith(".weight") and t.kind not in ("norm", "bias")


def n_rows(t: Tensor) -> int:
    rows = 1
    for d in t.shape[1:]:
        rows *= d
    return rows


def tensor_bytes(t: Tensor, type_name: str) -> int:
    """The tensor's bytes at the type."""
    if type_name == t.type:
        return t.n_bytes
    return n_rows(t) * qtype(type_name).row_bytes(t.shape[0])


def check(t: Tensor, type_name: str, imatrix: Path | None = None) -> str:
    """The type's name if the tensor can take it; otherwise a one-line error naming the tensor and why."""
    q = qtype(type_name)
    if not quantizable(t):
        raise FlexoffloadError(f"{t.name} is not a weight matrix llama-quantize re-types ({t.type}, shape "
                               f"{'x'.join(map(str, t.shape))})")
    if not cpu_can_run(q.name):
        raise FlexoffloadError(f"{q.name} has no dot product in the CPU backend: {t.name} cannot run at it")
    if t.shape[0] % q.block:
        raise FlexoffloadError(f"{t.name} cannot take {q.name}: its rows are {t.shape[0]} weights, not a multiple of "
                               f"{q.name}'s block of {q.block}")
    if imatrix is None and requires_imatrix(q.name):
        raise FlexoffloadError(f"{q.name} needs an importance matrix (llama-imatrix) to quantize {t.name}")
    return q.name


def candidates(t: Tensor, ladder: tuple[str, ...] = LADDER) -> list[str]:
    """The lower types the tensor can take, fewest bits last: those of the ladder with fewer bits per weight than
    its own type whose block divides its rows. Empty for tensors that are not re-typed."""
    if not quantizable(t):
        return []
    own = qtype(t.type).bits_per_weight
    out = []
    for name in ladder:
        q = qtype(name)
        if q.bits_per_weight < own and t.shape[0] % q.block == 0 and q.name != t.type:
            out.append(q.name)
    return sorted(out, key=lambda n: -qtype(n).bits_per_weight)


def validate(model: Model, types: dict[str, str], imatrix: Path | None = None) -> dict[str, str]:
    """A plan's types checked tensor by tensor (names must exist and be weight matrices): {name: type name}."""
    by_name = {t.name: t for t in model.tensors}
    out = {}
    for name, type_name in types.items():
        if name not in by_name:
            raise FlexoffloadError(f"{model.path.name} has no tensor {name}")
        t = by_name[name]
        if type_name.upper() != t.type:
            out[name] = check(t, type_name, imatrix)
    return out


def mixed_bytes(model: Model, types: dict[str, str]) -> int:
    """The weights' bytes with the plan's types."""
    return sum(tensor_bytes(t, types.get(t.name, t.type)) for t in model.tensors)


def _tool_failure(name: str, r: subprocess.CompletedProcess) -> FlexoffloadError:
    lines = [x for x in (r.stderr + r.stdout).splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower() or "failed" in x.lower()]
    why = (errors or lines or [""])[-1]
    return FlexoffloadError(f"{name} failed (exit {r.returncode}): {why.strip()[:200]}")


def run_tool(name: str, args: list[str], timeout: float, n_threads: int | None = None) -> subprocess.CompletedProcess:
    """A llama.cpp tool from the native build; a clear error on failure or when it does not end in time."""
    cmd = [str(native.tool(name))] + args
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           errors="replace")
    except subprocess.TimeoutExpired:
        raise FlexoffloadError(f"{name} did not end in {timeout:.0f} s") from None
    if r.returncode != 0:
        raise _tool_failure(name, r)
    return r


def imatrix(model: Model, text: str, n_ctx: int = 512, n_chunks: int = 0, n_threads: int | None = None,
            timeout: float = 3600) -> Path:
    """The importance matrix of the model on a calibration text (llama-imatrix), cached by file and text."""
    key = content_key(text, str(n_ctx), str(n_chunks))
    out = cache_dir() / "precision" / f"{file_key(model.path)}-imatrix-{key}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        text_file, partial = Path(tmp) / "calibration.txt", Path(tmp) / "imatrix.gguf"
        text_file.write_text(text, encoding="utf-8")
        args = ["-m", str(model.path), "-f", str(text_file), "-o", str(partial), "-c", str(n_ctx),
                "-t", str(n_threads or os.cpu_count() or 1), "--no-ppl", "--output-frequency", "100000"]
        if n_chunks:
            args += ["--chunks", str(n_chunks)]
        run_tool("llama-imatrix", args, timeout)
        if not partial.is_file():
            raise FlexoffloadError("llama-imatrix wrote no importance matrix")
        os.replace(partial, out)
    return out


def mixed_path(model: Model, types: dict[str, str], imatrix_path: Path | None, original: Path | None = None) -> Path:
    """Where the requantized file of a plan's types lives in the cache: named by its inputs."""
    plan = json.dumps(sorted(types.items()))
    src = file_key(original) if original else ""
    im = file_key(imatrix_path) if imatrix_path else ""
    key = content_key(file_key(model.path), src, im, plan, native_key())
    return cache_dir() / "mixed" / f"{model.path.stem}-{key}.gguf"


def native_key() -> str:
    """The native build's name (its key): a new llama-quantize may round differently."""
    return native.build_dir().resolve().parent.parent.name


def _pattern(name: str) -> str:
    """An exact-name pattern for llama-quantize's --tensor-type (a std::regex it searches with)."""
    return "^" + re.escape(name) + "$"


UNQUANTIZED = ("F32", "F16", "BF16")


def check_original(model: Model, original: Path) -> Path:
    """The original (unquantized) weights of the model: every weight matrix of the file, by name and shape, at
    F32/F16/BF16. Otherwise a one-line error naming the first tensor that differs."""
    from flexoffload.gguf.model import load

    by_name = {t.name: t for t in load(original).tensors}
    for t in model.tensors:
        if not quantizable(t):
            continue
        o = by_name.get(t.name)
        if o is None:
            raise FlexoffloadError(f"{original.name} is not the original of {model.path.name}: it has no {t.name}")
        if o.shape != t.shape:
            raise FlexoffloadError(f"{original.name} is not the original of {model.path.name}: {t.name} is "
                                   f"{'x'.join(map(str, o.shape))}, not {'x'.join(map(str, t.shape))}")
        if o.type not in UNQUANTIZED:
            raise FlexoffloadError(f"{original.name} is quantized ({t.name} is {o.type}): the original weights are "
                                   f"{', '.join(UNQUANTIZED)}")
    return original


def requantize(model: Model, types: dict[str, str], imatrix_path: Path | None = None, original: Path | None = None,
               n_threads: int | None = None, timeout: float = QUANTIZE_TIMEOUT_S) -> Path:
    """The GGUF with the plan's types (every other tensor at the file's own type, copied byte for byte), written by
    llama-quantize into the cache under a name of its inputs; an existing one is reused. Written to a temporary
    file first, so a failure never leaves a damaged model behind.

    original: the original (F16/BF16) file of the same model, to quantize from instead of requantizing."""
    types = validate(model, types, imatrix_path)
    if original is not None:
        check_original(model, original)
    out = mixed_path(model, types, imatrix_path, original)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # every weight matrix named, so none takes the target ftype's own choice: the plan's type or the file's
    lines = [f"{_pattern(t.name)}={types.get(t.name, t.type)}" for t in model.tensors if quantizable(t)]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        type_file, partial = Path(tmp) / "types.txt", Path(tmp) / "mixed.gguf"
        type_file.write_text("\n".join(lines) + "\n")
        args = ["--allow-requantize", "--tensor-type-file", str(type_file)]
        if imatrix_path:
            args += ["--imatrix", str(imatrix_path)]
        args += [str(original or model.path), str(partial), "Q4_K_M", str(n_threads or os.cpu_count() or 1)]
        run_tool("llama-quantize", args, timeout)
        os.replace(partial, out)
    return out


# What measure/sensitivity.py measures: each group's harm at each lower type, as the walk (mixed.py) reads it.
@dataclass
class Row:
    group: str
    kind: str
    first: int | None
    last: int | None
    from_type: str
    type: str
    tensors: list[str]
    bytes_saved: int
    kld: float
    kld_err: float
    ppl: float
    same_top: float
    uqest: float
    uqest_delta: float  # against the file's own UQEst on the same prompts
    same_tokens: float  # the share of generated tokens equal to the file's own


@dataclass
class Sensitivity:
    model: str
    n_groups: int
    ladder: list[str]
    base_uqest: float
    base_ppl: float
    rows: list[Row]

    def row(self, group: str, type_name: str) -> Row | None:
        for r in self.rows:
            if r.group == group and r.type == type_name:
                return r
        return None

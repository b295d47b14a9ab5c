"""Lower precisions for weight tensors (M2Cache, issue 17): which a tensor can take, and what a choice of them weighs.

Under a memory budget every streamed byte is disk time, so a tensor given a lower llama.cpp type is speed: fewer
bytes read per token, or room for more resident tensors. This module says which lower types a tensor can take
(`candidates`), checks a choice (`check`: the CPU backend must run the type, the tensor's rows must be whole blocks of
it) and weighs it (`tensor_bytes`, `mixed_bytes`). It starts no process: measure/requantize.py writes the mixed file
and the importance matrix with llama.cpp's tools.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from flexoffload import FlexoffloadError, native
from flexoffload.gguf.model import Model, Tensor

from flexoffload.defaults import LADDER  # the lower types a plan may choose (the options' --types default)


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
    """The type's enum value in ggml (what ggml's C functions take)."""
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
    """The tensor's rows: the product of its dimensions but the first (a row's length)."""
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


UNQUANTIZED = ("F32", "F16", "BF16")  # the types of original (never quantized) weights


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

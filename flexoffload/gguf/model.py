"""The tensor table of a GGUF file: names, layers, kinds, types, sizes and absolute file offsets.

Everything the planners and the budget need to know about a model, read without loading weights.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from flexoffload import FlexoffloadError

GGUF_MAGIC = b"GGUF"

# The kinds a tensor can be, in the order `info` lists them within a layer.
KINDS = (
    "token_embd", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_gate", "ffn_up", "ffn_down", "router", "expert", "norm", "bias", "output", "other",
)

ATTENTION_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN_KINDS = ("ffn_gate", "ffn_up", "ffn_down")

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: str
    layer: int | None  # None for tensors outside the repeating blocks (embeddings, output)
    type: str  # ggml type name: Q4_K, F32, ...
    shape: tuple[int, ...]
    n_bytes: int
    offset: int  # absolute offset of the data in the file


@dataclass
class Model:
    path: Path
    file_size: int
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    tensors: list[Tensor] = field(default_factory=list)
    n_expert: int = 0  # a mixture of experts: experts per layer (0: dense)
    n_expert_used: int = 0  # experts a token routes to per layer

    @property
    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def token_bytes(self, t: Tensor) -> int:
        """The bytes of t one token reads: an expert tensor's routed experts' slices (n_expert_used of its
        n_expert equal slices), any other tensor whole."""
        if t.kind == "expert" and self.n_expert:
            return t.n_bytes // self.n_expert * self.n_expert_used
        return t.n_bytes

    @property
    def routed_bytes(self) -> int:
        """The weights one token reads: every dense tensor, and of each expert tensor the routed experts."""
        return sum(self.token_bytes(t) for t in self.tensors)

    @property
    def tied_embeddings(self) -> bool:
        """Whether the output matrix is token_embd (no output.weight): llama.cpp then uses it twice a pass."""
        return (any(t.kind == "token_embd" for t in self.tensors)
                and not any(t.kind == "output" for t in self.tensors))

    def layer_tensors(self, layer: int | None) -> list[Tensor]:
        return [t for t in self.tensors if t.layer == layer]

    def layer_bytes(self, layer: int) -> int:
        return sum(t.n_bytes for t in self.tensors if t.layer == layer)


def tensor_kind(name: str) -> tuple[str, int | None]:
    """The kind and layer of a tensor, from llama.cpp's naming (blk.N.attn_q.weight, output.weight, ...)."""
    m = _LAYER.match(name)
    layer = int(m.group(1)) if m else None
    rest = m.group(2) if m else name
    if rest.endswith(".bias"):
        return "bias", layer
    base = rest.removesuffix(".weight")
    if "norm" in base:
        return "norm", layer
    if base in KINDS:
        return base, layer
    if base.endswith("_exps"):  # ffn_{gate,up,down}_exps, ffn_gate_up_exps: one slice an expert
        return "expert", layer
    if base.removesuffix("_shexp") in FFN_KINDS:  # a shared expert: a dense FFN every token uses
        return base.removesuffix("_shexp"), layer
    if base == "ffn_gate_inp":  # the router's matrix
        return "router", layer
    if base == "attn_qkv":
        return "attn_q", layer
    return "other", layer


def load(path: str | os.PathLike) -> Model:
    """Read and check a GGUF file's header and tensor table.

    Raises FlexoffloadError for a missing file, a file that is not GGUF, or one whose tensor data runs
    past the end of the file (truncated).
    """
    path = Path(path)
    if not path.exists():
        raise FlexoffloadError(f"model file not found: {path}")
    if not path.is_file():
        raise FlexoffloadError(f"model path is not a file: {path}")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise FlexoffloadError(f"not a GGUF file (bad magic {magic!r}): {path}")

    try:
        with open(path, "rb") as f:
            header = _read_header(f)
    except (EOFError, struct.error, UnicodeDecodeError, ValueError) as e:
        raise FlexoffloadError(f"GGUF file is damaged or truncated ({e}): {path}") from None
    kv = header.kv

    def field_value(key: str, default=None):
        return kv.get(key, default)

    arch = field_value("general.architecture", "unknown")
    tensors = []
    for name, shape, type_name, n_bytes, rel_offset in header.tensors:
        kind, layer = tensor_kind(name)
        offset = header.data_offset + rel_offset
        if offset + n_bytes > file_size:
            raise FlexoffloadError(
                f"GGUF file is truncated: tensor {name} ends at byte {offset + n_bytes}, "
                f"the file has {file_size}: {path}"
            )
        tensors.append(Tensor(name, kind, layer, type_name, shape, n_bytes, offset))
    if not tensors:
        raise FlexoffloadError(f"GGUF file has no tensors: {path}")

    n_expert = int(field_value(f"{arch}.expert_count", 0) or 0)
    n_expert_used = int(field_value(f"{arch}.expert_used_count", 0) or 0)
    n_embd = int(field_value(f"{arch}.embedding_length", 0) or 0)
    _check_experts(path, tensors, n_expert, n_expert_used, n_embd)
    n_head = int(field_value(f"{arch}.attention.head_count", 1) or 1)
    token_embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    n_vocab = token_embd.shape[1] if token_embd is not None and len(token_embd.shape) > 1 else 0
    return Model(
        path=path,
        file_size=file_size,
        arch=arch,
        name=field_value("general.name", path.stem),
        n_layer=int(field_value(f"{arch}.block_count", 0) or 0),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(field_value(f"{arch}.attention.head_count_kv", n_head) or n_head),
        n_ff=int(field_value(f"{arch}.feed_forward_length", 0) or 0),
        n_vocab=n_vocab,
        n_ctx_train=int(field_value(f"{arch}.context_length", 0) or 0),
        tensors=tensors,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
    )


def _check_experts(path: Path, tensors: list[Tensor], n_expert: int, n_expert_used: int, n_embd: int) -> None:
    """A mixture of experts the header and the tensors agree on: a token routes to at most every expert, each
    expert tensor is n_expert equal slices (ggml's ne[2]), so an expert is one contiguous read, and each layer with
    experts has its router, an n_embd x n_expert matrix (what llama.cpp's loader would refuse only once loading)."""
    experts = [t for t in tensors if t.kind == "expert"]
    if not experts:
        return
    if n_expert < 1 or not 0 < n_expert_used <= n_expert:
        raise FlexoffloadError(f"{path.name} has expert tensors, but routes to {n_expert_used} of {n_expert} experts "
                               f"a token: expert_used_count must be between 1 and expert_count")
    for t in experts:
        if len(t.shape) != 3 or t.shape[2] != n_expert or t.n_bytes % n_expert:
            raise FlexoffloadError(f"{path.name}: expert tensor {t.name} (shape {'x'.join(map(str, t.shape))}) is not "
                                   f"{n_expert} equal slices, one an expert")
    routers = {t.layer: t for t in tensors if t.kind == "router"}
    for layer in sorted({t.layer for t in experts}):
        r = routers.get(layer)
        if r is None:
            raise FlexoffloadError(f"{path.name}: layer {layer} has expert tensors but no router (ffn_gate_inp)")
        if len(r.shape) != 2 or r.shape[1] != n_expert or (n_embd and r.shape[0] != n_embd):
            raise FlexoffloadError(f"{path.name}: router {r.name} has shape {'x'.join(map(str, r.shape))}, not "
                                   f"{n_embd or 'n_embd'}x{n_expert} (the embedding by the experts)")


# --- a GGUF header reader ---------------------------------------------------------------------
# gguf's GGUFReader builds a numpy view per array element: on the 1.5B Qwen (152k tokens, 151k merges) it took 6.4
# and 7.5 s with gguf 0.19.0, where this reader took 0.10 s (2026-11-25, this machine). It reads scalars and skips
# arrays, which is all the tensor table needs; the gguf package still gives the type sizes.

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass
class _Header:
    kv: dict
    tensors: list  # (name, shape, type name, n_bytes, offset relative to the data section)
    data_offset: int


def metadata(path: str | os.PathLike, arrays: frozenset[str] = frozenset()) -> dict:
    """A GGUF's key-value metadata: the scalars, and of the arrays those named (the others None)."""
    with open(path, "rb") as f:
        return _read_header(f, arrays).kv


def _read_header(f, arrays: frozenset[str] = frozenset()) -> _Header:
    """The header; arrays: the keys whose arrays are read (as lists), the others' are skipped (None)."""
    def read(n: int) -> bytes:
        b = f.read(n)
        if len(b) != n:
            raise EOFError("the header ends early")
        return b

    def unpack(fmt: str):
        return struct.unpack("<" + fmt, read(struct.calcsize("<" + fmt)))[0]

    def string() -> str:
        return read(unpack("Q")).decode("utf-8")

    def value(vtype: int, keep: bool = False):
        if vtype in _SCALARS:
            return unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            item_type, n = unpack("I"), unpack("Q")
            if keep and item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                return list(struct.unpack(f"<{n}{fmt}", read(n * struct.calcsize("<" + fmt))))
            if keep:
                return [value(item_type) for _ in range(n)]
            if item_type in _SCALARS:  # fixed-size items: skip them in one seek
                f.seek(n * struct.calcsize("<" + _SCALARS[item_type]), os.SEEK_CUR)
            elif item_type == _STRING:  # skip each string by its length, without decoding it
                for _ in range(n):
                    f.seek(unpack("Q"), os.SEEK_CUR)
            else:
                for _ in range(n):
                    value(item_type)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    read(4)  # magic, checked by the caller
    version = unpack("I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = unpack("Q"), unpack("Q")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(unpack("I"), key in arrays)
    tensors = []
    for _ in range(n_tensors):
        name = string()
        shape = tuple(unpack("Q") for _ in range(unpack("I")))
        ggml_type = GGMLQuantizationType(unpack("I"))
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = 1
        for d in shape:
            n_elements *= d
        tensors.append((name, shape, ggml_type.name, n_elements // block * type_size, unpack("Q")))
    alignment = kv.get("general.alignment", 32)
    data_offset = -(-f.tell() // alignment) * alignment
    return _Header(kv, tensors, data_offset)

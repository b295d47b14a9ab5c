"""A dense qwen2 GGUF rewritten as a glm4moe mixture of experts, from a given split of each FFN's neurons (MoEfication,
Zhang et al. 2022; measure/coactivation.py makes the split from real text). A constructed test bed, not a real MoE.

Why glm4moe (GLM-4.5's architecture in the pinned llama.cpp, src/models/glm4-moe.cpp): its attention is qwen2's
(separate q/k/v with optional biases, NEOX rope over the whole head when no rope.dimension_count says otherwise, no
q/k norm when none is given, the same scale), so every non-FFN tensor is copied byte for byte (ffn_norm under its
name there, post_attention_norm). Its FFN, through build_moe_ffn with sigmoid gating, is

    out = w_scale * sum over the k chosen e of sigmoid(router_e . x) * down_e(silu(gate_e x) * up_e x)  +  shared(x)

with the k chosen by the largest sigmoid (plus exp_probs_b, zero here), the weights not renormalized over the k
(expert_weights_norm false), and the shared expert added ungated. The others were worse fits: qwen2moe gates its
shared expert by sigmoid(g . x) computed as silu(z) / z, which is 0/0 at g = 0 and not a constant otherwise, and its
softmax weights make the down scale depend on n_expert; llama (Mixtral's layout) ropes in NORM order (q/k rows
permuted) and renormalizes over the k chosen (a down scale that depends on k); qwen3moe adds q/k norms.

So a neuron split reproduces the dense FFN on the chosen neurons: the router's logits are tiny (ROUTER_SCALE times
scores within +-1), every sigmoid is 1/2 to within ROUTER_SCALE / 4, w_scale is 2, so a chosen expert counts once
for any k, while the top-k order (sigmoid is monotonic) is the scores' order. All experts used: the dense FFN.

Gate and up rows are whole rows of the dense matrices (a row is its own run of quant blocks), copied as stored, in
the experts' order. ffn_down splits each row by neurons, so it is dequantized and written in down_type (Q8_0:
gguf.quants cannot write the K-quants); an expert's width must be whole blocks of down_type (32 for Q8_0 and Q4_0),
the shared expert's a whole number of experts' widths (glm4moe sizes it as expert_shared_count experts).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flexoffload import FlexoffloadError

if TYPE_CHECKING:
    import numpy as np

ARCH = "glm4moe"
SOURCE_ARCH = "qwen2"
ROUTER_SCALE = 1 / 512  # router scores (within +-1) to logits: each sigmoid within 0.1 % of 1/2
WEIGHTS_SCALE = 2.0  # expert_weights_scale: a chosen expert's weight, 2 * sigmoid(~0), is 1
DOWN_TYPES = ("Q8_0", "Q4_0", "F16", "F32")
_FFN = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight$")
_FFN_NORM = re.compile(r"blk\.(\d+)\.ffn_norm\.weight$")


@dataclass(frozen=True)
class LayerSplit:
    """One layer's FFN neurons as a shared expert and n_expert routed ones, with the router's scores."""
    shared: np.ndarray  # (n_shared,) neuron indices: the shared expert, read by every token
    experts: np.ndarray  # (n_expert, n_ff_expert) neuron indices, one row an expert
    router: np.ndarray  # (n_expert, n_embd): an expert's score is router @ x, within +-1 on real inputs

    @property
    def n_expert(self) -> int:
        return self.experts.shape[0]


def expert_tensors(il: int) -> list[str]:
    """The FFN tensors of layer il in the written file, in their order there."""
    return [f"blk.{il}.ffn_gate_inp.weight", f"blk.{il}.exp_probs_b.bias"] + [
        f"blk.{il}.{n}.weight" for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                                          "ffn_up_shexp", "ffn_down_shexp")]


def _check(splits: list[LayerSplit], n_layer: int, n_ff: int, n_embd: int, n_expert_used: int, block: int) -> None:
    import numpy as np

    if len(splits) != n_layer:
        raise FlexoffloadError(f"{len(splits)} layer splits for a model of {n_layer} layers")
    first = splits[0]
    for il, s in enumerate(splits):
        if s.experts.shape != first.experts.shape or s.shared.shape != first.shared.shape:
            raise FlexoffloadError(f"layer {il}: every layer must have the same experts and shared width")
        if s.router.shape != (s.n_expert, n_embd):
            raise FlexoffloadError(f"layer {il}: the router is {s.router.shape}, not ({s.n_expert}, {n_embd})")
        neurons = np.concatenate([s.shared.ravel(), s.experts.ravel()])
        if neurons.size != n_ff or not np.array_equal(np.sort(neurons), np.arange(n_ff)):
            raise FlexoffloadError(f"layer {il}: the shared expert and the experts must hold each of the {n_ff} "
                                   "neurons once")
    width, n_shared = first.experts.shape[1], first.shared.size
    if width % block or n_shared % width or not n_shared:
        raise FlexoffloadError(f"an expert's width ({width}) must be whole blocks of {block} neurons, and the shared "
                               f"expert's ({n_shared}) a whole number of experts' widths, not none")
    if not 0 < n_expert_used <= first.n_expert:
        raise FlexoffloadError(f"experts used per token must be between 1 and {first.n_expert}, not {n_expert_used}")


def write(src: str | os.PathLike, dst: str | os.PathLike, splits: list[LayerSplit], n_expert_used: int,
          down_type: str = "Q8_0", name: str = "") -> Path:
    """Write the dense qwen2 GGUF at src as a glm4moe GGUF at dst (atomically: a part file renamed), its FFNs split
    as splits say (one per layer), n_expert_used experts a token by default (llama.cpp's
    --override-kv glm4moe.expert_used_count=int:K changes it at load). Every other tensor is copied as stored."""
    import gguf
    import numpy as np

    if down_type not in DOWN_TYPES:
        raise FlexoffloadError(f"the experts' ffn_down type must be one of {', '.join(DOWN_TYPES)}, not {down_type}")
    qdown = gguf.GGMLQuantizationType[down_type]
    block = gguf.GGML_QUANT_SIZES[qdown][0]
    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    if arch != SOURCE_ARCH:
        raise FlexoffloadError(f"{src.name} is {arch}: only a dense {SOURCE_ARCH} model is made into experts")
    tensors = {t.name: t for t in reader.tensors}

    def hparam(key: str) -> int:
        return int(reader.fields[f"{SOURCE_ARCH}.{key}"].contents())

    n_layer, n_ff, n_embd = hparam("block_count"), hparam("feed_forward_length"), hparam("embedding_length")
    _check(splits, n_layer, n_ff, n_embd, n_expert_used, block)
    n_expert, width, n_shared = splits[0].n_expert, splits[0].experts.shape[1], splits[0].shared.size

    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(tmp, ARCH)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "general.name":
            value = name or f"{value} MoEfied (constructed test bed)"
        if key.startswith(SOURCE_ARCH + "."):
            key = ARCH + key[len(SOURCE_ARCH):]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(width)
    w.add_expert_shared_count(n_shared // width)
    w.add_leading_dense_block_count(0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_norm(False)
    w.add_expert_weights_scale(WEIGHTS_SCALE)

    # the tensor table first (shapes and sizes), then the data in the same order, one tensor in memory at a time
    plan: list[tuple[str, object]] = []  # (name in the file, the source tensor or the layer of an FFN tensor)
    for t in reader.tensors:
        m = _FFN.match(t.name)
        if m is None:
            norm = _FFN_NORM.match(t.name)
            plan.append((f"blk.{norm.group(1)}.post_attention_norm.weight" if norm else t.name, t))
        elif m.group(2) == "gate":  # the layer's MoE set where its dense FFN began
            plan += [(n, int(m.group(1))) for n in expert_tensors(int(m.group(1)))]

    def info(name: str, shape: tuple, qtype) -> None:
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.dtype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
            w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
        else:
            size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // size * nbytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)

    f32 = gguf.GGMLQuantizationType.F32
    for name, how in plan:
        if not isinstance(how, int):
            info(name, tuple(reversed([int(d) for d in how.shape])), how.tensor_type)
            continue
        kind = name.split(".")[2]
        gate_type = tensors[f"blk.{how}.ffn_gate.weight"].tensor_type
        up_type = tensors[f"blk.{how}.ffn_up.weight"].tensor_type
        info(name, *{
            "ffn_gate_inp": ((n_expert, n_embd), f32),
            "exp_probs_b": ((n_expert,), f32),
            "ffn_gate_exps": ((n_expert, width, n_embd), gate_type),
            "ffn_up_exps": ((n_expert, width, n_embd), up_type),
            "ffn_down_exps": ((n_expert, n_embd, width), qdown),
            "ffn_gate_shexp": ((n_shared, n_embd), gate_type),
            "ffn_up_shexp": ((n_shared, n_embd), up_type),
            "ffn_down_shexp": ((n_embd, n_shared), qdown),
        }[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    down: tuple[int, np.ndarray] | None = None  # the layer whose ffn_down is dequantized, (n_embd, n_ff)
    for name, how in plan:
        if not isinstance(how, int):
            w.write_tensor_data(how.data)
            continue
        il, kind, s = how, name.split(".")[2], splits[how]
        if kind.startswith("ffn_down") and (down is None or down[0] != il):
            d = tensors[f"blk.{il}.ffn_down.weight"]
            down = (il, gguf.quants.dequantize(d.data, d.tensor_type).astype(np.float32))
        if kind == "ffn_gate_inp":
            data = np.asarray(s.router, dtype=np.float32) * np.float32(ROUTER_SCALE)
        elif kind == "exp_probs_b":
            data = np.zeros(n_expert, dtype=np.float32)
        elif kind in ("ffn_gate_exps", "ffn_up_exps"):
            rows = tensors[f"blk.{il}.{kind.removesuffix('_exps')}.weight"].data
            data = np.ascontiguousarray(rows[s.experts.ravel()]).reshape(n_expert, width, -1)
        elif kind in ("ffn_gate_shexp", "ffn_up_shexp"):
            rows = tensors[f"blk.{il}.{kind.removesuffix('_shexp')}.weight"].data
            data = np.ascontiguousarray(rows[s.shared])
        elif kind == "ffn_down_exps":  # (n_embd, n_expert, width) -> one (n_embd, width) slice an expert
            cols = down[1][:, s.experts.ravel()].reshape(n_embd, n_expert, width)
            data = gguf.quants.quantize(np.ascontiguousarray(cols.transpose(1, 0, 2)), qdown)
        else:  # ffn_down_shexp
            data = gguf.quants.quantize(np.ascontiguousarray(down[1][:, s.shared]), qdown)
        w.write_tensor_data(data)
        del data
    w.close()
    os.replace(tmp, dst)
    return dst


def used(path: str | os.PathLike) -> int:
    """The experts a token routes to, as the file says (glm4moe.expert_used_count)."""
    import gguf

    return int(gguf.GGUFReader(path).fields[f"{ARCH}.expert_used_count"].contents())


def override_used(n_expert_used: int) -> list[str]:
    """The llama.cpp tools' arguments that load a glm4moe file routing to n_expert_used experts a token."""
    return ["--override-kv", f"{ARCH}.expert_used_count=int:{n_expert_used}"]


def with_used(src: str | os.PathLike, n_expert_used: int, dst: str | os.PathLike | None = None) -> Path:
    """A copy of the glm4moe file at src that routes each token to n_expert_used experts (default: beside src, named
    <stem>-k<n>.gguf), made once: the header's expert_used_count is the only byte that differs. A copy, not a load-time
    override, so every tool (llama-completion, the planner, a saved plan) sees the same file."""
    import shutil

    import gguf

    src = Path(src)
    dst = Path(dst) if dst else src.with_name(f"{src.stem}-k{n_expert_used}.gguf")
    reader = gguf.GGUFReader(src)
    if reader.fields["general.architecture"].contents() != ARCH:
        raise FlexoffloadError(f"{src.name} is not a {ARCH} file of experts")
    n_expert = int(reader.fields[f"{ARCH}.expert_count"].contents())
    if not 0 < n_expert_used <= n_expert:
        raise FlexoffloadError(f"experts used per token must be between 1 and {n_expert}, not {n_expert_used}")
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and used(dst) == n_expert_used:
        return dst
    tmp = dst.with_name(dst.name + ".part")
    shutil.copyfile(src, tmp)
    copy = gguf.GGUFReader(tmp, "r+")
    field = copy.fields[f"{ARCH}.expert_used_count"]
    field.parts[field.data[0]][0] = n_expert_used
    copy.data.flush()
    del copy, field
    os.replace(tmp, dst)
    return dst

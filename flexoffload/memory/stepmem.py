"""The memory of a prefill's and a decode's steps (HyperGen's per-step estimate, on llama.cpp's graph): issue 16.

HyperGen's Table 1 sizes each step of a prefill from the layer's shapes: QKV, the attention scores (s x s a head),
the softmax, the attention output, the MLP. llama.cpp on a CPU already splits a prefill the way HyperGen's partition
does: a forward pass computes one ubatch of u tokens, and flash attention tiles the scores over the KV cells with an
online softmax (ggml-cpu/ops.cpp), so the s^2 term is u x n_kv and only the mask holds it (f16). What a context
holds is allocated when it is made, for the worst step:
- the KV cache, n_ctx cells, cleared (so charged) as it is made;
- the compute buffer, the graph's tensors for a ubatch of u tokens over all n_ctx cells (llama_context::
  sched_reserve), the one buffer every step of every layer reuses;
- the output buffer (n_outputs logits rows);
- the CPU backend's work buffer, grown to the largest node's scratch (ggml-cpu.cpp; not in llama.cpp's report): a
  matrix multiplication converts its input to the weight's dot type (Q8_K for the K-quants: 292 bytes a 256 values),
  and without flash attention the scores are converted to f16 for the product with V.

measure/dryrun.py's `buffers` asks llama.cpp for the first three without allocating anything: a child loads the
model with no_alloc (metadata only, nothing read) and makes one context per setting, reading the sizes it logs
(footprint.py's parsing); one child answers many settings, and the answers are cached. `work_bytes` adds the fourth
from the graph's shapes. `steps` breaks a ubatch down HyperGen's way, for the report: what each step adds and what
it leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexoffload.gguf.model import Model

# ggml's dot types: the block a matrix multiplication converts its f32 input to, by the weight's type (bytes, values)
_Q8_K = (292, 256)
_Q8_0 = (34, 32)
DOT_TYPE = {"Q2_K": _Q8_K, "Q3_K": _Q8_K, "Q4_K": _Q8_K, "Q5_K": _Q8_K, "Q6_K": _Q8_K, "IQ4_XS": _Q8_K,
            "Q4_0": _Q8_0, "Q4_1": (36, 32), "Q5_0": _Q8_0, "Q5_1": (36, 32), "Q8_0": _Q8_0, "IQ4_NL": _Q8_0,
            "F16": (2, 1), "BF16": (2, 1), "F32": (0, 1)}


@dataclass(frozen=True)
class Setting:
    """One context: its cells, ubatch, attention path, KV cache types and logits rows."""

    n_ctx: int
    n_ubatch: int
    flash_attn: str = "on"
    type_k: str = "f16"
    type_v: str = "f16"
    n_outputs: int = 1

    def key(self) -> str:
        return f"c{self.n_ctx}-u{self.n_ubatch}-{self.flash_attn}-{self.type_k}-{self.type_v}-o{self.n_outputs}"


@dataclass(frozen=True)
class Buffers:
    """What llama.cpp allocates for a context (bytes), as it reports it, and the CPU backend's work buffer."""

    kv_cache: int
    compute: int
    output: int
    work: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.compute + self.output + self.work


def work_bytes(model: Model, n_ubatch: int, n_kv: int, flash_attn: bool) -> int:
    """The CPU backend's work buffer: the largest scratch a node of the ubatch's graph asks for (ggml_graph_plan):
    a weight's matrix multiplication converts its u input rows to the weight's dot type; without flash attention,
    the product of the scores with V converts the scores (n_kv x u a head) to f16."""
    largest = 0
    for t in model.tensors:
        if len(t.shape) == 2 and t.kind not in ("token_embd", "norm", "bias"):
            block, values = DOT_TYPE.get(t.type, _Q8_K)
            largest = max(largest, -(-t.shape[0] * n_ubatch // values) * block)
    if not flash_attn:
        largest = max(largest, 2 * n_kv * n_ubatch * model.n_head)
    return largest


def steps(model: Model, n_ubatch: int, n_kv: int, flash_attn: bool) -> list[dict]:
    """HyperGen's Table 1 for one ubatch of a layer, in bytes (f32 activations): what each step holds at its peak
    and what it leaves for the next (the weights are llama.cpp's, resident or streamed: not counted here)."""
    u, e, ekv = n_ubatch, model.n_embd, model.n_embd * model.n_head_kv // max(model.n_head, 1)
    x = 4 * u * e
    qkv = 4 * u * (e + 2 * ekv)
    mask = (2 if flash_attn else 4) * n_kv * u
    scores = 0 if flash_attn else 4 * n_kv * u * model.n_head  # flash attention never holds them: 64 x 64 tiles
    mlp = 4 * u * 2 * model.n_ff
    return [
        {"step": "QKV", "peak": x + qkv, "retained": x + qkv},
        {"step": "attention scores", "peak": x + qkv + mask + scores, "retained": x + qkv + mask + scores},
        {"step": "softmax", "peak": x + qkv + mask + scores, "retained": x + mask + scores},  # in place
        {"step": "attention output", "peak": x + mask + scores + 4 * u * e, "retained": x},
        {"step": "MLP", "peak": x + mlp + 4 * u * e, "retained": x},
    ]


UBATCHES = (32, 64, 128, 256, 512, 1024, 2048)  # the ubatch sizes a prefill plan chooses among
CELLS = 256  # llama.cpp pads the KV cache to this many cells


def cells_for(n_tokens: int) -> int:
    """The context a prompt and its generation need, padded as llama.cpp pads the cache."""
    return -(-n_tokens // CELLS) * CELLS

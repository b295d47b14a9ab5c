"""Synthetic GGUF models of any shape, written with the gguf package: random weights, real shapes.

Their text is noise, their timing is real. Five architectures as llama.cpp loads them: llama, qwen2 (q/k/v biases),
gemma3 (tied embeddings, q/k norms, post-attention and post-FFN norms, sliding-window layers), phi3 (fused attn_qkv,
gate and up fused in ffn_up), and two mixtures of experts: llama with experts (Mixtral's layout: a router,
ffn_gate_inp, and ffn_{gate,up,down}_exps, one contiguous slice per expert) and qwen3moe (q/k norms, many small
experts of their own width). Random weights do not route uniformly: as measured (docs/experts.md), after the first
layers nearly every token goes to the same 4-11 experts, so a small expert cache hits almost always and these files
show a cache near its best case, not its worst. Every one gets the same small SentencePiece-style vocabulary (byte
tokens plus filler pieces), so llama.cpp loads, tokenizes and generates with it; the output weights of the control
and byte tokens are zero (token_embd's rows where the embeddings are tied), so greedy text is whole pieces, valid
UTF-8. Tensor data is written one tensor at a time, so a 7B-shaped file never has to fit in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

ARCHS = ("llama", "qwen2", "gemma3", "phi3", "qwen3moe")
ALIGNMENT = 32  # GGUF's default: each tensor's data starts on a multiple of it
N_SPECIAL = 259  # <unk>, <s>, </s> and the 256 byte tokens: the first rows of the vocabulary


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ctx_train: int = 4096
    arch: str = "llama"
    head_dim: int = 0  # 0: n_embd // n_head; gemma3's heads are wider than that (1B: 4 x 256 over 1152)
    sliding_window: int = 0  # gemma3: the window of its sliding layers (5 of every 6, llama.cpp's default)
    tied_embeddings: bool = False  # no output.weight: llama.cpp multiplies by token_embd instead
    rope_freq_base: float = 0.0  # 0: not written, llama.cpp's default (10000)
    n_expert: int = 0  # a mixture of experts: experts per layer (0: a dense FFN)
    n_expert_used: int = 0  # experts a token routes to per layer
    n_ff_expert: int = 0  # an expert's FFN width (qwen3moe's expert_feed_forward_length; 0: n_ff)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}, not {self.arch}")
        if self.n_expert and self.arch not in ("llama", "qwen3moe"):
            raise ValueError("experts are written for llama (Mixtral's layout) and qwen3moe")
        if self.arch == "qwen3moe" and not self.n_expert:
            raise ValueError("qwen3moe is a mixture of experts: give n_expert")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError("n_expert_used must be between 1 and n_expert")

    @property
    def expert_width(self) -> int:
        return self.n_ff_expert or self.n_ff

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


TINY = Shape(n_layer=3, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=512)
LLAMA2_7B = Shape(n_layer=32, n_embd=4096, n_ff=11008, n_head=32, n_head_kv=32, n_vocab=32000)

# Per architecture a tiny shape for unit tests and a realistic one (0.3-4 GB at Q4_0) for memory and timing.
SHAPES: dict[str, Shape] = {
    "tiny": TINY,
    "llama2-7b": LLAMA2_7B,
    "llama-gqa-tiny": Shape(n_layer=3, n_embd=128, n_ff=256, n_head=8, n_head_kv=1, n_vocab=384, n_ctx_train=512),
    # Llama 3.2 3B's width, FFN, depth and vocabulary, with 32 heads over 4 KV heads (8:1; its own are 24 over 8)
    "llama-gqa-3b": Shape(n_layer=28, n_embd=3072, n_ff=8192, n_head=32, n_head_kv=4, n_vocab=128256,
                          n_ctx_train=8192, rope_freq_base=500000.0),
    "qwen2-tiny": Shape(n_layer=3, n_embd=128, n_ff=256, n_head=8, n_head_kv=2, n_vocab=384, n_ctx_train=512,
                        arch="qwen2", tied_embeddings=True, rope_freq_base=1000000.0),
    # Qwen2.5-1.5B: tied embeddings, as its config has them
    "qwen2-1.5b": Shape(n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, n_vocab=151936,
                        n_ctx_train=32768, arch="qwen2", tied_embeddings=True, rope_freq_base=1000000.0),
    # 6 layers: 5 sliding and 1 global, as in gemma3's pattern; the window is shorter than a test's few tokens
    "gemma3-tiny": Shape(n_layer=6, n_embd=64, n_ff=128, n_head=4, n_head_kv=1, n_vocab=384, n_ctx_train=512,
                         arch="gemma3", head_dim=32, sliding_window=8, tied_embeddings=True,
                         rope_freq_base=1000000.0),
    # gemma3's 256k vocabulary on a small model: the embeddings dominate, as they do in the 270M and 1B
    "gemma3-tiny-256k": Shape(n_layer=6, n_embd=256, n_ff=512, n_head=4, n_head_kv=1, n_vocab=262144,
                              n_ctx_train=4096, arch="gemma3", head_dim=64, sliding_window=512,
                              tied_embeddings=True, rope_freq_base=1000000.0),
    "gemma3-1b": Shape(n_layer=26, n_embd=1152, n_ff=6912, n_head=4, n_head_kv=1, n_vocab=262144, n_ctx_train=32768,
                       arch="gemma3", head_dim=256, sliding_window=512, tied_embeddings=True,
                       rope_freq_base=1000000.0),
    "phi3-tiny": Shape(n_layer=3, n_embd=128, n_ff=256, n_head=4, n_head_kv=4, n_vocab=384, n_ctx_train=512,
                       arch="phi3"),
    # Phi-3-mini-4k
    # Mixtral's layout at a small size (the MoE issue's model: 924 MiB at Q4_0), and a tiny one for tests
    "llama-moe-tiny": Shape(n_layer=2, n_embd=128, n_ff=128, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=512,
                            n_expert=8, n_expert_used=2),
    "llama-moe-1b": Shape(n_layer=16, n_embd=1024, n_ff=1024, n_head=16, n_head_kv=4, n_vocab=32000,
                          n_ctx_train=4096, n_expert=32, n_expert_used=4),
    # Qwen3-30B-A3B's pattern (128 small experts, 8 used, q/k norms) at a small size
    "qwen3moe-tiny": Shape(n_layer=2, n_embd=128, n_ff=384, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=512,
                           arch="qwen3moe", head_dim=32, n_expert=16, n_expert_used=4, n_ff_expert=64),
    "qwen3moe-2b": Shape(n_layer=24, n_embd=1024, n_ff=3072, n_head=16, n_head_kv=4, n_vocab=32000,
                         n_ctx_train=4096, arch="qwen3moe", head_dim=64, n_expert=128, n_expert_used=8,
                         n_ff_expert=256),
    "phi3-mini": Shape(n_layer=32, n_embd=3072, n_ff=8192, n_head=32, n_head_kv=32, n_vocab=32064,
                       arch="phi3"),
}


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then filler pieces up to n_vocab."""
    import gguf

    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        piece = "\u2581" + letters[i % 26] + (letters[(i // 26) % 26] if i >= 26 else "") + (str(i // 676) if i >= 676 else "")
        tokens.append(piece)
        types.append(T.NORMAL)
        i += 1
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(k) for k in range(len(tokens) - 259)]
    return tokens[:n_vocab], scores[:n_vocab], [int(t) for t in types[:n_vocab]]


def _tensor_plan(s: Shape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, (rows, cols)) in numpy order, i.e. ggml's (ne1, ne0) reversed, in the order they are written.

    Only the tensors llama.cpp's loader for the architecture creates: any other makes it refuse the file."""
    q_dim = s.n_embd_head * s.n_head
    kv_dim = s.n_embd_head * s.n_head_kv
    plan = [("token_embd.weight", (s.n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        plan.append((f"blk.{i}.attn_norm.weight", (s.n_embd,)))
        if s.arch == "phi3":
            plan.append((f"blk.{i}.attn_qkv.weight", (q_dim + 2 * kv_dim, s.n_embd)))
        else:
            plan += [
                (f"blk.{i}.attn_q.weight", (q_dim, s.n_embd)),
                (f"blk.{i}.attn_k.weight", (kv_dim, s.n_embd)),
                (f"blk.{i}.attn_v.weight", (kv_dim, s.n_embd)),
            ]
        if s.arch == "qwen2":
            plan += [
                (f"blk.{i}.attn_q.bias", (q_dim,)),
                (f"blk.{i}.attn_k.bias", (kv_dim,)),
                (f"blk.{i}.attn_v.bias", (kv_dim,)),
            ]
        if s.arch in ("gemma3", "qwen3moe"):  # RMS norms over each head's q and k
            plan += [
                (f"blk.{i}.attn_q_norm.weight", (s.n_embd_head,)),
                (f"blk.{i}.attn_k_norm.weight", (s.n_embd_head,)),
            ]
        plan.append((f"blk.{i}.attn_output.weight", (s.n_embd, q_dim)))
        if s.arch == "gemma3":
            plan.append((f"blk.{i}.post_attention_norm.weight", (s.n_embd,)))
        plan.append((f"blk.{i}.ffn_norm.weight", (s.n_embd,)))
        if s.n_expert:  # the router, then each matrix's experts, one (rows, cols) slice an expert
            plan += [
                (f"blk.{i}.ffn_gate_inp.weight", (s.n_expert, s.n_embd)),
                (f"blk.{i}.ffn_gate_exps.weight", (s.n_expert, s.expert_width, s.n_embd)),
                (f"blk.{i}.ffn_up_exps.weight", (s.n_expert, s.expert_width, s.n_embd)),
                (f"blk.{i}.ffn_down_exps.weight", (s.n_expert, s.n_embd, s.expert_width)),
            ]
        elif s.arch == "phi3":  # gate and up in one matrix, gate rows first
            plan.append((f"blk.{i}.ffn_up.weight", (2 * s.n_ff, s.n_embd)))
        else:
            plan += [
                (f"blk.{i}.ffn_gate.weight", (s.n_ff, s.n_embd)),
                (f"blk.{i}.ffn_up.weight", (s.n_ff, s.n_embd)),
            ]
        if not s.n_expert:
            plan.append((f"blk.{i}.ffn_down.weight", (s.n_embd, s.n_ff)))
        if s.arch == "gemma3":
            plan.append((f"blk.{i}.post_ffw_norm.weight", (s.n_embd,)))
    plan.append(("output_norm.weight", (s.n_embd,)))
    if not s.tied_embeddings:
        plan.append(("output.weight", (s.n_vocab, s.n_embd)))
    return plan


def _output_name(s: Shape) -> str:
    """The matrix that makes the logits: token_embd where the embeddings are tied."""
    return "token_embd.weight" if s.tied_embeddings else "output.weight"


def _is_quantized(name: str, dims: tuple[int, ...], qtype: str) -> bool:
    # norms, biases and the router stay F32 (as convert_hf_to_gguf keeps ffn_gate_inp)
    return len(dims) >= 2 and qtype == "Q4_0" and "ffn_gate_inp" not in name


def _data_bytes(name: str, dims: tuple[int, ...], qtype: str) -> int:
    if _is_quantized(name, dims, qtype):
        return math.prod(dims) // 32 * 18
    return math.prod(dims) * 4


def predicted_size(shape: Shape, qtype: str = "Q4_0") -> int:
    """The size of the file write() makes, without writing it, to within a kilobyte: the tensor data and the
    header's vocabulary and tensor table exactly, the rest of the metadata (under 1 KB) as an allowance."""
    plan = _tensor_plan(shape)
    header = 4 + 4 + 8 + 8  # magic, version, tensor count, key-value count
    tokens, _, _ = _vocab(shape.n_vocab)
    array_head = 8 + 32 + 4 + 4 + 8  # key length, a key of about 32 bytes, value type, item type, item count
    header += array_head + sum(8 + len(t.encode("utf-8")) for t in tokens)  # tokenizer.ggml.tokens
    header += 2 * (array_head + 4 * shape.n_vocab)  # scores (f32) and token types (i32)
    header += 640  # the scalar metadata
    for name, dims in plan:
        header += 8 + len(name) + 4 + 8 * len(dims) + 4 + 8  # name, n_dims, dims, type, offset
    data = 0
    for name, dims in plan:
        data += -(-_data_bytes(name, dims, qtype) // ALIGNMENT) * ALIGNMENT
    return -(-header // ALIGNMENT) * ALIGNMENT + data


def _q4_0(rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random Q4_0 blocks (f16 scale + 16 bytes of nibbles per 32 weights) with small, finite scales."""
    import numpy as np

    n_blocks = rows * cols // 32
    blocks = np.empty((n_blocks, 18), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, n_blocks) * scale
    blocks[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 18)


def _add_hparams(w, shape: Shape) -> None:
    """The architecture's hyperparameters, as convert_hf_to_gguf writes them for it."""
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    if shape.arch in ("gemma3", "qwen3moe"):  # its head width is not n_embd / n_head, and it ropes the whole head
        w.add_key_length(shape.n_embd_head)
        w.add_value_length(shape.n_embd_head)
    else:
        w.add_rope_dimension_count(shape.n_embd_head)
    if shape.rope_freq_base:
        w.add_rope_freq_base(shape.rope_freq_base)
    if shape.sliding_window:
        w.add_sliding_window(shape.sliding_window)
    w.add_layer_norm_rms_eps(1e-6 if shape.arch in ("qwen2", "gemma3", "qwen3moe") else 1e-5)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
        if shape.n_ff_expert:
            w.add_expert_feed_forward_length(shape.n_ff_expert)


def write(path: str | Path, shape: Shape = TINY, qtype: str = "Q4_0", seed: int = 0,
          output_seed: int | None = None, output_scale: float = 1.0) -> Path:
    """Write a GGUF of the shape's architecture at path. qtype: Q4_0 or F32 for the 2-D weights; norms and biases
    are F32.

    output_seed: draw the output matrix from its own seed, so that a model with fewer layers from the same seeds
    shares embeddings, first layers and output with a deeper one (a draft that often agrees with its target).
    output_scale: multiplies the output matrix, so logits spread and the next token is not near uniform.
    With tied embeddings the output matrix is token_embd, and both apply to it."""
    import gguf
    import numpy as np

    if qtype not in ("Q4_0", "F32"):
        raise ValueError(f"qtype must be Q4_0 or F32, not {qtype}")
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), shape.arch)
    # llama.cpp gives a model whose name says "phi3" Phi-3's special tokens (<|endoftext|>), which this vocabulary
    # lacks, and refuses it
    name_arch = "phi-three" if shape.arch == "phi3" else shape.arch
    w.add_name(f"synthetic-{name_arch}-{shape.n_layer}x{shape.n_embd}-{qtype}")
    _add_hparams(w, shape)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if qtype == "Q4_0" else gguf.LlamaFileType.ALL_F32)
    tokens, scores, types = _vocab(shape.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)

    plan = _tensor_plan(shape)
    for name, dims in plan:
        if _is_quantized(name, dims, qtype):
            w.add_tensor_info(name, (*dims[:-1], dims[-1] // 32 * 18), np.dtype(np.uint8),
                              _data_bytes(name, dims, qtype), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor_info(name, dims, np.dtype(np.float32), _data_bytes(name, dims, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    output_name = _output_name(shape)
    for name, dims in plan:
        if name.endswith(".bias"):
            data = rng.normal(0, 0.05, dims).astype(np.float32)
        elif len(dims) == 1:  # norms: ones (gemma's are stored with its +1 already added, so ones there too)
            data = np.ones(dims, dtype=np.float32)
        else:
            r = np.random.default_rng(output_seed) if name == output_name and output_seed is not None else rng
            scale = output_scale if name == output_name else 1.0
            if qtype == "F32" or not _is_quantized(name, dims, qtype):
                data = r.normal(0, 0.05 * scale, dims).astype(np.float32)
            else:  # a matrix, or an expert tensor's slices (one expert's rows after another's)
                data = _q4_0(math.prod(dims[:-1]), dims[-1], r, scale).reshape(*dims[:-1], dims[-1] // 32 * 18)
        if name == output_name:  # zero logits for <unk>, <s>, </s> and bytes: the noise is whole pieces
            data[:N_SPECIAL] = 0
        w.write_tensor_data(data)
        del data  # before the next tensor is made: one tensor in memory at a time
    w.close()
    return path

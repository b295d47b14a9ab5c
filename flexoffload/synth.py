"""Synthetic GGUF models of any shape, written with the gguf package: random weights, real shapes.

Their text is noise, their timing is real. A llama-architecture model with a small SentencePiece-style
vocabulary (byte tokens plus filler pieces), so llama.cpp loads, tokenizes and generates with it; the
output weights of the control and byte tokens are zero, so greedy text is whole pieces, valid UTF-8. Tensor
data is written one tensor at a time, so a 7B-shaped file never has to fit in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ctx_train: int = 4096


TINY = Shape(n_layer=3, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=512)
LLAMA2_7B = Shape(n_layer=32, n_embd=4096, n_ff=11008, n_head=32, n_head_kv=32, n_vocab=32000)


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
    """(name, (rows, cols)) in numpy order, i.e. ggml's (ne1, ne0) reversed."""
    kv = s.n_embd // s.n_head * s.n_head_kv
    plan = [("token_embd.weight", (s.n_vocab, s.n_embd))]
    for i in range(s.n_layer):
        plan += [
            (f"blk.{i}.attn_norm.weight", (s.n_embd,)),
            (f"blk.{i}.attn_q.weight", (s.n_embd, s.n_embd)),
            (f"blk.{i}.attn_k.weight", (kv, s.n_embd)),
            (f"blk.{i}.attn_v.weight", (kv, s.n_embd)),
            (f"blk.{i}.attn_output.weight", (s.n_embd, s.n_embd)),
            (f"blk.{i}.ffn_norm.weight", (s.n_embd,)),
            (f"blk.{i}.ffn_gate.weight", (s.n_ff, s.n_embd)),
            (f"blk.{i}.ffn_up.weight", (s.n_ff, s.n_embd)),
            (f"blk.{i}.ffn_down.weight", (s.n_embd, s.n_ff)),
        ]
    plan += [("output_norm.weight", (s.n_embd,)), ("output.weight", (s.n_vocab, s.n_embd))]
    return plan


def _q4_0(rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random Q4_0 blocks (f16 scale + 16 bytes of nibbles per 32 weights) with small, finite scales."""
    n_blocks = rows * cols // 32
    blocks = np.empty((n_blocks, 18), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, n_blocks) * scale
    blocks[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 18)


def write(path: str | Path, shape: Shape = TINY, qtype: str = "Q4_0", seed: int = 0,
          output_seed: int | None = None, output_scale: float = 1.0) -> Path:
    """Write a llama-shaped GGUF at path. qtype: Q4_0 or F32 for the 2-D weights; norms are F32.

    output_seed: draw the output matrix from its own seed, so that a model with fewer layers from the same seeds
    shares embeddings, first layers and output with a deeper one (a draft that often agrees with its target).
    output_scale: multiplies the output matrix, so logits spread and the next token is not near uniform."""
    import gguf

    if qtype not in ("Q4_0", "F32"):
        raise ValueError(f"qtype must be Q4_0 or F32, not {qtype}")
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic-llama-{shape.n_layer}x{shape.n_embd}-{qtype}")
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.n_embd // shape.n_head)
    w.add_layer_norm_rms_eps(1e-5)
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
        if len(dims) == 1 or qtype == "F32":
            n = int(np.prod(dims))
            w.add_tensor_info(name, dims, np.dtype(np.float32), n * 4)
        else:
            rows, cols = dims
            w.add_tensor_info(name, (rows, cols // 32 * 18), np.dtype(np.uint8), rows * cols // 32 * 18,
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, dims in plan:
        if len(dims) == 1:
            data = np.ones(dims, dtype=np.float32)
        else:
            r = np.random.default_rng(output_seed) if name == "output.weight" and output_seed is not None else rng
            scale = output_scale if name == "output.weight" else 1.0
            data = (r.normal(0, 0.05 * scale, dims).astype(np.float32) if qtype == "F32"
                    else _q4_0(dims[0], dims[1], r, scale))
        if name == "output.weight":  # zero logits for <unk>, <s>, </s> and bytes: the noise is whole pieces
            data[:259] = 0
        w.write_tensor_data(data)
    w.close()
    return path

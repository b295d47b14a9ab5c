"""Synthetic GGUF models of any shape, written with the gguf package: random weights, real shapes.

Their text is noise, their timing is real. Five architectures as llama.cpp loads them: llama, qwen2 (q/k/v biases),
gemma3 (tied embeddings, q/k norms, post-attention and post-FFN norms, sliding-window layers), phi3 (fused attn_qkv,
gate and up fused in ffn_up), and three mixtures of experts: llama with experts (Mixtral's layout: a router,
ffn_gate_inp, and ffn_{gate,up,down}_exps, one contiguous slice per expert), qwen3moe (q/k norms, many small
experts of their own width) and gpt-oss (attention sinks and biases, sliding-window attention on every other layer,
biased router and experts, MXFP4 experts).

Routing (write's `routing`):
- "random": the router reads the whole residual stream with random weights. Random weights do not route uniformly:
  as measured (docs/experts.md), after the first layers nearly every token goes to the same 4-11 experts, so a small
  expert cache hits almost always: these files show a cache at its best case, not its worst.
- "text": the routers read only the last ROUTE_DIMS dimensions of the residual stream, which only the token
  embedding writes (every output projection's rows there are zero), so each layer routes a token by the token
  alone, as trained routers largely do (OpenMoE's context-independent specialization). With a real model's
  vocabulary (write's `tokenizer`) those dimensions hold that model's own embedding of the token, centred and
  randomly projected, so tokens the real model places near each other (the words of one passage, of one topic)
  route to overlapping experts: a real prompt routes with real token statistics and with the locality they bring
  (docs/experts.md measures it against published figures), and a stream of uniformly random tokens routes
  uniformly at random (the pessimistic bound). Without one, each token's code is random.

The vocabulary is a small SentencePiece-style one (byte tokens plus filler pieces) or, with write's `tokenizer`, a
real model's (its tokens, types and merges, padded with unused tokens up to the shape's n_vocab), so real text
tokenizes as it would for that model. Either way the output weights of every token that is not a whole, valid
UTF-8 piece (control and byte tokens, unused ones) are zero (token_embd's rows where the embeddings are tied), so
greedy text is whole pieces, valid UTF-8. Tensor data is written one tensor at a time, so a 17 GB file never has to
fit in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# the vocabularies live in vocab.py; synth.copied_vocab and synth._vocab stay reachable here (tests patch _vocab)
from flexoffload.gguf.blocks import BLOCK, mxfp4, q4_0, q4_0_of, q8_0, q8_0_of
from flexoffload.gguf.vocab import _add_vocab, _vocab, _vocab_header_bytes, copied_vocab  # noqa: F401

if TYPE_CHECKING:
    import numpy as np

ARCHS = ("llama", "qwen2", "gemma3", "phi3", "qwen3moe", "gpt-oss")
MOE_ARCHS = ("qwen3moe", "gpt-oss")  # mixtures of experts only
ROUTINGS = ("random", "text")
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
        if self.n_expert and self.arch not in ("llama", *MOE_ARCHS):
            raise ValueError("experts are written for llama (Mixtral's layout), qwen3moe and gpt-oss")
        if self.arch in MOE_ARCHS and not self.n_expert:
            raise ValueError(f"{self.arch} is a mixture of experts: give n_expert")
        if self.arch == "gpt-oss" and not self.sliding_window:
            raise ValueError("gpt-oss has sliding-window layers: give sliding_window")
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
    # Qwen2.5-7B's (untied, 28 heads over 4 KV heads) with the 1.5B's vocabulary of 151,936 (its own is padded to
    # 152,064), so that the real 0.5B drafts for it: a realistic pair (scripts/spec_replay)
    "qwen2-7b": Shape(n_layer=28, n_embd=3584, n_ff=18944, n_head=28, n_head_kv=4, n_vocab=151936,
                      n_ctx_train=32768, arch="qwen2", rope_freq_base=1000000.0),
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
    # Qwen3-30B-A3B's published config (about 17 GB at Q4_0); its vocabulary is Qwen2.5's (write's tokenizer)
    "qwen3moe-30b-a3b": Shape(n_layer=48, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4, n_vocab=151936,
                              n_ctx_train=32768, arch="qwen3moe", head_dim=128, rope_freq_base=1000000.0,
                              n_expert=128, n_expert_used=8, n_ff_expert=768),
    # gpt-oss-20b's: sliding window 128 on every other layer, 32 experts of 2880, MXFP4 experts (about 12 GB)
    "gpt-oss-20b": Shape(n_layer=24, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, n_vocab=201088,
                         n_ctx_train=131072, arch="gpt-oss", head_dim=64, sliding_window=128,
                         rope_freq_base=150000.0, n_expert=32, n_expert_used=4, n_ff_expert=2880),
    # gpt-oss-120b's: gpt-oss-20b's layers, 36 of them, with 128 experts (about 63 GB with --qtype Q8_0, as published)
    "gpt-oss-120b": Shape(n_layer=36, n_embd=2880, n_ff=2880, n_head=64, n_head_kv=8, n_vocab=201088,
                          n_ctx_train=131072, arch="gpt-oss", head_dim=64, sliding_window=128,
                          rope_freq_base=150000.0, n_expert=128, n_expert_used=4, n_ff_expert=2880),
    "gpt-oss-tiny": Shape(n_layer=2, n_embd=128, n_ff=128, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=512,
                          arch="gpt-oss", head_dim=32, sliding_window=8, n_expert=8, n_expert_used=2,
                          n_ff_expert=64),
}
ROUTE_DIMS = 64  # the residual stream's dimensions "text" routing keeps for the token (32 below 512 wide)


def route_dims(n_embd: int) -> int:
    """The width of "text" routing's dimensions, the last of the residual stream."""
    return ROUTE_DIMS if n_embd >= 512 else 32


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
        if s.arch in ("qwen2", "gpt-oss"):
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
        if s.arch == "gpt-oss":  # an output bias and a sink logit a head; the post-attention norm is the FFN's
            plan += [(f"blk.{i}.attn_output.bias", (s.n_embd,)), (f"blk.{i}.attn_sinks.weight", (s.n_head,))]
        if s.arch in ("gemma3", "gpt-oss"):
            plan.append((f"blk.{i}.post_attention_norm.weight", (s.n_embd,)))
        if s.arch != "gpt-oss":
            plan.append((f"blk.{i}.ffn_norm.weight", (s.n_embd,)))
        if s.n_expert:  # the router, then each matrix's experts, one (rows, cols) slice an expert
            plan += [
                (f"blk.{i}.ffn_gate_inp.weight", (s.n_expert, s.n_embd)),
                (f"blk.{i}.ffn_gate_exps.weight", (s.n_expert, s.expert_width, s.n_embd)),
                (f"blk.{i}.ffn_up_exps.weight", (s.n_expert, s.expert_width, s.n_embd)),
                (f"blk.{i}.ffn_down_exps.weight", (s.n_expert, s.n_embd, s.expert_width)),
            ]
            if s.arch == "gpt-oss":  # the router's and every expert's biases
                plan += [
                    (f"blk.{i}.ffn_gate_inp.bias", (s.n_expert,)),
                    (f"blk.{i}.ffn_gate_exps.bias", (s.n_expert, s.expert_width)),
                    (f"blk.{i}.ffn_up_exps.bias", (s.n_expert, s.expert_width)),
                    (f"blk.{i}.ffn_down_exps.bias", (s.n_expert, s.n_embd)),
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


def _tensor_type(shape: Shape, name: str, dims: tuple[int, ...], qtype: str) -> str:
    """F32 for norms, biases, sinks and the router (as convert_hf_to_gguf keeps ffn_gate_inp); gpt-oss's experts
    MXFP4 (as published); every other matrix qtype."""
    if qtype == "F32" or len(dims) < 2 or name.endswith(".bias") or "ffn_gate_inp" in name:
        return "F32"
    return "MXFP4" if shape.arch == "gpt-oss" and "_exps" in name else qtype


QTYPES = ("Q4_0", "Q8_0", "F32")  # write's qtype: the 2-D weights' type


def _data_bytes(shape: Shape, name: str, dims: tuple[int, ...], qtype: str) -> int:
    t = _tensor_type(shape, name, dims, qtype)
    return math.prod(dims) // 32 * BLOCK[t] if t in BLOCK else math.prod(dims) * 4


def predicted_size(shape: Shape, qtype: str = "Q4_0", tokenizer: str | Path | None = None) -> int:
    """The size of the file write() makes, without writing it, to within a kilobyte: the tensor data and the
    header's vocabulary and tensor table exactly, the rest of the metadata (under 1 KB) as an allowance."""
    plan = _tensor_plan(shape)
    header = 4 + 4 + 8 + 8  # magic, version, tensor count, key-value count
    vocab = copied_vocab(tokenizer, shape.n_vocab) if tokenizer else _vocab(shape.n_vocab)
    header += _vocab_header_bytes(vocab)
    header += 640  # the scalar metadata
    for name, dims in plan:
        header += 8 + len(name) + 4 + 8 * len(dims) + 4 + 8  # name, n_dims, dims, type, offset
    data = 0
    for name, dims in plan:
        data += -(-_data_bytes(shape, name, dims, qtype) // ALIGNMENT) * ALIGNMENT
    return -(-header // ALIGNMENT) * ALIGNMENT + data


def _route_codes(tokenizer: str | Path, n_vocab: int, route: slice, rng: np.random.Generator) -> np.ndarray:
    """Each token's code for "text" routing: the tokenizer model's embedding of it, centred on the mean over its
    vocabulary and projected at random onto the route's dimensions, scaled to the embedding's other weights (a Q4_0
    weight's typical size); random for the padding beyond its vocabulary."""
    import gguf
    import numpy as np

    from flexoffload import FlexoffloadError

    embd = next((t for t in gguf.GGUFReader(str(tokenizer)).tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise FlexoffloadError(f"{tokenizer} has no token_embd to route by")
    real = gguf.quants.dequantize(embd.data, embd.tensor_type)
    real -= real[:min(len(real), n_vocab)].mean(axis=0)
    width = route.stop - route.start
    codes = rng.normal(0, 1, (n_vocab, width)).astype(np.float32)
    n = min(len(real), n_vocab)
    codes[:n] = real[:n] @ rng.normal(0, 1, (real.shape[1], width)).astype(np.float32)
    return codes / codes[:n].std() * 0.04


def _add_hparams(w, shape: Shape) -> None:
    """The architecture's hyperparameters, as convert_hf_to_gguf writes them for it."""
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    if shape.arch in ("gemma3", *MOE_ARCHS):  # its head width is not n_embd / n_head, and it ropes the whole head
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
          output_seed: int | None = None, output_scale: float = 1.0, routing: str = "random",
          tokenizer: str | Path | None = None, progress=None) -> Path:
    """Write a GGUF of the shape's architecture at path. qtype: Q4_0, Q8_0 or F32 for the 2-D weights (gpt-oss's
    experts MXFP4 where it is not F32); norms and biases are F32.

    output_seed: draw the output matrix from its own seed, so that a model with fewer layers from the same seeds
    shares embeddings, first layers and output with a deeper one (a draft that often agrees with its target).
    output_scale: multiplies the output matrix, so logits spread and the next token is not near uniform.
    With tied embeddings the output matrix is token_embd, and both apply to it.
    routing: "random" or "text" (the module's docstring). tokenizer: a GGUF whose vocabulary to copy.
    progress: called after each tensor with the data bytes written so far and in all."""
    import gguf
    import numpy as np

    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {', '.join(QTYPES)}, not {qtype}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing}")
    if routing == "text" and not shape.n_expert:
        raise ValueError("text routing is for a mixture of experts")
    path = Path(path)
    rng = np.random.default_rng(seed)
    vocab = copied_vocab(tokenizer, shape.n_vocab) if tokenizer else _vocab(shape.n_vocab)
    w = gguf.GGUFWriter(str(path), shape.arch)
    # llama.cpp gives a model whose name says "phi3" Phi-3's special tokens (<|endoftext|>), which this vocabulary
    # lacks, and refuses it
    name_arch = "phi-three" if shape.arch == "phi3" else shape.arch
    w.add_name(f"synthetic-{name_arch}-{shape.n_layer}x{shape.n_embd}-{qtype}" + ("-text" if routing == "text" else ""))
    _add_hparams(w, shape)
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "F32": gguf.LlamaFileType.ALL_F32}[qtype])
    _add_vocab(w, vocab)

    plan = _tensor_plan(shape)
    for name, dims in plan:
        t = _tensor_type(shape, name, dims, qtype)
        if t in BLOCK:
            w.add_tensor_info(name, (*dims[:-1], dims[-1] // 32 * BLOCK[t]), np.dtype(np.uint8),
                              _data_bytes(shape, name, dims, qtype), raw_dtype=gguf.GGMLQuantizationType[t])
        else:
            w.add_tensor_info(name, dims, np.dtype(np.float32), _data_bytes(shape, name, dims, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    output_name = _output_name(shape)
    silent = np.array(vocab.silent())
    # "text" routing: the token's dimensions, which only the embedding writes and only the routers read
    route = slice(shape.n_embd - route_dims(shape.n_embd), shape.n_embd)
    total, done = sum(_data_bytes(shape, name, dims, qtype) for name, dims in plan), 0
    for name, dims in plan:
        t = _tensor_type(shape, name, dims, qtype)
        if name.endswith(".bias") or name.endswith("attn_sinks.weight"):
            data = rng.normal(0, 0.05, dims).astype(np.float32)
        elif len(dims) == 1:  # norms: ones (gemma's are stored with its +1 already added, so ones there too)
            data = np.ones(dims, dtype=np.float32)
        else:
            r = np.random.default_rng(output_seed) if name == output_name and output_seed is not None else rng
            scale = output_scale if name == output_name else 1.0
            if t == "F32":
                data = r.normal(0, 0.05 * scale, dims).astype(np.float32)
            else:  # a matrix, or an expert tensor's slices (one expert's rows after another's)
                blocks = {"MXFP4": lambda rows, cols, g, _: mxfp4(rows, cols, g), "Q4_0": q4_0, "Q8_0": q8_0}[t]
                make = lambda rows, cols, g: blocks(rows, cols, g, scale)  # noqa: E731
                data = make(math.prod(dims[:-1]), dims[-1], r).reshape(*dims[:-1], dims[-1] // 32 * BLOCK[t])
        if name == output_name:  # zero logits for control, byte and unused tokens: the noise is whole pieces
            data[silent] = 0
        if routing == "text" and name == "token_embd.weight" and tokenizer:
            codes = _route_codes(tokenizer, shape.n_vocab, route, rng)
            if t == "F32":
                data[:, route] = codes
            else:
                data[:, route.start // 32 * BLOCK[t]:] = (q8_0_of if t == "Q8_0" else q4_0_of)(codes)
        if routing == "text":
            _keep_route(name, data, route)
        w.write_tensor_data(data)
        del data  # before the next tensor is made: one tensor in memory at a time
        done += _data_bytes(shape, name, dims, qtype)
        if progress:
            progress(done, total)
    w.close()
    return path


def _keep_route(name: str, data, route: slice) -> None:
    """"text" routing: nothing but the embedding writes the route's dimensions (all-zero blocks are zeros in Q4_0
    and MXFP4 alike) and the routers read nothing else."""
    if name.endswith(("attn_output.weight", "attn_output.bias")):
        data[route] = 0
    elif name.endswith(("ffn_down_exps.weight", "ffn_down_exps.bias")):
        data[:, route] = 0
    elif name.endswith("ffn_gate_inp.weight"):
        keep = data[:, route].copy()
        data[:] = 0
        data[:, route] = keep
    elif name.endswith("ffn_gate_inp.bias"):
        data[:] = 0

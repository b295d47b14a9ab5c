"""FlexInfer's flexible tensor preservation (Algorithm 1 of the paper), as written.

The algorithm, with size_FFN and size_attn one FFN and one attention tensor and N layers:
  if mem >= size_FFN*N*3 + size_attn*N*2: keep all FFN tensors of all layers
  elif mem >= size_FFN*N*2: keep two FFN tensors of all layers
  elif mem >= size_FFN*N: keep one FFN tensor of all layers
  then keep as many attention tensors as possible, one by one.

Taken as written, with these readings where a real model is less regular than the paper's sizes:
- "mem >= X" is "X fits": in the memory left after the rules every policy shares (small tensors, token_embd and
  output, which the paper also keeps in memory), with the prefetch window the plan then needs.
- A "FFN tensor of all layers" is one FFN kind across all layers, at its real bytes (Q4_K_M mixes types per
  layer); kinds are taken smallest total first, so "two FFN tensors" are the two smallest kinds. "size_attn*N*2"
  is two attention tensors per layer: the two smallest attention kinds not already resident (with GQA, K and V,
  as the paper's footnote prefers; on Qwen2.5-1.5B these are small and resident anyway, so it is Q and output).
- "One by one": attention tensors individually, kind by kind (smallest kind first), layers in order, each one
  that still fits. The algorithm then stops: memory left after the attention tensors is not given to the FFN
  tensors that missed their threshold. So between "all FFN" and "all FFN + half attention" only two FFN kinds are
  kept, and memory can go unused; layer tensors of other kinds stay streamed.
"""

from __future__ import annotations

from flexoffload.gguf.model import Model
from flexoffload.plan.costmodel import Profile
from flexoffload.gguf.model import ATTENTION_KINDS, FFN_KINDS
from flexoffload.plan.planners.common import base, by_kind, layer_pool


def plan(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    ledger = base(model, capacity, window)
    pool = layer_pool(model, ledger.resident)
    ffn, attention = by_kind(pool, FFN_KINDS), by_kind(pool, ATTENTION_KINDS)
    half_attention = [t for kind in attention[:2] for t in kind]
    if ledger.fits([t for kind in ffn for t in kind] + half_attention):
        n_ffn = len(ffn)
    else:
        n_ffn = max(j for j in range(len(ffn) or 1) if ledger.fits([t for kind in ffn[:j] for t in kind]))
    ledger.add(t for kind in ffn[:n_ffn] for t in kind)
    return ledger.take(t for kind in attention for t in kind).resident

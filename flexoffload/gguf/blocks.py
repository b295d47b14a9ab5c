"""Quantized blocks for synthetic weights: random ones of a type (Q4_0, Q8_0, MXFP4) and given values rounded
as ggml rounds them (Q4_0, Q8_0). synth.py writes tensors of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

BLOCK = {"Q4_0": 18, "Q8_0": 34, "MXFP4": 17}  # bytes per block of 32 weights


def q4_0(rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random Q4_0 blocks (f16 scale + 16 bytes of nibbles per 32 weights) with small, finite scales."""
    import numpy as np

    n_blocks = rows * cols // 32
    blocks = np.empty((n_blocks, 18), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, n_blocks) * scale
    blocks[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 18)


def q8_0(rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Random Q8_0 blocks (f16 scale + 32 signed bytes per 32 weights) with small, finite scales: the same spread of
    weights as q4_0's."""
    import numpy as np

    n_blocks = rows * cols // 32
    blocks = np.empty((n_blocks, 34), dtype=np.uint8)
    scales = rng.uniform(0.002, 0.02, n_blocks) * scale / 16  # int8 steps: 8 / 128 of a Q4_0 step
    blocks[:, :2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(0, 256, (n_blocks, 32), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 34)


def mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random MXFP4 blocks (an E8M0 exponent + 16 bytes of FP4 pairs per 32 weights) scaled about as Q4_0's."""
    import numpy as np

    n_blocks = rows * cols // 32
    blocks = np.empty((n_blocks, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(118, 122, n_blocks, dtype=np.uint8)  # 2^-10 .. 2^-7 times the table's -12 .. 12
    blocks[:, 1:] = rng.integers(0, 256, (n_blocks, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // 32 * 17)


def q4_0_of(values: np.ndarray) -> np.ndarray:
    """values (rows x a multiple of 32) as Q4_0 blocks, rounded as ggml's quantize_row_q4_0_ref does."""
    import numpy as np

    rows, cols = values.shape
    x = values.reshape(rows, cols // 32, 32).astype(np.float32)
    peak = np.take_along_axis(x, np.abs(x).argmax(axis=2)[..., None], axis=2)  # the signed value of largest size
    d = peak / -8
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, (x * inv + 8.5).astype(np.int8)).astype(np.uint8)
    blocks = np.empty((rows, cols // 32, 18), dtype=np.uint8)
    blocks[..., :2] = d.astype(np.float16).view(np.uint8)
    blocks[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return blocks.reshape(rows, cols // 32 * 18)


def q8_0_of(values: np.ndarray) -> np.ndarray:
    """values (rows x a multiple of 32) as Q8_0 blocks, rounded as ggml's quantize_row_q8_0_ref does."""
    import numpy as np

    rows, cols = values.shape
    x = values.reshape(rows, cols // 32, 32).astype(np.float32)
    d = np.abs(x).max(axis=2, keepdims=True) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.round(x * inv).astype(np.int8)
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = d.astype(np.float16).view(np.uint8)
    blocks[..., 2:] = q.view(np.uint8)
    return blocks.reshape(rows, cols // 32 * 34)

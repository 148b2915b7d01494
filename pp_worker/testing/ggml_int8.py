"""A numpy model of ggml's integer scheme for products with quantized weights: x quantized per block to int8 as
ggml's CPU backend does (``quantize_row_q8_K_ref`` for the 256-value types, ``quantize_row_q8_0_ref`` for the 32-value
ones), each block's product with the weights summed over those ints, then scaled by the block's d.

The weights' values are the `gguf` package's dequantization (d s q - dmin m, exact in float64 up to its float32
rounding), so ``product`` is the integer sums ggml takes, combined in float64: what the C kernels' integer path
(``cpu/c/q8.h``, ``matmul_int.c``) must give up to the order of its float steps, and the ggml scheme whose distance
from the float64 reference bounds the integer path's logits (tests/test_int8.py).
"""

from __future__ import annotations

import numpy as np


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (its magic-number trick), for float32 values below 2^22."""
    return np.rint(v.astype(np.float32)).astype(np.int32)


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d (..., nb) float32, q (..., nb, 256) int8) of x (..., k) as ggml's quantize_row_q8_K_ref: per block, max the
    value of largest |x| (the first such), iscale = -127 / max, q = min(127, nearest_int(iscale x)), d = 1 / iscale;
    a block of zeros gets d 0, q 0."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 256)
    first = np.abs(blocks).argmax(-1)[..., None]  # argmax takes the first of equal maxima, as ggml's strict >
    mx = np.take_along_axis(blocks, first, -1)  # (..., nb, 1)
    zero = mx == 0
    iscale = np.where(zero, np.float32(0), np.float32(-127.0) / np.where(zero, np.float32(1), mx)).astype(np.float32)
    q = np.minimum(127, nearest_int(iscale * blocks)).astype(np.int8)
    d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    return d[..., 0], q


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d (..., nb) float32, q (..., nb, 32) int8) of x (..., k) as ggml's quantize_row_q8_0_ref: d = max|x| / 127,
    q = roundf(x (1 / d)) (ties away from zero), and d as ggml stores it, rounded to fp16."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    v = (blocks * inv[..., None]).astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int8)
    return d.astype(np.float16).astype(np.float32), q


def quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x's int8 blocks for weights of ``block``-value blocks (256: Q8_K; 32: Q8_0)."""
    return quantize_q8_k(x) if block == 256 else quantize_q8_0(x)


def dequantized_x(x: np.ndarray, block: int) -> np.ndarray:
    """x (..., k) as ggml's scheme sees it: d q per block, float64."""
    d, q = quantize(x, block)
    return (d[..., None].astype(np.float64) * q).reshape(x.shape)


def product(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """x (b, k) @ w (n, k)^T on ggml's integer scheme, float64: per block of x, its ints times the weights, times d."""
    d, q = quantize(x, block)  # (b, nb), (b, nb, block)
    wb = w.astype(np.float64).reshape(w.shape[0], -1, block)  # (n, nb, block)
    sums = np.einsum("bjk,njk->bnj", q.astype(np.float64), wb)  # each block's sum of q w: the integer sums, scaled
    return np.einsum("bnj,bj->bn", sums, d.astype(np.float64))

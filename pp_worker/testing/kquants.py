"""A test-only packer for ggml's K-quant blocks (Q2_K ... Q6_K), IQ4_NL, IQ4_XS and TQ2_0, written from the block
format.

The `gguf` package dequantizes these types but cannot quantize them. This packer is simple, not llama.cpp's: each
sub-block's scale (and min) is its range over the levels (`_affine`), or its largest magnitude over the end level
(`_signed`: Q3_K, Q6_K, IQ4_XS), the super-block keeps them as 4-, 6- or 8-bit multiples of an fp16 step, and every
value is rounded to its nearest level. Good enough to make files whose
weights are close to the float ones (tests/test_modelgen.py checks the round trip through `gguf.quants.dequantize`),
which is all the tests need: the engine is checked against the dequantized file, never against the float weights.

Layouts (ggml-common.h), 256 values per block:
- Q2_K (84 bytes): scales[16] (a 4-bit scale and a 4-bit min per 16 values), qs[64] (2-bit values), d, dmin (fp16).
- Q3_K (110 bytes): hmask[32] (the third bits), qs[64] (the low 2 bits), scales[12] (16 six-bit scales), d (fp16).
- Q4_K (144 bytes): d, dmin (fp16), scales[12] (8 six-bit scales and 8 six-bit mins), qs[128] (4-bit values).
- Q5_K (176 bytes): d, dmin, scales[12], qh[32] (the fifth bits), qs[128].
- Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (fp16).
- IQ4_NL (18 bytes, 32 values): d (fp16), qs[16]: 4-bit indices into 16 fixed non-uniform levels (low nibbles the
  first 16 values, high nibbles the next 16).
- IQ4_XS (136 bytes): d (fp16), scales_h (uint16: 2 high bits per sub-block of 32), scales_l[4] (4 low bits per
  sub-block), qs[128] (IQ4_NL's indices, 16 bytes per sub-block); a sub-block's scale is d * (its 6 bits - 32).
- TQ2_0 (66 bytes): qs[64] (2-bit values, laid out as Q2_K's), d (fp16); a weight is d * (q - 1): ternary.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _affine(x: np.ndarray, levels: int, size: int = 32,
            top: int = 63) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of 256 -> (d, dmin) fp16, the sub-blocks' scales and mins in 0..top, and values in 0..levels, such that
    x ~ d * scale * q - dmin * min per sub-block of ``size``."""
    sub = x.reshape(-1, QK // size, size)
    lo = np.minimum(sub.min(-1), 0.0)  # ggml keeps mins <= 0: the offset is a subtraction of a non-negative min
    scale, offset = (sub.max(-1) - lo) / levels, -lo  # (n, sub-blocks)
    d, dmin = _fp16(scale.max(-1) / top), _fp16(offset.max(-1) / top)  # (n,)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, top).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(offset, dminf, out=np.zeros_like(offset), where=dminf > 0)), 0, top).astype(np.uint8)
    step, base = (df * sc)[..., None], (dminf * mn)[..., None]  # (n, 8, 1)
    q = np.clip(np.rint(np.divide(sub + base, step, out=np.zeros_like(sub), where=step > 0)), 0, levels)
    return d, dmin, sc, mn, q.astype(np.uint8).reshape(-1, QK)


def _signed(sub: np.ndarray, end: float, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-blocks (n, s, m) -> (d fp16 (n,), scales (n, s) in -top-1..top as floats, each sub-block's step
    (n, s, 1)), each sub-block's largest magnitude landing on level -``end`` (the one without a positive twin, as
    ggml does): x ~ d * scale * q."""
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]  # (n, s), signed
    scale = -peak / end
    d = _fp16(np.abs(scale).max(-1) / top)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -top - 1, top)
    return d, sc, (df * sc)[..., None]


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> ggml's 12 bytes (the inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Values (n, 256) -> qs (n, 128): chunk j of 64 holds values 64j..64j+31 low, 64j+32..64j+63 high."""
    c = q.reshape(-1, 4, 2, 32) & 15
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)


def _header(d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8)], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, QK).astype(np.float32), 15)
    return np.concatenate([_header(d, dmin), _pack_scales(sc, mn), _nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, QK).astype(np.float32), 31)
    bits = (q.reshape(-1, 4, 2, 32) >> 4) & 1  # (n, chunk j, half, l): bit 2j + half of qh[l]
    qh = (bits << (2 * np.arange(4)[None, :, None, None] + np.arange(2)[None, None, :, None])).sum((1, 2))
    return np.concatenate([_header(d, dmin), _pack_scales(sc, mn), qh.astype(np.uint8), _nibbles(q)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16).astype(np.float32)  # 16 sub-blocks of 16
    d, sc, step = _signed(sub, 32, 127)
    sc = sc.astype(np.int8)
    q = np.clip(np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # (n, half, quarter, l): value 128 * half + 32 * quarter + l
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)],
                        axis=2).reshape(-1, 128)  # per half: ql[l] for quarters 0 and 2, ql[32 + l] for 1 and 3
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)


def _bit_pairs(q: np.ndarray) -> np.ndarray:
    """Values (n, 256) in 0..3 -> qs (n, 64): value 128 c + 32 j + l is bit pair j of qs[32 c + l]."""
    c = q.reshape(-1, 2, 4, 32) & 3
    return (c << (2 * np.arange(4))[None, None, :, None]).sum(2).astype(np.uint8).reshape(-1, 64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine(x.reshape(-1, QK).astype(np.float32), 3, size=16, top=15)  # 4-bit scales per 16
    return np.concatenate([sc | (mn << 4), _bit_pairs(q), _header(d, dmin)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    d, sc, step = _signed(sub, 4, 31)  # values -4..3
    sc = sc.astype(np.int32)
    u = (np.clip(np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -4, 3) + 4).astype(np.uint8)
    u = u.reshape(-1, QK)  # value + 4: low 2 bits in qs, the third (set: no 4 subtracted) in hmask
    hbits = (u.reshape(-1, 8, 32) >> 2) & 1  # (n, group 4 c + j, l): bit 4 c + j of hmask[l]
    hmask = (hbits << np.arange(8)[None, :, None]).sum(1).astype(np.uint8)
    s6 = (sc + 32).astype(np.uint8)  # (n, 16): low nibbles in bytes 0-7 (8-15 as high nibbles), top bit pairs in 8-11
    scales = np.zeros((s6.shape[0], 12), np.uint8)
    scales[:, :8] = (s6[:, :8] & 15) | ((s6[:, 8:] & 15) << 4)
    for i in range(16):
        scales[:, 8 + i % 4] |= (s6[:, i] >> 4) << (2 * (i // 4))
    return np.concatenate([hmask, _bit_pairs(u & 3), scales, d.reshape(-1, 1).view(np.uint8)], axis=1)


IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_indices(sub: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Values (..., 32) and their step (..., 1) -> the nearest levels' indices, packed: (..., 16) bytes."""
    scaled = np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)
    q = np.abs(scaled[..., None] - IQ4_NL_LEVELS).argmin(-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 32).astype(np.float32)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[:, None], -1)  # (n, 1), signed: lands on -127
    d = _fp16(peak / IQ4_NL_LEVELS[0])
    return np.concatenate([d.view(np.uint8), _iq4_indices(sub, d.astype(np.float32))], axis=1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    d, ls, step = _signed(sub, -IQ4_NL_LEVELS[0], 31)  # 6-bit sub-block scales, the largest magnitude on -127
    ls = ls.astype(np.int32)
    qs = _iq4_indices(sub, step).reshape(-1, 128)
    six = (ls + 32).astype(np.uint16)  # (n, 8)
    high = ((six >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
    low = ((six[:, 0::2] & 15) | ((six[:, 1::2] & 15) << 4)).astype(np.uint8)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), high.reshape(-1, 1).view(np.uint8), low, qs], axis=1)


def quantize_tq2_0(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, QK).astype(np.float32)
    d = _fp16(np.abs(blocks).max(-1, keepdims=True))
    df = d.astype(np.float32)
    q = np.clip(np.rint(np.divide(blocks, df, out=np.zeros_like(blocks), where=df > 0)), -1, 1) + 1
    return np.concatenate([_bit_pairs(q.astype(np.uint8)), d.view(np.uint8)], axis=1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k,
              "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl, "IQ4_XS": quantize_iq4_xs,
              "TQ2_0": quantize_tq2_0}
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136,
               "TQ2_0": 66}


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """(rows, k) float weights, k a multiple of the block (256; IQ4_NL 32) -> (rows, k / block * block bytes)
    uint8, ggml's layout."""
    rows, k = w.shape
    block = 32 if type_name == "IQ4_NL" else QK
    if k % block:
        raise ValueError(f"{type_name} rows need a multiple of {block} values, got {k}")
    return QUANTIZERS[type_name](w).reshape(rows, -1)

"""Hidden states as Q8 on the wire (``PP_WIRE_DTYPE=q8``): about half the bytes of float16, at a small error.

Layout of a (1, T, D) payload, little-endian, T * (D + 4) bytes:
    T float32 scales (row t's at byte 4t), then T * D int8 values, row-major.
Row t decodes to ``q[t] * scale[t]``. Symmetric absmax quantization per row (per token): scale = max|x| / 127,
q = round-to-nearest-even(x / scale) in [-127, 127], so every element comes back within scale / 2 of its float16 value;
an all-zero row has scale 0. The scale is float32 so that it is exact enough at both ends of float16's range (a
float16 scale would lose bits below 6e-5 and break the bound). The size differs from float16's T * D * 2 for every
D but 4, where the worker refuses to emit q8. Decoding gives float16 bytes: engines never see q8.
"""

from __future__ import annotations

import numpy as np

WIRE_DTYPES = ("f16", "q8")  # "f16": the contract's float16 payload, the default
SCALE_BYTES = 4
QMAX = 127  # symmetric: -128 is never emitted, and refused on input (it would decode past float16's range)
MAX_SCALE = np.float32(65504.0) / np.float32(QMAX)  # a row holding float16's largest value; 127 * it rounds to 65504


class Q8Error(ValueError):
    """A hidden state q8 cannot carry (non-finite values), or a q8 payload that is not one; the message says why."""


def payload_bytes(dtype: str, seq_len: int, hidden_dim: int) -> int:
    """Bytes of a (1, seq_len, hidden_dim) hidden state on the wire in ``dtype``."""
    return seq_len * hidden_dim * 2 if dtype == "f16" else seq_len * (hidden_dim + SCALE_BYTES)


def encode(hidden: bytes | memoryview, hidden_dim: int) -> bytes:
    """float16 bytes of (1, T, D) -> the q8 payload. Refuses inf and NaN rather than emit rows that mean nothing."""
    x = np.frombuffer(hidden, dtype="<f2").reshape(-1, hidden_dim).astype(np.float32)  # (T, D)
    absmax = np.maximum(x.max(axis=1), -x.min(axis=1))  # (T,); max and min propagate NaN, so inf/NaN show here
    if not np.isfinite(absmax).all():
        rows = np.flatnonzero(~np.isfinite(absmax))
        raise Q8Error(f"hidden state has inf or NaN in {len(rows)} row(s) (first: row {rows[0]}); "
                      "q8 cannot carry them")
    scale = absmax / np.float32(QMAX)  # (T,) float32
    inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)  # a zero row stays zero
    # |x| * (1 / scale) <= 127 up to a float32 ulp, so the rounded value is always in [-127, 127]: no clipping
    q = np.rint(np.multiply(x, inverse[:, None], out=x), out=x).astype(np.int8)  # (T, D), ties to even
    return scale.astype("<f4").tobytes() + q.tobytes()


def decode(payload: bytes, seq_len: int, hidden_dim: int) -> bytes:
    """A q8 payload of exactly ``payload_bytes("q8", seq_len, hidden_dim)`` bytes -> float16 bytes of (1, T, D).
    A scale that is negative, non-finite or past float16's range, or a value of -128, is a Q8Error: what comes
    out is always finite float16."""
    scale = np.frombuffer(payload, dtype="<f4", count=seq_len)  # (T,)
    bad = ~((scale >= 0) & (scale <= MAX_SCALE))  # NaN fails both comparisons
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise Q8Error(f"q8 scale of row {t} is {float(scale[t])!r}; must be in [0, {float(MAX_SCALE)!r}]")
    q = np.frombuffer(payload, dtype=np.int8, offset=seq_len * SCALE_BYTES).reshape(seq_len, hidden_dim)  # (T, D)
    if q.size and q.min() < -QMAX:
        raise Q8Error(f"q8 values must be in [-{QMAX}, {QMAX}]; got -128")
    return np.multiply(q, scale[:, None], dtype=np.float32).astype("<f2").tobytes()

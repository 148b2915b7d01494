"""Hidden states on the wire: float16 (the contract's), float32, and Q8.

`emit` puts an engine's output on a stage's wire (``PP_WIRE_DTYPE``). A value past float16's range would arrive as
inf and make NaN of everything after it (Gemma 3's residual stream passes 65504 on real models). ``auto``, the
default, sends such a state as float32 and says so (``hidden_dtype``; the receiver knows it from its length anyway),
and every other one as the contract's float16, byte for byte. ``f16`` is float16 only: such a state is an error
naming the other wires. ``f32`` sends float32 always: exactly what the engine computed.

Q8 (``PP_WIRE_DTYPE=q8``): about half the bytes of float16, at a small error.

Layout of a (1, T, D) payload, little-endian, T * (D + 4) bytes:
    T float32 scales (row t's at byte 4t), then T * D int8 values, row-major.
Row t decodes to ``q[t] * scale[t]``. Symmetric absmax quantization per row (per token): scale = max|x| / 127,
q = round-to-nearest-even(x / scale) in [-127, 127], so every element comes back within scale / 2 of its float16 value;
an all-zero row has scale 0. The scale is float32 so that it is exact enough at both ends of float16's range (a
float16 scale would lose bits below 6e-5 and break the bound). The size differs from float16's T * D * 2 for every
D but 4, where the worker refuses to emit q8. Decoding gives float16 bytes: engines never see q8. A row q8 cannot
carry (inf, NaN, past float16's range) is an error.
"""

from __future__ import annotations

import numpy as np

DTYPES = ("f16", "q8", "f32")  # of a payload (a request's hidden_dtype); "f16": the contract's float16
WIRE_DTYPES = ("f16", "auto", "f32", "q8")  # PP_WIRE_DTYPE: what a stage emits; "auto": f16, or f32 past its range
DEFAULT_WIRE = "auto"  # float16 byte for byte wherever it holds the state
VALUE_BYTES = {"f16": 2, "f32": 4}  # the plain dtypes' bytes per value
SCALE_BYTES = 4
QMAX = 127  # symmetric: -128 is never emitted, and refused on input (it would decode past float16's range)
MAX_SCALE = np.float32(65504.0) / np.float32(QMAX)  # a row holding float16's largest value; 127 * it rounds to 65504


class Q8Error(ValueError):
    """A hidden state the wire cannot carry (inf or NaN), or a q8 payload that is not one; the message says why."""


def payload_bytes(dtype: str, seq_len: int, hidden_dim: int) -> int:
    """Bytes of a (1, seq_len, hidden_dim) hidden state on the wire in ``dtype``."""
    if dtype == "q8":
        return seq_len * (hidden_dim + SCALE_BYTES)
    return seq_len * hidden_dim * VALUE_BYTES[dtype]


def emit(hidden: bytes | memoryview, source: str, wire: str, hidden_dim: int) -> tuple[bytes | memoryview, str]:
    """An engine's (1, T, D) output (float16 or float32 bytes: ``source``) on a stage whose ``PP_WIRE_DTYPE`` is
    ``wire`` -> (payload, its dtype). auto (the default) gives float16, or float32 when a finite value lies past
    float16's range; f16 float16; f32 float32; q8 q8. inf and NaN go out as they are on f16, auto and f32 (as the
    seed's float16 did; the worker reports them, `nonfinite_rows`); a Q8Error for them on q8, and for a value past
    float16's range on f16 and q8."""
    x = as_rows(hidden, source, hidden_dim)
    with np.errstate(over="ignore"):  # past float16's range becomes inf, and is found below
        half = x.astype("<f2", copy=False)
    bad = (half.view("<u2") & 0x7C00) == 0x7C00  # an all-ones exponent: inf or NaN in float16
    if bad.any():
        wide = bad & np.isfinite(x)  # finite values float16 would make inf
        if wire == "q8" and not np.isfinite(x).all():
            rows = nonfinite_rows(x)
            raise Q8Error(f"hidden state has inf or NaN in {len(rows)} row(s) (first: row {rows[0]}); q8 cannot "
                          "carry them")
        if wide.any():
            rows = np.flatnonzero(wide.any(axis=1))
            if wire in ("f16", "q8"):
                raise Q8Error(f"hidden state exceeds float16's range in {len(rows)} row(s) (first: row {rows[0]}); "
                              f"{wire} cannot carry it: start the stages with PP_WIRE_DTYPE=auto (the default: "
                              "float32 where float16 cannot hold a state) or f32")
            wire = "f32"  # in float16 it would be inf
    if wire == "f32":
        return (hidden if source == "f32" else x.astype("<f4").tobytes()), "f32"
    if wire == "q8":
        return encode(half, hidden_dim), "q8"
    return (hidden if source == "f16" else half.tobytes()), "f16"  # f16, or auto in float16's range


def nonfinite_rows(x: np.ndarray) -> np.ndarray:
    """The rows (T, D) -> indices of those holding inf or NaN. float16 by its bits (an all-ones exponent): numpy's
    float16 isfinite is ~10x slower, ~0.2 ms on a 32-token prefill's state."""
    if x.dtype == np.float16:
        return np.flatnonzero(((x.view("<u2") & 0x7C00) == 0x7C00).any(axis=1))
    return np.flatnonzero(~np.isfinite(x).all(axis=1))


def as_rows(data: bytes | memoryview, dtype: str, hidden_dim: int) -> np.ndarray:
    """float16 ("f16") or float32 ("f32") bytes of (1, T, D) -> a (T, D) view."""
    return np.frombuffer(data, dtype="<f4" if dtype == "f32" else "<f2").reshape(-1, hidden_dim)


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

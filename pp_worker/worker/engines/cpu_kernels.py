"""Hand-written C kernels for products with GGUF weights on the CPU, run through tinygrad's own program path.

A weight stays as the file's bytes: one uint8 buffer of N rows, each row K / QK blocks of the GGML type (F16 rows
are K fp16 values). A kernel decodes R rows at a time into float32 vectors in registers or L1 and multiplies them
with B input rows: decode (B = 1), batched decode (B sessions), and prefill chunks (B tokens) share one template.
Each block type is a C function that decodes one block into QK / 16 vectors of 16 floats, by the formulas of
ggml's ``dequantize_row_*`` (the tests check every type against the `gguf` package's numpy dequantizer).

Why C: tinygrad's CPU codegen sums each output row serially and re-derives the dequantization per element;
these kernels keep 16-wide accumulators over contiguous rows (bench/NOTES.md has the measurements). They run as
ordinary tinygrad programs: `Tensor.custom_kernel` with an ``Ops.PROGRAM`` whose source tinygrad compiles with its
own clang compiler (and caches), launched by its CPU runtime on ``threads`` threads (``core_id`` splits the rows),
captured by TinyJit like any kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from tinygrad import Context, Device, Tensor, UOp, dtypes
from tinygrad.helpers import CPU_COUNT
from tinygrad.runtime.support.compiler_cpu import ClangJITCompiler
from tinygrad.uop.ops import KernelInfo, Ops, ProgramInfo

from pp_worker.worker.engines.gguf_file import type_name
from pp_worker.worker.engines.hostio import filled

# ggml type -> (elements per block, bytes per block): F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
# IQ4_NL, IQ4_XS
BLOCKS: dict[int, tuple[int, int]] = {1: (32, 64), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                                      10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
                                      20: (32, 18), 23: (256, 136)}
ROWS = 4  # weight rows decoded per step: each input vector loaded once serves ROWS products

HEADER = r"""
typedef float f16v __attribute__((ext_vector_type(16)));
typedef float f8v __attribute__((ext_vector_type(8)));
typedef unsigned char u8x32 __attribute__((ext_vector_type(32)));
typedef signed char i8x32 __attribute__((ext_vector_type(32)));
typedef unsigned char u8x16 __attribute__((ext_vector_type(16)));
typedef signed char i8x16 __attribute__((ext_vector_type(16)));
typedef unsigned int u32x16 __attribute__((ext_vector_type(16)));
typedef unsigned short u16x16 __attribute__((ext_vector_type(16)));
typedef __fp16 h16x16 __attribute__((ext_vector_type(16)));
static inline float half_at(const unsigned char* p) { unsigned short h; __builtin_memcpy(&h, p, 2);
  return (float)__builtin_bit_cast(__fp16, h); }
static inline u8x16 u8_at(const unsigned char* p) { u8x16 v; __builtin_memcpy(&v, p, 16); return v; }
static inline f16v f_at(const float* p) { f16v v; __builtin_memcpy(&v, p, 64); return v; }
static inline f16v fu8(u8x16 v) { return __builtin_convertvector(v, f16v); }
static inline f16v lo16(i8x32 v) { return __builtin_convertvector(
  __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), f16v); }
static inline f16v hi16(i8x32 v) { return __builtin_convertvector(
  __builtin_shufflevector(v, v, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31), f16v); }
typedef float f4v __attribute__((ext_vector_type(4)));
static inline float hsum(f16v v) {  /* halves added pairwise: 4 adds deep (a row's last step; 9 one by one) */
  f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
        + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1]; }
typedef int i32x16 __attribute__((ext_vector_type(16)));
static inline i32x16 i32_at(const unsigned char* p) { return __builtin_convertvector(u8_at(p), i32x16); }
static const f16v FIOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const u32x16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define SPLAT4(v, a, b, c, d) __builtin_shufflevector(v, v, a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d)
#if defined(__AVX512F__)
#define LOOK __builtin_ia32_permvarsf512  /* 16 floats: out[i] = t[idx[i] & 15] (vpermps) */
static const i32x16 LOW4 = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
/* 32 floats (lo, hi) at a 5-bit index: bits 0-3 from nib, the rest from five (one vpternlogd: (c & a) | (~c & b),
   0xE4; vpermi2ps reads bits 0-4). The same select written in plain C became three instructions. */
#define LOOK5(lo, hi, nib, five) __builtin_ia32_vpermi2varps512( \
  lo, __builtin_ia32_pternlogd512_mask((i32x16)(nib), (i32x16)(five), LOW4, 0xE4, 0xFFFF), hi)
#endif
"""

# Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins (ggml's get_scale_min_k4), all 16 at once as one
# vector {d * scales, dmin * mins} (the same products as one at a time), from the block's first 16 bytes read once: the
# 6-bit fields put together by byte shuffles and masks, d and dmin converted together
SCALE_MIN = r"""typedef __fp16 h16x8 __attribute__((ext_vector_type(8)));
static inline f16v scale_min(const unsigned char* b) {
  u8x16 v = u8_at(b);
  u8x16 a = __builtin_shufflevector(v, v, 4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  u8x16 t = __builtin_shufflevector(v, v, 0, 0, 0, 0, 4, 5, 6, 7, 0, 0, 0, 0, 8, 9, 10, 11);
  const u8x16 lo = {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0};
  const u8x16 hi = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15};
  const u8x16 top = {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48};
  u8x16 q = (a & lo) | ((a >> 4) & hi) | ((t >> 2) & top);
  f8v d = __builtin_convertvector(__builtin_bit_cast(h16x8, v), f8v);  /* d, dmin (then scale bytes as halves) */
  return __builtin_convertvector(q, f16v) * __builtin_shufflevector(d, d, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1,
                                                                    1, 1); }
"""

# IQ4_NL and IQ4_XS: 4-bit indices into 16 fixed non-uniform levels (ggml's kvalues_iq4nl), times the scale of
# the block (IQ4_NL) or of the sub-block of 32 (IQ4_XS: 6-bit, minus 32, times the block's d; low 4 bits in
# scales_l, high 2 in scales_h). A group's low nibbles are its first 16 values, its high nibbles the next 16.
IQ4 = r"""static const f16v KV4 = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static inline float iq4_scale(const unsigned char* b, int g) {  /* d for IQ4_NL, d (ls - 32) for IQ4_XS */
#if IQ4_XS
  unsigned short sh; __builtin_memcpy(&sh, b + 2, 2);
  return half_at(b) * ((((b[4 + g / 2] >> 4 * (g & 1)) & 15) | (((sh >> 2 * g) & 3) << 4)) - 32);
#else
  return half_at(b);
#endif
}
"""
IQ4_TYPES = {20: "#define IQ4_XS 0\n#define IQ4_QS 2\n" + IQ4,  # IQ4_NL: d, qs[16]
             23: "#define IQ4_XS 1\n#define IQ4_QS (8 + 16 * g)\n" + IQ4}  # IQ4_XS: d, scales_h, scales_l[4], qs[128]
IQ4_DECODE = r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = iq4_scale(b, g); u8x16 q = u8_at(b + IQ4_QS);
  for (int i = 0; i < 16; i++) { w[0][i] = KV4[q[i] & 15] * d; w[1][i] = KV4[q[i] >> 4] * d; } }"""
IQ4_LOOKUP = r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  f16v t = KV4 * iq4_scale(b, g); i32x16 q = i32_at(b + IQ4_QS);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }"""

# decode32(block, g, w): values 32g .. 32g+31 of a block into w[0], w[1], as ggml's dequantize_row_<type> computes
# them (g is 0 for the types with 32 values a block). Groups of 32 keep two vectors live at a time, whatever the
# block size: a kernel decodes a group and uses it at once (or stores it, for several rows of x).
DECODERS: dict[int, str] = {
    1: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  for (int i = 0; i < 2; i++) { u16x16 h; __builtin_memcpy(&h, b + 32 * i, 32);
    w[i] = __builtin_convertvector(__builtin_bit_cast(h16x16, h), f16v); } }""",
    2: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); u8x16 q = u8_at(b + 2);
  w[0] = (fu8(q & 15) - 8.0f) * d; w[1] = (fu8(q >> 4) - 8.0f) * d; }""",
    3: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b), m = half_at(b + 2); u8x16 q = u8_at(b + 4);
  w[0] = fu8(q & 15) * d + m; w[1] = fu8(q >> 4) * d + m; }""",
    6: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); unsigned int qh; __builtin_memcpy(&qh, b + 2, 4); u8x16 q = u8_at(b + 6);
  u32x16 lo = __builtin_convertvector(q & 15, u32x16) | (((qh >> IOTA) & 1) << 4);
  u32x16 hi = __builtin_convertvector(q >> 4, u32x16) | (((qh >> (IOTA + 16)) & 1) << 4);
  w[0] = (__builtin_convertvector(lo, f16v) - 16.0f) * d; w[1] = (__builtin_convertvector(hi, f16v) - 16.0f) * d; }""",
    7: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b), m = half_at(b + 2); unsigned int qh; __builtin_memcpy(&qh, b + 4, 4); u8x16 q = u8_at(b + 8);
  u32x16 lo = __builtin_convertvector(q & 15, u32x16) | (((qh >> IOTA) & 1) << 4);
  u32x16 hi = __builtin_convertvector(q >> 4, u32x16) | (((qh >> (IOTA + 16)) & 1) << 4);
  w[0] = __builtin_convertvector(lo, f16v) * d + m; w[1] = __builtin_convertvector(hi, f16v) * d + m; }""",
    8: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b); i8x16 q0, q1; __builtin_memcpy(&q0, b + 2, 16); __builtin_memcpy(&q1, b + 18, 16);
  w[0] = __builtin_convertvector(q0, f16v) * d; w[1] = __builtin_convertvector(q1, f16v) * d; }""",
    # Q2_K (scales[16], qs[64], d, dmin): group g is bit pair g % 4 of qs[32 (g / 4) ..]; each half of it a sub-block
    # of 16 with a 4-bit scale (low nibble of scales[2g + half]) and a 4-bit min (its high nibble)
    10: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b + 80), dmin = half_at(b + 82); const unsigned char* q = b + 16 + 32 * (g >> 2);
  for (int h = 0; h < 2; h++) { int sc = b[2 * g + h];
    w[h] = fu8((u8_at(q + 16 * h) >> (2 * (g & 3))) & 3) * (d * (sc & 15)) - dmin * (sc >> 4); } }""",
    # Q3_K (hmask[32], qs[64], scales[12], d): as Q2_K, with a third bit from bit g of hmask[16 half ..] (clear: the
    # value is 4 less) and 6-bit signed scales (minus 32) per 16, their low nibbles in bytes 0-7 and high bit pairs
    # in bytes 8-11 (ggml's kmask shuffle in dequantize_row_q3_K)
    11: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b + 108); const unsigned char* q = b + 32 + 32 * (g >> 2), *s = b + 96;
  for (int h = 0; h < 2; h++) { int i = 2 * g + h;
    int sc = ((i < 8 ? s[i] & 15 : s[i - 8] >> 4) | ((s[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4) - 32;
    u8x16 v = ((u8_at(q + 16 * h) >> (2 * (g & 3))) & 3) | (((u8_at(b + 16 * h) >> g) & 1) << 2);
    w[h] = (fu8(v) - 4.0f) * (d * sc); } }""",
    **{t: pre + IQ4_DECODE for t, pre in IQ4_TYPES.items()},
    # Q4_K: group g holds the low (g even) or high (g odd) nibbles of qs[32 (g / 2) ..], sub-block g's scale and min
    12: SCALE_MIN + r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 16 + 32 * (g >> 1);
  for (int h = 0; h < 2; h++) { u8x16 v = u8_at(q + 16 * h); w[h] = d * fu8(g & 1 ? v >> 4 : v & 15) - n; } }""",
    # Q5_K: as Q4_K, the fifth bit of each value in bit g of qh[...]
    13: SCALE_MIN + r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 48 + 32 * (g >> 1);
  for (int h = 0; h < 2; h++) {
    u8x16 v = u8_at(q + 16 * h), hb = u8_at(b + 16 + 16 * h);
    w[h] = d * fu8((g & 1 ? v >> 4 : v & 15) | (((hb >> g) & 1) << 4)) - n; } }""",
    # Q6_K: group g is quarter g % 4 of half g / 4: low 4 bits from ql, 2 high bits from qh, a scale per 16 values.
    # The bits of a group's 32 values are put together in one 32-byte vector; the scales converted all at once.
    14: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  int half = g >> 2, quarter = g & 3;
  const unsigned char* ql = b + 64 * half + 32 * (quarter & 1); const unsigned char* qh = b + 128 + 32 * half;
  i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
  f16v ds = __builtin_convertvector(sc, f16v) * half_at(b + 208);
  u8x32 l, e; __builtin_memcpy(&l, ql, 32); __builtin_memcpy(&e, qh, 32);
  i8x32 q = (i8x32)((quarter >> 1 ? l >> 4 : l & 15) | (((e >> (2 * quarter)) & 3) << 4)) - 32;
  w[0] = ds[8 * half + 2 * quarter] * lo16(q); w[1] = ds[8 * half + 2 * quarter + 1] * hi16(q); }""",
}

# With AVX-512's 16-float table lookup (vpermps: out[i] = t[idx[i] & 15]), the 4-bit types look each value up in a
# table of its 16 possible values, made per block (Q4_K: per group of 32) by the expression above: the same floats,
# one lookup where the decoders above spend a conversion and a multiply-add (bench/NOTES.md has the numbers).
LOOKUPS: dict[int, str] = {
    **{t: pre + IQ4_LOOKUP for t, pre in IQ4_TYPES.items()},
    2: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  f16v t = (FIOTA - 8.0f) * half_at(b); i32x16 q = i32_at(b + 2);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }""",
    3: r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  f16v t = FIOTA * half_at(b) + half_at(b + 2); i32x16 q = i32_at(b + 4);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }""",
    12: SCALE_MIN + r"""static inline void decode32(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 16 + 32 * (g >> 1);
  f16v t = d * FIOTA - n;
  for (int h = 0; h < 2; h++) { i32x16 v = i32_at(q + 16 * h); w[h] = LOOK(t, g & 1 ? v >> 4 : v); } }""",
}

# One row of x with AVX-512, Q4_K and Q5_K: a 64-byte half of a block's nibbles read as 16 int32 lanes of 8 nibbles
# each, and nibble m of all 16 lanes looked up at once (vpermps reads only an index's low 4 bits: a shift per 16
# values, no widening load). Q5_K's fifth bits are shifted out of qh (its 32 bytes in both halves of a vector) to bit
# 4 per lane, joined to the nibble by one bitwise select (vpternlogd, written out: the same select in plain C gained
# 1.02x) and looked up in a table of 32 (vpermi2ps): 1.18-1.27x the fifth bit looked up on its own and added.
# Lanes 0-7 hold values of one group and lanes 8-15 of another, so the lookup is of q itself, a group's scale
# multiplies its sum (d * sum(q x)) and its min x's group sum (dmin * m * sum(x)): the dequantized product
# rearranged, exact to float32 rounding. x is put in the lanes' order once per call (xp), its group sums with it
# (xs). Cache-hot, one thread, 512 rows: Q4_K 1.3-1.5x the group-by-group lookup, Q5_K 1.1-1.2x its decoder. A
# block's 8 scales and 8 mins come out as one vector (scale_min), and the mins' products are summed with the rest at
# the row's end: a further 1.14-1.25x (bench/NOTES.md).
K4_LANES = r"""#define ROW_DOT
#define SPLAT2(v, a, c) __builtin_shufflevector(v, v, a, a, a, a, a, a, a, a, c, c, c, c, c, c, c, c)
typedef unsigned int u32x8 __attribute__((ext_vector_type(8)));
static inline const float* prep_x(const float* restrict x, float* restrict xp, float* restrict xs,
                                  int nb) {
  static const int at[16] = {0, 4, 8, 12, 16, 20, 24, 28, 64, 68, 72, 76, 80, 84, 88, 92};
  for (int g = 0; g < 8 * nb; g++) xs[g] = hsum(f_at(x + 32 * g) + f_at(x + 32 * g + 16));
  for (int c = 0; c < 2 * nb; c++)  /* lane l, nibble m of half c: byte 4 l + m / 2 of its 64, low nibble if m even */
    _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m++)
      _Pragma("clang loop unroll(full)") for (int l = 0; l < 16; l++)
        xp[128 * c + 16 * m + l] = x[128 * c + 32 * (m & 1) + m / 2 + at[l]];
  return xp;
}
#define HALF(h) { \
  u32x16 q; __builtin_memcpy(&q, b + QS + 64 * h, 64); \
  const float* p = xp + 256 * j + 128 * h; \
  f16v e = 0, o = 0; \
  _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m += 2) { \
    e += VALUE(h, m) * f_at(p + 16 * m); \
    o += VALUE(h, m + 1) * f_at(p + 16 * m + 16); } \
  acc += e * SPLAT2(ds, 4 * h, 4 * h + 2) + o * SPLAT2(ds, 4 * h + 1, 4 * h + 3); }
static inline float row_dot(const unsigned char* restrict row, const float* restrict xp, const float* restrict xs,
                            int nb) {
  f16v acc = 0, mins = 0;  /* mins: lanes 8-15, with dm */
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK * j;
    f16v ds = scale_min(b); f8v s; __builtin_memcpy(&s, xs + 8 * j, 32);
    mins += ds * __builtin_shufflevector((f8v)0, s, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    HIGH_BITS
    HALF(0) HALF(1)
  }
  return hsum(acc - mins);
}"""
Q8_0_ROW = r"""#define ROW_DOT
static inline const float* prep_x(const float* restrict x, float* restrict xp, float* restrict xs,
                                  int nb) {
  return x; }  /* read as it is */
static inline f16v q_dot_x(const unsigned char* b, const float* x) {  /* a block's sum of q x, not yet scaled */
  i8x16 q0, q1; __builtin_memcpy(&q0, b + 2, 16); __builtin_memcpy(&q1, b + 18, 16);
  return __builtin_convertvector(q0, f16v) * f_at(x) + __builtin_convertvector(q1, f16v) * f_at(x + 16);
}
static inline float row_dot(const unsigned char* restrict row, const float* restrict xp, const float* restrict xs,
                            int nb) {
  f16v acc0 = 0, acc1 = 0;
  for (int j0 = 0; j0 < nb; j0 += 16) {  /* 16 blocks at a time: their scales first, then their sums */
    const unsigned char* b = row + 34 * j0;
    const float* x = xp + 32 * j0;
    int n = nb - j0 < 16 ? nb - j0 : 16, j = 0;
    float d[16];
    for (int i = 0; i < n; i++) d[i] = half_at(b + 34 * i);
    for (; j + 1 < n; j += 2) {  /* acc += d * sum in one expression: one FMA */
      acc0 += d[j] * q_dot_x(b + 34 * j, x + 32 * j);
      acc1 += d[j + 1] * q_dot_x(b + 34 * j + 34, x + 32 * j + 32);
    }
    if (j < n) acc0 += d[j] * q_dot_x(b + 34 * j, x + 32 * j);
  }
  return hsum(acc0 + acc1);
}"""
# One row of x with AVX-512, Q2_K and Q3_K: a block's 64 bytes of 2-bit pairs read as 16 int32 lanes of 16 pairs
# (lane l: bytes 4 l to 4 l + 3), and pair m of all 16 lanes looked up at once as floats in a table of 16 (vpermps
# reads an index's low 4 bits: the pairs above need no mask where the table repeats). Value m of lane l is weight
# 128 (l / 8) + 32 (m % 4) + 4 (l % 8) + m / 4 of the block, of sub-block 8 (l / 8) + 2 (m % 4) + (l % 8) / 4: the
# four m of one m % 4 share their lanes' scales, applied once to their sum. Q3_K's third bits (hmask: bit
# 8 (m / 4) + 4 (l / 8) + m % 4 of its int32 l % 8) join the pair by one shift per lane and one bitwise select, its
# table holding q - 4 itself; Q2_K's mins multiply x's sums per 16, taken once per call. x is put in the lanes'
# order once per call (xp): the dequantized product rearranged, exact to float32 rounding. Cache-hot, one thread,
# 1536x512: Q2_K 1.38-1.59x and Q3_K 1.24-1.25x their products over 16-value groups (bench/NOTES.md).
K23_LANES = r"""#define ROW_DOT
static inline const float* prep_x(const float* restrict x, float* restrict xp, float* restrict xs,
                                  int nb) {
#if MINS  /* x's sums per 16, for Q2_K's mins */
  for (int s = 0; s < 16 * nb; s++) xs[s] = hsum(f_at(x + 16 * s));
#endif
  for (int c = 0; c < nb; c++)
    _Pragma("clang loop unroll(full)") for (int m = 0; m < 16; m++)
      _Pragma("clang loop unroll(full)") for (int l = 0; l < 16; l++)
        xp[256 * c + 16 * m + l] = x[256 * c + 128 * (l / 8) + 32 * (m % 4) + 4 * (l % 8) + m / 4];
  return xp;
}
static inline float row_dot(const unsigned char* restrict row, const float* restrict xp, const float* restrict xs,
                            int nb) {
  f16v acc = 0, mins = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK * j;
    f16v sd;  /* the 16 sub-blocks' scales */
    SCALES
    u32x16 q; __builtin_memcpy(&q, b + QS, 64);
    HIGH_BITS
    const float* p = xp + 256 * j;
    f16v e[4] = {0};
    _Pragma("clang loop unroll(full)") for (int m = 0; m < 16; m++)
      e[m % 4] += LOOK(TABLE, (i32x16)(INDEX)) * f_at(p + 16 * m);
    acc += e[0] * SPLAT4(sd, 0, 1, 8, 9) + e[1] * SPLAT4(sd, 2, 3, 10, 11) + e[2] * SPLAT4(sd, 4, 5, 12, 13)
         + e[3] * SPLAT4(sd, 6, 7, 14, 15);
  }
  return hsum(acc - mins);
}"""
Q2_K_ROW = r"""#define BLOCK 84
#define QS 16
#define MINS 1
static const f16v TABLE = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
#define INDEX (q >> (2 * m))
#define HIGH_BITS
#define SCALES u8x16 sb = u8_at(b); sd = fu8(sb & 15) * half_at(b + 80); \
  mins += fu8(sb >> 4) * half_at(b + 82) * f_at(xs + 16 * j);
""" + K23_LANES
Q3_K_ROW = r"""#define BLOCK 110
#define QS 32
#define MINS 0
typedef unsigned int u32x8 __attribute__((ext_vector_type(8)));
static const f16v TABLE = {-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3};
/* hmask's int32s in lanes 0-7 and again in 8-15, those of 0-7 shifted left by 2 (their bits reach 27 at most), so
   one right shift per lane brings value m's third bit to bit 2: the pair in bits 0-1, bit 3 whatever */
#define HIGH_BITS u32x8 h8; __builtin_memcpy(&h8, b, 32); \
  u32x16 hb = __builtin_shufflevector(h8 << 2, h8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#define INDEX (((q >> (2 * m)) & 3) | ((hb >> ((u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} \
  + (8 * (m / 4) + m % 4))) & ~3u))
#define SCALES u8x16 sv = 0; __builtin_memcpy(&sv, b + 96, 12); \
  u32x16 lo = __builtin_convertvector(__builtin_shufflevector(sv & 15, sv >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, \
                                                              19, 20, 21, 22, 23), u32x16); \
  u32x16 hi = __builtin_convertvector(__builtin_shufflevector(sv, sv, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, \
                                                              9, 10, 11), u32x16); \
  sd = (__builtin_convertvector((i32x16)(lo | ((hi >> (2 * (IOTA >> 2))) & 3) << 4), f16v) - 32.0f) \
       * half_at(b + 108);
""" + K23_LANES
# One row of x with AVX-512, IQ4_XS: the K4_LANES way over its layout. 64 bytes (4 sub-blocks of 32) read as 16
# int32 lanes of 8 nibbles, each lane within one sub-block; nibble m of all lanes looked up at once in the 16
# levels; x put in the lanes' order once per call; the 4 sub-blocks' scales applied once to their lanes' sums.
IQ4_XS_ROW = r"""#define ROW_DOT
static inline const float* prep_x(const float* restrict x, float* restrict xp, float* restrict xs,
                                  int nb) {
  for (int c = 0; c < 2 * nb; c++)  /* lane l, nibble m of half c: byte 4 (l % 4) + m / 2 of sub-block l / 4 */
    _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m++)
      _Pragma("clang loop unroll(full)") for (int l = 0; l < 16; l++)
        xp[128 * c + 16 * m + l] = x[128 * c + 32 * (l / 4) + 4 * (l % 4) + m / 2 + 16 * (m & 1)];
  return xp;
}
#define IQ4_HALF(h) { \
  u32x16 q; __builtin_memcpy(&q, b + 8 + 64 * h, 64); \
  const float* p = xp + 256 * j + 128 * h; \
  f16v e = 0, o = 0; \
  _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m += 2) { \
    e += LOOK(KV4, (i32x16)(q >> (4 * m))) * f_at(p + 16 * m); \
    o += LOOK(KV4, (i32x16)(q >> (4 * m + 4))) * f_at(p + 16 * m + 16); } \
  acc += (e + o) * SPLAT4(sc, 4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3); }
static inline float row_dot(const unsigned char* restrict row, const float* restrict xp, const float* restrict xs,
                            int nb) {
  f16v acc = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + 136 * j;
    f8v sc;
    _Pragma("clang loop unroll(full)") for (int g = 0; g < 8; g++) sc[g] = iq4_scale(b, g);
    IQ4_HALF(0) IQ4_HALF(1)
  }
  return hsum(acc);
}"""
# One row of x with AVX-512, Q5_0 and Q5_1 (the fallbacks llama.cpp writes in K-quant files for rows that are not
# whole 256-value blocks, as in models 896 wide): a block's 16 bytes widened once to 16 int32 lanes, the low nibbles
# and (shifted) the high ones each joined to their fifth bits (qh shifted per lane to bit 4) by one bitwise select
# (vpternlogd) and looked up as floats in a table of 32 (vpermi2ps), q - 16 for Q5_0; the block's d scales the sum
# of its 32 products, and Q5_1's m multiplies x's sum per block, taken once per call. Cache-hot, one thread, 1536x512:
# Q5_0 1.36x and Q5_1 1.13x their decoders (bench/NOTES.md).
Q5_ROW = r"""#define ROW_DOT
static inline const float* prep_x(const float* restrict x, float* restrict xp, float* restrict xs,
                                  int nb) {
#if Q5_MIN
  for (int j = 0; j < nb; j++) xs[j] = hsum(f_at(x + 32 * j) + f_at(x + 32 * j + 16));
#endif
  return x;
}
static inline float row_dot(const unsigned char* restrict row, const float* restrict x, const float* restrict xs,
                            int nb) {
  f16v acc = 0; float mins = 0;
  const f16v lo32 = FIOTA + Q5_OFF, hi32 = FIOTA + (16 + Q5_OFF);
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + Q5_BLOCK * j;
    unsigned int qh; __builtin_memcpy(&qh, b + Q5_QH, 4);
    i32x16 q = i32_at(b + Q5_QH + 4);
    u32x16 h = (u32x16)qh;
    f16v s = LOOK5(lo32, hi32, q, (h << 4) >> IOTA) * f_at(x + 32 * j)
           + LOOK5(lo32, hi32, q >> 4, h >> (IOTA + 12)) * f_at(x + 32 * j + 16);
    acc += half_at(b) * s;
#if Q5_MIN
    mins += half_at(b + 2) * xs[j];
#endif
  }
  return hsum(acc) + mins;
}"""
# type -> (whether it needs AVX-512, its one-row product). Q8_0 (any CPU): a block's sum of q x times its scale, once,
# in place of a multiply per value (1.07-1.12x); the scaling and the accumulation one FMA, the scales of 16 blocks
# converted before their sums, so that a row of up to 512 values unrolls whole (a further 1.1-1.3x): cache-hot, one
# thread (bench/NOTES.md).
ROW_DOTS: dict[int, tuple[bool, str]] = {
    6: (True, "#define Q5_BLOCK 22\n#define Q5_QH 2\n#define Q5_MIN 0\n#define Q5_OFF -16\n" + Q5_ROW),
    7: (True, "#define Q5_BLOCK 24\n#define Q5_QH 4\n#define Q5_MIN 1\n#define Q5_OFF 0\n" + Q5_ROW),
    8: (False, Q8_0_ROW),
    10: (True, Q2_K_ROW),
    11: (True, Q3_K_ROW),
    23: (True, IQ4_XS_ROW),
    12: (True, "#define QS 16\n#define BLOCK 144\n#define HIGH_BITS\n"
               "#define VALUE(h, m) LOOK(FIOTA, (i32x16)(q >> (4 * (m))))\n" + K4_LANES),
    # Q5_K: value m of lane l in half h is bit 8 (m / 2) + 4 h + (m & 1) (+ 2 in lanes 8-15) of qh's int32 l % 8
    13: (True, r"""#define QS 48
#define BLOCK 176
#define HIGH_BITS u32x8 h8; __builtin_memcpy(&h8, b + 16, 32); \
  u32x16 hb = __builtin_shufflevector(h8, h8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
/* the fifth bit to bit 4: right by its place less 4, or left where its place is under 4 (m < 2 in half 0) */
#define AT(h, m) (8 * ((m) / 2) + 4 * (h) + ((m) & 1))
#define FIFTH(h, m) (AT(h, m) >= 4 ? hb >> ((u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} + (AT(h, m) - 4)) \
  : hb << ((u32x16){2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0} + (2 - AT(h, m))))
#define VALUE(h, m) LOOK5(FIOTA, FIOTA + 16, q >> (4 * (m)), FIFTH(h, m))
""" + K4_LANES),
    # Q6_K: the same lanes over a half-block's 64 bytes of low 4 bits; each lane's 2 high bits from qh (its 32 bytes
    # in both halves of a vector) by a shift per lane, looked up in a table of 16 (h & 3) - 32; the 4 lanes of a
    # quarter share a scale. Cache-hot, one thread: 1.13-1.23x the group-by-group decoder.
    14: (True, r"""#define ROW_DOT
typedef unsigned int u32x8 __attribute__((ext_vector_type(8)));
static const f16v THI = {-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16};
static inline const float* prep_x(const float* restrict x, float* restrict xp, float* restrict xs,
                                  int nb) {
  static const int at[16] = {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60};
  for (int c = 0; c < 2 * nb; c++)  /* lane l, nibble m of half c: byte 4 l + m / 2 of ql's 64 */
    _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m++)
      _Pragma("clang loop unroll(full)") for (int l = 0; l < 16; l++)
        xp[128 * c + 16 * m + l] = x[128 * c + 64 * (m & 1) + m / 2 + at[l]];
  return xp;
}
#define HALF(h) { \
  u32x16 q; __builtin_memcpy(&q, b + 64 * h, 64); \
  u32x8 h8; __builtin_memcpy(&h8, b + 128 + 32 * h, 32); \
  u32x16 hb = __builtin_shufflevector(h8, h8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7); \
  const float* p = xp + 256 * j + 128 * h; \
  f16v e = 0, o = 0; \
  _Pragma("clang loop unroll(full)") for (int m = 0; m < 8; m += 2) { \
    u32x16 at = (u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} + 4 * m; \
    e += (LOOK(FIOTA, (i32x16)(q >> (4 * m))) + LOOK(THI, (i32x16)(hb >> at))) * f_at(p + 16 * m); \
    o += (LOOK(FIOTA, (i32x16)(q >> (4 * m + 4))) + LOOK(THI, (i32x16)(hb >> (at + 4)))) * f_at(p + 16 * m + 16); } \
  acc += e * SPLAT4(sf, 8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3) \
       + o * SPLAT4(sf, 8 * h + 4, 8 * h + 5, 8 * h + 6, 8 * h + 7); }
static inline float row_dot(const unsigned char* restrict row, const float* restrict xp, const float* restrict xs,
                            int nb) {
  f16v acc = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + 210 * j;
    i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
    f16v sf = __builtin_convertvector(sc, f16v) * half_at(b + 208);
    HALF(0) HALF(1)
  }
  return hsum(acc);
}"""),
}

# out (B, N) = x (B, K) @ W (N, K)^T; dims = {N, B, threads}. Rows of W split over the threads, ROWS rows decoded
# at a time into wbuf (L1), each then multiplied with the B rows of x. Only K is fixed in the source (it sizes
# wbuf and unrolls), so a model needs one kernel per (type, K), whatever its row counts and call sizes.
KERNEL = r"""
void NAME(float* restrict out, const unsigned char* restrict w, const float* restrict x, const int* restrict dims,
          int core_id) {
  enum { K = %(k)d, R = %(rows)d, QK = %(qk)d, BB = %(bb)d, NB = K / QK, V = K / 16 };
  const int N = dims[0], B = dims[1], T = dims[2];
  int per = ((N + R - 1) / R + T - 1) / T * R, n0 = core_id * per, n1 = n0 + per < N ? n0 + per : N;
  if (B == 1) {  /* one row of x: each block decoded into registers and used at once */
#ifdef ROW_DOT  /* or the type's own one-row product (ROW_DOTS), x prepared once per call (into xp, or as it is) */
    float xp[K] __attribute__((aligned(64))), xs[K / 16];
    const float* xr = prep_x(x, xp, xs, NB);
    for (int n = n0; n < n1; n++) out[n] = row_dot(w + (long)n * NB * BB, xr, xs, NB);
#else
    for (int n = n0; n < n1; n++) {
      const unsigned char* row = w + (long)n * NB * BB;
      f16v acc0 = 0, acc1 = 0;
      for (int j = 0; j < NB; j++)
        _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++) {
          f16v v[2];
          decode32(row + j * BB, g, v);
          acc0 += v[0] * f_at(x + j * QK + 32 * g);
          acc1 += v[1] * f_at(x + j * QK + 32 * g + 16);
        }
      out[n] = hsum(acc0 + acc1);
    }
#endif
    return;
  }
  f16v wbuf[R][V];
  for (int n = n0; n < n1; n += R) {
    int r_n = n1 - n < R ? n1 - n : R;
    for (int r = 0; r < r_n; r++)
      for (int j = 0; j < NB; j++)
        _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++)
          decode32(w + (long)(n + r) * NB * BB + j * BB, g, &wbuf[r][j * (QK / 16) + 2 * g]);
    for (int bi = 0; bi < B; bi++) {
      const float* xb = x + (long)bi * K;
      f16v acc[R] = {0};
      for (int v = 0; v < V; v++) {
        f16v xv = f_at(xb + 16 * v);
        for (int r = 0; r < R; r++) acc[r] += wbuf[r][v] * xv;
      }
      for (int r = 0; r < r_n; r++) out[(long)bi * N + n + r] = hsum(acc[r]);
    }
  }
}
"""

# out (B, K) float32 = rows idx[b] of W decoded; dims = {N, B}: an embedding lookup that reads only the rows it gathers
GATHER = r"""
void NAME(float* restrict out, const unsigned char* restrict w, const int* restrict idx, const int* restrict dims,
          int core_id) {
  enum { K = %(k)d, QK = %(qk)d, BB = %(bb)d, NB = K / QK };
  const int N = dims[0], B = dims[1];
  f16v v[2];
  for (int t = 0; t < B; t++) {
    int r = idx[t] < 0 || idx[t] >= N ? 0 : idx[t];  /* ids are checked by the protocol layer; never read outside W */
    for (int j = 0; j < NB; j++)
      _Pragma("clang loop unroll(full)") for (int g = 0; g < QK / 32; g++) {
        decode32(w + (long)r * NB * BB + j * BB, g, v);
        __builtin_memcpy(out + (long)t * K + j * QK + 32 * g, &v[0], 64);
        __builtin_memcpy(out + (long)t * K + j * QK + 32 * g + 16, &v[1], 64);
      }
  }
}
"""


def supported(ggml_type: int, k: int) -> bool:
    """Whether rows of ``k`` values of ``ggml_type`` have a kernel here (whole blocks)."""
    return ggml_type in BLOCKS and k % BLOCKS[ggml_type][0] == 0


def row_bytes(ggml_type: int, k: int) -> int:
    qk, bb = BLOCKS[ggml_type]
    return k // qk * bb


def source(template: str, ggml_type: int, k: int, name: str) -> str:
    """C source of kernel ``name`` from ``template`` (KERNEL or GATHER) for rows of ``k`` values of ``ggml_type``."""
    qk, bb = BLOCKS[ggml_type]
    body = template % {"k": k, "rows": ROWS, "qk": qk, "bb": bb}
    decoder = DECODERS[ggml_type]
    if ggml_type in LOOKUPS:  # AVX-512 where the compiler targets it, else the portable decoder
        decoder = f"#if defined(__AVX512F__)\n{LOOKUPS[ggml_type]}\n#else\n{decoder}\n#endif"
    if ggml_type in ROW_DOTS:
        avx512, row = ROW_DOTS[ggml_type]
        decoder += f"\n#if defined(__AVX512F__)\n{row}\n#endif" if avx512 else f"\n{row}"
    return HEADER + decoder + body.replace("NAME", name)


@functools.cache
def _compiler(device: str) -> ClangJITCompiler:
    """tinygrad's clang compiler for ``device``'s CPU (whatever renderer the device uses for its own kernels)."""
    return ClangJITCompiler(Device[device].arch.split(","))


@functools.cache
def _binary(src: str, device: str) -> bytes:
    """The machine code of ``src``, compiled once per process (and cached on disk by tinygrad)."""
    return _compiler(device).compile_cached(src)


_DIMS: dict[tuple[str, tuple[int, ...]], Tensor] = {}


def dims(device: str, *values: int) -> Tensor:
    """The realized int32 ``dims`` argument of a kernel call, made once per shape. Written through the buffer
    (`hostio.filled`), not realized: the first call of a shape may come while a TinyJit captures, which would record
    a realize."""
    if (t := _DIMS.get((device, values))) is None:
        def fill(mv: memoryview) -> None:
            np.frombuffer(mv, np.int32)[:] = values

        t = _DIMS[device, values] = filled((len(values),), dtypes.int32, fill, device)
    return t


def dims_values(buf: Any) -> tuple[int, ...] | None:
    """The values of a `dims` argument, given its buffer (None for any other buffer): what `jitcache` writes down."""
    return next((values for (_, values), t in _DIMS.items() if t.uop.base.buffer is buf), None)


def launch(name: str, src: str, tensors: tuple[Tensor, ...], shape: tuple[int, ...], threads: int,
           bound: tuple[UOp, ...] = ()) -> Tensor:
    """The first of ``tensors`` (the output) after C function ``name`` of ``src`` ran on (*tensors, dims) on
    ``threads`` threads. The function's parameters: the tensors' buffers, the int32 ``dims`` holding ``shape``,
    ``int core_id`` (0..threads-1), then one int per variable of ``bound`` (bound variables: positions)."""
    device = tensors[0].device
    variables = tuple(b.unbind()[0] if b.op is Ops.BIND else b for b in bound)
    # the first call of a kernel or shape may come while tinygrad traces a block (`function`, which forbids device
    # use to catch stray realizes): compiling our source and realizing a constant of our own are safe there
    with Context(ALLOW_DEVICE_USAGE=1):
        lib = _binary(src, device)
        dims_t = dims(device, *shape)
    n = len(tensors) + 1

    def fxn(*params: UOp) -> UOp:
        core = UOp.variable("core_id", 0, threads - 1, dtypes.int)
        sink = UOp.sink(*params, core, *variables, arg=KernelInfo(name=name))
        info = ProgramInfo(name=name, global_size=(threads, 1, 1), local_size=None, vars=(core, *variables),
                           globals=tuple(range(n)), outs=(0,), ins=tuple(range(1, n)))
        return UOp(Ops.PROGRAM, src=(sink, UOp(Ops.DEVICE, arg=device), UOp(Ops.LINEAR, src=(*sink.src, sink)),
                                     UOp(Ops.SOURCE, arg=src), UOp(Ops.BINARY, arg=lib)), arg=info)
    # Tensor.custom_kernel's call, with the variables' bindings as arguments of the call too: what tells the schedule
    # their values when nothing else in it uses them
    srcs = tuple(x.contiguous() if x.op is not Ops.AFTER else x for x in (*(t.uop for t in tensors), dims_t.uop))
    call = fxn(*(UOp.placeholder_like(x, slot=i) for i, x in enumerate(srcs))).call(*srcs, *bound)
    return Tensor(srcs[0].after(call))


def _call(template: str, out: Tensor, w: Tensor, x: Tensor, ggml_type: int, k: int, shape: tuple[int, ...],
          threads: int) -> Tensor:
    """``out`` after the product (KERNEL) or gather (GATHER) kernel ran on (out, w, x, dims)."""
    name = f"{type_name(ggml_type).lower()}_{'gather' if template is GATHER else 'mm'}_{k}"
    return launch(name, source(template, ggml_type, k, name), (out, w, x), shape, threads)


def matmul(x: Tensor, raw: Tensor, ggml_type: int, n: int, k: int) -> Tensor:
    """``x`` (..., k) @ W^T -> (..., n) float32, W the (n, k) weight held as ``raw``: its GGUF bytes, (n, row_bytes)."""
    lead = x.shape[:-1]
    b = math.prod(lead)
    threads = max(1, min(CPU_COUNT.value, n // ROWS))
    out = Tensor.empty(b, n, dtype=dtypes.float32, device=x.device)
    xs = x.reshape(b, k).cast(dtypes.float32).contiguous()
    return _call(KERNEL, out, raw, xs, ggml_type, k, (n, b, threads), threads).reshape(*lead, n)


def gather(idx: Tensor, raw: Tensor, ggml_type: int, n: int, k: int) -> Tensor:
    """Rows ``idx`` (...) of the (n, k) weight held as ``raw``, decoded: (..., k) float32."""
    lead = idx.shape
    t = math.prod(lead)
    out = Tensor.empty(t, k, dtype=dtypes.float32, device=idx.device)
    ids = idx.reshape(t).cast(dtypes.int32).contiguous()
    return _call(GATHER, out, raw, ids, ggml_type, k, (n, t), 1).reshape(*lead, k)

/* out (B, N) = x (B, K) @ W (N, K)^T on the integer path (PP_EXACT unset; q8.h), x given as its int8 blocks
   (xq: B rows of K / BLOCK_VALUES blocks of XB bytes, quantize.c's), each weight row's integer products with BT rows
   of them at a time, or (32-value blocks) tiles of WR weight rows against XR rows of x. dims = {N, B, parts}; rows
   of W split over the parts as in matmul.c. The type's generic file
   gives iq32 (a 32-value group of a block as unsigned, or signed with IQ_SIGNED, bytes) and iscales: for 256-value
   blocks, per 16 values an integer scale s and offset m, and the block's floats D and M: weight value = D s u - M m.
   So a block's product with x's block is dx (D sum_j s_j (u . q)_j - M sum_j m_j bsums_j), the sums in int32 as
   ggml's (the products in 16-bit pairs, then times the scales and summed in pairs into 32 bits, as ggml's AVX2
   code). For 32-value blocks, D (and M, with IQ_MIN: Q4_1, Q5_1's min, times the block's sum of q): dx D (w . q) -
   dx M sum q. */
enum { BT = 8 };  /* rows of x per pass: each weight row read once per BT rows (prefill, batched decode) */
/* a tile's weight rows and rows of x (WR x XR sums in registers: AVX-512 has 32, AVX2 16). XR divides the block of
   x (32 rows) and WR a part's rows (4 n). One thread, B 32, Q8_0 and Q4_0 at the 1.1B shape's widths: AVX-512 2x8
   0.99-1.17x 4x4 (which spills) and 3x4; AVX2 2x4 1.07-1.2x the passes of one weight row (bench/NOTES.md,
   "Prefill") */
#ifndef WR
#if defined(__AVX512F__)
#define WR 2
#define XR 8
#else
#define WR 2
#define XR 4
#endif
#endif
/* the weights INT_AHEAD bytes ahead asked for, a line at a time: a matrix from memory waits on its lines otherwise */
#ifndef INT_AHEAD
#define INT_AHEAD 8192
#endif
#define AHEAD_BY(b, n, d) _Pragma("clang loop unroll(full)") \
  for (int pf = 0; (d) && pf < (n); pf += 64) __builtin_prefetch((b) + (d) + pf)
#define AHEAD_N(b, n) AHEAD_BY(b, n, INT_AHEAD)
#define AHEAD(b) AHEAD_N(b, BLOCK_BYTES)
#if IQ_SIGNED
#define IDOT dot32s
#define IDOT64 dot64s
#else
#define IDOT dot32u
#define IDOT64 dot64u
#endif
#if BLOCK_VALUES == 256  /* a scale and an offset per 16 values (iscales gives them as 16-bit vectors: the scales in
   the groups' order, sl below; the offsets in the values' order, as x's bsums) */
#if defined(__AVX512BW__)  /* a step is two groups in 512 bits (2c, 2c + 1 side by side: 1.1-1.3x one group a step,
   bench/NOTES.md); their pair products times their four scales spread over the 16-bit lanes (vpermw) */
typedef i32x16 isum;
#define STEPS(F) F(0) F(1) F(2) F(3)
#define STEP_BYTES 64
#ifdef IQ64  /* the type's own two groups at once (its x86 file) */
#define STEP_W(c) iq64(b, c)
#else
#define STEP_W(c) CAT64(iq32(b, 2 * (c)), iq32(b, 2 * (c) + 1))
#endif
#define STEP_SCALES(c) __builtin_shufflevector(sl, sl, S8(2 * (c)), S8(8 + 2 * (c)), S8(2 * (c) + 1), S8(9 + 2 * (c)))
#define STEP_X i8x64_at
#define STEP_ACC madd32_acc
#define PAIRS_U pairs64_u
#define PAIRS_S pairs64_s
static inline i32x8 fold(i32x16 s) {
  return __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13,
                                                                                       14, 15); }
#else  /* a step is one group: its pair products (pairs 0-7 are values 0-15) times its two scales, sl[g] on pairs
   0-7 and sl[8 + g] on 8-15 (the first 16 values' in the low 128 bits, the second 16s' in the high: vpshufb) */
typedef i32x8 isum;
#define STEPS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
#define STEP_BYTES 32
#define STEP_W(g) iq32(b, g)
#define STEP_SCALES(g) __builtin_shufflevector(sl, sl, S8(g), S8(8 + (g)))
#define STEP_X i8x32_at
#define STEP_ACC madd16_acc
#define PAIRS_U pairs_u
#define PAIRS_S pairs_s
static inline i32x8 fold(i32x8 s) { return s; }
#endif
#if IQ_SIGNED
#define PAIRS PAIRS_S
#else
#define PAIRS PAIRS_U
#endif
#ifdef IQ_PAIRS64  /* the type's own pair products of a 512-bit step with x (its x86 file) */
#define ROW_STEP(c) s = STEP_ACC(s, IQ_PAIRS64(b, c, STEP_X(xb + STEP_BYTES * (c))), STEP_SCALES(c));
#else
#define ROW_STEP(c) s = STEP_ACC(s, PAIRS(STEP_W(c), STEP_X(xb + STEP_BYTES * (c))), STEP_SCALES(c));
#endif
static inline float row_dot_q8(const unsigned char* restrict row, const unsigned char* restrict xq, int nb) {
  f8v acc = 0;  /* each block's int32 sums scaled in 8 float lanes, summed once a row */
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    AHEAD(b);
    i16x16 sl, m, bs; float D, M, dx;
    iscales(b, &sl, &m, &D, &M);
    __builtin_memcpy(&dx, xb + X_D, 4); __builtin_memcpy(&bs, xb + X_SUMS, 32);
    isum s = 0;
    STEPS(ROW_STEP)
#if IQ_NO_MIN  /* M and m are 0 (IQ4_XS): the offsets' term is a zero, the products' term rounded alone as above */
    f8v p = __builtin_convertvector(fold(s), f8v) * (dx * D);
    acc += p;
#else
    acc += __builtin_convertvector(fold(s), f8v) * (dx * D) - __builtin_convertvector(madd16(m, bs), f8v) * (dx * M);
#endif
  }
  return hsum_f8(acc);
}
/* one weight row's products with nbt (at most BT) rows of x: each step's weights unpacked once for all of them (and
   its scales shuffled once), each row's floats in row_dot_q8's order, so the same results */
#define ROWS_STEP(c) { \
  __auto_type w = STEP_W(c); __auto_type sc = STEP_SCALES(c); \
  _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) \
    if (i < nbt) sum[i] = STEP_ACC(sum[i], PAIRS(w, STEP_X(xq + ((long)i * nb + j) * XB + STEP_BYTES * (c))), sc); }
static inline void rows_dot_q8(float* restrict out, long stride, const unsigned char* restrict row,
                               const unsigned char* restrict xq, int nb, int nbt) {
  f8v acc[BT];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) acc[i] = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + j * BLOCK_BYTES;
    AHEAD(b);
    i16x16 sl, m; float D, M;
    iscales(b, &sl, &m, &D, &M);
    isum sum[BT];
    _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) sum[i] = 0;
    STEPS(ROWS_STEP)
    _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) if (i < nbt) {
      const unsigned char* xb = xq + ((long)i * nb + j) * XB; i16x16 bs; float dx;
      __builtin_memcpy(&dx, xb + X_D, 4); __builtin_memcpy(&bs, xb + X_SUMS, 32);
      acc[i] += __builtin_convertvector(fold(sum[i]), f8v) * (dx * D)
              - __builtin_convertvector(madd16(m, bs), f8v) * (dx * M);
    }
  }
  for (int i = 0; i < nbt; i++) out[i * stride] = hsum_f8(acc[i]);
}
#else  /* 32-value blocks, one scale each: the integer sums scaled in float lanes, the lanes and the rows' offsets summed
   once a row. With AVX-512 a step is two blocks in 16 lanes (one 512-bit vector: one chain of adds waits on its
   previous add a block at a time); else one block in 8 */
#if defined(__AVX512F__)
typedef f16v facc;
enum { BPS = 2 };  /* blocks a step */
#define STEP_XV i8x64_pair
#define STEP_DOT_X IDOT64
#define STEP_W(b) CAT64(iq32(b, 0), iq32((b) + BLOCK_BYTES, 0))
#define STEP_SCALES(s) CAT16((f8v)(s)[0], (f8v)(s)[1])
#define LAST(v) CAT16(v, (f8v)0)  /* an odd block last: lanes 0-7 */
static inline i8x64 i8x64_pair(const unsigned char* xb) { return CAT64(i8x32_at(xb), i8x32_at(xb + XB)); }
static inline float fold_acc(f16v a) { return hsum_f8(LO8(a) + HI8(a)); }
#else
typedef f8v facc;
enum { BPS = 1 };
#define STEP_XV i8x32_at
#define STEP_DOT_X IDOT
#define STEP_W(b) iq32(b, 0)
#define STEP_SCALES(s) ((f8v)(s)[0])
#define LAST(v) (v)
static inline float fold_acc(f8v a) { return hsum_f8(a); }
#endif
#define STEP_DOT(w, xb) STEP_DOT_X(w, STEP_XV(xb))
/* a step's n blocks' D and M (read once for every row of x), then against a row of x's: s = dx D each, and the
   offsets (dx M sum q, IQ_MIN) added to off */
static inline void w_scales(const unsigned char* b, int n, float* D, float* M) {
  for (int k = 0; k < n; k++) iscales(b + k * BLOCK_BYTES, &D[k], &M[k]); }
static inline void x_scales(const unsigned char* xb, int n, const float* D, const float* M, float* s, float* off) {
  for (int k = 0; k < n; k++) {
    float dx; __builtin_memcpy(&dx, xb + k * XB + X_D, 4);
#if IQ_MIN
    short bs[2]; __builtin_memcpy(bs, xb + k * XB + X_SUMS, 4);
    *off += dx * M[k] * (float)(bs[0] + bs[1]);
#endif
    s[k] = dx * D[k];
  } }
#if defined(IQ_U) || defined(IQ_DOT32)  /* AVX-512 (BW, VL) and VNNI: a block a 256-bit step, its weights unpacked and
   its d widened with no shuffle (the type's x86 file, pairs512.h), the signed types' IQ_U taken off each lane by x's
   4-value sums times it (a second vpdpbusd), or the type's own products (IQ_DOT32); even blocks in one sum, odd ones
   in another: the same int32 lanes and float steps as the loop below (its 16 lanes: lanes 0-7 even blocks, 8-15 odd
   ones), so the same floats, in about half the instructions (bench/NOTES.md) */
#ifdef IQ_DOT32  /* the type's own (its x86 file) */
#define BLOCK_DOT(b, x) IQ_DOT32(b, x)
#elif IQ_U
#define BLOCK_DOT(b, x) (dot32u(iq32u(b), x) - dot32u((u8x32)(unsigned char)IQ_U, x))
#else
#define BLOCK_DOT(b, x) dot32u(iq32u(b), x)
#endif
#define BLOCK_STEP(acc, b, xb) { \
  i8x32 x = i8x32_at(xb); float dx; __builtin_memcpy(&dx, (xb) + X_D, 4); \
  acc += __builtin_convertvector(BLOCK_DOT(b, x), f8v) * ((f8v)dx * block_d(b)); }
static inline float row_dot_q8(const unsigned char* restrict row, const unsigned char* restrict xq, int nb) {
  f8v even = 0, odd = 0; float off = 0, s[2], D[2], M[2];
  int j = 0;
  for (; j + 2 <= nb; j += 2) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    AHEAD_N(b, 2 * BLOCK_BYTES);
    BLOCK_STEP(even, b, xb)
    BLOCK_STEP(odd, b + BLOCK_BYTES, xb + XB)
#if IQ_MIN
    w_scales(b, 2, D, M); x_scales(xb, 2, D, M, s, &off);  /* the offsets, in the loop below's order */
#endif
  }
  f16v acc = CAT16(even, odd);
  for (; j < nb; j++) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    w_scales(b, 1, D, M); x_scales(xb, 1, D, M, s, &off);
    acc += LAST(__builtin_convertvector(IDOT(iq32(b, 0), i8x32_at(xb)), f8v) * s[0]);
  }
  return fold_acc(acc) - off;
}
#else
static inline float row_dot_q8(const unsigned char* restrict row, const unsigned char* restrict xq, int nb) {
  facc acc = 0; float off = 0, s[BPS], D[BPS], M[BPS];
  int j = 0;
  for (; j + BPS <= nb; j += BPS) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    AHEAD_N(b, BPS * BLOCK_BYTES);
    w_scales(b, BPS, D, M); x_scales(xb, BPS, D, M, s, &off);
    acc += __builtin_convertvector(STEP_DOT(STEP_W(b), xb), facc) * STEP_SCALES(s);
  }
  for (; j < nb; j++) {
    const unsigned char* b = row + j * BLOCK_BYTES; const unsigned char* xb = xq + j * XB;
    w_scales(b, 1, D, M); x_scales(xb, 1, D, M, s, &off);
    acc += LAST(__builtin_convertvector(IDOT(iq32(b, 0), i8x32_at(xb)), f8v) * s[0]);
  }
  return fold_acc(acc) - off;
}
#endif
/* one weight row's products with nbt (at most BT) rows of x: each step's weights unpacked once for all of them, each
   row's floats in row_dot_q8's order, so the same results */
static inline void rows_dot_q8(float* restrict out, long stride, const unsigned char* restrict row,
                               const unsigned char* restrict xq, int nb, int nbt) {
  facc acc[BT]; float off[BT], s[BPS], D[BPS], M[BPS];
  _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) { acc[i] = 0; off[i] = 0; }
  int j = 0;
  for (; j + BPS <= nb; j += BPS) {
    const unsigned char* b = row + j * BLOCK_BYTES;
    AHEAD_N(b, BPS * BLOCK_BYTES);
    __auto_type w = STEP_W(b);
    w_scales(b, BPS, D, M);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) if (i < nbt) {
      const unsigned char* xb = xq + ((long)i * nb + j) * XB;
      x_scales(xb, BPS, D, M, s, &off[i]);
      acc[i] += __builtin_convertvector(STEP_DOT(w, xb), facc) * STEP_SCALES(s);
    }
  }
  for (; j < nb; j++) {
    const unsigned char* b = row + j * BLOCK_BYTES;
    __auto_type w = iq32(b, 0);
    w_scales(b, 1, D, M);
    _Pragma("clang loop unroll(full)") for (int i = 0; i < BT; i++) if (i < nbt) {
      const unsigned char* xb = xq + ((long)i * nb + j) * XB;
      x_scales(xb, 1, D, M, s, &off[i]);
      acc[i] += LAST(__builtin_convertvector(IDOT(w, i8x32_at(xb)), f8v) * s[0]);
    }
  }
  for (int i = 0; i < nbt; i++) out[i * stride] = fold_acc(acc[i]) - off[i];
}
#if !IQ_MIN  /* a tile (prefill): WR weight rows against XR rows of x, WR x XR sums in registers. A step's x (loaded,
   its scales) serves WR weight rows, each row's unpacked weights and scales XR rows of x; each (row, x) sum in
   rows_dot_q8's order (s = dx D, the same float), so the same results. Q4_1 and Q5_1 (IQ_MIN) pass rows one at a
   time. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && IQ_SIGNED
/* signed weights: x + 128 (unsigned) times w by vpdpbusd, from -128 sum w (once a weight step): the same int32
   lanes as |w| times x with w's sign, without that sign taken per (row, x) */
typedef i8x64 tile_x;
typedef i32x16 tile_bias;
static inline i8x64 tile_xv(const unsigned char* xb) { return (i8x64)((u8x64)i8x64_pair(xb) ^ 0x80); }
static inline i32x16 tile_bias_of(i8x64 w) {
  return (i32x16)0 - (i32x16)__builtin_ia32_vpdpbusd512((i32x16)0, (i32x16)(u8x64)0x80, (i32x16)w); }
static inline i32x16 tile_dot(i32x16 bias, i8x64 w, i8x64 xu) {
  return (i32x16)__builtin_ia32_vpdpbusd512(bias, (i32x16)xu, (i32x16)w); }
#else
typedef __typeof__(STEP_XV((const unsigned char*)0)) tile_x;
typedef int tile_bias;
static inline tile_x tile_xv(const unsigned char* xb) { return STEP_XV(xb); }
#define tile_bias_of(w) 0
#define tile_dot(bias, w, x) (STEP_DOT_X(w, x))
#endif
static inline void tile_dot_q8(float* restrict out, long stride, const unsigned char* restrict w,
                               const unsigned char* restrict xq, int nb) {
  facc acc[WR][XR];
  _Pragma("clang loop unroll(full)") for (int r = 0; r < WR; r++)
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XR; i++) acc[r][i] = 0;
  int j = 0;
  for (; j + BPS <= nb; j += BPS) {
    __typeof__(STEP_W(w)) wv[WR]; tile_bias bias[WR]; facc dw[WR];
    _Pragma("clang loop unroll(full)") for (int r = 0; r < WR; r++) {
      const unsigned char* b = w + ((long)r * nb + j) * BLOCK_BYTES;
      float D[BPS], M[BPS];
      AHEAD_N(b, BPS * BLOCK_BYTES);
      w_scales(b, BPS, D, M);
      wv[r] = STEP_W(b); bias[r] = tile_bias_of(wv[r]); dw[r] = STEP_SCALES(D);
    }
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XR; i++) {
      const unsigned char* xb = xq + ((long)i * nb + j) * XB;
      float dx[BPS];
      _Pragma("clang loop unroll(full)") for (int k = 0; k < BPS; k++) __builtin_memcpy(&dx[k], xb + k * XB + X_D, 4);
      tile_x xv = tile_xv(xb); facc dxv = STEP_SCALES(dx);
      _Pragma("clang loop unroll(full)") for (int r = 0; r < WR; r++)
        acc[r][i] += __builtin_convertvector(tile_dot(bias[r], wv[r], xv), facc) * (dxv * dw[r]);
    }
  }
  for (; j < nb; j++)  /* an odd block last (AVX-512's steps of two) */
    _Pragma("clang loop unroll(full)") for (int r = 0; r < WR; r++) {
      const unsigned char* b = w + ((long)r * nb + j) * BLOCK_BYTES;
      __auto_type wb = iq32(b, 0); float D, M;
      iscales(b, &D, &M);
      _Pragma("clang loop unroll(full)") for (int i = 0; i < XR; i++) {
        const unsigned char* xb = xq + ((long)i * nb + j) * XB;
        float dx; __builtin_memcpy(&dx, xb + X_D, 4);
        acc[r][i] += LAST(__builtin_convertvector(IDOT(wb, i8x32_at(xb)), f8v) * (dx * D));
      }
    }
  _Pragma("clang loop unroll(full)") for (int r = 0; r < WR; r++)
    _Pragma("clang loop unroll(full)") for (int i = 0; i < XR; i++) out[i * stride + r] = fold_acc(acc[r][i]);
}
#define TILES 1
#endif
#endif
/* rows of x per block (a multiple of BT, at most 32, its int8 blocks at most 512 KiB: half an L2): each weight row
   passes every BT rows of a block while it is in L1, so a chunk streams the weights once per block, not once per BT
   rows of x (a 256-token chunk read the matrix 32 times). Not 64: at K 576 a block of 32 rows (23 KiB) stays in L1
   with the row, one of 64 did not (a stage's 512-token prefill 8% slower) */
enum { X_FIT = (512 << 10) / (PP_K / BLOCK_VALUES * XB) / BT * BT,
       XBLOCK = X_FIT < BT ? BT : X_FIT > 32 ? 32 : X_FIT };
/* weight row n's products with rows [b0, b1) of x, BT at a time */
static inline void rows_pass(float* restrict out, const unsigned char* restrict row, const unsigned char* restrict xq,
                             int N, int n, int b0, int b1) {
  enum { NB = PP_K / BLOCK_VALUES };
  for (; b0 < b1; b0 += BT) {
    int nbt = b1 - b0 < BT ? b1 - b0 : BT;
    const unsigned char* xb = xq + (long)b0 * NB * XB;
    if (nbt == 1) out[(long)b0 * N + n] = row_dot_q8(row, xb, NB);
    else rows_dot_q8(out + (long)b0 * N + n, N, row, xb, NB, nbt);
  }
}
#ifdef PP_GROUP  /* rows interleaved in groups at load (types.py's grouped) */
#include "matmul_groups.h"
#elif IQ_MIN  /* Q4_1, Q5_1: their own product (the offsets' x side once a call) */
#include "matmul_min.h"
#else
void NAME(float* restrict out, const unsigned char* restrict w, const unsigned char* restrict xq,
          const int* restrict dims, int core_id) {
  enum { K = PP_K, R = PP_ROWS, NB = K / BLOCK_VALUES };
  const int N = dims[0], B = dims[1], T = dims[2];
  int n0, n1; rows_part(N, R, T, core_id, &n0, &n1);
  for (int c0 = 0; c0 < B; c0 += XBLOCK) {
    int c1 = c0 + XBLOCK < B ? c0 + XBLOCK : B;
    int n = n0;
#ifdef TILES
    for (; n + WR <= n1 && c1 - c0 >= XR; n += WR) {  /* whole tiles, then the last rows of x one weight row a pass */
      const unsigned char* rows = w + (long)n * NB * BLOCK_BYTES;
      int b0 = c0;
      for (; b0 + XR <= c1; b0 += XR) tile_dot_q8(out + (long)b0 * N + n, N, rows, xq + (long)b0 * NB * XB, NB);
      for (int r = 0; r < WR; r++) rows_pass(out, rows + (long)r * NB * BLOCK_BYTES, xq, N, n + r, b0, c1);
    }
#endif
    for (; n < n1; n++) rows_pass(out, w + (long)n * NB * BLOCK_BYTES, xq, N, n, c0, c1);
  }
}
#endif

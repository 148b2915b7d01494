/* One row of x with AVX-512, Q6_K: the lanes of k4_lanes.h over a half-block's 64 bytes of low 4 bits; each lane's 2
   high bits from qh (its 32 bytes in both halves of a vector) by a shift per lane, looked up in a table of 16
   (h & 3) - 32; the 4 lanes of a quarter share a scale. Cache-hot, one thread: 1.13-1.23x the group-by-group
   decoder. */
#if defined(__AVX512F__)
static const f16v THI = {-32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16};
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  /* lane l, nibble m of half c: byte 4 l + m / 2 of ql's 64 */
  LANES(xp, x, 2 * nb, 128, 8, 64 * (m & 1) + m / 2 + 4 * l)
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
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict xp,
                                   const float* restrict xs, int nb) {
  f16v acc = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
    f16v sf = __builtin_convertvector(sc, f16v) * half_at(b + 208);
    HALF(0) HALF(1)
  }
  return hsum(acc);
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
#elif defined(__AVX2__)
#include "avx2.h"
/* One row of x with AVX2, Q6_K: a quarter's 32 six-bit values put together as bytes in 8 int32 lanes (ql's nibbles
   and qh's bit pairs, four instructions for the 32), then byte k of every lane masked where it lies, converted and
   multiplied by x scaled by 2^-8k. Lanes 0-3 hold the quarter's first 16 values and 4-7 the next 16, so the sum is
   scaled by a vector of the two scales; the -32 is taken off once per block, by x's sums per 16. */
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int s = 0; s < 16 * nb; s++) xs[s] = hsum(f_at(x + 16 * s));
  bytes_x(x, xp, 8 * nb);
  return xp;
}
#define Q6_HALF(h) { \
  u32x8 l0 = u32x8_at(b + 64 * h), l1 = u32x8_at(b + 64 * h + 32), hb = u32x8_at(b + 128 + 32 * h); \
  const float* p = xp + 256 * j + 128 * h; \
  acc += bytes_dot((l0 & 0x0F0F0F0F) | ((hb << 4) & 0x30303030), p) * PAIR(sf, 8 * h) \
       + bytes_dot((l1 & 0x0F0F0F0F) | ((hb << 2) & 0x30303030), p + 32) * PAIR(sf, 8 * h + 2) \
       + bytes_dot(((l0 >> 4) & 0x0F0F0F0F) | (hb & 0x30303030), p + 64) * PAIR(sf, 8 * h + 4) \
       + bytes_dot(((l1 >> 4) & 0x0F0F0F0F) | ((hb >> 2) & 0x30303030), p + 96) * PAIR(sf, 8 * h + 6); }
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict xp,
                                 const float* restrict xs, int nb) {
  f8v acc = 0, offs = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    PREFETCH(b, BLOCK_BYTES);
    i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
    f16v sf = __builtin_convertvector(sc, f16v) * half_at(b + 208);
    offs += __builtin_shufflevector(sf, sf, 0, 1, 2, 3, 4, 5, 6, 7) * f8_at(xs + 16 * j)
          + __builtin_shufflevector(sf, sf, 8, 9, 10, 11, 12, 13, 14, 15) * f8_at(xs + 16 * j + 8);
    Q6_HALF(0) Q6_HALF(1)
  }
  return hsum8(acc - 32.0f * offs);
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
#endif

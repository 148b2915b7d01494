#include "iq4.h"
/* One row of x with AVX-512: the way of k4_lanes.h over IQ4_XS's layout. 64 bytes (4 sub-blocks of 32) read as 16
   int32 lanes of 8 nibbles, each lane within one sub-block; nibble m of all lanes looked up at once in the 16 levels;
   x put in the lanes' order once per call; the 4 sub-blocks' scales applied once to their lanes' sums. */
#if defined(__AVX512F__)
static inline const float* prep_x_avx512(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  /* lane l, nibble m of half c: byte 4 (l % 4) + m / 2 of sub-block l / 4 */
  LANES(xp, x, 2 * nb, 128, 8, 32 * (l / 4) + 4 * (l % 4) + m / 2 + 16 * (m & 1))
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
static inline float row_dot_avx512(const unsigned char* restrict row, const float* restrict xp,
                                   const float* restrict xs, int nb) {
  f16v acc = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    f8v sc;
    _Pragma("clang loop unroll(full)") for (int g = 0; g < 8; g++) sc[g] = iq4_scale(b, g);
    IQ4_HALF(0) IQ4_HALF(1)
  }
  return hsum(acc);
}
#define ROW_DOT row_dot_avx512
#define PREP_X prep_x_avx512
#endif

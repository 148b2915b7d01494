/* One row of x with AVX2, Q8_0: a block's 32 bytes as 8 int32 lanes, byte k of each brought to the top (bits 24-31,
   so its sign is the lane's) by a shift and a mask, converted and multiplied by x scaled by 2^-24 (byte lanes,
   avx2.h), in place of four widening loads (vpmovsxbd); the block's d widened from its half by two instructions
   (vpbroadcastw, vcvtph2ps) where the generic C takes four, and applied to the block's sum. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#include "avx2.h"
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int j = 0; j < nb; j++)
    for (int k = 0; k < 4; k++)
      for (int l = 0; l < 8; l++) xp[32 * j + 8 * k + l] = x[32 * j + 4 * l + k] * 0x1p-24f;
  return xp;
}
static inline f8v q8_dot(const unsigned char* b, const float* p) {  /* a block's sum of q x, 8 lanes, not scaled */
  u32x8 q = u32x8_at(b + 2); const u32x8 top = 0xFF000000u;
  return fi32(q << 24) * f8_at(p) + fi32((q << 16) & top) * f8_at(p + 8) + fi32((q << 8) & top) * f8_at(p + 16)
       + fi32(q & top) * f8_at(p + 24);
}
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict xp,
                                 const float* restrict xs, int nb) {
  f8v acc0 = 0, acc1 = 0;
  int j = 0;
  for (; j + 1 < nb; j += 2) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    PREFETCH(b, 2 * BLOCK_BYTES);
    acc0 += h8_splat(b) * q8_dot(b, xp + 32 * j);
    acc1 += h8_splat(b + BLOCK_BYTES) * q8_dot(b + BLOCK_BYTES, xp + 32 * j + 32);
  }
  if (j < nb) acc0 += h8_splat(row + BLOCK_BYTES * j) * q8_dot(row + BLOCK_BYTES * j, xp + 32 * j);
  return hsum8(acc0 + acc1);
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
#endif

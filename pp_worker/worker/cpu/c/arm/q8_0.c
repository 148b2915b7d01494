/* Q8_0 with NEON (aarch64): the int8 values converted in 2 instructions per 4 (i8_f32) where clang makes 5 of the
   generic C. A decoder of the generic floats (q d), and a one-row product that scales each block's sum of q x once,
   as the generic one does, in 4-float lanes. Instructions per weight value under qemu (bench/arm_insns.py, K 2048):
   one row 1.29 (generic 2.12), 4 rows of x 3.52 (4.33), a gathered row 1.17 (1.98). */
#if defined(__ARM_NEON)
#include "neon.h"
static inline void decode32_neon(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b);
  _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {  /* unrolled: w stays in registers */
    float32x4_t f[4]; i8_f32(vld1q_s8((const signed char*)b + 2 + 16 * h), f);
    w[h] = join4(f) * d; } }
#define DECODE32 decode32_neon
static inline const float* prep_x_neon(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  return x; }  /* read as it is */
static inline float row_dot_neon(const unsigned char* restrict row, const float* restrict x,
                                 const float* restrict xs, int nb) {
  float32x4_t acc[4] = {0};  /* lane i of acc[k]: values 4 k + i and 16 + 4 k + i of every block */
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j; const float* xb = x + 32 * j;
    float32x4_t lo[4], hi[4];
    i8_f32(vld1q_s8((const signed char*)b + 2), lo); i8_f32(vld1q_s8((const signed char*)b + 18), hi);
    float d = half_at(b);
    for (int k = 0; k < 4; k++) {
      float32x4_t sum = vfmaq_f32(vmulq_f32(lo[k], vld1q_f32(xb + 4 * k)), hi[k], vld1q_f32(xb + 16 + 4 * k));
      acc[k] = vfmaq_n_f32(acc[k], sum, d);
    }
  }
  return vaddvq_f32((acc[0] + acc[1]) + (acc[2] + acc[3]));
}
#define ROW_DOT row_dot_neon
#define PREP_X prep_x_neon
#endif

/* Q4_K with NEON (aarch64): the nibbles converted through fp16 subnormals (nib_f32: q 2^-24, exactly; 1.75
   instructions per 4 values where clang makes ~4 of the generic C), the 2^-24 folded into the group's scale. A
   decoder of the generic floats (d q - dmin m: the same product, exact, so the same rounding), and a one-row product
   that multiplies each group's sum of q x by its scale and its min by x's group sum (dmin m sum(x), x's group sums
   made once per call): the dequantized product rearranged, exact to float32 rounding. Instructions per weight value
   under qemu (bench/arm_insns.py, K 2048): one row 1.12 (generic 2.24), 4 rows of x 3.73 (4.31), a gathered row
   1.35 (1.96). */
#if defined(__ARM_NEON)
#include "neon.h"
static inline void decode32_neon(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g] * 0x1p24f, n = sm[8 + g]; const unsigned char* q = b + 16 + 32 * (g >> 1);
  _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {  /* unrolled: w stays in registers */
    uint8x16_t v = vld1q_u8(q + 16 * h); float32x4_t f[4];
    nib_f32(g & 1 ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(15)), f);
    w[h] = d * join4(f) - n; } }
#define DECODE32 decode32_neon
static inline const float* prep_x_neon(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int g = 0; g < 8 * nb; g++) xs[g] = hsum(f_at(x + 32 * g) + f_at(x + 32 * g + 16));
  return x;
}
static inline float row_dot_neon(const unsigned char* restrict row, const float* restrict x,
                                 const float* restrict xs, int nb) {
  float32x4_t acc[2] = {0}, mins = vdupq_n_f32(0);
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j; const float* xb = x + 256 * j;
    f16v sm = scale_min(b);
    float32x4_t s[8];  /* group g's sum of q 2^-24 x, in 4 lanes */
    /* unrolled (2.0x the instructions of the group by group decoder, 1.5x with these two loops rolled): 32 bytes
       hold group 2 p in their low nibbles, 2 p + 1 in their high */
    _Pragma("clang loop unroll(full)") for (int p = 0; p < 4; p++) {
      float32x4_t e = vdupq_n_f32(0), o = vdupq_n_f32(0);
      _Pragma("clang loop unroll(full)") for (int h = 0; h < 2; h++) {
        uint8x16_t v = vld1q_u8(b + 16 + 32 * p + 16 * h); float32x4_t lo[4], hi[4];
        nib_f32(vandq_u8(v, vdupq_n_u8(15)), lo); nib_f32(vshrq_n_u8(v, 4), hi);
        for (int k = 0; k < 4; k++) {
          e = vfmaq_f32(e, lo[k], vld1q_f32(xb + 64 * p + 16 * h + 4 * k));
          o = vfmaq_f32(o, hi[k], vld1q_f32(xb + 64 * p + 32 + 16 * h + 4 * k)); }
      }
      s[2 * p] = e; s[2 * p + 1] = o;
    }
    f4v d0 = __builtin_shufflevector(sm, sm, 0, 1, 2, 3), d1 = __builtin_shufflevector(sm, sm, 4, 5, 6, 7);
    float32x4_t dv[2] = {(float32x4_t)(d0 * 0x1p24f), (float32x4_t)(d1 * 0x1p24f)};
#define SCALED(g) acc[g & 1] = vfmaq_laneq_f32(acc[g & 1], s[g], dv[g / 4], g % 4);  /* the lane: a constant */
    SCALED(0) SCALED(1) SCALED(2) SCALED(3) SCALED(4) SCALED(5) SCALED(6) SCALED(7)
    mins = vfmaq_f32(mins, (float32x4_t)__builtin_shufflevector(sm, sm, 8, 9, 10, 11), vld1q_f32(xs + 8 * j));
    mins = vfmaq_f32(mins, (float32x4_t)__builtin_shufflevector(sm, sm, 12, 13, 14, 15), vld1q_f32(xs + 8 * j + 4));
  }
  return vaddvq_f32(acc[0] + acc[1] - mins);
}
#define ROW_DOT row_dot_neon
#define PREP_X prep_x_neon
#endif

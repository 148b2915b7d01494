/* What the NEON files share: conversions of 8-bit and 4-bit values to float32 in fewer instructions than clang 14
   makes of the generic C's __builtin_convertvector (on aarch64 it widens through zip, shifts or masks, then sxtl or
   uxtl: 4-5 instructions per 4 values where these take 2-2.5), and the bridge from NEON's 4-float registers to the
   kernels' 16-float vectors (free: the same registers). */
#include <arm_neon.h>
static inline f16v join4(const float32x4_t f[4]) {
  f8v a = __builtin_shufflevector((f4v)f[0], (f4v)f[1], 0, 1, 2, 3, 4, 5, 6, 7);
  f8v b = __builtin_shufflevector((f4v)f[2], (f4v)f[3], 0, 1, 2, 3, 4, 5, 6, 7);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* 16 int8 as floats, exactly: byte i moved (tbl) to the top byte of int32 lane i % 4 of vector i / 4 (indexes past
   15 give 0), q << 24, then converted as a fixed-point number with 24 fraction bits: q. One tbl and one scvtf per 4. */
static const uint8x16_t TOP_BYTE[4] = {
  {255, 255, 255, 0, 255, 255, 255, 1, 255, 255, 255, 2, 255, 255, 255, 3},
  {255, 255, 255, 4, 255, 255, 255, 5, 255, 255, 255, 6, 255, 255, 255, 7},
  {255, 255, 255, 8, 255, 255, 255, 9, 255, 255, 255, 10, 255, 255, 255, 11},
  {255, 255, 255, 12, 255, 255, 255, 13, 255, 255, 255, 14, 255, 255, 255, 15}};
static inline void i8_f32(int8x16_t q, float32x4_t f[4]) {
  for (int i = 0; i < 4; i++) f[i] = vcvtq_n_f32_s32(vreinterpretq_s32_s8(vqtbl1q_s8(q, TOP_BYTE[i])), 24); }
/* 16 values 0..15 (one a byte) as floats times 2^-24, exactly: widened to 16 bits, each is the bit pattern of the
   fp16 subnormal q 2^-24, which fcvtl converts exactly (conversions never flush fp16 subnormals: FPUnpackCV). One
   widening per 8 and one fcvtl per 4; the caller scales by 2^24 where it applies a scale anyway. */
static inline void nib_f32(uint8x16_t q, float32x4_t f[4]) {
  uint16x8_t lo = vmovl_u8(vget_low_u8(q)), hi = vmovl_high_u8(q);
  f[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(lo))); f[1] = vcvt_high_f32_f16(vreinterpretq_f16_u16(lo));
  f[2] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(hi))); f[3] = vcvt_high_f32_f16(vreinterpretq_f16_u16(hi)); }

#if defined(__AVX512F__)
/* a group's 16 values as a table (d q - dmin m for q = 0..15), each value one lookup */
static inline void decode32_avx512(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 16 + 32 * (g >> 1);
  f16v t = d * FIOTA - n;
  for (int h = 0; h < 2; h++) { i32x16 v = i32_at(q + 16 * h); w[h] = LOOK(t, g & 1 ? v >> 4 : v); } }
#define DECODE32 decode32_avx512
#define QS 16
#define HIGH_BITS
#define VALUE(h, m) LOOK(FIOTA, (i32x16)(q >> (4 * (m))))
#include "k4_lanes.h"
#elif defined(__AVX2__)
#include "avx2.h"
/* One row of x with AVX2: a 32-byte run of qs (groups 2c and 2c + 1) as 8 int32 lanes of 8 nibbles; nibble m of
   lane l is value 4 l + m / 2 of group 2c + (m & 1), masked where it lies (the upper four after one shift by 16, the
   last by a shift by 28), so 3 instructions a value of 8 lanes (mask, convert, FMA). A group's scale multiplies its
   sum, its min x's group sum, as in k4_lanes.h. */
static const float NIBBLE_AT[8] = {1, 0x1p-4f, 0x1p-8f, 0x1p-12f, 1, 0x1p-4f, 0x1p-8f, 1};  /* x's scale, nibble m */
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int g = 0; g < 8 * nb; g++) xs[g] = hsum(f_at(x + 32 * g) + f_at(x + 32 * g + 16));
  for (int c = 0; c < 4 * nb; c++)
    for (int m = 0; m < 8; m++)
      for (int l = 0; l < 8; l++) xp[64 * c + 8 * m + l] = x[64 * c + 32 * (m & 1) + 4 * l + m / 2] * NIBBLE_AT[m];
  return xp;
}
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict xp,
                                 const float* restrict xs, int nb) {
  f8v acc0 = 0, acc1 = 0, mins = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    PREFETCH(b, BLOCK_BYTES);
    f16v sm = scale_min(b);
    float d[8]; __builtin_memcpy(d, &sm, 32); SPILL(d);
    mins += __builtin_shufflevector(sm, sm, 8, 9, 10, 11, 12, 13, 14, 15) * f8_at(xs + 8 * j);
    _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
      u32x8 q = u32x8_at(b + 16 + 32 * c), q2 = q >> 16;
      const float* p = xp + 256 * j + 64 * c;
      f8v e = fi32(q & 0xF) * f8_at(p) + fi32(q & 0xF00) * f8_at(p + 16) + fi32(q2 & 0xF) * f8_at(p + 32)
            + fi32(q2 & 0xF00) * f8_at(p + 48);
      f8v o = fi32(q & 0xF0) * f8_at(p + 8) + fi32(q & 0xF000) * f8_at(p + 24) + fi32(q2 & 0xF0) * f8_at(p + 40)
            + fi32(q >> 28) * f8_at(p + 56);
      acc0 += e * d[2 * c]; acc1 += o * d[2 * c + 1];
    }
  }
  return hsum8(acc0 + acc1 - mins);
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
#endif

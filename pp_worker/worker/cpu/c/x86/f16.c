/* One row of x with AVX2, F16: 64 values a step into 8 independent sums (the generic loop keeps 4, two f16v, and its
   FMAs wait on each other: 4 cycles each, 2 issued a cycle), x read as it is. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#include "avx2.h"
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  return x; }
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict x,
                                 const float* restrict xs, int nb) {
  f8v a[8] = {0};
  int j = 0;
  for (; j + 1 < nb; j += 2)
    _Pragma("clang loop unroll(full)") for (int i = 0; i < 8; i++) a[i] += h8_at(row + 64 * j + 16 * i) * f8_at(x + 32 * j + 8 * i);
  if (j < nb)
    _Pragma("clang loop unroll(full)") for (int i = 0; i < 4; i++) a[i] += h8_at(row + 64 * j + 16 * i) * f8_at(x + 32 * j + 8 * i);
  return hsum8(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
#endif

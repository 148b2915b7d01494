#if defined(__AVX512F__)
#define QS 48
#define HIGH_BITS u32x8 h8; __builtin_memcpy(&h8, b + 16, 32); \
  u32x16 hb = __builtin_shufflevector(h8, h8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
/* value m of lane l in half h is bit 8 (m / 2) + 4 h + (m & 1) (+ 2 in lanes 8-15) of qh's int32 l % 8; the fifth bit
   to bit 4: right by its place less 4, or left where its place is under 4 (m < 2 in half 0) */
#define AT(h, m) (8 * ((m) / 2) + 4 * (h) + ((m) & 1))
#define FIFTH(h, m) (AT(h, m) >= 4 ? hb >> ((u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} + (AT(h, m) - 4)) \
  : hb << ((u32x16){2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0} + (2 - AT(h, m))))
#define VALUE(h, m) LOOK5(FIOTA, FIOTA + 16, q >> (4 * (m)), FIFTH(h, m))
#include "k4_lanes.h"
#elif defined(__AVX2__)
#include "avx2.h"
/* One row of x with AVX2, Q5_K: a group's 32 five-bit values put together as bytes in 8 int32 lanes (its nibbles,
   and its fifth bits shifted out of qh to bit 4 of each byte: qh's 32 bytes are the 32 values' in every group), then
   summed as Q6_K's byte lanes; scales and mins as Q4_K's. */
static inline const float* prep_x_avx2(const float* restrict x, float* restrict xp, float* restrict xs, int nb) {
  for (int g = 0; g < 8 * nb; g++) xs[g] = hsum(f_at(x + 32 * g) + f_at(x + 32 * g + 16));
  bytes_x(x, xp, 8 * nb);
  return xp;
}
#define FIFTH(g) ((g) <= 4 ? (hb << (4 - (g))) & 0x10101010 : (hb >> ((g) - 4)) & 0x10101010)
static inline float row_dot_avx2(const unsigned char* restrict row, const float* restrict xp,
                                 const float* restrict xs, int nb) {
  f8v acc0 = 0, acc1 = 0, mins = 0;
  for (int j = 0; j < nb; j++) {
    const unsigned char* b = row + BLOCK_BYTES * j;
    f16v sm = scale_min(b);
    float d[8]; __builtin_memcpy(d, &sm, 32); SPILL(d);
    mins += __builtin_shufflevector(sm, sm, 8, 9, 10, 11, 12, 13, 14, 15) * f8_at(xs + 8 * j);
    u32x8 hb = u32x8_at(b + 16);
    _Pragma("clang loop unroll(full)") for (int c = 0; c < 4; c++) {
      u32x8 q = u32x8_at(b + 48 + 32 * c);
      const float* p = xp + 256 * j + 64 * c;
      acc0 += bytes_dot((q & 0x0F0F0F0F) | FIFTH(2 * c), p) * d[2 * c];
      acc1 += bytes_dot(((q >> 4) & 0x0F0F0F0F) | FIFTH(2 * c + 1), p + 32) * d[2 * c + 1];
    }
  }
  return hsum8(acc0 + acc1 - mins);
}
#define ROW_DOT row_dot_avx2
#define PREP_X prep_x_avx2
#endif

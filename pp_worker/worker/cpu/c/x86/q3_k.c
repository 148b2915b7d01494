#if defined(__AVX512F__)
#define QS 32
#define MINS 0
static const f16v TABLE = {-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3};
/* hmask's int32s in lanes 0-7 and again in 8-15, those of 0-7 shifted left by 2 (their bits reach 27 at most), so
   one right shift per lane brings value m's third bit to bit 2: the pair in bits 0-1, bit 3 whatever */
#define HIGH_BITS u32x8 h8; __builtin_memcpy(&h8, b, 32); \
  u32x16 hb = __builtin_shufflevector(h8 << 2, h8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#define INDEX (((q >> (2 * m)) & 3) | ((hb >> ((u32x16){0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2} \
  + (8 * (m / 4) + m % 4))) & ~3u))
#define SCALES u8x16 sv = 0; __builtin_memcpy(&sv, b + 96, 12); \
  u32x16 lo = __builtin_convertvector(__builtin_shufflevector(sv & 15, sv >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, \
                                                              19, 20, 21, 22, 23), u32x16); \
  u32x16 hi = __builtin_convertvector(__builtin_shufflevector(sv, sv, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, \
                                                              9, 10, 11), u32x16); \
  sd = (__builtin_convertvector((i32x16)(lo | ((hi >> (2 * (IOTA >> 2))) & 3) << 4), f16v) - 32.0f) \
       * half_at(b + 108);
#include "k23_lanes.h"
#endif

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
#endif

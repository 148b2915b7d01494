#if defined(__AVX512F__)
#define QS 16
#define MINS 1
static const f16v TABLE = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
#define INDEX (q >> (2 * m))
#define HIGH_BITS
#define SCALES u8x16 sb = u8_at(b); sd = fu8(sb & 15) * half_at(b + 80); \
  mins += fu8(sb >> 4) * half_at(b + 82) * f_at(xs + 16 * j);
#include "k23_lanes.h"
#endif

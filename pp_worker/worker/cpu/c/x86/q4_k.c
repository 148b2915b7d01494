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
#endif

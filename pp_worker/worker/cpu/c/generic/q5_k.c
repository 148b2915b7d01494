/* Q5_K (d, dmin, scales[12], qh[32], qs[128]): as Q4_K, the fifth bit of each value in bit g of qh[...] */
#include "k_scales.h"
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 48 + 32 * (g >> 1);
  for (int h = 0; h < 2; h++) {
    u8x16 v = u8_at(q + 16 * h), hb = u8_at(b + 16 + 16 * h);
    w[h] = d * fu8((g & 1 ? v >> 4 : v & 15) | (((hb >> g) & 1) << 4)) - n; } }
#ifdef PP_INT  /* the integer path (q8.h): as Q4_K's, the fifth bit from qh */
#define IQ_SIGNED 0
static inline u8x32 iq32(const unsigned char* b, int g) {
  u8x32 v = u8x32_at(b + 48 + 32 * (g >> 1)), h = u8x32_at(b + 16);
  return field8(v, 4 * (g & 1), 0, 4) | field8(h, g, 4, 1); }
#define iscales k4_iscales
#endif

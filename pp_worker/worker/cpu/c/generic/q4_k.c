/* Q4_K (d, dmin, scales[12], qs[128]): group g holds the low (g even) or high (g odd) nibbles of qs[32 (g / 2) ..],
   sub-block g's scale and min */
#include "k_scales.h"
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 16 + 32 * (g >> 1);
  for (int h = 0; h < 2; h++) { u8x16 v = u8_at(q + 16 * h); w[h] = d * fu8(g & 1 ? v >> 4 : v & 15) - n; } }
#ifdef PP_INT  /* the integer path (q8.h): unsigned 4-bit values, a 6-bit scale and min per 32 */
#define IQ_SIGNED 0
#define GROUP_K 4  /* rows in groups (matmul_groups.h) */
static inline u8x32 iq32(const unsigned char* b, int g) {
  u8x32 v = u8x32_at(b + 16 + 32 * (g >> 1)); return g & 1 ? v >> 4 : v & 15; }
#define iscales k4_iscales
#endif

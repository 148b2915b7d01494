/* Q4_K (d, dmin, scales[12], qs[128]): group g holds the low (g even) or high (g odd) nibbles of qs[32 (g / 2) ..],
   sub-block g's scale and min */
#include "k_scales.h"
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  f16v sm = scale_min(b);
  float d = sm[g], n = sm[8 + g]; const unsigned char* q = b + 16 + 32 * (g >> 1);
  for (int h = 0; h < 2; h++) { u8x16 v = u8_at(q + 16 * h); w[h] = d * fu8(g & 1 ? v >> 4 : v & 15) - n; } }
#ifdef PP_INT  /* the integer path (q8.h): unsigned 4-bit values, a 6-bit scale and min per 32 */
#define IQ_SIGNED 0
static inline u8x32 iq32(const unsigned char* b, int g) {
  u8x32 v = u8x32_at(b + 16 + 32 * (g >> 1)); return g & 1 ? v >> 4 : v & 15; }
static inline void k4_scale_min(const unsigned char* q, int j, int* s, int* m) {  /* ggml's get_scale_min_k4 */
  if (j < 4) { *s = q[j] & 63; *m = q[j + 4] & 63; }
  else { *s = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); } }
static inline void iscales(const unsigned char* b, int* s, int* m, float* D, float* M) {
  for (int j = 0; j < 8; j++) { k4_scale_min(b + 4, j, &s[2 * j], &m[2 * j]); s[2 * j + 1] = s[2 * j];
    m[2 * j + 1] = m[2 * j]; }
  *D = half_at(b); *M = half_at(b + 2); }
#endif

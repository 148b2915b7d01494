/* Q3_K (hmask[32], qs[64], scales[12], d): as Q2_K, with a third bit from bit g of hmask[16 half ..] (clear: the value
   is 4 less) and 6-bit signed scales (minus 32) per 16, their low nibbles in bytes 0-7 and high bit pairs in bytes
   8-11 (ggml's kmask shuffle in dequantize_row_q3_K) */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b + 108); const unsigned char* q = b + 32 + 32 * (g >> 2), *s = b + 96;
  for (int h = 0; h < 2; h++) { int i = 2 * g + h;
    int sc = ((i < 8 ? s[i] & 15 : s[i - 8] >> 4) | ((s[8 + (i & 3)] >> (2 * (i >> 2))) & 3) << 4) - 32;
    u8x16 v = ((u8_at(q + 16 * h) >> (2 * (g & 3))) & 3) | (((u8_at(b + 16 * h) >> g) & 1) << 2);
    w[h] = (fu8(v) - 4.0f) * (d * sc); } }
#ifdef PP_INT  /* the integer path (q8.h): the unsigned 3-bit value u = q + 4 (its bit pair, the hmask bit as bit 2),
   d s u - d (4 s): the 4 taken off as a min of 4 s per 16, d as both D and M */
#define IQ_SIGNED 0
#define GROUP_K 3  /* rows in groups (matmul_groups.h) */
static inline u8x32 iq32(const unsigned char* b, int g) {
  return field8(u8x32_at(b + 32 + 32 * (g >> 2)), 2 * (g & 3), 0, 2) | field8(u8x32_at(b), g, 2, 1); }
static inline void iscales(const unsigned char* b, i16x16* sl, i16x16* m, float* D, float* M) {
  u8x16 v = 0; __builtin_memcpy(&v, b + 96, 12);  /* not 16: the block ends 2 bytes after its scales */
  u16x16 lo = __builtin_convertvector(__builtin_shufflevector(v & 15, (u8x16)((u16x8)v >> 4) & 15, 0, 1, 2, 3, 4, 5, 6,
                                                              7, 16, 17, 18, 19, 20, 21, 22, 23), u16x16);
  u16x16 hi = __builtin_convertvector(__builtin_shufflevector(v, v, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10,
                                                              11), u16x16);
  const u16x16 at = {0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6};
  i16x16 s = (i16x16)(lo | ((hi >> at) & 3) << 4) - 32;  /* sub-block k's scale, k = 0..15 */
  *sl = __builtin_shufflevector(s, s, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  *m = s * 4; *D = *M = half_at(b + 108); }
#endif

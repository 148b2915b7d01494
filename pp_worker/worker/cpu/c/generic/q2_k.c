/* Q2_K (scales[16], qs[64], d, dmin): group g is bit pair g % 4 of qs[32 (g / 4) ..]; each half of it a sub-block of
   16 with a 4-bit scale (low nibble of scales[2g + half]) and a 4-bit min (its high nibble) */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = half_at(b + 80), dmin = half_at(b + 82); const unsigned char* q = b + 16 + 32 * (g >> 2);
  for (int h = 0; h < 2; h++) { int sc = b[2 * g + h];
    w[h] = fu8((u8_at(q + 16 * h) >> (2 * (g & 3))) & 3) * (d * (sc & 15)) - dmin * (sc >> 4); } }
#ifdef PP_INT  /* the integer path (q8.h): unsigned 2-bit values; per 16 a 4-bit scale (d) and a 4-bit min (dmin) */
#define IQ_SIGNED 0
#define GROUP_K 2  /* rows in groups (matmul_groups.h) */
static inline u8x32 iq32(const unsigned char* b, int g) { return field8(u8x32_at(b + 16 + 32 * (g >> 2)), 2 * (g & 3),
                                                                        0, 2); }
/* sub-block k's scale (low nibble of scales[k]) for both its 16s' pairs in the groups' order (k = 2g: group g's
   first 16, 2g + 1 its second), its min (the high nibble) in the values' order, each byte beside a zero byte */
static inline void iscales(const unsigned char* b, i16x16* sl, i16x16* m, float* D, float* M) {
  u8x16 v = u8_at(b), s = v & 15, n = (u8x16)((u16x8)v >> 4) & 15, z = 0;
  *sl = (i16x16)__builtin_shufflevector(s, z, 0, 16, 2, 16, 4, 16, 6, 16, 8, 16, 10, 16, 12, 16, 14, 16, 1, 16, 3, 16,
                                        5, 16, 7, 16, 9, 16, 11, 16, 13, 16, 15, 16);
  *m = (i16x16)__builtin_shufflevector(n, z, 0, 16, 1, 16, 2, 16, 3, 16, 4, 16, 5, 16, 6, 16, 7, 16, 8, 16, 9, 16, 10,
                                       16, 11, 16, 12, 16, 13, 16, 14, 16, 15, 16);
  *D = half_at(b + 80); *M = half_at(b + 82); }
#endif

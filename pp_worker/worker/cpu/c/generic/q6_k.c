/* Q6_K (ql[128], qh[64], scales[16], d): group g is quarter g % 4 of half g / 4: low 4 bits from ql, 2 high bits from
   qh, a scale per 16 values. The bits of a group's 32 values are put together in one 32-byte vector; the scales
   converted all at once. */
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  int half = g >> 2, quarter = g & 3;
  const unsigned char* ql = b + 64 * half + 32 * (quarter & 1); const unsigned char* qh = b + 128 + 32 * half;
  i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);
  f16v ds = __builtin_convertvector(sc, f16v) * half_at(b + 208);
  u8x32 l, e; __builtin_memcpy(&l, ql, 32); __builtin_memcpy(&e, qh, 32);
  i8x32 q = (i8x32)((quarter >> 1 ? l >> 4 : l & 15) | (((e >> (2 * quarter)) & 3) << 4)) - 32;
  w[0] = ds[8 * half + 2 * quarter] * lo16(q); w[1] = ds[8 * half + 2 * quarter + 1] * hi16(q); }
#ifdef PP_INT  /* the integer path (q8.h): unsigned 6-bit values (q + 32), a signed scale per 16 (sub-block g's scale
   is scales[g]), the 32 taken back through the offsets: d sc (u - 32) = d sc u - d (32 sc) */
#define IQ_SIGNED 0
#define GROUP_K 6  /* rows in groups (matmul_groups.h) */
static inline u8x32 iq32(const unsigned char* b, int g) {
  int half = g >> 2, quarter = g & 3;
  u8x32 l = u8x32_at(b + 64 * half + 32 * (quarter & 1)), e = u8x32_at(b + 128 + 32 * half);
  return field8(l, 4 * (quarter >> 1), 0, 4) | field8(e, 2 * quarter, 4, 2); }
static inline void iscales(const unsigned char* b, i16x16* sl, i16x16* m, float* D, float* M) {
  i8x16 sc; __builtin_memcpy(&sc, b + 192, 16);  /* group g's halves: scales 2g and 2g + 1 */
  *sl = __builtin_convertvector(__builtin_shufflevector(sc, sc, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15),
                                i16x16);
  *m = 32 * __builtin_convertvector(sc, i16x16); *D = *M = half_at(b + 208); }
#endif

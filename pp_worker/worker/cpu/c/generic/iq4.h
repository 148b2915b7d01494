/* IQ4_NL and IQ4_XS: 4-bit indices into 16 fixed non-uniform levels (ggml's kvalues_iq4nl), times the scale of the
   block (IQ4_NL) or of the sub-block of 32 (IQ4_XS: 6-bit, minus 32, times the block's d; low 4 bits in scales_l,
   high 2 in scales_h). A group's low nibbles are its first 16 values, its high nibbles the next 16. The including
   file defines IQ4_XS (0 or 1) and IQ4_QS (where group g's 16 bytes start). */
static const f16v KV4 = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static inline float iq4_scale(const unsigned char* b, int g) {  /* d for IQ4_NL, d (ls - 32) for IQ4_XS */
#if IQ4_XS
  unsigned short sh; __builtin_memcpy(&sh, b + 2, 2);
  return half_at(b) * ((((b[4 + g / 2] >> 4 * (g & 1)) & 15) | (((sh >> 2 * g) & 3) << 4)) - 32);
#else
  return half_at(b);
#endif
}
static inline void decode32_generic(const unsigned char* b, int g, f16v* w) {
  float d = iq4_scale(b, g); u8x16 q = u8_at(b + IQ4_QS);
  for (int i = 0; i < 16; i++) { w[0][i] = KV4[q[i] & 15] * d; w[1][i] = KV4[q[i] >> 4] * d; } }
#ifdef PP_INT  /* the integer path (q8.h): the levels as signed bytes, IQ4_XS's 6-bit scale an integer per 32 */
#define IQ_SIGNED 1
#define GROUP_LEVELS 1  /* rows in groups (matmul_groups.h) */
static const i8x16 KV4_INT = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static inline i8x32 iq32(const unsigned char* b, int g) {
  u8x16 q = u8_at(b + IQ4_QS); i8x16 lo, hi;
#if defined(__SSSE3__)  /* the levels looked up 16 at once (pshufb) */
  typedef char v16qi_t __attribute__((vector_size(16)));
  lo = (i8x16)__builtin_ia32_pshufb128((v16qi_t)KV4_INT, (v16qi_t)(q & 15));
  hi = (i8x16)__builtin_ia32_pshufb128((v16qi_t)KV4_INT, (v16qi_t)(q >> 4));
#else
  for (int i = 0; i < 16; i++) { lo[i] = KV4_INT[q[i] & 15]; hi[i] = KV4_INT[q[i] >> 4]; }
#endif
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                 22, 23, 24, 25, 26, 27, 28, 29, 30, 31); }
#if IQ4_XS
#define IQ_NO_MIN 1  /* m and M are 0: matmul_int.c's one-row product skips their term */
static inline void iscales(const unsigned char* b, i16x16* sl, i16x16* m, float* D, float* M) {
  /* sub-block g's 6 bits: nibble g of scales_l[4] (bytes 4-7), bits 2g.. of scales_h (bytes 2-3); both halves of
     group g take it */
  u8x16 v = u8_at(b);
  u32x8 l = __builtin_convertvector(__builtin_shufflevector(v, v, 4, 4, 5, 5, 6, 6, 7, 7), u32x8);
  u32x8 h = __builtin_convertvector(__builtin_shufflevector(v, v, 2, 2, 2, 2, 3, 3, 3, 3), u32x8);
  const u32x8 lsh = {0, 4, 0, 4, 0, 4, 0, 4}, hsh = {0, 2, 4, 6, 0, 2, 4, 6};
  i16x8 s = __builtin_convertvector((i32x8)(((l >> lsh) & 15) | (((h >> hsh) & 3) << 4)) - 32, i16x8);
  *sl = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
  *m = 0; *D = half_at(b); *M = 0; }
#else
static inline void iscales(const unsigned char* b, float* D, float* M) { *D = half_at(b); *M = 0; }
#endif
#endif

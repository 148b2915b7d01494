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
static const i8x16 KV4_INT = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static inline i8x32 iq32(const unsigned char* b, int g) {
  u8x16 q = u8_at(b + IQ4_QS); i8x32 v;
  for (int i = 0; i < 16; i++) { v[i] = KV4_INT[q[i] & 15]; v[16 + i] = KV4_INT[q[i] >> 4]; }
  return v; }
static inline void iscales(const unsigned char* b, int* s, int* m, float* D, float* M) {
  for (int j = 0; j < BLOCK_VALUES / 16; j++) m[j] = 0;
#if IQ4_XS
  unsigned short sh; __builtin_memcpy(&sh, b + 2, 2);
  for (int g = 0; g < 8; g++) s[2 * g] = s[2 * g + 1] = (((b[4 + g / 2] >> 4 * (g & 1)) & 15) | (((sh >> 2 * g) & 3)
                                                         << 4)) - 32;
#else
  s[0] = s[1] = 1;
#endif
  *D = half_at(b); *M = 0; }
#endif

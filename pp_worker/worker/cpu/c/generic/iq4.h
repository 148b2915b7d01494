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

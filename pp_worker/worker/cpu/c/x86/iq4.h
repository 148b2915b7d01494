/* IQ4_NL and IQ4_XS with AVX-512: the 16 levels times the scale as a table, each value one lookup */
#if defined(__AVX512F__)
static inline void decode32_avx512(const unsigned char* b, int g, f16v* w) {
  f16v t = KV4 * iq4_scale(b, g); i32x16 q = i32_at(b + IQ4_QS);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }
#define DECODE32 decode32_avx512
#endif

/* IQ4_NL and IQ4_XS with AVX-512: the 16 levels times the scale as a table, each value one lookup. With AVX2: the
   levels looked up as bytes (vpshufb, 16 at once), widened, converted and times the scale: the same floats. */
#if defined(__AVX512F__)
static inline void decode32_avx512(const unsigned char* b, int g, f16v* w) {
  f16v t = KV4 * iq4_scale(b, g); i32x16 q = i32_at(b + IQ4_QS);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }
#define DECODE32 decode32_avx512
#elif defined(__AVX2__)
typedef char v16qi __attribute__((vector_size(16)));
static const i8x16 KV4_I8 = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static inline void decode32_avx2(const unsigned char* b, int g, f16v* w) {
  float d = iq4_scale(b, g); u8x16 q = u8_at(b + IQ4_QS);
  i8x16 lo = (i8x16)__builtin_ia32_pshufb128((v16qi)KV4_I8, (v16qi)(q & 15));
  i8x16 hi = (i8x16)__builtin_ia32_pshufb128((v16qi)KV4_I8, (v16qi)(q >> 4));
  w[0] = __builtin_convertvector(lo, f16v) * d; w[1] = __builtin_convertvector(hi, f16v) * d; }
#define DECODE32 decode32_avx2
#endif

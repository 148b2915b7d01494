/* Q4_1 with AVX-512: as Q4_0, a table of the block's 16 values */
#if defined(__AVX512F__)
static inline void decode32_avx512(const unsigned char* b, int g, f16v* w) {
  f16v t = FIOTA * half_at(b) + half_at(b + 2); i32x16 q = i32_at(b + 4);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }
#define DECODE32 decode32_avx512
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#define P_QS 4
#define P_QH 0
#define P_MIN 1
#define P_OFF 0
#define P_LEVELS 0
#include "pairs_avx2.h"
#endif
#include "pairs512.h"
#if defined(PP_INT) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define IQ_U 0  /* the one-row step's bytes: q */
static inline u8x32 iq32u(const unsigned char* b) {
  return block_nibbles(b + 4); }
#endif

/* Q4_0 with AVX-512: each value looked up in a table of its block's 16 possible values (vpermps), one lookup where
   the generic decoder spends a conversion and a multiply-add (bench/NOTES.md) */
#if defined(__AVX512F__)
static inline void decode32_avx512(const unsigned char* b, int g, f16v* w) {
  f16v t = (FIOTA - 8.0f) * half_at(b); i32x16 q = i32_at(b + 2);
  w[0] = LOOK(t, q); w[1] = LOOK(t, q >> 4); }
#define DECODE32 decode32_avx512
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#define P_QS 2
#define P_QH 0
#define P_MIN 0
#define P_OFF 8
#define P_LEVELS 0
#include "pairs_avx2.h"
#endif
#include "pairs512.h"
#if defined(PP_INT) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define IQ_U 8  /* the one-row step's bytes: q + 8 */
static inline u8x32 iq32u(const unsigned char* b) {
  return block_nibbles(b + 2); }
#endif

#include "iq4.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#define P_QS 2
#define P_QH 0
#define P_MIN 0
#define P_OFF 128
#define P_LEVELS 1
#include "pairs_avx2.h"
#endif
#include "pairs512.h"
#if defined(PP_INT) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* the one-row step's products: |level| looked up (vpshufb), x negated where the level is negative (its index below 8:
   vptestnmb and a masked subtract); one vpdpbusd where the level + 128 and x's sums times 128 took two (1.09x) */
#define IQ_DOT32 iq_dot32
static inline i32x8 iq_dot32(const unsigned char* b, i8x32 x) {
  typedef char v32qi_t __attribute__((vector_size(32)));
  u8x32 n = block_nibbles(b + 2);
  i8x16 mag16 = __builtin_elementwise_abs(KV4_INT);
  const u8x32 mag = (u8x32)__builtin_shufflevector(mag16, mag16, S16(0), S16(0));
  return dot32u((u8x32)__builtin_ia32_pshufb256((v32qi_t)mag, (v32qi_t)n), (n & 8) == 0 ? -x : x); }
#endif

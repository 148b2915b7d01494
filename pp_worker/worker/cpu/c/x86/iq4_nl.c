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
#define IQ_U 128  /* the one-row step's bytes: the level + 128 (vpshufb) */
static inline u8x32 iq32u(const unsigned char* b) {
  typedef char v32qi_t __attribute__((vector_size(32)));
  const u8x32 levels = (u8x32)__builtin_shufflevector(KV4_INT, KV4_INT, S16(0), S16(0)) ^ 128;
  return (u8x32)__builtin_ia32_pshufb256((v32qi_t)levels, (v32qi_t)block_nibbles(b + 2)); }
#endif

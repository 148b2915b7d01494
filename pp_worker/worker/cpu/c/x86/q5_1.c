#define Q5_QH 4
#define Q5_MIN 1
#define Q5_OFF 0
#include "q5_row.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#define P_QS 8
#define P_QH 4
#define P_MIN 1
#define P_OFF 0
#define P_LEVELS 0
#include "pairs_avx2.h"
#endif
#include "pairs512.h"
#if defined(PP_INT) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define IQ_U 0  /* the one-row step's bytes: q */
static inline u8x32 iq32u(const unsigned char* b) {
  return block_fifth(block_nibbles(b + 8), b + 4); }
#endif

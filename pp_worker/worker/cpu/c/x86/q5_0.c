#define Q5_QH 2
#define Q5_MIN 0
#define Q5_OFF -16
#include "q5_row.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#define P_QS 6
#define P_QH 2
#define P_MIN 0
#define P_OFF 16
#define P_LEVELS 0
#include "pairs_avx2.h"
#endif
#include "pairs512.h"
#if defined(PP_INT) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define IQ_U 16  /* the one-row step's bytes: q + 16 */
static inline u8x32 iq32u(const unsigned char* b) {
  return block_fifth(block_nibbles(b + 6), b + 2); }
#endif

#include "iq4.h"
#if defined(__AVX2__) && !defined(__AVX512F__)
#define P_QS 2
#define P_QH 0
#define P_MIN 0
#define P_OFF 128
#define P_LEVELS 1
#include "pairs_avx2.h"
#endif

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

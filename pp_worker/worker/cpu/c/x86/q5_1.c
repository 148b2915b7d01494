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

/* IQ4_NL (d, qs[16]) */
#define IQ4_XS 0
#define IQ4_QS 2
#include "iq4.h"

/* IQ4_XS (d, scales_h, scales_l[4], qs[128]) */
#define IQ4_XS 1
#define IQ4_QS (8 + 16 * g)
#include "iq4.h"

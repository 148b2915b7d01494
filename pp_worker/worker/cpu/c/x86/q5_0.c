#define Q5_QH 2
#define Q5_MIN 0
#define Q5_OFF -16
#include "q5_row.h"

#define Q5_QH 4
#define Q5_MIN 1
#define Q5_OFF 0
#include "q5_row.h"

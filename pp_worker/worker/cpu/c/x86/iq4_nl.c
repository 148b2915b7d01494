#include "iq4.h"

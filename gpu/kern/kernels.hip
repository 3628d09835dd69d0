/* The kernels, as HIP: hipcc builds them into a code object (devices.cmake). */
#include "kernels.h"

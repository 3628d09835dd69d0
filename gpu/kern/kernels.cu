/* The kernels, as CUDA: nvcc builds them into the fatbin cuda.c loads (devices.cmake). */
#include "kernels.h"

/* The cuda backend: dev.c over CUDA's driver API (dev_api.h). */
#define SD_DEV_CUDA 1
#include "dev.c"

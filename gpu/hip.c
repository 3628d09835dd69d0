/* The hip backend: dev.c over HIP's module API (dev_api.h). */
#define SD_DEV_HIP 1
#include "dev.c"

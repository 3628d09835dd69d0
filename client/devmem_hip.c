/* libshard's importer of HIP device memory: devmem_dev.c over HIP's API. */
#define SD_DEV_HIP  1
#define DEVMEM_OPEN shard_devmem_open_hip
#include "devmem_dev.c"

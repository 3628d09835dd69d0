/* libshard's importer of CUDA device memory: devmem_dev.c over CUDA's driver API. */
#define SD_DEV_CUDA 1
#define DEVMEM_OPEN shard_devmem_open_cuda
#include "devmem_dev.c"

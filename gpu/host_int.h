/* What the backends that keep their buffers in host memory share (host.c). */
#ifndef SD_HOST_INT_H
#define SD_HOST_INT_H

#include "sd/gpu.h"

int sd__host_alloc(size_t bytes, int flags, const char *tag, struct sd_mem *mem_p);
void sd__host_free(struct sd_mem *mem);

#endif

/* What the backends that keep their buffers in host memory share (host.c). */
#ifndef SD_HOST_INT_H
#define SD_HOST_INT_H

#include "sd/gpu.h"

#include <stdint.h>

int sd__host_alloc(int device, size_t bytes, int flags, const char *tag, struct sd_mem *mem_p);
void sd__host_free(struct sd_mem *mem);
/* the kernels every host-memory backend runs at once, whatever its queue */
void sd__host_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes);
void sd__host_zero(struct sd_gpu_queue *q, void *dst, size_t bytes);
int sd__host_sync(struct sd_gpu_queue *q);

/* What a backend's allocations on one device take: bytes added to *used (negative: freed), and
 * *peak raised to it (thread-safe: allocations are made on the loop and on workers) */
void sd__mem_count(uint64_t *used, uint64_t *peak, int64_t bytes);
/* the host's physical memory in bytes (0 where it cannot be told): an emulated device's */
uint64_t sd__host_memory_bytes(void);

/* pinned host memory where the backend has none of its own (emu-gpu) */
int sd__host_pinned_alloc(size_t bytes, void **p_p);
void sd__host_pinned_free(void *p);

#endif

/* How libshard maps a job's shared buffers (the gather pool, the staging slots) and moves bytes
 * into them: the registration's reply says what the fds are (RegisterReply.memory). "host":
 * memfds, mapped with mmap and filled with memcpy. "cuda": a GPU's VMM memory as POSIX fd
 * handles, imported (cuMemImportFromShareableHandle), mapped at a reserved range (read-only for
 * the pool) and filled with cuMemcpy; the driver is opened at run time, so one libshard runs
 * everywhere. */
#ifndef SHARD_DEVMEM_H
#define SHARD_DEVMEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct shard_devmem {
    const char *name;
    bool host;   /* its pointers are host memory the caller may read and write */
    bool memfds; /* its fds are memfds (their sizes can be checked) */
    /* map `bytes` of the allocation fd stands for (fd stays the caller's to close) */
    int (*map)(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen);
    void (*unmap)(void *ptr, size_t bytes);
    /* dst = src (either may be host memory or the device's); dst = zeros */
    int (*copy)(void *dst, const void *src, size_t bytes, char *err, size_t errlen);
    int (*zero)(void *dst, size_t bytes, char *err, size_t errlen);
    /* NULL where the memory has no streams (host, emu-gpu). Else: enqueue on stream (the
     * device's, e.g. a CUstream) the write of value into *word, a 32-bit word of host memory
     * (the fence page), after the work enqueued before it; the page is registered with the
     * device on first use, and forget_host drops that before the page is unmapped. */
    int (*stream_write)(void *stream, uint32_t *word, uint32_t value, char *err, size_t errlen);
    void (*forget_host)(void *page, size_t bytes);
};

/* The importer for a reply's memory kind, opened on the daemon's device: the one whose UUID is
 * uuid ("GPU-" and hex digits; "" or not found: index `device`, the daemon's numbering), which
 * must be the calling thread's current one where it has a context (a trainer on another GPU is
 * refused naming both); NULL with err filled when this libshard or this machine cannot import. */
const struct shard_devmem *shard_devmem_open(const char *kind, int device, const char *uuid,
                                             char *err, size_t errlen);
/* libshard's waits for a device so far, every importer's (each copy or zeroing into device
 * memory waits for itself: shard_copy, shard_push_grad): what a trainer's hot path must not do */
extern _Atomic unsigned long long sd_devmem_waits;

/* the GPU importers (devmem_dev.c), where built */
const struct shard_devmem *shard_devmem_open_cuda(int device, const char *uuid, char *err,
                                                  size_t errlen);
const struct shard_devmem *shard_devmem_open_hip(int device, const char *uuid, char *err,
                                                 size_t errlen);

#endif

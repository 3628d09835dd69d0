/* libshard's importers of a job's shared buffers (devmem.h): host memfds, emu-gpu's emulated
 * device (memfds this process cannot touch either), and a GPU's VMM memory passed as POSIX fd
 * handles (devmem_dev.c, built for CUDA and HIP where their headers are; the driver opened at
 * run time, so that such a libshard still runs on machines without a GPU). */
#include "devmem.h"
#include "sd/region.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

/* ---- host memory: memfds */

static int host_map(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen)
{
    /* populated: the first fetches and pushes do not take the page faults. The pool is
     * private and read-only: pages never written read the daemon's shared memory, and a write
     * lands in a private copy that the write guard catches and discards (wguard.h) */
    void *p = mmap(NULL, bytes ? bytes : 1, read_only ? PROT_READ : PROT_READ | PROT_WRITE,
                   (read_only ? MAP_PRIVATE : MAP_SHARED) | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "mmap: %s", strerror(errno));
        return -errno;
    }
    *ptr_p = p;
    return 0;
}

static void host_unmap(void *ptr, size_t bytes)
{
    munmap(ptr, bytes ? bytes : 1);
}

static int host_copy(void *dst, const void *src, size_t bytes, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    memcpy(dst, src, bytes);
    return 0;
}

static int host_zero(void *dst, size_t bytes, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    memset(dst, 0, bytes);
    return 0;
}

static const struct shard_devmem host_mem = {.name = "host",
                                             .host = true,
                                             .memfds = true,
                                             .map = host_map,
                                             .unmap = host_unmap,
                                             .copy = host_copy,
                                             .zero = host_zero};

/* ---- emu-gpu: the daemon's emulated device (memfds), mapped so that this process cannot touch
 * it either: the pointers handed out are PROT_NONE reservations, the bytes behind them are
 * reached only through copy and zero, as a GPU's through cuMemcpy. A trainer that reads a
 * fetched unit on the host faults here as it would with a GPU's pointer. */

static struct sd_regions emu_regions = SD_REGIONS_INIT;

static int emu_map(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen)
{
    size_t len = bytes ? bytes : 1;
    void *back = mmap(NULL, len, read_only ? PROT_READ : PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, 0);
    if (back == MAP_FAILED) {
        snprintf(err, errlen, "mmap: %s", strerror(errno));
        return -errno;
    }
    void *dev = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct sd_region r = {
        .dev = (uintptr_t)dev, .len = len, .back = back, .fd = -1, .read_only = read_only};
    if (dev == MAP_FAILED || sd_region_add(&emu_regions, &r) != 0) {
        if (dev != MAP_FAILED)
            munmap(dev, len);
        munmap(back, len);
        snprintf(err, errlen, "out of memory for the device's addresses");
        return -ENOMEM;
    }
    *ptr_p = dev;
    return 0;
}

static void emu_unmap(void *ptr, size_t bytes)
{
    struct sd_region r;
    (void)bytes;
    if (ptr != NULL && sd_region_remove(&emu_regions, ptr, &r)) {
        munmap(ptr, r.len);
        munmap(r.back, r.len);
    }
}

/* p's bytes behind the device address, or p itself (host memory); NULL where the copy may not
 * go (past an allocation, a write into a read-only one) */
static void *emu_at(void *p, size_t bytes, bool write, const char *what, char *err, size_t errlen)
{
    struct sd_region r;
    bool past_end;
    void *at = sd_region_host(&emu_regions, p, bytes, &past_end);
    if (at == NULL && !past_end)
        return p;
    if (past_end || (write && sd_region_find(&emu_regions, p, &r, NULL) && r.read_only)) {
        snprintf(err, errlen, "the %s (%p, %zu bytes) %s", what, p, bytes,
                 past_end ? "runs past the end of its device allocation"
                          : "is read-only device memory");
        return NULL;
    }
    return at;
}

static int emu_copy(void *dst, const void *src, size_t bytes, char *err, size_t errlen)
{
    if (bytes == 0)
        return 0;
    void *d = emu_at(dst, bytes, true, "copy's destination", err, errlen);
    void *s = d != NULL ? emu_at((void *)(uintptr_t)src, bytes, false, "copy's source", err, errlen)
                        : NULL;
    if (d == NULL || s == NULL)
        return -EFAULT;
    memcpy(d, s, bytes);
    return 0;
}

static int emu_zero(void *dst, size_t bytes, char *err, size_t errlen)
{
    void *d = bytes > 0 ? emu_at(dst, bytes, true, "destination", err, errlen) : dst;
    if (d == NULL)
        return -EFAULT;
    memset(d, 0, bytes);
    return 0;
}

static const struct shard_devmem emu_mem = {.name = "emu-gpu",
                                            .host = false,
                                            .memfds = true,
                                            .map = emu_map,
                                            .unmap = emu_unmap,
                                            .copy = emu_copy,
                                            .zero = emu_zero};

_Atomic unsigned long long sd_devmem_waits;

const struct shard_devmem *shard_devmem_open(const char *kind, int device, const char *uuid,
                                             char *err, size_t errlen)
{
    if (kind == NULL || kind[0] == '\0' || strcmp(kind, "host") == 0)
        return &host_mem;
    if (strcmp(kind, "emu-gpu") == 0)
        return &emu_mem;
#ifdef SHARD_CLIENT_CUDA
    if (strcmp(kind, "cuda") == 0)
        return shard_devmem_open_cuda(device, uuid, err, errlen);
#endif
#ifdef SHARD_CLIENT_HIP
    if (strcmp(kind, "hip") == 0)
        return shard_devmem_open_hip(device, uuid, err, errlen);
#endif
    (void)device;
    (void)uuid;
    snprintf(err, errlen,
             "the job's buffers are %s device memory, which this libshard cannot import (built "
             "without %s's headers; rebuild with them)",
             kind,
             strcmp(kind, "cuda") == 0  ? "CUDA"
             : strcmp(kind, "hip") == 0 ? "HIP"
                                        : kind);
    return NULL;
}

/* A table of emulated device allocations (region.c): each a range of "device addresses" (a
 * PROT_NONE reservation, so that the host faults on it as it would reading a GPU's pointer) and
 * the host memory behind it, which only the owner's copies and kernels touch. The daemon's
 * emu-gpu backend keeps one, libshard's emu-gpu importer another; the cuda and hip backends use
 * one, without backing, to answer which pointers are device memory. Thread-safe. */
#ifndef SD_REGION_H
#define SD_REGION_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_region {
    uintptr_t dev;
    size_t len;
    void *back; /* the host memory behind it, or NULL */
    int fd;     /* the owner's: what it frees with it */
    bool read_only;
    int device; /* the device it lives on (a backend driving several) */
};

struct sd_regions {
    pthread_mutex_t lock;
    struct sd_region *r; /* sorted by dev */
    size_t n, cap;
};

#define SD_REGIONS_INIT                                                                            \
    {                                                                                              \
        .lock = PTHREAD_MUTEX_INITIALIZER                                                          \
    }

int sd_region_add(struct sd_regions *t, const struct sd_region *r);
/* take out the region starting at dev (into *out): false when there is none */
bool sd_region_remove(struct sd_regions *t, const void *dev, struct sd_region *out);
/* the region p lies in (into *out, may be NULL) and the bytes from p to its end */
bool sd_region_find(struct sd_regions *t, const void *p, struct sd_region *out, size_t *room_p);
/* p's place in the backing of its region, for bytes from p on: NULL when p is not in one or the
 * bytes run past its end (*past_end_p says which) */
void *sd_region_host(struct sd_regions *t, const void *p, size_t bytes, bool *past_end_p);

#endif

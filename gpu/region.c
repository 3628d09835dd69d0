/* The device allocations of a backend whose memory the host cannot touch (host_int.h): emu-gpu
 * translates its addresses through them, and the cuda and hip backends answer is_device (what
 * the transport stages through pinned host memory) from them. A sorted array under a lock:
 * a job holds a few dozen allocations. */
#include "host_int.h"
#include "sd/status.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct region {
    uintptr_t dev;
    size_t len;
    struct sd_mem back;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct region *regions;
static size_t n_regions, cap_regions;

/* the index of the first region starting above a */
static size_t upper(uintptr_t a)
{
    size_t lo = 0, hi = n_regions;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (regions[mid].dev <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int sd__region_add(const void *dev, size_t len, const struct sd_mem *back)
{
    pthread_mutex_lock(&lock);
    if (n_regions == cap_regions) {
        size_t cap = cap_regions ? 2 * cap_regions : 64;
        struct region *r = realloc(regions, cap * sizeof(*r));
        if (r == NULL) {
            pthread_mutex_unlock(&lock);
            return SD_ENOMEM;
        }
        regions = r;
        cap_regions = cap;
    }
    size_t i = upper((uintptr_t)dev);
    memmove(&regions[i + 1], &regions[i], (n_regions - i) * sizeof(*regions));
    regions[i] = (struct region){.dev = (uintptr_t)dev, .len = len, .back = *back};
    n_regions++;
    pthread_mutex_unlock(&lock);
    return SD_OK;
}

bool sd__region_remove(const void *dev, struct sd_mem *back_p)
{
    pthread_mutex_lock(&lock);
    size_t i = upper((uintptr_t)dev);
    bool found = i > 0 && regions[i - 1].dev == (uintptr_t)dev;
    if (found) {
        *back_p = regions[i - 1].back;
        memmove(&regions[i - 1], &regions[i], (n_regions - i) * sizeof(*regions));
        n_regions--;
    }
    pthread_mutex_unlock(&lock);
    return found;
}

bool sd__region_find(const void *p, void **back_p, size_t *room_p)
{
    uintptr_t a = (uintptr_t)p;
    pthread_mutex_lock(&lock);
    size_t i = upper(a);
    bool found = i > 0 && a - regions[i - 1].dev < regions[i - 1].len;
    if (found) {
        const struct region *r = &regions[i - 1];
        if (back_p != NULL)
            *back_p = r->back.ptr != NULL ? (uint8_t *)r->back.ptr + (a - r->dev) : NULL;
        if (room_p != NULL)
            *room_p = r->len - (a - r->dev);
    }
    pthread_mutex_unlock(&lock);
    return found;
}

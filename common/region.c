/* A table of emulated device allocations (sd/region.h): a sorted array under a lock (a job
 * holds a few dozen allocations). */
#include "sd/region.h"
#include "sd/status.h"

#include <stdlib.h>
#include <string.h>

/* the index of the first region starting above a */
static size_t upper(const struct sd_regions *t, uintptr_t a)
{
    size_t lo = 0, hi = t->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->r[mid].dev <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int sd_region_add(struct sd_regions *t, const struct sd_region *r)
{
    pthread_mutex_lock(&t->lock);
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        struct sd_region *nr = realloc(t->r, cap * sizeof(*nr));
        if (nr == NULL) {
            pthread_mutex_unlock(&t->lock);
            return SD_ENOMEM;
        }
        t->r = nr;
        t->cap = cap;
    }
    size_t i = upper(t, r->dev);
    memmove(&t->r[i + 1], &t->r[i], (t->n - i) * sizeof(*t->r));
    t->r[i] = *r;
    t->n++;
    pthread_mutex_unlock(&t->lock);
    return SD_OK;
}

bool sd_region_remove(struct sd_regions *t, const void *dev, struct sd_region *out)
{
    pthread_mutex_lock(&t->lock);
    size_t i = upper(t, (uintptr_t)dev);
    bool found = i > 0 && t->r[i - 1].dev == (uintptr_t)dev;
    if (found) {
        *out = t->r[i - 1];
        memmove(&t->r[i - 1], &t->r[i], (t->n - i) * sizeof(*t->r));
        t->n--;
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

bool sd_region_find(struct sd_regions *t, const void *p, struct sd_region *out, size_t *room_p)
{
    uintptr_t a = (uintptr_t)p;
    pthread_mutex_lock(&t->lock);
    size_t i = upper(t, a);
    bool found = i > 0 && a - t->r[i - 1].dev < t->r[i - 1].len;
    if (found) {
        if (out != NULL)
            *out = t->r[i - 1];
        if (room_p != NULL)
            *room_p = t->r[i - 1].len - (a - t->r[i - 1].dev);
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

void *sd_region_host(struct sd_regions *t, const void *p, size_t bytes, bool *past_end_p)
{
    struct sd_region r;
    size_t room = 0;
    *past_end_p = false;
    if (!sd_region_find(t, p, &r, &room) || r.back == NULL)
        return NULL;
    if (bytes > room) {
        *past_end_p = true;
        return NULL;
    }
    return (uint8_t *)r.back + ((uintptr_t)p - r.dev);
}

#include "sd/interval.h"
#include "sd/util.h"

#include <stdlib.h>
#include <string.h>

static const struct sd_ival *sort_base;

static int by_size_desc(const void *a, const void *b)
{
    const struct sd_ival *x = &sort_base[*(const uint32_t *)a];
    const struct sd_ival *y = &sort_base[*(const uint32_t *)b];
    if (x->size != y->size)
        return x->size < y->size ? 1 : -1;
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    return *(const uint32_t *)a < *(const uint32_t *)b ? -1 : 1;
}

static int by_start(const void *a, const void *b)
{
    const struct sd_ival *x = &sort_base[*(const uint32_t *)a];
    const struct sd_ival *y = &sort_base[*(const uint32_t *)b];
    if (x->start != y->start)
        return x->start < y->start ? -1 : 1;
    if (x->size != y->size)
        return x->size < y->size ? 1 : -1;
    return *(const uint32_t *)a < *(const uint32_t *)b ? -1 : 1;
}

/* latest end first: the backward pass mirrors the forward one */
static int by_end_desc(const void *a, const void *b)
{
    const struct sd_ival *x = &sort_base[*(const uint32_t *)a];
    const struct sd_ival *y = &sort_base[*(const uint32_t *)b];
    if (x->end != y->end)
        return x->end > y->end ? -1 : 1;
    if (x->size != y->size)
        return x->size < y->size ? 1 : -1;
    return *(const uint32_t *)a < *(const uint32_t *)b ? -1 : 1;
}

static int size_class(uint64_t size)
{
    int c = 0;
    while (size >>= 1)
        c++;
    return c;
}

/* larger size classes first, then by start: big units settle, near-equal ones pack in time */
static int by_class_start(const void *a, const void *b)
{
    const struct sd_ival *x = &sort_base[*(const uint32_t *)a];
    const struct sd_ival *y = &sort_base[*(const uint32_t *)b];
    int cx = size_class(x->size), cy = size_class(y->size);
    if (cx != cy)
        return cx > cy ? -1 : 1;
    return by_start(a, b);
}

static int by_off(const void *a, const void *b)
{
    const struct sd_ival *x = *(const struct sd_ival *const *)a;
    const struct sd_ival *y = *(const struct sd_ival *const *)b;
    return (x->off > y->off) - (x->off < y->off);
}

/* Place the intervals in the given order, each in the smallest gap that holds it among those
 * already placed and live at the same time (else after them all). */
static uint64_t place(struct sd_ival *iv, uint32_t n, uint64_t align, const uint32_t *order,
                      const struct sd_ival **busy, uint8_t *placed)
{
    uint64_t peak = 0;
    memset(placed, 0, n);
    for (uint32_t oi = 0; oi < n; oi++) {
        struct sd_ival *cur = &iv[order[oi]];
        uint64_t size = sd_round_up(cur->size, align);
        uint32_t nb = 0;
        for (uint32_t j = 0; j < n; j++)
            if (placed[j] && iv[j].start < cur->end && cur->start < iv[j].end)
                busy[nb++] = &iv[j];
        qsort(busy, nb, sizeof(*busy), by_off);
        uint64_t best = UINT64_MAX, best_gap = UINT64_MAX, at = 0;
        for (uint32_t b = 0; b < nb; b++) {
            uint64_t limit = busy[b]->off;
            if (limit >= at && limit - at >= size && limit - at < best_gap) {
                best_gap = limit - at;
                best = at;
            }
            at = SD_MAX(at, sd_round_up(busy[b]->off + busy[b]->size, align));
        }
        cur->off = best == UINT64_MAX ? at : best;
        placed[order[oi]] = 1;
        peak = SD_MAX(peak, cur->off + size);
    }
    return peak;
}

uint64_t sd_ival_plan(struct sd_ival *iv, uint32_t n, uint64_t align)
{
    if (n == 0)
        return 0;
    uint32_t *order = malloc(n * sizeof(*order));
    const struct sd_ival **busy = malloc(n * sizeof(*busy));
    uint8_t *placed = malloc(n);
    uint64_t *first = malloc(n * sizeof(*first));
    if (order == NULL || busy == NULL || placed == NULL || first == NULL) {
        free(order);
        free(busy);
        free(placed);
        free(first);
        return UINT64_MAX;
    }
    /* several orders, the smallest peak wins: decreasing size (mixed sizes), start (the nearly
     * stack-like schedules of forward and backward passes), size class then start, latest end */
    for (uint32_t i = 0; i < n; i++)
        order[i] = i;
    sort_base = iv;
    qsort(order, n, sizeof(*order), by_size_desc);
    uint64_t peak = place(iv, n, align, order, busy, placed);
    for (uint32_t i = 0; i < n; i++)
        first[i] = iv[i].off;
    int (*const others[])(const void *, const void *) = {by_start, by_class_start, by_end_desc};
    for (size_t k = 0; k < sizeof(others) / sizeof(others[0]); k++) {
        qsort(order, n, sizeof(*order), others[k]);
        uint64_t p = place(iv, n, align, order, busy, placed);
        if (p < peak) {
            peak = p;
            for (uint32_t i = 0; i < n; i++)
                first[i] = iv[i].off;
        }
    }
    for (uint32_t i = 0; i < n; i++) /* the best placement found */
        iv[i].off = first[i];
    free(order);
    free(busy);
    free(placed);
    free(first);
    return peak;
}

uint64_t sd_ival_max_load(const struct sd_ival *iv, uint32_t n, uint64_t align)
{
    uint64_t best = 0;
    for (uint32_t i = 0; i < n; i++) { /* the load is highest at some interval's start */
        uint64_t load = 0;
        for (uint32_t j = 0; j < n; j++)
            if (iv[j].start <= iv[i].start && iv[i].start < iv[j].end)
                load += sd_round_up(iv[j].size, align);
        best = SD_MAX(best, load);
    }
    return best;
}

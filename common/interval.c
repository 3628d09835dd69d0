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

/* by a perturbed size, largest first (the randomized restarts) */
static const uint64_t *sort_key;
static int by_key_desc(const void *a, const void *b)
{
    uint64_t x = sort_key[*(const uint32_t *)a], y = sort_key[*(const uint32_t *)b];
    if (x != y)
        return x < y ? 1 : -1;
    return *(const uint32_t *)a < *(const uint32_t *)b ? -1 : 1;
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

/* place in this order; keep the placement in best[] if its peak beats *peak */
static void try_order(struct sd_ival *iv, uint32_t n, uint64_t align, const uint32_t *order,
                      const struct sd_ival **busy, uint8_t *placed, uint64_t *peak, uint64_t *best)
{
    uint64_t p = place(iv, n, align, order, busy, placed);
    if (p >= *peak)
        return;
    *peak = p;
    for (uint32_t i = 0; i < n; i++)
        best[i] = iv[i].off;
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
    uint64_t peak = UINT64_MAX;
    int (*const orders[])(const void *, const void *) = {by_size_desc, by_start, by_class_start,
                                                         by_end_desc};
    for (size_t k = 0; k < sizeof(orders) / sizeof(orders[0]); k++) {
        qsort(order, n, sizeof(*order), orders[k]);
        try_order(iv, n, align, order, busy, placed, &peak, first);
    }
    /* Still above the lower bound: restart largest-first with each size perturbed by up to a
     * quarter (units of near-equal size trade places), from a fixed seed (the same schedule
     * always gets the same plan), within about 2e7 overlap checks so that a plan of thousands
     * of gathers still takes well under a second. */
    uint64_t bound = sd_ival_max_load(iv, n, align), rng = 0x9e3779b97f4a7c15ull;
    uint64_t *key = malloc(n * sizeof(*key));
    uint32_t restarts = (uint32_t)SD_MIN(48, 20000000ull / ((uint64_t)n * n + 1));
    for (uint32_t r = 0; key != NULL && r < restarts && peak > bound; r++) {
        for (uint32_t i = 0; i < n; i++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17; /* xorshift64 */
            key[i] = iv[i].size + (uint64_t)((double)iv[i].size * (double)(rng >> 11) /
                                             (double)(1ull << 53) / 4.0);
        }
        sort_key = key;
        qsort(order, n, sizeof(*order), by_key_desc);
        try_order(iv, n, align, order, busy, placed, &peak, first);
    }
    free(key);
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

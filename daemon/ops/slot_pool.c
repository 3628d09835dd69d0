/* Offsets inside the pre-allocated gather pool: a sorted array of used extents, first fit.
 * The array is sized once (one extent per unit at most), so no call allocates. */
#include "slot_pool.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdlib.h>
#include <string.h>

int sd_slot_pool_init(struct sd_slot_pool *p, uint64_t capacity, uint32_t max_extents)
{
    memset(p, 0, sizeof(*p));
    p->used = calloc(max_extents ? max_extents : 1, sizeof(*p->used));
    if (p->used == NULL)
        return SD_ENOMEM;
    p->capacity = capacity;
    p->max_used = max_extents;
    return SD_OK;
}

void sd_slot_pool_fini(struct sd_slot_pool *p)
{
    free(p->used);
    memset(p, 0, sizeof(*p));
}

int sd_slot_pool_alloc(struct sd_slot_pool *p, uint64_t len, uint64_t align, uint64_t *off_p)
{
    if (p->n_used >= p->max_used || len == 0 || len > p->capacity)
        return SD_ENOSPC;
    uint64_t start = 0;
    for (uint32_t i = 0; i <= p->n_used; i++) {
        uint64_t cand = sd_round_up(start, align);
        uint64_t limit = i < p->n_used ? p->used[i].off : p->capacity;
        if (cand <= limit && limit - cand >= len) {
            memmove(&p->used[i + 1], &p->used[i], (p->n_used - i) * sizeof(p->used[0]));
            p->used[i] = (struct sd_extent){.off = cand, .len = len};
            p->n_used++;
            *off_p = cand;
            return SD_OK;
        }
        if (i < p->n_used)
            start = p->used[i].off + p->used[i].len;
    }
    return SD_ENOSPC;
}

void sd_slot_pool_free(struct sd_slot_pool *p, uint64_t off)
{
    for (uint32_t i = 0; i < p->n_used; i++)
        if (p->used[i].off == off) {
            memmove(&p->used[i], &p->used[i + 1], (p->n_used - i - 1) * sizeof(p->used[0]));
            p->n_used--;
            return;
        }
}

uint64_t sd_slot_pool_used_bytes(const struct sd_slot_pool *p)
{
    uint64_t s = 0;
    for (uint32_t i = 0; i < p->n_used; i++)
        s += p->used[i].len;
    return s;
}

int sd_slot_pool_take(struct sd_slot_pool *p, uint64_t off, uint64_t len)
{
    if (p->n_used >= p->max_used)
        return SD_ENOSPC;
    uint32_t i = 0;
    while (i < p->n_used && p->used[i].off < off)
        i++;
    memmove(&p->used[i + 1], &p->used[i], (p->n_used - i) * sizeof(p->used[0]));
    p->used[i] = (struct sd_extent){.off = off, .len = len};
    p->n_used++;
    return SD_OK;
}

/* The unit cache: residency of gathered copies in the gather pool, holds, and eviction of the
 * least recently released copy nobody holds. */
#include "unit_cache.h"
#include "sd/schedule.h"
#include "sd/status.h"

#include <stdlib.h>
#include <string.h>

int sd_unit_cache_init(struct sd_unit_cache *c, uint32_t n_units, uint32_t slots_per_unit,
                       uint64_t capacity)
{
    memset(c, 0, sizeof(*c));
    c->slots_per_unit = slots_per_unit;
    c->n_slots = n_units * slots_per_unit;
    c->units = calloc(c->n_slots ? c->n_slots : 1, sizeof(*c->units));
    if (c->units == NULL)
        return SD_ENOMEM;
    for (uint32_t i = 0; i < c->n_slots; i++) {
        c->units[i].unit = i / slots_per_unit;
        c->units[i].lslot = i % slots_per_unit;
        c->units[i].qrx = -1;
    }
    int status = sd_slot_pool_init(&c->spool, capacity, c->n_slots + 1);
    if (status != SD_OK) {
        free(c->units);
        c->units = NULL;
    }
    return status;
}

void sd_unit_cache_fini(struct sd_unit_cache *c)
{
    free(c->units);
    c->units = NULL;
    sd_slot_pool_fini(&c->spool);
}

int sd_unit_cache_reserve(struct sd_unit_cache *c, uint64_t bytes, uint64_t align, uint64_t *off_p)
{
    for (;;) {
        if (sd_slot_pool_alloc(&c->spool, bytes, align, off_p) == SD_OK)
            return SD_OK;
        struct sd_unit_state *victim = NULL;
        for (uint32_t v = 0; v < c->n_slots; v++) {
            struct sd_unit_state *us = &c->units[v];
            if (us->resident && !us->inflight && us->refs == 0 &&
                (victim == NULL || us->lru_tick < victim->lru_tick))
                victim = us;
        }
        if (victim == NULL)
            return SD_ENOSPC;
        sd_unit_cache_evict(c, victim);
    }
}

void sd_unit_cache_evict(struct sd_unit_cache *c, struct sd_unit_state *us)
{
    sd_slot_pool_free(&c->spool, us->pool_off);
    us->resident = false;
    us->plan_iv = SD_SCHED_NONE;
    c->evictions++;
}

bool sd_unit_cache_drop_stale(struct sd_unit_cache *c, struct sd_unit_state *us, uint64_t gen)
{
    if (!us->resident || us->gen == gen || us->refs != 0)
        return false;
    sd_slot_pool_free(&c->spool, us->pool_off);
    us->resident = false;
    return true;
}

bool sd_unit_cache_drop(struct sd_unit_cache *c, struct sd_unit_state *us)
{
    if (!us->resident || us->inflight || us->refs != 0)
        return false;
    sd_slot_pool_free(&c->spool, us->pool_off);
    us->resident = false;
    return true;
}

bool sd_unit_cache_others_hold(const struct sd_unit_cache *c, const uint32_t *holds)
{
    for (uint32_t i = 0; i < c->n_slots; i++) {
        const struct sd_unit_state *us = &c->units[i];
        if (us->inflight || (us->resident && us->refs > holds[us->unit]))
            return true;
    }
    return false;
}

void sd_unit_cache_hold(struct sd_unit_cache *c, struct sd_unit_state *us)
{
    (void)c;
    us->refs++;
}

void sd_unit_cache_unhold(struct sd_unit_cache *c, struct sd_unit_state *us, uint32_t n)
{
    us->refs -= n;
    if (n > 0 && us->refs == 0)
        us->lru_tick = ++c->tick;
}

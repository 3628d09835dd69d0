/* The unit cache (daemon/ops/unit_cache.c) alone: residency, holds, eviction of the least recently
 * released copy nobody holds, stale generations, drops; and a random run of reserve, hold,
 * release and drop against a second, naive model of the same rules (a list of resident copies
 * with their release times), which must pick the same victims and agree on what fits. */
#include "check.h"
#include "sd/schedule.h"
#include "sd/status.h"
#include "unit_cache.h"

#include <stdlib.h>
#include <string.h>

enum { UNIT = 4096 };

/* make copy us resident at a fresh place of UNIT bytes */
static int place(struct sd_unit_cache *c, struct sd_unit_state *us)
{
    uint64_t off;
    int st = sd_unit_cache_reserve(c, UNIT, 64, &off);
    if (st == SD_OK) {
        us->pool_off = off;
        us->resident = true;
    }
    return st;
}

static void basics(void)
{
    struct sd_unit_cache c;
    TH_CHECK(sd_unit_cache_init(&c, 5, 2, 3 * UNIT) == SD_OK, "init");
    TH_CHECK(c.n_slots == 10 && c.slots_per_unit == 2, "10 copies");
    TH_CHECK(sd_unit_cache_slot(&c, 3, 1) == &c.units[7] && c.units[7].unit == 3 &&
                 c.units[7].lslot == 1,
             "unit 3's copy of local rank 1");
    struct sd_unit_state *a = sd_unit_cache_slot(&c, 0, 0), *b = sd_unit_cache_slot(&c, 1, 0),
                         *d = sd_unit_cache_slot(&c, 2, 0), *e = sd_unit_cache_slot(&c, 3, 0);
    TH_CHECK(place(&c, a) == SD_OK && place(&c, b) == SD_OK && place(&c, d) == SD_OK,
             "three units fill the pool");
    sd_unit_cache_hold(&c, a);
    sd_unit_cache_hold(&c, b);
    sd_unit_cache_hold(&c, d);
    TH_CHECK(place(&c, e) == SD_ENOSPC && c.evictions == 0, "all held: no room, nothing evicted");
    /* release b, then a: b is the least recently released */
    sd_unit_cache_unhold(&c, b, 1);
    sd_unit_cache_unhold(&c, a, 1);
    TH_CHECK(a->lru_tick > b->lru_tick && a->refs == 0 && b->refs == 0, "release order");
    TH_CHECK(place(&c, e) == SD_OK && !b->resident && a->resident && c.evictions == 1 &&
                 b->plan_iv == SD_SCHED_NONE,
             "the least recently released copy goes first");
    sd_unit_cache_hold(&c, e);
    /* a copy a gather is filling is never a victim, and counts as space that comes back */
    a->inflight = true;
    uint32_t holds[5] = {0};
    TH_CHECK(sd_unit_cache_others_hold(&c, holds), "a gather in flight holds space");
    TH_CHECK(place(&c, b) == SD_ENOSPC, "in flight and held: no room");
    a->inflight = false;
    /* others_hold: d is held once; by this rank (holds) or by another */
    holds[2] = 1;
    holds[3] = 1;
    sd_unit_cache_unhold(&c, e, 0); /* a no-op: no release, no tick */
    TH_CHECK(e->lru_tick == 0 && e->refs == 1, "unhold of 0 does not count as a release");
    TH_CHECK(!sd_unit_cache_others_hold(&c, holds), "d is held by this rank only");
    holds[2] = 0;
    TH_CHECK(sd_unit_cache_others_hold(&c, holds), "d held by another rank");
    /* stale copies: resident, another generation, nobody holds them */
    a->gen = 1;
    TH_CHECK(!sd_unit_cache_drop_stale(&c, a, 1), "the current generation stays");
    TH_CHECK(!sd_unit_cache_drop_stale(&c, d, 2), "a held copy stays");
    TH_CHECK(sd_unit_cache_drop_stale(&c, a, 2) && !a->resident && c.evictions == 1,
             "a stale copy goes (not an eviction)");
    TH_CHECK(!sd_unit_cache_drop_stale(&c, a, 3), "twice: nothing");
    /* a client's drop */
    TH_CHECK(!sd_unit_cache_drop(&c, d), "a held copy is not dropped");
    sd_unit_cache_unhold(&c, d, 1);
    d->inflight = true;
    TH_CHECK(!sd_unit_cache_drop(&c, d), "a copy being gathered is not dropped");
    d->inflight = false;
    TH_CHECK(sd_unit_cache_drop(&c, d) && !d->resident, "dropped");
    TH_CHECK(sd_slot_pool_used_bytes(&c.spool) == UNIT, "one unit (e, held) left: %llu",
             (unsigned long long)sd_slot_pool_used_bytes(&c.spool));
    sd_unit_cache_fini(&c);
    TH_CHECK(c.units == NULL, "fini");
}

/* The naive model: per copy resident / refs / inflight / last release time. */
struct model {
    bool resident[16], inflight[16];
    uint32_t refs[16];
    uint64_t released[16], clock;
    uint32_t n, cap; /* copies, units of room */
};

static int model_victim(const struct model *m)
{
    int v = -1;
    for (uint32_t i = 0; i < m->n; i++)
        if (m->resident[i] && !m->inflight[i] && m->refs[i] == 0 &&
            (v < 0 || m->released[i] < m->released[v]))
            v = (int)i;
    return v;
}

static uint32_t model_used(const struct model *m)
{
    uint32_t u = 0;
    for (uint32_t i = 0; i < m->n; i++)
        u += m->resident[i] || m->inflight[i];
    return u;
}

static void random_run(unsigned seed)
{
    struct sd_unit_cache c;
    struct model m = {.n = 12, .cap = 5};
    TH_CHECK(sd_unit_cache_init(&c, 12, 1, (uint64_t)m.cap * UNIT) == SD_OK, "init");
    srand(seed);
    int disagree = 0;
    for (int step = 0; step < 4000; step++) {
        uint32_t i = (uint32_t)rand() % m.n;
        struct sd_unit_state *us = &c.units[i];
        switch (rand() % 6) {
        case 0: /* fetch: reserve if not resident, then hold */
            if (!m.resident[i] && !m.inflight[i]) {
                int want = model_used(&m) < m.cap ? -2 : model_victim(&m);
                uint64_t ev0 = c.evictions;
                int st = place(&c, us);
                if (want == -1) {
                    disagree += st != SD_ENOSPC;
                    break;
                }
                if (want >= 0) {
                    m.resident[want] = false;
                    disagree += c.evictions != ev0 + 1 || c.units[want].resident;
                } else {
                    disagree += c.evictions != ev0;
                }
                disagree += st != SD_OK;
                m.resident[i] = st == SD_OK;
                if (st != SD_OK)
                    break;
            }
            if (m.resident[i]) {
                sd_unit_cache_hold(&c, us);
                m.refs[i]++;
            }
            break;
        case 1: /* release */
        case 2:
            if (m.refs[i] > 0) {
                sd_unit_cache_unhold(&c, us, 1);
                if (--m.refs[i] == 0)
                    m.released[i] = ++m.clock;
            }
            break;
        case 3: /* drop */
            disagree +=
                sd_unit_cache_drop(&c, us) != (m.resident[i] && !m.inflight[i] && m.refs[i] == 0);
            if (m.refs[i] == 0 && !m.inflight[i])
                m.resident[i] = false;
            break;
        case 4: /* a gather starts or ends on a resident copy nobody holds */
            if (m.resident[i] && m.refs[i] == 0) {
                m.inflight[i] = !m.inflight[i];
                us->inflight = m.inflight[i];
            }
            break;
        default:
            break;
        }
        for (uint32_t j = 0; j < m.n; j++)
            disagree += c.units[j].resident != m.resident[j] || c.units[j].refs != m.refs[j];
    }
    TH_CHECK(disagree == 0, "seed %u: %d disagreements with the naive model", seed, disagree);
    TH_CHECK(c.evictions > 50, "seed %u: the run evicted (%llu)", seed,
             (unsigned long long)c.evictions);
    sd_unit_cache_fini(&c);
}

int main(void)
{
    basics();
    for (unsigned seed = 1; seed <= 5; seed++)
        random_run(seed);
    return th_summary("test_unit_cache");
}

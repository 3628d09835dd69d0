/* Planning the gathers of a frozen schedule; see sd/schedule.h. */
#include "sd/schedule.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdbool.h>
#include <string.h>

const char *sd_sched_op_name(enum sd_sched_op op)
{
    switch (op) {
    case SD_SCHED_FETCH:
        return "fetch";
    case SD_SCHED_RELEASE:
        return "release";
    case SD_SCHED_PUSH:
        return "push";
    }
    return "?";
}

uint64_t sd_sched_digest(const uint32_t *ops, uint32_t n)
{
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint32_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++) {
            h ^= (ops[i] >> (8 * b)) & 0xff;
            h *= 0x100000001b3ULL;
        }
    return h ^ n;
}

/* The position at which the prefetcher issues gather q (of gathers base..q, in fetch order):
 * once the leading rank has passed the fetch of gather f - 1, the daemon keeps gathers
 * f .. f + depth - 1 issued, as far as prefetch_bytes allows (the nearest always goes). */
static uint32_t issue_position(const struct sd_sched_plan *plan, const uint32_t *fpos,
                               uint32_t base, uint32_t q, const struct sd_sched_params *p)
{
    if (p->prefetch_depth == 0)
        return fpos[q];
    uint32_t f = q - base + 1 > p->prefetch_depth ? q + 1 - p->prefetch_depth : base;
    for (; f < q; f++) { /* the earliest window start whose bytes allow gather q */
        uint64_t bytes = 0;
        for (uint32_t i = f; i <= q; i++)
            bytes += plan->iv[i].size;
        if (p->prefetch_bytes == 0 || bytes <= p->prefetch_bytes)
            break;
    }
    return f == base ? 0 : fpos[f - 1] + 1;
}

int sd_sched_plan_build(const uint32_t *ops, uint32_t n, const uint64_t *slot_bytes,
                        uint32_t n_units, const struct sd_sched_params *p,
                        struct sd_sched_plan *plan, uint32_t *scratch)
{
    uint32_t *cur = scratch;                  /* the unit's current (or last) gather */
    uint32_t *holds = scratch + n_units;      /* its fetches not yet released */
    uint32_t *closed = scratch + 2 * n_units; /* position of the release that ended it */
    uint32_t *fpos = scratch + 3 * n_units;   /* per gather: the position of its first fetch */
    uint32_t n_iv = 0;
    for (uint32_t u = 0; u < n_units; u++) {
        cur[u] = SD_SCHED_NONE;
        holds[u] = closed[u] = 0;
    }
    for (uint32_t pos = 0; pos < n; pos++) {
        uint32_t u = sd_sched_unit_of(ops[pos]);
        enum sd_sched_op op = sd_sched_op_of(ops[pos]);
        if (u >= n_units || (op != SD_SCHED_FETCH && op != SD_SCHED_RELEASE && op != SD_SCHED_PUSH))
            return SD_EINVAL;
        plan->occ[pos] = SD_SCHED_NONE;
    }
    /* persistent units first: one gather each, issued at the start, live all step */
    for (uint32_t pos = 0; pos < n; pos++) {
        uint32_t u = sd_sched_unit_of(ops[pos]);
        if (sd_sched_op_of(ops[pos]) != SD_SCHED_FETCH || slot_bytes[u] >= p->persist_bytes ||
            cur[u] != SD_SCHED_NONE)
            continue;
        plan->iv[n_iv] = (struct sd_ival){.start = 0, .end = n, .size = slot_bytes[u]};
        plan->iv_unit[n_iv] = u;
        cur[u] = n_iv++;
    }
    uint32_t base = n_iv; /* the prefetch window counts the gathers from here on */
    for (uint32_t pos = 0; pos < n; pos++) {
        uint32_t u = sd_sched_unit_of(ops[pos]);
        enum sd_sched_op op = sd_sched_op_of(ops[pos]);
        bool persist = slot_bytes[u] < p->persist_bytes;
        if (op == SD_SCHED_RELEASE && holds[u] > 0 && --holds[u] == 0 && !persist) {
            plan->iv[cur[u]].end = pos + 1;
            closed[u] = pos;
        }
        if (op != SD_SCHED_FETCH)
            continue;
        if (holds[u]++ > 0 || persist) {
            plan->occ[pos] = cur[u]; /* held, or gathered for the whole step */
            continue;
        }
        /* a new gather, unless the last one of this unit is reused: fetched again soon after its
         * release, or its successor's prefetch would start before that release anyway */
        plan->iv[n_iv] = (struct sd_ival){.end = n, .size = slot_bytes[u]};
        fpos[n_iv] = pos;
        uint32_t at = issue_position(plan, fpos, base, n_iv, p);
        if (cur[u] != SD_SCHED_NONE && (pos - closed[u] <= p->reuse_distance || at <= closed[u])) {
            plan->iv[cur[u]].end = n; /* open again until its next release */
            plan->occ[pos] = cur[u];
            continue;
        }
        plan->iv[n_iv].start = at;
        plan->iv_unit[n_iv] = u;
        plan->occ[pos] = n_iv;
        cur[u] = n_iv++;
    }
    plan->n_iv = n_iv;
    plan->lower_bound = sd_ival_max_load(plan->iv, n_iv, p->align);
    plan->peak = sd_ival_plan(plan->iv, n_iv, p->align);
    return plan->peak == UINT64_MAX ? SD_ENOMEM : SD_OK;
}

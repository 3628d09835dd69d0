/* A job's fetch/release/push schedule (DESIGN.md sections 3 and 7): the sequence of calls one
 * rank makes in one step, recorded during the first step and then replayed. The planner turns a
 * frozen sequence into gathers: one lifetime interval per gather (a fetch that finds its unit
 * already gathered, because it is held, reused within reuse_distance or persistent, joins the
 * interval that gathered it), the position at which the prefetcher issues each gather, and a
 * fixed offset in the gather pool for each interval (sd_ival_plan). Pure; the daemon replays
 * the plan (daemon/ops/schedule.c). */
#ifndef SD_SCHEDULE_H
#define SD_SCHEDULE_H

#include "sd/interval.h"

#include <stdint.h>

enum sd_sched_op { SD_SCHED_FETCH = 1, SD_SCHED_RELEASE = 2, SD_SCHED_PUSH = 3 };
#define SD_SCHED_UNIT_MASK 0x0fffffffu
#define SD_SCHED_NONE      UINT32_MAX

static inline uint32_t sd_sched_entry(enum sd_sched_op op, uint32_t unit)
{
    return (uint32_t)op << 28 | (unit & SD_SCHED_UNIT_MASK);
}
static inline enum sd_sched_op sd_sched_op_of(uint32_t e)
{
    return (enum sd_sched_op)(e >> 28);
}
static inline uint32_t sd_sched_unit_of(uint32_t e)
{
    return e & SD_SCHED_UNIT_MASK;
}
const char *sd_sched_op_name(enum sd_sched_op op);
/* FNV-1a over the entries: what ranks and nodes compare */
uint64_t sd_sched_digest(const uint32_t *ops, uint32_t n);

struct sd_sched_params {
    uint32_t prefetch_depth; /* gathers issued ahead of the leading rank; 0: on demand */
    uint64_t prefetch_bytes; /* bytes of those gathers at most (the nearest always goes); 0: any */
    uint32_t reuse_distance; /* a unit fetched again at most this many positions after its
                                release stays gathered */
    uint64_t persist_bytes;  /* units smaller than this stay gathered all step, every step */
    uint64_t align;          /* offsets in the pool, a power of two */
};

/* Arrays are the caller's, each of n entries (n_iv <= n). */
struct sd_sched_plan {
    struct sd_ival *iv;   /* per gather: [issue position, end) and the pool offset */
    uint32_t *iv_unit;    /* per gather: its unit */
    uint32_t *occ;        /* per position: the gather a fetch uses, else SD_SCHED_NONE */
    uint32_t n_iv;        /* gathers, in issue order (issue positions never decrease) */
    uint64_t peak;        /* the pool this placement needs */
    uint64_t lower_bound; /* the largest sum of sizes live at once: no placement needs less */
};

/* Plan the gathers of ops[0..n) for units of slot_bytes[unit] (slot sizes, already multiplied
 * by the copies a node keeps). scratch holds 3 * n_units + n words. Returns SD_OK, SD_EINVAL for an
 * entry naming a unit >= n_units or an unknown op, SD_ENOMEM if the placement could not run. */
int sd_sched_plan_build(const uint32_t *ops, uint32_t n, const uint64_t *slot_bytes,
                        uint32_t n_units, const struct sd_sched_params *p,
                        struct sd_sched_plan *plan, uint32_t *scratch);

#endif

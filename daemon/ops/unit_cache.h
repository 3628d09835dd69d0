/* The unit cache: a job's gathered copies of units (one per unit, or one per unit and local
 * rank without the hierarchical gather), where they live in the gather pool, who holds them, and
 * which go when the pool is full (least recently released first). Pure bookkeeping over the
 * slot pool: no job, no I/O (unit tests build it alone). */
#ifndef SD_UNIT_CACHE_H
#define SD_UNIT_CACHE_H

#include "pull.h"
#include "slot_pool.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_bulk;
struct sd_xfer;
struct sd_job;

/* A gathered copy of a unit: one per unit, or one per unit and local rank when the hierarchical
 * gather is off. Across nodes a gather is in flight until every remote block arrived. */
struct sd_unit_state {
    uint64_t pool_off; /* bytes; valid while resident */
    uint64_t gen;      /* weights generation that was gathered */
    uint64_t lru_tick;
    uint64_t start_ns;
    uint32_t refs;
    uint32_t unit, lslot;
    uint32_t plan_iv;   /* the frozen schedule's gather whose place it occupies, or NONE */
    uint32_t remaining; /* remote blocks still to arrive */
    int32_t qrx;        /* with ,qw: the receive slot of the gather it leads, or -1 */
    uint64_t waiters;   /* local ranks whose fetch waits for this gather */
    bool resident, inflight;
    /* its slot is written but the device may still be writing it: the waiters are answered once
     * the job's queue reached ready_ticket (fetch.c); inflight meanwhile */
    bool answer_pending;
    /* this fill of its slot is on the pool's copies on the job's other GPUs (fetch.c) */
    bool published;
    uint64_t ready_ticket;
    int status;
    uint32_t suspect;
    struct sd_bulk **rb;   /* [group nodes - 1] */
    struct sd_xfer *req_x; /* [group nodes - 1] */
    struct sd_req_msg req;
    struct sd_job *job;
    struct sd_unit_state *batch_next; /* the next unit of a coalesced gather this one leads */
};

struct sd_unit_cache {
    struct sd_slot_pool spool;
    struct sd_unit_state *units; /* [n_slots]: unit u's copy for local rank l at u * per + l */
    uint32_t n_slots, slots_per_unit;
    uint64_t tick;      /* release clock: the least recent release goes first */
    uint64_t evictions; /* cached copies dropped to make room */
};

/* units[n_slots] with slots_per_unit copies of each unit, a pool of capacity bytes. */
int sd_unit_cache_init(struct sd_unit_cache *c, uint32_t n_units, uint32_t slots_per_unit,
                       uint64_t capacity);
void sd_unit_cache_fini(struct sd_unit_cache *c);
/* The copy of unit a local rank uses: the node's one, or its own without the hierarchy. */
static inline struct sd_unit_state *sd_unit_cache_slot(struct sd_unit_cache *c, uint32_t unit,
                                                       uint32_t local)
{
    return &c->units[(size_t)unit * c->slots_per_unit + (c->slots_per_unit > 1 ? local : 0)];
}
/* Room for bytes in the pool, evicting copies nobody holds, least recently released first:
 * SD_OK and the offset, or SD_ENOSPC when what is left is held or in flight. */
int sd_unit_cache_reserve(struct sd_unit_cache *c, uint64_t bytes, uint64_t align, uint64_t *off_p);
/* Drop a resident copy from the pool to make room (an eviction). */
void sd_unit_cache_evict(struct sd_unit_cache *c, struct sd_unit_state *us);
/* A resident copy nobody holds of another weights generation than gen: dropped (true), so the
 * fetch gathers it anew. */
bool sd_unit_cache_drop_stale(struct sd_unit_cache *c, struct sd_unit_state *us, uint64_t gen);
/* A copy nobody holds and no gather fills dropped from the pool (a client's drop): true if it
 * was resident. */
bool sd_unit_cache_drop(struct sd_unit_cache *c, struct sd_unit_state *us);
/* Another holder than the one with holds[] (fetches per unit) keeps a copy resident or in
 * flight: space that will come back. */
bool sd_unit_cache_others_hold(const struct sd_unit_cache *c, const uint32_t *holds);
/* One more hold, one fewer (a release: the copy becomes the most recently released). */
void sd_unit_cache_hold(struct sd_unit_cache *c, struct sd_unit_state *us);
void sd_unit_cache_unhold(struct sd_unit_cache *c, struct sd_unit_state *us, uint32_t n);

#endif

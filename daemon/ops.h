/* The operations of a job, one file each, and what they call of each other:
 *   dispatch.c   a ring entry to its operation; parked operations failed all at once
 *   fetch.c      fetch, release, drop; gathers across nodes; serving peers' pull requests
 *   push.c       push rounds, from the local ranks' gradients to the ordered retire into g
 *   step.c       the step's phases (gradient sync, norm, optimizer, refresh), one node or many
 *   optimizer.c  clipping and the optimizer through the device backend
 *   weights.c    the weights' all-gather after the optimizer (f_w < f_os)
 *   loading.c    initial values and the ready barrier */
#ifndef SD_OPS_H
#define SD_OPS_H

#include "job.h"
#include "registry.h"
#include "sd/ring.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_session;

/* room for a completion's message */
#define SD_OP_MSG_LEN SD_CQE_MSG_LEN

struct sd_push_entry {
    struct sd_session *s;
    uint64_t tag;
    uint64_t arrive_ns;
    uint32_t slot;
};

struct sd_push_round {
    uint32_t arrived;
    uint64_t first_ns;
    uint64_t seq; /* which round of its (unit, group) it collects: the micro-step */
};

/* A push round that crosses nodes: node partial, reduce-scatter in the partition group, and
 * without the 2-hop sync an all-reduce across the replication group, every micro-step. Up to
 * push_rounds of them are on the wire at once, each with its own buffers; they are applied to the
 * g shards in the order they started, so the sums do not depend on which finishes first. */
struct sd_node_round {
    struct sd_job *job;
    bool net_done; /* its transfers (and all-reduce) finished */
    bool quant;    /* ,qg: its blocks travel as int4 (quant.c's buffers of this round) */
    uint32_t unit;
    uint64_t seq, start_ns;
    uint32_t pending;
    int status;
    uint32_t suspect;
    size_t chunk;
    float *part; /* the node partial: buf, or the one rank's fp32 staging slot */
    float *buf;  /* [max unit] the node partial when it must be summed (NULL if never) */
    float *rs_recv, *rs_out, *ar_tmp; /* [G - 1 blocks], [block], [ar_tmp_count] */
    uint32_t chunk_arrivals[SD_TAG_MAX_CHUNKS];
    struct sd_allreduce ar;
};

/* a local round whose pushes all arrived, waiting for a node round */
struct sd_round_ref {
    uint32_t unit;
    uint64_t seq;
};

/* Push rounds are kept [unit][group][generation]: round n of (unit u, g-partition group g)
 * collects in generation n % round_gens. gi indexes job->push.rounds; its members' entries start at
 * gi * g_members in job->push.round_entries. */
static inline size_t sd_job_round_index(const struct sd_job *job, uint32_t u, uint32_t g,
                                        uint64_t n)
{
    return ((size_t)u * job->push.g_groups + g) * job->push.round_gens +
           (size_t)(n % job->push.round_gens);
}

static inline struct sd_push_entry *sd_job_round_ents(struct sd_job *job, size_t gi)
{
    return &job->push.round_entries[gi * job->push.g_members];
}

/* the unit and the group of round slot gi */
static inline uint32_t sd_job_round_unit(const struct sd_job *job, size_t gi)
{
    return (uint32_t)(gi / job->push.round_gens / job->push.g_groups);
}

static inline uint32_t sd_job_round_group(const struct sd_job *job, size_t gi)
{
    return (uint32_t)(gi / job->push.round_gens % job->push.g_groups);
}

/* Where local rank j's g shard of a unit sits in this node's reduced block of it (len floats
 * per shard): the block holds the k ranks' shards in local order when the g-partition group
 * spans nodes, else the f_g shards of the whole unit in unit order. */
static inline uint64_t sd_job_g_block_off(const struct sd_job *job, uint32_t j, uint64_t len)
{
    return job->gnodes[SD_STATE_G] > 1
               ? (uint64_t)j * len
               : (uint64_t)sd_plan_shard(&job->plan, SD_STATE_G, job->first_rank + j) * len;
}

/* ---- dispatch.c */
/* complete an operation that succeeded, counted in the job's statistics */
void sd_op_done(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t v0,
                uint64_t v1, uint64_t start_ns);
/* Complete parked operations with an error: push rounds, step and ready barriers, stalled
 * entries, and (with_fetches) ranks waiting for an in-flight gather. */
void sd_job_fail_parked(struct sd_job *job, int status, const char *msg, bool with_fetches);

/* ---- fetch.c */
/* false to stall the ring (the gather cannot start or its place is busy) */
bool sd_fetch(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t start);
void sd_fetch_release(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start);
void sd_fetch_drop(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                   uint64_t start);
/* a session leaves: its holds go */
void sd_fetch_release_holds(struct sd_job *job, struct sd_session *s);
/* A gather inside the node, done when this returns: a refresh of a held copy, or a prefetch. */
void sd_fetch_local_gather(struct sd_job *job, struct sd_unit_state *us);
/* A gather finished (or failed): answer every rank waiting for it. */
void sd_fetch_complete(struct sd_job *job, struct sd_unit_state *us);
/* Room in the pool: the frozen schedule's place, else the cache's (evicting); SD_EAGAIN: a
 * slower rank still uses the planned place. */
int sd_fetch_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p);
/* Start the gather of a slot whose pool place is set (the schedule's prefetch): inside the node
 * it is done when this returns; SD_EAGAIN when no transfer resources are free now. */
int sd_fetch_prefetch(struct sd_job *job, struct sd_unit_state *us);
/* would a gather of unit (copy lslot) join the open batch? */
bool sd_fetch_would_join(const struct sd_job *job, uint32_t unit, uint32_t lslot);
/* send the gathers sd_fetch_prefetch coalesced (a no-op when none wait) */
void sd_fetch_prefetch_flush(struct sd_job *job);
/* Start pulling the remote blocks of slot us (pool place set): SD_EAGAIN when no transfer
 * resources are free now. */
int sd_fetch_gather_start(struct sd_job *job, struct sd_unit_state *us);
/* serve the pull requests that waited for a newer generation or readiness */
void sd_fetch_serve_queue(struct sd_job *job);

/* ---- push.c */
/* false to stall: the rank is round_gens micro-steps ahead of its group */
bool sd_push(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* at a step: a round some ranks of a group pushed and others did not (msg says which) */
bool sd_push_partial_round(struct sd_job *job, char *msg, size_t len);

/* ---- step.c */
void sd_step(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* drive the step forward as far as it can go now; called again by every completion */
void sd_step_progress(struct sd_job *job);

/* ---- optimizer.c */
/* The optimizer on every local rank's shards for step job->steps + 1, once the gradients are
 * synchronized and the global sum of squares is known: clipping, AdamW or SGD with each tensor's
 * group's hyperparameters (job->opt.hparams), the cast into w, the gradients zeroed. used: a bit
 * per tensor that some rank gave a gradient (the others are left as they are), or NULL for every
 * tensor. Returns the global gradient norm. */
double sd_optimizer_apply(struct sd_job *job, double sumsq, const uint64_t *used);

/* ---- weights.c */
/* Does the weights' all-gather after the optimizer cross nodes (f_w < f_os, f_os > k)? */
bool sd_weights_remote(const struct sd_job *job);
/* Start unit u's exchanges with the os group's other nodes: job->step.pending counts them and
 * the last completion calls sd_step_progress; a post that failed sets job->step.status and
 * suspect and is returned. */
int sd_weights_exchange(struct sd_job *job, uint32_t u);
/* The parts of every local rank's w shards that other local ranks own (or that the exchange
 * received into another local holder), copied in. */
void sd_weights_local(struct sd_job *job);

/* ---- loading.c */
void sd_loading_init(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start);
void sd_loading_ready(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start);
/* the registration is agreed: the other nodes start receiving their initial values */
void sd_loading_start(struct sd_job *job);
/* Elements [lo, hi) of unit ul cover the weight shards of node m's ranks, which hold their
 * optimizer-state shards (model.h): all sd_loading_unit reads. A zero3 node gets 1/N of the
 * unit, not all of it. */
void sd_loading_range(const struct sd_job *job, uint32_t m, const struct sd_unit_layout *ul,
                      uint64_t *lo, uint64_t *hi);
/* fp32 values of unit's elements from src_off on (src[0] is element src_off, through this
 * node's sd_loading_range) into this node's shards: the masters and the weights in their dtype */
void sd_loading_unit(struct sd_job *job, uint32_t unit, const float *src, uint64_t src_off);
/* this node read its part of the checkpoint the job starts from: it is ready */
void sd_loading_loaded(struct sd_job *job);
/* node 0's rank 0 finished loading */
void sd_loading_remote_ready(struct sd_job *job);

#endif

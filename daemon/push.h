/* push.c: push rounds, from the local ranks' gradients to the ordered retire into g;
 * the round bookkeeping that step.c and quant.c read. */
#ifndef SD_PUSH_H
#define SD_PUSH_H

#include "job.h"
#include "coll/coll.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;

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

/* false to stall: the rank is round_gens micro-steps ahead of its group */
bool sd_push(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* at a step: a round some ranks of a group pushed and others did not (msg says which) */
bool sd_push_partial_round(struct sd_job *job, char *msg, size_t len);

#endif

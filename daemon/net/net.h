/* Transfers across nodes. The node-wide part (the transport, the cluster, the standing receives
 * for pull requests) is net_service.c's; a job's part (its all-reduces and exchanges bound to
 * the engine, the node rounds' sizes, the failure descriptions and deadlines of its transfers)
 * is job_net.c's, below every operation; its registrations, bulks and buffers are set up with
 * the job's memory (job_mem.c). Nothing here is used on a single node. */
#ifndef SD_NET_H
#define SD_NET_H

#include "coll/coll.h"
#include "job.h"
#include "net_service.h"
#include "pull.h"
#include "registry.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_cluster;
struct sd_registry;

/* gathers of one job on the wire at once, at most */
#define SD_MAX_GATHERS_INFLIGHT 8

/* ---- a job's (job_net.c) */
/* (its memory across nodes, set up and torn down with the job's memory: job_mem.h) */
void sd_job_net_cancel(struct sd_job *job);
/* describe the operation in flight (sd_job_activity) and the nodes it waits for, for failure
 * messages */
void sd_job_net_describe(const struct sd_job *job, char *out, size_t len);
/* The nodes the job's unfinished transfers are with, "0, 2" ("" when none). */
void sd_job_net_pending_peers(const struct sd_job *job, char *out, size_t len);
/* an operation across nodes in flight longer than op_timeout_ms fails the job, naming the nodes
 * it waits for */
void sd_job_net_sweep(struct sd_job *job, uint64_t now);
/* the registration p lies in (providers with FI_MR_LOCAL), or NULL */
void *sd_job_net_desc(const struct sd_job *job, const void *p);
/* Register [p, p + len) with the job's transport (job->xfer's table; nothing for a provider
 * that needs no registration): SD_OK or the provider's failure. */
int sd_job_net_reg(struct sd_job *job, const void *p, size_t len);
/* The ranks' os arenas, registered on the first read a peer asks of them (fetch_serve.c): not
 * pinned at the start of every job for what few jobs do. */
int sd_job_net_reg_os(struct sd_job *job);
/* Does each round's all-reduce add its sum into the g shard itself (sd_allreduce's acc)? */
bool sd_job_net_rounds_accumulate(const struct sd_job *job);
/* the sizes of a push node round's buffers (push.c lays them out): its all-reduce's temporary,
 * whether it sums its partial into a buffer of its own, and all its floats */
size_t sd_job_net_ar_tmp_floats(const struct sd_job *job, const struct sd_config *cfg);
bool sd_job_net_round_buf(const struct sd_job *job);
/* Across nodes, are the node blocks of a unit's reduce-scatter the k ranks' g shards in unit
 * order (f_w = 1, or the whole group inside the node)? Else each block is gathered shard by
 * shard (the nesting of model.h). */
static inline bool sd_job_net_g_ident(const struct sd_job *job)
{
    return job->gnodes[SD_STATE_G] == 1 || job->plan.f[SD_STATE_W] == 1;
}
size_t sd_job_net_round_floats(const struct sd_job *job, const struct sd_config *cfg);
/* An all-reduce across the replication group (job->xfer.members, R of them): what a push round
 * or the step's boundary hop gives. */
struct sd_job_allreduce {
    struct sd_allreduce *ar;
    uint32_t R, unit;
    uint64_t round; /* the tag's seq names the round (a micro-step) or, with step_sync, the step */
    bool step_sync;
    float *buf; /* count floats */
    size_t count;
    float *tmp; /* tmp_count floats (the push rounds' temporary: push.h) */
    size_t tmp_count;
    float *acc;   /* as sd_allreduce_param's, or NULL */
    bool scatter; /* only the reduce-scatter (sd_allreduce_param's) */
    /* encoded (the boundary hop under ,qg: int4 blocks; ,gwire: bf16 or fp16, sd/codec.h's
     * codec): the encodings' buffer and the unit's error feedback (quant.h); codec 0: fp32 */
    int codec;
    uint8_t *qbuf;
    float *qerr;
    sd_allreduce_cb cb;
    void *arg;
};
int sd_job_net_allreduce(struct sd_job *job, const struct sd_job_allreduce *a);
/* An exchange of kind with node x->peer: this node receives the message the peer sends (src
 * peer) and sends its own (src self). Fails like a post that failed when a tag field does not
 * fit. */
uint32_t sd_job_net_exchange(struct sd_job *job, struct sd_exchange_param *x, uint32_t kind,
                             uint32_t unit, uint32_t seq, int *status_p, uint32_t *suspect_p);

/* The job's view of the transport (job_tp.c): peers are the job's nodes, mapped to the cluster
 * nodes the coordinator confirmed. Opened with the job's network parts, closed with them. */
int sd_job_tp_open(struct sd_job *job);
void sd_job_tp_close(struct sd_job *job);
static inline struct sd_transport *sd_job_tp(const struct sd_job *job)
{
    return job->xfer.tp;
}

/* nodes of the replication group of this node's g shards, ascending */
static inline uint32_t sd_job_replication_nodes(const struct sd_job *job, uint32_t *out)
{
    uint32_t n = 0, G = job->gnodes[SD_STATE_G];
    for (uint32_t m = 0; m < job->nodes; m++)
        if (G == 1 || m % G == job->node % G)
            out[n++] = m;
    return n;
}

/* the first node of this node's partition group of group_nodes nodes (job->gnodes[state]) */
static inline uint32_t sd_job_group_first(const struct sd_job *job, uint32_t group_nodes)
{
    return job->node - job->node % group_nodes;
}

#endif

/* push.c: push rounds, from the local ranks' gradients to the ordered retire into g. Its state
 * (struct sd_push_state: the rounds, the node rounds and their buffers) is its own; the job
 * keeps a pointer (job->push, NULL until sd_push_create). */
#ifndef SD_PUSH_H
#define SD_PUSH_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_config;
struct sd_session;
struct sd_sqe;

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

/* At job creation, once plan and layout are known: the rounds' geometry (across nodes or not,
 * push_rounds generations); SD_ENOMEM. */
int sd_push_create(struct sd_job *job);
/* floats of the node rounds' buffers across nodes, every generation's (0 on one node) */
size_t sd_push_net_floats(const struct sd_job *job, const struct sd_config *cfg);
/* at registration: the rounds' bookkeeping (SD_ENOMEM) */
int sd_push_alloc(struct sd_job *job);
/* across nodes: the node rounds and their buffers, one allocation the caller registers with the
 * fabric (*mem_p, *floats_p); SD_ENOMEM */
int sd_push_net_setup(struct sd_job *job, float **mem_p, size_t *floats_p);
void sd_push_net_teardown(struct sd_job *job);
/* the node rounds' buffer, handed over to be freed off the loop (ptr NULL: none) */
struct sd_mem sd_push_take_net_mem(struct sd_job *job);
/* the job's memory goes; the job goes */
void sd_push_free(struct sd_job *job);
void sd_push_destroy(struct sd_job *job);
/* no node round is on the wire or waiting for one */
/* Local rounds whose reduction the device has not finished yet (waiting), and the loop's look
 * at them: completes those it finished, in order; true if any. */
bool sd_push_queue_waiting(const struct sd_job *job);
bool sd_push_queue_poll(struct sd_job *job);
bool sd_push_idle(const struct sd_job *job);
/* round 0's all-reduce temporary (the boundary hop borrows it: no round runs during the step,
 * nor at all where no round crosses nodes) and the
 * floats every round's has */
float *sd_push_ar_tmp(const struct sd_job *job);
size_t sd_push_ar_tmp_count(const struct sd_job *job);
/* round 0's node buffer (the largest unit's floats, registered with the fabric) where no push
 * round crosses nodes and it exists, else NULL: the boundary hop's buffer during the backward */
float *sd_push_idle_round_buf(const struct sd_job *job);

#endif

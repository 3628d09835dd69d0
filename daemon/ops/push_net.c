/* The push module's node rounds: their buffers in the backend's memory (one allocation, one
 * registration with the fabric), and what the boundary hop borrows of them (push.h). Part of
 * the push module (push_int.h). */
#include "net.h"
#include "push.h"
#include "push_int.h"
#include "push_round.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>

size_t sd_push_net_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    return job->nodes > 1 && job->push != NULL
               ? (size_t)job->push->round_gens * sd_job_net_round_floats(job, cfg)
               : 0;
}

int sd_push_net_setup(struct sd_job *job, float **mem_p, size_t *floats_p)
{
    struct sd_push_state *ps = job->push;
    const struct sd_config *cfg = job->reg->cfg;
    uint32_t G = job->gnodes[SD_STATE_G];
    uint64_t maxn = job->layout.max_unit_numel, block = G > 1 ? maxn / G : 0;
    size_t per_round = sd_job_net_round_floats(job, cfg);
    ps->ar_tmp_count = sd_job_net_ar_tmp_floats(job, cfg);
    ps->nr = calloc(ps->round_gens, sizeof(*ps->nr));
    char tag[96];
    snprintf(tag, sizeof(tag), "shardd-%s-rounds", job->name);
    int st = job->reg->dev->alloc(sd_job_rank_device(job, 0),
                                  (size_t)ps->round_gens * per_round * sizeof(float),
                                  SD_MEM_PRIVATE, tag, &ps->nr_mem);
    ps->rq_cap = job->layout.n_units * ps->round_gens;
    ps->round_queue = calloc(ps->rq_cap, sizeof(*ps->round_queue));
    if (!ps->nr || st != SD_OK || !ps->round_queue)
        return SD_ENOMEM;
    bool need_buf = sd_job_net_round_buf(job);
    for (uint32_t i = 0; i < ps->round_gens; i++) {
        struct sd_node_round *rd = &ps->nr[i];
        float *p = (float *)ps->nr_mem.ptr + (size_t)i * per_round;
        rd->job = job;
        rd->index = i;
        rd->ticket = calloc(G ? G : 1, sizeof(*rd->ticket));
        if (rd->ticket == NULL)
            return SD_ENOMEM;
        if (need_buf) {
            rd->buf = p;
            p += maxn + 16;
        }
        if (G > 1) {
            rd->rs_recv = p;
            p += (size_t)(G - 1) * block + 16;
            rd->rs_out = p;
            p += block + 16;
        }
        rd->ar_tmp = p;
    }
    *mem_p = ps->nr_mem.ptr;
    *floats_p = (size_t)ps->round_gens * per_round;
    return SD_OK;
}

void sd_push_net_teardown(struct sd_job *job)
{
    struct sd_push_state *ps = job->push;
    if (ps == NULL)
        return;
    for (uint32_t i = 0; ps->nr != NULL && i < ps->round_gens; i++)
        free(ps->nr[i].ticket);
    free(ps->nr); /* nr_mem goes with the job's other big buffers (sd_push_free) */
    free(ps->round_queue);
    ps->nr = NULL;
    ps->round_queue = NULL;
}

struct sd_mem sd_push_take_net_mem(struct sd_job *job)
{
    struct sd_mem m = {.fd = -1};
    if (job->push != NULL) {
        m = job->push->nr_mem;
        job->push->nr_mem = (struct sd_mem){.fd = -1};
    }
    return m;
}

float *sd_push_ar_tmp(const struct sd_job *job)
{
    return job->push->nr[0].ar_tmp;
}

size_t sd_push_ar_tmp_count(const struct sd_job *job)
{
    return job->push->ar_tmp_count;
}

float *sd_push_idle_round_buf(const struct sd_job *job)
{
    const struct sd_push_state *ps = job->push;
    return ps != NULL && ps->nr != NULL && !ps->node_rounds ? ps->nr[0].buf : NULL;
}

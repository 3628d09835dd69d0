/* Loading a checkpoint into a job of any world and plan (checkpoint.h): each node reads, on a
 * worker, the ranges of each state its ranks' shards need, then sets the fp32 masters and
 * moments and derives the weights in their dtype from the masters. */
#include "checkpoint_int.h"
#include "job.h"
#include "ops.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* state s of unit u's elements [lo, hi) (unit coordinates) into dst, tensor by tensor; padding
 * stays as it is (zero) */
static int read_unit_range(struct sd_job *job, struct sd_ckpt_reader *rd, uint32_t s, uint32_t u,
                           uint64_t lo, uint64_t hi, float *dst)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors; t++) {
        const struct sd_tensor_layout *tl = &job->layout.tensors[t];
        uint64_t a = SD_MAX(lo, tl->offset), z = SD_MIN(hi, tl->offset + tl->numel);
        if (a >= z)
            continue;
        int st = sd_ckpt_read(rd, s, t, a - tl->offset, z - tl->offset, dst + (a - lo), c->err,
                              sizeof(c->err));
        if (st != SD_OK)
            return st;
    }
    return SD_OK;
}

/* Unit u's part of load_buf: the masters over the node's range of it (sd_loading_range: every
 * local rank's w shard, read once for them all), then each local rank's moments over its os
 * shard. Returns its floats; with at, the read (load_work) or the copies into the arenas. */
static uint64_t unit_block(struct sd_job *job, uint32_t u, float *at, struct sd_ckpt_reader *rd)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint64_t os_stride = sd_arena_os_stride(job->layout.arena_numel[SD_STATE_OS]), lo, hi;
    sd_loading_range(job, job->node, ul, &lo, &hi);
    uint64_t n = hi - lo;
    if (at != NULL && rd != NULL)
        c->status = read_unit_range(job, rd, 0, u, lo, hi, at);
    else if (at != NULL)
        sd_loading_unit(job, u, at, lo);
    for (uint32_t r = 0; r < job->k; r++) {
        uint64_t b, e;
        sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
        float *os = (float *)sd_job_state(job, r, SD_STATE_OS) + ul->arena_off[SD_STATE_OS];
        for (uint32_t s = 1; s < c->src.n_states; s++, n += e - b) {
            if (at == NULL || c->status != SD_OK)
                continue;
            if (rd != NULL)
                c->status = read_unit_range(job, rd, s, u, b, e, at + n);
            else
                dev->copy(job->mem.queue, os + s * os_stride, at + n, (e - b) * sizeof(float));
        }
    }
    return n;
}

static void load_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    struct sd_ckpt_reader rd;
    if ((c->status = sd_ckpt_reader_init(&rd, &c->src, c->err, sizeof(c->err))) != SD_OK)
        return;
    float *at = c->load_buf;
    for (uint32_t u = 0; u < job->layout.n_units && c->status == SD_OK; u++)
        at += unit_block(job, u, at, &rd);
    c->loaded_bytes = rd.bytes_read;
    sd_ckpt_reader_free(&rd);
}

static void load_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (job->state != SD_JOB_LOADING)
        return; /* failed meanwhile: the parked calls were answered */
    if (c->status != SD_OK) {
        sd_job_fail(job, c->status, "loading the checkpoint: %s", c->err);
        return;
    }
    const struct sd_layout *l = &job->layout;
    float *at = c->load_buf;
    for (uint32_t u = 0; u < l->n_units; u++)
        at += unit_block(job, u, at, NULL);
    if (!sd_job_sync(job))
        return;
    free(c->load_buf);
    c->load_buf = NULL;
    for (uint32_t t = 0; t < l->n_tensors; t++)
        job->opt.tensor_steps[t] = c->src.tensors[t].steps;
    for (uint32_t g = 0; g < c->src.n_groups; g++)
        job->opt.hparams[g] = c->src.groups[g];
    job->steps = job->opt.applied = c->src.step;
    c->load_ns = sd_now_ns() - c->load_start_ns;
    SD_INFO("job", "job '%s': loaded step %llu from %s (%.1f MiB read in %.1f ms)", job->name,
            (unsigned long long)c->src.step, c->src.path, (double)c->loaded_bytes / 1048576.0,
            (double)c->load_ns / 1e6);
    sd_loading_loaded(job);
}

void sd_ckpt_load_start(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->load_start_ns = sd_now_ns();
    uint64_t floats = 0;
    for (uint32_t u = 0; u < job->layout.n_units; u++)
        floats += unit_block(job, u, NULL, NULL);
    c->load_buf = calloc(floats + 1, sizeof(float));
    if (c->load_buf == NULL) {
        sd_job_fail(job, SD_ENOMEM, "loading checkpoint %s: out of memory for %llu floats",
                    c->src.path, (unsigned long long)floats);
        return;
    }
    sd_ckpt__run_worker(job, load_work, load_after);
}

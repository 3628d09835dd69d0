/* The optimizer part of a step: the global norm, clipping, and AdamW or SGD on every local rank's
 * optimizer shard through the device backend (fp32 master weights and moments; the cast into
 * the w shard). */
#include "job.h"
#include "ops.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <math.h>

double sd_optimizer_apply(struct sd_job *job, double sumsq)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_layout *l = &job->layout;
    const struct sd_optim *o = &job->model.optim;
    uint64_t t = job->steps + 1;
    double norm = sqrt(sumsq) / (double)job->world;
    float scale = 1.0f / (float)job->world;
    if (o->max_grad_norm > 0.0f && norm > (double)o->max_grad_norm)
        scale = scale * (float)((double)o->max_grad_norm / (norm + 1e-6));

    /* every rank's optimizer shard: master weights, moments, its part of its g shard, cast into
     * its part of its w shard (the nesting of model.h: os in g in w) */
    const struct sd_plan *pl = &job->plan;
    uint64_t os_stride = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]);
    for (uint32_t r = 0; r < job->k; r++) {
        uint32_t rank = job->first_rank + r;
        float *os = sd_job_state(job, r, SD_STATE_OS);
        float *g = sd_job_state(job, r, SD_STATE_G);
        uint8_t *w = sd_job_state(job, r, SD_STATE_W);
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            uint64_t off = ul->arena_off[SD_STATE_OS], len = ul->numel / pl->f[SD_STATE_OS];
            float *gp = g + ul->arena_off[SD_STATE_G] +
                        sd_plan_nested_off(pl, SD_STATE_OS, SD_STATE_G, rank, ul->numel);
            uint8_t *wp = w + job->mem.w_off[u] +
                          sd_plan_nested_off(pl, SD_STATE_OS, SD_STATE_W, rank, ul->numel) *
                              sd_dtype_size(ul->dtype);
            if (o->kind == SD_OPTIM_ADAMW) {
                struct sd_adamw_args a = {.lr = o->lr,
                                          .beta1 = o->beta1,
                                          .beta2 = o->beta2,
                                          .eps = o->eps,
                                          .weight_decay = o->weight_decay,
                                          .step = t};
                dev->adamw(job->mem.queue, &a, os + off, os + os_stride + off,
                           os + 2 * os_stride + off, gp, scale, wp, ul->dtype, len);
            } else {
                struct sd_sgd_args a = {
                    .lr = o->lr, .momentum = o->momentum, .weight_decay = o->weight_decay};
                dev->sgd(job->mem.queue, &a, os + off, os + os_stride + off, gp, scale, wp,
                         ul->dtype, len);
            }
        }
        /* the optimizer zeroed its part of the g shard; the rest held replicas' sums */
        if (pl->f[SD_STATE_OS] > pl->f[SD_STATE_G])
            dev->zero(job->mem.queue, g, l->arena_numel[SD_STATE_G] * sizeof(float));
    }
    return norm;
}

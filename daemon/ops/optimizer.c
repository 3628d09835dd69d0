/* The optimizer part of a step: the global norm, clipping, and AdamW or SGD on every local rank's
 * optimizer shard through the device backend (fp32 master weights and moments; the cast into
 * the w shard). Each tensor is updated with its parameter group's hyperparameters of this step
 * and its own step count, and with skip_unused a tensor no rank gave a gradient is left as it
 * is, as torch's optimizers skip a parameter whose .grad is None. */
#include "job_module.h"
#include "job.h"
#include "optimizer.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The optimizer's bookkeeping: what a schedule and skipped tensors change. */
struct sd_optim_state {
    struct sd_hparams *hparams; /* [n_groups]: the parameter groups' current hyperparameters */
    uint64_t *tensor_steps;     /* [n_tensors]: optimizer steps that updated each tensor */
    double last_grad_norm;      /* of the last step taken */
    float handoff_scale;        /* a trainer optimizer's step: the gradient sums' factor */
    uint64_t applied;           /* the steps the os shards hold (sd_optim_applied) */
};

/* one rank's os shard of unit u: the arrays the kernels read and write, at element 0 of the
 * shard */
struct os_view {
    float *master, *m, *v, *g;
    uint8_t *w;
    size_t w_elem;
};

static void update_range(struct sd_job *job, const struct os_view *o, uint64_t at, uint64_t n,
                         uint32_t tensor, float scale)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_hparams *h = &job->opt->hparams[job->model.tensors[tensor].group];
    uint8_t *w = o->w + at * o->w_elem;
    int dtype = job->layout.units[job->model.tensors[tensor].unit].dtype;
    int kind = job->model.optim.kind;
    if (sd_optim_layout(kind) == SD_OPTIM_ADAMW) {
        struct sd_adamw_args a = {.lr = h->lr,
                                  .beta1 = h->beta1,
                                  .beta2 = h->beta2,
                                  .eps = h->eps,
                                  .weight_decay = h->weight_decay,
                                  .step = job->opt->tensor_steps[tensor] + 1,
                                  .l2 = kind == SD_OPTIM_ADAM};
        dev->adamw(job->mem.queue, &a, o->master + at, o->m + at, o->v + at, o->g + at, scale, w,
                   dtype, n);
    } else {
        struct sd_sgd_args a = {.lr = h->lr,
                                .momentum = h->momentum,
                                .weight_decay = h->weight_decay,
                                .nesterov = kind == SD_OPTIM_SGD_NESTEROV};
        dev->sgd(job->mem.queue, &a, o->master + at, o->m + at, o->g + at, scale, w, dtype, n);
    }
}

static bool tensor_used(const uint64_t *used, uint32_t t)
{
    return used == NULL || (used[t / 64] >> (t % 64) & 1u) != 0;
}

/* Unit u's part [b, e) of one rank's os shard: each tensor's piece with its group's
 * hyperparameters, or (no gradient anywhere) only its gradient zeroed, as the padding's is. */
static void update_unit(struct sd_job *job, const struct os_view *o, uint32_t u, uint64_t b,
                        uint64_t e, const uint64_t *used, float scale)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint64_t at = b; /* unit elements before it are done */
    for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors && at < e; t++) {
        const struct sd_tensor_layout *tl = &job->layout.tensors[t];
        uint64_t lo = SD_MAX(tl->offset, b), hi = SD_MIN(tl->offset + tl->numel, e);
        if (lo >= hi)
            continue;
        if (lo > at)
            dev->zero(job->mem.queue, o->g + (at - b), (lo - at) * sizeof(float));
        if (tensor_used(used, t))
            update_range(job, o, lo - b, hi - lo, t, scale);
        else
            dev->zero(job->mem.queue, o->g + (lo - b), (hi - lo) * sizeof(float));
        at = hi;
    }
    if (at < e)
        dev->zero(job->mem.queue, o->g + (at - b), (e - at) * sizeof(float));
}

/* the step's global gradient norm, and the factor the gradient sums are multiplied by (the
 * mean over the ranks, unscaled by the step's loss scale, clipped); with a loss scale that is a
 * power of two both are bitwise those of the same gradients unscaled */
static float grad_scale(const struct sd_job *job, double sumsq, double S, double *norm_p)
{
    const struct sd_optim *opt = &job->model.optim;
    double norm = sqrt(sumsq) / (double)job->world / S;
    float scale = 1.0f / (float)job->world;
    if (S != 1.0)
        scale = scale * (float)(1.0 / S);
    if (opt->max_grad_norm > 0.0f && norm > (double)opt->max_grad_norm)
        scale = scale * (float)((double)opt->max_grad_norm / (norm + 1e-6));
    *norm_p = norm;
    return scale;
}

/* the step's bookkeeping: each tensor's count, the norm, the steps the shards hold */
static void count_step(struct sd_job *job, const uint64_t *used, double norm)
{
    for (uint32_t t = 0; t < job->layout.n_tensors; t++) {
        if (tensor_used(used, t))
            job->opt->tensor_steps[t]++;
        else
            job->stats.tensors_skipped++;
    }
    job->opt->last_grad_norm = norm;
    job->opt->applied = job->steps + 1;
}

double sd_optimizer_apply(struct sd_job *job, const struct sd_hparams *hp, double sumsq,
                          double loss_scale, const uint64_t *used)
{
    memcpy(job->opt->hparams, hp, sd_model_groups(&job->model) * sizeof(*hp));
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_layout *l = &job->layout;
    double norm;
    float scale = grad_scale(job, sumsq, loss_scale, &norm);

    /* every rank's optimizer shard: master weights, moments, its part of its g shard, cast into
     * its part of its w shard (the nesting of model.h: os in g in w) */
    const struct sd_plan *pl = &job->plan;
    for (uint32_t r = 0; r < job->k; r++) {
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            uint64_t b, e;
            sd_layout_shard(ul, pl, SD_STATE_OS, job->first_rank + r, &b, &e);
            struct os_view o = {.master = sd_job_os_state(job, r, 0, ul),
                                .m = sd_job_os_state(job, r, 1, ul),
                                .v = sd_job_os_state(job, r, 2, ul),
                                .g = sd_job_os_grad(job, r, u),
                                .w = sd_job_os_weights(job, r, u),
                                .w_elem = sd_dtype_size(ul->dtype)};
            update_unit(job, &o, u, b, e, used, scale);
        }
        /* the optimizer zeroed its part of the g shard; the rest held replicas' sums */
        if (pl->f[SD_STATE_OS] > pl->f[SD_STATE_G])
            dev->zero(job->mem.queue, sd_job_state(job, r, SD_STATE_G),
                      l->arena_numel[SD_STATE_G] * sizeof(float));
    }
    count_step(job, used, norm);
    return norm;
}

double sd_optimizer_handoff(struct sd_job *job, const struct sd_hparams *hp, double sumsq,
                            double loss_scale, const uint64_t *used)
{
    memcpy(job->opt->hparams, hp, sd_model_groups(&job->model) * sizeof(*hp));
    double norm;
    job->opt->handoff_scale = grad_scale(job, sumsq, loss_scale, &norm);
    count_step(job, used, norm);
    return norm;
}

float sd_optimizer_handoff_scale(const struct sd_job *job)
{
    return job->opt->handoff_scale;
}

void sd_optimizer_take_update(struct sd_job *job)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_layout *l = &job->layout;
    for (uint32_t r = 0; r < job->k; r++) {
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            dev->from_f32(job->mem.queue, sd_job_os_weights(job, r, u), ul->dtype,
                          sd_job_os_state(job, r, 0, ul), ul->numel / job->plan.f[SD_STATE_OS]);
        }
        dev->zero(job->mem.queue, sd_job_state(job, r, SD_STATE_G),
                  l->arena_numel[SD_STATE_G] * sizeof(float));
    }
}

/* ---- its state */

int sd_optim_create(struct sd_job *job)
{
    job->opt = calloc(1, sizeof(*job->opt));
    return job->opt != NULL ? SD_OK : SD_ENOMEM;
}

int sd_optim_alloc(struct sd_job *job)
{
    struct sd_optim_state *o = job->opt;
    uint32_t n_groups = sd_model_groups(&job->model);
    free(o->hparams);
    o->hparams = calloc(n_groups, sizeof(*o->hparams));
    o->tensor_steps = calloc(job->layout.n_tensors, sizeof(*o->tensor_steps));
    for (uint32_t g = 0; o->hparams != NULL && g < n_groups; g++)
        o->hparams[g] = sd_model_group(&job->model, g);
    return o->hparams != NULL && o->tensor_steps != NULL ? SD_OK : SD_ENOMEM;
}

void sd_optim_free(struct sd_job *job)
{
    if (job->opt == NULL)
        return;
    free(job->opt->tensor_steps);
    job->opt->tensor_steps = NULL;
}

void sd_optim_destroy(struct sd_job *job)
{
    if (job->opt == NULL)
        return;
    sd_optim_free(job);
    free(job->opt->hparams);
    free(job->opt);
    job->opt = NULL;
}

const struct sd_hparams *sd_optim_hparams(const struct sd_job *job)
{
    return job->opt != NULL ? job->opt->hparams : NULL;
}

const uint64_t *sd_optim_tensor_steps(const struct sd_job *job)
{
    return job->opt != NULL ? job->opt->tensor_steps : NULL;
}

double sd_optim_grad_norm(const struct sd_job *job)
{
    return job->opt != NULL ? job->opt->last_grad_norm : 0.0;
}

uint64_t sd_optim_applied(const struct sd_job *job)
{
    return job->opt != NULL ? job->opt->applied : 0;
}

void sd_optim_weights_new(struct sd_job *job)
{
    job->opt->applied = job->steps;
}

void sd_optim_restore(struct sd_job *job, const struct sd_hparams *hp, uint32_t n_groups,
                      uint64_t applied)
{
    n_groups = SD_MIN(n_groups, sd_model_groups(&job->model));
    memcpy(job->opt->hparams, hp, n_groups * sizeof(*hp));
    job->opt->applied = applied;
}

void sd_optim_set_tensor_steps(struct sd_job *job, uint32_t tensor, uint64_t steps)
{
    job->opt->tensor_steps[tensor] = steps;
}

void sd_optim_take_over(struct sd_job *job, const struct sd_job *old)
{
    const struct sd_optim_state *o = old->opt;
    memcpy(job->opt->tensor_steps, o->tensor_steps,
           job->layout.n_tensors * sizeof(*job->opt->tensor_steps));
    memcpy(job->opt->hparams, o->hparams, sd_model_groups(&job->model) * sizeof(*o->hparams));
    job->opt->last_grad_norm = o->last_grad_norm;
    job->opt->applied = old->steps;
}

const struct sd_job_module sd_optim_module = {.name = "optimizer",
                                              .create = sd_optim_create,
                                              .destroy = sd_optim_destroy,
                                              .alloc = sd_optim_alloc,
                                              .release = sd_optim_free};

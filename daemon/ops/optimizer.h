/* optimizer.c: clipping and the optimizer through the device backend, and the optimizer's
 * bookkeeping (struct sd_optim_state, its own): the parameter groups' hyperparameters, each
 * tensor's step count, the last norm, the steps the os shards hold. */
#ifndef SD_OPTIMIZER_H
#define SD_OPTIMIZER_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The optimizer on every local rank's shards for step job->steps + 1, once the gradients are
 * synchronized and the global sum of squares is known (of gradients the ranks multiplied by
 * loss_scale, 1 for none): unscaling, clipping, AdamW or SGD with each tensor's group's
 * hyperparameters (hp, this step's: they become the job's), the cast into w, the gradients
 * zeroed. used: a bit per tensor that some rank gave a gradient (the others are left as they
 * are), or NULL for every tensor. Returns the global gradient norm (unscaled). */
double sd_optimizer_apply(struct sd_job *job, const struct sd_hparams *hp, double sumsq,
                          double loss_scale, const uint64_t *used);

/* A trainer optimizer's step (sd_optim_in_trainer): the same bookkeeping as sd_optimizer_apply
 * (hyperparameters, tensor steps, norm), and the factor of the gradient sums it hands over
 * (sd_optimizer_handoff_scale); nothing on the device. */
double sd_optimizer_handoff(struct sd_job *job, const struct sd_hparams *hp, double sumsq,
                            double loss_scale, const uint64_t *used);
float sd_optimizer_handoff_scale(const struct sd_job *job);
/* The trainer wrote every local rank's updated master shards: the cast into w, the gradients
 * zeroed (kernels on the job's queue). */
void sd_optimizer_take_update(struct sd_job *job);

/* ---- its state */
/* at registration */
int sd_optim_create(struct sd_job *job);
/* with the job's memory: the groups' hyperparameters from the model, the tensors' steps */
int sd_optim_alloc(struct sd_job *job);
/* with the job's memory: the tensors' steps (the hyperparameters stay for shardctl) */
void sd_optim_free(struct sd_job *job);
void sd_optim_destroy(struct sd_job *job);

/* the parameter groups' hyperparameters of the last step, or NULL before the job's memory */
const struct sd_hparams *sd_optim_hparams(const struct sd_job *job);
/* each tensor's optimizer steps, or NULL before the job's memory */
const uint64_t *sd_optim_tensor_steps(const struct sd_job *job);
double sd_optim_grad_norm(const struct sd_job *job);
/* the steps the os shards hold: steps, or steps + 1 between the optimizer's update and the new
 * weights (a node lost there leaves the survivors' shards one step ahead) */
uint64_t sd_optim_applied(const struct sd_job *job);
/* the new weights are there: the shards hold job->steps */
void sd_optim_weights_new(struct sd_job *job);
/* A checkpoint's state (ckpt_load.c): the groups' hyperparameters, the steps it holds, and each
 * tensor's steps (sd_optim_set_tensor_steps). */
void sd_optim_restore(struct sd_job *job, const struct sd_hparams *hp, uint32_t n_groups,
                      uint64_t applied);
void sd_optim_set_tensor_steps(struct sd_job *job, uint32_t tensor, uint64_t steps);
/* A paused job's state, taken over (resume.c). */
void sd_optim_take_over(struct sd_job *job, const struct sd_job *old);

#endif

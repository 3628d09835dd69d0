/* optimizer.c: clipping and the optimizer through the device backend. */
#ifndef SD_OPTIMIZER_H
#define SD_OPTIMIZER_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The optimizer on every local rank's shards for step job->steps + 1, once the gradients are
 * synchronized and the global sum of squares is known: clipping, AdamW or SGD with each tensor's
 * group's hyperparameters (job->opt.hparams), the cast into w, the gradients zeroed. used: a bit
 * per tensor that some rank gave a gradient (the others are left as they are), or NULL for every
 * tensor. Returns the global gradient norm. */
double sd_optimizer_apply(struct sd_job *job, double sumsq, const uint64_t *used);

#endif

/* weights.c: the weights' all-gather after the optimizer (f_w < f_os). */
#ifndef SD_WEIGHTS_H
#define SD_WEIGHTS_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Does the weights' all-gather after the optimizer cross nodes (f_w < f_os, f_os > k)? */
bool sd_weights_remote(const struct sd_job *job);
/* Start unit u's exchanges with the os group's other nodes: job->step.pending counts them and
 * the last completion calls sd_step_progress; a post that failed sets job->step.status and
 * suspect and is returned. */
int sd_weights_exchange(struct sd_job *job, uint32_t u);
/* The parts of every local rank's w shards that other local ranks own (or that the exchange
 * received into another local holder), copied in. */
void sd_weights_local(struct sd_job *job);

#endif

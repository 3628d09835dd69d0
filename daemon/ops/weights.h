/* weights.c: the weights' all-gather after the optimizer (f_w < f_os). */
#ifndef SD_WEIGHTS_H
#define SD_WEIGHTS_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ,qw: each local rank's os part of unit u encoded into its wx slot and decoded back in place,
 * enqueued on the job's queue: the exchanges send the encodings once the device wrote them. */
void sd_weights_encode(struct sd_job *job, uint32_t u);
/* Start unit u's exchanges with the os group's other nodes: *posted_p counts those started,
 * each of which tells the step its completion (SD_JOB_EV_EXCHANGED); a post that failed is
 * returned, with its peer in *suspect_p. */
int sd_weights_exchange(struct sd_job *job, uint32_t u, uint32_t *posted_p, uint32_t *suspect_p);
/* The parts of every local rank's w shards that other local ranks own (or that the exchange
 * received into another local holder), copied in. */
void sd_weights_local(struct sd_job *job);

#endif

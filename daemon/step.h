/* step.c: the step's phases (gradient sync, norm, optimizer, refresh), one node or many. */
#ifndef SD_STEP_H
#define SD_STEP_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;

void sd_step(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* drive the step forward as far as it can go now; called again by every completion */
void sd_step_progress(struct sd_job *job);
/* A step waiting for its job's queue (the device still at the kernels of a phase): look again,
 * and go on if they are done. True if it went on. The loop calls it on every pass while any job
 * waits (sd_registry_poll_queues). */
bool sd_step_queue_poll(struct sd_job *job);

#endif

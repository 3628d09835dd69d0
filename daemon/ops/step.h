/* step.c: the step's phases (gradient sync, norm, optimizer, refresh), one node or many. Its
 * state is its own (step_int.h, step_state.c); the other modules ask it through these calls, and
 * it hears of their completions as the job's events (sd_job_event), which it turns into
 * progress as its phase needs. */
#ifndef SD_STEP_H
#define SD_STEP_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;

void sd_step(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* drive the step forward as far as it can go now */
void sd_step_progress(struct sd_job *job);
/* A step waiting for its job's queue (the device still at the kernels of a phase): look again,
 * and go on if they are done. True if it went on. The loop calls it on every pass while any job
 * waits (sd_jobs_poll_queues). */
bool sd_step_queue_poll(struct sd_job *job);
/* Does the step wait for its job's queue? */
bool sd_step_queue_waiting(const struct sd_job *job);

/* ---- its state (step_state.c) */
/* At registration: the barrier's (k ranks). */
int sd_step_create(struct sd_job *job);
/* With the job's memory (job_mem.c): the norm parts, the sums of squares, the arguments. */
int sd_step_alloc(struct sd_job *job);
/* Give back what sd_step_alloc took (the barrier stays for the job's record). */
void sd_step_free(struct sd_job *job);
void sd_step_destroy(struct sd_job *job);
/* The norm parts, which cross the network: job_net.c registers them with the fabric. */
void *sd_step_net_buf(const struct sd_job *job, size_t *bytes_p);

/* ---- what the others ask */
/* Is a step running on this node (every local rank called it and its phases are not over)? */
bool sd_step_running(const struct sd_job *job);
/* ... and nothing of it applied yet (before its optimizer phase)? */
bool sd_step_before_apply(const struct sd_job *job);
/* Local ranks waiting in the step's barrier. */
uint32_t sd_step_arrived(const struct sd_job *job);
/* Does the step wait at a trainer optimizer's hand-off for local rank local's update? */
bool sd_step_handoff(const struct sd_job *job, uint32_t local);

/* ---- what it hears: the completions its phases wait for come as the job's events
 * (job_module.h, sd_job_event), the ends of the weights' exchanges it started
 * (sd_weights_exchange) among them; it raises SD_JOB_EV_STEP_OVER once a step is answered. */

#endif

/* job_mem.c: a job's memory, all allocated at registration and given back at its end (above
 * every operation: each module's bookkeeping comes with it, job_module.h), with its buffers
 * across nodes (registrations, bulks, node rounds). */
#ifndef SD_JOB_MEM_H
#define SD_JOB_MEM_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Every local rank registered: check the budget, allocate every buffer (host memory on a worker
 * thread), then sd_job_allocated. */
void sd_job_mem_alloc(struct sd_job *job);
/* Give back everything sd_job_mem_alloc took (big host buffers off the loop). */
void sd_job_mem_free(struct sd_job *job);
/* The arenas' layout, for the budget and for allocating them. */
void sd_job_mem_arena_bytes(const struct sd_job *job, uint64_t bytes_p[SD_STATE_COUNT]);
/* A rank's control page: the fence page, the step arguments and a save's directory. */
uint64_t sd_job_control_bytes(const struct sd_job *job);
/* bytes of network buffers a job needs on this node */
uint64_t sd_job_net_bytes(const struct sd_job *job, const struct sd_config *cfg);
/* its transport view, bulks, node rounds' buffers and fabric registrations (nodes > 1) */
int sd_job_net_setup(struct sd_job *job, char *err, size_t errlen);
void sd_job_net_teardown(struct sd_job *job);
/* nothing reads or writes the job's memory any more: no transfer, no checkpoint worker */
bool sd_job_net_idle(const struct sd_job *job);

#endif

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
/* nothing reads or writes the job's memory any more: no transfer, no checkpoint worker */
bool sd_job_net_idle(const struct sd_job *job);

#endif

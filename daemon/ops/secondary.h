/* The secondary partition (secondary.c, plan option ,sec=S): what fetch, the job's memory and
 * the admin documents call of it. */
#ifndef SD_SECONDARY_H
#define SD_SECONDARY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_job;
struct sd_mem;
struct sd_sec_state; /* secondary.c's own; job->sec (NULL before registration allocated it) */
struct sd_unit_state;

/* bytes of one holder's secondary memory and the number of holders in use (0 when the plan
 * has no active secondary partition), for the budget */
uint64_t sd_sec_holder_bytes(const struct sd_job *job);
uint32_t sd_sec_holders(const struct sd_job *job);
/* Does the node's secondary copy hold unit us->unit of the current weights generation for the
 * group serving copy us? */
bool sd_sec_ready(const struct sd_job *job, const struct sd_unit_state *us);
/* Copy it into slot us (pool place set): enqueued on the job's queue. */
void sd_sec_load(struct sd_job *job, struct sd_unit_state *us);
/* Slot us now holds the current generation (a gather within the w group finished): refill the
 * secondary copy of its group from it unless that already holds this generation. Enqueued, not
 * waited for: true when it did, so that the caller keeps the slot from the network until the
 * job's queue passed the copies (a refill on the queue itself is ordered after them). */
bool sd_sec_keep(struct sd_job *job, struct sd_unit_state *us);

/* At registration: the state and its bookkeeping (SD_ENOMEM), then the holders' memory in the
 * backend (a failure's status, tag naming the allocation). */
int sd_sec_setup(struct sd_job *job);
int sd_sec_alloc(struct sd_job *job, char *tag, size_t taglen);
/* The holders' host memory handed over to be freed off the loop: moved into out (job->k
 * entries; NULL: only count them), their count (0 when the backend's memory is not host
 * memory or none is held). */
uint32_t sd_sec_hand_over(struct sd_job *job, struct sd_mem *out);
/* the job's memory goes (the counters stay for shardctl); the job goes */
void sd_sec_free(struct sd_job *job);
void sd_sec_destroy(struct sd_job *job);
/* gathers served from the secondary copies, and their refills */
void sd_sec_counts(const struct sd_job *job, uint64_t *loads_p, uint64_t *stores_p);

#endif

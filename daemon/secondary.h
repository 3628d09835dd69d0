/* The secondary partition (secondary.c, plan option ,sec=S): what fetch, the job's memory and
 * the admin documents call of it. */
#ifndef SD_SECONDARY_H
#define SD_SECONDARY_H

#include <stdbool.h>
#include <stdint.h>

struct sd_job;
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
 * secondary copy of its group from it unless that already holds this generation. False after
 * failing the job (the backend failed). */
bool sd_sec_keep(struct sd_job *job, struct sd_unit_state *us);

#endif

/* values.c: values written into a running job and read out of it. */
#ifndef SD_VALUES_H
#define SD_VALUES_H

#include "job.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;

/* SD_OP_WRITE: the values of a tensor (an fp32 copy in the rank's staging slot) into the
 * rank's own shards between steps: the weights (masters and weights) or an optimizer state, or
 * the tensor's step count. False while the rank's previous write is still read from its slot
 * (the ring entry waits). */
bool sd_values_write(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start);
/* SD_OP_WRITTEN: the node's ranks ended their writes; once all did (and no gather of the old
 * weights is in flight here) written weights are a new generation, and every rank is answered */
void sd_values_written(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* SD_OP_READ: a unit's fp32 master weights or optimizer state, gathered from its os group's
 * nodes into the rank's staging slot (a rank alone, between steps; one read at a time on a
 * node: false while another's runs, the ring entry waits); with SD_WRITE_STEPS a tensor's step
 * count. */
bool sd_values_read(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                    uint64_t start);

#endif

/* dispatch.c: a ring entry to its operation; parked operations failed all at once. */
#ifndef SD_DISPATCH_H
#define SD_DISPATCH_H

#include "job.h"
#include "sd/ring.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;

/* room for a completion's message */
#define SD_OP_MSG_LEN SD_CQE_MSG_LEN

/* complete an operation that succeeded, counted in the job's statistics */
void sd_op_done(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t v0,
                uint64_t v1, uint64_t start_ns);

#endif

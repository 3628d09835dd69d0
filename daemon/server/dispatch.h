/* dispatch.c: a ring entry to its operation. */
#ifndef SD_DISPATCH_H
#define SD_DISPATCH_H

#include <stdbool.h>

struct sd_job;
struct sd_session;
struct sd_sqe;

/* A ring entry: true if consumed, false if it must wait (stall the ring). */
bool sd_job_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);

#endif

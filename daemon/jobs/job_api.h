/* What a session asks of its job: the server and the sessions see no more of a job than this
 * (register.c, job.c and dispatch.c implement it). */
#ifndef SD_JOB_API_H
#define SD_JOB_API_H

#include <stdbool.h>
#include <stddef.h>

struct sd_job;
struct sd_registry;
struct sd_session;
struct sd_sqe;
struct Shard__Register;

/* Handle a Register message; replies now (error) or once every rank arrived, or waits for a
 * job of its name on its way out (register.c). */
void sd_job_register(struct sd_registry *reg, struct sd_session *s,
                     const struct Shard__Register *msg);
/* the session's registration waits for a job of its name to go (it may not send another) */
bool sd_job_register_waits(const struct sd_registry *reg, const struct sd_session *s);
/* the session ended: its waiting registration goes */
void sd_job_register_forget(struct sd_registry *reg, struct sd_session *s);
/* (the registry's sweep) each waiting registration tries again: it waits on, or is answered (past
 * register_timeout_ms: refused, naming what it waited for); (its end) they go */
void sd_job_register_retry(struct sd_registry *reg);
void sd_job_register_free(struct sd_registry *reg);
/* A session leaves its job: detach or disconnect (job.c). */
void sd_job_leave(struct sd_job *job, struct sd_session *s, const char *reason);
/* A ring entry: true if consumed, false if it must wait (stall the ring) (dispatch.c). */
bool sd_job_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
const char *sd_job_name(const struct sd_job *job);
/* a call of this job failed (its statistics) */
void sd_job_count_error(struct sd_job *job);

#endif

/* register.c: a session's Register message, answered now (an error), or once every rank of the
 * job arrived, or waiting for a job of its name on its way out; jobs found by name. */
#ifndef SD_REGISTER_H
#define SD_REGISTER_H

#include <stdbool.h>

struct sd_job;
struct sd_registry;
struct sd_session;
struct Shard__Register;

/* Handle a Register message; replies now (error) or once every rank arrived, or waits for a
 * job of its name on its way out. */
void sd_job_register(struct sd_registry *reg, struct sd_session *s,
                     const struct Shard__Register *msg);
/* the session's registration waits for a job of its name to go (it may not send another) */
bool sd_job_register_waits(const struct sd_registry *reg, const struct sd_session *s);
/* the session ended: its waiting registration goes */
void sd_job_register_forget(struct sd_registry *reg, struct sd_session *s);
/* (the jobs' sweep) each waiting registration tries again: it waits on, or is answered (past
 * register_timeout_ms: refused, naming what it waited for); (its end) they go */
void sd_job_register_retry(struct sd_registry *reg);
void sd_job_register_free(struct sd_registry *reg);
/* Active job by name (a paused one's name is free: resume.h). */
struct sd_job *sd_job_find(struct sd_registry *reg, const char *name);

#endif

/* job_life.c: a job's life, above every operation (the operations reach it through the job's
 * events: job_module.h). */
#ifndef SD_JOB_LIFE_H
#define SD_JOB_LIFE_H

#include "job.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_fsid;
struct sd_model;
struct sd_registry;
struct sd_session;

/* A new job from a Register message (model: taken over), linked into reg: its modules' states
 * created, nothing allocated yet; NULL with *status_p and err if it cannot be. */
struct sd_job *sd_job_create(struct sd_registry *reg, const Shard__Register *msg,
                             struct sd_model *model, const struct sd_fsid *owner, int *status_p,
                             char *err, size_t errlen);
/* Refuse the registration to every local rank and drop the job. */
void sd_job_refuse(struct sd_job *job, int status, const char *msg);
/* The same, and the job's other nodes are told (a registration that cannot complete anywhere). */
void sd_job_refuse_everywhere(struct sd_job *job, int status, const char *msg);
/* Every local rank registered and the checkpoint it loads is read (sd_ckpt_opened): allocate
 * its memory (nothing yet otherwise) */
void sd_job_registered(struct sd_job *job);
/* The coordinator agreed to the registration, with the job's transport tag and its nodes
 * (ids[n]: the cluster node of job node n, n of them): answer the ranks, start loading. */
void sd_job_confirm(struct sd_job *job, uint32_t tag, const uint32_t *ids, uint32_t n);
/* Every rank left (and, across nodes, every node said so): free its memory once its transfers
 * drained; keep its record for shardctl. */
void sd_job_retire(struct sd_job *job);
/* A retired job's transfers drained: its memory goes now. */
void sd_job_bury(struct sd_job *job);
/* Drop a job and all it holds (shutdown, a registration that never completed). */
void sd_job_destroy(struct sd_job *job);
void sd_job_free(struct sd_job *job);
/* The registration's deadline, parked operations' deadlines and stalled calls. */
void sd_job_sweep(struct sd_job *job, uint64_t now_ns);
/* A session leaves its job: detach or disconnect (reason says which, for the job's error). */
void sd_job_leave(struct sd_job *job, struct sd_session *s, const char *reason);
/* Its memory is allocated (status SD_OK) or not (err says why): go on (job_mem.c calls it). */
void sd_job_allocated(struct sd_job *job, int status, const char *err);
/* Every module's bookkeeping with the job's memory (for job_mem.c): SD_OK or the first error;
 * release gives back every module's. */
int sd_job_modules_alloc(struct sd_job *job);
void sd_job_modules_release(struct sd_job *job);

#endif

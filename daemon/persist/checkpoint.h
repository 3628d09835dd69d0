/* A job's checkpoints (checkpoint.c): the one it loads at registration, and its saves. */
#ifndef SD_CHECKPOINT_H
#define SD_CHECKPOINT_H

#include "sd/fsid.h"
#include "sd/model.h"
#include "shard.pb-c.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

struct sd_job;
struct sd_session;
struct sd_sqe;

/* At job creation: the checkpoint state, the owner whose identity every file of the job's
 * checkpoints is touched with, and with load_dir ("" or NULL: none) the directory to load
 * (checked for its form only: sd_ckpt_open_start reads it). err says why not. */
int sd_ckpt_job_init(struct sd_job *job, const struct sd_fsid *owner, const char *load_dir,
                     char *err, size_t errlen);
void sd_ckpt_job_free(struct sd_job *job);
/* The job is created: read and check the manifest it loads on a worker (nothing to do without
 * one); sd_job_registered once it is read, sd_job_refuse if it cannot be. */
void sd_ckpt_open_start(struct sd_job *job);
/* the manifest the job loads is read and checked (or it loads none) */
bool sd_ckpt_opened(const struct sd_job *job);
/* "shardd runs as uid X without CAP_SETUID...": why the daemon cannot act as uid */
const char *sd_ckpt_identity_error(const struct sd_job *job, uid_t uid);
/* does the job start from a checkpoint? its directory as registered; the step it holds */
bool sd_ckpt_loading(const struct sd_job *job);
const char *sd_ckpt_load_dir(const struct sd_job *job);
uint64_t sd_ckpt_start_step(const struct sd_job *job);
/* parameter group g's hyperparameters in force once loaded (the checkpoint's, or as registered) */
struct sd_hparams sd_ckpt_hparams(const struct sd_job *job, uint32_t g);
/* The job is confirmed: read this node's part on a worker, then sd_loading_loaded. */
void sd_ckpt_load_start(struct sd_job *job);
/* a worker reads or writes the job's memory: it must stay */
bool sd_ckpt_busy(const struct sd_job *job);
/* a worker works for an operation still waiting for it (not given up at its deadline): the os
 * shards it reads must not change */
bool sd_ckpt_reading(const struct sd_job *job);
/* the job goes while a worker runs: nothing waits for the worker any more (its end only lets
 * the memory go: the registry frees the job once sd_ckpt_busy is false) */
void sd_ckpt_drop(struct sd_job *job);
/* A worker past its operation's deadline: the operation fails now, naming what did not finish
 * (true: it did, and the job may be gone). */
bool sd_ckpt_work_sweep(struct sd_job *job, uint64_t now);
/* SD_OP_SAVE of one rank */
void sd_ckpt_save(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* the job failed: answer the ranks waiting in a save */
void sd_ckpt_fail_parked(struct sd_job *job, int status, const char *msg);
/* a save barrier waiting longer than timeout: present[r] set for the ranks in it */
bool sd_ckpt_overdue(struct sd_job *job, uint64_t now, uint64_t timeout, bool *present);
/* node 0: fail a save whose nodes have not reported within timeout plus the job's states at
 * 16 MiB/s, naming them */
void sd_ckpt_sweep(struct sd_job *job, uint64_t now, uint64_t timeout);
/* node 0: a member's report of its part; members: node 0's answer */
void sd_ckpt_peer_saved(struct sd_job *job, const Shard__JobSaved *m);
void sd_ckpt_peer_done(struct sd_job *job, uint64_t seq, int status, const char *msg);
/* Does rank write its os shard in a save (the replica with index shard % replicas)? A recovery
 * picks the same one while its node is up. */
bool sd_ckpt_is_writer(const struct sd_job *job, uint32_t rank);
/* no save or recovery reads the job's memory, and no rank waits in a save */
bool sd_ckpt_idle(const struct sd_job *job);
/* A recovery's part on this node (recover.h): write the os shards of the global ranks in
 * writers (those of this node) as save seq into a temporary directory of its own in dir, then
 * report to node 0 (node 0: wait for the nodes in reporting[nodes], commit, then
 * sd_recover_done). SD_OK, or why not. */
struct sd_ckpt_recover {
    const char *dir;
    uint64_t seq;
    const uint32_t *writers;
    size_t n_writers;
    const bool *reporting;
};
int sd_ckpt_recover_write(struct sd_job *job, const struct sd_ckpt_recover *r, char *err,
                          size_t errlen);
/* node 0: a recovery that gave up (a writer lost, its deadline) drops what it collected */
void sd_ckpt_recover_abandon(struct sd_job *job);
/* shardctl jobs: what was loaded and saved */
json_t *sd_ckpt_json(const struct sd_job *job);

#endif

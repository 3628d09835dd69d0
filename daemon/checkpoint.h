/* A job's checkpoints (checkpoint.c): the one it loads at registration, and its saves. */
#ifndef SD_CHECKPOINT_H
#define SD_CHECKPOINT_H

#include "sd/model.h"
#include "shard.pb-c.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

struct sd_job;
struct sd_session;
struct sd_sqe;

/* At job creation: the checkpoint state, and with load_dir ("" or NULL: none) the checkpoint
 * opened and checked against the job's model (err says why not). */
int sd_ckpt_job_init(struct sd_job *job, const char *load_dir, char *err, size_t errlen);
void sd_ckpt_job_free(struct sd_job *job);
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
/* SD_OP_SAVE of one rank */
void sd_ckpt_save(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* the job failed: answer the ranks waiting in a save */
void sd_ckpt_fail_parked(struct sd_job *job, int status, const char *msg);
/* a save barrier waiting longer than timeout: present[r] set for the ranks in it */
bool sd_ckpt_overdue(struct sd_job *job, uint64_t now, uint64_t timeout, bool *present);
/* node 0: fail a save whose nodes have not reported within timeout plus the job's states at
 * 16 MiB/s, naming them */
void sd_ckpt_sweep(struct sd_job *job, uint64_t now, uint64_t timeout);
/* Block until the job's checkpoint worker (reading or writing its memory) has finished: before
 * the memory is freed at shutdown */
void sd_ckpt_wait_worker(struct sd_job *job);
/* node 0: a member's report of its part; members: node 0's answer */
void sd_ckpt_peer_saved(struct sd_job *job, const Shard__JobSaved *m);
void sd_ckpt_peer_done(struct sd_job *job, uint64_t seq, int status, const char *msg);
/* Does rank write its os shard in a save (the replica with index shard % replicas)? A recovery
 * picks the same one while its node is up. */
bool sd_ckpt_is_writer(const struct sd_job *job, uint32_t rank);
/* no save or recovery reads the job's memory, and no rank waits in a save */
bool sd_ckpt_idle(const struct sd_job *job);
/* A recovery's part on this node (recover.h): write the os shards of the global ranks in
 * writers (those of this node) as save seq into dir/tmp, then report to node 0 (node 0: wait
 * for the nodes in reporting[nodes], commit, then sd_recover_done). SD_OK, or why not. */
struct sd_ckpt_recover {
    const char *dir, *tmp;
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

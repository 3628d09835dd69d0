/* Recovery from replicas (recover.c, DESIGN.md section 3b): shardctl checkpoint --job J DIR
 * writes a checkpoint of a running, paused, or failed-and-kept job from the nodes still up.
 *
 * Node 0 (the coordinator) picks, for every os shard, the first rank holding it whose node is
 * up; a shard that no live node holds (a plan with one partition group for the optimizer
 * states, and its node lost) makes it refuse with SD_ENOREPLICA and the list of the missing
 * extents. Otherwise it asks each live node that holds a chosen rank to write those ranks' os
 * shards (JobRecover), writes its own, and commits the checkpoint as a save does once every
 * part is in: one copy of every state, written by one replica. The parts must hold the same
 * step: a node lost between one survivor's optimizer update and another's leaves no consistent
 * state, and the recovery says so. A job whose node was lost fails as before, but with
 * resume_timeout_ms its survivors keep its state that long (resume.h) for this. */
#ifndef SD_RECOVER_H
#define SD_RECOVER_H

#include "shard.pb-c.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct sd_ckpt;
struct sd_job;
struct sd_registry;

/* where a command answered later goes: fn(ctx, conn_id, status, json) (the server's
 * sd_server_admin_answer, to the connection if it is still open) */
struct sd_admin_later {
    void (*fn)(void *ctx, uint64_t conn_id, int status, const char *json);
    void *ctx;
    uint64_t conn_id;
};

/* shardctl checkpoint --job: start the recovery of job into dir for a caller of uid. SD_OK with
 * *json_p NULL: answered later (later); otherwise the status and the JSON answer (malloc'd)
 * now: a refusal, with the missing extents. */
int sd_recover_admin(struct sd_registry *reg, const struct sd_admin_later *later, uid_t uid,
                     const char *job, const char *dir, char **json_p);
/* A member: node 0 asks for this node's part (answered with a JobSaved). */
void sd_recover_peer(struct sd_registry *reg, const Shard__JobRecover *m);
/* Node 0: a node's report of the recovery's part; true if it was one. */
bool sd_recover_route(struct sd_registry *reg, const Shard__JobSaved *m);
/* Node 0: the recovery of job is committed (status SD_OK: man, as final in its directory) or
 * failed (msg). */
void sd_recover_done(struct sd_job *job, int status, const char *msg, const struct sd_ckpt *man,
                     const char *final);
/* Node 0: a node that was to write went down, or the deadline passed: give the recovery up. */
void sd_recover_sweep(struct sd_registry *reg, uint64_t now_ns);
/* Is a recovery reading the job's state (its deadline waits)? */
bool sd_recover_target(const struct sd_job *job);
/* The job goes (or the daemon stops): a recovery of it is answered with an error. */
void sd_recover_forget(struct sd_registry *reg, const struct sd_job *job, const char *why);

#endif

/* Jobs that outlive their trainers (resume.c, DESIGN.md section 3b): with a resume timeout
 * (resume_timeout_ms, the daemon's or the registration's) a rank that dies pauses its job
 * instead of ending it. The job's other operations fail with SD_EPAUSED naming the rank and the
 * step to resume from; its state stays for the timeout; every rank registering again with the
 * same job name and model makes a new job that takes the state over and starts from that step.
 *
 * A pause happens at a step boundary on every node. A node pauses at once when its step is idle
 * (a step its ranks had not all entered can no longer complete anywhere) and tells the others,
 * each with the steps it has taken. A node that receives a pause while it runs the step the
 * pausing node did not enter drops that step (nothing of it was applied: the optimizer needs
 * every node's part of the norm first); one that runs the step the pausing node finished
 * completes it first. A half-done step's gradients are never taken over: the new job starts
 * with none, so the resumed run equals an uninterrupted one. */
#ifndef SD_RESUME_H
#define SD_RESUME_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct sd_job;
struct sd_registry;
struct sd_session;
struct sd_hparams;

/* its state (struct sd_resume_state, its own): at registration with the timeout in force */
int sd_resume_create(struct sd_job *job, uint64_t timeout_ms);
void sd_resume_destroy(struct sd_job *job);
uint64_t sd_resume_timeout_ms(const struct sd_job *job);
/* paused: its state waits to be taken over (by a registration not yet ready, or nobody) */
bool sd_resume_paused(const struct sd_job *job);
/* a rank died mid-step: the job pauses once the step is over (its name frees then) */
bool sd_resume_pausing(const struct sd_job *job);
/* its state is there for a taker: paused and not being taken over, or kept after a lost node */
bool sd_resume_holds_state(const struct sd_job *job);
bool sd_resume_kept(const struct sd_job *job);
/* this job started from a paused one; a later job took this one's state over */
bool sd_resume_resuming(const struct sd_job *job);
bool sd_resume_resumed(const struct sd_job *job);
/* it failed while ready: its memory holds the states of a step */
bool sd_resume_failed_ready(const struct sd_job *job);
/* The resume timeout a registration asks for (asked; 0: the daemon's) in force. */
uint64_t sd_resume_timeout(const struct sd_registry *reg, uint64_t asked);
/* A rank died (not a clean detach): true if the job pauses (now, or after the running step)
 * instead of failing. */
bool sd_resume_rank_died(struct sd_job *job, struct sd_session *s, const char *reason);
/* Another node paused the job after step steps (msg says why): true if it pauses here too (now,
 * or after the running step); false if it cannot (loading, no resume timeout): it must fail. */
bool sd_resume_peer_paused(struct sd_job *job, uint64_t step, const char *msg);
/* A node of the job was lost: with a resume timeout its state stays that long (the job fails
 * all the same) for shardctl checkpoint --job. True if kept. */
bool sd_resume_keep(struct sd_job *job);
/* A paused job past its deadline is dropped; a new job waiting to take a state over retries. */
void sd_resume_sweep(struct sd_job *job, uint64_t now_ns);
/* root's shardctl drop: a paused or kept job's state goes now (SD_OK), or why not */
int sd_resume_drop(struct sd_job *job, char *err, size_t errlen);
/* the memory uid's paused and kept jobs hold */
uint64_t sd_resume_kept_bytes(const struct sd_registry *reg, uid_t uid);
/* The paused job of this name (not yet taken over), or NULL. */
struct sd_job *sd_resume_find(struct sd_registry *reg, const char *name);
/* A registration of a paused job's name: job (just created) takes old's state over. SD_OK, or
 * why not (err): another model, world, owner; with a checkpoint to load, old is dropped. */
int sd_resume_attach(struct sd_job *job, struct sd_job *old, const char *load, char *err,
                     size_t errlen);
/* Registration reply: the step it starts from (resuming; else 0), the hyperparameters in
 * force. */
uint64_t sd_resume_start_step(const struct sd_job *job);
bool sd_resume_hparams(const struct sd_job *job, uint32_t g, struct sd_hparams *h_p);
/* Bytes of the memory budget that come back once job took the state over. */
uint64_t sd_resume_reclaim(const struct sd_job *job);
/* The job is confirmed: copy the paused job's weights and optimizer states, then ready. */
void sd_resume_load(struct sd_job *job);
/* the paused job's state is being copied on the job's queue: the loop's poll takes it over
 * once the queue passed the copies (a failure, or the job's end, waits for them first) */
bool sd_resume_queue_waiting(const struct sd_job *job);
bool sd_resume_queue_poll(struct sd_job *job);
/* shardctl jobs: the timeout, a pause's deadline, what it resumed */
json_t *sd_resume_json(const struct sd_job *job);
/* The job goes: forget the links to the job it resumes or that resumes it. */
void sd_resume_unlink(struct sd_job *job);
/* Every local rank left a paused (or once paused) job: true if it is handled here (kept until
 * taken over or its deadline, or retired on this node alone). */
bool sd_resume_all_left(struct sd_job *job);

#endif

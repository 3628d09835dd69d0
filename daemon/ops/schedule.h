/* The fetch/release/push schedule of a job on this node (schedule.c). */
#ifndef SD_DAEMON_SCHEDULE_H
#define SD_DAEMON_SCHEDULE_H

#include "sd/ring.h"
#include "sd/schedule.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_job;
struct sd_session;
struct sd_unit_state;

/* What the schedule drives in the operations above it: it decides which gathers go ahead of
 * their fetches, fetch issues them (main.c binds fetch's and the step's functions into the
 * registry, reg->sched_driver). */
struct sd_sched_driver {
    /* gather us into its place now (sd_fetch_prefetch): SD_OK, SD_EAGAIN, or the job failed */
    int (*prefetch)(struct sd_job *job, struct sd_unit_state *us);
    /* send the gathers prefetch coalesced (sd_fetch_prefetch_flush) */
    void (*flush)(struct sd_job *job);
    /* would unit's gather (copy lslot) join the open batch (sd_fetch_would_join)? */
    bool (*would_join)(const struct sd_job *job, uint32_t unit, uint32_t lslot);
    /* places a trainer's stream may still read: poll them (true if one came free), or have the
     * loop poll them (sd_fetch_fenced_poll, sd_fetch_fenced_blocked) */
    bool (*fenced_poll)(struct sd_job *job);
    void (*fenced_blocked)(struct sd_job *job);
    /* a step runs: no prefetch meanwhile (sd_step_running) */
    bool (*step_running)(const struct sd_job *job);
};

/* The schedule of a job on this node (schedule.c): recorded during the first step, checked
 * between ranks and nodes at the step boundary, then frozen and replayed with prefetch into
 * pool places planned offline. A call off the schedule falls back to on-demand fetching for the
 * rest of the step and a new schedule is recorded. */
enum sd_sched_state { SD_SCHED_RECORDING, SD_SCHED_FROZEN, SD_SCHED_OFF };
const char *sd_sched_state_name(enum sd_sched_state s);
struct sd_job_sched; /* schedule.c's own; job->sched (NULL before registration allocated it) */

/* What each node sends every other at the step (32 bytes, then with skip_unused a bit per
 * tensor): its squared norm, the digest and length of the schedule it recorded in this step (0
 * when not recording), the first unit whose gradient it found not finite, and a hash of the
 * step's hyperparameters its ranks gave (SD_HP_REFUSED: they were refused). */
struct sd_norm_part {
    double sumsq;
    uint64_t digest, n;
    uint32_t nonfinite_unit; /* the first unit whose gradient here is not finite, or UINT32_MAX */
    uint32_t hparams;
};
#define SD_HP_REFUSED UINT32_MAX

/* the schedule's state and arrays, at registration; sd_sched_free gives the arrays back when the
 * job's memory goes (its counters stay for shardctl) and sd_sched_destroy the rest with the job */
int sd_sched_alloc(struct sd_job *job);
void sd_sched_free(struct sd_job *job);
void sd_sched_destroy(struct sd_job *job);
/* A fetch, release or push timed around its service (dispatch.c's scheduled_op): begin returns
 * the gather-issue clock to pass to end; fetch: the call is a fetch (its CPU time counted) */
uint64_t sd_sched_call_begin(struct sd_job *job, bool fetch);
void sd_sched_call_end(struct sd_job *job, bool fetch, bool frozen, bool consumed, uint64_t allocs,
                       uint64_t cpu0, uint64_t issue0);
/* The CPU time of starting gathers (copying this node's shards into the pool, posting the
 * transfers), counted only while a fetch call is timed: elsewhere nothing reads it. */
uint64_t sd_sched_issue_clock(const struct sd_job *job);
/* A fetch answered outside its call (it waited for its gather): begin says whether to time it
 * (false inside a timed call, which counts it already), end counts it. */
bool sd_sched_answer_begin(const struct sd_job *job, uint64_t *cpu0_p);
void sd_sched_answer_end(struct sd_job *job, uint64_t cpu0);
void sd_sched_issue_count(struct sd_job *job, uint64_t t0);
/* what this node recorded in this step, for the step's exchange: digest (0: not recording) and
 * the recording's length */
void sd_sched_recorded(const struct sd_job *job, uint64_t *digest_p, uint64_t *n_p);
/* shardctl: the counters stats shows, and the whole schedule (its calls, the prefetch distance,
 * every gather's place in the pool), each added to o */
struct json_t;
void sd_sched_stats_json(const struct sd_job *job, struct json_t *o);
void sd_sched_json(const struct sd_job *job, struct json_t *o);
/* before a fetch or release outside the schedule (SD_OP_ASIDE) is served: not recorded; the
 * pool plan of a frozen schedule gives way to on-demand places for the rest of the step, as
 * for any call the schedule does not have, so that no planned copy is overwritten */
void sd_sched_aside(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* before a fetch, release or push is served: the position it matches (SD_SCHED_NONE if none) */
uint32_t sd_sched_before(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* after it was served (consumed) or stalled: records it, or advances the rank on the schedule
 * and issues the prefetches that allows; true if the call was served on the frozen schedule */
bool sd_sched_after(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint32_t pos,
                    bool consumed);
/* every local rank called step: check the recording (false after failing the job) */
bool sd_sched_step_check(struct sd_job *job);
/* the schedule node m of this node's partition group recorded in this step, from its norm part
 * (digest 0: not recording): false after failing the job */
bool sd_sched_check_node(struct sd_job *job, uint32_t m, const struct sd_norm_part *part);
/* the step completed: freeze, re-record or rewind, and prefetch the first gathers */
void sd_sched_step_done(struct sd_job *job);
/* issue the gathers the plan wants by now (retried after every call and gather) */
void sd_sched_prefetch(struct sd_job *job);
/* the pool place of a fetch being served: SD_OK, SD_EAGAIN (a slower rank still uses the
 * place: wait), or SD_ENOENT (not planned: allocate on demand) */
int sd_sched_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p);

#endif

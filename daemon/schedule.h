/* The fetch/release/push schedule of a job on this node (schedule.c). */
#ifndef SD_DAEMON_SCHEDULE_H
#define SD_DAEMON_SCHEDULE_H

#include "sd/ring.h"
#include "sd/schedule.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_job;
struct sd_session;

/* The schedule of a job on this node (schedule.c): recorded during the first step, checked
 * between ranks and nodes at the step boundary, then frozen and replayed with prefetch into
 * pool places planned offline. A call off the schedule falls back to on-demand fetching for the
 * rest of the step and a new schedule is recorded. */
enum sd_sched_state { SD_SCHED_RECORDING, SD_SCHED_FROZEN, SD_SCHED_OFF };
const char *sd_sched_state_name(enum sd_sched_state s);
struct sd_job_sched {
    enum sd_sched_state state;
    uint32_t cap;      /* calls recorded per rank and step at most */
    uint32_t *rec;     /* [k * cap] this step's calls per local rank */
    uint32_t *rec_len; /* [k] */
    bool overflow;     /* a rank made more calls than cap: not frozen */
    bool freeze_next;  /* the recording checked out: frozen when the step completes */
    bool deviated;     /* this step left the schedule: on demand until the step ends */
    uint64_t digest;   /* of this node's recording (0: not recording), exchanged between nodes */
    uint32_t n;        /* frozen calls per step */
    uint32_t *ops;     /* [cap] */
    struct sd_sched_plan plan;
    uint32_t *scratch;    /* the planner's */
    uint64_t *slot_bytes; /* [n_units] */
    uint64_t stride;      /* bytes between a unit's per-rank copies (no hierarchical gather) */
    struct sd_sched_params params; /* as planned (prefetch depth may be lowered to fit) */
    uint32_t *cursor;              /* [k] next position of each local rank */
    uint32_t lead;                 /* the furthest position a local rank reached this step */
    uint32_t *pf_next; /* [k] next gather to issue, per copy (one copy with the hierarchy) */
    bool in_prefetch;  /* a gather that completes at once must not re-enter */
    uint32_t want_iv;  /* the gather a fetch being served uses, else NONE */
    uint64_t want_off;
    uint64_t frozen_at_step;
    uint64_t freezes, invalidations, deviations, prefetches, prefetch_hits, waits, conflicts;
    uint64_t cpu_ns[2], fetches[2]; /* fetch handling: [0] not frozen, [1] frozen */
    uint64_t issue_ns[2];           /* of cpu_ns: starting gathers (the same work either way) */
    uint64_t issue_ns_in_call;      /* gather starts while a fetch call is timed */
    bool in_call;                   /* scheduled_op is timing a call */
    uint64_t allocs_frozen;         /* allocations made while serving calls on the schedule */
};

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

int sd_sched_alloc(struct sd_job *job);
void sd_sched_free(struct sd_job *job);
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
/* the schedules nodes [first, first + count) of this node's partition group recorded in this
 * step (parts indexed by node; digest 0: not recording): false after failing the job */
bool sd_sched_check_nodes(struct sd_job *job, uint32_t first, uint32_t count);
/* the step completed: freeze, re-record or rewind, and prefetch the first gathers */
void sd_sched_step_done(struct sd_job *job);
/* issue the gathers the plan wants by now (retried after every call and gather) */
void sd_sched_prefetch(struct sd_job *job);
/* the pool place of a fetch being served: SD_OK, SD_EAGAIN (a slower rank still uses the
 * place: wait), or SD_ENOENT (not planned: allocate on demand) */
int sd_sched_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p);

#endif

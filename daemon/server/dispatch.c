/* A ring entry to its operation: the checks every operation shares (the job's state, the unit),
 * the schedule's bookkeeping around fetch, release and push, and the failure of every parked
 * operation at once when the job fails. */
#include "schedule.h"
#include "checkpoint.h"
#include "job_module.h"
#include "fetch.h"
#include "dispatch.h"
#include "push.h"
#include "step.h"
#include "loading.h"
#include "values.h"
#include "session.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>

/* Common checks; returns false after failing the entry. */
static bool check_ready(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                        bool needs_unit)
{
    /* after a clean detach the shards are intact: fetch, release and read still work (to save
     * the final weights, masters and optimizer state); collectives that need every rank do
     * not */
    bool local_op = e->op == SD_OP_FETCH || e->op == SD_OP_RELEASE || e->op == SD_OP_READ;
    if (job->state == SD_JOB_FAILED && job->fail_status == SD_EPAUSED) {
        /* paused (or resumed by a later job): the message says the step and what to do */
        sd_session_fail(s, e, SD_EPAUSED, "%s: %s", sd_op_name((int)e->op), job->fail_msg);
        return false;
    }
    if (job->state == SD_JOB_FAILED || (job->state == SD_JOB_CLOSING && !local_op)) {
        sd_session_fail(s, e, SD_EJOBFAILED, "%s: job '%s' %s: %s", sd_op_name((int)e->op),
                        job->name, sd_job_state_name(job->state), job->fail_msg);
        return false;
    }
    if (job->state != SD_JOB_READY && job->state != SD_JOB_CLOSING) {
        sd_session_fail(s, e, SD_ESTATE,
                        "%s: job '%s' is still %s (rank 0 has not loaded the initial values)",
                        sd_op_name((int)e->op), job->name, sd_job_state_name(job->state));
        return false;
    }
    if (needs_unit && e->unit >= job->layout.n_units) {
        sd_session_fail(s, e, SD_ENOUNIT, "%s: unit %u does not exist (job '%s' has units 0..%u)",
                        sd_op_name((int)e->op), e->unit, job->name, job->layout.n_units - 1);
        return false;
    }
    return true;
}

/* fetch, release and push: matched against the schedule, recorded, counted */
static bool scheduled_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                         uint64_t start)
{
    if ((e->op == SD_OP_FETCH || e->op == SD_OP_RELEASE) && (e->arg0 & SD_OP_ASIDE)) {
        sd_sched_aside(job, s, e);
        if (e->op == SD_OP_RELEASE) {
            sd_fetch_release(job, s, e, start);
            return true;
        }
        return sd_fetch(job, s, e, start);
    }
    uint64_t allocs0 = sd_alloc_calls();
    uint64_t cpu0 = e->op == SD_OP_FETCH ? sd_thread_cpu_ns() : 0;
    uint64_t issue0 = sd_sched_call_begin(job, e->op == SD_OP_FETCH);
    uint32_t pos = sd_sched_before(job, s, e);
    bool consumed = true;
    if (e->op == SD_OP_FETCH)
        consumed = sd_fetch(job, s, e, start);
    else if (e->op == SD_OP_RELEASE)
        sd_fetch_release(job, s, e, start);
    else
        consumed = sd_push(job, s, e);
    /* what the call cost, the prefetches it issued included */
    bool frozen = sd_sched_after(job, s, e, pos, consumed);
    uint64_t allocs = sd_alloc_calls() - allocs0;
    job->stats.allocs_after_register += allocs;
    sd_sched_call_end(job, e->op == SD_OP_FETCH, frozen, consumed, allocs, cpu0, issue0);
    return consumed;
}

bool sd_job_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    uint64_t start = sd_now_ns();
    if (!(s->has_stalled && e == &s->stalled)) /* (a stalled call is recorded once) */
        sd_trace_call(&job->stats.trace, s->rank, e->op, e->unit, e->op == SD_OP_PUSH ? e->arg1 : 0,
                      e->tag, start);
    switch (e->op) {
    case SD_OP_FETCH:
    case SD_OP_RELEASE:
    case SD_OP_PUSH:
        if (check_ready(job, s, e, true))
            return scheduled_op(job, s, e, start);
        return true;
    case SD_OP_STEP:
        if (check_ready(job, s, e, false))
            sd_step(job, s, e);
        return true;
    case SD_OP_SAVE:
        if (check_ready(job, s, e, false))
            sd_ckpt_save(job, s, e);
        return true;
    case SD_OP_DROP:
        if (check_ready(job, s, e, true))
            sd_fetch_drop(job, s, e, start);
        return true;
    case SD_OP_WRITE:
        if (check_ready(job, s, e, false))
            return sd_values_write(job, s, e, start);
        return true;
    case SD_OP_READ:
        if (check_ready(job, s, e, false))
            return sd_values_read(job, s, e, start);
        return true;
    case SD_OP_WRITTEN:
        if (check_ready(job, s, e, false))
            sd_values_written(job, s, e);
        return true;
    case SD_OP_INIT:
        if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
            check_ready(job, s, e, false);
        else
            return sd_loading_init(job, s, e, start);
        return true;
    case SD_OP_READY:
        if (job->state == SD_JOB_FAILED || (job->state == SD_JOB_CLOSING && !job->was_ready))
            check_ready(job, s, e, false);
        else
            sd_loading_ready(job, s, e, start);
        return true;
    default:
        sd_session_fail(s, e, SD_EINVAL, "unknown operation code %u", e->op);
        return true;
    }
}

/* ---- the job's common paths (job_module.h): ring entries stalled waiting for a resource */

static void dispatch_fail_parked(struct sd_job *job, int status, const char *text,
                                 bool with_fetches)
{
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        /* a job closing (without with_fetches: a rank detached) still serves fetches and
         * releases: one that waits for a place goes on waiting (its deadline is swept) */
        if (s != NULL && s->has_stalled && !with_fetches &&
            (s->stalled.op == SD_OP_FETCH || s->stalled.op == SD_OP_RELEASE))
            continue;
        if (s != NULL && s->has_stalled) {
            sd_session_complete(s, s->stalled.tag, (int)s->stalled.op, status, 0, 0, text);
            s->has_stalled = false;
        }
    }
}

/* a call that cannot proceed (a pool place, transfer resources) for too long */
static bool dispatch_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        if (s == NULL || !s->has_stalled || now - s->stalled_ns <= op_timeout)
            continue;
        char text[SD_OP_MSG_LEN];
        snprintf(text, sizeof(text),
                 "rank %u's %s of unit %u could not proceed for %lld ms (op_timeout_ms): %s",
                 s->rank, sd_op_name((int)s->stalled.op), s->stalled.unit,
                 (long long)job->reg->cfg->op_timeout_ms,
                 s->stall_polls ? "its gradient was never signalled on the rank's fence page "
                                  "(grad_seq; shard_push_staged_signalled)"
                 : s->stalled.op == SD_OP_FETCH && job->xfer.rel_total > 0
                     ? "its pool place stayed busy, held by releases a stream was to signal on "
                       "the fence page (release_seq; shard_release_on_stream), or the "
                       "transfers it needs"
                 : s->stalled.op == SD_OP_FETCH
                     ? "its pool place or the transfers it needs stayed busy"
                     : "an earlier call of the same kind did not complete");
        if (job->state == SD_JOB_CLOSING) { /* the job ends anyway: the call fails alone */
            sd_session_complete(s, s->stalled.tag, (int)s->stalled.op, SD_ETIMEDOUT, 0, 0, text);
            s->has_stalled = false;
            continue;
        }
        sd_job_fail(job, SD_ETIMEDOUT, "%s", text);
        return true;
    }
    return false;
}

const struct sd_job_module sd_dispatch_module = {
    .name = "dispatch", .fail_parked = dispatch_fail_parked, .sweep = dispatch_sweep};

/* Jobs that outlive their trainers: pause, keep, take over (resume.h). */
#include "optimizer.h"
#include "step.h"
#include "resume.h"
#include "job_module.h"
#include "job.h"
#include "loading.h"
#include "session.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A job that outlives a dead rank (resume.c). With a resume timeout, a rank's death pauses the
 * job: it fails with SD_EPAUSED, its state stays for the timeout, and a registration of the same
 * name and model is a new job that takes the state over (paused stays set until then). */
struct sd_resume_state {
    uint64_t timeout_ms; /* 0: a dead rank ends the job */
    bool paused;         /* its state waits to be taken over */
    bool pending;        /* a rank died mid-step: pause once the step is over */
    bool pending_peer;   /* the pause came from another node: why is its message */
    bool wait;           /* resuming: a save of the paused job still runs; the sweep retries */
    bool was_paused;     /* it ends on this node alone, without the cluster */
    bool resuming;       /* this job started from a paused one */
    bool resumed;        /* a later job took the state over */
    bool kept;           /* failed (a node was lost): its state stays until the deadline, for
                            shardctl checkpoint --job (recover.h) */
    bool failed_ready;   /* it failed while ready: its memory holds the states of a step */
    bool copying;        /* resuming: the paused job's state is on the job's queue into its
                            arenas; taken over once the loop's poll saw the queue pass ticket */
    uint64_t ticket, copy_bytes;
    uint64_t deadline_ns;
    uint64_t start_step; /* resuming: the step the paused job had taken */
    char why[384];       /* pending: what happened (a peer's message) */
    struct sd_job *from; /* resuming: the paused job, until its state is taken over */
    struct sd_job *by;   /* paused: the job taking its state over */
};

int sd_resume_create(struct sd_job *job, uint64_t timeout_ms)
{
    job->load.resume = calloc(1, sizeof(*job->load.resume));
    if (job->load.resume == NULL)
        return SD_ENOMEM;
    job->load.resume->timeout_ms = timeout_ms;
    return SD_OK;
}

void sd_resume_destroy(struct sd_job *job)
{
    free(job->load.resume);
    job->load.resume = NULL;
}

uint64_t sd_resume_timeout_ms(const struct sd_job *job)
{
    return job->load.resume->timeout_ms;
}

bool sd_resume_paused(const struct sd_job *job)
{
    return job->load.resume->paused;
}

bool sd_resume_pausing(const struct sd_job *job)
{
    return job->load.resume->pending && job->state == SD_JOB_READY;
}

bool sd_resume_holds_state(const struct sd_job *job)
{
    const struct sd_resume_state *rs = job->load.resume;
    return (rs->paused && rs->by == NULL) || rs->kept;
}

bool sd_resume_kept(const struct sd_job *job)
{
    return job->load.resume->kept;
}

bool sd_resume_resuming(const struct sd_job *job)
{
    return job->load.resume->resuming;
}

bool sd_resume_resumed(const struct sd_job *job)
{
    return job->load.resume->resumed;
}

bool sd_resume_failed_ready(const struct sd_job *job)
{
    return job->load.resume->failed_ready;
}

/* A copy of the paused job's state that copier queued still reads that job's memory: wait for
 * it before either job can go (a failure, or a job's end, during the copy: rare, so waited for
 * here). The copier's poll then finds what happened. */
static void copy_wait(struct sd_job *copier)
{
    if (copier != NULL && copier->load.resume != NULL && copier->load.resume->copying)
        (void)copier->reg->dev->sync(copier->mem.queue);
}

/* the job failed (job_module.h): no copy goes on; was its state a step's? */
static void resume_failing(struct sd_job *job, int was)
{
    copy_wait(job);
    job->load.resume->copying = false;                    /* nothing goes on after a failure */
    job->load.resume->pending = false;                    /* a failure mid-step: not a step's */
    job->load.resume->failed_ready = was == SD_JOB_READY; /* its state is a step's */
}

uint64_t sd_resume_timeout(const struct sd_registry *reg, uint64_t asked)
{
    return asked != 0 ? asked : (uint64_t)reg->cfg->resume_timeout_ms;
}

uint64_t sd_resume_kept_bytes(const struct sd_registry *reg, uid_t uid)
{
    uint64_t bytes = 0;
    for (const struct sd_job *j = reg->jobs; j; j = j->next)
        if (j->uid == uid && (j->load.resume->paused || j->load.resume->kept))
            bytes += j->mem.bytes_total;
    return bytes;
}

/* May the job's state be kept (paused or kept) within its uid's share, paused_bytes_per_uid?
 * Why not into why. */
static bool within_share(const struct sd_job *job, char *why, size_t len)
{
    const struct sd_registry *reg = job->reg;
    uint64_t cap =
        reg->cfg->paused_bytes_per_uid ? reg->cfg->paused_bytes_per_uid : reg->budget / 2;
    uint64_t held = sd_resume_kept_bytes(reg, job->uid);
    if (held + job->mem.bytes_total <= cap)
        return true;
    char a[32], b[32], c[32];
    snprintf(why, len,
             "its state (%s) is not kept: uid %d's paused jobs hold %s already and "
             "paused_bytes_per_uid is %s",
             sd_fmt_bytes(a, sizeof(a), job->mem.bytes_total), (int)job->uid,
             sd_fmt_bytes(b, sizeof(b), held), sd_fmt_bytes(c, sizeof(c), cap));
    return false;
}

/* Pause now: every parked and later operation fails with text, the state stays until the
 * deadline; tell: the pause started here, the other nodes are told. A uid past its share of
 * kept memory fails instead. */
static void pause_text(struct sd_job *job, const char *text, bool tell)
{
    struct sd_resume_state *rs = job->load.resume;
    rs->pending = false;
    char why[256];
    if (!within_share(job, why, sizeof(why))) {
        char msg[700];
        snprintf(msg, sizeof(msg), "%s; %s", text, why);
        sd_job_fail_text(job, SD_EJOBFAILED, msg, tell);
        return;
    }
    rs->paused = rs->was_paused = true;
    rs->deadline_ns = sd_now_ns() + rs->timeout_ms * 1000000ULL;
    sd_job_fail_text(job, SD_EPAUSED, text, tell);
}

static void pause_here(struct sd_job *job, const char *why)
{
    char text[384];
    snprintf(text, sizeof(text),
             "job '%s' paused after step %llu: %.160s; register every rank again within %llu ms "
             "(resume_timeout_ms) to resume from step %llu",
             job->name, (unsigned long long)job->steps, why,
             (unsigned long long)job->load.resume->timeout_ms, (unsigned long long)job->steps);
    pause_text(job, text, true);
}

bool sd_resume_rank_died(struct sd_job *job, struct sd_session *s, const char *reason)
{
    struct sd_resume_state *rs = job->load.resume;
    if (rs->timeout_ms == 0 || job->state != SD_JOB_READY)
        return false;
    char why[160];
    snprintf(why, sizeof(why), "rank %u (pid %d) %s", s->rank, (int)s->pid, reason);
    if (!sd_step_running(job)) {
        pause_here(job, why);
        return true;
    }
    /* at a trainer optimizer's hand-off, owing its update: the step cannot complete, and the
     * other ranks' shards may hold theirs already (nothing consistent to keep): the job fails
     * now, not at the update's deadline */
    if (sd_step_handoff(job, s->local))
        return false;
    /* every rank had entered the step: it completes on every node, then the job pauses */
    if (!rs->pending) {
        rs->pending = true;
        rs->pending_peer = false;
        snprintf(rs->why, sizeof(rs->why), "%s", why);
    }
    SD_INFO("job", "job '%s': %s in step %llu; it pauses once the step is over", job->name, why,
            (unsigned long long)job->steps + 1);
    return true;
}

bool sd_resume_peer_paused(struct sd_job *job, uint64_t step, const char *msg)
{
    struct sd_resume_state *rs = job->load.resume;
    if (job->state != SD_JOB_READY || rs->timeout_ms == 0)
        return false; /* loading (nothing to keep yet), or no resume timeout on this node */
    if (!sd_step_running(job) || (sd_step_before_apply(job) && job->steps == step)) {
        /* the step the pausing node did not enter: nothing of it was applied anywhere */
        pause_text(job, msg, false);
        return true;
    }
    if (job->steps + 1 == step) { /* the step it finished: finish it too */
        rs->pending = true;
        rs->pending_peer = true;
        snprintf(rs->why, sizeof(rs->why), "%s", msg);
        return true;
    }
    SD_WARN("job", "job '%s': a node paused after step %llu while this node is in step %llu",
            job->name, (unsigned long long)step, (unsigned long long)job->steps + 1);
    pause_text(job, msg, false);
    return true;
}

/* The step is over (answered, SD_JOB_EV_STEP_OVER): a pause waiting for it happens now. */
static bool resume_event(struct sd_job *job, const struct sd_job_ev *ev)
{
    struct sd_resume_state *rs = job->load.resume;
    if (ev->kind != SD_JOB_EV_STEP_OVER || !rs->pending || job->state != SD_JOB_READY)
        return false;
    if (rs->pending_peer)
        pause_text(job, rs->why, false);
    else
        pause_here(job, rs->why);
    return true;
}

/* its state is created and freed by job_life.c (sd_resume_create, sd_resume_destroy): it hears
 * the step's end */
static const char *resume_gives_values(const struct sd_job *job)
{
    return sd_resume_resuming(job) ? "taking over a paused job's state" : NULL;
}

const struct sd_job_module sd_resume_module = {.name = "resume",
                                               .failing = resume_failing,
                                               .event = resume_event,
                                               .gives_values = resume_gives_values,
                                               .queue_waiting = sd_resume_queue_waiting,
                                               .queue_poll = sd_resume_queue_poll};

/* A paused job nobody took over in time, or a failed one kept: its state goes (now, or once its
 * ranks left). */
static void drop(struct sd_job *job)
{
    struct sd_resume_state *rs = job->load.resume;
    if (rs->kept) {
        rs->kept = false;
        SD_WARN("job",
                "job '%s' failed after step %llu; its state, kept for %llu ms "
                "(resume_timeout_ms), is dropped",
                job->name, (unsigned long long)job->steps, (unsigned long long)rs->timeout_ms);
    } else {
        rs->paused = false;
        job->fail_status = SD_EJOBFAILED;
        snprintf(job->fail_msg, sizeof(job->fail_msg),
                 "job '%s' paused after step %llu and was not registered again within %llu ms "
                 "(resume_timeout_ms): its state is dropped",
                 job->name, (unsigned long long)job->steps, (unsigned long long)rs->timeout_ms);
        SD_WARN("job", "%s", job->fail_msg);
    }
    sd_job_event(job, SD_JOB_EV_LET_GO); /* retires once its ranks left */
}

bool sd_resume_keep(struct sd_job *job)
{
    struct sd_resume_state *rs = job->load.resume;
    if (rs->timeout_ms == 0 || rs->paused || rs->pending || rs->kept ||
        !(job->state == SD_JOB_READY || (job->state == SD_JOB_FAILED && rs->failed_ready)))
        return false;
    char why[256];
    if (!within_share(job, why, sizeof(why))) {
        SD_WARN("job", "job '%s' failed: %s", job->name, why);
        return false;
    }
    rs->kept = true;
    rs->deadline_ns = sd_now_ns() + rs->timeout_ms * 1000000ULL;
    return true;
}

int sd_resume_drop(struct sd_job *job, char *err, size_t errlen)
{
    struct sd_resume_state *rs = job->load.resume;
    if (!sd_resume_holds_state(job)) {
        snprintf(err, errlen,
                 "job '%s' is %s, not paused or kept: only the state of a job whose trainers are "
                 "gone is dropped",
                 job->name, sd_job_state_name(job->state));
        return SD_ESTATE;
    }
    const char *needed = sd_job_state_needed(job); /* a recovery reads it */
    if (needed != NULL) {
        snprintf(err, errlen, "job '%s': %s", job->name, needed);
        return SD_EBUSY;
    }
    SD_WARN("job", "job '%s' (id %llu, uid %d): its %s state is dropped by root (shardctl drop)",
            job->name, (unsigned long long)job->id, (int)job->uid, rs->kept ? "kept" : "paused");
    rs->deadline_ns = 0;
    drop(job);
    return SD_OK;
}

void sd_resume_sweep(struct sd_job *job, uint64_t now)
{
    struct sd_resume_state *rs = job->load.resume;
    if (sd_resume_holds_state(job) && now >= rs->deadline_ns && sd_job_state_needed(job) == NULL)
        drop(job);
    else if (job->state == SD_JOB_LOADING && rs->resuming && rs->wait)
        sd_resume_load(job);
}

struct sd_job *sd_resume_find(struct sd_registry *reg, const char *name)
{
    for (struct sd_job *j = reg->jobs; j; j = j->next)
        if (j->load.resume->paused && j->load.resume->by == NULL && strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

int sd_resume_attach(struct sd_job *job, struct sd_job *old, const char *load, char *err,
                     size_t errlen)
{
    if (load != NULL && load[0] != '\0') { /* a checkpoint instead: the paused state goes */
        SD_INFO("job",
                "job '%s' registers with a checkpoint to load: the paused job (id %llu) "
                "is dropped",
                job->name, (unsigned long long)old->id);
        old->load.resume->deadline_ns = 0;
        return SD_OK;
    }
    if (old->uid != job->uid) {
        snprintf(err, errlen, "the job is paused and belongs to uid %d, not uid %d", (int)old->uid,
                 (int)job->uid);
        return SD_EPERM;
    }
    if (old->digest != job->digest || old->world != job->world) {
        char diff[256] = "";
        sd_model_diff(&old->model, &job->model, diff, sizeof(diff));
        snprintf(err, errlen,
                 "the job is paused after step %llu with another model or world (world %u, this "
                 "registration %u; %s): register the same model to resume it, or another job "
                 "name",
                 (unsigned long long)old->steps, old->world, job->world,
                 diff[0] ? diff : "same tensors");
        return SD_EMISMATCH;
    }
    struct sd_resume_state *rs = job->load.resume;
    rs->from = old;
    rs->resuming = true;
    rs->start_step = old->steps;
    old->load.resume->by = job;
    SD_INFO("job", "job '%s' (id %llu) resumes job id %llu, paused after step %llu", job->name,
            (unsigned long long)job->id, (unsigned long long)old->id,
            (unsigned long long)old->steps);
    return SD_OK;
}

uint64_t sd_resume_start_step(const struct sd_job *job)
{
    return job->load.resume->resuming ? job->load.resume->start_step : 0;
}

bool sd_resume_hparams(const struct sd_job *job, uint32_t g, struct sd_hparams *h_p)
{
    const struct sd_job *old = job->load.resume->from;
    if (old == NULL || sd_optim_hparams(old) == NULL)
        return false;
    *h_p = sd_optim_hparams(old)[g];
    return true;
}

uint64_t sd_resume_reclaim(const struct sd_job *job)
{
    const struct sd_job *old = job->load.resume->from;
    return old != NULL ? old->mem.bytes_total : 0;
}

/* job has old's state: old goes once its ranks left (those still attached get its message) */
static void taken_over(struct sd_job *job, struct sd_job *old)
{
    struct sd_resume_state *ors = old->load.resume;
    ors->by = NULL;
    ors->paused = false;
    ors->resumed = true;
    snprintf(old->fail_msg, sizeof(old->fail_msg),
             "job '%s' paused after step %llu and was resumed by job id %llu: register again",
             old->name, (unsigned long long)old->steps, (unsigned long long)job->id);
    job->load.resume->from = NULL;
    sd_job_event(old, SD_JOB_EV_LET_GO); /* retires once its ranks left */
}

static void copied(struct sd_job *job, struct sd_job *old, uint64_t bytes);

void sd_resume_load(struct sd_job *job)
{
    struct sd_resume_state *rs = job->load.resume;
    struct sd_job *old = rs->from;
    if (old == NULL) {
        sd_job_fail(job, SD_EJOBFAILED,
                    "the paused job it resumes was dropped before its state was taken over");
        return;
    }
    rs->wait = sd_job_shards_busy(old); /* a save of it still reads its memory: the sweep retries */
    if (rs->wait)
        return;
    const struct sd_gpu_ops *dev = job->reg->dev;
    static const int states[] = {SD_STATE_W, SD_STATE_OS};
    uint64_t bytes = 0;
    for (uint32_t r = 0; r < job->k; r++)
        for (size_t i = 0; i < sizeof(states) / sizeof(states[0]); i++) {
            struct sd_mem *from = sd_job_arena(old, r, states[i]),
                          *to = sd_job_arena(job, r, states[i]);
            if (from->bytes != to->bytes) {
                sd_job_fail(job, SD_EMISMATCH,
                            "the paused job's %s arena of rank %u has %zu bytes, this job's %zu",
                            sd_state_name(states[i]), job->first_rank + r, from->bytes, to->bytes);
                return;
            }
            dev->copy(job->mem.queue, to->ptr, from->ptr, from->bytes);
            bytes += from->bytes;
        }
    /* taken over once the copies are done, without holding the loop for them */
    int st = sd_job_queue_mark(job, false, &rs->ticket);
    if (st == SD_EAGAIN) { /* the loop's poll goes on (sd_resume_queue_poll) */
        rs->copying = true;
        rs->copy_bytes = bytes;
        return;
    }
    if (st != SD_OK) {
        sd_job_backend_failed(job, st);
        return;
    }
    copied(job, old, bytes);
}

bool sd_resume_queue_waiting(const struct sd_job *job)
{
    return job->load.resume != NULL && job->load.resume->copying;
}

bool sd_resume_queue_poll(struct sd_job *job)
{
    struct sd_resume_state *rs = job->load.resume;
    if (!sd_resume_queue_waiting(job) || job->state == SD_JOB_FAILED)
        return false;
    int st = job->reg->dev->query(job->mem.queue, rs->ticket);
    if (st == SD_EAGAIN)
        return false;
    rs->copying = false;
    if (st != SD_OK)
        sd_job_backend_failed(job, st);
    else if (rs->from == NULL) /* it went meanwhile (copy_wait let it) */
        sd_job_fail(job, SD_EJOBFAILED,
                    "the paused job it resumes was dropped while its state was copied");
    else
        copied(job, rs->from, rs->copy_bytes);
    return true;
}

/* the paused job's state is in this job's arenas: take the rest over, the job is loaded */
static void copied(struct sd_job *job, struct sd_job *old, uint64_t bytes)
{
    sd_optim_take_over(job, old);
    job->steps = old->steps;
    char b[32];
    SD_INFO("job",
            "job '%s' (id %llu) resumed job id %llu after step %llu: %s of weights and "
            "optimizer states taken over",
            job->name, (unsigned long long)job->id, (unsigned long long)old->id,
            (unsigned long long)job->steps, sd_fmt_bytes(b, sizeof(b), bytes));
    taken_over(job, old);
    sd_loading_loaded(job);
}

void sd_resume_unlink(struct sd_job *job)
{
    struct sd_resume_state *rs = job->load.resume;
    if (rs == NULL)
        return;
    copy_wait(job);
    copy_wait(rs->by);
    if (rs->from != NULL)
        rs->from->load.resume->by = NULL;
    if (rs->by != NULL)
        rs->by->load.resume->from = NULL;
    rs->from = rs->by = NULL;
}

bool sd_resume_all_left(struct sd_job *job)
{
    struct sd_resume_state *rs = job->load.resume;
    if (rs->pending || rs->paused || rs->kept)
        return true; /* kept: taken over, recovered, or dropped at its deadline */
    if (!rs->was_paused)
        return false;
    sd_job_event(job, SD_JOB_EV_LET_GO); /* resumed or dropped: the other nodes end theirs alike */
    return true;
}

json_t *sd_resume_json(const struct sd_job *job)
{
    const struct sd_resume_state *rs = job->load.resume;
    uint64_t now = sd_now_ns();
    json_t *o =
        json_pack("{s:I, s:b, s:b, s:b, s:b}", "timeout_ms", (json_int_t)rs->timeout_ms, "paused",
                  rs->paused, "pausing", rs->pending, "resumed", rs->resumed, "kept", rs->kept);
    if (rs->paused || rs->kept)
        json_object_set_new(o, "dropped_in_ms",
                            json_integer(rs->deadline_ns > now
                                             ? (json_int_t)((rs->deadline_ns - now) / 1000000)
                                             : 0));
    if (rs->resuming)
        json_object_set_new(o, "resumed_from_step", json_integer((json_int_t)rs->start_step));
    return o;
}

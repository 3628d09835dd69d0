/* A Register message (DESIGN.md section 2): validate it, create the job or join the one of its
 * name (resuming a paused one), and reply once every rank is there (job_life.c sends the layout). A
 * registration that meets a job of its name on its way out waits for it (a restarted trainer
 * registering before its old job saw it die, finished its step and paused, or saw its ranks
 * detach): its message is kept, packed, on the registry's list and each sweep retries it until
 * it is answered or register_timeout_ms passed. A job that runs on refuses its name at once. */
#include "checkpoint.h"
#include "job_life.h"
#include "register.h"
#include "resume.h"
#include "session.h"
#include "sd/model_msg.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void job_register(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg,
                         uint64_t until_ns);

struct sd_job *sd_job_find(struct sd_registry *reg, const char *name)
{
    for (struct sd_job *j = reg->jobs; j; j = j->next) /* paused: its name is free (resume.h) */
        if (strcmp(j->name, name) == 0 && !sd_resume_paused(j) &&
            !(sd_resume_kept(j) && j->n_left == j->k))
            return j;
    return NULL;
}

/* ---- the registrations waiting for a job of their name to go */

struct sd_waiting_reg {
    struct sd_waiting_reg *next;
    struct sd_session *s;
    uint8_t *msg; /* the Register message, packed */
    size_t len;
    uint64_t until_ns, round;
    uint64_t job_id; /* the job it waits for */
    char name[64];
    uint32_t rank;
};

static bool job_going(const struct sd_job *job, uint32_t rank, char *why, size_t len);

static int wait_add(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg,
                    uint64_t until_ns, const struct sd_job *job)
{
    struct sd_waiting_reg *w = calloc(1, sizeof(*w));
    size_t len = shard__register__get_packed_size(msg);
    if (w == NULL || (w->msg = malloc(len ? len : 1)) == NULL) {
        free(w);
        return SD_ENOMEM;
    }
    w->len = shard__register__pack(msg, w->msg);
    w->s = s;
    w->until_ns = until_ns;
    w->round = reg->waiting_round;
    w->job_id = job->id;
    snprintf(w->name, sizeof(w->name), "%s", job->name);
    w->rank = msg->rank;
    struct sd_waiting_reg **pp = &reg->waiting; /* in arrival order */
    while (*pp != NULL)
        pp = &(*pp)->next;
    *pp = w;
    return SD_OK;
}

bool sd_job_register_waits(const struct sd_registry *reg, const struct sd_session *s)
{
    for (const struct sd_waiting_reg *w = reg->waiting; w; w = w->next)
        if (w->s == s)
            return true;
    return false;
}

static void waiting_free(struct sd_waiting_reg *w)
{
    free(w->msg);
    free(w);
}

void sd_job_register_forget(struct sd_registry *reg, struct sd_session *s)
{
    for (struct sd_waiting_reg **pp = &reg->waiting; *pp;) {
        struct sd_waiting_reg *w = *pp;
        if (w->s == s) {
            *pp = w->next;
            waiting_free(w);
        } else {
            pp = &w->next;
        }
    }
}

/* Is w's wait unchanged: the job it waits for still there, still on its way out, before w's
 * deadline? Then it waits on without being read again (a large model's message is not parsed
 * each sweep). */
static bool still_waits(struct sd_registry *reg, const struct sd_waiting_reg *w, uint64_t now)
{
    char why[256];
    const struct sd_job *job = sd_job_find(reg, w->name);
    return now < w->until_ns && job != NULL && job->id == w->job_id &&
           job_going(job, w->rank, why, sizeof(why));
}

/* Each waiting registration of the rounds before this one whose wait changed tries again (one
 * that waits on joins this round: not retried twice in a sweep). One at a time off the list,
 * so that a session ending meanwhile finds its registration there or nowhere. */
void sd_job_register_retry(struct sd_registry *reg)
{
    uint64_t round = ++reg->waiting_round, now = sd_now_ns();
    for (;;) {
        struct sd_waiting_reg **pp = &reg->waiting;
        while (*pp != NULL && (*pp)->round >= round)
            pp = &(*pp)->next;
        struct sd_waiting_reg *w = *pp;
        if (w == NULL)
            return;
        if (still_waits(reg, w, now)) {
            w->round = round;
            continue;
        }
        *pp = w->next;
        Shard__Register *msg = shard__register__unpack(NULL, w->len, w->msg);
        if (msg == NULL) /* packed here: cannot fail but for memory */
            sd_session_send_error(w->s, SD_ENOMEM, "register: out of memory while it waited");
        else
            job_register(reg, w->s, msg, w->until_ns);
        shard__register__free_unpacked(msg, NULL);
        waiting_free(w);
    }
}

void sd_job_register_free(struct sd_registry *reg)
{
    while (reg->waiting != NULL) {
        struct sd_waiting_reg *w = reg->waiting;
        reg->waiting = w->next;
        waiting_free(w);
    }
}

/* The rank's connection hung up and the loop has not read its end yet (a killed trainer whose
 * restart registers at once). */
static bool rank_hung_up(const struct sd_job *job, uint32_t rank)
{
    if (rank < job->first_rank || rank - job->first_rank >= job->k)
        return false;
    const struct sd_session *held = job->ranks[rank - job->first_rank];
    return held != NULL && sd_session_hung_up(held);
}

/* A registration meets a job of its name that is past registering: true (why) if that job is
 * on its way out, so that the registration waits for it rather than being refused: it pauses
 * once its step is over, its ranks are detaching (failed or closing), or the rank's holder hung
 * up unread. A job that runs on is no such job: the name is taken. */
static bool job_going(const struct sd_job *job, uint32_t rank, char *why, size_t len)
{
    if (sd_resume_pausing(job)) {
        snprintf(why, len, "a rank died in step %llu: it pauses once the step is over",
                 (unsigned long long)job->steps + 1);
    } else if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING) {
        if (job->n_left < job->k)
            snprintf(why, len, "%s; %u of its %u ranks on this node have not detached yet",
                     sd_job_state_name(job->state), job->k - job->n_left, job->k);
        else
            snprintf(why, len, "%s; its ranks on other nodes have not detached yet",
                     sd_job_state_name(job->state));
    } else if (rank_hung_up(job, rank)) {
        snprintf(why, len, "rank %u's process (pid %d) hung up and is being reaped", rank,
                 (int)job->ranks[rank - job->first_rank]->pid);
    } else {
        return false;
    }
    return true;
}

/* The registration waits for the job of its name to go (why): now, it joins the registry's
 * waiting list; past until_ns, it is refused. */
static void register_wait(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg,
                          uint64_t until_ns, const struct sd_job *job, const char *why)
{
    const char *name = msg->job;
    bool again = until_ns != 0;
    if (again && sd_now_ns() >= until_ns) {
        sd_session_send_error(s, SD_ETIMEDOUT,
                              "register job '%s' rank %u: waited %lld ms (register_timeout_ms) for "
                              "the job of that name to go, and it is still there: %s",
                              name, msg->rank, (long long)reg->cfg->register_timeout_ms, why);
        return;
    }
    if (!again)
        until_ns = sd_now_ns() + (uint64_t)reg->cfg->register_timeout_ms * 1000000ULL;
    int status = wait_add(reg, s, msg, until_ns, job);
    if (status != SD_OK) {
        sd_session_send_error(s, status, "register job '%s' rank %u: out of memory", name,
                              msg->rank);
        return;
    }
    if (!again)
        SD_INFO("job",
                "job '%s': rank %u (pid %d) waits to register: the job of that name is %s "
                "(at most %lld ms, register_timeout_ms)",
                name, msg->rank, (int)s->pid, why, (long long)reg->cfg->register_timeout_ms);
}

/* ---- a registration */

/* Room for another job of uid (max_jobs_per_uid), so that one local user's registrations that
 * never complete cannot fill max_jobs for everyone: past the cap, the uid's oldest registration
 * still incomplete is refused (its ranks told why) for the new one; with none, the new one is
 * (false, err says why). */
static bool uid_room(struct sd_registry *reg, uid_t uid, const char *name, char *err, size_t len)
{
    uint32_t mine = 0;
    struct sd_job *oldest = NULL;
    for (struct sd_job *j = reg->jobs; j; j = j->next) {
        if (j->uid != uid)
            continue;
        mine++;
        if (j->state == SD_JOB_REGISTERING && !j->mem.allocating &&
            (oldest == NULL || j->created_ns < oldest->created_ns))
            oldest = j;
    }
    if (mine < (uint32_t)reg->cfg->max_jobs_per_uid)
        return true;
    if (oldest == NULL) {
        snprintf(err, len,
                 "register job '%s': uid %d has %u jobs served here, max_jobs_per_uid is %lld",
                 name, (int)uid, mine, (long long)reg->cfg->max_jobs_per_uid);
        return false;
    }
    char msg[300];
    snprintf(msg, sizeof(msg),
             "job '%s' of uid %d, its oldest registration not complete yet, is refused for its "
             "new job '%s': it has %u jobs served or registering here, max_jobs_per_uid is %lld",
             oldest->name, (int)uid, name, mine, (long long)reg->cfg->max_jobs_per_uid);
    sd_job_refuse_everywhere(oldest, SD_EBUSY, msg);
    return true;
}

void sd_job_register(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg)
{
    job_register(reg, s, msg, 0);
}

/* until_ns: 0 the first time; a waiting registration's deadline */
static void job_register(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg,
                         uint64_t until_ns)
{
    char err[768];
    struct sd_model model;
    const char *name = msg->job ? msg->job : "";
    size_t nlen = strlen(name);

    if (!sd_job_name_valid(name)) {
        sd_session_send_error(s, SD_EINVAL,
                              "register: job name '%.80s' (%zu bytes): a job name is 1..63 of "
                              "A-Z a-z 0-9 . _ - : , + = @ and does not start with '.' or '-'",
                              name, nlen);
        return;
    }
    if (msg->job_token.len != 0 && msg->job_token.len != SD_JOB_TOKEN_BYTES) {
        sd_session_send_error(s, SD_EINVAL,
                              "register job '%s' rank %u: a job token of %zu bytes (%d, or none)",
                              name, msg->rank, msg->job_token.len, SD_JOB_TOKEN_BYTES);
        return;
    }
    int status = sd_model_from_register(msg, (uint64_t)reg->cfg->max_tensors,
                                        (uint64_t)reg->cfg->max_units, &model, err, sizeof(err));
    if (status != SD_OK) {
        sd_session_send_error(s, status, "register job '%s' rank %u: %s", name, msg->rank, err);
        sd_model_free(&model);
        return;
    }

    struct sd_job *job = sd_job_find(reg, name);
    if (job == NULL) {
        struct sd_job *paused = sd_resume_find(reg, name);
        if (paused != NULL && paused->uid != s->cred.uid) { /* before anything of it is touched */
            sd_session_send_error(s, SD_EPERM,
                                  "register job '%s': a paused job of that name belongs to uid %d, "
                                  "you are uid %d; a job is joined only by its owner's processes",
                                  name, (int)paused->uid, (int)s->cred.uid);
            sd_model_free(&model);
            return;
        }
        if (paused == NULL && !uid_room(reg, s->cred.uid, name, err, sizeof(err))) {
            sd_session_send_error(s, SD_EBUSY, "%s", err);
            sd_model_free(&model);
            return;
        }
        if (reg->n_jobs >= (uint32_t)reg->cfg->max_jobs && paused == NULL) {
            sd_session_send_error(s, SD_EBUSY,
                                  "register job '%s': %u jobs are served, max_jobs is "
                                  "%lld",
                                  name, reg->n_jobs, (long long)reg->cfg->max_jobs);
            sd_model_free(&model);
            return;
        }
        int cst;
        job = sd_job_create(reg, msg, &model, &s->cred, &cst, err, sizeof(err));
        if (job == NULL) {
            sd_session_send_error(s, cst, "register job '%s' rank %u: %s", name, msg->rank, err);
            sd_model_free(&model);
            return;
        }
        if (paused != NULL &&
            (cst = sd_resume_attach(job, paused, msg->load, err, sizeof(err))) != SD_OK) {
            sd_session_send_error(s, cst, "register job '%s' rank %u: %s", name, msg->rank, err);
            sd_job_destroy(job);
            return;
        }
        SD_INFO("job", "job '%s' (id %llu) created by pid %d: world %u, plan %s", job->name,
                (unsigned long long)job->id, (int)s->pid, job->world, job->plan.name);
        sd_ckpt_open_start(job); /* the manifest it loads, read on a worker */
    } else {
        uint64_t digest = sd_model_digest(&model);
        if (job->uid != s->cred.uid) { /* root included: it registers jobs of its own */
            sd_session_send_error(s, SD_EPERM,
                                  "register job '%s': it belongs to uid %d, you are "
                                  "uid %d; a job is joined only by its owner's processes",
                                  name, (int)job->uid, (int)s->cred.uid);
        } else if (job->state != SD_JOB_REGISTERING && job_going(job, msg->rank, err, 256)) {
            register_wait(reg, s, msg, until_ns, job, err);
        } else if (job->state != SD_JOB_REGISTERING) {
            sd_session_send_error(s, SD_EEXIST,
                                  "register job '%s' rank %u: the job is already %s; pick another "
                                  "job name or wait until its ranks detach",
                                  name, msg->rank, sd_job_state_name(job->state));
        } else {
            char why[512] = "";
            if (digest != job->digest) {
                char diff[256];
                sd_model_diff(&job->model, &model, diff, sizeof(diff));
                snprintf(why, sizeof(why), "model digest %016llx differs from %016llx (%s)",
                         (unsigned long long)digest, (unsigned long long)job->digest, diff);
            } else if (strcmp(msg->load ? msg->load : "", sd_ckpt_load_dir(job)) != 0) {
                snprintf(why, sizeof(why), "loads checkpoint '%s', the other ranks '%s'",
                         msg->load ? msg->load : "", sd_ckpt_load_dir(job));
            } else if (msg->world != job->world) {
                snprintf(why, sizeof(why), "world %u differs from world %u of the other ranks",
                         msg->world, job->world);
            } else if (!sd_job_token_is(job, msg->job_token.data, msg->job_token.len)) {
                snprintf(why, sizeof(why),
                         "%s job secret than the other ranks of this node (every rank gives "
                         "the same, or none)",
                         msg->job_token.len ? "another" : "no");
            } else if (sd_job_ranks_per_node(reg->cfg, msg) != job->k) {
                snprintf(why, sizeof(why),
                         "%u ranks per node differ from %u of the other ranks (ranks_per_node)",
                         sd_job_ranks_per_node(reg->cfg, msg), job->k);
            } else if (msg->max_live_bytes != job->mem.max_live_bytes) {
                snprintf(why, sizeof(why),
                         "max_live_bytes %llu differs from %llu of the other ranks",
                         (unsigned long long)msg->max_live_bytes,
                         (unsigned long long)job->mem.max_live_bytes);
            } else if (sd_resume_timeout(reg, msg->resume_timeout_ms) !=
                       sd_resume_timeout_ms(job)) {
                snprintf(why, sizeof(why),
                         "resume_timeout_ms %llu differs from %llu of the other "
                         "ranks",
                         (unsigned long long)msg->resume_timeout_ms,
                         (unsigned long long)sd_resume_timeout_ms(job));
            }
            sd_model_free(&model);
            if (why[0] == '\0')
                goto add_rank;
            if (job->n_registered == job->k || job->mem.allocating) {
                /* every rank is there: this one is a stray, the job goes on */
                sd_session_send_error(s, SD_EMISMATCH, "register job '%s' rank %u: %s", name,
                                      msg->rank, why);
                return;
            }
            /* the job cannot start: the ranks already registered hear it now, not at the
             * registration's deadline (and the other nodes' ranks, through the coordinator) */
            sd_session_send_error(s, SD_EMISMATCH, "register job '%s' rank %u: %s", name, msg->rank,
                                  why);
            char text[640];
            snprintf(text, sizeof(text), "job '%s': rank %u (pid %d) registered it differently: %s",
                     name, msg->rank, (int)s->pid, why);
            sd_job_refuse_everywhere(job, SD_EMISMATCH, text);
            return;
        }
        sd_model_free(&model);
        return;
    }
add_rank:
    if (msg->rank >= job->world || msg->rank / job->k != job->node) {
        sd_session_send_error(
            s, SD_EINVAL,
            "register job '%s': rank %u is not on this node (node %u serves ranks "
            "%u..%u of world %u)",
            name, msg->rank, job->node, job->first_rank, job->first_rank + job->k - 1, job->world);
        if (job->n_registered == 0)
            sd_job_destroy(job);
        return;
    }
    uint32_t local = msg->rank - job->first_rank;
    if (job->ranks[local] != NULL && rank_hung_up(job, msg->rank)) {
        snprintf(err, sizeof(err),
                 "registering; rank %u's process (pid %d) hung up and is being "
                 "reaped",
                 msg->rank, (int)job->ranks[local]->pid);
        register_wait(reg, s, msg, until_ns, job, err);
        return;
    }
    if (job->ranks[local] != NULL) {
        sd_session_send_error(s, SD_EEXIST,
                              "register job '%s': rank %u is already registered by "
                              "pid %d",
                              name, msg->rank, (int)job->ranks[local]->pid);
        return;
    }
    job->ranks[local] = s;
    s->job = job;
    s->rank = msg->rank;
    s->local = local;
    job->n_registered++;
    SD_DEBUG("job", "job '%s': rank %u registered (%u of %u)", job->name, msg->rank,
             job->n_registered, job->k);
    sd_job_registered(job);
}

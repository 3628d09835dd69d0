/* The daemon's jobs as a whole: found by name, the loop's deadline sweep and device-queue
 * polls over all of them, what the cluster tells this node about them, and shutdown. */
#include "checkpoint.h"
#include "cluster/cluster.h"
#include "file_pool.h"
#include "jobs.h"
#include "job_life.h"
#include "job_mem.h"
#include "net.h"
#include "loading.h"
#include "register.h"
#include "recover.h"
#include "resume.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <string.h>

/* ---- what the cluster tells this node about jobs */

static void ev_job_confirmed(void *ctx, const char *name, uint32_t tag, const uint32_t *nodes,
                             uint32_t n)
{
    struct sd_registry *reg = ctx;
    struct sd_job *job = sd_job_find(reg, name);
    if (job == NULL || job->state != SD_JOB_REGISTERING || job->n_registered != job->k)
        return;
    sd_job_confirm(job, tag, nodes, n);
    if (sd_job_find(reg, name) != job)
        return; /* refused: the confirmation did not fit */
    sd_net_job_confirmed(reg, job->xfer.tag);
}

static void ev_job_refused(void *ctx, const char *name, int status, const char *msg)
{
    struct sd_job *job = sd_job_find(ctx, name);
    if (job != NULL && job->state == SD_JOB_REGISTERING)
        sd_job_refuse(job, status, msg);
}

static void ev_job_aborted(void *ctx, const char *name, uint32_t tag, int status, uint64_t step,
                           const char *msg)
{
    struct sd_job *job = sd_job_find(ctx, name);
    if (job == NULL || (tag != 0 && job->xfer.tag != tag))
        return; /* (a later job of the same name) */
    if (status == SD_EPAUSED) {
        if (sd_resume_peer_paused(job, step, msg))
            return;
        status = SD_EJOBFAILED; /* nothing kept on this node: the job ends here */
    }
    if (job->state == SD_JOB_REGISTERING) {
        sd_job_refuse(job, status, msg);
        return;
    }
    /* the failing node's message ends with its own dump (a path on its machine): this node's
     * failure names it after this node's dump, which a reader (and shardctl trace --merge) wants
     * first */
    char text[384], theirs[SD_PATH_MAX + 1] = ""; /* a job's fail_msg */
    const char *tail = strstr(msg, SD_TRACE_TAIL);
    if (tail != NULL) {
        const char *path = tail + strlen(SD_TRACE_TAIL);
        snprintf(theirs, sizeof(theirs), "%.*s", (int)strcspn(path, ";)"), path);
    }
    snprintf(text, sizeof(text), "on another node: %.*s",
             (int)SD_MIN((size_t)360, tail != NULL ? (size_t)(tail - msg) : strlen(msg)), msg);
    sd_job_fail_from_peer(job, status < 0 ? status : SD_EJOBFAILED, text, theirs);
}

static void ev_job_remote_ready(void *ctx, const char *name)
{
    struct sd_job *job = sd_job_find(ctx, name);
    if (job != NULL)
        sd_loading_remote_ready(job);
}

static void ev_job_saved(void *ctx, const Shard__JobSaved *m)
{
    if (sd_recover_route(ctx, m))
        return;
    struct sd_job *job = sd_job_find(ctx, m->job);
    if (job != NULL)
        sd_ckpt_peer_saved(job, m);
}

static void ev_job_save_done(void *ctx, const char *name, uint64_t seq, int status, const char *msg)
{
    struct sd_job *job = sd_job_find(ctx, name);
    if (job != NULL)
        sd_ckpt_peer_done(job, seq, status, msg);
}

static void ev_job_recover(void *ctx, const Shard__JobRecover *m)
{
    sd_recover_peer(ctx, m);
}

/* Cluster node node is down: the jobs it serves fail (or pause); the others never notice. */
static void ev_node_down(void *ctx, uint32_t node, const char *reason)
{
    struct sd_registry *reg = ctx;
    for (struct sd_job *job = reg->jobs, *next; job; job = next) {
        next = job->next;
        if (job->nodes == 1)
            continue;
        if (job->n_left == job->k && job->retire_pending) {
            /* waiting for the coordinator to end it; without the coordinator, end it here */
            if (node == 0)
                sd_job_retire(job);
            continue;
        }
        /* (a registration not confirmed yet does not know its nodes: the coordinator refuses
         * it when a node that reported it is down) */
        uint32_t jn = sd_job_node_of(job, node);
        if (jn == SD_NODE_UNKNOWN)
            continue;
        char peer[160], first[160];
        sd_job_peer_name(job, jn, peer, sizeof(peer));
        if (job->state == SD_JOB_REGISTERING) {
            char text[384];
            snprintf(text, sizeof(text), "%s is down (%s) while the job registers", peer, reason);
            sd_job_refuse_everywhere(job, SD_EPEER, text);
            continue;
        }
        char what[200], kept[320] = "";
        sd_job_net_describe(job, what, sizeof(what));
        if (sd_resume_keep(job))
            snprintf(kept, sizeof(kept),
                     "; its state is kept for %llu ms: shardctl checkpoint --job %s DIR on the "
                     "job's %s writes it from the replicas",
                     (unsigned long long)sd_resume_timeout_ms(job), job->name,
                     sd_job_peer_name(job, 0, first, sizeof(first)));
        sd_job_fail(job, SD_EPEER, "%s; %s is down: %.100s%s", what, peer, reason, kept);
    }
}

static bool ev_tag_in_use(void *ctx, uint32_t tag)
{
    return sd_registry_find_tag(ctx, tag) != NULL;
}

static uint32_t ev_tags_in_use(void *ctx, uint32_t *tags, uint32_t cap)
{
    struct sd_registry *reg = ctx;
    struct sd_job *lists[2] = {reg->jobs, reg->zombies};
    uint32_t n = 0;
    for (int i = 0; i < 2; i++)
        for (struct sd_job *j = lists[i]; j && n < cap; j = j->next)
            if (j->nodes > 1 && j->xfer.tag != 0)
                tags[n++] = j->xfer.tag;
    return n;
}

/* the job's nodes are known here: confirmed (a confirmed job may still wait for its nodes'
 * data paths, which need its direct links: its tag is set then) */
static bool job_confirmed(const struct sd_job *job)
{
    return job->nodes > 1 && (job->state != SD_JOB_REGISTERING || job->xfer.tag != 0);
}

/* a job here (confirmed: its nodes known; failed ones too, whose state a recovery may read)
 * spans cluster node node */
static bool job_spans_node(const struct sd_job *job, uint32_t node)
{
    return job_confirmed(job) && sd_job_node_of(job, node) != SD_NODE_UNKNOWN;
}

static void ev_nodes_in_use(void *ctx, bool *need, uint32_t n)
{
    struct sd_registry *reg = ctx;
    for (struct sd_job *j = reg->jobs; j; j = j->next)
        for (uint32_t i = 0; job_confirmed(j) && i < j->nodes; i++)
            if (j->xfer.node_ids[i] < n)
                need[j->xfer.node_ids[i]] = true;
}

static bool ev_job_spans(void *ctx, const char *name, uint32_t tag, uint32_t node)
{
    struct sd_registry *reg = ctx;
    for (struct sd_job *j = reg->jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0 && (tag == 0 || j->xfer.tag == tag) &&
            job_spans_node(j, node))
            return true;
    return false;
}

static bool ev_job_token(void *ctx, const char *name, uint8_t token[SD_JOB_TOKEN_BYTES])
{
    struct sd_registry *reg = ctx;
    for (struct sd_job *j = reg->jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0 && j->xfer.token_len == SD_JOB_TOKEN_BYTES) {
            memcpy(token, j->xfer.token, SD_JOB_TOKEN_BYTES);
            return true;
        }
    return false;
}

static const char *ev_job_spanning(void *ctx, uint32_t node)
{
    struct sd_registry *reg = ctx;
    for (struct sd_job *j = reg->jobs; j; j = j->next)
        if (job_spans_node(j, node) && j->xfer.token_len == SD_JOB_TOKEN_BYTES)
            return j->name;
    return NULL;
}

static void ev_job_ended(void *ctx, const char *name)
{
    struct sd_job *job = sd_job_find(ctx, name);
    if (job != NULL && job->n_left == job->k)
        sd_job_retire(job);
}

static int ev_formed(void *ctx)
{
    return sd_net_post_requests(ctx);
}

void sd_jobs_cluster_events(struct sd_registry *reg, struct sd_cluster_events *ev_p)
{
    *ev_p = (struct sd_cluster_events){.ctx = reg,
                                       .job_confirmed = ev_job_confirmed,
                                       .job_refused = ev_job_refused,
                                       .job_aborted = ev_job_aborted,
                                       .job_remote_ready = ev_job_remote_ready,
                                       .job_ended = ev_job_ended,
                                       .job_saved = ev_job_saved,
                                       .job_save_done = ev_job_save_done,
                                       .job_recover = ev_job_recover,
                                       .node_down = ev_node_down,
                                       .formed = ev_formed,
                                       .tag_in_use = ev_tag_in_use,
                                       .tags_in_use = ev_tags_in_use,
                                       .nodes_in_use = ev_nodes_in_use,
                                       .job_spans = ev_job_spans,
                                       .job_token = ev_job_token,
                                       .job_spanning = ev_job_spanning};
}

void sd_jobs_sweep(struct sd_registry *reg, uint64_t now)
{
    for (struct sd_job **pp = &reg->zombies; *pp;) {
        struct sd_job *z = *pp;
        if (!sd_job_net_idle(z)) {
            pp = &z->next;
            continue;
        }
        *pp = z->next;
        if (z->mem.doomed)
            sd_job_free(z);
        else
            sd_job_bury(z);
    }
    for (struct sd_job *job = reg->jobs, *next; job; job = next) {
        next = job->next; /* the sweep may drop the job */
        sd_job_sweep(job, now);
    }
    sd_recover_sweep(reg, now);
    sd_job_register_retry(
        reg); /* after the jobs' deadlines: a job paused or dropped frees its name */
}

bool sd_jobs_poll_queues(struct sd_registry *reg, bool *waiting_p)
{
    bool moved = false, waiting = false;
    for (struct sd_job *job = reg->jobs, *next; job; job = next) {
        next = job->next; /* the step may end the job */
        if (!sd_job_queue_waiting(job))
            continue;
        moved |= sd_job_queue_poll(job);
        waiting |= sd_job_queue_waiting(job);
    }
    *waiting_p = waiting;
    return moved;
}

void sd_jobs_destroy_all(struct sd_registry *reg)
{
    sd_recover_forget(reg, NULL, "the daemon stops");
    /* file work first: the tasks that end in time give their jobs back; those stuck in a
     * filesystem keep theirs, left to the process's exit */
    uint32_t stuck = sd_file_pool_stop(reg->files, SD_FILE_STOP_WAIT_MS);
    reg->files = NULL;
    while (reg->jobs != NULL) {
        sd_job_destroy(reg->jobs);
    }
    while (reg->zombies != NULL) {
        struct sd_job *job = reg->zombies;
        reg->zombies = job->next;
        if (sd_ckpt_busy(job)) { /* its worker is stuck: its memory stays with it */
            reg->stuck_jobs++;
            continue;
        }
        sd_job_free(job);
    }
    if (stuck > 0)
        SD_WARN("main", "%u jobs left to %u stuck file tasks", reg->stuck_jobs, stuck);
    while (reg->finished != NULL) {
        struct sd_job *job = reg->finished;
        reg->finished = job->next;
        sd_job_free(job);
    }
    reg->n_finished = 0;
    sd_job_register_free(reg);
}

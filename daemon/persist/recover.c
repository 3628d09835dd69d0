/* Recovery from replicas: a checkpoint of a job written by the nodes still up (recover.h). */
#include "optimizer.h"
#include "recover.h"
#include "resume.h"
#include "checkpoint.h"
#include "cluster/cluster.h"
#include "job.h"
#include "net_service.h"
#include "sd/ckpt.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* node 0: the recovery under way (one at a time) */
struct sd_recovery {
    struct sd_admin_later later; /* the shardctl to answer */
    struct sd_job *job;
    uint64_t seq, start_ns, deadline_ns;
    char dir[SD_CKPT_PATH_MAX];
    bool *reporting;   /* [nodes]: the nodes that write a part (node 0 always) */
    uint32_t *writers; /* the global ranks whose os shards are written */
    size_t n_writers;
};

/* The job of this name whose state a recovery reads: a paused or kept one first, then a running
 * one, then one that failed while ready and whose ranks are still attached. */
static struct sd_job *find(struct sd_registry *reg, const char *name)
{
    struct sd_job *best = NULL;
    int best_rank = 0;
    for (struct sd_job *j = reg->jobs; j; j = j->next) {
        if (strcmp(j->name, name) != 0)
            continue;
        int rank = sd_resume_holds_state(j)                                 ? 3
                   : j->state == SD_JOB_READY                               ? 2
                   : j->state == SD_JOB_FAILED && sd_resume_failed_ready(j) ? 1
                                                                            : 0;
        if (rank > best_rank) {
            best = j;
            best_rank = rank;
        }
    }
    return best;
}

/* The rank that writes os shard p: the one a save picks (sd_ckpt_is_writer: the writes spread
 * over the replicas) or, when its node is down, the next rank holding p on a node that is up
 * (wrapping around). UINT32_MAX: none. */
static uint32_t pick_writer(const struct sd_job *job, uint32_t p, const bool *up)
{
    uint32_t first_up = UINT32_MAX;
    bool passed = false; /* the save's writer, or a rank after it */
    for (uint32_t r = 0; r < job->world; r++) {
        if (sd_plan_shard(&job->plan, SD_STATE_OS, r) != p)
            continue;
        passed = passed || sd_ckpt_is_writer(job, r);
        if (!up[r / job->k])
            continue;
        if (passed)
            return r;
        if (first_up == UINT32_MAX)
            first_up = r;
    }
    return first_up;
}

static int refuse(char **json_p, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int refuse(char **json_p, int status, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    json_t *o = json_pack("{s:s, s:i}", "error", msg, "status", status);
    *json_p = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return status;
}

static void recovery_free(struct sd_recovery *rec)
{
    if (rec == NULL)
        return;
    free(rec->reporting);
    free(rec->writers);
    free(rec);
}

static void answer(struct sd_registry *reg, int status, json_t *o)
{
    struct sd_recovery *rec = reg->recovery;
    reg->recovery = NULL;
    json_object_set_new(o, "status", json_integer(status));
    char *text = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    rec->later.fn(rec->later.ctx, rec->later.conn_id, status, text ? text : "{}");
    free(text);
    recovery_free(rec);
}

static void answer_error(struct sd_registry *reg, int status, const char *msg)
{
    SD_WARN("job", "checkpoint of job '%s' from the replicas: %s", reg->recovery->job->name, msg);
    answer(reg, status, json_pack("{s:s, s:s}", "job", reg->recovery->job->name, "error", msg));
}

/* The os shards no live node holds: a refusal listing their extents (tensor, range, states). */
static int refuse_missing(struct sd_job *job, const bool *covered, const bool *up, char **json_p)
{
    const struct sd_layout *l = &job->layout;
    uint32_t f = job->plan.f[SD_STATE_OS], n_states = sd_ckpt_states(job->model.optim.kind);
    json_t *missing = json_array(), *lost = json_array(), *states = json_array();
    for (uint32_t s = 0; s < n_states; s++)
        json_array_append_new(states, json_string(sd_ckpt_state_name(job->model.optim.kind, s)));
    for (uint32_t m = 0; m < job->nodes; m++)
        if (!up[m])
            json_array_append_new(lost, json_integer(m));
    char first[200] = "", shards[200] = "";
    size_t off = 0;
    uint64_t n = 0, elems = 0;
    uint32_t n_shards = 0;
    for (uint32_t p = 0; p < f; p++) {
        if (covered[p])
            continue;
        json_t *ranks = json_array();
        uint32_t rep = UINT32_MAX;
        for (uint32_t r = 0; r < job->world; r++)
            if (sd_plan_shard(&job->plan, SD_STATE_OS, r) == p) {
                json_array_append_new(ranks, json_integer(r));
                rep = rep == UINT32_MAX ? r : rep;
            }
        if (n_shards++ < 8 && off < sizeof(shards))
            off += (size_t)snprintf(shards + off, sizeof(shards) - off, "%s%u (rank %u, node %u)",
                                    off ? ", " : "", p, rep, rep / job->k);
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            uint64_t b, e;
            sd_layout_shard(ul, &job->plan, SD_STATE_OS, rep, &b, &e);
            for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors; t++) {
                const struct sd_tensor_layout *tl = &l->tensors[t];
                uint64_t lo = SD_MAX(b, tl->offset), hi = SD_MIN(e, tl->offset + tl->numel);
                if (lo >= hi)
                    continue;
                const char *name = job->model.tensors[t].name;
                if (n++ == 0)
                    snprintf(first, sizeof(first), "%.80s[%llu, %llu)", name,
                             (unsigned long long)(lo - tl->offset),
                             (unsigned long long)(hi - tl->offset));
                elems += hi - lo;
                json_array_append_new(
                    missing, json_pack("{s:s, s:[I, I], s:O, s:I, s:O}", "tensor", name, "range",
                                       (json_int_t)(lo - tl->offset), (json_int_t)(hi - tl->offset),
                                       "states", states, "shard", (json_int_t)p, "ranks", ranks));
            }
        }
        json_decref(ranks);
    }
    char msg[1024];
    snprintf(msg, sizeof(msg),
             "job '%s' (plan %s) has no copy of %u of its %u optimizer-state shards on a node "
             "that is up: shards %s%s; %llu extents (%llu elements x %u states) are missing, "
             "the first %s; the answer lists them all",
             job->name, job->plan.name, n_shards, f, shards, n_shards > 8 ? ", ..." : "",
             (unsigned long long)n, (unsigned long long)elems, n_states, first);
    SD_WARN("job", "checkpoint from the replicas refused: %s", msg);
    json_t *o =
        json_pack("{s:s, s:s, s:i, s:o, s:o, s:o}", "job", job->name, "error", msg, "status",
                  SD_ENOREPLICA, "lost_nodes", lost, "states", states, "missing", missing);
    *json_p = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return SD_ENOREPLICA;
}

int sd_recover_admin(struct sd_registry *reg, const struct sd_admin_later *later, uid_t uid,
                     const char *name, const char *dir, char **json_p)
{
    *json_p = NULL;
    if (name == NULL || name[0] == '\0' || dir == NULL || dir[0] == '\0')
        return refuse(json_p, SD_EINVAL, "checkpoint needs a job (--job NAME) and a directory");
    if (dir[0] != '/' || strlen(dir) >= SD_CKPT_PATH_MAX - 160)
        return refuse(json_p, SD_EINVAL,
                      "checkpoint: '%.200s' is not an absolute path of at most %d bytes", dir,
                      SD_CKPT_PATH_MAX - 161);
    if (reg->recovery != NULL)
        return refuse(json_p, SD_EBUSY,
                      "a checkpoint of job '%s' is being written from the replicas; try again "
                      "once it is done",
                      reg->recovery->job->name);
    struct sd_job *job = find(reg, name);
    if (job == NULL || (uid != 0 && job->uid != uid))
        return refuse(json_p, SD_ENOJOB,
                      "no job '%.64s' whose state this node holds (a job that failed keeps its "
                      "state only with resume_timeout_ms, for that long)",
                      name);
    char first[160];
    if (job->node != 0)
        return refuse(json_p, SD_EINVAL,
                      "this daemon serves node %u of job '%s': checkpoint --job runs on the "
                      "daemon of the job's %s, rank 0's, which asks the other nodes for their "
                      "parts",
                      job->node, name, sd_job_peer_name(job, 0, first, sizeof(first)));
    if (!sd_ckpt_idle(job))
        return refuse(json_p, SD_EBUSY, "job '%s' is saving a checkpoint; try again", name);

    bool *up = calloc(job->nodes, sizeof(bool)), *covered = calloc(job->plan.f[SD_STATE_OS], 1);
    struct sd_recovery *rec = calloc(1, sizeof(*rec));
    if (rec != NULL) {
        rec->reporting = calloc(job->nodes, sizeof(bool));
        rec->writers = calloc(job->world, sizeof(uint32_t));
    }
    if (up == NULL || covered == NULL || rec == NULL || rec->reporting == NULL ||
        rec->writers == NULL) {
        free(up);
        free(covered);
        recovery_free(rec);
        return refuse(json_p, SD_ENOMEM, "checkpoint: out of memory");
    }
    uint32_t n_covered = 0;
    for (uint32_t m = 0; m < job->nodes; m++)
        up[m] = sd_job_node_alive(job, m);
    for (uint32_t p = 0; p < job->plan.f[SD_STATE_OS]; p++) {
        uint32_t r = pick_writer(job, p, up);
        if (r == UINT32_MAX)
            continue;
        covered[p] = true;
        n_covered++;
        rec->writers[rec->n_writers++] = r;
        rec->reporting[r / job->k] = true;
    }
    int st = SD_OK;
    if (n_covered < job->plan.f[SD_STATE_OS]) {
        st = refuse_missing(job, covered, up, json_p);
        free(up);
        free(covered);
        recovery_free(rec);
        return st;
    }
    rec->reporting[0] = true;
    rec->later = *later;
    rec->job = job;
    rec->seq = (1ULL << 62) | ++reg->recoveries; /* never a save's number */
    rec->start_ns = sd_now_ns();
    rec->deadline_ns = rec->start_ns + 10ULL * (uint64_t)reg->cfg->op_timeout_ms * 1000000ULL;
    snprintf(rec->dir, sizeof(rec->dir), "%s", dir);
    char err[1024];
    reg->recovery = rec;
    SD_INFO("job", "job '%s': writing a checkpoint of step %llu to %s from %zu ranks' replicas",
            job->name, (unsigned long long)sd_optim_applied(job), dir, rec->n_writers);
    Shard__JobRecover m = SHARD__JOB_RECOVER__INIT;
    m.job = job->name;
    m.seq = rec->seq;
    m.dir = rec->dir;
    m.n_writers = rec->n_writers;
    m.writers = rec->writers;
    m.from = sd_cluster_self(sd_net_cluster(reg->net));
    for (uint32_t node = 1; node < job->nodes; node++)
        if (rec->reporting[node]) {
            m.node = node;
            sd_cluster_job_recover(sd_net_cluster(reg->net), job->xfer.node_ids[node], &m);
        }
    struct sd_ckpt_recover r = {.dir = dir,
                                .seq = rec->seq,
                                .writers = rec->writers,
                                .n_writers = rec->n_writers,
                                .reporting = rec->reporting};
    st = sd_ckpt_recover_write(job, &r, err, sizeof(err));
    free(up);
    free(covered);
    if (st != SD_OK) {
        reg->recovery = NULL;
        recovery_free(rec);
        return refuse(json_p, st, "checkpoint of job '%s': %s", name, err);
    }
    return SD_OK; /* sd_recover_done answers */
}

void sd_recover_peer(struct sd_registry *reg, const Shard__JobRecover *m)
{
    struct sd_job *job = find(reg, m->job);
    char err[1024] = "";
    int st;
    if (job == NULL) {
        st = SD_ENOJOB;
        snprintf(err, sizeof(err),
                 "node %u holds no state of job '%.64s' (it was dropped, or not kept: "
                 "resume_timeout_ms)",
                 m->node, m->job);
    } else if (m->node != job->node || m->from != job->xfer.node_ids[0]) {
        st = SD_EPROTO;
        snprintf(err, sizeof(err),
                 "cluster node %u asked this daemon for job node %u's part of '%.64s', but it "
                 "serves node %u of it, whose node 0 is cluster node %u",
                 m->from, m->node, m->job, job->node, job->xfer.node_ids[0]);
    } else if (m->dir[0] != '/' || strlen(m->dir) >= SD_CKPT_PATH_MAX - 320) {
        st = SD_EPROTO;
        snprintf(err, sizeof(err), "node %u: a recovery into '%.200s' is not valid", m->node,
                 m->dir);
    } else {
        struct sd_ckpt_recover r = {
            .dir = m->dir, .seq = m->seq, .writers = m->writers, .n_writers = m->n_writers};
        st = sd_ckpt_recover_write(job, &r, err, sizeof(err));
    }
    if (st == SD_OK)
        return; /* the write's end reports */
    Shard__JobSaved rep = SHARD__JOB_SAVED__INIT;
    rep.job = m->job;
    rep.node = m->node;
    rep.seq = m->seq;
    rep.status = st;
    rep.message = err;
    rep.dir = m->dir;
    sd_cluster_job_saved(sd_net_cluster(reg->net), m->from, &rep);
}

bool sd_recover_route(struct sd_registry *reg, const Shard__JobSaved *m)
{
    struct sd_recovery *rec = reg->recovery;
    if (rec == NULL || m->seq != rec->seq || strcmp(m->job, rec->job->name) != 0)
        return false;
    sd_ckpt_peer_saved(rec->job, m);
    return true;
}

void sd_recover_done(struct sd_job *job, int status, const char *msg, const struct sd_ckpt *man,
                     const char *final)
{
    struct sd_registry *reg = job->reg;
    struct sd_recovery *rec = reg->recovery;
    if (rec == NULL || rec->job != job)
        return;
    if (status != SD_OK) {
        answer_error(reg, status, msg);
        return;
    }
    char path[SD_CKPT_PATH_MAX + 80];
    snprintf(path, sizeof(path), "%s/%s", rec->dir, final);
    SD_INFO("job", "job '%s': step %llu recovered to %s (%.1f MiB, %.1f ms)", job->name,
            (unsigned long long)man->step, path, (double)man->bytes / 1048576.0,
            (double)(sd_now_ns() - rec->start_ns) / 1e6);
    json_t *lost = json_array(), *writers = json_array();
    for (uint32_t m = 0; m < job->nodes; m++)
        if (!sd_job_node_alive(job, m))
            json_array_append_new(lost, json_integer(m));
    for (size_t i = 0; i < rec->n_writers; i++)
        json_array_append_new(writers, json_integer(rec->writers[i]));
    json_t *o =
        json_pack("{s:s, s:s, s:I, s:s, s:I, s:i, s:o, s:o, s:f}", "job", job->name, "checkpoint",
                  path, "step", (json_int_t)man->step, "plan", man->plan, "bytes",
                  (json_int_t)man->bytes, "files", (int)man->n_files, "lost_nodes", lost, "writers",
                  writers, "ms", (double)(sd_now_ns() - rec->start_ns) / 1e6);
    answer(reg, SD_OK, o);
}

void sd_recover_sweep(struct sd_registry *reg, uint64_t now)
{
    struct sd_recovery *rec = reg->recovery;
    if (rec == NULL || sd_ckpt_reading(rec->job))
        return; /* a worker writes: its end goes on */
    char msg[256] = "";
    for (uint32_t m = 0; m < rec->job->nodes && !msg[0]; m++)
        if (rec->reporting[m] && !sd_job_node_alive(rec->job, m))
            snprintf(msg, sizeof(msg), "node %u went down while it wrote its part", m);
    if (!msg[0] && now >= rec->deadline_ns)
        snprintf(msg, sizeof(msg), "the nodes' parts did not all come within %llu ms",
                 (unsigned long long)(rec->deadline_ns - rec->start_ns) / 1000000ULL);
    if (!msg[0])
        return;
    sd_ckpt_recover_abandon(rec->job);
    answer_error(reg, SD_EPEER, msg);
}

bool sd_recover_target(const struct sd_job *job)
{
    return job->reg->recovery != NULL && job->reg->recovery->job == job;
}

void sd_recover_forget(struct sd_registry *reg, const struct sd_job *job, const char *why)
{
    if (reg->recovery != NULL && (job == NULL || reg->recovery->job == job))
        answer_error(reg, SD_ECANCELED, why);
}

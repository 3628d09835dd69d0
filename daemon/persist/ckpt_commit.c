/* Node 0's part of a save or a recovery (checkpoint.h): the nodes' reports, the manifest, and
 * the commit on a file-pool thread as the job's owner: each node's data file is moved from its
 * temporary directory into node 0's, the MANIFEST written (O_EXCL), the directory renamed into
 * place (a checkpoint of the same step is kept until LATEST names the new one) and LATEST
 * replaced. A save that fails has every part it made removed, by a task of its own. */
#include "checkpoint_int.h"
#include "cluster/cluster.h"
#include "recover.h"
#include "sd/ckpt.h"
#include "sd/log.h"
#include "sd/safe_fs.h"
#include "sd/status.h"
#include "sd/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int sd_ckpt__commit_init(struct sd_job *job)
{
    struct sd_ckpt_commit *cm = &job->load.ckpt->cm;
    cm->reporting = calloc(job->nodes, sizeof(bool));
    cm->rep_file = calloc(job->nodes, sizeof(uint32_t));
    cm->rep_seq = calloc(job->nodes, sizeof(uint64_t));
    cm->reps = calloc(job->nodes, sizeof(*cm->reps));
    cm->tmps = calloc(job->nodes, sizeof(*cm->tmps));
    cm->man.dir_fd = -1;
    return cm->reporting && cm->rep_file && cm->rep_seq && cm->reps && cm->tmps ? SD_OK : SD_ENOMEM;
}

/* drop the nodes' reports node 0 keeps (node 0's own part is items, never a report) */
static void reports_free(struct sd_ckpt_commit *cm, uint32_t nodes)
{
    for (uint32_t m = 0; cm->reps != NULL && m < nodes; m++) {
        if (cm->reps[m] != NULL)
            shard__job_saved__free_unpacked(cm->reps[m], NULL);
        cm->reps[m] = NULL;
    }
}

void sd_ckpt__commit_free(struct sd_job *job)
{
    struct sd_ckpt_commit *cm = &job->load.ckpt->cm;
    sd_ckpt_close(&cm->man);
    reports_free(cm, job->nodes);
    free(cm->reps);
    free(cm->tmps);
    free(cm->reporting);
    free(cm->rep_file);
    free(cm->rep_seq);
}

/* ---- removing the parts of a save that is not committed */

#define DISCARD_MAX 64 /* the temporary directories one task removes; the rest are leftovers */

struct discard {
    struct sd_file_task task;
    char job[64];
    char dir[SD_CKPT_PATH_MAX];
    uint32_t n;
    char names[DISCARD_MAX][128];
};

static void discard_fn(struct sd_file_task *t)
{
    struct discard *d = t->arg;
    int dfd = sd_fs_dir_open(d->dir, false, 0);
    for (uint32_t i = 0; dfd >= 0 && i < d->n; i++) {
        int st = sd_fs_remove(dfd, d->names[i]);
        if (st != 0 && st != -ENOENT)
            SD_WARN("job", "job '%s': removing the partial checkpoint %s/%s: %s", d->job, d->dir,
                    d->names[i], strerror(-st));
    }
    if (dfd >= 0)
        close(dfd);
}

static void discard_after(struct sd_file_task *t, int status)
{
    (void)status;
    free(t->arg);
}

void sd_ckpt__discard(struct sd_job *job, const char *dir, const char *const *names, uint32_t n)
{
    struct discard *d = calloc(1, sizeof(*d));
    char prefix[96];
    sd_ckpt__tmp_prefix(job, prefix, sizeof(prefix));
    for (uint32_t i = 0; d != NULL && i < n && d->n < DISCARD_MAX; i++)
        if (names[i] != NULL && strncmp(names[i], prefix, strlen(prefix)) == 0 &&
            sd_fs_name_ok(names[i]) && strlen(names[i]) < sizeof(d->names[0]))
            snprintf(d->names[d->n++], sizeof(d->names[0]), "%s", names[i]);
    if (d == NULL || d->n == 0 || sd_job_files(job) == NULL) {
        free(d);
        return; /* what is left is removed by the next commit in dir */
    }
    snprintf(d->job, sizeof(d->job), "%s", job->name);
    snprintf(d->dir, sizeof(d->dir), "%s", dir);
    d->task = (struct sd_file_task){
        .id = job->load.ckpt->id, .fn = discard_fn, .after = discard_after, .arg = d};
    sd_file_pool_submit(sd_job_files(job), &d->task);
}

/* every part of save seq that a node made and reported (node 0's own, when it was written) */
static void discard_parts(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const char *names[DISCARD_MAX];
    uint32_t n = 0;
    if (c->cm.rep_seq[0] == c->seq && c->work.status == SD_OK && !c->work.busy)
        names[n++] = c->tmp;
    for (uint32_t m = 1; m < job->nodes && n < DISCARD_MAX; m++) {
        const Shard__JobSaved *r = c->cm.reps[m];
        if (r != NULL && r->seq == c->seq && r->status == SD_OK && r->tmp != NULL)
            names[n++] = r->tmp; /* sd_ckpt__discard takes the job's own names only */
    }
    sd_ckpt__discard(job, c->dir, names, n);
}

/* ---- the commit */

static void commit_after(struct sd_job *job);

/* Partial checkpoints of this job that an earlier save left (a daemon was killed while it
 * wrote, a node's part was never collected): removed, each with a log line. A job's saves run
 * one at a time and every part of this one is moved or removed by now. */
static void remove_leftovers(struct sd_job *job, int dfd)
{
    char prefix[96];
    sd_ckpt__tmp_prefix(job, prefix, sizeof(prefix));
    int lfd = dup(dfd);
    DIR *d = lfd >= 0 ? fdopendir(lfd) : NULL;
    if (d == NULL) {
        if (lfd >= 0)
            close(lfd);
        return;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, prefix, strlen(prefix)) != 0)
            continue;
        int st = sd_fs_remove(dfd, de->d_name);
        SD_WARN("job",
                "job '%s': removed the partial checkpoint %s/%s an interrupted save left%s%s",
                job->name, job->load.ckpt->dir, de->d_name, st == SD_OK ? "" : ": ",
                st == SD_OK ? "" : strerror(-st));
    }
    closedir(d);
}

/* node m's data file from its temporary directory into node 0's (tfd) */
static int gather_part(struct sd_job *job, int dfd, int tfd, uint32_t m)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const char *tmp = c->cm.tmps[m];
    char file[64];
    snprintf(file, sizeof(file), "data-%u.bin", m);
    int mfd = sd_fs_subdir(dfd, tmp);
    if (mfd < 0) {
        sd_ckpt__fail(job, mfd, "node %u's part %s/%s: %s", m, c->dir, tmp, sd_ckpt__hint(mfd));
        return mfd;
    }
    struct stat st;
    int status = SD_OK;
    if (fstatat(mfd, file, &st, AT_SYMLINK_NOFOLLOW) != 0)
        status = -errno;
    else if (!S_ISREG(st.st_mode) || st.st_uid != c->id.uid)
        status = SD_EPERM;
    else if (renameat2(mfd, file, tfd, file, RENAME_NOREPLACE) != 0 &&
             (errno != EINVAL || renameat(mfd, file, tfd, file) != 0))
        status = -errno;
    close(mfd);
    if (status != SD_OK)
        sd_ckpt__fail(job, status, "node %u's part %s/%s/%s: %s", m, c->dir, tmp, file,
                      status == SD_EPERM ? "not a regular file of the job's owner"
                                         : sd_ckpt__hint(status));
    else
        sd_fs_remove(dfd, tmp);
    return status;
}

/* On a worker, as the job's owner: the parts into node 0's directory, the manifest, the
 * commit; or, on any failure, every part removed. */
static void commit_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    sd_ckpt__test_stall(job, "commit");
    int dfd = sd_fs_dir_open(c->dir, false, 0);
    if (dfd < 0) {
        sd_ckpt__fail(job, dfd, "opening %.900s: %s", c->dir, sd_ckpt__hint(dfd));
        return;
    }
    int tfd = sd_fs_subdir(dfd, c->tmp);
    if (tfd < 0)
        sd_ckpt__fail(job, tfd, "node 0's part %.900s/%s: %s", c->dir, c->tmp, sd_ckpt__hint(tfd));
    for (uint32_t m = 1; tfd >= 0 && m < job->nodes; m++)
        if (c->cm.reporting[m] && gather_part(job, dfd, tfd, m) != SD_OK)
            break;
    char path[SD_CKPT_PATH_MAX + 160];
    snprintf(path, sizeof(path), "%s/%s", c->dir, c->tmp);
    if (c->work.status == SD_OK)
        c->work.status =
            sd_ckpt_write_manifest(tfd, path, &c->cm.man, c->work.err, sizeof(c->work.err));
    if (tfd >= 0)
        close(tfd);
    if (c->work.status == SD_OK)
        c->work.status =
            sd_ckpt_commit(dfd, c->dir, c->tmp, c->final, c->work.err, sizeof(c->work.err));
    if (c->work.status != SD_OK || sd_ckpt__abandoned(job))
        sd_fs_remove(dfd, c->tmp); /* the parts not moved yet are leftovers, removed next */
    remove_leftovers(job, dfd);
    close(dfd);
}

void sd_ckpt_sweep(struct sd_job *job, uint64_t now, uint64_t timeout)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || job->node != 0 || !c->saving || c->recovery || c->work.busy || c->seq == 0 ||
        c->cm.rep_seq[0] != c->seq || c->first_ns == 0)
        return;
    uint64_t bytes = 0;
    for (uint32_t t = 0; t < job->layout.n_tensors; t++)
        bytes += job->layout.tensors[t].numel * sd_ckpt_states(job->model.optim.kind) * 4;
    uint64_t limit = timeout + (uint64_t)((double)bytes / (16.0 * 1048576.0) * 1e9);
    if (now - c->first_ns <= limit)
        return;
    char late[256] = "";
    size_t at = 0;
    for (uint32_t m = 1; m < job->nodes && at < sizeof(late) - 16; m++)
        if (c->cm.reporting[m] && c->cm.rep_seq[m] != c->seq)
            at += (size_t)snprintf(late + at, sizeof(late) - at, "%s%u", at ? ", " : "", m);
    discard_parts(job);
    c->cm.rep_seq[0] = 0; /* taken: the save is over */
    reports_free(&c->cm, job->nodes);
    c->work.status = SD_ETIMEDOUT;
    snprintf(c->work.err, sizeof(c->work.err),
             "node 0: node %s did not report its part of step %llu within %.1f s (op_timeout_ms, "
             "and the job's %.1f MiB of states at 16 MiB/s)",
             late, (unsigned long long)c->step, (double)limit / 1e9, (double)bytes / 1048576.0);
    commit_after(job);
}

static void commit_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c->recovery) { /* answered first: a save starting next reuses err */
        sd_recover_done(job, c->work.status, c->work.err, &c->cm.man, c->final);
        sd_ckpt_close(&c->cm.man);
        sd_ckpt__recovery_end(job);
        return;
    }
    sd_ckpt_close(&c->cm.man);
    if (job->state != SD_JOB_READY)
        return;
    char msg[1200];
    snprintf(msg, sizeof(msg), "save: %s", c->work.err);
    if (c->work.status == SD_OK) {
        c->saves++;
        c->save_ns = sd_now_ns() - c->first_ns;
        SD_INFO("job", "job '%s': step %llu saved to %s/%s (%.1f MiB, %.1f ms; node 0 wrote %s)",
                job->name, (unsigned long long)c->step, c->dir, c->final,
                (double)c->bytes_saved / 1048576.0, (double)c->save_ns / 1e6,
                atomic_load(&c->direct) ? "with O_DIRECT" : "buffered");
    } else {
        SD_WARN("job", "job '%s': %s", job->name, msg);
    }
    if (job->nodes > 1)
        sd_cluster_job_save_done(sd_job_cluster(job), job->name, job->xfer.node_ids, job->nodes,
                                 c->seq, c->work.status, c->work.status == SD_OK ? "" : msg);
    sd_ckpt__save_answer(job, c->work.status, msg); /* (its latency from first_ns) */
    c->first_ns = 0;
    sd_job_event(job, SD_JOB_EV_OS_FREE);
}

/* the manifest of save seq from every node's extents (node m's in data-m.bin) */
static int build_manifest(struct sd_job *job, const Shard__JobSaved *const *reps)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    struct sd_ckpt *man = &c->cm.man;
    memset(man, 0, sizeof(*man));
    man->dir_fd = -1;
    snprintf(man->job, sizeof(man->job), "%s", job->name);
    snprintf(man->plan, sizeof(man->plan), "%s", job->plan.name);
    man->step = c->step;
    man->world = job->world;
    man->ranks_per_node = job->k;
    man->nodes = job->nodes;
    man->optim_kind = job->model.optim.kind;
    man->max_grad_norm = job->model.optim.max_grad_norm;
    man->n_states = sd_ckpt_states(man->optim_kind);
    man->n_tensors = job->model.n_tensors;
    man->n_groups = sd_model_groups(&job->model);
    uint32_t *file_of = c->cm.rep_file; /* the nodes that wrote, in order: data-<node>.bin */
    man->n_files = 0;
    for (uint32_t m = 0; m < job->nodes; m++)
        if (m == 0 || c->cm.reporting[m])
            file_of[m] = man->n_files++;
    man->n_extents = c->n_items;
    for (uint32_t m = 1; m < job->nodes; m++)
        man->n_extents += c->cm.reporting[m] ? reps[m]->n_extents : 0;
    man->tensors = calloc(man->n_tensors, sizeof(*man->tensors));
    man->groups = calloc(man->n_groups, sizeof(*man->groups));
    man->files = calloc(man->n_files, sizeof(*man->files));
    man->extents = calloc(man->n_extents + 1, sizeof(*man->extents));
    if (!man->tensors || !man->groups || !man->files || !man->extents)
        return SD_ENOMEM;
    for (uint32_t t = 0; t < man->n_tensors; t++) {
        const struct sd_tensor_desc *d = &job->model.tensors[t];
        struct sd_ckpt_tensor *ct = &man->tensors[t];
        snprintf(ct->name, sizeof(ct->name), "%s", d->name);
        ct->ndim = d->ndim;
        memcpy(ct->dims, d->dims, sizeof(ct->dims));
        ct->dtype = d->dtype;
        ct->unit = d->unit;
        ct->group = d->group;
        ct->steps = c->snap_steps[t];
    }
    memcpy(man->groups, c->snap_hp, man->n_groups * sizeof(*man->groups));
    for (uint32_t m = 0; m < job->nodes; m++)
        if (m == 0 || c->cm.reporting[m])
            snprintf(man->files[file_of[m]], sizeof(man->files[0]), "data-%u.bin", m);
    uint64_t n = 0;
    for (uint64_t i = 0; i < c->n_items; i++)
        man->extents[n++] = c->items[i];
    for (uint32_t m = 1; m < job->nodes; m++)
        for (size_t i = 0; c->cm.reporting[m] && i < reps[m]->n_extents; i++) {
            const Shard__CkptExtent *x = reps[m]->extents[i];
            if (x->state >= man->n_states || x->tensor >= man->n_tensors || x->end <= x->begin)
                return SD_EPROTO;
            man->extents[n++] = (struct sd_ckpt_extent){.state = x->state,
                                                        .tensor = x->tensor,
                                                        .file = file_of[m],
                                                        .begin = x->begin,
                                                        .end = x->end,
                                                        .file_off = x->offset,
                                                        .crc = x->crc};
        }
    for (uint64_t i = 0; i < n; i++)
        man->bytes += (man->extents[i].end - man->extents[i].begin) * sizeof(float);
    c->bytes_saved = man->bytes;
    return SD_OK;
}

/* Why save seq cannot be committed (a node's failure, or nodes that disagree), or SD_OK */
static int reports_check(struct sd_job *job, char *msg, size_t len)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c->work.status != SD_OK) {
        snprintf(msg, len, "%s%s", strncmp(c->work.err, "node ", 5) ? "node 0: " : "", c->work.err);
        return c->work.status;
    }
    for (uint32_t m = 1; m < job->nodes; m++) {
        const Shard__JobSaved *r = c->cm.reps[m];
        if (!c->cm.reporting[m])
            continue;
        if (r->status != SD_OK) {
            snprintf(msg, len, "%.1000s", r->message);
            return r->status;
        }
        char prefix[96];
        sd_ckpt__tmp_prefix(job, prefix, sizeof(prefix));
        if (r->tmp == NULL || strncmp(r->tmp, prefix, strlen(prefix)) != 0 ||
            !sd_fs_name_ok(r->tmp) || strlen(r->tmp) >= sizeof(c->cm.tmps[0])) {
            snprintf(msg, len, "node %u reports its part in '%.64s', not a directory of the job", m,
                     r->tmp ? r->tmp : "");
            return SD_EPROTO;
        }
        if (c->recovery && r->step != c->step) {
            snprintf(msg, len,
                     "node %u's optimizer states hold step %llu, node 0's step %llu: a step was "
                     "being applied when the job stopped (a node lost between the update and the "
                     "new weights)%s",
                     m, (unsigned long long)r->step, (unsigned long long)c->step,
                     job->state == SD_JOB_READY ? "; try again between steps" : "");
            return SD_EMISMATCH;
        }
        if (r->step != c->step || strcmp(r->dir, c->dir) != 0) {
            snprintf(msg, len,
                     "node %u saves step %llu to '%.300s', node 0 step %llu to '%.300s': every "
                     "rank saves "
                     "to the same directory between the same two steps",
                     m, (unsigned long long)r->step, r->dir, (unsigned long long)c->step, c->dir);
            return SD_EMISMATCH;
        }
    }
    return SD_OK;
}

/* the report of every node is in: commit, or give the save up */
static void save_collect(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (sd_ckpt__working(job) || c->seq == 0)
        return;
    for (uint32_t m = 0; m < job->nodes; m++)
        if ((m == 0 || c->cm.reporting[m]) && c->cm.rep_seq[m] != c->seq)
            return;
    char msg[1200];
    int status = reports_check(job, msg, sizeof(msg));
    if (status == SD_OK &&
        (status = build_manifest(job, (const Shard__JobSaved *const *)c->cm.reps)) != SD_OK)
        snprintf(msg, sizeof(msg), "node 0: building the manifest: %s", sd_status_str(status));
    if (status != SD_OK) {
        discard_parts(job);
        c->cm.rep_seq[0] = 0; /* taken */
        reports_free(&c->cm, job->nodes);
        sd_ckpt_close(&c->cm.man);
        c->work.status = status;
        snprintf(c->work.err, sizeof(c->work.err), "%.1000s", msg);
        commit_after(job);
        return;
    }
    c->cm.rep_seq[0] = 0;                     /* taken */
    for (uint32_t m = 1; m < job->nodes; m++) /* what the commit's worker reads of them */
        if (c->cm.reporting[m])
            snprintf(c->cm.tmps[m], sizeof(c->cm.tmps[m]), "%s", c->cm.reps[m]->tmp);
    reports_free(&c->cm, job->nodes);
    sd_ckpt__run_worker(job, commit_work, commit_after, "committing the checkpoint",
                        sd_ckpt__deadline(job, 0));
}

void sd_ckpt__own_part(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->cm.rep_seq[0] = c->seq;
    save_collect(job);
}

void sd_ckpt_peer_saved(struct sd_job *job, const Shard__JobSaved *m)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    /* kept whatever node 0 waits for now: a node whose ranks came to a save first may report
     * before node 0's ranks have all come to it (save_collect takes what it waits for) */
    if (c == NULL || job->node != 0 || m->node == 0 || m->node >= job->nodes)
        return;
    /* keep a copy: the message is the link's */
    size_t len = shard__job_saved__get_packed_size(m);
    uint8_t *buf = malloc(len + 1);
    if (buf == NULL)
        return;
    shard__job_saved__pack(m, buf);
    if (c->cm.reps[m->node] != NULL)
        shard__job_saved__free_unpacked(c->cm.reps[m->node], NULL);
    c->cm.reps[m->node] = shard__job_saved__unpack(NULL, len, buf);
    free(buf);
    if (c->cm.reps[m->node] == NULL)
        return;
    c->cm.rep_seq[m->node] = m->seq;
    save_collect(job);
}

void sd_ckpt_recover_abandon(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || !c->recovery || c->work.busy || c->q_then != NULL)
        return;
    discard_parts(job);
    reports_free(&c->cm, job->nodes);
    memset(c->cm.rep_seq, 0, job->nodes * sizeof(*c->cm.rep_seq));
    sd_ckpt__recovery_end(job);
}

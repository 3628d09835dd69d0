/* Checkpoints of a job (DESIGN.md section 3b; the format is sd/ckpt.h's).
 *
 * Save (SD_OP_SAVE, every rank, at a step boundary): once the node's ranks are all in the call,
 * each node writes the optimizer shards it is the designated replica of into its data file on a
 * worker thread and reports the extents and their crcs to node 0. Node 0 writes the MANIFEST,
 * renames the directory into place and replaces LATEST (also on a worker), then answers every
 * node. One replica per extent: rank R writes its os shard p when R / f_os == p % (world / f_os),
 * so the model states are written once, spread over the replication groups.
 *
 * Load (a registration that names a checkpoint): the manifest is read and checked against the
 * model at registration; once the memory is allocated each node reads, on a worker, the ranges
 * of each state its ranks' shards need, then sets the fp32 masters and moments and derives the
 * weights in their dtype from the masters. Every node loads on its own and is ready when done. */
#include "checkpoint_int.h"
#include "cluster/cluster.h"
#include "net.h"
#include "ops.h"
#include "recover.h"
#include "session.h"
#include "sd/ckpt.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct ckpt_work {
    uv_work_t req;
    struct sd_job *job; /* NULL: freed while the work ran (shutdown), nothing after it */
    void (*fn)(struct sd_job *job);
    void (*after)(struct sd_job *job);
    struct ckpt_work *next;
};

/* the works queued and not yet after their after_cb, of every job (the loop's thread) */
static struct ckpt_work *works;

static void works_unlink(struct ckpt_work *w)
{
    for (struct ckpt_work **p = &works; *p != NULL; p = &(*p)->next)
        if (*p == w) {
            *p = w->next;
            return;
        }
}

static void work_cb(uv_work_t *req)
{
    struct ckpt_work *w = req->data;
    w->fn(w->job);
    atomic_store(&w->job->load.ckpt->running, false);
}

static void after_cb(uv_work_t *req, int uv_status)
{
    struct ckpt_work *w = req->data;
    struct sd_job *job = w->job;
    works_unlink(w);
    if (job == NULL) { /* the job went while the work ran (sd_ckpt_wait_worker) */
        free(w);
        return;
    }
    job->load.ckpt->busy = false;
    if (uv_status != 0 && job->load.ckpt->status == SD_OK) {
        job->load.ckpt->status = SD_ECANCELED;
        snprintf(job->load.ckpt->err, sizeof(job->load.ckpt->err), "cancelled");
    }
    void (*after)(struct sd_job *) = w->after;
    free(w);
    after(job);
    if (job->state == SD_JOB_READY && job->step.phase == SD_STEP_APPLY && !sd_ckpt_busy(job))
        sd_step_progress(job); /* a step waited for the worker to leave the os shards */
}

/* fn on a worker thread (in place without a loop), then after on the loop */
void sd_ckpt__run_worker(struct sd_job *job, void (*fn)(struct sd_job *),
                         void (*after)(struct sd_job *))
{
    struct sd_ckpt_job *c = job->load.ckpt;
    struct ckpt_work *w = job->reg->loop != NULL ? calloc(1, sizeof(*w)) : NULL;
    c->status = SD_OK;
    c->err[0] = '\0';
    if (w != NULL) {
        *w = (struct ckpt_work){.job = job, .fn = fn, .after = after};
        w->req.data = w;
        c->busy = true;
        atomic_store(&c->running, true);
        if (uv_queue_work(job->reg->loop, &w->req, work_cb, after_cb) == 0) {
            w->next = works;
            works = w;
            return;
        }
        c->busy = false;
        atomic_store(&c->running, false);
        free(w);
    }
    fn(job);
    after(job);
}

bool sd_ckpt_busy(const struct sd_job *job)
{
    return job->load.ckpt != NULL && job->load.ckpt->busy;
}

static bool owner_ok(const struct sd_job *job, const char *path, char *err, size_t errlen)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        snprintf(err, errlen, "%.900s: %s", path, strerror(errno));
        return false;
    }
    if (job->uid == 0 || job->uid == geteuid() || st.st_uid == job->uid)
        return true;
    snprintf(err, errlen, "%.900s belongs to uid %d, not to the job's uid %d", path, (int)st.st_uid,
             (int)job->uid);
    return false;
}

/* ---- lifecycle */

/* node 0: drop the nodes' reports it keeps (node 0's own part is items, never a report) */
static void reports_free(struct sd_ckpt_job *c, uint32_t nodes)
{
    for (uint32_t m = 0; c->reps != NULL && m < nodes; m++) {
        if (c->reps[m] != NULL)
            shard__job_saved__free_unpacked(c->reps[m], NULL);
        c->reps[m] = NULL;
    }
}

int sd_ckpt_job_init(struct sd_job *job, const char *load_dir, char *err, size_t errlen)
{
    struct sd_ckpt_job *c = calloc(1, sizeof(*c));
    if (c == NULL || (c->waiting = calloc(job->k, sizeof(bool))) == NULL ||
        (c->writer = calloc(job->k, sizeof(bool))) == NULL ||
        (c->reporting = calloc(job->nodes, sizeof(bool))) == NULL ||
        (c->rep_file = calloc(job->nodes, sizeof(uint32_t))) == NULL ||
        (c->snap_steps = calloc(job->model.n_tensors + 1, sizeof(uint64_t))) == NULL ||
        (c->snap_hp = calloc(sd_model_groups(&job->model) + 1, sizeof(*c->snap_hp))) == NULL ||
        (c->tags = calloc(job->k, sizeof(uint64_t))) == NULL ||
        (c->rep_seq = calloc(job->nodes, sizeof(uint64_t))) == NULL ||
        (c->reps = calloc(job->nodes, sizeof(*c->reps))) == NULL) {
        job->load.ckpt = c;
        snprintf(err, errlen, "out of memory");
        return SD_ENOMEM;
    }
    job->load.ckpt = c;
    if (load_dir == NULL || load_dir[0] == '\0')
        return SD_OK;
    if (load_dir[0] != '/') {
        snprintf(err, errlen, "load: '%s' is not an absolute path", load_dir);
        return SD_EINVAL;
    }
    snprintf(c->load_dir, sizeof(c->load_dir), "%s", load_dir);
    int status = sd_ckpt_open(load_dir, &c->src, err, errlen);
    if (status != SD_OK)
        return status;
    c->load = true;
    if (!owner_ok(job, c->src.path, err, errlen))
        return SD_EPERM;
    char diff[512];
    if ((status = sd_ckpt_check_model(&c->src, &job->model, diff, sizeof(diff))) != SD_OK) {
        snprintf(err, errlen, "checkpoint %s is of another model: %s", c->src.path, diff);
        return status;
    }
    return SD_OK;
}

const char *sd_ckpt_load_dir(const struct sd_job *job)
{
    return job->load.ckpt != NULL ? job->load.ckpt->load_dir : "";
}

bool sd_ckpt_loading(const struct sd_job *job)
{
    return job->load.ckpt != NULL && job->load.ckpt->load;
}

uint64_t sd_ckpt_start_step(const struct sd_job *job)
{
    return sd_ckpt_loading(job) ? job->load.ckpt->src.step : 0;
}

struct sd_hparams sd_ckpt_hparams(const struct sd_job *job, uint32_t g)
{
    if (sd_ckpt_loading(job) && g < job->load.ckpt->src.n_groups)
        return job->load.ckpt->src.groups[g];
    return sd_model_group(&job->model, g);
}

void sd_ckpt_wait_worker(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || !c->busy)
        return;
    SD_WARN("job", "job '%s': waiting for its checkpoint worker to finish before its memory goes",
            job->name);
    while (atomic_load(&c->running)) /* shutdown with a worker still reading or writing */
        usleep(1000);
    for (struct ckpt_work *w = works; w != NULL; w = w->next)
        if (w->job == job)
            w->job = NULL; /* its after_cb comes once the job is gone */
}

void sd_ckpt_job_free(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL)
        return;
    sd_ckpt_wait_worker(job);
    sd_ckpt_close(&c->src);
    sd_ckpt_close(&c->man);
    free(c->load_buf);
    free(c->waiting);
    free(c->writer);
    free(c->reporting);
    free(c->rep_file);
    free(c->snap_steps);
    free(c->snap_hp);
    free(c->tags);
    free(c->rep_seq);
    reports_free(c, job->nodes);
    free(c->reps);
    free(c->items);
    free(c->item_src);
    free(c);
    job->load.ckpt = NULL;
}

json_t *sd_ckpt_json(const struct sd_job *job)
{
    const struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL)
        return json_null();
    return json_pack("{s:s, s:I, s:f, s:I, s:I, s:f, s:I, s:b, s:b}", "loaded_from",
                     c->load ? c->src.path : "", "loaded_bytes", (json_int_t)c->loaded_bytes,
                     "load_ms", (double)c->load_ns / 1e6, "saves", (json_int_t)c->saves,
                     "saved_bytes", (json_int_t)c->bytes_saved, "last_save_ms",
                     (double)c->save_ns / 1e6, "save_seq", (json_int_t)c->seq, "busy", c->busy,
                     "save_direct", atomic_load(&c->direct));
}

/* ---- saving */

static void save_answer(struct sd_job *job, int status, const char *msg)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    for (uint32_t r = 0; r < job->k; r++) {
        bool waiting = c->waiting[r];
        c->waiting[r] = false;
        if (!waiting || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_SAVE]++;
        if (status == SD_OK)
            sd_latency_add(&job->stats.lat[SD_OP_SAVE], sd_now_ns() - c->first_ns);
        sd_session_complete(job->ranks[r], c->tags[r], SD_OP_SAVE, status, c->step, c->seq,
                            status == SD_OK ? NULL : msg);
    }
    c->arrived = 0;
    c->saving = false;
}

void sd_ckpt_fail_parked(struct sd_job *job, int status, const char *msg)
{
    if (job->load.ckpt != NULL)
        save_answer(job, status, msg);
}

bool sd_ckpt_is_writer(const struct sd_job *job, uint32_t rank)
{
    uint32_t f = job->plan.f[SD_STATE_OS];
    return rank / f == sd_plan_shard(&job->plan, SD_STATE_OS, rank) % (job->world / f);
}

/* this node's extents, their sources and their place in its data file */
static int save_plan(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const struct sd_layout *l = &job->layout;
    uint32_t n_states = sd_ckpt_states(job->model.optim.kind);
    uint64_t os_stride = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]), cap = 0, n = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t file_off = 0;
        n = 0;
        for (uint32_t r = 0; r < job->k; r++) {
            if (!c->writer[r])
                continue;
            const float *os = sd_job_state(job, r, SD_STATE_OS);
            for (uint32_t u = 0; u < l->n_units; u++) {
                const struct sd_unit_layout *ul = &l->units[u];
                uint64_t b, e;
                sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
                for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors; t++) {
                    const struct sd_tensor_layout *tl = &l->tensors[t];
                    uint64_t lo = SD_MAX(b, tl->offset), hi = SD_MIN(e, tl->offset + tl->numel);
                    for (uint64_t a = lo; a < hi; a += SD_CKPT_EXTENT_ELEMS) {
                        uint64_t z = SD_MIN(hi, a + SD_CKPT_EXTENT_ELEMS);
                        for (uint32_t s = 0; s < n_states; s++, n++) {
                            if (pass == 1) {
                                c->item_src[n] =
                                    os + s * os_stride + ul->arena_off[SD_STATE_OS] + (a - b);
                                c->items[n] = (struct sd_ckpt_extent){.state = s,
                                                                      .tensor = t,
                                                                      .file = job->node,
                                                                      .begin = a - tl->offset,
                                                                      .end = z - tl->offset,
                                                                      .file_off = file_off};
                            }
                            file_off += (z - a) * sizeof(float);
                        }
                    }
                }
            }
        }
        if (pass == 0) {
            cap = n;
            free(c->items);
            free(c->item_src);
            c->items = calloc(cap + 1, sizeof(*c->items));
            c->item_src = calloc(cap + 1, sizeof(*c->item_src));
            if (c->items == NULL || c->item_src == NULL)
                return SD_ENOMEM;
        }
    }
    c->n_items = n;
    return SD_OK;
}

static int mkdir_owned(const struct sd_job *job, const char *path)
{
    if (mkdir(path, 0750) == 0) {
        if (job->uid != geteuid() && chown(path, job->uid, (gid_t)-1) != 0)
            return -errno;
        return SD_OK;
    }
    return errno == EEXIST ? SD_OK : -errno;
}

/* SHARDD_TEST_SAVE_STALL=NODE:MS: that node's writes of its part start MS late (a stalled
 * filesystem, for tests); read on the loop before the first write */
static long test_stall_node = -2, test_stall_ms;

static void save_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (test_stall_node == (long)job->node && test_stall_ms > 0)
        usleep((useconds_t)test_stall_ms * 1000);
    char tmp[SD_CKPT_PATH_MAX + 160], file[SD_CKPT_PATH_MAX + 256];
    snprintf(tmp, sizeof(tmp), "%s/%s", c->dir, c->tmp);
    int st = mkdir_owned(job, c->dir);
    if (st == SD_OK && !owner_ok(job, c->dir, c->err, sizeof(c->err))) {
        c->status = SD_EPERM;
        return;
    }
    if (st == SD_OK)
        st = mkdir_owned(job, tmp);
    if (st != SD_OK) {
        c->status = st;
        snprintf(c->err, sizeof(c->err), "creating %.900s: %s", tmp, sd_status_str(st));
        return;
    }
    snprintf(file, sizeof(file), "%s/data-%u.bin", tmp, job->node);
    int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0640);
    if (fd < 0) {
        c->status = -errno;
        snprintf(c->err, sizeof(c->err), "creating %.900s: %s", file, strerror(errno));
        return;
    }
    if (job->uid != geteuid() && fchown(fd, job->uid, (gid_t)-1) != 0)
        st = -errno;
    struct sd_ckpt_io io = {.threads = (uint32_t)job->reg->cfg->checkpoint_threads,
                            .direct = job->reg->cfg->checkpoint_direct != 0};
    bool direct = false;
    if (st == SD_OK)
        st = sd_ckpt_write_extents(fd, c->items, c->item_src, c->n_items, &io, &direct);
    atomic_store(&c->direct, direct);
    if (st == SD_OK && fsync(fd) != 0)
        st = -errno;
    close(fd);
    if (st != SD_OK) {
        c->status = st;
        snprintf(c->err, sizeof(c->err), "writing %.900s: %s", file, sd_status_str(st));
    }
}

static void save_collect(struct sd_job *job);
static void save_parked(struct sd_job *job);

/* A recovery's write on this node is over (done, failed or given up): the saves' numbering is
 * back, and a save the ranks wait in meanwhile starts. */
static void recovery_end(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->recovery = false;
    c->seq = c->save_seq;
    save_parked(job);
}

static void save_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (!c->recovery && job->state != SD_JOB_READY) {
        if (job->node == 0) /* the save is given up: nobody commits it */
            sd_ckpt_remove(c->dir, c->tmp);
        return;
    }
    if (job->node == 0) {
        c->rep_seq[0] = c->seq;
        save_collect(job);
        return;
    }
    Shard__CkptExtent *xs = calloc(c->n_items + 1, sizeof(*xs));
    Shard__CkptExtent **xp = calloc(c->n_items + 1, sizeof(*xp));
    Shard__JobSaved m = SHARD__JOB_SAVED__INIT;
    m.job = job->name;
    m.node = job->node;
    m.seq = c->seq;
    m.step = c->step;
    m.status = xs == NULL || xp == NULL ? SD_ENOMEM : c->status;
    m.message = c->err;
    m.dir = c->dir;
    for (uint64_t i = 0; m.status == SD_OK && i < c->n_items; i++) {
        const struct sd_ckpt_extent *x = &c->items[i];
        shard__ckpt_extent__init(&xs[i]);
        xs[i] = (Shard__CkptExtent){.base = xs[i].base,
                                    .state = x->state,
                                    .tensor = x->tensor,
                                    .begin = x->begin,
                                    .end = x->end,
                                    .offset = x->file_off,
                                    .crc = x->crc};
        xp[i] = &xs[i];
    }
    m.n_extents = m.status == SD_OK ? c->n_items : 0;
    m.extents = xp;
    sd_cluster_job_saved(job->reg->net->cl, &m);
    free(xs);
    free(xp);
    if (c->recovery) /* this node's part of it is done */
        recovery_end(job);
}

/* This node's part of save c->seq (c->dir, c->tmp, c->writer set): the step the os shards hold
 * and what the manifest says of it, then the extents written on a worker. */
static int write_part(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->step = job->opt.applied;
    sd_ckpt_step_name(c->final, sizeof(c->final), c->step);
    memcpy(c->snap_steps, job->opt.tensor_steps, job->model.n_tensors * sizeof(uint64_t));
    memcpy(c->snap_hp, job->opt.hparams, sd_model_groups(&job->model) * sizeof(*c->snap_hp));
    if (job->state == SD_JOB_READY && !sd_job_sync(job))
        return SD_EJOBFAILED;
    int st = save_plan(job);
    if (st != SD_OK)
        return st;
    if (test_stall_node == -2) {
        const char *v = getenv("SHARDD_TEST_SAVE_STALL");
        test_stall_node = v ? strtol(v, NULL, 10) : -1;
        test_stall_ms = v && strchr(v, ':') ? strtol(strchr(v, ':') + 1, NULL, 10) : 0;
    }
    sd_ckpt__run_worker(job, save_work, save_after);
    return SD_OK;
}

/* every local rank is in the save: plan this node's part and write it */
static void save_start(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->seq++;
    c->saving = true;
    c->recovery = false;
    snprintf(c->dir, sizeof(c->dir), "%s", c->save_dir);
    snprintf(c->tmp, sizeof(c->tmp), ".tmp-%s-%llu-%llu", job->name, (unsigned long long)job->steps,
             (unsigned long long)c->seq);
    for (uint32_t r = 0; r < job->k; r++)
        c->writer[r] = sd_ckpt_is_writer(job, job->first_rank + r);
    for (uint32_t m = 0; m < job->nodes; m++)
        c->reporting[m] = true;
    int st = write_part(job);
    if (st == SD_ENOMEM)
        save_answer(job, st, "save: out of memory");
}

bool sd_ckpt_idle(const struct sd_job *job)
{
    const struct sd_ckpt_job *c = job->load.ckpt;
    return c != NULL && !c->busy && !c->recovery && c->arrived == 0;
}

int sd_ckpt_recover_write(struct sd_job *job, const struct sd_ckpt_recover *r, char *err,
                          size_t errlen)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (!sd_ckpt_idle(job)) {
        snprintf(err, errlen, "node %u: job '%s' is saving a checkpoint", job->node, job->name);
        return SD_EBUSY;
    }
    snprintf(c->dir, sizeof(c->dir), "%s", r->dir);
    snprintf(c->tmp, sizeof(c->tmp), "%s", r->tmp);
    memset(c->writer, 0, job->k * sizeof(bool));
    for (size_t i = 0; i < r->n_writers; i++)
        if (r->writers[i] >= job->first_rank && r->writers[i] < job->first_rank + job->k)
            c->writer[r->writers[i] - job->first_rank] = true;
    for (uint32_t m = 0; m < job->nodes; m++)
        c->reporting[m] = r->reporting != NULL && r->reporting[m];
    c->save_seq = c->seq;
    c->seq = r->seq;
    c->recovery = true;
    int st = write_part(job);
    if (st != SD_OK) {
        recovery_end(job);
        snprintf(err, errlen, "node %u: %s", job->node, sd_status_str(st));
    }
    return st;
}

void sd_ckpt_save(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    char path[SD_CKPT_PATH_MAX];
    uint64_t len = e->arg0;
    const char *area = (const char *)job->mem.staging[s->local].ptr + job->mem.save_path_off;
    if (len == 0 || len >= SD_CKPT_PATH_MAX || memchr(area, '\0', len) != NULL) {
        sd_session_fail(s, e, SD_EINVAL,
                        "save: the directory's length %llu is not in 1..%d or it holds a NUL",
                        (unsigned long long)len, SD_CKPT_PATH_MAX - 1);
        return;
    }
    memcpy(path, area, len);
    path[len] = '\0';
    if (path[0] != '/') {
        sd_session_fail(s, e, SD_EINVAL, "save: '%s' is not an absolute path", path);
        return;
    }
    if (c->waiting[s->local] || (c->busy && !c->recovery)) {
        sd_session_fail(s, e, SD_EBUSY, "save: rank %u's previous save is still running", s->rank);
        return;
    }
    if (job->step.arrived > 0) {
        sd_session_fail(s, e, SD_ESTATE,
                        "save: other ranks of this node are in step %llu; every rank saves "
                        "between the same two steps",
                        (unsigned long long)job->steps + 1);
        return;
    }
    if (c->arrived == 0) {
        snprintf(c->save_dir, sizeof(c->save_dir), "%s", path);
        c->first_ns = sd_now_ns();
    } else if (strcmp(c->save_dir, path) != 0) {
        sd_session_fail(s, e, SD_EMISMATCH,
                        "save: rank %u saves to '%s', the other ranks of this node to '%s'",
                        s->rank, path, c->save_dir);
        return;
    }
    c->waiting[s->local] = true;
    c->tags[s->local] = e->tag;
    c->arrived++;
    save_parked(job);
}

/* every local rank is in the save and no recovery writes: start it (the end of a recovery's
 * part calls again) */
static void save_parked(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c->arrived == job->k && !c->saving && !c->recovery && !c->busy &&
        job->state == SD_JOB_READY)
        save_start(job);
}

/* a save barrier that waits too long (sd_job_sweep): the ranks it waits for */
bool sd_ckpt_overdue(struct sd_job *job, uint64_t now, uint64_t timeout, bool *present)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || c->arrived == 0 || c->arrived == job->k || now - c->first_ns <= timeout)
        return false;
    for (uint32_t r = 0; r < job->k; r++)
        present[r] = c->waiting[r];
    return true;
}

/* ---- node 0: the reports, the manifest and the commit */

/* Partial checkpoints of this job that an earlier save left (its daemon was killed while it
 * wrote): removed, each with a log line. A job's saves run one at a time, so only the one being
 * committed is its own. */
static void commit_after(struct sd_job *job);

/* Node 0: a save whose other nodes have not all reported their parts within op_timeout_ms and
 * the job's states at 16 MiB/s (a stalled filesystem, a lost report) fails naming them, and
 * every rank is answered, instead of waiting for ever. Late reports are kept and ignored. */
void sd_ckpt_sweep(struct sd_job *job, uint64_t now, uint64_t timeout)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || job->node != 0 || !c->saving || c->recovery || c->busy || c->seq == 0 ||
        c->rep_seq[0] != c->seq || c->first_ns == 0)
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
        if (c->reporting[m] && c->rep_seq[m] != c->seq)
            at += (size_t)snprintf(late + at, sizeof(late) - at, "%s%u", at ? ", " : "", m);
    c->rep_seq[0] = 0; /* taken: the save is over */
    reports_free(c, job->nodes);
    sd_ckpt_remove(c->dir, c->tmp);
    c->status = SD_ETIMEDOUT;
    snprintf(c->err, sizeof(c->err),
             "node 0: node %s did not report its part of step %llu within %.1f s (op_timeout_ms, "
             "and the job's %.1f MiB of states at 16 MiB/s)",
             late, (unsigned long long)c->step, (double)limit / 1e9, (double)bytes / 1048576.0);
    commit_after(job);
}

static void remove_leftovers(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    char prefix[96];
    snprintf(prefix, sizeof(prefix), ".tmp-%s-", job->name);
    DIR *d = opendir(c->dir);
    if (d == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, prefix, strlen(prefix)) != 0 || strcmp(de->d_name, c->tmp) == 0)
            continue;
        int st = sd_ckpt_remove(c->dir, de->d_name);
        SD_WARN("job",
                "job '%s': removed the partial checkpoint %s/%s an interrupted save left%s%s",
                job->name, c->dir, de->d_name, st == SD_OK ? "" : ": ",
                st == SD_OK ? "" : sd_status_str(st));
    }
    closedir(d);
}

static void commit_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    char tmp[SD_CKPT_PATH_MAX + 160];
    snprintf(tmp, sizeof(tmp), "%s/%s", c->dir, c->tmp);
    c->status = sd_ckpt_write_manifest(tmp, &c->man, c->err, sizeof(c->err));
    if (c->status == SD_OK)
        c->status = sd_ckpt_commit(c->dir, c->tmp, c->final, c->err, sizeof(c->err));
    if (c->status != SD_OK)
        sd_ckpt_remove(c->dir, c->tmp);
    remove_leftovers(job);
}

static void commit_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    sd_ckpt_close(&c->man);
    if (c->recovery) { /* answered first: a save starting next reuses err */
        sd_recover_done(job, c->status, c->err);
        recovery_end(job);
        return;
    }
    if (job->state != SD_JOB_READY)
        return;
    char msg[1200];
    snprintf(msg, sizeof(msg), "save: %s", c->err);
    if (c->status == SD_OK) {
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
        sd_cluster_job_save_done(job->xfer.net->cl, job->name, job->nodes, c->seq, c->status,
                                 c->status == SD_OK ? "" : msg);
    c->first_ns = 0;
    save_answer(job, c->status, msg);
}

/* the manifest of save seq from every node's extents (node m's in data-m.bin) */
static int build_manifest(struct sd_job *job, const Shard__JobSaved *const *reps)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    struct sd_ckpt *man = &c->man;
    memset(man, 0, sizeof(*man));
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
    uint32_t *file_of = c->rep_file; /* the nodes that wrote, in order: data-<node>.bin */
    man->n_files = 0;
    for (uint32_t m = 0; m < job->nodes; m++)
        if (m == 0 || c->reporting[m])
            file_of[m] = man->n_files++;
    man->n_extents = c->n_items;
    for (uint32_t m = 1; m < job->nodes; m++)
        man->n_extents += c->reporting[m] ? reps[m]->n_extents : 0;
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
        if (m == 0 || c->reporting[m])
            snprintf(man->files[file_of[m]], sizeof(man->files[0]), "data-%u.bin", m);
    uint64_t n = 0;
    for (uint64_t i = 0; i < c->n_items; i++)
        man->extents[n++] = c->items[i];
    for (uint32_t m = 1; m < job->nodes; m++)
        for (size_t i = 0; c->reporting[m] && i < reps[m]->n_extents; i++) {
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

/* Why save seq cannot be committed (a node's failure, or nodes that disagree), or "" */
static int reports_check(struct sd_job *job, char *msg, size_t len)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c->status != SD_OK) {
        snprintf(msg, len, "node 0: %s", c->err);
        return c->status;
    }
    for (uint32_t m = 1; m < job->nodes; m++) {
        const Shard__JobSaved *r = c->reps[m];
        if (!c->reporting[m])
            continue;
        if (r->status != SD_OK) {
            snprintf(msg, len, "node %u: %s", m, r->message);
            return r->status;
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
    if (c->busy || c->seq == 0)
        return;
    for (uint32_t m = 0; m < job->nodes; m++)
        if ((m == 0 || c->reporting[m]) && c->rep_seq[m] != c->seq)
            return;
    c->rep_seq[0] = 0; /* taken */
    char msg[1200];
    int status = reports_check(job, msg, sizeof(msg));
    if (status == SD_OK &&
        (status = build_manifest(job, (const Shard__JobSaved *const *)c->reps)) != SD_OK)
        snprintf(msg, sizeof(msg), "node 0: building the manifest: %s", sd_status_str(status));
    reports_free(c, job->nodes);
    if (status != SD_OK) {
        sd_ckpt_close(&c->man);
        sd_ckpt_remove(c->dir, c->tmp);
        c->status = status;
        snprintf(c->err, sizeof(c->err), "%.1000s", msg);
        commit_after(job);
        return;
    }
    sd_ckpt__run_worker(job, commit_work, commit_after);
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
    if (c->reps[m->node] != NULL)
        shard__job_saved__free_unpacked(c->reps[m->node], NULL);
    c->reps[m->node] = shard__job_saved__unpack(NULL, len, buf);
    free(buf);
    if (c->reps[m->node] == NULL)
        return;
    c->rep_seq[m->node] = m->seq;
    save_collect(job);
}

void sd_ckpt_recover_abandon(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || !c->recovery || c->busy)
        return;
    sd_ckpt_remove(c->dir, c->tmp);
    reports_free(c, job->nodes);
    memset(c->rep_seq, 0, job->nodes * sizeof(*c->rep_seq));
    recovery_end(job);
}

void sd_ckpt_peer_done(struct sd_job *job, uint64_t seq, int status, const char *msg)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || seq != c->seq || job->state != SD_JOB_READY)
        return;
    if (status == SD_OK)
        c->saves++;
    c->first_ns = 0;
    save_answer(job, status, msg);
}

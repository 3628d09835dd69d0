/* Checkpoints of a job (DESIGN.md section 3b; the format is sd/ckpt.h's).
 *
 * Save (SD_OP_SAVE, every rank, at a step boundary): once the node's ranks are all in the call,
 * each node writes the optimizer shards it is the designated replica of into a data file in a
 * temporary directory of its own, on a file-pool thread, and reports the extents, their crcs
 * and the directory to node 0. Node 0 moves the nodes' files into its own, writes the MANIFEST,
 * renames the directory into place and replaces LATEST (ckpt_commit.c), then answers every
 * node. One replica per extent: rank R writes its os shard p when R / f_os == p % (world / f_os),
 * so the model states are written once, spread over the replication groups.
 *
 * Every file is touched with the rights of the job's owner (sd/fsid.h), below a directory fd,
 * one name at a time and never through a symlink (sd/safe_fs.h): a checkpoint can reach nothing
 * its owner could not reach, and a planted link, FIFO or device is refused.
 *
 * Load (ckpt_load.c): at registration a worker reads and checks the manifest; once the memory
 * is allocated each node reads, on workers, the ranges of each state its ranks' shards need. */
#include "optimizer.h"
#include "checkpoint_int.h"
#include "cluster/cluster.h"
#include "push.h"
#include "step.h"
#include "recover.h"
#include "session.h"
#include "sd/ckpt.h"
#include "sd/log.h"
#include "sd/safe_fs.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the job's file work */

static void task_fn(struct sd_file_task *t)
{
    struct sd_job *job = t->arg;
    job->load.ckpt->work.fn(job);
}

/* on the loop: the worker is done (or never ran: status) */
static void task_after(struct sd_file_task *t, int status)
{
    struct sd_job *job = t->arg;
    struct sd_ckpt_work *w = &job->load.ckpt->work;
    w->busy = false;
    if (atomic_load(&w->abandoned)) { /* its operation failed at the deadline, or went */
        atomic_store(&w->abandoned, false);
        SD_INFO("job", "job '%s': the file task given up (%s) ended after %.1f s", job->name,
                w->what, (double)(sd_now_ns() - t->queued_ns) / 1e9);
        return; /* a job dropped meanwhile is freed by the registry's sweep, now idle */
    }
    if (status != SD_OK && w->status == SD_OK) {
        w->status = status;
        if (status == SD_EPERM)
            snprintf(w->err, sizeof(w->err),
                     "shardd cannot take the identity of uid %u (the job's owner) for its "
                     "files: it lacks CAP_SETUID and CAP_SETGID",
                     (unsigned)t->id.uid);
        else
            snprintf(w->err, sizeof(w->err), "cancelled: the daemon stops");
    }
    w->after(job); /* may free the job: nothing after it */
}

void sd_ckpt__run_worker(struct sd_job *job, void (*fn)(struct sd_job *),
                         void (*after)(struct sd_job *), const char *what, uint64_t deadline_ns)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    struct sd_ckpt_work *w = &c->work;
    w->status = SD_OK;
    w->err[0] = '\0';
    w->fn = fn;
    w->after = after;
    w->what = what;
    w->deadline_ns = deadline_ns;
    w->busy = true;
    atomic_store(&w->abandoned, false);
    w->task = (struct sd_file_task){.id = c->id, .fn = task_fn, .after = task_after, .arg = job};
    if (sd_job_files(job) != NULL) {
        sd_file_pool_submit(sd_job_files(job), &w->task);
        return;
    }
    /* no pool (a registry without a loop): in place, with the owner's identity */
    struct sd_fsid saved;
    int st = sd_fsid_enter(&c->id, &saved);
    if (st == SD_OK) {
        fn(job);
        sd_fsid_leave(&saved);
    }
    task_after(&w->task, st);
}

/* the job's items on the file pool (an sd_ckpt_runner's run: ctx is the job) */
static void pool_run(void *ctx, uint32_t threads, uint64_t n, sd_ckpt_par_fn *fn, void *arg)
{
    struct sd_job *job = ctx;
    sd_file_pool_parallel(sd_job_files(job), threads, n, fn, arg);
}

void sd_ckpt__parallel(struct sd_job *job, uint64_t n, sd_ckpt_par_fn *fn, void *arg)
{
    pool_run(job, (uint32_t)job->reg->cfg->checkpoint_threads, n, fn, arg);
}

void sd_ckpt__after_queue(struct sd_job *job, void (*then)(struct sd_job *job, int status))
{
    struct sd_ckpt_job *c = job->load.ckpt;
    int st = sd_job_queue_mark(job, false, &c->q_ticket);
    if (st == SD_EAGAIN) {
        c->q_then = then; /* ckpt_queue_poll goes on */
        return;
    }
    then(job, st);
}

static bool ckpt_queue_waiting(const struct sd_job *job)
{
    return job->load.ckpt != NULL && job->load.ckpt->q_then != NULL;
}

static bool ckpt_queue_poll(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (!ckpt_queue_waiting(job))
        return false;
    int st = job->reg->dev->query(job->mem.queue, c->q_ticket);
    if (st == SD_EAGAIN)
        return false;
    void (*then)(struct sd_job *, int) = c->q_then;
    c->q_then = NULL;
    then(job, st); /* may end the job */
    return true;
}

bool sd_ckpt__working(const struct sd_job *job)
{
    const struct sd_ckpt_work *w = &job->load.ckpt->work;
    return w->busy && !atomic_load(&w->abandoned);
}

bool sd_ckpt__abandoned(const struct sd_job *job)
{
    return atomic_load(&job->load.ckpt->work.abandoned);
}

void sd_ckpt__fail(struct sd_job *job, int status, const char *fmt, ...)
{
    struct sd_ckpt_work *w = &job->load.ckpt->work;
    if (w->status != SD_OK)
        return; /* the first failure says why */
    w->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->err, sizeof(w->err), fmt, ap);
    va_end(ap);
}

uint64_t sd_ckpt__deadline(const struct sd_job *job, uint64_t bytes)
{
    return sd_now_ns() + (uint64_t)job->reg->cfg->op_timeout_ms * 1000000ULL +
           (uint64_t)((double)bytes / (16.0 * 1048576.0) * 1e9);
}

const char *sd_ckpt__hint(int st)
{
    switch (st) {
    case -EROFS:
        return "Read-only file system (under systemd's ProtectSystem=strict, add the directory "
               "to the unit's ReadWritePaths=)";
    case -EACCES:
        return "Permission denied (files are written with the rights of the job's owner)";
    case -ELOOP:
        return "a symbolic link (never followed inside a checkpoint directory)";
    case -EEXIST:
        return "File exists (and is not shardd's to replace)";
    default:
        return strerror(-st);
    }
}

#ifdef SD_TEST_HOOKS
void sd_ckpt__test_stall(const struct sd_job *job, const char *what)
{
    const char *v = getenv("SHARDD_TEST_FILE_STALL");
    char *end;
    if (v == NULL || strtol(v, &end, 10) != (long)job->node || *end != ':')
        return;
    long ms = strtol(end + 1, &end, 10);
    if (*end == ':' && strstr(end + 1, what) != NULL && ms > 0)
        usleep((useconds_t)ms * 1000);
}
#endif

bool sd_ckpt_busy(const struct sd_job *job)
{
    return job->load.ckpt != NULL && job->load.ckpt->work.busy;
}

bool sd_ckpt_reading(const struct sd_job *job)
{
    /* a write waiting for the device before its worker reads the shards holds them already */
    return job->load.ckpt != NULL && (sd_ckpt__working(job) || job->load.ckpt->q_then != NULL);
}

void sd_ckpt_drop(struct sd_job *job)
{
    if (sd_ckpt_busy(job))
        atomic_store(&job->load.ckpt->work.abandoned, true);
}

bool sd_ckpt_work_sweep(struct sd_job *job, uint64_t now)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || !sd_ckpt__working(job) || c->work.deadline_ns == 0 ||
        now < c->work.deadline_ns)
        return false;
    struct sd_ckpt_work *w = &c->work;
    atomic_store(&w->abandoned, true); /* busy stays: the worker still holds the memory */
    w->status = SD_ETIMEDOUT;
    snprintf(w->err, sizeof(w->err),
             "node %u: %s did not finish within %.1f s (op_timeout_ms and the data at 16 MiB/s); "
             "the filesystem does not answer",
             job->node, w->what, (double)(now - w->task.queued_ns) / 1e9);
    SD_WARN("job", "job '%s': %s", job->name, w->err);
    w->after(job); /* may free the job */
    return true;
}

/* ---- lifecycle */

static uint64_t manifest_bound(const struct sd_job *job)
{
    /* a checkpoint of this model, saved under any plan of up to 4096 optimizer shards: its
     * extents are the tensors', split at 4 MiB and at shard boundaries */
    uint64_t t = job->model.n_tensors, u = job->layout.n_units, numel = 0;
    for (uint32_t i = 0; i < job->layout.n_tensors; i++)
        numel += job->layout.tensors[i].numel;
    uint64_t extents = SD_CKPT_MAX_STATES * (t + numel / SD_CKPT_EXTENT_ELEMS + 1 + u * 4096);
    return SD_MIN((1ull << 20) + t * 1024 + extents * 320, SD_CKPT_MANIFEST_MAX);
}

int sd_ckpt_job_init(struct sd_job *job, const struct sd_fsid *owner, const char *load_dir,
                     char *err, size_t errlen)
{
    struct sd_ckpt_job *c = calloc(1, sizeof(*c));
    job->load.ckpt = c;
    if (c == NULL || sd_barrier_init(&c->bar, job->k) != SD_OK ||
        (c->writer = calloc(job->k, sizeof(bool))) == NULL ||
        (c->snap_steps = calloc(job->model.n_tensors + 1, sizeof(uint64_t))) == NULL ||
        (c->snap_hp = calloc(sd_model_groups(&job->model) + 1, sizeof(*c->snap_hp))) == NULL ||
        sd_ckpt__commit_init(job) != SD_OK) {
        snprintf(err, errlen, "out of memory");
        return SD_ENOMEM;
    }
    c->id = *owner;
    c->ld.src.dir_fd = c->cm.man.dir_fd = -1;
    if (load_dir == NULL || load_dir[0] == '\0')
        return SD_OK;
    if (load_dir[0] != '/' || strlen(load_dir) >= SD_CKPT_PATH_MAX - 320) {
        snprintf(err, errlen, "load: '%.200s' is not an absolute path of at most %d bytes",
                 load_dir, SD_CKPT_PATH_MAX - 321);
        return SD_EINVAL;
    }
    if (!sd_fsid_can_act_as(owner->uid)) {
        snprintf(err, errlen, "load: %s", sd_ckpt_identity_error(job, owner->uid));
        return SD_EPERM;
    }
    snprintf(c->ld.dir, sizeof(c->ld.dir), "%s", load_dir);
    c->ld.load = true;
    c->ld.max_manifest = manifest_bound(job);
    return SD_OK;
}

const char *sd_ckpt_identity_error(const struct sd_job *job, uid_t uid)
{
    static _Thread_local char text[400];
    (void)job;
    snprintf(text, sizeof(text),
             "shardd runs as uid %u without CAP_SETUID and CAP_SETGID, so it cannot read or "
             "write files with the rights of uid %u, the job's owner: run shardd as root or "
             "give it those two capabilities (the systemd unit's AmbientCapabilities), or run "
             "the job as uid %u",
             (unsigned)geteuid(), (unsigned)uid, (unsigned)geteuid());
    return text;
}

const char *sd_ckpt_load_dir(const struct sd_job *job)
{
    return job->load.ckpt != NULL ? job->load.ckpt->ld.dir : "";
}

bool sd_ckpt_loading(const struct sd_job *job)
{
    return job->load.ckpt != NULL && job->load.ckpt->ld.load;
}

uint64_t sd_ckpt_start_step(const struct sd_job *job)
{
    return sd_ckpt_loading(job) ? job->load.ckpt->ld.src.step : 0;
}

struct sd_hparams sd_ckpt_hparams(const struct sd_job *job, uint32_t g)
{
    if (sd_ckpt_loading(job) && g < job->load.ckpt->ld.src.n_groups)
        return job->load.ckpt->ld.src.groups[g];
    return sd_model_group(&job->model, g);
}

void sd_ckpt_job_free(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL)
        return;
    sd_ckpt_close(&c->ld.src);
    free(c->ld.buf);
    sd_ckpt__commit_free(job);
    sd_barrier_fini(&c->bar);
    free(c->writer);
    free(c->snap_steps);
    free(c->snap_hp);
    free(c->items);
    free(c->item_src);
    free(c->stage);
    free(c);
    job->load.ckpt = NULL;
}

json_t *sd_ckpt_json(const struct sd_job *job)
{
    const struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL)
        return json_null();
    json_t *o = json_pack("{s:s, s:I, s:f, s:I, s:I, s:f, s:I, s:b, s:b}", "loaded_from",
                          c->ld.load ? c->ld.src.path : "", "loaded_bytes",
                          (json_int_t)atomic_load(&c->ld.bytes), "load_ms", (double)c->ld.ns / 1e6,
                          "saves", (json_int_t)c->saves, "saved_bytes", (json_int_t)c->bytes_saved,
                          "last_save_ms", (double)c->save_ns / 1e6, "save_seq", (json_int_t)c->seq,
                          "busy", c->work.busy, "save_direct", atomic_load(&c->direct));
    if (c->work.busy)
        json_object_set_new(o, "working",
                            json_pack("{s:s, s:b, s:f}", "what", c->work.what, "given_up",
                                      atomic_load(&c->work.abandoned), "for_ms",
                                      (double)(sd_now_ns() - c->work.task.queued_ns) / 1e6));
    return o;
}

/* ---- saving */

void sd_ckpt__save_answer(struct sd_job *job, int status, const char *msg)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    struct sd_req q;
    for (uint32_t r = 0; r < job->k; r++) {
        if (!sd_barrier_take(&c->bar, r, &q) || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_SAVE]++;
        if (status == SD_OK)
            sd_latency_add(&job->stats.lat[SD_OP_SAVE], sd_now_ns() - c->first_ns);
        sd_session_complete(job->ranks[r], q.tag, SD_OP_SAVE, status, c->step, c->seq,
                            status == SD_OK ? NULL : msg);
    }
    c->saving = false;
}

void sd_ckpt_fail_parked(struct sd_job *job, int status, const char *msg)
{
    if (job->load.ckpt != NULL)
        sd_ckpt__save_answer(job, status, msg);
}

bool sd_ckpt_is_writer(const struct sd_job *job, uint32_t rank)
{
    uint32_t f = job->plan.f[SD_STATE_OS];
    return rank / f == sd_plan_shard(&job->plan, SD_STATE_OS, rank) % (job->world / f);
}

void sd_ckpt__tmp_prefix(const struct sd_job *job, char *buf, size_t len)
{
    snprintf(buf, len, ".tmp-%s-", job->name);
}

/* The walk over this node's extents: counted (items NULL), then filled in the same order. */
struct plan_walk {
    struct sd_ckpt_job *c;
    const float *os; /* the writer rank's os arena */
    uint64_t os_stride, n, file_off;
    uint32_t n_states, node;
    bool fill;
};

/* tensor tl's part of os shard [b, e) of unit ul: an extent per SD_CKPT_EXTENT_ELEMS elements
 * and state, in file order */
static void plan_tensor(struct plan_walk *w, const struct sd_unit_layout *ul, uint32_t t,
                        const struct sd_tensor_layout *tl, uint64_t b, uint64_t e)
{
    uint64_t lo = SD_MAX(b, tl->offset), hi = SD_MIN(e, tl->offset + tl->numel);
    for (uint64_t a = lo; a < hi; a += SD_CKPT_EXTENT_ELEMS) {
        uint64_t z = SD_MIN(hi, a + SD_CKPT_EXTENT_ELEMS);
        for (uint32_t s = 0; s < w->n_states; s++, w->n++) {
            if (w->fill) {
                w->c->item_src[w->n] =
                    w->os + s * w->os_stride + ul->arena_off[SD_STATE_OS] + (a - b);
                w->c->items[w->n] = (struct sd_ckpt_extent){.state = s,
                                                            .tensor = t,
                                                            .file = w->node,
                                                            .begin = a - tl->offset,
                                                            .end = z - tl->offset,
                                                            .file_off = w->file_off};
            }
            w->file_off += (z - a) * sizeof(float);
        }
    }
}

/* this node's extents, their sources and their place in its data file */
static int save_plan(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const struct sd_layout *l = &job->layout;
    struct plan_walk w = {.c = c,
                          .os_stride = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]),
                          .n_states = sd_ckpt_states(job->model.optim.kind),
                          .node = job->node};
    for (int pass = 0; pass < 2; pass++) {
        w.n = w.file_off = 0;
        w.fill = pass == 1;
        for (uint32_t r = 0; r < job->k; r++) {
            if (!c->writer[r])
                continue;
            w.os = sd_job_state(job, r, SD_STATE_OS);
            for (uint32_t u = 0; u < l->n_units; u++) {
                const struct sd_unit_layout *ul = &l->units[u];
                uint64_t b, e;
                sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
                for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors; t++)
                    plan_tensor(&w, ul, t, &l->tensors[t], b, e);
            }
        }
        if (pass == 0) {
            free(c->items);
            free(c->item_src);
            c->items = calloc(w.n + 1, sizeof(*c->items));
            c->item_src = calloc(w.n + 1, sizeof(*c->item_src));
            if (c->items == NULL || c->item_src == NULL)
                return SD_ENOMEM;
        }
    }
    c->n_items = w.n;
    return SD_OK;
}

/* Memory of a device backend is written from host memory: every extent is copied into one
 * staging buffer by the backend, in file order, and written from there once the loop's poll
 * saw the device past the copies (part_queued). */
static int save_stage(struct sd_job *job, uint64_t bytes)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    free(c->stage);
    c->stage = malloc(bytes + sizeof(float));
    if (c->stage == NULL)
        return SD_ENOMEM;
    float *at = c->stage;
    for (uint64_t i = 0; i < c->n_items; i++) {
        uint64_t len = c->items[i].end - c->items[i].begin;
        job->reg->dev->copy(job->mem.queue, at, c->item_src[i], len * sizeof(float));
        c->item_src[i] = at;
        at += len;
    }
    return SD_OK;
}

/* On a worker, as the job's owner: this node's part into data-<node>.bin of a new temporary
 * directory of its own in c->dir (made when missing). */
static void save_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    sd_ckpt__test_stall(job, c->recovery ? "recover" : "save");
    char prefix[96], file[64];
    sd_ckpt__tmp_prefix(job, prefix, sizeof(prefix));
    snprintf(file, sizeof(file), "data-%u.bin", job->node);
    c->tmp[0] = '\0';
    int dfd = sd_fs_dir_open(c->dir, true, 0750);
    if (dfd < 0) {
        sd_ckpt__fail(job, dfd, "opening the checkpoint directory %.900s: %s", c->dir,
                      sd_ckpt__hint(dfd));
        return;
    }
    int tfd = sd_fs_mkdtemp(dfd, prefix, 0750, c->tmp, sizeof(c->tmp));
    if (tfd < 0) {
        c->tmp[0] = '\0';
        sd_ckpt__fail(job, tfd, "creating a temporary directory in %.900s: %s", c->dir,
                      sd_ckpt__hint(tfd));
        close(dfd);
        return;
    }
    int fd = sd_fs_openat(tfd, file, O_WRONLY | O_CREAT | O_EXCL, 0640);
    int st = fd < 0 ? fd : SD_OK;
    struct sd_ckpt_runner runner = {.run = pool_run, .ctx = job};
    struct sd_ckpt_io io = {.threads = (uint32_t)job->reg->cfg->checkpoint_threads,
                            .direct = job->reg->cfg->checkpoint_direct != 0,
                            .runner = &runner};
    bool direct = false;
    if (st == SD_OK)
        st = sd_ckpt_write_extents(fd, c->items, c->item_src, c->n_items, &io, &direct);
    atomic_store(&c->direct, direct);
    if (st == SD_OK && fsync(fd) != 0)
        st = -errno;
    if (fd >= 0)
        close(fd);
    if (st == SD_OK)
        st = sd_fs_fsync(tfd, NULL);
    close(tfd);
    if (st != SD_OK)
        sd_ckpt__fail(job, st, "writing %.900s/%s/%s: %s", c->dir, c->tmp, file, sd_ckpt__hint(st));
    if (st != SD_OK || sd_ckpt__abandoned(job)) { /* nobody commits it: it goes */
        sd_fs_remove(dfd, c->tmp);
        c->tmp[0] = '\0';
    }
    close(dfd);
}

static void save_parked(struct sd_job *job);

void sd_ckpt__recovery_end(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->recovery = false;
    c->seq = c->save_seq;
    save_parked(job);
}

static void save_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    free(c->stage);
    c->stage = NULL;
    if (!c->recovery && job->state != SD_JOB_READY) { /* the save is given up */
        if (c->work.status == SD_OK)
            sd_ckpt__discard(job, c->dir, (const char *const[]){c->tmp}, 1);
        return;
    }
    if (job->node == 0) {
        sd_ckpt__own_part(job);
        sd_job_event(job, SD_JOB_EV_OS_FREE);
        return;
    }
    Shard__CkptExtent *xs = calloc(c->n_items + 1, sizeof(*xs));
    Shard__CkptExtent **xp = calloc(c->n_items + 1, sizeof(*xp));
    Shard__JobSaved m = SHARD__JOB_SAVED__INIT;
    m.job = job->name;
    m.node = job->node;
    m.seq = c->seq;
    m.step = c->step;
    m.status = xs == NULL || xp == NULL ? SD_ENOMEM : c->work.status;
    m.message = c->work.err;
    m.dir = c->dir;
    m.tmp = m.status == SD_OK ? c->tmp : "";
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
    sd_cluster_job_saved(sd_job_cluster(job), job->xfer.node_ids[0], &m);
    free(xs);
    free(xp);
    if (c->recovery) /* this node's part of it is done */
        sd_ckpt__recovery_end(job);
    /* a step waited for the worker to leave the os shards (a recovery's too: a running job's
     * checkpoint, whose step went on meanwhile), unless a parked save took them again */
    sd_job_event(job, SD_JOB_EV_OS_FREE);
}

/* the bytes of this node's part: its extents' */
static uint64_t part_bytes(const struct sd_ckpt_job *c)
{
    uint64_t bytes = 0;
    for (uint64_t i = 0; i < c->n_items; i++)
        bytes += (c->items[i].end - c->items[i].begin) * sizeof(float);
    return bytes;
}

/* The device is past what the write reads (the staged copies, or the kernels still writing
 * the os shards a worker reads in place): the worker writes the part. A save whose job failed
 * meanwhile is given up (its ranks were answered); a backend's failure is the write's. */
static void part_queued(struct sd_job *job, int status)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (status == SD_OK && !c->recovery && job->state != SD_JOB_READY) {
        free(c->stage);
        c->stage = NULL;
        return;
    }
    if (status != SD_OK) {
        c->work.status = status;
        snprintf(c->work.err, sizeof(c->work.err), "node %u: the %s backend failed: %s", job->node,
                 job->reg->dev->name, sd_status_str(status));
        c->tmp[0] = '\0';
        sd_job_backend_failed(job, status);
        save_after(job); /* a recovery's part reports the failure */
        return;
    }
    sd_ckpt__run_worker(job, save_work, save_after, "writing its part of the checkpoint",
                        sd_ckpt__deadline(job, part_bytes(c)));
}

/* This node's part of save c->seq (c->dir and c->writer set): the step the os shards hold and
 * what the manifest says of it, then the extents written on a worker once the device is past
 * what they read (the loop never waits for it). */
static int write_part(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->step = sd_optim_applied(job);
    sd_ckpt_step_name(c->final, sizeof(c->final), c->step);
    memcpy(c->snap_steps, sd_optim_tensor_steps(job), job->model.n_tensors * sizeof(uint64_t));
    memcpy(c->snap_hp, sd_optim_hparams(job), sd_model_groups(&job->model) * sizeof(*c->snap_hp));
    int st = save_plan(job);
    if (st != SD_OK)
        return st;
    if (!job->reg->dev->host_memory && (st = save_stage(job, part_bytes(c))) != SD_OK)
        return st;
    sd_ckpt__after_queue(job, part_queued);
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
    for (uint32_t r = 0; r < job->k; r++)
        c->writer[r] = sd_ckpt_is_writer(job, job->first_rank + r);
    for (uint32_t m = 0; m < job->nodes; m++)
        c->cm.reporting[m] = true;
    int st = write_part(job);
    if (st == SD_ENOMEM)
        sd_ckpt__save_answer(job, st, "save: out of memory");
}

bool sd_ckpt_idle(const struct sd_job *job)
{
    const struct sd_ckpt_job *c = job->load.ckpt;
    return c != NULL && !c->work.busy && c->q_then == NULL && !c->recovery && c->bar.arrived == 0;
}

int sd_ckpt_recover_write(struct sd_job *job, const struct sd_ckpt_recover *r, char *err,
                          size_t errlen)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (!sd_ckpt_idle(job)) {
        snprintf(err, errlen, "node %u: job '%s' is saving a checkpoint", job->node, job->name);
        return SD_EBUSY;
    }
    if (!sd_fsid_can_act_as(c->id.uid)) {
        snprintf(err, errlen, "node %u: %s", job->node, sd_ckpt_identity_error(job, c->id.uid));
        return SD_EPERM;
    }
    snprintf(c->dir, sizeof(c->dir), "%s", r->dir);
    memset(c->writer, 0, job->k * sizeof(bool));
    for (size_t i = 0; i < r->n_writers; i++)
        if (r->writers[i] >= job->first_rank && r->writers[i] < job->first_rank + job->k)
            c->writer[r->writers[i] - job->first_rank] = true;
    for (uint32_t m = 0; m < job->nodes; m++)
        c->cm.reporting[m] = r->reporting != NULL && r->reporting[m];
    c->save_seq = c->seq;
    c->seq = r->seq;
    c->recovery = true;
    int st = write_part(job);
    if (st != SD_OK) {
        sd_ckpt__recovery_end(job);
        snprintf(err, errlen, "node %u: %s", job->node, sd_status_str(st));
    }
    return st;
}

void sd_ckpt_save(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    char path[SD_CKPT_PATH_MAX];
    uint64_t len = e->arg0;
    const char *area = (const char *)sd_job_control(job, s->local, job->mem.save_path_off);
    if (len == 0 || len >= SD_CKPT_PATH_MAX - 320 || memchr(area, '\0', len) != NULL) {
        sd_session_fail(s, e, SD_EINVAL,
                        "save: the directory's length %llu is not in 1..%d or it holds a NUL",
                        (unsigned long long)len, SD_CKPT_PATH_MAX - 321);
        return;
    }
    memcpy(path, area, len);
    path[len] = '\0';
    if (path[0] != '/') {
        sd_session_fail(s, e, SD_EINVAL, "save: '%s' is not an absolute path", path);
        return;
    }
    if (!sd_fsid_can_act_as(c->id.uid)) {
        sd_session_fail(s, e, SD_EPERM, "save: %s", sd_ckpt_identity_error(job, c->id.uid));
        return;
    }
    if (sd_barrier_waits(&c->bar, s->local) || (c->work.busy && !c->recovery)) {
        sd_session_fail(s, e, SD_EBUSY, "save: rank %u's previous save is still running%s", s->rank,
                        atomic_load(&c->work.abandoned)
                            ? " (it was given up at its deadline; its worker is stuck in the "
                              "filesystem)"
                            : "");
        return;
    }
    if (sd_step_arrived(job) > 0 || sd_step_running(job)) {
        sd_session_fail(s, e, SD_ESTATE,
                        "save: %s step %llu; every rank saves between the same two steps",
                        sd_step_running(job) ? "this node is in (a trainer optimizer's hand-off: "
                                               "save after shard_step_update_done)"
                                             : "other ranks of this node are in",
                        (unsigned long long)job->steps + 1);
        return;
    }
    if (c->bar.arrived == 0) {
        snprintf(c->save_dir, sizeof(c->save_dir), "%s", path);
        c->first_ns = sd_now_ns();
    } else if (strcmp(c->save_dir, path) != 0) {
        sd_session_fail(s, e, SD_EMISMATCH,
                        "save: rank %u saves to '%s', the other ranks of this node to '%s'",
                        s->rank, path, c->save_dir);
        return;
    }
    sd_barrier_arrive(&c->bar, s->local, e->tag, sd_now_ns());
    save_parked(job);
}

/* every local rank is in the save and no recovery writes: start it (the end of a recovery's
 * part calls again) */
static void save_parked(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (sd_barrier_full(&c->bar) && !c->saving && !c->recovery && !c->work.busy &&
        job->state == SD_JOB_READY)
        save_start(job);
}

/* a save barrier that waits too long (sd_job_sweep): the ranks it waits for */
bool sd_ckpt_overdue(struct sd_job *job, uint64_t now, uint64_t timeout, bool *present)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    return c != NULL && sd_barrier_overdue(&c->bar, now, timeout, present);
}

void sd_ckpt_peer_done(struct sd_job *job, uint64_t seq, int status, const char *msg)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c == NULL || seq != c->seq || job->state != SD_JOB_READY)
        return;
    if (status == SD_OK)
        c->saves++;
    sd_ckpt__save_answer(job, status, msg); /* (its latency from first_ns) */
    c->first_ns = 0;
}

/* ---- the job's common paths (job_module.h) */

static void ckpt_fail_parked(struct sd_job *job, int status, const char *text, bool with_fetches)
{
    (void)with_fetches;
    sd_ckpt_fail_parked(job, status, text);
}

/* the nodes' reports of a save (node 0), then a save barrier that waits too long */
static bool ckpt_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    bool present[1024];
    char missing[128];
    sd_ckpt_sweep(job, now, op_timeout);
    if (job->state == SD_JOB_FAILED)
        return true;
    if (!sd_ckpt_overdue(job, now, op_timeout, present))
        return false;
    sd_job_missing_ranks(job, present, missing, sizeof(missing));
    sd_job_fail(job, SD_ETIMEDOUT,
                "save after step %llu: ranks %s did not call save within %lld ms "
                "(op_timeout_ms)",
                (unsigned long long)job->steps, missing, (long long)job->reg->cfg->op_timeout_ms);
    return true;
}

static const char *ckpt_gives_values(const struct sd_job *job)
{
    return sd_ckpt_loading(job) ? "loading a checkpoint" : NULL;
}

static const char *ckpt_needs_state(const struct sd_job *job)
{
    return sd_recover_target(job) ? "a checkpoint of it is being written from the replicas" : NULL;
}

const struct sd_job_module sd_ckpt_module = {.name = "checkpoint",
                                             .needs_state = ckpt_needs_state,
                                             .gives_values = ckpt_gives_values,
                                             .fail_parked = ckpt_fail_parked,
                                             .sweep = ckpt_sweep,
                                             .shards_busy = sd_ckpt_reading,
                                             .queue_waiting = ckpt_queue_waiting,
                                             .queue_poll = ckpt_queue_poll};

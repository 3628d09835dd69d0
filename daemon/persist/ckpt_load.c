/* Loading a checkpoint into a job of any world and plan (checkpoint.h): each node reads, on
 * worker threads, the ranges of each state its ranks' shards need, sets the fp32 masters and
 * moments and derives the weights in their dtype from the masters.
 *
 * Shard buffers in host memory are filled by the threads themselves (checkpoint_threads of
 * them, reading with O_DIRECT where the filesystem has it): one task per unit, local rank and
 * state, then one per unit and local rank for its weights. Device memory is staged in ld.buf
 * and copied through the device's queue on the loop. */
#include "optimizer.h"
#include "checkpoint_int.h"
#include "loading.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* state s of unit u's elements [lo, hi) (unit coordinates) */
struct unit_range {
    uint32_t s, u;
    uint64_t lo, hi;
};

/* the range into dst, tensor by tensor; padding stays as it is (zero) */
static int read_unit_range(struct sd_job *job, struct sd_ckpt_reader *rd,
                           const struct unit_range *r, float *dst, char *err, size_t errlen)
{
    uint32_t s = r->s;
    uint64_t lo = r->lo, hi = r->hi;
    const struct sd_unit_layout *ul = &job->layout.units[r->u];
    for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors; t++) {
        const struct sd_tensor_layout *tl = &job->layout.tensors[t];
        uint64_t a = SD_MAX(lo, tl->offset), z = SD_MIN(hi, tl->offset + tl->numel);
        if (a >= z)
            continue;
        int st =
            sd_ckpt_read(rd, s, t, a - tl->offset, z - tl->offset, dst + (a - lo), err, errlen);
        if (st != SD_OK)
            return st;
    }
    return SD_OK;
}

/* ---- host memory: the threads fill the shard buffers */

struct par_load {
    struct sd_job *job;
    struct sd_ckpt_reader *rd; /* [threads] */
    uint32_t n_states;
    atomic_int status; /* the first error's; its message in work.err */
};

static void par_fail(struct par_load *p, int st, const char *msg)
{
    int ok = SD_OK;
    if (atomic_compare_exchange_strong(&p->status, &ok, st))
        sd_ckpt__fail(p->job, st, "%s", msg);
}

static void weights(struct par_load *p, uint32_t thread, uint32_t u, uint32_t r);

/* whether local rank r's w shard of ul lies in its own os shard (as under zero3 and mics): its
 * weights follow from its masters alone */
static bool w_in_os(const struct sd_job *job, const struct sd_unit_layout *ul, uint32_t r)
{
    uint64_t b, e, wb, we;
    sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
    sd_layout_shard(ul, &job->plan, SD_STATE_W, job->first_rank + r, &wb, &we);
    return wb == we || (b <= wb && we <= e);
}

/* task i: state i % n_states of unit i / (k n_states), over local rank (i / n_states) % k's os
 * shard, straight into its arena; the rank's weights too when its masters are all they need */
static void load_state(void *arg, uint32_t thread, uint64_t i)
{
    struct par_load *p = arg;
    struct sd_job *job = p->job;
    if (atomic_load(&p->status) != SD_OK)
        return;
    uint32_t s = (uint32_t)(i % p->n_states), r = (uint32_t)(i / p->n_states % job->k),
             u = (uint32_t)(i / p->n_states / job->k);
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t b, e;
    sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
    char err[1024];
    int st =
        read_unit_range(job, &p->rd[thread], &(struct unit_range){.s = s, .u = u, .lo = b, .hi = e},
                        sd_job_os_state(job, r, s, ul), err, sizeof(err));
    if (st != SD_OK)
        par_fail(p, st, err);
    else if (s == 0 && w_in_os(job, ul, r))
        weights(p, thread, u, r);
}

/* local rank r's weights of unit u in their dtype, from the masters: those of the node's os
 * shards, read again where its w shard reaches past them */
static void weights(struct par_load *p, uint32_t thread, uint32_t u, uint32_t r)
{
    struct sd_job *job = p->job;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    size_t dsize = sd_dtype_size(ul->dtype);
    uint8_t *w = sd_job_w_shard(job, r, u);
    float *scratch = NULL; /* masters past the node's os shards */
    uint64_t wb, we;
    sd_layout_shard(ul, &job->plan, SD_STATE_W, job->first_rank + r, &wb, &we);
    for (uint64_t at = wb; at < we;) {
        const float *src = NULL;
        uint64_t z = we;
        for (uint32_t q = 0; q < job->k && src == NULL; q++) {
            uint64_t b, e;
            sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + q, &b, &e);
            if (b <= at && at < e) {
                src = sd_job_os_state(job, q, 0, ul) + (at - b);
                z = SD_MIN(we, e);
            } else if (b > at) {
                z = SD_MIN(z, b); /* read up to the next os shard */
            }
        }
        if (src == NULL) {
            char err[1024] = "out of memory";
            z = SD_MIN(z, at + SD_CKPT_EXTENT_ELEMS);
            if (scratch == NULL)
                scratch = malloc((size_t)SD_CKPT_EXTENT_ELEMS * sizeof(float));
            int st = scratch == NULL
                         ? SD_ENOMEM
                         : read_unit_range(job, &p->rd[thread],
                                           &(struct unit_range){.u = u, .lo = at, .hi = z}, scratch,
                                           err, sizeof(err));
            if (st != SD_OK) {
                par_fail(p, st, err);
                break;
            }
            src = scratch;
        }
        /* the backend keeps its memory on the host (load_host): the conversion runs here, the
         * host backend's (a backend's own kernels run on its queue, which is the loop's) */
        sd_gpu_host_ops.from_f32(NULL, w + (at - wb) * dsize, ul->dtype, src, z - at);
        at = z;
    }
    free(scratch);
}

/* task i: local rank i % k's weights of unit i / k, unless load_state did them */
static void load_weights(void *arg, uint32_t thread, uint64_t i)
{
    struct par_load *p = arg;
    uint32_t r = (uint32_t)(i % p->job->k), u = (uint32_t)(i / p->job->k);
    if (atomic_load(&p->status) == SD_OK && !w_in_os(p->job, &p->job->layout.units[u], r))
        weights(p, thread, u, r);
}

static void load_host(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    uint32_t threads = (uint32_t)job->reg->cfg->checkpoint_threads;
    struct par_load p = {.job = job, .n_states = c->ld.src.n_states};
    atomic_init(&p.status, SD_OK);
    p.rd = calloc(threads, sizeof(*p.rd));
    uint32_t ready = 0;
    for (; p.rd != NULL && ready < threads; ready++) {
        char err[512];
        int st = sd_ckpt_reader_init(&p.rd[ready], &c->ld.src, err, sizeof(err));
        if (st != SD_OK) {
            par_fail(&p, st, err);
            break;
        }
        p.rd[ready].direct = job->reg->cfg->checkpoint_direct != 0;
    }
    if (p.rd == NULL)
        par_fail(&p, SD_ENOMEM, "out of memory");
    uint64_t units = job->layout.n_units;
    if (atomic_load(&p.status) == SD_OK)
        sd_ckpt__parallel(job, units * job->k * p.n_states, load_state, &p);
    if (atomic_load(&p.status) == SD_OK) /* every master is in place */
        sd_ckpt__parallel(job, units * job->k, load_weights, &p);
    for (uint32_t t = 0; t < ready; t++) {
        atomic_fetch_add(&c->ld.bytes, p.rd[t].bytes_read);
        sd_ckpt_reader_free(&p.rd[t]);
    }
    free(p.rd);
}

/* ---- device memory: staged in ld.buf */

/* Unit u's part of ld.buf: the masters over the node's range of it (sd_loading_range: every
 * local rank's w shard, read once for them all), then each local rank's moments over its os
 * shard. Returns its floats; with at, the read (load_work) or the copies into the arenas. */
static uint64_t unit_block(struct sd_job *job, uint32_t u, float *at, struct sd_ckpt_reader *rd)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint64_t lo, hi;
    sd_loading_range(job, job->node, ul, &lo, &hi);
    uint64_t n = hi - lo;
    if (at != NULL && rd != NULL)
        c->work.status = read_unit_range(job, rd, &(struct unit_range){.u = u, .lo = lo, .hi = hi},
                                         at, c->work.err, sizeof(c->work.err));
    else if (at != NULL)
        sd_loading_unit(job, u, at, lo, true);
    for (uint32_t r = 0; r < job->k; r++) {
        uint64_t b, e;
        sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
        for (uint32_t s = 1; s < c->ld.src.n_states; s++, n += e - b) {
            if (at == NULL || c->work.status != SD_OK)
                continue;
            if (rd != NULL)
                c->work.status =
                    read_unit_range(job, rd, &(struct unit_range){.s = s, .u = u, .lo = b, .hi = e},
                                    at + n, c->work.err, sizeof(c->work.err));
            else
                dev->copy(job->mem.queue, sd_job_os_state(job, r, s, ul), at + n,
                          (e - b) * sizeof(float));
        }
    }
    return n;
}

static void load_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    sd_ckpt__test_stall(job, "load");
    if (job->reg->dev->host_memory) {
        load_host(job);
        return;
    }
    struct sd_ckpt_reader rd;
    if ((c->work.status = sd_ckpt_reader_init(&rd, &c->ld.src, c->work.err, sizeof(c->work.err))) !=
        SD_OK)
        return;
    float *at = c->ld.buf;
    for (uint32_t u = 0; u < job->layout.n_units && c->work.status == SD_OK; u++)
        at += unit_block(job, u, at, &rd);
    atomic_store(&c->ld.bytes, rd.bytes_read);
    sd_ckpt_reader_free(&rd);
}

/* the device is past the copies out of ld.buf (or, in host memory, there is nothing to wait
 * for): the job's state is the checkpoint's */
static void loaded(struct sd_job *job, int status)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    const struct sd_layout *l = &job->layout;
    if (status != SD_OK)
        sd_job_backend_failed(job, status);
    if (job->state != SD_JOB_LOADING)
        return; /* failed meanwhile: the parked calls were answered */
    free(c->ld.buf);
    c->ld.buf = NULL;
    for (uint32_t t = 0; t < l->n_tensors; t++)
        sd_optim_set_tensor_steps(job, t, c->ld.src.tensors[t].steps);
    sd_optim_restore(job, c->ld.src.groups, c->ld.src.n_groups, c->ld.src.step);
    job->steps = c->ld.src.step;
    c->ld.ns = sd_now_ns() - c->ld.start_ns;
    SD_INFO("job", "job '%s': loaded step %llu from %s (%.1f MiB read in %.1f ms)", job->name,
            (unsigned long long)c->ld.src.step, c->ld.src.path,
            (double)atomic_load(&c->ld.bytes) / 1048576.0, (double)c->ld.ns / 1e6);
    sd_loading_loaded(job);
}

static void load_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (job->state != SD_JOB_LOADING)
        return; /* failed meanwhile: the parked calls were answered */
    if (c->work.status != SD_OK) {
        sd_job_fail(job, c->work.status, "loading the checkpoint: %s", c->work.err);
        return;
    }
    const struct sd_layout *l = &job->layout;
    float *at = c->ld.buf;
    for (uint32_t u = 0; at != NULL && u < l->n_units; u++)
        at += unit_block(job, u, at, NULL);
    sd_ckpt__after_queue(job, loaded);
}

/* nothing queued touches the buffers the threads fill any more: read the checkpoint */
static void load_queued(struct sd_job *job, int status)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (status != SD_OK)
        sd_job_backend_failed(job, status);
    if (job->state != SD_JOB_LOADING)
        return; /* failed meanwhile: the parked calls were answered */
    sd_ckpt__run_worker(job, load_work, load_after, "reading its part of the checkpoint",
                        sd_ckpt__deadline(job, c->ld.src.bytes));
}

void sd_ckpt_load_start(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    c->ld.start_ns = sd_now_ns();
    if (!job->reg->dev->host_memory) {
        uint64_t floats = 0;
        for (uint32_t u = 0; u < job->layout.n_units; u++)
            floats += unit_block(job, u, NULL, NULL);
        c->ld.buf = calloc(floats + 1, sizeof(float));
        if (c->ld.buf == NULL) {
            sd_job_fail(job, SD_ENOMEM, "loading checkpoint %s: out of memory for %llu floats",
                        c->ld.src.path, (unsigned long long)floats);
            return;
        }
    }
    sd_ckpt__after_queue(job, load_queued);
}

/* ---- the manifest, read and checked at registration */

static void open_work(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    sd_ckpt__test_stall(job, "open");
    /* root's jobs read anyone's checkpoint; a user's only her own files */
    uid_t owner = c->id.uid == 0 ? SD_FS_ANY_OWNER : c->id.uid;
    char err[900];
    int st = sd_ckpt_open_owned(c->ld.dir, owner, c->ld.max_manifest, &c->ld.src, err, sizeof(err));
    if (st != SD_OK) {
        sd_ckpt__fail(job, st, "%s", err);
        return;
    }
    char diff[512];
    if ((st = sd_ckpt_check_model(&c->ld.src, &job->model, diff, sizeof(diff))) != SD_OK)
        sd_ckpt__fail(job, st, "checkpoint %s is of another model: %s", c->ld.src.path, diff);
}

static void open_after(struct sd_job *job)
{
    struct sd_ckpt_job *c = job->load.ckpt;
    if (c->work.status != SD_OK) {
        char msg[1100];
        snprintf(msg, sizeof(msg), "job '%s': %s", job->name, c->work.err);
        sd_job_event_text(job, SD_JOB_EV_OPENED, c->work.status, msg); /* may free the job */
        return;
    }
    c->ld.opened = true;
    sd_job_event_text(job, SD_JOB_EV_OPENED, SD_OK, NULL);
}

void sd_ckpt_open_start(struct sd_job *job)
{
    if (!sd_ckpt_loading(job))
        return;
    sd_ckpt__run_worker(job, open_work, open_after, "reading the checkpoint's manifest",
                        sd_ckpt__deadline(job, job->load.ckpt->ld.max_manifest / 8));
}

bool sd_ckpt_opened(const struct sd_job *job)
{
    return !sd_ckpt_loading(job) || job->load.ckpt->ld.opened;
}

/* A job's memory, all of it allocated at registration (DESIGN.md section 7): the w, g and os
 * arenas of every local rank in the backend's memory (cache-coloured, see SD_ARENA_COLOUR), the
 * gather pool and staging slots the trainers map, scratch and the network buffers, within the
 * daemon's memory budget. Host memory is backed and given back on a worker thread. */
#include "schedule.h"
#include "job_life.h"
#include "job_mem.h"
#include "checkpoint.h"
#include "step.h"
#include "push.h"
#include "net.h"
#include "quant.h"
#include "secondary.h"
#include "sd/ckpt.h"
#include "sd/fence.h"
#include "sd/log.h"
#include "resume.h"
#include "sd/status.h"
#include "sd/util.h"
#include "transport/transport.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>
#include <unistd.h>

/* the job's buffers across nodes (nodes > 1; at the end of this file): their bytes, and its
 * transport view, bulks, node rounds' buffers and fabric registrations set up and torn down */
static uint64_t net_bytes(const struct sd_job *job, const struct sd_config *cfg);
static int net_setup(struct sd_job *job, char *err, size_t errlen);
static void net_teardown(struct sd_job *job);

/* A job's big buffers go back on a worker thread: unmapping a job of 64 MiB units (about
 * 1 GiB) held the loop for 250 ms here, and with it every other job's transfers and the
 * heartbeats. Its bytes return to the budget once they are really gone. */
struct job_free_work {
    uv_work_t req;
    struct sd_registry *reg;
    /* host memory: arenas, staging, pool, scratch, node rounds (host backends), control pages */
    struct sd_mem *mems;
    uint32_t n_mems;
    uint64_t bytes, start_ns;
    char job[64];
};

static void free_work_cb(uv_work_t *req)
{
    struct job_free_work *w = req->data;
    for (uint32_t i = 0; i < w->n_mems; i++)
        sd_gpu_host_ops.free(&w->mems[i]);
}

static void free_after_cb(uv_work_t *req, int uv_status)
{
    struct job_free_work *w = req->data;
    (void)uv_status; /* work that is queued always runs: uv_cancel is never called on it */
    w->reg->used -= w->bytes;
    SD_DEBUG("job", "job '%s': %llu bytes returned in %.1f ms, off the loop", w->job,
             (unsigned long long)w->bytes, (double)(sd_now_ns() - w->start_ns) / 1e6);
    free(w->mems);
    free(w);
}

/* Hand the job's host buffers to a worker. Without a loop, or out of memory for the hand-over,
 * it takes nothing and sd_job_mem_free frees them in place. */
static void free_off_loop(struct sd_job *job)
{
    struct sd_registry *reg = job->reg;
    bool host = reg->dev->host_memory;
    uint32_t n_arena = job->mem.arena != NULL && host ? job->k * SD_STATE_COUNT : 0;
    uint32_t n_staging = job->mem.staging != NULL && host ? job->k : 0;
    uint32_t n_fence = job->mem.fence != NULL ? job->k : 0; /* host memory whatever the backend */
    uint32_t n_sec = sd_sec_hand_over(job, NULL);
    if (reg->loop == NULL || job->mem.bytes_total == 0)
        return;
    struct job_free_work *w = calloc(1, sizeof(*w));
    struct sd_mem *mems = calloc(n_arena + n_staging + n_fence + n_sec + 3, sizeof(*mems));
    if (w == NULL || mems == NULL) {
        free(w);
        free(mems);
        return;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < n_arena; i++) {
        mems[n++] = job->mem.arena[i];
        job->mem.arena[i] = (struct sd_mem){.fd = -1};
    }
    for (uint32_t i = 0; i < n_staging; i++) {
        mems[n++] = job->mem.staging[i];
        job->mem.staging[i] = (struct sd_mem){.fd = -1};
    }
    for (uint32_t i = 0; i < n_fence; i++) {
        mems[n++] = job->mem.fence[i];
        job->mem.fence[i] = (struct sd_mem){.fd = -1};
    }
    n += sd_sec_hand_over(job, mems + n);
    if (host) {
        mems[n++] = job->mem.pool;
        mems[n++] = job->mem.scratch_mem;
        mems[n++] = sd_push_take_net_mem(job);
        job->mem.pool = job->mem.scratch_mem = (struct sd_mem){.fd = -1};
    }
    *w = (struct job_free_work){.reg = reg,
                                .mems = mems,
                                .n_mems = n,
                                .bytes = job->mem.bytes_total,
                                .start_ns = sd_now_ns()};
    w->req.data = w;
    snprintf(w->job, sizeof(w->job), "%s", job->name);
    job->mem.scratch = NULL;
    job->mem.bytes_total = 0;
    if (uv_queue_work(reg->loop, &w->req, free_work_cb, free_after_cb) != 0) {
        free_work_cb(&w->req);
        free_after_cb(&w->req, 0);
    }
}

void sd_job_mem_free(struct sd_job *job)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    if (job->mem.queue != NULL) { /* no kernel may still touch what goes below */
        dev->sync(job->mem.queue);
        dev->queue_destroy(job->mem.queue);
        job->mem.queue = NULL;
    }
    if (job->nodes > 1)
        net_teardown(job); /* deregisters before anything is unmapped */
    free_off_loop(job);    /* what it took is empty below */
    if (job->mem.arena != NULL)
        for (uint32_t i = 0; i < job->k * SD_STATE_COUNT; i++)
            dev->free(&job->mem.arena[i]);
    if (job->mem.staging != NULL)
        for (uint32_t i = 0; i < job->k; i++)
            dev->free(&job->mem.staging[i]);
    if (job->mem.fence != NULL)
        for (uint32_t i = 0; i < job->k; i++)
            sd_gpu_host_ops.free(&job->mem.fence[i]);
    if (job->mem.pool.ptr != NULL)
        dev->free(&job->mem.pool);
    for (uint32_t i = 0; i < job->mem.n_pool_copies; i++)
        dev->free(&job->mem.pool_copy[i]);
    free(job->mem.pool_copy);
    job->mem.pool_copy = NULL;
    job->mem.n_pool_copies = 0;
    if (job->mem.scratch_mem.ptr != NULL)
        dev->free(&job->mem.scratch_mem);
    free(job->mem.arena);
    free(job->mem.staging);
    free(job->mem.fence);
    free(job->mem.fence_count);
    job->mem.fence = NULL;
    job->mem.fence_count = NULL;
    sd_job_modules_release(job); /* what shardctl reads stays: sd_job_free */
    sd_unit_cache_fini(&job->cache);
    free(job->xfer.wait_tags);
    job->xfer.wait_tags = NULL;
    free(job->xfer.rel_pending);
    free(job->xfer.rel_need);
    job->xfer.rel_pending = job->xfer.rel_need = NULL;
    job->xfer.rel_total = 0;
    free(job->xfer.answer_q);
    job->xfer.answer_q = NULL;
    job->xfer.aq_len = 0;
    free(job->mem.w_off);
    job->mem.arena = job->mem.staging = NULL;
    job->mem.scratch = NULL;
    job->mem.w_off = NULL;
    if (job->mem.bytes_total) {
        job->reg->used -= job->mem.bytes_total;
        job->mem.bytes_total = 0;
    }
}

/* Bytes the job needs on this node, by buffer. */
struct job_bytes {
    uint64_t w, g, os, sec, quant, pool, copies, staging, scratch, net, total;
};

/* The GPUs the job's local ranks use besides local rank 0's, in rank order, into copies (may be
 * NULL; one copy of the pool each): their count. */
static uint32_t job_pool_copies(const struct sd_job *job, struct sd_mem *copies)
{
    uint32_t n = 0;
    for (uint32_t r = 1; r < job->k; r++) {
        int d = sd_job_rank_device(job, r);
        bool seen = d == sd_job_rank_device(job, 0);
        for (uint32_t q = 1; q < r && !seen; q++)
            seen = d == sd_job_rank_device(job, q);
        if (!seen && copies != NULL)
            copies[n] = (struct sd_mem){.fd = -1, .device = d};
        n += !seen;
    }
    return n;
}

/* One rank's arena of each state: its data, and the colouring in front of and inside it. */
void sd_job_mem_arena_bytes(const struct sd_job *job, uint64_t bytes_p[SD_STATE_COUNT])
{
    const struct sd_layout *l = &job->layout;
    uint64_t os_stride = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]);
    bytes_p[SD_STATE_W] = job->mem.w_arena_bytes;
    bytes_p[SD_STATE_G] = l->arena_numel[SD_STATE_G] * sizeof(float);
    bytes_p[SD_STATE_OS] = os_stride * sizeof(float) * sd_optim_state_floats(job->model.optim.kind);
    for (int st = 0; st < SD_STATE_COUNT; st++)
        bytes_p[st] += sd_arena_colour(st);
}

static uint64_t control_bytes(const struct sd_job *job)
{
    return SD_FENCE_BYTES +
           sd_step_args_bytes(sd_model_groups(&job->model), job->layout.n_tensors,
                              job->model.bcast_bytes) +
           SD_CKPT_PATH_MAX;
}

static struct job_bytes job_bytes_needed(const struct sd_job *job, const struct sd_config *cfg)
{
    struct job_bytes b = {0};
    const struct sd_layout *l = &job->layout;
    uint64_t arena[SD_STATE_COUNT];
    sd_job_mem_arena_bytes(job, arena);
    b.w = arena[SD_STATE_W] * job->k;
    b.g = arena[SD_STATE_G] * job->k;
    b.os = arena[SD_STATE_OS] * job->k;
    b.sec = sd_sec_holder_bytes(job) * sd_sec_holders(job);
    b.quant = sd_quant_bytes(job, cfg);
    /* default: every unit at once; without the hierarchy each local rank has its own copy */
    b.pool = job->mem.max_live_bytes ? job->mem.max_live_bytes
             : cfg->max_live_bytes   ? cfg->max_live_bytes
                                     : l->total_bytes * job->slots_per_unit;
    b.copies = b.pool * job_pool_copies(job, NULL);
    b.staging =
        ((uint64_t)cfg->staging_slots * l->max_unit_numel * sizeof(float) + control_bytes(job)) *
        job->k;
    b.scratch = l->max_unit_numel * sizeof(float);
    b.net = net_bytes(job, cfg);
    const uint64_t parts[] = {b.w,    b.g,      b.os,      b.sec,     b.quant,
                              b.pool, b.copies, b.staging, b.scratch, b.net};
    b.total = 0;
    for (size_t i = 0; i < SD_ARRAY_SIZE(parts); i++) /* max_live_bytes near 2^64 must not wrap */
        if (__builtin_add_overflow(b.total, parts[i], &b.total))
            b.total = UINT64_MAX;
    return b;
}

/* Allocating a job's memory has three parts. job_alloc_begin checks the budget, reserves the
 * bytes and allocates the bookkeeping; job_alloc_device and job_alloc_control allocate and back the
 * big buffers (on a worker thread for host memory: backing 0.5 GiB took the loop up to 1 s here,
 * and a loop that stalls misses heartbeats and holds up every other job's transfers);
 * job_alloc_finish sets up the rest on the loop. Each failure leaves err filled and the caller
 * frees with sd_job_mem_free. */
static int job_alloc_begin(struct sd_job *job, char *err, size_t errlen)
{
    struct sd_registry *reg = job->reg;
    const struct sd_config *cfg = reg->cfg;
    const struct sd_layout *l = &job->layout;
    struct job_bytes need = job_bytes_needed(job, cfg);
    /* resuming: the paused job's memory comes back once its state is taken over */
    uint64_t budget = reg->budget + sd_resume_reclaim(job);
    char b1[32], b2[32], b3[32];

    if (need.pool < l->max_unit_bytes) {
        snprintf(err, errlen,
                 "max_live_bytes (%s) is smaller than the largest unit (%s): no unit could be "
                 "gathered",
                 sd_fmt_bytes(b1, sizeof(b1), need.pool),
                 sd_fmt_bytes(b2, sizeof(b2), l->max_unit_bytes));
        return SD_ENOSPC;
    }
    if (need.total > budget || reg->used > budget - need.total) {
        snprintf(err, errlen,
                 "job '%s' needs %llu bytes (%s: w %llu, g %llu, os %llu, secondary %llu, "
                 "quantization %llu, gather pool %llu, its copies on other GPUs %llu, staging "
                 "%llu, scratch %llu, network %llu) "
                 "but only %llu of the %llu-byte memory budget are free (%s); raise "
                 "memory_budget or shard more (plan)",
                 job->name, (unsigned long long)need.total,
                 sd_fmt_bytes(b1, sizeof(b1), need.total), (unsigned long long)need.w,
                 (unsigned long long)need.g, (unsigned long long)need.os,
                 (unsigned long long)need.sec, (unsigned long long)need.quant,
                 (unsigned long long)need.pool, (unsigned long long)need.copies,
                 (unsigned long long)need.staging, (unsigned long long)need.scratch,
                 (unsigned long long)need.net, (unsigned long long)(budget - reg->used),
                 (unsigned long long)budget, sd_fmt_bytes(b3, sizeof(b3), budget - reg->used));
        return SD_ENOSPC;
    }
    /* reserved now, so that jobs registering meanwhile see it */
    job->mem.bytes_total = need.total;
    reg->used += need.total;

    uint32_t k = job->k;
    job->mem.arena = calloc((size_t)k * SD_STATE_COUNT, sizeof(*job->mem.arena));
    job->mem.staging = calloc(k, sizeof(*job->mem.staging));
    job->mem.fence = calloc(k, sizeof(*job->mem.fence));
    job->mem.fence_count = calloc(2 * (size_t)k, sizeof(*job->mem.fence_count));
    uint32_t n_copies = job_pool_copies(job, NULL);
    job->mem.pool_copy = calloc(n_copies + 1, sizeof(*job->mem.pool_copy));
    if (job->mem.pool_copy != NULL) /* each on its GPU, made by job_alloc_device */
        job->mem.n_pool_copies = job_pool_copies(job, job->mem.pool_copy);
    int cache_st = sd_unit_cache_init(&job->cache, l->n_units, job->slots_per_unit, need.pool);
    int queue_st = reg->dev->queue_create(&job->mem.queue);
    job->xfer.wait_tags = calloc((size_t)job->n_slots * k, sizeof(*job->xfer.wait_tags));
    job->xfer.answer_q = calloc(job->n_slots, sizeof(*job->xfer.answer_q));
    job->xfer.rel_pending = calloc((size_t)job->n_slots * k, sizeof(*job->xfer.rel_pending));
    job->xfer.rel_need = calloc((size_t)job->n_slots * k, sizeof(*job->xfer.rel_need));
    uint32_t n_groups = sd_model_groups(&job->model);
    int mods_st = sd_job_modules_alloc(job);
    if (mods_st != SD_OK || !job->mem.arena || !job->mem.staging || !job->mem.fence ||
        !job->mem.fence_count || !job->mem.pool_copy || cache_st != SD_OK || queue_st != SD_OK ||
        !job->xfer.wait_tags || !job->xfer.answer_q || !job->xfer.rel_pending ||
        !job->xfer.rel_need) {
        snprintf(err, errlen, "out of memory for the job's bookkeeping");
        return SD_ENOMEM;
    }
    for (uint32_t i = 0; i < job->n_slots; i++)
        job->cache.units[i].job = job;
    for (uint32_t i = 0; i < k * SD_STATE_COUNT; i++)
        job->mem.arena[i].fd = -1;
    for (uint32_t i = 0; i < k; i++)
        job->mem.staging[i].fd = job->mem.fence[i].fd = -1;
    job->mem.pool.fd = job->mem.scratch_mem.fd = -1;
    job->stats.pool_bytes = need.pool;
    job->stats.memory_bytes = need.total;
    job->stats.loss_scale = 1.0; /* until a step says another */
    job->mem.staging_slots = (uint32_t)cfg->staging_slots;
    job->mem.staging_slot_bytes = l->max_unit_numel * sizeof(float);
    /* in the control page, after the fence; a save's directory follows the step arguments
     * (counted in them for the client) */
    job->mem.step_args_off = SD_FENCE_BYTES;
    job->mem.step_args_bytes = sd_step_args_bytes(n_groups, l->n_tensors, job->model.bcast_bytes);
    job->mem.save_path_off = job->mem.step_args_off + job->mem.step_args_bytes;
    job->mem.step_args_bytes += SD_CKPT_PATH_MAX;
    return SD_OK;
}

/* the message of a failed allocation: what, how much, and on which GPU (device >= 0, a device
 * backend) */
static int alloc_failed(const struct sd_job *job, const char *tag, int device, uint64_t bytes,
                        int status, char *err, size_t errlen)
{
    char b[32], where[32] = "";
    if (device >= 0 && !job->reg->dev->host_memory)
        snprintf(where, sizeof(where), " on GPU %d", device);
    snprintf(err, errlen, "allocating %s (%s)%s for job '%s' failed: %s", tag,
             sd_fmt_bytes(b, sizeof(b), bytes), where, job->name, sd_status_str(status));
    return status;
}

/* Everything of the job in the backend's memory: the w, g and os arenas of every local rank,
 * scratch, the secondary and quantized copies, and what the trainers map there (each rank's
 * staging slots and the gather pool: memfds, or a device's fd handles). Like job_alloc_control,
 * touches only its buffers of job and reads what registration fixed: safe on a worker thread
 * while the job is allocating (host memory; a device's memory is allocated on the loop). */
static int job_alloc_device(struct sd_job *job, char *err, size_t errlen)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint64_t bytes[SD_STATE_COUNT];
    sd_job_mem_arena_bytes(job, bytes);
    char tag[96];
    int status;
    for (uint32_t r = 0; r < job->k; r++)
        for (int st = 0; st < SD_STATE_COUNT; st++) {
            snprintf(tag, sizeof(tag), "shardd-%s-r%u-%s", job->name, job->first_rank + r,
                     sd_state_name(st));
            status = dev->alloc(sd_job_rank_device(job, r), bytes[st], SD_MEM_PRIVATE, tag,
                                &job->mem.arena[r * SD_STATE_COUNT + st]);
            if (status != SD_OK)
                return alloc_failed(job, tag, sd_job_rank_device(job, r), bytes[st], status, err,
                                    errlen);
        }
    uint64_t staging = (uint64_t)job->mem.staging_slots * job->mem.staging_slot_bytes;
    for (uint32_t r = 0; r < job->k; r++) {
        snprintf(tag, sizeof(tag), "shardd-%s-r%u-staging", job->name, job->first_rank + r);
        status = dev->alloc(sd_job_rank_device(job, r), staging, SD_MEM_SHARED, tag,
                            &job->mem.staging[r]);
        if (status != SD_OK)
            return alloc_failed(job, tag, sd_job_rank_device(job, r), staging, status, err, errlen);
    }
    snprintf(tag, sizeof(tag), "shardd-%s-pool", job->name);
    status = dev->alloc(sd_job_rank_device(job, 0), job->stats.pool_bytes,
                        SD_MEM_SHARED | SD_MEM_CLIENT_RO, tag, &job->mem.pool);
    if (status != SD_OK)
        return alloc_failed(job, tag, sd_job_rank_device(job, 0), job->stats.pool_bytes, status,
                            err, errlen);
    for (uint32_t i = 0; i < job->mem.n_pool_copies; i++) {
        int d = job->mem.pool_copy[i].device; /* placed by job_alloc_begin */
        snprintf(tag, sizeof(tag), "shardd-%s-pool-gpu%d", job->name, d);
        status = dev->alloc(d, job->stats.pool_bytes, SD_MEM_SHARED | SD_MEM_CLIENT_RO, tag,
                            &job->mem.pool_copy[i]);
        if (status != SD_OK)
            return alloc_failed(job, tag, d, job->stats.pool_bytes, status, err, errlen);
    }
    snprintf(tag, sizeof(tag), "shardd-%s-scratch", job->name);
    status = dev->alloc(sd_job_rank_device(job, 0), job->layout.max_unit_numel * sizeof(float),
                        SD_MEM_PRIVATE, tag, &job->mem.scratch_mem);
    if (status != SD_OK)
        return alloc_failed(job, tag, sd_job_rank_device(job, 0),
                            job->layout.max_unit_numel * sizeof(float), status, err, errlen);
    job->mem.scratch = job->mem.scratch_mem.ptr;
    status = sd_sec_alloc(job, tag, sizeof(tag));
    if (status != SD_OK)
        return alloc_failed(job, tag, -1, sd_sec_holder_bytes(job), status, err, errlen);
    return sd_quant_alloc(job, err, errlen);
}

/* Each local rank's control page, host memory whatever the backend (the daemon reads it on the
 * host): its fence page (sd/fence.h), then its step arguments and a save's directory. */
static int job_alloc_control(struct sd_job *job, char *err, size_t errlen)
{
    char tag[96];
    for (uint32_t r = 0; r < job->k; r++) {
        snprintf(tag, sizeof(tag), "shardd-%s-r%u-control", job->name, job->first_rank + r);
        int status =
            sd_gpu_host_ops.alloc(0, control_bytes(job), SD_MEM_SHARED, tag, &job->mem.fence[r]);
        if (status != SD_OK)
            return alloc_failed(job, tag, -1, control_bytes(job), status, err, errlen);
        struct sd_fence_page *f = job->mem.fence[r].ptr;
        f->magic = SD_FENCE_MAGIC;
        f->version = SD_FENCE_VERSION;
    }
    return SD_OK;
}

static int job_alloc_finish(struct sd_job *job, char *err, size_t errlen)
{
    sd_quant_start(job);
    int status = sd_sched_alloc(job);
    if (status != SD_OK) {
        snprintf(err, errlen, "out of memory for the job's schedule");
        return status;
    }
    if (job->nodes > 1) {
        char nerr[256];
        status = net_setup(job, nerr, sizeof(nerr));
        if (status != SD_OK) {
            snprintf(err, errlen, "job '%s': %s", job->name, nerr);
            return status;
        }
    }
    return SD_OK;
}

struct job_alloc_work {
    uv_work_t req;
    struct sd_job *job;
    bool device; /* the backend's memory is host memory: backed on the worker too */
    int status;
    char err[768];
};

static void alloc_work_cb(uv_work_t *req)
{
    struct job_alloc_work *w = req->data;
#ifdef SD_TEST_HOOKS /* tests only: SHARDD_TEST_ALLOC_STALL_MS holds every allocation that long */
    const char *stall = getenv("SHARDD_TEST_ALLOC_STALL_MS");
    if (stall != NULL)
        usleep((useconds_t)strtoul(stall, NULL, 10) * 1000u);
#endif
    w->status = w->device ? job_alloc_device(w->job, w->err, sizeof(w->err)) : SD_OK;
    if (w->status == SD_OK)
        w->status = job_alloc_control(w->job, w->err, sizeof(w->err));
}

/* The buffers are there (status SD_OK) or not: finish on the loop and go on. */
static void job_alloc_done(struct sd_job *job, int status, char *err, size_t errlen)
{
    if (status == SD_OK)
        status = job_alloc_finish(job, err, errlen);
    job->mem.alloc_ns = sd_now_ns() - job->mem.alloc_start_ns;
    if (status != SD_OK || job->n_registered != job->k) {
        sd_job_mem_free(job);
        if (job->n_registered != job->k) /* a rank left meanwhile: wait for it again */
            return;
    }
    sd_job_allocated(job, status, err);
}

static void alloc_after_cb(uv_work_t *req, int uv_status)
{
    struct job_alloc_work *w = req->data;
    struct sd_job *job = w->job;
    job->mem.allocating = false;
    if (uv_status != 0) {
        w->status = SD_ECANCELED;
        snprintf(w->err, sizeof(w->err), "allocating the buffers of job '%s' was cancelled",
                 job->name);
    }
    if (job->mem.doomed) /* unlinked while the worker ran */
        sd_job_free(job);
    else
        job_alloc_done(job, w->status, w->err, sizeof(w->err));
    free(w);
}

/* Every local rank is here: allocate, then go on in sd_job_allocated. Host memory is backed on a
 * worker thread; device memory is allocated here, in the thread the backend set up. */
void sd_job_mem_alloc(struct sd_job *job)
{
    char err[768];
    bool host = job->reg->dev->host_memory;
    job->mem.alloc_start_ns = sd_now_ns();
    int status = job_alloc_begin(job, err, sizeof(err));
    if (status == SD_OK && !host)
        status = job_alloc_device(job, err, sizeof(err));
    struct job_alloc_work *w =
        status == SD_OK && job->reg->loop != NULL ? calloc(1, sizeof(*w)) : NULL;
    if (w != NULL) {
        w->req.data = w;
        w->job = job;
        w->device = host;
        job->mem.allocating = true;
        if (uv_queue_work(job->reg->loop, &w->req, alloc_work_cb, alloc_after_cb) == 0)
            return;
        job->mem.allocating = false;
        free(w);
    }
    if (status == SD_OK && host)
        status = job_alloc_device(job, err, sizeof(err));
    if (status == SD_OK)
        status = job_alloc_control(job, err, sizeof(err));
    job_alloc_done(job, status, err, sizeof(err));
}

/* ---- the job's buffers across nodes */

static uint32_t bulks_needed(const struct sd_job *job)
{
    uint32_t Gw = job->gnodes[SD_STATE_W], G = job->gnodes[SD_STATE_G], N = job->nodes;
    uint32_t gathers = SD_MAX_GATHERS_INFLIGHT * (Gw - 1);
    uint32_t serve = SD_MAX_GATHERS_INFLIGHT * (N - 1) * job->slots_per_unit;
    uint32_t round = sd_job_push_gens(job) * (2 * (G - 1) + 2 * (N - 1));
    uint32_t step =
        2 * (N - 1) + 2 + 2 * (job->gnodes[SD_STATE_OS] - 1); /* + the weights' all-gather */
    uint32_t init = N;
    return gathers + serve + round + step + init + 4;
}

/* Pinned buffers for device memory in flight: every chunk of every bulk this job may have on
 * the wire at once (bulks_needed bounds the bulks, a unit the chunks of one), each of the
 * largest chunk a bulk of the job may use, at most SD_STAGE_RESERVE_BYTES together (beyond
 * that a receive makes one, counted in shardctl's staging_buffer_bytes, and sends wait). */
#define SD_STAGE_RESERVE_BYTES (256ull << 20)

static void stage_buffers(const struct sd_job *job, const struct sd_config *cfg, size_t *bytes_p,
                          uint32_t *count_p)
{
    size_t chunk = sd_bulk_chunk_bytes(job->layout.max_unit_bytes, job->k, cfg->chunk_bytes);
    uint64_t per_bulk = (job->layout.max_unit_bytes + chunk - 1) / chunk;
    uint64_t count = (uint64_t)bulks_needed(job) * (per_bulk ? per_bulk : 1);
    *bytes_p = chunk;
    *count_p = (uint32_t)SD_MAX(8, SD_MIN(count, SD_STAGE_RESERVE_BYTES / chunk));
}

static uint64_t net_bytes(const struct sd_job *job, const struct sd_config *cfg)
{
    if (job->nodes <= 1)
        return 0;
    uint32_t Gw = job->gnodes[SD_STATE_W];
    uint64_t b = (uint64_t)sd_push_net_floats(job, cfg) * sizeof(float);
    b += (uint64_t)bulks_needed(job) * sizeof(struct sd_bulk);
    b += (uint64_t)job->n_slots * (Gw ? Gw - 1 : 0) * (sizeof(struct sd_xfer) + sizeof(void *));
    return b;
}

static int net_setup(struct sd_job *job, char *err, size_t errlen)
{
    uint32_t Gw = job->gnodes[SD_STATE_W], N = job->nodes;
    uint64_t maxn = job->layout.max_unit_numel;
    job->xfer.net = job->reg->net;
    if (job->xfer.net == NULL) {
        snprintf(err, errlen, "this daemon has no cluster (nodes = 1)");
        return SD_ENOSYS;
    }
    if (job->k > 64 || Gw - 1 > 64 || job->k > SD_BULK_MAX_PIECES) {
        snprintf(err, errlen, "at most 64 ranks per node across nodes (have %u)", job->k);
        return SD_ENOSYS;
    }
    if (sd_job_tp_open(job) != SD_OK)
        goto err_nomem;
    int st = sd_bulk_pool_init(&job->xfer.bulks, bulks_needed(job));
    if (st != SD_OK)
        goto err_nomem;
    /* device memory crosses nodes through pinned buffers: ready before the first transfer */
    size_t stage_bytes;
    uint32_t stage_count;
    stage_buffers(job, job->reg->cfg, &stage_bytes, &stage_count);
    st = sd_transport_stage_reserve(sd_net_transport(job->xfer.net), stage_bytes, stage_count);
    if (st != SD_OK) {
        snprintf(err, errlen, "reserving pinned staging buffers failed: %s", sd_status_str(st));
        return st;
    }
    float *nr_mem = NULL;
    size_t nr_floats = 0;
    if (sd_push_net_setup(job, &nr_mem, &nr_floats) != SD_OK)
        goto err_nomem;
    if (Gw > 1) {
        for (uint32_t i = 0; i < job->n_slots; i++) {
            job->cache.units[i].rb = calloc(Gw, sizeof(*job->cache.units[i].rb));
            job->cache.units[i].req_x = calloc(Gw, sizeof(*job->cache.units[i].req_x));
            if (!job->cache.units[i].rb || !job->cache.units[i].req_x)
                goto err_nomem;
        }
    }
    job->xfer.members = calloc(N, sizeof(*job->xfer.members));
    job->xfer.req_cap = N * job->n_slots + 16;
    job->xfer.req_queue = calloc(job->xfer.req_cap, sizeof(*job->xfer.req_queue));
    job->xfer.read_req = calloc(1, sizeof(*job->xfer.read_req));
    uint32_t max_mrs = 3 * job->k + 8;
    job->xfer.mr_handles = calloc(max_mrs, sizeof(void *));
    job->xfer.mr_descs = calloc(max_mrs, sizeof(void *));
    job->xfer.mr_base = calloc(max_mrs, sizeof(void *));
    job->xfer.mr_len = calloc(max_mrs, sizeof(size_t));
    if (!job->xfer.members || !job->xfer.req_queue || !job->xfer.read_req ||
        !job->xfer.mr_handles || !job->xfer.mr_descs || !job->xfer.mr_base || !job->xfer.mr_len)
        goto err_nomem;
    /* memory registered once per job */
    const struct sd_mem *quant = sd_quant_mem(job);
    st = sd_job_net_reg(job, job->mem.pool.ptr, job->mem.pool.bytes);
    for (uint32_t r = 0; st == SD_OK && r < job->k; r++) {
        st = sd_job_net_reg(job, sd_job_arena(job, r, SD_STATE_W)->ptr,
                            sd_job_arena(job, r, SD_STATE_W)->bytes);
        if (st == SD_OK)
            st = sd_job_net_reg(job, job->mem.staging[r].ptr, job->mem.staging[r].bytes);
    }
    if (st == SD_OK)
        st = sd_job_net_reg(job, job->xfer.read_req, sizeof(*job->xfer.read_req));
    if (st == SD_OK)
        st = sd_job_net_reg(job, job->mem.scratch, maxn * sizeof(float));
    if (st == SD_OK)
        st = sd_job_net_reg(job, nr_mem, nr_floats * sizeof(float));
    size_t norm_bytes;
    void *norm_buf = sd_step_net_buf(job, &norm_bytes);
    if (st == SD_OK)
        st = sd_job_net_reg(job, norm_buf, norm_bytes);
    if (st == SD_OK) /* encoded w shards, gather receive slots, int4 blocks */
        st = quant != NULL ? sd_job_net_reg(job, quant->ptr, quant->bytes) : SD_OK;
    if (st == SD_OK) /* the pull requests each gather sends live in its unit state */
        st = sd_job_net_reg(job, job->cache.units, job->n_slots * sizeof(*job->cache.units));
    const struct sd_mem *g_arena = sd_job_arena(job, 0, SD_STATE_G);
    if (st == SD_OK &&
        sd_job_net_rounds_accumulate(job)) /* the all-gathers of the rounds land there */
        st = sd_job_net_reg(job, g_arena->ptr, g_arena->bytes);
    if (st != SD_OK) {
        snprintf(err, errlen, "registering the job's memory with the fabric failed: %s",
                 sd_status_str(st));
        return st;
    }
    return SD_OK;

err_nomem:
    snprintf(err, errlen, "out of memory for the job's network buffers");
    return SD_ENOMEM;
}

static void net_teardown(struct sd_job *job)
{
    for (uint32_t i = 0; job->xfer.net && i < job->xfer.n_mrs; i++)
        sd_job_tp(job)->ops->mr_dereg(sd_job_tp(job), job->xfer.mr_handles[i]);
    job->xfer.n_mrs = 0;
    sd_job_tp_close(job);
    for (uint32_t i = 0; job->cache.units != NULL && i < job->n_slots; i++) {
        free(job->cache.units[i].rb);
        free(job->cache.units[i].req_x);
        job->cache.units[i].rb = NULL;
        job->cache.units[i].req_x = NULL;
    }
    sd_bulk_pool_fini(&job->xfer.bulks);
    sd_push_net_teardown(job); /* the rounds' buffer goes with the job's other big buffers */
    free(job->xfer.members);
    free(job->xfer.req_queue);
    free(job->xfer.read_req);
    job->xfer.read_req = NULL;
    free(job->xfer.mr_handles);
    free(job->xfer.mr_descs);
    free(job->xfer.mr_base);
    free(job->xfer.mr_len);
    job->xfer.members = NULL;
    job->xfer.req_queue = NULL;
    job->xfer.mr_handles = job->xfer.mr_descs = NULL;
    job->xfer.mr_base = NULL;
    job->xfer.mr_len = NULL;
}

bool sd_job_net_idle(const struct sd_job *job)
{
    if (sd_ckpt_busy(job)) /* a checkpoint's worker reads or writes its memory */
        return false;
    return job->xfer.net == NULL ||
           (job->xfer.bulks.in_use == 0 && job->xfer.w_sends_inflight == 0 &&
            job->xfer.gathers_inflight == 0);
}

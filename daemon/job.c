/* Jobs: registration (all ranks, same model, with a deadline), memory for every buffer of the
 * job allocated up front within the budget, the layout reply, departures and failures. */
#include "cluster.h"
#include "daemon.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>

const char *sd_job_state_name(enum sd_job_state s)
{
    static const char *const names[] = {"registering", "loading", "ready",
                                        "failed",      "closing", "finished"};
    return names[s];
}

void sd_registry_init(struct sd_registry *reg, const struct sd_config *cfg,
                      const struct sd_gpu_ops *dev)
{
    memset(reg, 0, sizeof(*reg));
    reg->cfg = cfg;
    reg->dev = dev;
    reg->budget = cfg->memory_budget;
    if (reg->budget == 0) { /* default: half of physical memory */
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        reg->budget = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 2 : (1ULL << 32);
    }
}

struct sd_job *sd_registry_find(struct sd_registry *reg, const char *name)
{
    for (struct sd_job *j = reg->jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

struct sd_job *sd_registry_find_any(struct sd_registry *reg, const char *name)
{
    struct sd_job *j = sd_registry_find(reg, name);
    struct sd_job *lists[2] = {reg->zombies, reg->finished}; /* retiring, then recently ended */
    for (int i = 0; i < 2 && j == NULL; i++)
        for (struct sd_job *f = lists[i]; j == NULL && f; f = f->next)
            if (strcmp(f->name, name) == 0)
                j = f;
    return j;
}

static void model_free(struct sd_model *m)
{
    free(m->tensors);
    m->tensors = NULL;
    m->n_tensors = 0;
}

/* Copy a Register message into a model description; err says what is wrong. */
static int model_from_msg(const Shard__Register *msg, struct sd_model *m, char *err, size_t len)
{
    memset(m, 0, sizeof(*m));
    if (msg->n_tensors == 0 || msg->n_tensors > SD_MAX_TENSORS) {
        snprintf(err, len, "model has %zu tensors; expected 1..%d", msg->n_tensors, SD_MAX_TENSORS);
        return SD_EINVAL;
    }
    if (msg->optimizer == NULL) {
        snprintf(err, len, "model has no optimizer settings");
        return SD_EINVAL;
    }
    if (msg->plan == NULL || strlen(msg->plan) >= sizeof(m->plan)) {
        snprintf(err, len, "plan is missing or too long");
        return SD_EINVAL;
    }
    m->tensors = calloc(msg->n_tensors, sizeof(*m->tensors));
    if (m->tensors == NULL) {
        snprintf(err, len, "out of memory for %zu tensor descriptions", msg->n_tensors);
        return SD_ENOMEM;
    }
    m->n_tensors = (uint32_t)msg->n_tensors;
    for (size_t i = 0; i < msg->n_tensors; i++) {
        const Shard__TensorDesc *t = msg->tensors[i];
        struct sd_tensor_desc *d = &m->tensors[i];
        if (t->name == NULL || strlen(t->name) >= SD_MAX_NAME || t->n_dims > SD_MAX_DIMS) {
            snprintf(err, len, "tensor %zu: name longer than %d bytes or more than %d dims", i,
                     SD_MAX_NAME - 1, SD_MAX_DIMS);
            model_free(m);
            return SD_EINVAL;
        }
        snprintf(d->name, sizeof(d->name), "%s", t->name);
        d->ndim = (uint32_t)t->n_dims;
        for (size_t k = 0; k < t->n_dims; k++)
            d->dims[k] = t->dims[k];
        d->dtype = t->dtype < SD_DTYPE_COUNT ? (int)t->dtype : -1;
        d->unit = t->unit;
    }
    const Shard__Optimizer *o = msg->optimizer;
    m->optim = (struct sd_optim){.kind = (int)o->kind,
                                 .lr = o->lr,
                                 .beta1 = o->beta1,
                                 .beta2 = o->beta2,
                                 .eps = o->eps,
                                 .weight_decay = o->weight_decay,
                                 .momentum = o->momentum,
                                 .max_grad_norm = o->max_grad_norm};
    snprintf(m->plan, sizeof(m->plan), "%s", msg->plan);
    return sd_model_validate(m, err, len);
}

/* A job's big buffers go back on a worker thread: unmapping a job of 64 MiB units (about
 * 1 GiB) held the loop for 250 ms here, and with it every other job's transfers and the
 * heartbeats. Its bytes return to the budget once they are really gone. */
struct job_free_work {
    uv_work_t req;
    struct sd_registry *reg;
    struct sd_mem *mems; /* host memory: arenas (host backend), staging, pool */
    uint32_t n_mems;
    void *heap[2]; /* scratch, the node rounds' buffers */
    uint64_t bytes, start_ns;
    char job[64];
};

static void free_work_cb(uv_work_t *req)
{
    struct job_free_work *w = req->data;
    for (uint32_t i = 0; i < w->n_mems; i++)
        sd_gpu_host_ops.free(&w->mems[i]);
    free(w->heap[0]);
    free(w->heap[1]);
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
 * it takes nothing and job_free_memory frees them in place. */
static void free_off_loop(struct sd_job *job)
{
    struct sd_registry *reg = job->reg;
    bool host = reg->dev == &sd_gpu_host_ops;
    uint32_t n_arena = job->arena != NULL && host ? job->k * SD_STATE_COUNT : 0;
    uint32_t n_staging = job->staging != NULL ? job->k : 0;
    if (reg->loop == NULL || job->bytes_total == 0)
        return;
    struct job_free_work *w = calloc(1, sizeof(*w));
    struct sd_mem *mems = calloc(n_arena + n_staging + 1, sizeof(*mems));
    if (w == NULL || mems == NULL) {
        free(w);
        free(mems);
        return;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < n_arena; i++) {
        mems[n++] = job->arena[i];
        job->arena[i] = (struct sd_mem){.fd = -1};
    }
    for (uint32_t i = 0; i < n_staging; i++) {
        mems[n++] = job->staging[i];
        job->staging[i] = (struct sd_mem){.fd = -1};
    }
    mems[n++] = job->pool;
    job->pool = (struct sd_mem){.fd = -1};
    *w = (struct job_free_work){.reg = reg,
                                .mems = mems,
                                .n_mems = n,
                                .heap = {job->scratch, job->nr_mem},
                                .bytes = job->bytes_total,
                                .start_ns = sd_now_ns()};
    w->req.data = w;
    snprintf(w->job, sizeof(w->job), "%s", job->name);
    job->scratch = NULL;
    job->nr_mem = NULL;
    job->bytes_total = 0;
    if (uv_queue_work(reg->loop, &w->req, free_work_cb, free_after_cb) != 0) {
        free_work_cb(&w->req);
        free_after_cb(&w->req, 0);
    }
}

static void job_free_memory(struct sd_job *job)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    if (job->nodes > 1)
        sd_job_net_teardown(job); /* deregisters before anything is unmapped */
    free_off_loop(job);           /* what it took is empty below */
    if (job->arena != NULL)
        for (uint32_t i = 0; i < job->k * SD_STATE_COUNT; i++)
            dev->free(&job->arena[i]);
    if (job->staging != NULL)
        for (uint32_t i = 0; i < job->k; i++)
            sd_gpu_host_ops.free(&job->staging[i]);
    if (job->pool.ptr != NULL)
        sd_gpu_host_ops.free(&job->pool);
    free(job->arena);
    free(job->staging);
    free(job->scratch);
    free(job->nr_mem);
    free(job->units);
    free(job->rounds);
    free(job->round_entries);
    free(job->rounds_done);
    free(job->w_off);
    sd_sched_free(job);
    sd_slot_pool_fini(&job->spool);
    job->arena = job->staging = NULL;
    job->scratch = NULL;
    job->nr_mem = NULL;
    job->units = NULL;
    job->rounds = NULL;
    job->round_entries = NULL;
    job->rounds_done = NULL;
    job->w_off = NULL;
    if (job->bytes_total) {
        job->reg->used -= job->bytes_total;
        job->bytes_total = 0;
    }
}

static void job_free(struct sd_job *job)
{
    job_free_memory(job);
    sd_layout_free(&job->layout);
    model_free(&job->model);
    free(job->ranks);
    free(job->step_tags);
    free(job->step_arrive_ns);
    free(job->step_waiting);
    free(job->ready_waiting);
    free(job->ready_tags);
    free(job);
}

static void job_unlink(struct sd_job *job)
{
    struct sd_registry *reg = job->reg;
    for (struct sd_job **pp = &reg->jobs; *pp; pp = &(*pp)->next)
        if (*pp == job) {
            *pp = job->next;
            break;
        }
    reg->n_jobs--;
}

/* A job that never became ready: nothing worth keeping. */
static void job_destroy(struct sd_job *job)
{
    job_unlink(job);
    if (job->allocating) { /* the worker writes its buffers: alloc_after_cb frees it */
        job->doomed = true;
        return;
    }
    SD_DEBUG("job", "job '%s' (id %llu) dropped", job->name, (unsigned long long)job->id);
    job_free(job);
}

/* Every rank left: free the job's memory, keep its record and statistics for shardctl. */
static void job_bury(struct sd_job *job);

static void job_retire(struct sd_job *job)
{
    struct sd_registry *reg = job->reg;
    job_unlink(job);
    if (!sd_job_net_idle(job)) {
        /* transfers still read or write its memory: free it once they are done */
        sd_job_net_cancel(job);
        job->retire_pending = true;
        job->next = reg->zombies;
        reg->zombies = job;
        return;
    }
    job_bury(job);
}

static void job_bury(struct sd_job *job)
{
    struct sd_registry *reg = job->reg;
    job_free_memory(job);
    if (job->state != SD_JOB_FAILED)
        job->state = SD_JOB_FINISHED;
    SD_INFO("job", "job '%s' (id %llu) %s after %llu steps; memory released", job->name,
            (unsigned long long)job->id, sd_job_state_name(job->state),
            (unsigned long long)job->steps);
    job->next = reg->finished;
    reg->finished = job;
    if (++reg->n_finished > SD_FINISHED_JOBS_KEPT) {
        struct sd_job **pp = &reg->finished;
        while ((*pp)->next != NULL)
            pp = &(*pp)->next;
        job_free(*pp);
        *pp = NULL;
        reg->n_finished--;
    }
}

/* Bytes the job needs on this node, by buffer. */
struct job_bytes {
    uint64_t w, g, os, pool, staging, scratch, net, total;
};

/* One rank's arena of each state: its data, and the colouring in front of and inside it. */
static void job_arena_bytes(const struct sd_job *job, uint64_t bytes_p[SD_STATE_COUNT])
{
    const struct sd_layout *l = &job->layout;
    uint64_t os_stride = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]);
    bytes_p[SD_STATE_W] = job->w_arena_bytes;
    bytes_p[SD_STATE_G] = l->arena_numel[SD_STATE_G] * sizeof(float);
    bytes_p[SD_STATE_OS] = os_stride * sizeof(float) * sd_optim_state_floats(job->model.optim.kind);
    for (int st = 0; st < SD_STATE_COUNT; st++)
        bytes_p[st] += sd_arena_colour(st);
}

static struct job_bytes job_bytes_needed(const struct sd_job *job, const struct sd_config *cfg)
{
    struct job_bytes b = {0};
    const struct sd_layout *l = &job->layout;
    uint64_t arena[SD_STATE_COUNT];
    job_arena_bytes(job, arena);
    b.w = arena[SD_STATE_W] * job->k;
    b.g = arena[SD_STATE_G] * job->k;
    b.os = arena[SD_STATE_OS] * job->k;
    /* default: every unit at once; without the hierarchy each local rank has its own copy */
    b.pool = job->max_live_bytes   ? job->max_live_bytes
             : cfg->max_live_bytes ? cfg->max_live_bytes
                                   : l->total_bytes * job->slots_per_unit;
    b.staging = (uint64_t)cfg->staging_slots * l->max_unit_numel * sizeof(float) * job->k;
    b.scratch = l->max_unit_numel * sizeof(float);
    b.net = sd_job_net_bytes(job, cfg);
    b.total = b.w + b.g + b.os + b.pool + b.staging + b.scratch + b.net;
    return b;
}

/* Allocating a job's memory has three parts. job_alloc_begin checks the budget, reserves the
 * bytes and allocates the bookkeeping; job_alloc_arenas and job_alloc_host allocate and back the
 * big buffers (on a worker thread for host memory: backing 0.5 GiB took the loop up to 1 s here,
 * and a loop that stalls misses heartbeats and holds up every other job's transfers);
 * job_alloc_finish sets up the rest on the loop. Each failure leaves err filled and the caller
 * frees with job_free_memory. */
static int job_alloc_begin(struct sd_job *job, char *err, size_t errlen)
{
    struct sd_registry *reg = job->reg;
    const struct sd_config *cfg = reg->cfg;
    const struct sd_layout *l = &job->layout;
    struct job_bytes need = job_bytes_needed(job, cfg);
    uint64_t budget = reg->budget;
    char b1[32], b2[32], b3[32];

    if (need.pool < l->max_unit_bytes) {
        snprintf(err, errlen,
                 "max_live_bytes (%s) is smaller than the largest unit (%s): no unit could be "
                 "gathered",
                 sd_fmt_bytes(b1, sizeof(b1), need.pool),
                 sd_fmt_bytes(b2, sizeof(b2), l->max_unit_bytes));
        return SD_ENOSPC;
    }
    if (reg->used + need.total > budget) {
        snprintf(err, errlen,
                 "job '%s' needs %llu bytes (%s: w %llu, g %llu, os %llu, gather pool %llu, "
                 "staging %llu, scratch %llu, network %llu) but only %llu of the %llu-byte "
                 "memory budget are free (%s); raise memory_budget or shard more (plan)",
                 job->name, (unsigned long long)need.total,
                 sd_fmt_bytes(b1, sizeof(b1), need.total), (unsigned long long)need.w,
                 (unsigned long long)need.g, (unsigned long long)need.os,
                 (unsigned long long)need.pool, (unsigned long long)need.staging,
                 (unsigned long long)need.scratch, (unsigned long long)need.net,
                 (unsigned long long)(budget - reg->used), (unsigned long long)budget,
                 sd_fmt_bytes(b3, sizeof(b3), budget - reg->used));
        return SD_ENOSPC;
    }
    /* reserved now, so that jobs registering meanwhile see it */
    job->bytes_total = need.total;
    reg->used += need.total;

    uint32_t k = job->k;
    job->arena = calloc((size_t)k * SD_STATE_COUNT, sizeof(*job->arena));
    job->staging = calloc(k, sizeof(*job->staging));
    job->scratch = malloc(need.scratch ? need.scratch : 1);
    job->units = calloc(job->n_slots, sizeof(*job->units));
    if (job->node_rounds) { /* one round per unit over all local ranks, then the network */
        job->g_members = k;
        job->g_groups = 1;
    } else {
        job->g_members = SD_MIN(job->plan.f[SD_STATE_G], k);
        job->g_groups = k / job->g_members;
    }
    size_t n_rounds = (size_t)l->n_units * job->g_groups;
    job->rounds = calloc(n_rounds * job->round_gens, sizeof(*job->rounds));
    job->round_entries =
        calloc(n_rounds * job->round_gens * job->g_members, sizeof(*job->round_entries));
    job->rounds_done = calloc(n_rounds, sizeof(*job->rounds_done));
    if (!job->arena || !job->staging || !job->scratch || !job->units || !job->rounds ||
        !job->round_entries || !job->rounds_done) {
        snprintf(err, errlen, "out of memory for the job's bookkeeping");
        return SD_ENOMEM;
    }
    for (uint32_t i = 0; i < job->n_slots; i++) {
        job->units[i].unit = i / job->slots_per_unit;
        job->units[i].lslot = i % job->slots_per_unit;
        job->units[i].job = job;
    }
    for (uint32_t i = 0; i < k * SD_STATE_COUNT; i++)
        job->arena[i].fd = -1;
    for (uint32_t i = 0; i < k; i++)
        job->staging[i].fd = -1;
    job->pool.fd = -1;
    job->stats.pool_bytes = need.pool;
    job->staging_slots = (uint32_t)cfg->staging_slots;
    job->staging_slot_bytes = l->max_unit_numel * sizeof(float);
    return SD_OK;
}

static int alloc_failed(const struct sd_job *job, const char *tag, int status, char *err,
                        size_t errlen)
{
    snprintf(err, errlen, "allocating %s for job '%s' failed: %s", tag, job->name,
             sd_status_str(status));
    return status;
}

/* The w, g and os arenas of every local rank, in the backend's memory. Like job_alloc_host,
 * touches only its buffers of job and reads what registration fixed: safe on a worker thread
 * while the job is allocating. */
static int job_alloc_arenas(struct sd_job *job, char *err, size_t errlen)
{
    uint64_t bytes[SD_STATE_COUNT];
    job_arena_bytes(job, bytes);
    char tag[96];
    for (uint32_t r = 0; r < job->k; r++)
        for (int st = 0; st < SD_STATE_COUNT; st++) {
            snprintf(tag, sizeof(tag), "shardd-%s-r%u-%s", job->name, job->first_rank + r,
                     sd_state_name(st));
            int status = job->reg->dev->alloc(bytes[st], SD_MEM_PRIVATE, tag,
                                              &job->arena[r * SD_STATE_COUNT + st]);
            if (status != SD_OK)
                return alloc_failed(job, tag, status, err, errlen);
        }
    return SD_OK;
}

/* The host memory the trainers map: each local rank's staging slots and the gather pool. */
static int job_alloc_host(struct sd_job *job, char *err, size_t errlen)
{
    char tag[96];
    int status;
    for (uint32_t r = 0; r < job->k; r++) {
        snprintf(tag, sizeof(tag), "shardd-%s-r%u-staging", job->name, job->first_rank + r);
        status = sd_gpu_host_ops.alloc((uint64_t)job->staging_slots * job->staging_slot_bytes,
                                       SD_MEM_SHARED, tag, &job->staging[r]);
        if (status != SD_OK)
            return alloc_failed(job, tag, status, err, errlen);
    }
    snprintf(tag, sizeof(tag), "shardd-%s-pool", job->name);
    status = sd_gpu_host_ops.alloc(job->stats.pool_bytes, SD_MEM_SHARED, tag, &job->pool);
    return status == SD_OK ? SD_OK : alloc_failed(job, tag, status, err, errlen);
}

static int job_alloc_finish(struct sd_job *job, char *err, size_t errlen)
{
    int status = sd_slot_pool_init(&job->spool, job->stats.pool_bytes, job->n_slots + 1);
    if (status == SD_OK)
        status = sd_sched_alloc(job);
    if (status != SD_OK) {
        snprintf(err, errlen, "out of memory for the job's schedule");
        return status;
    }
    if (job->nodes > 1) {
        char nerr[256];
        status = sd_job_net_setup(job, nerr, sizeof(nerr));
        if (status != SD_OK) {
            snprintf(err, errlen, "job '%s': %s", job->name, nerr);
            return status;
        }
    }
    return SD_OK;
}

/* Send the layout and the shared fds to one registered rank. */
static int job_send_layout(struct sd_job *job, struct sd_session *s)
{
    const struct sd_layout *l = &job->layout;
    int status = SD_ENOMEM;
    Shard__UnitLayout *units = calloc(l->n_units, sizeof(*units));
    Shard__UnitLayout **up = calloc(l->n_units, sizeof(*up));
    Shard__TensorLayout *tens = calloc(l->n_tensors, sizeof(*tens));
    Shard__TensorLayout **tp = calloc(l->n_tensors, sizeof(*tp));
    s->holds = calloc(l->n_units, sizeof(*s->holds));
    if (!units || !up || !tens || !tp || !s->holds)
        goto out;
    for (uint32_t u = 0; u < l->n_units; u++) {
        shard__unit_layout__init(&units[u]);
        units[u].numel = l->units[u].numel;
        units[u].used = l->units[u].used;
        units[u].dtype = (uint32_t)l->units[u].dtype;
        units[u].first_tensor = l->units[u].first_tensor;
        units[u].n_tensors = l->units[u].n_tensors;
        up[u] = &units[u];
    }
    for (uint32_t t = 0; t < l->n_tensors; t++) {
        shard__tensor_layout__init(&tens[t]);
        tens[t].offset = l->tensors[t].offset;
        tens[t].numel = l->tensors[t].numel;
        tp[t] = &tens[t];
    }
    uint32_t factors[SD_STATE_COUNT];
    for (int st = 0; st < SD_STATE_COUNT; st++)
        factors[st] = job->plan.f[st];
    Shard__RegisterReply rep = SHARD__REGISTER_REPLY__INIT;
    rep.job_id = job->id;
    rep.n_units = l->n_units;
    rep.units = up;
    rep.n_tensors = l->n_tensors;
    rep.tensors = tp;
    rep.pool_bytes = job->pool.bytes;
    rep.staging_slots = job->staging_slots;
    rep.staging_slot_bytes = job->staging_slot_bytes;
    rep.n_shard_factor = SD_STATE_COUNT;
    rep.shard_factor = factors;
    rep.ranks_per_node = job->k;
    Shard__DaemonMsg out = SHARD__DAEMON_MSG__INIT;
    out.msg_case = SHARD__DAEMON_MSG__MSG_REGISTER;
    out.register_ = &rep;

    /* the pool goes out read-only: clients read gathered weights, never write them */
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", job->pool.fd);
    int ro = open(path, O_RDONLY | O_CLOEXEC);
    if (ro < 0) {
        status = -errno;
        goto out;
    }
    int fds[2] = {ro, job->staging[s->local].fd};
    status = sd_conn_send(s->conn, &out, fds, 2);
    close(ro);
    if (status == SD_OK)
        s->registered = true;
out:
    free(units);
    free(up);
    free(tens);
    free(tp);
    return status;
}

static void job_unlink_rank(struct sd_job *job, struct sd_session *s)
{
    if (job->ranks[s->local] == s)
        job->ranks[s->local] = NULL;
    s->job = NULL;
}

/* Registration is agreed (one node: at once; across nodes: confirmed by the coordinator):
 * answer every local rank with the layout and start loading the initial values. */
static void job_start_loading(struct sd_job *job)
{
    job->state = SD_JOB_LOADING;
    job->stats.allocs_after_register = 0;
    char b[32], c[32];
    SD_INFO("job",
            "job '%s' registered: %u ranks (%u on this node, %u nodes), plan %s, %u units, %s of "
            "parameters, %s allocated in %.1f ms",
            job->name, job->world, job->k, job->nodes, job->plan.name, job->layout.n_units,
            sd_fmt_bytes(b, sizeof(b), job->layout.total_bytes),
            sd_fmt_bytes(c, sizeof(c), job->bytes_total), (double)job->alloc_ns / 1e6);
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        if (s != NULL && job_send_layout(job, s) != SD_OK) {
            sd_job_fail(job, SD_ECONNRESET, "rank %u could not be sent its layout",
                        job->first_rank + r);
            return;
        }
    }
    if (job->nodes > 1)
        sd_job_net_loading(job);
}

/* Refuse the registration to every local rank and drop the job. */
static void job_refuse(struct sd_job *job, int status, const char *msg)
{
    SD_WARN("job", "job '%s' refused: %s", job->name, msg);
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        if (s == NULL)
            continue;
        sd_conn_send_error(s->conn, status, "register: %s", msg);
        job_unlink_rank(job, s);
    }
    job_destroy(job);
}

/* The job's memory is allocated (status SD_OK) or not (err says why): one node starts at once,
 * several ask the coordinator. */
static void job_allocated(struct sd_job *job, int status, const char *err)
{
    if (job->nodes == 1) {
        if (status != SD_OK)
            job_refuse(job, status, err);
        else
            job_start_loading(job);
        return;
    }
    /* the coordinator's decision comes back through sd_job_confirmed / sd_job_refused, possibly
     * before this call returns (node 0 decides locally): touch nothing of job afterwards */
    job->register_deadline_ns =
        sd_now_ns() + 2 * (uint64_t)job->reg->cfg->register_timeout_ms * 1000000ULL;
    sd_cluster_report_job(job->reg->net->cl, job->name, job->digest, job->world, job->nodes, status,
                          status == SD_OK ? "" : err);
}

struct job_alloc_work {
    uv_work_t req;
    struct sd_job *job;
    bool arenas; /* host-memory arenas: backed on the worker too */
    int status;
    char err[768];
};

static void alloc_work_cb(uv_work_t *req)
{
    struct job_alloc_work *w = req->data;
    w->status = w->arenas ? job_alloc_arenas(w->job, w->err, sizeof(w->err)) : SD_OK;
    if (w->status == SD_OK)
        w->status = job_alloc_host(w->job, w->err, sizeof(w->err));
}

/* The buffers are there (status SD_OK) or not: finish on the loop and go on. */
static void job_alloc_done(struct sd_job *job, int status, char *err, size_t errlen)
{
    if (status == SD_OK)
        status = job_alloc_finish(job, err, errlen);
    job->alloc_ns = sd_now_ns() - job->alloc_start_ns;
    if (status != SD_OK || job->n_registered != job->k) {
        job_free_memory(job);
        if (job->n_registered != job->k) /* a rank left meanwhile: wait for it again */
            return;
    }
    job_allocated(job, status, err);
}

static void alloc_after_cb(uv_work_t *req, int uv_status)
{
    struct job_alloc_work *w = req->data;
    struct sd_job *job = w->job;
    job->allocating = false;
    if (uv_status != 0) {
        w->status = SD_ECANCELED;
        snprintf(w->err, sizeof(w->err), "allocating the buffers of job '%s' was cancelled",
                 job->name);
    }
    if (job->doomed) /* unlinked while the worker ran */
        job_free(job);
    else
        job_alloc_done(job, w->status, w->err, sizeof(w->err));
    free(w);
}

/* Every local rank is here: allocate, then go on in job_allocated. Host memory is backed on a
 * worker thread; device memory is allocated here, in the thread the backend set up. */
static void job_complete_registration(struct sd_job *job)
{
    char err[768];
    bool host = job->reg->dev == &sd_gpu_host_ops;
    job->alloc_start_ns = sd_now_ns();
    int status = job_alloc_begin(job, err, sizeof(err));
    if (status == SD_OK && !host)
        status = job_alloc_arenas(job, err, sizeof(err));
    struct job_alloc_work *w =
        status == SD_OK && job->reg->loop != NULL ? calloc(1, sizeof(*w)) : NULL;
    if (w != NULL) {
        w->req.data = w;
        w->job = job;
        w->arenas = host;
        job->allocating = true;
        if (uv_queue_work(job->reg->loop, &w->req, alloc_work_cb, alloc_after_cb) == 0)
            return;
        job->allocating = false;
        free(w);
    }
    if (status == SD_OK && host)
        status = job_alloc_arenas(job, err, sizeof(err));
    if (status == SD_OK)
        status = job_alloc_host(job, err, sizeof(err));
    job_alloc_done(job, status, err, sizeof(err));
}

void sd_job_confirmed(struct sd_registry *reg, const char *name, uint32_t tag)
{
    struct sd_job *job = sd_registry_find(reg, name);
    if (job == NULL || job->state != SD_JOB_REGISTERING || job->n_registered != job->k)
        return;
    job->tag = tag;
    job_start_loading(job);
    sd_net_job_confirmed(reg, job);
}

void sd_job_refused(struct sd_registry *reg, const char *name, int status, const char *msg)
{
    struct sd_job *job = sd_registry_find(reg, name);
    if (job != NULL && job->state == SD_JOB_REGISTERING)
        job_refuse(job, status, msg);
}

static struct sd_job *job_create(struct sd_registry *reg, const Shard__Register *msg,
                                 struct sd_model *model, uid_t uid, char *err, size_t errlen)
{
    const struct sd_config *cfg = reg->cfg;
    if (msg->world == 0 || msg->world > SD_MAX_WORLD) {
        snprintf(err, errlen, "world size %u must be in 1..%d", msg->world, SD_MAX_WORLD);
        return NULL;
    }
    /* a job spans nodes [0, world / k): one node takes all its ranks; a cluster has k fixed */
    uint32_t k = cfg->nodes > 1 || cfg->ranks_per_node ? (uint32_t)cfg->ranks_per_node : msg->world;
    uint32_t nodes = msg->world / k;
    if (msg->world % k != 0 || nodes > (uint32_t)cfg->nodes) {
        snprintf(err, errlen,
                 "world size %u is not a multiple of ranks_per_node %u within the %lld nodes of "
                 "this cluster",
                 msg->world, k, (long long)cfg->nodes);
        return NULL;
    }
    if (nodes > 1 && !sd_cluster_ready(reg->net ? reg->net->cl : NULL)) {
        snprintf(err, errlen,
                 "the cluster has not formed yet (waiting for the other daemons); "
                 "retry in a moment");
        return NULL;
    }
    for (uint32_t n = 0; n < nodes; n++)
        if (reg->net != NULL && !sd_cluster_alive(reg->net->cl, n)) {
            snprintf(err, errlen, "node %u of the job's %u nodes is down", n, nodes);
            return NULL;
        }
    struct sd_job *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    job->reg = reg;
    snprintf(job->name, sizeof(job->name), "%s", msg->job);
    job->id = ++reg->next_job_id;
    job->uid = uid;
    job->world = msg->world;
    job->max_live_bytes = msg->max_live_bytes;
    job->k = k;
    job->node = (uint32_t)cfg->node;
    job->first_rank = job->node * k;
    job->topo = (struct sd_topo){.nodes = nodes, .ranks_per_node = k};
    job->model = *model;
    memset(model, 0, sizeof(*model));
    job->digest = sd_model_digest(&job->model);
    job->created_ns = sd_now_ns();
    job->register_deadline_ns = job->created_ns + (uint64_t)cfg->register_timeout_ms * 1000000ULL;
    job->ranks = calloc(k, sizeof(*job->ranks));
    job->step_tags = calloc(k, sizeof(*job->step_tags));
    job->step_arrive_ns = calloc(k, sizeof(*job->step_arrive_ns));
    job->step_waiting = calloc(k, sizeof(*job->step_waiting));
    job->ready_waiting = calloc(k, sizeof(*job->ready_waiting));
    job->ready_tags = calloc(k, sizeof(*job->ready_tags));
    int status = sd_plan_parse(job->model.plan, &job->topo, &job->plan, err, errlen);
    if (status == SD_OK)
        status = sd_layout_build(&job->model, &job->plan, &job->layout, err, errlen);
    job->nodes = nodes;
    uint32_t fw = job->plan.f[SD_STATE_W];
    job->group_nodes = fw > k ? fw / k : 1;
    job->slots_per_unit = job->group_nodes > 1 && !job->plan.hierarchical ? k : 1;
    job->node_rounds = nodes > 1 && (job->plan.f[SD_STATE_G] > k || !job->plan.two_hop);
    /* a round inside the node is reduced as soon as it is complete: one generation is enough */
    job->round_gens = job->node_rounds ? (uint32_t)reg->cfg->push_rounds : 1;
    if (status == SD_OK)
        job->n_slots = job->layout.n_units * job->slots_per_unit;
    if (status == SD_OK) {
        job->w_off = calloc(job->layout.n_units, sizeof(*job->w_off));
        if (job->w_off == NULL)
            status = SD_ENOMEM;
    }
    if (status != SD_OK || !job->ranks || !job->step_tags || !job->step_arrive_ns ||
        !job->step_waiting || !job->ready_waiting || !job->ready_tags) {
        if (status == SD_OK)
            snprintf(err, errlen, "out of memory");
        job_free(job);
        return NULL;
    }
    for (uint32_t u = 0; u < job->layout.n_units; u++) {
        job->w_off[u] = job->w_arena_bytes;
        job->w_arena_bytes += sd_job_w_shard_bytes(job, u);
    }
    job->next = reg->jobs;
    reg->jobs = job;
    reg->n_jobs++;
    return job;
}

void sd_job_register(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg)
{
    char err[768];
    struct sd_conn *c = s->conn;
    struct sd_model model;
    const char *name = msg->job ? msg->job : "";
    size_t nlen = strlen(name);

    if (nlen == 0 || nlen >= sizeof(((struct sd_job *)0)->name)) {
        sd_conn_send_error(c, SD_EINVAL, "register: job name must be 1..63 bytes, got %zu", nlen);
        return;
    }
    for (size_t i = 0; i < nlen; i++)
        if (name[i] < 0x21 || name[i] > 0x7e) {
            sd_conn_send_error(c, SD_EINVAL,
                               "register: job name must be printable ASCII without spaces");
            return;
        }
    int status = model_from_msg(msg, &model, err, sizeof(err));
    if (status != SD_OK) {
        sd_conn_send_error(c, status, "register job '%s' rank %u: %s", name, msg->rank, err);
        model_free(&model);
        return;
    }

    struct sd_job *job = sd_registry_find(reg, name);
    if (job == NULL) {
        if (reg->n_jobs >= (uint32_t)reg->cfg->max_jobs) {
            sd_conn_send_error(c, SD_EBUSY,
                               "register job '%s': %u jobs are served, max_jobs is "
                               "%lld",
                               name, reg->n_jobs, (long long)reg->cfg->max_jobs);
            model_free(&model);
            return;
        }
        job = job_create(reg, msg, &model, c->uid, err, sizeof(err));
        if (job == NULL) {
            sd_conn_send_error(c, SD_EINVAL, "register job '%s' rank %u: %s", name, msg->rank, err);
            model_free(&model);
            return;
        }
        SD_INFO("job", "job '%s' (id %llu) created by pid %d: world %u, plan %s", job->name,
                (unsigned long long)job->id, (int)c->pid, job->world, job->plan.name);
    } else {
        uint64_t digest = sd_model_digest(&model);
        if (job->uid != c->uid && c->uid != 0) {
            sd_conn_send_error(c, SD_EPERM,
                               "register job '%s': it belongs to uid %d, you are "
                               "uid %d",
                               name, (int)job->uid, (int)c->uid);
        } else if (job->state != SD_JOB_REGISTERING) {
            sd_conn_send_error(c, SD_EEXIST,
                               "register job '%s' rank %u: the job is already %s; pick another "
                               "job name or wait until its ranks detach",
                               name, msg->rank, sd_job_state_name(job->state));
        } else if (digest != job->digest) {
            char diff[256];
            sd_model_diff(&job->model, &model, diff, sizeof(diff));
            sd_conn_send_error(c, SD_EMISMATCH,
                               "register job '%s' rank %u: model digest %016llx differs from "
                               "%016llx registered by the other ranks (%s)",
                               name, msg->rank, (unsigned long long)digest,
                               (unsigned long long)job->digest, diff);
        } else if (msg->world != job->world || msg->max_live_bytes != job->max_live_bytes) {
            sd_conn_send_error(c, SD_EMISMATCH,
                               "register job '%s': world %u / max_live_bytes %llu differ from "
                               "%u / %llu of the other ranks",
                               name, msg->world, (unsigned long long)msg->max_live_bytes,
                               job->world, (unsigned long long)job->max_live_bytes);
        } else {
            model_free(&model);
            goto add_rank;
        }
        model_free(&model);
        return;
    }
add_rank:
    if (msg->rank >= job->world || msg->rank / job->k != job->node) {
        sd_conn_send_error(c, SD_EINVAL,
                           "register job '%s': rank %u is not on this node (node %u serves ranks "
                           "%u..%u of world %u)",
                           name, msg->rank, job->node, job->first_rank,
                           job->first_rank + job->k - 1, job->world);
        if (job->n_registered == 0)
            job_destroy(job);
        return;
    }
    uint32_t local = msg->rank - job->first_rank;
    if (job->ranks[local] != NULL) {
        sd_conn_send_error(c, SD_EEXIST,
                           "register job '%s': rank %u is already registered by "
                           "pid %d",
                           name, msg->rank, (int)job->ranks[local]->conn->pid);
        return;
    }
    job->ranks[local] = s;
    s->job = job;
    s->rank = msg->rank;
    s->local = local;
    job->n_registered++;
    SD_DEBUG("job", "job '%s': rank %u registered (%u of %u)", job->name, msg->rank,
             job->n_registered, job->k);
    if (job->n_registered == job->k)
        job_complete_registration(job);
}

static void job_fail_text(struct sd_job *job, int status, const char *text, bool tell_peers)
{
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
        return;
    SD_WARN("job", "job '%s' failed: %s", job->name, text);
    bool registering = job->state == SD_JOB_REGISTERING;
    job->state = SD_JOB_FAILED;
    job->fail_status = status;
    snprintf(job->fail_msg, sizeof(job->fail_msg), "%s", text);
    job->step_phase = SD_STEP_IDLE;
    if (job->nodes > 1 && !registering) {
        sd_job_net_cancel(job);
        if (tell_peers)
            sd_cluster_abort_job(job->reg->net->cl, job->name, job->nodes, status, text);
    }
    sd_job_fail_parked(job, status, text, true);
}

void sd_job_fail(struct sd_job *job, int status, const char *fmt, ...)
{
    char text[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    job_fail_text(job, status, text, true);
}

void sd_job_aborted(struct sd_registry *reg, const char *name, int status, const char *msg)
{
    struct sd_job *job = sd_registry_find(reg, name);
    if (job == NULL)
        return;
    if (job->state == SD_JOB_REGISTERING) {
        job_refuse(job, status, msg);
        return;
    }
    char text[256];
    snprintf(text, sizeof(text), "on another node: %s", msg);
    job_fail_text(job, status < 0 ? status : SD_EJOBFAILED, text, false);
}

void sd_registry_node_down(struct sd_registry *reg, uint32_t node, const char *reason)
{
    for (struct sd_job *job = reg->jobs, *next; job; job = next) {
        next = job->next;
        if (node >= job->nodes || job->nodes == 1)
            continue;
        if (job->n_left == job->k && job->retire_pending) {
            /* waiting for the coordinator to end it; without the coordinator, end it here */
            if (node == 0)
                job_retire(job);
            continue;
        }
        if (job->state == SD_JOB_REGISTERING) {
            char text[256];
            snprintf(text, sizeof(text), "node %u is down (%s) while the job registers", node,
                     reason);
            job_refuse(job, SD_EPEER, text);
            continue;
        }
        char what[200];
        sd_job_net_describe(job, what, sizeof(what));
        sd_job_fail(job, SD_EPEER, "%s; node %u is down: %s", what, node, reason);
    }
}

struct sd_job *sd_registry_find_tag(struct sd_registry *reg, uint32_t tag)
{
    struct sd_job *lists[2] = {reg->jobs, reg->zombies};
    for (int i = 0; i < 2; i++)
        for (struct sd_job *j = lists[i]; j; j = j->next)
            if (j->nodes > 1 && j->tag == tag && j->tag != 0)
                return j;
    return NULL;
}

bool sd_registry_tag_in_use(struct sd_registry *reg, uint32_t tag)
{
    return sd_registry_find_tag(reg, tag) != NULL;
}

uint32_t sd_registry_job_nodes(struct sd_registry *reg, const char *name)
{
    struct sd_job *job = sd_registry_find(reg, name);
    return job ? job->nodes : 0;
}

void sd_job_leave(struct sd_job *job, struct sd_session *s, const char *reason)
{
    if (job->state == SD_JOB_REGISTERING) {
        job_unlink_rank(job, s);
        job->n_registered--;
        if (job->n_registered == 0)
            job_destroy(job);
        return;
    }
    if (s->registered)
        sd_job_release_holds(job, s);
    if (s->has_stalled) {
        s->has_stalled = false;
    }
    job_unlink_rank(job, s);
    job->n_left++;
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING) {
        /* already over */
    } else if (strcmp(reason, "detached") == 0) {
        job->state = SD_JOB_CLOSING;
        job->fail_status = SD_EJOBFAILED;
        snprintf(job->fail_msg, sizeof(job->fail_msg), "rank %u (pid %d) detached after step %llu",
                 s->rank, (int)s->conn->pid, (unsigned long long)job->steps);
        SD_INFO("job", "job '%s' closing: %s", job->name, job->fail_msg);
        sd_job_fail_parked(job, SD_EJOBFAILED, job->fail_msg, false);
    } else {
        sd_job_fail(job, SD_EJOBFAILED, "rank %u (pid %d) %s after step %llu", s->rank,
                    (int)s->conn->pid, reason, (unsigned long long)job->steps);
    }
    if (job->n_left < job->k)
        return;
    /* across nodes the job ends when every node's ranks left: peers may still gather this
     * node's shards (a rank saving the final weights) */
    if (job->nodes > 1 && !job->retire_pending) {
        job->retire_pending = true;
        if (sd_cluster_job_left(job->reg->net->cl, job->name, job->nodes))
            return; /* sd_job_ended retires it, maybe already did */
    }
    job_retire(job);
}

void sd_job_ended(struct sd_registry *reg, const char *name)
{
    struct sd_job *job = sd_registry_find(reg, name);
    if (job != NULL && job->n_left == job->k)
        job_retire(job);
}

static void list_missing(char *out, size_t len, const struct sd_job *job, const bool *present)
{
    size_t off = 0;
    out[0] = '\0';
    for (uint32_t r = 0; r < job->k && off < len; r++)
        if (!present[r])
            off += (size_t)snprintf(out + off, len - off, "%s%u", off ? ", " : "",
                                    job->first_rank + r);
}

void sd_registry_sweep(struct sd_registry *reg, uint64_t now)
{
    for (struct sd_job **pp = &reg->zombies; *pp;) {
        struct sd_job *z = *pp;
        if (!sd_job_net_idle(z)) {
            pp = &z->next;
            continue;
        }
        *pp = z->next;
        job_bury(z);
    }
    uint64_t op_timeout = (uint64_t)reg->cfg->op_timeout_ms * 1000000ULL;
    char missing[128];
    bool present[1024];
    for (struct sd_job *job = reg->jobs, *next; job; job = next) {
        next = job->next;
        if (job->state == SD_JOB_REGISTERING) {
            if (now < job->register_deadline_ns || job->allocating)
                continue;
            for (uint32_t r = 0; r < job->k && r < 1024; r++)
                present[r] = job->ranks[r] != NULL;
            list_missing(missing, sizeof(missing), job, present);
            for (uint32_t r = 0; r < job->k; r++) {
                struct sd_session *s = job->ranks[r];
                if (s == NULL)
                    continue;
                sd_conn_send_error(s->conn, SD_ETIMEDOUT,
                                   "register job '%s': ranks %s did not register within %lld ms "
                                   "(register_timeout_ms)",
                                   job->name, missing, (long long)reg->cfg->register_timeout_ms);
                job_unlink_rank(job, s);
            }
            job_destroy(job);
            continue;
        }
        if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
            continue;
        if (job->nodes > 1 && job->state == SD_JOB_READY) {
            sd_job_net_sweep(job, now);
            if (job->state == SD_JOB_FAILED)
                continue;
        }
        /* a step barrier that waits too long */
        if (job->step_arrived > 0 && now - job->step_first_ns > op_timeout) {
            for (uint32_t r = 0; r < job->k && r < 1024; r++)
                present[r] = job->step_waiting[r];
            list_missing(missing, sizeof(missing), job, present);
            sd_job_fail(job, SD_ETIMEDOUT,
                        "step %llu: ranks %s did not call step within %lld ms (op_timeout_ms)",
                        (unsigned long long)job->steps + 1, missing,
                        (long long)reg->cfg->op_timeout_ms);
            continue;
        }
        /* a call that cannot proceed (a pool place, transfer resources) for too long */
        for (uint32_t r = 0; r < job->k; r++) {
            struct sd_session *s = job->ranks[r];
            if (s == NULL || !s->has_stalled || now - s->stalled_ns <= op_timeout)
                continue;
            sd_job_fail(job, SD_ETIMEDOUT,
                        "rank %u's %s of unit %u could not proceed for %lld ms (op_timeout_ms): "
                        "%s",
                        s->rank, sd_op_name((int)s->stalled.op), s->stalled.unit,
                        (long long)reg->cfg->op_timeout_ms,
                        s->stalled.op == SD_OP_FETCH
                            ? "its pool place or the transfers it needs stayed busy"
                            : "an earlier call of the same kind did not complete");
            break;
        }
        if (job->state == SD_JOB_FAILED)
            continue;
        if (job->state == SD_JOB_LOADING) {
            bool waiting = false;
            for (uint32_t r = 0; r < job->k; r++)
                waiting |= job->ready_waiting[r];
            if (waiting && now - job->created_ns >
                               op_timeout + (uint64_t)reg->cfg->register_timeout_ms * 1000000ULL)
                sd_job_fail(job, SD_ETIMEDOUT,
                            "rank 0 did not finish loading the initial values in time");
            continue;
        }
        size_t n_gens = (size_t)job->layout.n_units * job->g_groups * job->round_gens;
        for (size_t gi = 0; gi < n_gens; gi++) {
            struct sd_push_round *rd = &job->rounds[gi];
            if (rd->arrived == 0 || rd->arrived == job->g_members ||
                now - rd->first_ns <= op_timeout)
                continue;
            uint32_t g = sd_job_round_group(job, gi), u = sd_job_round_unit(job, gi);
            struct sd_push_entry *ent = sd_job_round_ents(job, gi);
            for (uint32_t r = 0; r < job->k && r < 1024; r++)
                present[r] = r / job->g_members != g || ent[r % job->g_members].s != NULL;
            list_missing(missing, sizeof(missing), job, present);
            sd_job_fail(job, SD_ETIMEDOUT,
                        "push of unit %u (micro-step %llu): ranks %s did not push within "
                        "%lld ms (op_timeout_ms)",
                        u, (unsigned long long)rd->seq + 1, missing,
                        (long long)reg->cfg->op_timeout_ms);
            break;
        }
    }
}

void sd_registry_destroy_all(struct sd_registry *reg)
{
    while (reg->jobs != NULL) {
        struct sd_job *job = reg->jobs;
        for (uint32_t r = 0; r < job->k; r++)
            if (job->ranks[r] != NULL)
                job_unlink_rank(job, job->ranks[r]);
        job_destroy(job);
    }
    while (reg->zombies != NULL) {
        struct sd_job *job = reg->zombies;
        reg->zombies = job->next;
        job_free(job);
    }
    while (reg->finished != NULL) {
        struct sd_job *job = reg->finished;
        reg->finished = job->next;
        job_free(job);
    }
    reg->n_finished = 0;
}

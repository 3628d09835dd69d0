/* A job built by hand and the shared fakes (job_fixture.h). */
#include "job_fixture.h"
#include "check.h"
#include "net.h"
#include "session.h"
#include "stats.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct th_fake th_fake;

float th_rand_unit(void)
{
    return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f;
}

bool th_job_build(struct th_job *tj, const char *plan, uint32_t nodes, uint32_t k, uint32_t node,
                  const uint64_t *sizes, uint32_t n, int dtype)
{
    memset(tj, 0, sizeof(*tj));
    tj->reg.dev = &sd_gpu_host_ops;
    tj->reg.cfg = &tj->cfg;
    tj->cfg.op_timeout_ms = 1000;
    struct sd_job *job = &tj->job;
    job->reg = &tj->reg;
    for (uint32_t t = 0; t < n && t < TH_JOB_MAX_TENSORS; t++) {
        tj->tensors[t] =
            (struct sd_tensor_desc){.ndim = 1, .dims = {sizes[t]}, .dtype = dtype, .unit = t};
        snprintf(tj->tensors[t].name, sizeof(tj->tensors[t].name), "t%u", t);
    }
    job->model = (struct sd_model){.n_tensors = n, .tensors = tj->tensors};
    job->model.optim = (struct sd_optim){.kind = SD_OPTIM_SGD, .lr = 0.1f};
    snprintf(job->model.plan, sizeof(job->model.plan), "%s", plan);
    snprintf(job->name, sizeof(job->name), "j");
    job->topo = (struct sd_topo){.nodes = nodes, .ranks_per_node = k};
    char err[256];
    if (k > TH_JOB_MAX_K ||
        sd_plan_parse(plan, &job->topo, &job->plan, err, sizeof(err)) != SD_OK ||
        sd_layout_build(&job->model, &job->plan, &job->layout, err, sizeof(err)) != SD_OK) {
        TH_CHECK(false, "%s on %ux%u: %s", plan, nodes, k,
                 k > TH_JOB_MAX_K ? "too many ranks" : err);
        return false;
    }
    job->state = SD_JOB_READY;
    job->k = k;
    job->nodes = nodes;
    job->node = node;
    job->world = nodes * k;
    job->first_rank = node * k;
    for (int st = 0; st < SD_STATE_COUNT; st++)
        job->gnodes[st] = job->plan.f[st] > k ? job->plan.f[st] / k : 1;
    sd_gpu_host_ops.queue_create(&job->mem.queue);
    for (uint32_t r = 0; r < k; r++)
        tj->s[r] = (struct sd_session){.job = job, .local = r, .rank = job->first_rank + r};
    return true;
}

void th_job_g_arenas(struct th_job *tj)
{
    struct sd_job *job = &tj->job;
    uint64_t n = job->layout.arena_numel[SD_STATE_G];
    job->mem.arena = tj->arena;
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_mem *a = &tj->arena[r * SD_STATE_COUNT + SD_STATE_G];
        a->bytes = sd_arena_colour(SD_STATE_G) + n * sizeof(float);
        a->ptr = calloc(1, a->bytes);
        float *g = th_job_g(tj, r);
        for (uint64_t i = 0; i < n; i++)
            g[i] = th_rand_unit();
    }
}

void th_job_state_arenas(struct th_job *tj)
{
    struct sd_job *job = &tj->job;
    const struct sd_layout *l = &job->layout;
    job->mem.arena = tj->arena;
    job->mem.w_off = calloc(l->n_units, sizeof(*job->mem.w_off));
    job->mem.w_arena_bytes = 0;
    for (uint32_t u = 0; u < l->n_units; u++) {
        job->mem.w_off[u] = job->mem.w_arena_bytes;
        job->mem.w_arena_bytes += sd_job_w_shard_bytes(job, u);
    }
    uint64_t os_bytes = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]) * sizeof(float) *
                        sd_optim_state_floats(job->model.optim.kind);
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_mem *w = &tj->arena[r * SD_STATE_COUNT + SD_STATE_W];
        w->bytes = sd_arena_colour(SD_STATE_W) + job->mem.w_arena_bytes;
        w->ptr = calloc(1, w->bytes);
        struct sd_mem *os = &tj->arena[r * SD_STATE_COUNT + SD_STATE_OS];
        os->bytes = sd_arena_colour(SD_STATE_OS) + os_bytes;
        os->ptr = calloc(1, os->bytes);
    }
}

float *th_job_g(struct th_job *tj, uint32_t r)
{
    return sd_job_state(&tj->job, r, SD_STATE_G);
}

void th_job_free(struct th_job *tj)
{
    for (uint32_t i = 0; i < tj->job.k * SD_STATE_COUNT; i++)
        free(tj->arena[i].ptr);
    free(tj->job.mem.w_off);
    sd_gpu_host_ops.queue_destroy(tj->job.mem.queue);
    sd_layout_free(&tj->job.layout);
}

void th_fake_reset(void)
{
    memset(&th_fake, 0, sizeof(th_fake));
}

int th_answered(uint32_t local, uint64_t tag)
{
    for (int i = 0; i < th_fake.done && i < TH_MAX_ANSWERS; i++)
        if (th_fake.ans[i].local == local && th_fake.ans[i].tag == tag)
            return i;
    return -1;
}

/* ---- the fakes */

void sd_session_complete(struct sd_session *s, uint64_t tag, int op, int status, uint64_t v0,
                         uint64_t v1, const char *msg)
{
    (void)op;
    if (th_fake.done < TH_MAX_ANSWERS) {
        struct th_answer *a = &th_fake.ans[th_fake.done];
        *a =
            (struct th_answer){.local = s->local, .tag = tag, .v0 = v0, .v1 = v1, .status = status};
        snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    }
    th_fake.done++;
}

void sd_session_fail(struct sd_session *s, const struct sd_sqe *e, int status, const char *fmt, ...)
{
    (void)s;
    (void)e;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(th_fake.fail_msg, sizeof(th_fake.fail_msg), fmt, ap);
    va_end(ap);
    th_fake.fails++;
    th_fake.fail_status = status;
}

void sd_job_fail(struct sd_job *job, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(th_fake.job_msg, sizeof(th_fake.job_msg), fmt, ap);
    va_end(ap);
    th_fake.job_fails++;
    th_fake.job_status = status;
    job->state = SD_JOB_FAILED;
}

/* (the job's core names a peer with its cluster node; a job built by hand has no cluster) */
const char *sd_job_peer_name(const struct sd_job *job, uint32_t n, char *buf, size_t len)
{
    (void)job;
    snprintf(buf, len, "node %u", n);
    return buf;
}

void sd_job_missing_ranks(const struct sd_job *job, const bool *present, char *out, size_t len)
{
    (void)job;
    (void)present;
    snprintf(out, len, "?");
}

void sd_job_backend_failed(struct sd_job *job, int status)
{
    sd_job_fail(job, status, "backend");
}

int sd_job_queue_mark(struct sd_job *job, bool behind, uint64_t *ticket_p)
{
    (void)job;
    (void)behind;
    *ticket_p = 0;
    if (th_fake.queue_eagain > 0) {
        th_fake.queue_eagain--;
        return SD_EAGAIN;
    }
    return SD_OK;
}

bool sd_job_event(struct sd_job *job, enum sd_job_event ev)
{
    (void)job;
    if ((int)ev >= 0 && (int)ev < 16)
        th_fake.events[ev]++;
    return false;
}

bool sd_job_event_unit(struct sd_job *job, enum sd_job_event ev, uint32_t unit)
{
    th_fake.last_event_unit = unit;
    return sd_job_event(job, ev);
}

void sd_job_net_describe(const struct sd_job *job, char *out, size_t len)
{
    (void)job;
    snprintf(out, len, "the operation");
}

void sd_latency_add(struct sd_latency *l, uint64_t ns)
{
    (void)l;
    (void)ns;
}

/* the fake engine: recorded, completed by the test */
int sd_job_net_allreduce(struct sd_job *job, const struct sd_job_allreduce *a)
{
    (void)job;
    if (th_fake.n_ar < TH_MAX_POSTS)
        th_fake.ar[th_fake.n_ar++] = *a;
    a->ar->p.arg = a->arg;
    a->ar->p.qbits = 0;
    a->ar->bytes_sent = a->ar->bytes_recv = a->count * sizeof(float);
    return SD_OK;
}

/* its device waits are the test's: it completes the all-reduce when it chooses */
bool sd_allreduce_poll(struct sd_allreduce *ar)
{
    (void)ar;
    return false;
}

bool sd_allreduce_waiting(const struct sd_allreduce *ar)
{
    (void)ar;
    return false;
}

void sd_allreduce_abort(struct sd_allreduce *ar, int status)
{
    (void)ar;
    (void)status;
}

uint32_t sd_job_net_exchange(struct sd_job *job, struct sd_exchange_param *x, uint32_t kind,
                             uint32_t unit, uint32_t seq, int *status_p, uint32_t *suspect_p)
{
    (void)job;
    (void)kind;
    (void)unit;
    (void)seq;
    (void)status_p;
    (void)suspect_p;
    if (th_fake.n_ex < TH_MAX_POSTS)
        th_fake.ex[th_fake.n_ex++] = *x;
    return 2; /* its send and its receive */
}

/* the rest of the job's core, as the modules see it: a state's name, memory the transport does
 * not need registered, an operation answered */
const char *sd_job_state_name(enum sd_job_state st)
{
    static const char *names[] = {"registering", "loading", "ready",
                                  "failed",      "closing", "finished"};
    return (unsigned)st < sizeof(names) / sizeof(names[0]) ? names[st] : "?";
}

void *sd_job_net_desc(const struct sd_job *job, const void *p)
{
    (void)job;
    (void)p;
    return NULL;
}

void sd_op_done(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t v0,
                uint64_t v1, uint64_t start_ns)
{
    (void)job;
    (void)start_ns;
    th_fake.op_done++;
    sd_session_complete(s, e->tag, (int)e->op, SD_OK, v0, v1, NULL);
}

uint16_t th_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, 4);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

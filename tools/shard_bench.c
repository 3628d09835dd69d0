/* shard-bench: benchmarks of shardd, each reported as a ratio against a baseline measured in the
 * same run.
 *
 *   fetch    throughput of gathering a unit (default 64 MiB) vs memcpy of the same bytes, and the
 *            latency of fetching an already resident unit vs a bare Unix-socket round trip
 *   step     AdamW step throughput on a shard (default 64M parameters) vs the memory-bandwidth
 *            bound: 32 bytes per parameter (read g, master, m, v; write master, m, v, w) at the
 *            bandwidth memcpy reaches (bytes read + written per second)
 *   allgather|reducescatter|allreduce
 *            one job per size across the daemons of --sockets, with the columns of nccl-tests:
 *            the mean time per operation (the pushes of reducescatter and allreduce go back to
 *            back and are waited for once; each allgather is a fetch waited for), algbw, busbw,
 *            and #wrong from checking every element; the sizes run one after the other on every
 *            rank
 *
 * --json prints one object per measurement with name, size_bytes, time_s, baseline,
 * baseline_time_s and ratio. Times are medians over --iters repetitions. */
#include "shard.h"
#include "bench_kernels.h"
#include "sd/codec.h"
#include "sd/gpu.h"
#include "shard_internal.h"
#include "sd/cost.h"
#include "sd/model.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <math.h>
#include <time.h>
#include <unistd.h>

/* fewer iterations for large sizes: about 1 GiB moved per measurement, at least 3 */
#define SD_BENCH_ITERS(iters, size)                                                                \
    ((size) * (uint64_t)(iters) > (1ULL << 30)                                                     \
         ? ((1ULL << 30) / (size) < 3 ? 3 : (1ULL << 30) / (size))                                 \
         : (uint64_t)(iters))

struct opts {
    const char *socket;
    const char *sockets; /* collectives: one socket per node, comma-separated */
    int ranks_per_node;
    uint64_t size, min_size, max_size;
    uint64_t params;
    int iters, warmup;
    bool json;
    bool copy_push; /* reducescatter/allreduce: shard_push_grad instead of the zero-copy push */
    bool sgd;       /* step: SGD with momentum instead of AdamW */
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void report(const struct opts *o, const char *name, uint64_t bytes, double t,
                   const char *baseline, double tb, double ratio, const char *unit_note)
{
    if (o->json) {
        printf("{\"name\": \"%s\", \"size_bytes\": %llu, \"time_s\": %.9g, \"baseline\": \"%s\", "
               "\"baseline_time_s\": %.9g, \"ratio\": %.4f}\n",
               name, (unsigned long long)bytes, t, baseline, tb, ratio);
    } else {
        printf("%-18s %12llu %14.3f %-26s %14.3f %8.3f  %s\n", name, (unsigned long long)bytes,
               t * 1e6, baseline, tb * 1e6, ratio, unit_note);
    }
    fflush(stdout);
}

static double memcpy_time(uint64_t bytes, int iters)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double *t = calloc((size_t)iters, sizeof(double));
    for (int i = 0; i < iters; i++) {
        double t0 = now_s();
        memcpy(i % 2 ? a : b, i % 2 ? b : a, bytes);
        t[i] = now_s() - t0;
    }
    double m = median(t, iters);
    free(a);
    free(b);
    free(t);
    return m;
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int st_ = (call);                                                                          \
        if (st_ != SHARD_OK) {                                                                     \
            fprintf(stderr, "shard-bench: %s: %s: %s\n", #call, shard_strerror(st_),               \
                    ctx ? shard_last_error(ctx) : "");                                             \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

static shard_ctx_t *ctx;

/* A job of world 1 with n_units fp32 units of `numel` elements each. */
static int register_job(const struct opts *o, const char *job, int n_units, uint64_t numel,
                        uint64_t max_live)
{
    static char names[64][16];
    static uint64_t dims[64][1];
    shard_tensor_t t[64];
    for (int u = 0; u < n_units; u++) {
        snprintf(names[u], sizeof(names[u]), "t%d", u);
        dims[u][0] = numel;
        t[u] = (shard_tensor_t){
            .name = names[u], .ndim = 1, .dims = dims[u], .dtype = SHARD_FP32, .unit = (uint32_t)u};
    }
    char jobname[64];
    snprintf(jobname, sizeof(jobname), "%s-%d", job, (int)getpid());
    shard_model_t m = {.job = jobname,
                       .rank = 0,
                       .world = 1,
                       .plan = "zero3",
                       .tensors = t,
                       .n_tensors = (uint32_t)n_units,
                       .optimizer = {.name = "adamw",
                                     .lr = 1e-3f,
                                     .beta1 = 0.9f,
                                     .beta2 = 0.999f,
                                     .eps = 1e-8f,
                                     .weight_decay = 0.01f},
                       .max_live_bytes = max_live};
    if (o->sgd)
        m.optimizer = (shard_optimizer_t){
            .name = "sgd", .lr = 1e-3f, .momentum = 0.9f, .weight_decay = 0.01f};
    CHECK(shard_attach(o->socket, &ctx));
    CHECK(shard_register(ctx, &m));
    return 0;
}

/* Round trip of a 64-byte request and reply over a Unix socket to another process. */
static double socket_rtt(int iters)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        char buf[64];
        while (read(sv[1], buf, sizeof(buf)) == (ssize_t)sizeof(buf))
            if (write(sv[1], buf, sizeof(buf)) != (ssize_t)sizeof(buf))
                break;
        _exit(0);
    }
    close(sv[1]);
    char buf[64] = {0};
    double *t = calloc((size_t)iters, sizeof(double));
    for (int i = 0; i < iters + 100; i++) {
        double t0 = now_s();
        if (write(sv[0], buf, sizeof(buf)) != (ssize_t)sizeof(buf) ||
            read(sv[0], buf, sizeof(buf)) != (ssize_t)sizeof(buf))
            break;
        if (i >= 100)
            t[i - 100] = now_s() - t0;
    }
    close(sv[0]);
    waitpid(pid, NULL, 0);
    double m = median(t, iters);
    free(t);
    return m;
}

static int bench_fetch(const struct opts *o)
{
    uint64_t numel = o->size / 4;
    /* two units and a pool that holds one: every fetch evicts the other unit and gathers */
    if (register_job(o, "bench-fetch", 2, numel, o->size))
        return 1;
    shard_unit_info_t ui;
    CHECK(shard_unit_info(ctx, 0, &ui));
    int iters = o->iters;
    double *t = calloc((size_t)iters, sizeof(double));
    const void *p;
    for (int i = 0; i < iters + 2; i++) {
        double t0 = now_s();
        CHECK(shard_fetch(ctx, (uint32_t)(i % 2), &p));
        double dt = now_s() - t0;
        CHECK(shard_release(ctx, (uint32_t)(i % 2)));
        if (i >= 2)
            t[i - 2] = dt;
    }
    double tf = median(t, iters);
    double tm = memcpy_time(ui.bytes, iters);
    report(o, "fetch_gather", ui.bytes, tf, "memcpy", tm, tm / tf,
           "ratio = memcpy time / fetch time (target >= 0.7)");

    int lat_iters = 20000;
    double *tl = calloc((size_t)lat_iters, sizeof(double));
    CHECK(shard_fetch(ctx, 0, &p));
    CHECK(shard_release(ctx, 0));
    for (int i = 0; i < lat_iters + 1000; i++) {
        double t0 = now_s();
        CHECK(shard_fetch(ctx, 0, &p));
        double dt = now_s() - t0;
        CHECK(shard_release(ctx, 0));
        if (i >= 1000)
            tl[i - 1000] = dt;
    }
    double tr = median(tl, lat_iters);
    double rtt = socket_rtt(lat_iters);
    report(o, "fetch_resident", 0, tr, "unix_socket_round_trip", rtt, tr / rtt,
           "ratio = fetch latency / socket RTT (target <= 0.5)");
    free(t);
    free(tl);
    CHECK(shard_detach(ctx));
    ctx = NULL;
    return 0;
}

static int bench_step(const struct opts *o)
{
    int units = 4;
    uint64_t numel = o->params / (uint64_t)units;
    if (register_job(o, "bench-step", units, numel, 0))
        return 1;
    int iters = o->iters;
    double *t = calloc((size_t)iters, sizeof(double));
    double norm;
    for (int i = 0; i < iters + 1; i++) {
        double t0 = now_s();
        CHECK(shard_step(ctx, &norm));
        if (i >= 1)
            t[i - 1] = now_s() - t0;
    }
    double ts = median(t, iters);
    uint64_t n = numel * (uint64_t)units;
    double tm = memcpy_time(n * 4, iters); /* moves 2 * 4n bytes */
    double bw = 2.0 * (double)n * 4 / tm;
    /* AdamW reads g, master, m, v and writes master, m, v, w; SGD has one moment less */
    double per_param = o->sgd ? 24.0 : 32.0;
    double bound = per_param * (double)n / bw;
    report(o, o->sgd ? "sgd_step" : "adamw_step", n * 4, ts, "memcpy_bandwidth_bound", bound,
           bound / ts,
           o->sgd ? "ratio = (24 B/param at memcpy bandwidth) / step time (target >= 0.7)"
                  : "ratio = (32 B/param at memcpy bandwidth) / step time (target >= 0.7)");
    free(t);
    CHECK(shard_detach(ctx));
    ctx = NULL;
    return 0;
}

/* ---- collectives across the daemons of a cluster (nccl-tests conventions)
 *
 * One process per rank. allgather: a zero3 fetch that must gather (the cached copy is dropped
 * before each iteration); reducescatter: a zero3 gradient push (reduce-scatter across the
 * partition group); allreduce: a push under "ddp,no-2hop" (every micro-step all-reduces across
 * all ranks). Times are per rank, averaged over the iterations; the reported time is the slowest
 * rank's. #wrong counts elements that differ from the exact expected result: gathered values
 * against the initial values, reductions through one SGD step with lr 1 on integer gradients. */

enum { COLL_AG = 1, COLL_RS = 2, COLL_AR = 3 };

struct coll_result {
    uint64_t size;
    double time_s;
    uint64_t wrong;
    int status;
};

/* One gradient push of unit 0, every element `value`: written into the staging buffer
 * (shard_grad_buffer, as a trainer whose backward pass writes there), or with --copy-push
 * copied by shard_push_grad from grad, which holds that gradient (NULL otherwise). host: where
 * the gradient is made when the job's buffers are a device's (then copied in), else NULL. */
static int push_value(shard_ctx_t *c, const struct opts *o, const shard_unit_info_t *ui,
                      const float *grad, float *host, float value)
{
    if (o->copy_push)
        return shard_push_grad(c, 0, grad, ui->bytes);
    void *b;
    int st = shard_grad_buffer(c, 0, &b);
    if (st != 0)
        return st;
    float *f = host != NULL ? host : b;
    for (uint64_t i = 0; i < ui->numel; i++)
        f[i] = value;
    if (host != NULL && (st = shard_copy(c, b, host, ui->bytes)) != 0)
        return st;
    return shard_push_staged(c, 0);
}

/* a fetched unit's bytes where this process can read them: p itself, or copied into host when
 * the job's buffers are a device's */
static const float *readable(shard_ctx_t *c, const void *p, float *host, size_t bytes, int *st_p)
{
    if (host == NULL)
        return p;
    *st_p = shard_copy(c, host, p, bytes);
    return host;
}

static int coll_rank(const struct opts *o, int kind, int rank, int world, const char *sock,
                     uint64_t size, struct coll_result *res)
{
    uint64_t numel = size / 4;
    uint64_t dims[1] = {numel};
    shard_tensor_t t = {.name = "x", .ndim = 1, .dims = dims, .dtype = SHARD_FP32, .unit = 0};
    char job[96];
    snprintf(job, sizeof(job), "bench-%d-%d-%llu", kind, (int)getppid(), (unsigned long long)size);
    float *init = NULL;
    const float *inits[1] = {NULL};
    if (kind == COLL_AG && rank == 0) {
        init = malloc(numel * sizeof(float));
        for (uint64_t i = 0; i < numel; i++)
            init[i] = (float)(i % 4099);
        inits[0] = init;
    }
    shard_model_t m = {.job = job,
                       .rank = (uint32_t)rank,
                       .world = (uint32_t)world,
                       .plan = kind == COLL_AR ? "ddp,no-2hop" : "zero3",
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 1.0f},
                       .init = inits};
    shard_ctx_t *c = NULL;
    int st = shard_attach(sock, &c);
    if (st == 0)
        st = shard_register(c, &m);
    free(init);
    if (st != 0) {
        fprintf(stderr, "shard-bench rank %d: %s\n", rank, shard_last_error(c));
        if (c)
            shard_detach(c);
        return st;
    }
    shard_unit_info_t ui;
    shard_unit_info(c, 0, &ui);
    int iters = (int)SD_BENCH_ITERS(o->iters, size), total = iters + o->warmup;
    double sum = 0, t0_all = 0;
    const void *p;
    float *grad = NULL;
    /* the job's buffers are a device's: read and written through shard_copy */
    float *host = strcmp(shard_memory(c), "host") != 0 ? malloc(ui.bytes ? ui.bytes : 1) : NULL;
    if (kind != COLL_AG && o->copy_push) {
        grad = malloc(ui.bytes);
        for (uint64_t i = 0; i < ui.numel; i++)
            grad[i] = (float)(rank + 1);
    }
    for (int it = 0; it < total && st == 0; it++) {
        double t0;
        if (kind == COLL_AG) {
            st = shard__drop(c, 0);
            t0 = now_s();
            if (st == 0)
                st = shard_fetch(c, 0, &p);
            double dt = now_s() - t0;
            if (st == 0 && it == total - 1) {
                const float *x = readable(c, p, host, ui.bytes, &st);
                for (uint64_t i = 0; st == 0 && i < numel; i++)
                    res->wrong += x[i] != (float)(i % 4099);
            }
            if (st == 0)
                st = shard_release(c, 0);
            if (it >= o->warmup)
                sum += dt;
        } else if (it < o->warmup) {
            st = push_value(c, o, &ui, grad, host, (float)(rank + 1));
            if (st == 0)
                st = shard__push_flush(c);
        } else {
            /* as nccl-tests: the measured iterations go back to back (a push returns once its
             * gradient is staged), then one wait; the time is their mean */
            if (it == o->warmup)
                t0_all = now_s();
            st = push_value(c, o, &ui, grad, host, (float)(rank + 1));
            if (st == 0 && it == total - 1) {
                st = shard__push_flush(c);
                sum = now_s() - t0_all;
            }
        }
    }
    if (st == 0 && kind != COLL_AG) {
        /* w = 0 - lr * (sum over pushes and ranks) / world = -total * (world + 1) / 2 */
        double norm;
        st = shard_step(c, &norm);
        if (st == 0)
            st = shard_fetch(c, 0, &p);
        if (st == 0) {
            const float *x = readable(c, p, host, ui.bytes, &st);
            double want = -(double)total * (world + 1) / 2.0;
            for (uint64_t i = 0; st == 0 && i < ui.numel; i++)
                res->wrong += fabs(x[i] - want) > 1e-6 * fabs(want);
            shard_release(c, 0);
        }
    }
    if (st != 0)
        fprintf(stderr, "shard-bench rank %d size %llu: %s\n", rank, (unsigned long long)size,
                shard_last_error(c));
    free(grad);
    free(host);
    shard_detach(c);
    res->size = size;
    res->time_s = sum / iters;
    res->status = st;
    return st;
}

/* memory_used_bytes of the daemon at sock (its budget in use), or -1 */
static long long daemon_used(const char *sock)
{
    char *js = NULL;
    shard_admin(sock, "status", NULL, &js);
    const char *p = js ? strstr(js, "\"memory_used_bytes\":") : NULL;
    long long v = p ? atoll(p + strlen("\"memory_used_bytes\":")) : -1;
    free(js);
    return v;
}

/* A daemon frees a finished job's buffers once its ranks left, on a worker thread: about
 * 0.25 s of CPU for the 1 GiB of a 64 MiB job, times 4 daemons on a small host. Wait until
 * every daemon is back to what it used before the sweep (10 s at most), so that the next size
 * is not measured while they unmap the last one; nccl-tests never frees between sizes. */
static void wait_memory_returned(const char *const *socks, int nodes, const long long *base)
{
    double t0 = now_s();
    for (int i = 0; i < nodes; i++)
        while (daemon_used(socks[i]) > base[i] && now_s() - t0 < 10)
            usleep(5000);
}

static int bench_coll(const struct opts *o, int kind, const char *name)
{
    char buf[4096];
    const char *socks[64];
    int nodes = 0;
    snprintf(buf, sizeof(buf), "%s", o->sockets ? o->sockets : "");
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok && nodes < 64;
         tok = strtok_r(NULL, ",", &save))
        socks[nodes++] = tok;
    if (nodes == 0 || o->ranks_per_node < 1) {
        fprintf(stderr,
                "shard-bench %s: needs --sockets S0,S1,... (one per node) and "
                "--ranks-per-node K\n",
                name);
        return 2;
    }
    int world = nodes * o->ranks_per_node;
    long long base[64];
    for (int i = 0; i < nodes; i++)
        base[i] = daemon_used(socks[i]);
    int fds[2];
    if (pipe(fds) != 0)
        return 1;
    /* Every rank finishes a size before any starts the next (go[r]: a byte per size from this
     * process): a rank that went on alone would register the next job, whose buffers the
     * daemons allocate and fill, while the others still measure. */
    pid_t kids[512];
    int go[512];
    if (world > 512) {
        fprintf(stderr, "shard-bench %s: at most 512 ranks\n", name);
        return 2;
    }
    for (int r = 0; r < world; r++) {
        int gp[2];
        if (pipe(gp) != 0)
            return 1;
        kids[r] = fork();
        if (kids[r] == 0) {
            close(fds[0]);
            close(gp[1]);
            for (int q = 0; q < r; q++)
                close(go[q]);
            for (uint64_t size = o->min_size; size <= o->max_size; size *= 2) {
                char c;
                if (size > o->min_size && read(gp[0], &c, 1) != 1)
                    _exit(1); /* another rank failed */
                struct coll_result res = {0};
                int st = coll_rank(o, kind, r, world, socks[r / o->ranks_per_node], size, &res);
                if (st != 0 && res.status == 0)
                    res.status = st; /* it failed before measuring (attach, register) */
                if (write(fds[1], &res, sizeof(res)) != (ssize_t)sizeof(res))
                    _exit(1);
                if (res.status != 0)
                    _exit(1);
            }
            _exit(0);
        }
        close(gp[0]);
        go[r] = gp[1];
    }
    close(fds[1]);
    double factor = kind == COLL_AR ? 2.0 * (world - 1) / world : (double)(world - 1) / world;
    if (!o->json)
        printf("# %s: %d ranks (%d nodes x %d)\n# %12s %12s %12s %12s %12s %8s\n", name, world,
               nodes, o->ranks_per_node, "size_bytes", "count", "time_us", "algbw_GB/s",
               "busbw_GB/s", "#wrong");
    int rc = 0;
    for (uint64_t size = o->min_size; size <= o->max_size; size *= 2) {
        double worst = 0;
        uint64_t wrong = 0;
        int failed = 0;
        for (int r = 0; r < world; r++) {
            struct coll_result res;
            if (read(fds[0], &res, sizeof(res)) != (ssize_t)sizeof(res)) {
                failed = 1;
                break;
            }
            worst = res.time_s > worst ? res.time_s : worst;
            wrong += res.wrong;
            failed |= res.status != 0;
        }
        if (failed) {
            fprintf(stderr, "shard-bench %s: a rank failed at size %llu\n", name,
                    (unsigned long long)size);
            rc = 1;
            break;
        }
        double algbw = (double)size / worst / 1e9, busbw = algbw * factor;
        if (o->json)
            printf("{\"name\": \"%s\", \"size_bytes\": %llu, \"ranks\": %d, \"time_s\": %.9g, "
                   "\"algbw_GBps\": %.4f, \"busbw_GBps\": %.4f, \"wrong\": %llu, \"baseline\": "
                   "\"none\", \"baseline_time_s\": 0, \"ratio\": 0}\n",
                   name, (unsigned long long)size, world, worst, algbw, busbw,
                   (unsigned long long)wrong);
        else
            printf("  %12llu %12llu %12.1f %12.3f %12.3f %8llu\n", (unsigned long long)size,
                   (unsigned long long)(size / 4), worst * 1e6, algbw, busbw,
                   (unsigned long long)wrong);
        fflush(stdout);
        rc |= wrong != 0;
        wait_memory_returned(socks, nodes, base); /* before the next size, or the next run */
        for (int r = 0; r < world && size * 2 <= o->max_size; r++) /* the ranks go on */
            if (write(go[r], "g", 1) != 1)
                rc = 1;
    }
    for (int r = 0; r < world; r++)
        close(go[r]);
    close(fds[0]);
    for (int r = 0; r < world; r++) {
        int status;
        waitpid(kids[r], &status, 0);
        rc |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    return rc;
}

/* The MiCS cost model for a plan: inter-node bytes per node per step, and their time. */
static int bench_model(int argc, char **argv)
{
    const char *plan_s = "mics:2";
    struct sd_cost_in in = {.numel = 1 << 20,
                            .w_bytes = 4,
                            .nodes = 4,
                            .k = 2,
                            .accum = 1,
                            .cached_in_step = true,
                            .inter_Bps = 1e9 / 8};
    double compute_s = 0;
    bool json = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--bf16") == 0) {
            in.w_bytes = 2;
        } else if (strcmp(a, "--regather") == 0) {
            in.cached_in_step = false;
        } else if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (v == NULL) {
            fprintf(stderr, "shard-bench model: unexpected argument '%s' (or its value missing)\n",
                    a);
            return 2;
        } else if (strcmp(a, "--plan") == 0) {
            plan_s = argv[++i];
        } else if (strcmp(a, "--params") == 0) {
            in.numel = strtoull(argv[++i], NULL, 0);
        } else if (strcmp(a, "--nodes") == 0) {
            in.nodes = (uint32_t)atoi(argv[++i]);
        } else if (strcmp(a, "--ranks-per-node") == 0) {
            in.k = (uint32_t)atoi(argv[++i]);
        } else if (strcmp(a, "--accum") == 0) {
            in.accum = (uint32_t)atoi(argv[++i]);
        } else if (strcmp(a, "--gbps") == 0) {
            in.inter_Bps = atof(argv[++i]) * 1e9 / 8;
        } else if (strcmp(a, "--compute-s") == 0) {
            compute_s = atof(argv[++i]);
        } else {
            fprintf(stderr, "shard-bench model: unexpected argument '%s'\n", a);
            return 2;
        }
    }
    if (in.nodes < 1 || in.k < 1 || in.accum < 1 || in.numel < 1 || !(in.inter_Bps > 0)) {
        fprintf(stderr, "shard-bench model: --nodes, --ranks-per-node, --accum, --params and "
                        "--gbps must be positive\n");
        return 2;
    }
    struct sd_topo topo = {.nodes = in.nodes, .ranks_per_node = in.k};
    struct sd_plan plan;
    char err[256];
    if (sd_plan_parse(plan_s, &topo, &plan, err, sizeof(err)) != 0) {
        fprintf(stderr, "shard-bench model: %s\n", err);
        return 2;
    }
    struct sd_cost_out o;
    sd_cost_step(&in, &plan, &o);
    if (json)
        printf("{\"name\": \"model\", \"plan\": \"%s\", \"params\": %llu, \"fetch_bytes\": %.0f, "
               "\"push_bytes\": %.0f, \"step_bytes\": %.0f, \"total_bytes\": %.0f, "
               "\"comm_s\": %.6f, \"step_s\": %.6f}\n",
               plan_s, (unsigned long long)in.numel, o.fetch_bytes, o.push_bytes, o.step_bytes,
               o.total_bytes, o.comm_s, o.comm_s + compute_s);
    else
        printf("%s: per node per step %.1f MB inter-node (fetch %.1f, push %.1f, step %.1f): "
               "%.3f s at %.2f Gbit/s%s\n",
               plan_s, o.total_bytes / 1e6, o.fetch_bytes / 1e6, o.push_bytes / 1e6,
               o.step_bytes / 1e6, o.comm_s, in.inter_Bps * 8 / 1e9,
               compute_s > 0 ? " (+ compute)" : "");
    return 0;
}

/* ---- codec: the host backend's block quantization kernels against memcpy of the same fp32
 * input, in the same run (GB/s of fp32 input) */

static double time_best(void (*fn)(void *), void *arg, int iters)
{
    double best = 1e30;
    for (int i = 0; i < iters; i++) {
        double t0 = now_s();
        fn(arg);
        double t = now_s() - t0;
        best = t < best ? t : best;
    }
    return best;
}

struct codec_run {
    const struct sd_gpu_ops *dev;
    struct sd_gpu_queue *q;
    float *x, *y;
    uint8_t *enc;
    size_t n;
    int bits;
    uint32_t block;
};

static void run_memcpy(void *arg)
{
    struct codec_run *r = arg;
    memcpy(r->y, r->x, r->n * sizeof(float));
}

static void run_quant(void *arg)
{
    struct codec_run *r = arg;
    r->dev->quantize(r->q, r->enc, r->bits, r->x, SD_DTYPE_FP32, r->n, r->block);
    r->dev->sync(r->q);
}

static void run_dequant(void *arg)
{
    struct codec_run *r = arg;
    r->dev->dequantize(r->q, r->y, SD_DTYPE_FP32, r->enc, r->bits, r->n, r->block, true);
    r->dev->sync(r->q);
}

static int bench_codec(const struct opts *o, uint32_t block)
{
    struct codec_run r = {.dev = &sd_gpu_host_ops, .n = o->size / sizeof(float), .block = block};
    r.x = malloc(r.n * sizeof(float));
    r.y = calloc(r.n, sizeof(float));
    r.enc = malloc(sd_codec_bytes(8, r.n, block));
    if (r.x == NULL || r.y == NULL || r.enc == NULL || r.dev->queue_create(&r.q) != 0) {
        fprintf(stderr, "shard-bench codec: out of memory for %zu elements\n", r.n);
        return 1;
    }
    for (size_t i = 0; i < r.n; i++)
        r.x[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    double mc = time_best(run_memcpy, &r, o->iters);
    for (int bits = 8; bits >= 4; bits -= 4) {
        r.bits = bits;
        double qt = time_best(run_quant, &r, o->iters), dt = time_best(run_dequant, &r, o->iters);
        double gb = (double)o->size / 1e9;
        if (o->json)
            printf("{\"name\": \"codec\", \"bits\": %d, \"block\": %u, \"bytes\": %llu, "
                   "\"quantize_GBps\": %.3f, \"dequantize_acc_GBps\": %.3f, "
                   "\"memcpy_GBps\": %.3f, \"encoded_bytes\": %llu}\n",
                   bits, block, (unsigned long long)o->size, gb / qt, gb / dt, gb / mc,
                   (unsigned long long)sd_codec_bytes(bits, r.n, block));
        else
            printf("int%d block %u, %llu bytes of fp32 (encoded %llu): quantize %.2f GB/s, "
                   "dequantize-accumulate %.2f GB/s, memcpy %.2f GB/s (ratios %.3f, %.3f)\n",
                   bits, block, (unsigned long long)o->size,
                   (unsigned long long)sd_codec_bytes(bits, r.n, block), gb / qt, gb / dt, gb / mc,
                   mc / qt, mc / dt);
    }
    r.dev->queue_destroy(r.q);
    free(r.x);
    free(r.y);
    free(r.enc);
    return 0;
}

static void usage(FILE *out)
{
    fprintf(
        out,
        "usage: shard-bench fetch|step|all|codec [--socket PATH] [--size BYTES] [--params N]\n"
        "       shard-bench kernels [--backend cuda|hip|emu|host] [--size BYTES] [--params N]\n"
        "                   [--optimizer adamw|sgd] [--iters N] [--json]\n"
        "       shard-bench allgather|reducescatter|allreduce --sockets P0,P1,...\n"
        "                   [--ranks-per-node K] [--min BYTES] [--max BYTES] [--iters N]\n"
        "                   [--warmup N] [--copy-push] [--json]\n"
        "       shard-bench model [--plan P] [--params N] [--nodes N] [--ranks-per-node K]\n"
        "                   [--accum S] [--gbps G] [--compute-s S] [--bf16] [--regather]\n"
        "                   [--json]\n"
        "  fetch   gather throughput of a --size unit (default 64 MiB) vs memcpy, and the\n"
        "          latency of fetching a resident unit vs a Unix-socket round trip\n"
        "  step    optimizer step (--optimizer, default adamw) on --params parameters\n"
        "          (default 64M) vs the memcpy bandwidth bound (32 bytes per parameter for\n"
        "          AdamW, 24 for SGD with momentum)\n"
        "  allgather, reducescatter, allreduce\n"
        "          collectives across the daemons of a cluster (one socket per node, K ranks\n"
        "          each), sizes doubling from --min (4096) to --max (64 MiB), with the columns\n"
        "          of nccl-tests (time, algbw, busbw, #wrong). Gradients are written into\n"
        "          shardd's staging buffer (shard_grad_buffer); --copy-push has shard_push_grad\n"
        "          copy them instead\n"
        "  model   the MiCS cost model: inter-node bytes per node per step of a plan\n"
        "  codec   the host backend's int8/int4 block quantization (quantize, dequantize-\n"
        "          accumulate) on --size bytes of fp32 (default 64 MiB) in blocks of --block\n"
        "          (default 256) vs memcpy of the same input, GB/s of fp32 input; no daemon\n"
        "  kernels a device backend's kernels (default cuda) against its own copy bandwidth:\n"
        "          a --size unit (default 256 MiB) gathered from 8 shards, AdamW and SGD on\n"
        "          --params (default 64M), the codecs; exits 77 without the device; no daemon\n"
        "Needs running daemons (--socket, default $SHARD_SOCKET or /run/shardd/shardd.sock).\n"
        "shard-bench --version prints the version.\n");
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "model") == 0)
        return bench_model(argc, argv);
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--version") == 0) {
            printf("shard-bench %s\n", SHARD_VERSION);
            return 0;
        }
    struct opts o = {.size = 64ULL << 20,
                     .params = 64ULL << 20,
                     .iters = 20,
                     .warmup = 2,
                     .min_size = 4096,
                     .max_size = 64ULL << 20,
                     .ranks_per_node = 1};
    const char *what = NULL, *backend = "cuda";
    uint32_t block = 256;
    bool size_set = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--json") == 0) {
            o.json = true;
        } else if (strcmp(a, "--copy-push") == 0) {
            o.copy_push = true;
        } else if (strcmp(a, "--optimizer") == 0 && v) {
            const char *name = argv[++i];
            if (strcmp(name, "adamw") != 0 && strcmp(name, "sgd") != 0) {
                fprintf(stderr, "shard-bench: --optimizer is adamw or sgd, not '%s'\n", name);
                return 2;
            }
            o.sgd = strcmp(name, "sgd") == 0;
        } else if (strcmp(a, "--socket") == 0 && v) {
            o.socket = argv[++i];
        } else if (strcmp(a, "--size") == 0 && v) {
            o.size = strtoull(argv[++i], NULL, 0);
            size_set = true;
        } else if (strcmp(a, "--backend") == 0 && v) {
            backend = argv[++i];
        } else if (strcmp(a, "--params") == 0 && v) {
            o.params = strtoull(argv[++i], NULL, 0);
        } else if (strcmp(a, "--iters") == 0 && v) {
            o.iters = atoi(argv[++i]);
        } else if (strcmp(a, "--warmup") == 0 && v) {
            o.warmup = atoi(argv[++i]);
        } else if (strcmp(a, "--sockets") == 0 && v) {
            o.sockets = argv[++i];
        } else if (strcmp(a, "--ranks-per-node") == 0 && v) {
            o.ranks_per_node = atoi(argv[++i]);
        } else if (strcmp(a, "--min") == 0 && v) {
            o.min_size = strtoull(argv[++i], NULL, 0);
        } else if (strcmp(a, "--max") == 0 && v) {
            o.max_size = strtoull(argv[++i], NULL, 0);
        } else if (strcmp(a, "--block") == 0 && v) {
            block = (uint32_t)strtoul(argv[++i], NULL, 0);
        } else if (a[0] != '-' && what == NULL) {
            what = a;
        } else {
            fprintf(stderr, "shard-bench: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (what == NULL || o.iters < 1 || o.size < 4096 || o.params < 1024) {
        usage(stderr);
        return 2;
    }
    if (strcmp(what, "codec") == 0) {
        if (block < SD_CODEC_MIN_BLOCK || block > SD_CODEC_MAX_BLOCK) {
            fprintf(stderr, "shard-bench: --block must be %d..%d\n", SD_CODEC_MIN_BLOCK,
                    SD_CODEC_MAX_BLOCK);
            return 2;
        }
        return bench_codec(&o, block);
    }
    if (strcmp(what, "kernels") == 0)
        return sd_bench_kernels(backend, size_set ? o.size : 256ULL << 20, o.params, o.iters,
                                o.json);
    if (strcmp(what, "allgather") == 0)
        return bench_coll(&o, COLL_AG, what);
    if (strcmp(what, "reducescatter") == 0)
        return bench_coll(&o, COLL_RS, what);
    if (strcmp(what, "allreduce") == 0)
        return bench_coll(&o, COLL_AR, what);
    if (!o.json)
        printf("%-18s %12s %14s %-26s %14s %8s\n", "# name", "size_bytes", "time_us", "baseline",
               "baseline_us", "ratio");
    int rc = 0;
    bool all = strcmp(what, "all") == 0;
    if (all || strcmp(what, "fetch") == 0)
        rc |= bench_fetch(&o);
    if (all || strcmp(what, "step") == 0)
        rc |= bench_step(&o);
    if (!all && strcmp(what, "fetch") != 0 && strcmp(what, "step") != 0) {
        fprintf(stderr,
                "shard-bench: unknown benchmark '%s' (fetch, step, all, allgather, "
                "reducescatter, allreduce)\n",
                what);
        return 2;
    }
    return rc;
}

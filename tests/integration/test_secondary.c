/* The secondary partition (,sec=S) against stale copies, with real daemons and real clients.
 *
 * DeepSpeed's hpZ had a run of bugs from secondary copies used after the weights changed (wrong
 * convergence, loss 0, stale after a checkpoint load). Here two nodes of one rank run the same
 * calls on two jobs side by side, one with zero3,sec=1 (each node keeps a whole secondary copy)
 * and one with plain zero3, each with a gather pool of one unit so that every fetch of another
 * unit evicts the last:
 *   1. forward: fetch unit 0 (fills the secondary copy), then unit 1 (evicts unit 0);
 *   2. push gradients and step between that forward and the next use of unit 0;
 *   3. fetch unit 0 again: it must be gathered anew (the secondary holds the old generation),
 *      equal bitwise to the plain job's, and differ from step 1's;
 *   4. reload: drop the copy and fetch it once more: now served from the secondary copy of the
 *      new generation, equal bitwise;
 *   5. a second step, and unit 1 fetched after it: again the new weights, never the old copy.
 * The daemons' counters then show exactly one fetch served from the secondary copy (step 4), no
 * inter-node bytes for it, and one refill per unit and generation gathered. */
#include "harness.h"
#include "shard.h"
#include "shard_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define N_A 1000 /* unit 0: "a" [N_A]; unit 1: "b" [40, 25] */

static struct th_cluster cl;
static struct th_daemon one;       /* a daemon alone: both ranks of a job on one node */
static uint64_t pool_bytes = 4096; /* one unit: a fetch evicts the last one */

struct job {
    shard_ctx_t *ctx;
    uint64_t da[1], db[2];
    shard_tensor_t t[2];
    float init_a[N_A], init_b[1000];
    const float *init[2];
    shard_unit_info_t ui[2];
};

static int job_open(struct job *j, const char *sock, const char *name, const char *plan,
                    uint32_t rank)
{
    memset(j, 0, sizeof(*j));
    j->da[0] = N_A;
    j->db[0] = 40;
    j->db[1] = 25;
    j->t[0] = (shard_tensor_t){.name = "a", .ndim = 1, .dims = j->da, .dtype = SHARD_FP32};
    j->t[1] =
        (shard_tensor_t){.name = "b", .ndim = 2, .dims = j->db, .dtype = SHARD_FP32, .unit = 1};
    for (int i = 0; i < N_A; i++)
        j->init_a[i] = sinf((float)i * 0.37f);
    for (int i = 0; i < 1000; i++)
        j->init_b[i] = cosf((float)i * 0.11f);
    j->init[0] = j->init_a;
    j->init[1] = j->init_b;
    shard_model_t m = {.job = name,
                       .rank = rank,
                       .world = 2,
                       .plan = plan,
                       .tensors = j->t,
                       .n_tensors = 2,
                       .optimizer = {.name = "adamw",
                                     .lr = 0.01f,
                                     .beta1 = 0.9f,
                                     .beta2 = 0.999f,
                                     .eps = 1e-8f,
                                     .weight_decay = 0.1f},
                       .init = j->init,
                       .max_live_bytes = pool_bytes};
    int st = shard_attach(sock, &j->ctx);
    if (st == SHARD_OK)
        st = shard_register(j->ctx, &m);
    for (uint32_t u = 0; st == SHARD_OK && u < 2; u++)
        st = shard_unit_info(j->ctx, u, &j->ui[u]);
    if (st != SHARD_OK)
        fprintf(stderr, "rank %u %s: %s: %s\n", rank, name, shard_strerror(st),
                shard_last_error(j->ctx));
    return st;
}

/* fetch unit u into out (a copy), release it */
static int fetch_copy(struct job *j, uint32_t u, float *out)
{
    const void *p;
    int st = shard_fetch(j->ctx, u, &p);
    if (st != SHARD_OK)
        return st;
    st = shard_copy(j->ctx, out, p, j->ui[u].bytes); /* host or a device's memory */
    int rst = shard_release(j->ctx, u);
    return st != SHARD_OK ? st : rst;
}

static int push_and_step(struct job *j, uint32_t rank, int step)
{
    float g[1024];
    for (int u = 1; u >= 0; u--) {
        uint64_t n = j->ui[u].numel;
        for (uint64_t i = 0; i < n; i++)
            g[i] = sinf((float)(i + 1) * 0.01f * (float)(rank + 1) + (float)step);
        int st = shard_push_grad(j->ctx, (uint32_t)u, g, j->ui[u].bytes);
        if (st != SHARD_OK)
            return st;
    }
    return shard_step(j->ctx, NULL);
}

#define EXPECT(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank %u: ", rank);                                                    \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

#define CALL(call)                                                                                 \
    do {                                                                                           \
        int st_ = (call);                                                                          \
        EXPECT(st_ == SHARD_OK, "%s: %s", #call, shard_strerror(st_));                             \
    } while (0)

static int rank_main(uint32_t rank)
{
    struct job sec, plain;
    const char *sock = cl.d[rank].sock;
    if (job_open(&sec, sock, "sec", "zero3,sec=1", rank) != SHARD_OK ||
        job_open(&plain, sock, "plain", "zero3", rank) != SHARD_OK)
        return 1;
    static float a0[1024], a0p[1024], a1[1024], a1p[1024], b1[1024], b1p[1024];
    size_t bytes0 = sec.ui[0].bytes, bytes1 = sec.ui[1].bytes;
    /* 1. the forward: unit 0, then unit 1 evicts it */
    CALL(fetch_copy(&sec, 0, a0));
    CALL(fetch_copy(&plain, 0, a0p));
    CALL(fetch_copy(&sec, 1, b1));
    CALL(fetch_copy(&plain, 1, b1p));
    EXPECT(memcmp(a0, a0p, bytes0) == 0, "unit 0 differs before any step");
    EXPECT(memcmp(a0, sec.init_a, N_A * sizeof(float)) == 0, "unit 0 is not the initial values");
    /* 2. a step between the forward and the next use */
    CALL(push_and_step(&sec, rank, 1));
    CALL(push_and_step(&plain, rank, 1));
    /* 3. unit 0 again: the new weights, not the secondary copy of the old ones */
    CALL(fetch_copy(&sec, 0, a1));
    CALL(fetch_copy(&plain, 0, a1p));
    EXPECT(memcmp(a1, a1p, bytes0) == 0, "unit 0 after the step differs from plain zero3's");
    EXPECT(memcmp(a1, a0, bytes0) != 0, "unit 0 did not change in the step");
    /* 4. reload: dropped, fetched again, from the secondary copy of the new generation */
    CALL(shard__drop(sec.ctx, 0));
    CALL(fetch_copy(&sec, 0, a0));
    EXPECT(memcmp(a0, a1p, bytes0) == 0, "unit 0 reloaded from the secondary copy differs");
    /* 5. another step, then unit 1, last fetched two generations ago */
    CALL(shard__drop(plain.ctx, 0));
    CALL(fetch_copy(&plain, 0, a0p));
    CALL(push_and_step(&sec, rank, 2));
    CALL(push_and_step(&plain, rank, 2));
    CALL(fetch_copy(&sec, 1, a0));
    CALL(fetch_copy(&plain, 1, a0p));
    EXPECT(memcmp(a0, a0p, bytes1) == 0, "unit 1 after the second step differs from plain's");
    EXPECT(memcmp(a0, b1, bytes1) != 0, "unit 1 did not change");
    shard_detach(sec.ctx);
    shard_detach(plain.ctx);
    return 0;
}

/* A unit held across the step on one node is gathered anew by the step itself (refresh_held):
 * from this step's weights, never from the secondary copy or the int8 encodings of the last
 * generation, which the refresh found still labelled current (the step declares the new
 * generation only once its kernels ran) and loaded: the holder read the old weights as the new
 * ones. A GPU trainer holds most units across the step (its releases wait for its stream), so
 * zeropp on a GPU trained one step behind on them. Both ranks on one daemon: the held job's
 * unit 0 after the step must equal bitwise the same job's fetched anew. */
static int rank_held(uint32_t rank, const char *plan)
{
    struct job held, fresh;
    char hn[64], fn[64];
    snprintf(hn, sizeof(hn), "held-%s", plan);
    snprintf(fn, sizeof(fn), "fresh-%s", plan);
    const char *sock = one.sock;
    pool_bytes = 0; /* the daemon's: room for both units */
    if (job_open(&held, sock, hn, plan, rank) != SHARD_OK ||
        job_open(&fresh, sock, fn, plan, rank) != SHARD_OK)
        return 1;
    static float before[1024], h[1024], f[1024], b[1024];
    size_t bytes0 = held.ui[0].bytes;
    for (int step = 1; step <= 2; step++) {
        const void *p;
        CALL(shard_fetch(held.ctx, 0, &p)); /* held across the step */
        CALL(shard_copy(held.ctx, before, p, bytes0));
        CALL(fetch_copy(&held, 1, b));
        CALL(fetch_copy(&fresh, 0, f));
        CALL(fetch_copy(&fresh, 1, b));
        CALL(push_and_step(&held, rank, step));
        CALL(push_and_step(&fresh, rank, step));
        CALL(shard_copy(held.ctx, h, p, bytes0));
        CALL(shard_release(held.ctx, 0));
        CALL(fetch_copy(&fresh, 0, f));
        EXPECT(memcmp(h, before, bytes0) != 0,
               "%s step %d: the unit held across the step still has the old weights", plan, step);
        EXPECT(memcmp(h, f, bytes0) == 0,
               "%s step %d: the unit held across the step differs from the one fetched after it",
               plan, step);
    }
    shard_detach(held.ctx);
    shard_detach(fresh.ctx);
    return 0;
}

int main(void)
{
    const char *extra[] = {"--prefetch-depth", "0", "--op-timeout-ms", "20000", NULL};
    if (th_cluster_start(&cl, 2, 1, extra) != 0) {
        fprintf(stderr, "cannot start a cluster of 2 nodes\n");
        return 1;
    }
    pid_t pids[2];
    for (uint32_t r = 0; r < 2; r++) {
        pids[r] = fork();
        if (pids[r] == 0)
            _exit(rank_main(r));
    }
    for (int r = 0; r < 2; r++) {
        int rc = th_wait(pids[r], 60000);
        TH_CHECK(rc == 0, "rank %d exited with %d", r, rc);
    }
    for (int node = 0; node < 2; node++) {
        json_t *s = th_job_stats(cl.d[node].sock, "sec");
        json_t *p = th_job_stats(cl.d[node].sock, "plain");
        TH_CHECK(s != NULL && p != NULL, "node %d: stats of both jobs", node);
        if (s == NULL || p == NULL) {
            json_decref(s);
            json_decref(p);
            continue;
        }
        /* loads: only the reload of step 4; refills: units 0 and 1 of generations 0 and 1
         * (the schedule frozen after step 1 gathers unit 1 when unit 0 is released, before the
         * reload departs from it) and unit 1 of generation 2 */
        TH_CHECK(th_json_int(s, "secondary.loads") == 1, "node %d: %lld fetches from the secondary",
                 node, th_json_int(s, "secondary.loads"));
        TH_CHECK(th_json_int(s, "secondary.stores") == 5, "node %d: %lld refills", node,
                 th_json_int(s, "secondary.stores"));
        /* the plain job gathered across nodes once more than the secondary one: the reload */
        long long sb = th_json_int(s, "ops.fetch.bytes.inter_node_recv");
        long long pb = th_json_int(p, "ops.fetch.bytes.inter_node_recv");
        TH_CHECK(sb > 0 && pb > sb, "node %d: inter-node fetch bytes %lld with sec, %lld without",
                 node, sb, pb);
        TH_CHECK(th_json_int(s, "gathers") == th_json_int(p, "gathers"),
                 "node %d: %lld gathers with sec, %lld without (the same fetches)", node,
                 th_json_int(s, "gathers"), th_json_int(p, "gathers"));
        TH_CHECK(th_json_int(s, "errors") == 0 && th_json_int(p, "errors") == 0, "node %d: errors",
                 node);
        json_decref(s);
        json_decref(p);
    }
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");

    /* units held across the step, both ranks on one node: with the secondary copy (f 2 > sec
     * 1), with int8 weights, and both */
    const char *plans[] = {"zero3,sec=1", "zero3,qw", "zeropp,sec=1"};
    if (th_daemon_start(&one, extra) != 0) {
        fprintf(stderr, "cannot start a daemon\n");
        return 1;
    }
    for (size_t i = 0; i < sizeof(plans) / sizeof(plans[0]); i++) {
        for (uint32_t r = 0; r < 2; r++) {
            pids[r] = fork();
            if (pids[r] == 0)
                _exit(rank_held(r, plans[i]));
        }
        for (int r = 0; r < 2; r++) {
            int rc = th_wait(pids[r], 60000);
            TH_CHECK(rc == 0, "%s held across the step: rank %d exited with %d", plans[i], r, rc);
        }
    }
    TH_CHECK(th_daemon_alive(&one) && th_daemon_stop(&one) == 0,
             "the daemon did not shut down cleanly");
    return th_summary("test_secondary");
}

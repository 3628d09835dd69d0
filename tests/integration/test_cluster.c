/* Several real daemons over libfabric (tcp;ofi_rxm on loopback), real trainer processes:
 *
 * Fidelity: every plan, with and without the hierarchical gather and the 2-hop sync, ends with
 * the parameters of plain data parallelism (mlp_train --reference) within |a-b| <= 1e-5 + 1e-5|b|
 * (the reduction is hierarchical, (g0+g1)+(g2+g3), so not bitwise; see test_fidelity.c for why
 * AdamW needs that bound).
 *
 * Volume: the inter-node bytes every daemon counted equal the formulas, with S the padded
 * parameter bytes (fp32), p the shard factor, k ranks per node, N nodes, G = p / k nodes per
 * partition group, T steps, s micro-steps per step:
 *   init   node 0 sends (N - 1) S, every other node receives S
 *   fetch  a hierarchical gather receives (p - k) / p S per node; without the hierarchy every
 *          rank gathers for itself, k times that per node; a gather runs once per step (the
 *          backward pass finds the unit cached) plus once for rank 0's final dump on node 0
 *   push   the reduce-scatter sends and receives (p - k) / p S per node every micro-step
 *   step   the 2-hop all-reduce across the R = N / G replication nodes sends 2 (R - 1) / R of the
 *          node's block (S / G) once per step, not per micro-step, plus 32 (N - 1) bytes of norm
 *          and schedule digest;
 *          without 2-hop that all-reduce moves into every micro-step's push.
 *
 * Order: several micro-steps of one unit reduce across nodes at once (push_rounds), and the g
 * shards still receive them in micro-step order, which floating point can tell apart; a push
 * push_rounds micro-steps ahead waits for the oldest round. (Rounds of one unit that start in
 * order also finish in order here, so this shows the sums stay exact with rounds in flight; it
 * cannot force a later round to finish first.)
 *
 * The ranks' promise of their last micro-step (shard_last_micro_step, mlp_train --mark-last):
 * under mics:2 and topo-fp (the g group inside the node, the boundary hop across nodes; topo-fp's
 * a reduce-scatter to the optimizer owners) each unit's hop goes during the backward; the
 * parameters are bitwise those of the same run without the promise and the bytes across nodes the
 * same; a rank that pushes after it fails the job, naming it.
 *
 * Transport variants (argv[3]): the same test with rendezvous_bytes (every message above 4 KiB
 * waits for its receiver's clear-to-send), the same with 128 posts per endpoint, 64 KiB chunks
 * and 3 data lanes (queue_depth: the pending queues, the credit and the deferred clear-to-sends
 * all at work, on every lane), and on the shm provider without CMA, with 2 data lanes. Backend
 * variants: host-deferred (kernels run only when waited for), emu-device (the device paths,
 * on host memory), emu-gpu (device memory the host cannot touch: transfers staged) and
 * emu-gpu-deferred (the same, every new ticket "not yet" at first: the polled waits taken), and
 * hmem (emu-device's memory on shm, which reaches it itself: FI_HMEM registration, nothing
 * staged; emu-device on tcp stages it). */
#include "harness.h"
#include "shard.h"

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <rdma/fabric.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

static struct th_cluster cl;
static int N, K;
static bool staged; /* emu-gpu: device memory crosses nodes through pinned buffers */

static long long staging_bytes(int node)
{
    json_t *st = th_admin_json(cl.d[node].sock, "status");
    long long b = th_json_int(st, "transport.staging_bytes");
    json_decref(st);
    return b;
}

/* the job's bytes across nodes, every operation, sent and received */
static long long inter_node_bytes(json_t *st)
{
    long long sum = 0;
    const char *op;
    json_t *v;
    json_object_foreach(json_object_get(st, "ops"), op, v)
    {
        json_t *b = json_object_get(v, "bytes");
        sum += json_integer_value(json_object_get(b, "inter_node_sent")) +
               json_integer_value(json_object_get(b, "inter_node_recv"));
    }
    return sum;
}

struct run {
    const char *plan;
    int accum;
};

static void run_one(const struct run *r, int idx)
{
    const int W = N * K, T = 6;
    char job[64], accum[16], world[16], steps[16];
    snprintf(job, sizeof(job), "c%d-%d", N, idx);
    snprintf(accum, sizeof(accum), "%d", r->accum);
    snprintf(world, sizeof(world), "%d", W);
    snprintf(steps, sizeof(steps), "%d", T);
    const char *args[] = {"--world", world, "--steps",  steps, "--accum", accum, "--plan", r->plan,
                          "--seed",  "3",   "--hidden", "256", "--quiet", NULL};
    double t0 = th_now_s();
    struct th_dump_diff dd;
    long long staged0[TH_MAX_NODES];
    for (int node = 0; node < N; node++)
        staged0[node] = staging_bytes(node);
    if (!th_cluster_train(&cl, job, args, r->plan, 1e-5, &dd))
        return;
    TH_CHECK(dd.outside == 0, "%s accum %d: %zu parameters outside the tolerance (max %g)", r->plan,
             r->accum, dd.outside, dd.maxd);

    /* bytes against the formulas */
    long long S = th_job_params(cl.d[0].sock, job) * 4;
    int p = strncmp(r->plan, "ddp", 3) == 0     ? 1
            : strncmp(r->plan, "zero3", 5) == 0 ? W
                                                : atoi(r->plan + 5);
    bool hier = strstr(r->plan, "no-hier") == NULL, two_hop = strstr(r->plan, "no-2hop") == NULL;
    int G = p > K ? p / K : 1, R = N / G, s = r->accum;
    long long block = S / G;
    for (int node = 0; node < N; node++) {
        json_t *st = th_job_stats(cl.d[node].sock, job);
        TH_CHECK(st != NULL, "node %d has no stats for %s", node, job);
        if (st == NULL)
            continue;
        /* node 0 sends each node the shards of its ranks: K of p, or all when p < K */
        long long init_node = p >= K ? S / p * K : S;
        long long init_sent = node == 0 ? (long long)(N - 1) * init_node : 0;
        long long init_recv = node == 0 ? 0 : init_node;
        int dumps = node == 0 ? 1 : 0;
        long long gathers = G > 1 ? (hier ? T + dumps : (long long)K * T + dumps) : 0;
        long long fetch_recv = gathers * (G - 1) * block;
        long long push = (long long)T * s * (G - 1) * block;
        long long ar_count = G > 1 ? block : S;
        long long ar = R > 1 ? 2LL * (R - 1) * ar_count / R : 0;
        if (!two_hop)
            push += (long long)T * s * ar;
        long long step = (long long)T * ((two_hop ? ar : 0) + 32LL * (N - 1));
        long long got[5] = {th_json_int(st, "ops.init.bytes.inter_node_sent"),
                            th_json_int(st, "ops.init.bytes.inter_node_recv"),
                            th_json_int(st, "ops.fetch.bytes.inter_node_recv"),
                            th_json_int(st, "ops.push.bytes.inter_node_sent"),
                            th_json_int(st, "ops.step.bytes.inter_node_sent")};
        long long want[5] = {init_sent, init_recv, fetch_recv, push, step};
        static const char *const what[5] = {"init sent", "init received", "fetch received",
                                            "push sent", "step sent"};
        for (int i = 0; i < 5; i++)
            TH_CHECK(got[i] == want[i], "%s accum %d node %d: %s %lld bytes, formula %lld (S %lld)",
                     r->plan, r->accum, node, what[i], got[i], want[i], S);
        TH_CHECK(th_json_int(st, "ops.push.bytes.inter_node_recv") == push,
                 "%s node %d: push received %lld, formula %lld", r->plan, node,
                 th_json_int(st, "ops.push.bytes.inter_node_recv"), push);
        TH_CHECK(th_json_int(st, "allocations_since_register") == 0,
                 "allocations after registration");
        /* staged: every byte of device memory that crossed nodes, both ways; not the step's
         * norm exchange (32 bytes to and from each other node a step, host memory). Host
         * memory stages nothing. */
        long long staged_want = staged ? inter_node_bytes(st) - 2LL * T * 32 * (N - 1) : 0;
        long long staged_got = staging_bytes(node) - staged0[node];
        TH_CHECK(staged_got == staged_want, "%s accum %d node %d: staged %lld bytes, expected %lld",
                 r->plan, r->accum, node, staged_got, staged_want);
        const char *sched = json_string_value(json_object_get(st, "schedule"));
        TH_CHECK(sched && strcmp(sched, "frozen") == 0 &&
                     th_json_int(st, "schedule_invalidations") == 0,
                 "%s node %d: schedule %s", r->plan, node, sched ? sched : "?");
        json_decref(st);
    }
    printf("%dx%d %-22s accum %d: %zu params, %zu differ (max %.3g), S %lld B, %.2f s\n", N, K,
           r->plan, r->accum, dd.n, dd.differ, dd.maxd, S, th_now_s() - t0);
}

static void test_mark_last(const char *plan, bool broken)
{
    char world[16], a[64], b[64], c[64];
    snprintf(world, sizeof(world), "%d", N * K);
    snprintf(a, sizeof(a), "ml%d-plain-%s", N, plan);
    snprintf(b, sizeof(b), "ml%d-marked-%s", N, plan);
    snprintf(c, sizeof(c), "ml%d-broken", N);
    const char *plain[] = {"--world", world, "--steps",  "5",   "--accum", "3", "--plan", plan,
                           "--seed",  "4",   "--hidden", "256", "--quiet", NULL};
    const char *marked[] = {"--world",  world,    "--steps", "5",           "--accum",
                            "3",        "--plan", plan,      "--seed",      "4",
                            "--hidden", "256",    "--quiet", "--mark-last", NULL};
    struct th_dump_diff dd;
    if (!th_cluster_train(&cl, a, plain, plan, 1e-5, &dd) ||
        !th_cluster_train(&cl, b, marked, plan, 1e-5, &dd))
        return;
    TH_CHECK(dd.outside == 0, "%s --mark-last: %zu parameters outside the tolerance (max %g)", plan,
             dd.outside, dd.maxd);
    char da[400], db[400];
    snprintf(da, sizeof(da), "%s/%s.bin", cl.d[0].dir, a);
    snprintf(db, sizeof(db), "%s/%s.bin", cl.d[0].dir, b);
    TH_CHECK(th_compare_dumps(da, db, 0, &dd) && dd.differ == 0,
             "%s with and without --mark-last: %zu of %zu parameters differ (max %g)", plan,
             dd.differ, dd.n, dd.maxd);
    long long early_total = 0;
    for (int node = 0; node < N; node++) {
        json_t *sa = th_job_stats(cl.d[node].sock, a), *sb = th_job_stats(cl.d[node].sock, b);
        TH_CHECK(sa && sb, "node %d has the stats of both runs", node);
        if (sa == NULL || sb == NULL) {
            json_decref(sa);
            json_decref(sb);
            continue;
        }
        long long units = th_json_int(sb, "units"), early = th_json_int(sb, "boundary_hops_early");
        TH_CHECK(th_json_int(sa, "boundary_hops_early") == 0 && early >= 1 && early <= 5 * units,
                 "node %d: %lld units' hops went during the backward with --mark-last (of %lld), "
                 "%lld without",
                 node, early, 5 * units, th_json_int(sa, "boundary_hops_early"));
        early_total += early;
        TH_CHECK(th_json_int(sa, "ops.step.bytes.inter_node_sent") ==
                     th_json_int(sb, "ops.step.bytes.inter_node_sent"),
                 "node %d: the step sent %lld bytes across nodes without the promise, %lld with",
                 node, th_json_int(sa, "ops.step.bytes.inter_node_sent"),
                 th_json_int(sb, "ops.step.bytes.inter_node_sent"));
        json_decref(sa);
        json_decref(sb);
    }
    printf("%dx%d %s --mark-last: bitwise the unmarked run's; %lld units' boundary hops went "
           "during the backward\n",
           N, K, plan, early_total);
    if (!broken)
        return;
    /* the promise broken: marked from the second-last micro-step of three */
    const char *more[] = {"--mark-last-from", "2", NULL};
    pid_t pids[TH_MAX_RANKS];
    int failed = 0;
    for (int r = 0; r < N * K; r++) {
        char log[400];
        snprintf(log, sizeof(log), "%s/%s-%d.log", cl.d[0].dir, c, r);
        pids[r] = th_spawn_rank(cl.d[r / K].sock, c, r, plain, more, log);
    }
    for (int r = 0; r < N * K; r++)
        failed += th_wait(pids[r], 60000) != 0;
    char log0[400];
    snprintf(log0, sizeof(log0), "%s/%s-0.log", cl.d[0].dir, c);
    char *t = th_read_file(log0, NULL);
    TH_CHECK(failed == N * K && t && strstr(t, "shard_last_micro_step"),
             "a push after the marked last micro-step: %d of %d ranks failed, rank 0's log:\n%s",
             failed, N * K, t ? t : "(none)");
    free(t);
}

/* shard-bench's three collectives across the daemons, sizes that split unevenly into chunks:
 * every element must equal the exact expected value (its #wrong column, and its exit code) */
static void bench_collectives(void)
{
    char socks[1024] = "";
    for (int i = 0; i < N; i++)
        snprintf(socks + strlen(socks), sizeof(socks) - strlen(socks), "%s%s", i ? "," : "",
                 cl.d[i].sock);
    char kstr[16];
    snprintf(kstr, sizeof(kstr), "%d", K);
    const char *ops[] = {"allgather", "reducescatter", "allreduce"};
    for (int i = 0; i < 3; i++) {
        char out[512];
        snprintf(out, sizeof(out), "%s/bench-%s.out", cl.d[0].dir, ops[i]);
        const char *argv[] = {
            SHARD_BENCH_PATH, ops[i], "--sockets", socks,     "--ranks-per-node", kstr,
            "--min",          "4096", "--max",     "4194304", "--iters",          "3",
            "--json",         NULL};
        int rc = th_wait(th_spawn(argv, out), 120000);
        char *txt = th_read_file(out, NULL);
        int rows = 0, bad = 0;
        for (const char *p = txt; p && (p = strstr(p, "\"wrong\": ")) != NULL; p++) {
            rows++;
            bad += atoll(p + 10) != 0;
        }
        TH_CHECK(rc == 0 && rows == 11 && bad == 0,
                 "shard-bench %s: exit %d, %d sizes, %d with wrong elements: %s", ops[i], rc, rows,
                 bad, txt ? txt : "(no output)");
        free(txt);
    }
}

/* Every rank pushes 1e8, 1, -1e8 and 1 into one unit, back to back, so that the daemons have
 * several reductions of it on the wire at once (and, with push_rounds 3, the fourth push waits
 * for the first round). Added to the gradient in micro-step order, 1e8 W + W rounds to 1e8 W
 * (W a power of two below 32) and the sum is exactly W; other orders give 0 or 2 W. SGD with
 * lr 1 on the mean gradient W / W then leaves every weight at exactly -1. Under "ddp,no-2hop"
 * with one rank per node each round's all-reduce adds into the gradient itself, so the rounds
 * of the unit must run one at a time. */
struct order_rank {
    const char *plan;
    int rank;
    int st;
    char err[256];
    float w0, w_last;
};

#define ORDER_NUMEL (4u << 20) /* 16 MiB: each round outlasts the next push */

static void *order_thread(void *arg)
{
    struct order_rank *o = arg;
    uint64_t dims[1] = {ORDER_NUMEL};
    shard_tensor_t t = {.name = "x", .ndim = 1, .dims = dims, .dtype = SHARD_FP32, .unit = 0};
    shard_model_t m = {.job = o->plan,
                       .rank = (uint32_t)o->rank,
                       .world = (uint32_t)(N * K),
                       .plan = o->plan,
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 1.0f}};
    shard_ctx_t *c = NULL;
    float *g = malloc(ORDER_NUMEL * sizeof(float));
    o->st = g ? shard_attach(cl.d[o->rank / K].sock, &c) : -1;
    if (o->st == 0)
        o->st = shard_register(c, &m);
    static const float v[4] = {1e8f, 1.0f, -1e8f, 1.0f};
    for (int i = 0; i < 4 && o->st == 0; i++) {
        for (uint32_t e = 0; e < ORDER_NUMEL; e++)
            g[e] = v[i];
        o->st = shard_push_grad(c, 0, g, ORDER_NUMEL * sizeof(float));
    }
    double norm;
    const void *p = NULL;
    if (o->st == 0)
        o->st = shard_step(c, &norm);
    if (o->st == 0)
        o->st = shard_fetch(c, 0, &p);
    if (o->st == 0) { /* read as a device trainer must (shard_copy works on host memory too) */
        float first, last;
        o->st = shard_copy(c, &first, p, sizeof(first));
        if (o->st == 0)
            o->st = shard_copy(c, &last, (const float *)p + ORDER_NUMEL - 1, sizeof(last));
        o->w0 = first;
        o->w_last = last;
        shard_release(c, 0);
    }
    if (o->st != 0)
        snprintf(o->err, sizeof(o->err), "%s", c ? shard_last_error(c) : "out of memory");
    if (c)
        shard_detach(c);
    free(g);
    return NULL;
}

static void test_round_order(const char *plan, long long peak_min, long long peak_max)
{
    int W = N * K;
    struct order_rank o[TH_MAX_RANKS];
    pthread_t th[TH_MAX_RANKS];
    for (int r = 0; r < W; r++) {
        o[r] = (struct order_rank){.plan = plan, .rank = r};
        pthread_create(&th[r], NULL, order_thread, &o[r]);
    }
    for (int r = 0; r < W; r++)
        pthread_join(th[r], NULL);
    for (int r = 0; r < W; r++)
        TH_CHECK(o[r].st == 0 && o[r].w0 == -1.0f && o[r].w_last == -1.0f,
                 "%s rank %d: status %d (%s), weights %g ... %g after 1e8, 1, -1e8, 1 (expected "
                 "-1: the micro-steps were added out of order)",
                 plan, r, o[r].st, o[r].err, o[r].w0, o[r].w_last);
    for (int node = 0; node < N; node++) {
        json_t *st = th_job_stats(cl.d[node].sock, plan);
        long long peak = st ? th_json_int(st, "push_rounds_peak") : -1;
        TH_CHECK(peak >= peak_min && peak <= peak_max,
                 "%s node %d: %lld reductions in flight at most, expected %lld..%lld (push_rounds "
                 "3, 4 micro-steps pushed back to back)",
                 plan, node, peak, peak_min, peak_max);
        json_decref(st);
    }
    printf("%dx%d round order under %s: 4 micro-steps of 16 MiB, exact\n", N, K, plan);
}

/* Whether this host can run the shm provider's daemons: libfabric has it, and /dev/shm holds
 * their regions (a container's default 64 MiB does not). */
static bool shm_usable(char *why, size_t len)
{
    struct statvfs v;
    if (statvfs("/dev/shm", &v) != 0 ||
        (unsigned long long)v.f_bavail * v.f_frsize < (512ULL << 20)) {
        snprintf(why, len, "/dev/shm has less than 512 MiB free");
        return false;
    }
    struct fi_info *hints = fi_allocinfo(), *info = NULL;
    if (hints == NULL)
        return false;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED;
    hints->fabric_attr->prov_name = strdup("shm");
    int r = fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    fi_freeinfo(info);
    if (r != 0)
        snprintf(why, len, "libfabric has no shm provider: %s", fi_strerror(-r));
    return r == 0;
}

/* The transport's counters (shardctl status): every data lane carried sends; every
 * clear-to-send a node received released exactly one of its sends, either parked before it came
 * or finding it on arrival, and the cluster received every one that was sent. Without rendezvous
 * there are none. With small queues, posts waited for room and clear-to-sends for credit. */
static void check_transport(long long want_bytes, bool small_queues, int lanes)
{
    long long sent = 0, received = 0, queued = 0, deferred = 0;
    for (int node = 0; node < N; node++) {
        json_t *st = th_admin_json(cl.d[node].sock, "status");
        /* the chunks of a transfer spread over the data lanes: each carried some */
        json_t *ls = json_object_get(json_object_get(st, "transport"), "data_lane_sends");
        TH_CHECK(json_is_array(ls) && (int)json_array_size(ls) == lanes,
                 "node %d: data_lane_sends should list %d lanes", node, lanes);
        for (size_t l = 0; json_is_array(ls) && l < json_array_size(ls); l++)
            TH_CHECK(json_integer_value(json_array_get(ls, l)) > 0,
                     "node %d: data lane %zu of %d carried no send", node, l, lanes);
        long long b = th_json_int(st, "transport.rendezvous_bytes"),
                  s = th_json_int(st, "transport.clear_to_sends_sent"),
                  r = th_json_int(st, "transport.clear_to_sends_received"),
                  parked = th_json_int(st, "transport.sends_parked"),
                  cleared = th_json_int(st, "transport.sends_cleared_on_arrival");
        TH_CHECK(b == want_bytes, "node %d: rendezvous_bytes %lld, expected %lld", node, b,
                 want_bytes);
        if (want_bytes > 0)
            TH_CHECK(s > 0 && r > 0 && parked + cleared == r,
                     "node %d: %lld clear-to-sends sent, %lld received, %lld sends parked and %lld "
                     "cleared on arrival (expected parked + cleared = received > 0)",
                     node, s, r, parked, cleared);
        else
            TH_CHECK(s == 0 && r == 0 && parked == 0 && cleared == 0,
                     "node %d: rendezvous off, yet %lld clear-to-sends sent, %lld received", node,
                     s, r);
        sent += s;
        received += r;
        queued += th_json_int(st, "transport.posts_queued");
        deferred += th_json_int(st, "transport.clear_to_sends_deferred");
        if (node == 0)
            printf("%dx%d rendezvous above %lld bytes: node 0 sent %lld clear-to-sends, received "
                   "%lld (%lld sends parked, %lld cleared on arrival)\n",
                   N, K, b, s, r, parked, cleared);
        json_decref(st);
    }
    TH_CHECK(sent == received, "%lld clear-to-sends sent, %lld received", sent, received);
    if (small_queues) { /* the paths the small queues are there for were taken */
        TH_CHECK(queued > 0 && deferred > 0,
                 "small queues: %lld posts waited for room, %lld clear-to-sends for credit "
                 "(expected both > 0)",
                 queued, deferred);
        printf("%dx%d small queues: %lld posts waited for room, %lld clear-to-sends for credit\n",
               N, K, queued, deferred);
    }
}

int main(int argc, char **argv)
{
    N = argc > 1 ? atoi(argv[1]) : 2;
    K = argc > 2 ? atoi(argv[2]) : 2;
    /* the transport's variants, each through the whole test: "rendezvous" sends every message
     * above 4 KiB only once its receive is posted (on the default tcp provider); "shm-sar" runs
     * the daemons on the shm provider copying through bounce buffers, where libfabric < 1.19
     * needs that rendezvous */
    const char *variant = argc > 3 ? argv[3] : "";
    int lanes = 1;
    const char *extra[16] = {
        "--small-allreduce-bytes", "0", "--op-timeout-ms", "20000", "--push-rounds", "3", NULL};
    int ne = 6;
    if (strcmp(variant, "rendezvous") == 0 || strcmp(variant, "rendezvous-q128") == 0) {
        extra[ne++] = "--rendezvous-bytes";
        extra[ne++] = "4096";
        if (strcmp(variant, "rendezvous-q128") == 0) {
            /* 128 posts per endpoint and 64 KiB chunks: transfers wait in the pending queues,
             * 64 standing clear-to-send receives give each peer a credit of 21, and clear-to-sends
             * wait for it; a transfer's chunks go over 3 pairs of data endpoints */
            const char *q[] = {"--queue-depth", "128",          "--chunk-bytes",
                               "65536",         "--data-lanes", "3"};
            lanes = 3;
            for (size_t i = 0; i < sizeof(q) / sizeof(q[0]); i++)
                extra[ne++] = q[i];
        }
    } else if (strcmp(variant, "shm-sar") == 0) {
        char why[256];
        if (!shm_usable(why, sizeof(why))) {
            printf("test_cluster %s: skipped: %s\n", variant, why);
            return 77;
        }
        const char *shm[] = {"--provider", "shm", "--fabric-addr", "",
                             "--shm-cma",  "0",   "--data-lanes",  "2"};
        lanes = 2;
        for (size_t i = 0; i < sizeof(shm) / sizeof(shm[0]); i++)
            extra[ne++] = shm[i];
    } else if (strcmp(variant, "hmem") == 0) {
        /* device memory (emu-device's) on a provider that reaches it itself (shm's FI_HMEM,
         * as host memory): registered with FI_HMEM and sent in place, nothing staged */
        char why[256];
        if (!shm_usable(why, sizeof(why))) {
            printf("test_cluster %s: skipped: %s\n", variant, why);
            return 77;
        }
        const char *hm[] = {"--provider", "shm",        "--fabric-addr", "",
                            "--backend",  "emu-device", "--chunk-bytes", "4096"};
        for (size_t i = 0; i < sizeof(hm) / sizeof(hm[0]); i++)
            extra[ne++] = hm[i];
    } else if (strcmp(variant, "deferred") == 0) {
        /* kernels run only when a daemon waits for them, as on a GPU stream: every result a
         * daemon reads, sends or hands out without waiting is stale, and the checks fail */
        extra[ne++] = "--backend";
        extra[ne++] = "host-deferred";
    } else if (strcmp(variant, "device") == 0) {
        /* the daemon's device paths (device allocation on the loop, the device kernels through
         * the emulation), on host memory that the transport still reads directly */
        extra[ne++] = "--backend";
        extra[ne++] = "emu-device";
    } else if (strcmp(variant, "emu-gpu") == 0 || strcmp(variant, "emu-gpu-deferred") == 0) {
        /* device memory the host cannot touch: every transfer across nodes is staged through
         * pinned host buffers (transport/stage.c); -deferred: its queue answers every new
         * ticket "not yet" first, as a busy GPU's, so the staged copies, the rounds and the step
         * on device memory go on from the loop's poll, and each daemon drives two GPUs without
         * peer access (its ranks on GPU 0 and 1: copies between them staged, the staged
         * transfers from and to either) */
        extra[ne++] = "--backend";
        extra[ne++] = variant;
        if (strcmp(variant, "emu-gpu-deferred") == 0) {
            extra[ne++] = "--devices";
            extra[ne++] = "0,1";
            setenv("SHARDD_EMU_GPUS", "2", 1);
            setenv("SHARDD_EMU_PEERS", "none", 1);
        }
    } else if (variant[0] != '\0') {
        fprintf(stderr,
                "test_cluster: unknown variant '%s' (rendezvous, rendezvous-q128, shm-sar, "
                "deferred, device, emu-gpu, emu-gpu-deferred, hmem)\n",
                variant);
        return 2;
    }
    bool rendezvous = variant[0] != '\0' && strcmp(variant, "deferred") != 0 &&
                      strcmp(variant, "device") != 0 && strncmp(variant, "emu-gpu", 7) != 0 &&
                      strcmp(variant, "hmem") != 0;
    extra[ne] = NULL;
    if (th_cluster_start(&cl, N, K, extra) != 0) {
        fprintf(stderr, "cannot start a cluster of %d nodes\n", N);
        return 1;
    }
    /* the daemons' backend (the variant's, or SHARD_TEST_BACKEND's): device memory is staged */
    json_t *status = th_admin_json(cl.d[0].sock, "status");
    const char *backend =
        json_string_value(json_object_get(json_object_get(status, "config"), "backend"));
    /* device memory is staged unless the provider reaches it itself (FI_HMEM) */
    json_t *hm = json_object_get(json_object_get(status, "transport"), "hmem");
    bool device = backend != NULL &&
                  (strncmp(backend, "emu-gpu", 7) == 0 || strcmp(backend, "emu-device") == 0 ||
                   strcmp(backend, "cuda") == 0 || strcmp(backend, "hip") == 0);
    staged = device && !json_is_true(hm);
    TH_CHECK(backend != NULL && json_is_boolean(hm), "status names the backend and FI_HMEM");
    TH_CHECK(strcmp(variant, "hmem") != 0 || json_is_true(hm),
             "shm reaches emu-device's memory itself (FI_HMEM): nothing is staged");
    TH_CHECK(strncmp(variant, "emu-gpu", 7) != 0 || json_is_false(hm),
             "no provider reaches emu-gpu's memory: it is staged");
    json_decref(status);
    struct run runs2[] = {
        {"ddp", 1},        {"ddp", 4},    {"zero3", 1},          {"zero3", 4},
        {"mics:2", 2},     {"mics:4", 2}, {"mics:4,no-hier", 1}, {"mics:2,no-2hop", 2},
        {"ddp,no-2hop", 2}};
    struct run runs4[] = {{"ddp", 2},           {"zero3", 2},          {"mics:2", 2},
                          {"mics:4", 2},        {"mics:4,no-hier", 1}, {"mics:4,no-2hop", 2},
                          {"mics:2,no-2hop", 1}};
    /* one rank per node: the reduce-scatter sends straight from the rank's staging slot, and
     * without 2-hop the all-reduces add into the gradient shards themselves */
    struct run runs1[] = {
        {"zero3", 2}, {"mics:2", 2}, {"mics:2,no-2hop", 2}, {"ddp", 1}, {"ddp,no-2hop", 2}};
    struct run *runs = K == 1 ? runs1 : N == 4 ? runs4 : runs2;
    size_t nr = K == 1   ? sizeof(runs1) / sizeof(runs1[0])
                : N == 4 ? sizeof(runs4) / sizeof(runs4[0])
                         : sizeof(runs2) / sizeof(runs2[0]);
    for (size_t i = 0; i < nr && th_cluster_alive(&cl, runs[i].plan); i++)
        run_one(&runs[i], (int)i);
    if (!th_cluster_alive(&cl, "after the plans")) { /* a daemon crashed: what follows waits */
        th_cluster_stop(&cl);
        return th_summary("test_cluster");
    }
    test_round_order("zero3", 2, 3);
    if (K > 1) { /* a g group inside the node: mics:2's boundary hop crosses nodes, and
                  * topo-fp's reduce-scatters to the optimizer owners (f_os = world) */
        test_mark_last("mics:2", true);
        test_mark_last("topo-fp", false);
    }
    if (K == 1) /* the all-reduces add into the gradient: one round of the unit at a time */
        test_round_order("ddp,no-2hop", 1, 1);
    if (K == 1)
        bench_collectives();
    check_transport(rendezvous ? 4096 : 0, strcmp(variant, "rendezvous-q128") == 0, lanes);
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_cluster");
}

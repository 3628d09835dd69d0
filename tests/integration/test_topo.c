/* Per-state shard factors across real daemons (tcp;ofi_rxm on loopback), real trainer processes.
 * Usage: test_topo NODES RANKS_PER_NODE.
 *
 * Fidelity: each topo:W/G/OS plan (and the presets zero1, zero2 that are spellings of it) ends
 * with the parameters of plain data parallelism (mlp_train --reference): fp32 within
 * |a-b| <= 1e-5 + 1e-5|b| (see test_fidelity.c for why), bf16 weights within one bf16 ulp
 * (2^-7 relative).
 *
 * Volume: the inter-node bytes every daemon counted equal these formulas, written here from the
 * plan alone. S is the padded parameter count times 4 (fp32), S_w the same in the weights'
 * dtype; n = N k ranks; for each state X, G_X = f_X / k nodes per partition group when f_X > k,
 * else 1; R = N / G_g nodes hold the replicas of a node's g shards; T steps of s micro-steps:
 *   init   node 0 sends each node the cover of its ranks' w shards: k S / f_w if f_w >= k, else S
 *   fetch  a gather receives (G_w - 1) / G_w S_w per node, once per step (plus rank 0's final
 *          dump on node 0); a w group inside a node moves nothing across nodes
 *   push   every micro-step reduce-scatters (G_g - 1) / G_g S inside the g group: nothing when
 *          the g group is inside a node
 *   step   once per step: the boundary hop all-reduces the node's block B (S / G_g, or S when
 *          G_g = 1) across the R nodes, 2 (R - 1) / R B, each optimizer owner then reads its os
 *          part; where f_os = n it reduce-scatters B to the owners instead, (R - 1) / R B, and
 *          ends bitwise equal to the same plan with ,hop-ar (the all-reduce of the same packed
 *          block: each element summed in the same order); the weights' all-gather (f_w < f_os, f_os
 * > k) sends each of the node's k os parts (S_w / f_os each) to every node of the os group that
 * holds its w shard: G_os - 1 nodes when f_w <= k, else G_os / G_w - 1; 32 (N - 1) bytes of norm
 * and schedule digest. With an active secondary partition (,sec=S, f_w > S) and a gather pool too
 * small to keep a unit from forward to backward (--max-live-bytes), only the first gather of each
 * weights generation crosses nodes: the fetch formula above holds unchanged, and the run shows
 * gathers served from the secondary copy (without it the same run moves more).
 *
 * Inside each node the copies are counted by link class (stats.h): intra_package between ranks
 * of one package (the 2x4 cluster runs with packages of 2 ranks, the 4x2 one with packages of
 * 1, where only a rank's copies to itself are intra-package) and intra_node between packages.
 * want_intra() below enumerates them from the plan by the rules of DESIGN.md/README (a second
 * implementation of the daemon's counting): each gather copies the node's w-group members
 * into local rank 0's copy; a secondary refill copies it out to the S holders; a push round
 * across nodes sums each rank's gradient into the node partial at rank 0 and adds the result
 * into each g shard; one inside the node sends each member's shard to its holder; the hop packs
 * each g shard into rank 0's buffer and back (only its os part where the hop reduce-scatters);
 * the weights' parts other ranks own are copied into
 * each w shard from their owner, or from the first local holder that received them. */
#include "harness.h"
#include "sd/model.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static struct th_cluster cl;
static int N, K, PK; /* nodes, ranks per node, ranks per package */

struct run {
    const char *plan;
    uint32_t f[3]; /* what the plan means on this cluster, written out */
    int accum;
    const char *optimizer, *dtype;
    uint32_t sec;      /* the plan's ,sec=S (0: none) */
    bool small_pool;   /* a gather pool that cannot keep units from forward to backward */
    int twin;          /* 1 + the index of an earlier run this one must end bitwise equal to */
    const char *clip;  /* --max-grad-norm, or NULL */
    const char *scale; /* --loss-scale (shard_step_scaled), or NULL */
    bool gwire;        /* the plan's ,gwire=bf16 or fp16: gradients cross nodes in 2 bytes */
};

/* bytes copied inside one node, by operation (fetch, push, step) and link class */
struct intra {
    long long b[3][2];
};

static void cp(struct intra *w, int op, int a, int b, long long bytes)
{
    w->b[op][a / PK == b / PK ? 0 : 1] += bytes;
}

/* The boundary hop reduce-scatters where every element of a node's g block has its optimizer
 * state on exactly one replica node: f_os = the world (and exact: no ,qg, not ,hop-ar) */
static bool scatters(const struct run *r)
{
    return (int)r->f[2] == N * K && strstr(r->plan, "hop-ar") == NULL;
}

/* The copies inside node m over the run (see the top of the file). gp: primary gathers of
 * every unit (each copying the node's w-group members into rank 0's copy); the secondary's
 * loads are checked apart. */
static struct intra want_intra(const struct run *r, int m, int T, long long gp, long long Sw,
                               long long S)
{
    struct intra w = {0};
    int W = (int)r->f[0], G = (int)r->f[1], OS = (int)r->f[2], s = r->accum;
    int members = W >= K ? K : W;
    for (int j = 0; j < members; j++)
        cp(&w, 0, j, 0, gp * Sw / W);
    if (r->sec && W > (int)r->sec) /* a refill per generation gathered */
        for (int j = 0; j < (int)r->sec; j++)
            cp(&w, 0, 0, j, gp * Sw / r->sec);
    if (N > 1 && G > K) { /* push rounds across nodes */
        for (int j = 0; j < K; j++) {
            cp(&w, 1, j, 0, (long long)T * s * Sw);
            cp(&w, 1, 0, j, (long long)T * s * S / G);
        }
    } else {
        int f = G < K ? G : K;
        for (int h = 0; h < K; h++)
            for (int j = h - h % f; j < h - h % f + f; j++)
                cp(&w, 1, j, h, (long long)T * s * Sw / f);
    }
    int Gg = G > K ? G / K : 1;
    if (N / Gg > 1) /* the boundary hop: each g shard into rank 0's buffer and back (only its os
                     * part where the hop reduce-scatters) */
        for (int j = 0; j < K; j++) {
            cp(&w, 2, j, 0, (long long)T * S / G);
            cp(&w, 2, 0, j, (long long)T * S / (scatters(r) ? OS : G));
        }
    struct sd_plan plan = {.f = {r->f[0], r->f[1], r->f[2]}};
    int per = OS / W, os_pos[64];
    for (int i = 0; i < OS && i < 64; i++)
        os_pos[sd_plan_shard(&plan, SD_STATE_OS, (uint32_t)i)] = i;
    for (int j = 0; per > 1 && j < K; j++) {
        int rank = m * K + j, iw = rank % W;
        for (int e = 0; e < per; e++) {
            int p = iw * per + e, owner = rank - rank % OS + os_pos[p], from;
            if (owner == rank)
                continue;
            if (owner / K == m) {
                from = owner - m * K;
            } else { /* received into the first rank of node m holding w shard iw */
                int lo = W <= K ? 0 : (m * K) % W;
                from = W <= K ? iw : iw - lo;
                if (from < 0 || from >= K || from == j)
                    continue;
            }
            cp(&w, 2, from, j, (long long)T * Sw / OS);
        }
    }
    return w;
}

static long long nodes_of(uint32_t f)
{
    return f > (uint32_t)K ? f / K : 1;
}

static void run_one(const struct run *r, int idx)
{
    const int n = N * K, T = 4;
    char job[64], accum[16], world[16], steps[16];
    snprintf(job, sizeof(job), "t%d-%d", N, idx);
    snprintf(accum, sizeof(accum), "%d", r->accum);
    snprintf(world, sizeof(world), "%d", n);
    snprintf(steps, sizeof(steps), "%d", T);
    const char *args[] = {
        "--world", world, "--steps", steps, "--accum", accum, "--plan", r->plan, "--seed", "5",
        "--hidden", "128", "--optimizer", r->optimizer, "--dtype", r->dtype, "--quiet",
        /* two of the hidden layers' units: the forward's copies are evicted
         * before the backward needs them */
        r->small_pool ? "--max-live-bytes" : NULL,
        strcmp(r->dtype, "bf16") == 0 ? "70000" : "140000", NULL, NULL, NULL, NULL, NULL};
    size_t at = 0; /* in the place of --max-live-bytes or after it */
    while (args[at] != NULL)
        at++;
    if (r->clip != NULL) {
        args[at++] = "--max-grad-norm";
        args[at++] = r->clip;
    }
    if (r->scale != NULL) {
        args[at++] = "--loss-scale";
        args[at++] = r->scale;
    }
    args[at] = NULL;
    double t0 = th_now_s();
    bool bf16 = strcmp(r->dtype, "bf16") == 0;
    struct th_dump_diff dd;
    /* ,gwire: each node's partial sum rounded once (u = 2^-8 in bf16, 2^-11 in fp16) before the
     * owner adds it in fp32; an SGD step moves a parameter by lr times the gradient, so the error
     * is at most lr u (sum of the partials' magnitudes) / n a step, with momentum 0.9 over 4
     * steps 9 lr u of it: under 1e-6 for this model's gradient elements (below 0.2), inside the
     * fp32 band (measured: 1.9e-6 at most after 20 steps on 2 x 2) */
    if (!th_cluster_train(&cl, job, args, r->plan, bf16 ? 1.0 / 128 : 1e-5, &dd))
        return;
    TH_CHECK(dd.outside == 0, "%s %s %s accum %d: %zu parameters outside the tolerance (max %g)",
             r->plan, r->optimizer, r->dtype, r->accum, dd.outside, dd.maxd);

    long long P = th_job_params(cl.d[0].sock, job), S = P * 4, Sw = P * (bf16 ? 2 : 4);
    uint32_t W = r->f[0], G = r->f[1], OS = r->f[2];
    long long Gw = nodes_of(W), Gg = nodes_of(G), Gos = nodes_of(OS), R = N / Gg;
    long long s = r->accum;
    long long B = Gg > 1 ? S / Gg : S;
    long long Bw = r->gwire ? B / 2 : B; /* the block as it crosses nodes */
    long long hop = R > 1 ? 2 * (R - 1) * Bw / R : 0;
    if (R > 1 && scatters(r)) /* a reduce-scatter to the owners: half */
        hop = (R - 1) * Bw / R;
    long long wag = 0;
    if (OS > (uint32_t)K && W < OS)
        wag = (long long)K * (Sw / OS) * (W <= (uint32_t)K ? Gos - 1 : Gos / Gw - 1);
    for (int node = 0; node < N; node++) {
        json_t *st = th_job_stats(cl.d[node].sock, job);
        TH_CHECK(st != NULL, "node %d has no stats for %s", node, job);
        if (st == NULL)
            continue;
        long long init_node = W >= (uint32_t)K ? S / W * K : S;
        long long dumps = node == 0 ? 1 : 0;
        long long gathers = Gw > 1 ? T + dumps : 0;
        long long want_fetch = gathers * (Gw - 1) * (Sw / Gw);
        bool sec = r->sec && W > r->sec;
        long long n_units = th_json_int(st, "units");
        long long n_gathers = th_json_int(st, "gathers");
        long long loads = th_json_int(st, "secondary.loads");
        if (r->small_pool && !sec) { /* the contrast run: gathers again for the backward */
            long long got = th_json_int(st, "ops.fetch.bytes.inter_node_recv");
            TH_CHECK(Gw == 1 || got > gathers * (Gw - 1) * (Sw / Gw),
                     "%s node %d: a pool too small for the backward re-gathers across nodes "
                     "(%lld bytes, %lld with every unit kept)",
                     r->plan, node, got, gathers * (Gw - 1) * (Sw / Gw));
            want_fetch = got; /* checked just now */
        }
        if (!r->small_pool)
            TH_CHECK(n_gathers == n_units * (T + dumps),
                     "%s node %d: %lld gathers, %lld units x %lld generations", r->plan, node,
                     n_gathers, n_units, (long long)T + dumps);
        if (sec && r->small_pool) {
            TH_CHECK(loads > 0 && n_gathers == n_units * (T + dumps) + loads,
                     "%s node %d: %lld gathers, %lld from the secondary copy: every gather but "
                     "the first of each unit and generation (%lld) from it",
                     r->plan, node, n_gathers, loads, n_units * (T + dumps));
        } else {
            TH_CHECK(loads == 0, "%s node %d: %lld gathers from a secondary copy", r->plan, node,
                     loads);
        }
        if (!(r->small_pool && !sec)) {
            struct intra wi = want_intra(r, node, T, T + dumps, Sw, S);
            static const char *const ops[3] = {"fetch", "push", "step"};
            static const char *const cls[2] = {"intra_package", "intra_node"};
            long long rest[2] = {0, 0};
            for (int op = 0; op < 3; op++)
                for (int c = 0; c < 2; c++) {
                    char p[96];
                    snprintf(p, sizeof(p), "ops.%s.bytes.%s", ops[op], cls[c]);
                    long long got = th_json_int(st, p);
                    if (op == 0 && loads > 0) { /* loads: checked below */
                        rest[c] = got - wi.b[op][c];
                        continue;
                    }
                    TH_CHECK(got == wi.b[op][c], "%s accum %d node %d: %s %lld bytes, formula %lld",
                             r->plan, r->accum, node, p, got, wi.b[op][c]);
                }
            /* each load copies the S holders' pieces into rank 0's copy: of every unit the same
             * share crosses packages */
            long long in_pkg = (long long)(r->sec < (uint32_t)PK ? r->sec : (uint32_t)PK);
            TH_CHECK(loads == 0 || (rest[0] > 0 &&
                                    rest[0] * ((long long)r->sec - in_pkg) == rest[1] * in_pkg),
                     "%s node %d: loads from the secondary copied %lld + %lld bytes inside the "
                     "node, not in the ratio %lld : %lld",
                     r->plan, node, rest[0], rest[1], in_pkg, (long long)r->sec - in_pkg);
        }
        long long want[6] = {
            node == 0 ? (N - 1) * init_node : 0,
            node == 0 ? 0 : init_node,
            want_fetch,
            T * s * (Gg - 1) * Bw,
            T * s * (Gg - 1) * Bw,
            T * (hop + wag + 32LL * (N - 1)),
        };
        static const char *const path[6] = {
            "ops.init.bytes.inter_node_sent",  "ops.init.bytes.inter_node_recv",
            "ops.fetch.bytes.inter_node_recv", "ops.push.bytes.inter_node_sent",
            "ops.push.bytes.inter_node_recv",  "ops.step.bytes.inter_node_sent"};
        for (int i = 0; i < 6; i++) {
            long long got = th_json_int(st, path[i]);
            TH_CHECK(got == want[i], "%s accum %d node %d: %s %lld bytes, formula %lld (S %lld)",
                     r->plan, r->accum, node, path[i], got, want[i], S);
        }
        TH_CHECK(th_json_int(st, "ops.step.bytes.inter_node_recv") == want[5],
                 "%s node %d: step received %lld, formula %lld", r->plan, node,
                 th_json_int(st, "ops.step.bytes.inter_node_recv"), want[5]);
        TH_CHECK(th_json_int(st, "allocations_since_register") == 0,
                 "allocations after registration");
        json_decref(st);
    }
    TH_CHECK(r->twin <= idx, "run %d's twin %d is not an earlier run", idx, r->twin - 1);
    if (r->twin > 0 && r->twin <= idx) {
        char twin[400], mine[400];
        snprintf(twin, sizeof(twin), "%s/t%d-%d.bin", cl.d[0].dir, N, r->twin - 1);
        snprintf(mine, sizeof(mine), "%s/%s.bin", cl.d[0].dir, job);
        struct th_dump_diff tw;
        TH_CHECK(th_compare_dumps(mine, twin, 0, &tw) && tw.differ == 0,
                 "%s: %zu of %zu parameters differ from run %d's (max %g): the same sums in the "
                 "same order should give the same bits",
                 r->plan, tw.differ, tw.n, r->twin - 1, tw.maxd);
        printf("%dx%d %s: bitwise equal to run %d\n", N, K, r->plan, r->twin - 1);
    }
    printf("%dx%d %-12s %-5s %s accum %d: %zu params, %zu differ (max %.3g), hop %lld B, weights "
           "all-gather %lld B per node and step, %.2f s\n",
           N, K, r->plan, r->optimizer, r->dtype, r->accum, dd.n, dd.differ, dd.maxd, hop, wag,
           th_now_s() - t0);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: test_topo NODES RANKS_PER_NODE\n");
        return 2;
    }
    N = atoi(argv[1]);
    K = atoi(argv[2]);
    PK = N == 4 ? 1 : 2;
    char pk[16];
    snprintf(pk, sizeof(pk), "%d", PK);
    /* the ring all-reduce for every size: the direct one for small units moves (R - 1) B */
    const char *extra[] = {
        "--op-timeout-ms", "20000", "--small-allreduce-bytes", "0", "--package-size", pk, NULL};
    if (th_cluster_start(&cl, N, K, extra) != 0) {
        fprintf(stderr, "cannot start a cluster of %d nodes\n", N);
        return 1;
    }
    uint32_t n = (uint32_t)(N * K);
    /* 2 nodes x 4 ranks: ZeRO-1, ZeRO-2, the paper's weights-over-2 plan and a g group smaller
     * than the node; 4 nodes x 2 ranks: g over the node, os over all */
    /* ,sec=S changes something only where f_w > S: runs with an inactive one check that it
     * holds and moves nothing more; the active ones run with a pool too small to keep the
     * forward's units for the backward, next to the same plan without it */
    struct run runs24[] = {
        {"zero1", {1, 1, n}, 1, "adamw", "fp32", 0, false, 0, NULL, NULL, false},
        /* the boundary hop all-reduced instead of reduce-scattered: the same bits */
        {"zero1,hop-ar", {1, 1, n}, 1, "adamw", "fp32", 0, false, 1, NULL, NULL, false},
        {"zero2", {1, n, n}, 3, "sgd", "fp32", 0, false, 0, NULL, NULL, false},
        {"topo:2/4/8", {2, 4, 8}, 1, "sgd", "bf16", 0, false, 0, NULL, NULL, false},
        {"topo:2/4/8", {2, 4, 8}, 3, "adamw", "fp32", 0, false, 0, NULL, NULL, false},
        {"topo:1/2/8", {1, 2, 8}, 3, "adamw", "bf16", 0, false, 0, NULL, NULL, false},
        {"topo:1/2/8", {1, 2, 8}, 1, "sgd", "fp32", 0, false, 0, NULL, NULL, false},
        {"zero1,sec=2", {1, 1, n}, 3, "sgd", "bf16", 2, false, 0, NULL, NULL, false},
        {"zero2,sec=4", {1, n, n}, 1, "adamw", "fp32", 4, false, 0, NULL, NULL, false},
        {"topo:2/4/8,sec=2", {2, 4, 8}, 3, "adamw", "bf16", 2, true, 0, NULL, NULL, false},
        {"topo:2/4/8,sec=1", {2, 4, 8}, 3, "sgd", "fp32", 1, true, 0, NULL, NULL, false},
        {"topo:1/2/8,sec=2", {1, 2, 8}, 1, "adamw", "fp32", 2, true, 0, NULL, NULL, false},
        {"zero3", {n, n, n}, 3, "adamw", "fp32", 0, true, 0, NULL, NULL, false},
        {"zero3,sec=4", {n, n, n}, 3, "adamw", "fp32", 4, true, 0, NULL, NULL, false},
        {"zero3,sec=2", {n, n, n}, 1, "sgd", "bf16", 2, true, 0, NULL, NULL, false},
        {"mics:4,sec=2", {4, 4, 4}, 3, "adamw", "fp32", 2, true, 0, NULL, NULL, false}, /* across
                                                                                         * packages
                                                                                         * only
                                                                                         */
    };
    struct run runs42[] = {
        {"topo:2/2/8", {2, 2, 8}, 1, "adamw", "fp32", 0, false, 0, NULL, NULL, false},
        {"topo:2/2/8", {2, 2, 8}, 3, "sgd", "bf16", 0, false, 0, NULL, NULL, false},
        /* the boundary hop all-reduced instead of reduce-scattered: the same bits, with the
         * norm clipping too */
        {"topo:2/2/8,hop-ar", {2, 2, 8}, 1, "adamw", "fp32", 0, false, 1, NULL, NULL, false},
        {"topo:2/2/8", {2, 2, 8}, 3, "adamw", "fp32", 0, false, 0, "0.05", NULL, false},
        {"topo:2/2/8,hop-ar", {2, 2, 8}, 3, "adamw", "fp32", 0, false, 4, "0.05", NULL, false},
        {"zero1", {1, 1, n}, 3, "adamw", "fp32", 0, false, 0, NULL, NULL, false},
        {"zero1,hop-ar", {1, 1, n}, 3, "adamw", "fp32", 0, false, 6, NULL, NULL, false},
        /* gradients pushed times a loss scale of a power of two and divided by it in the
         * daemon (shard_step_scaled): the same bits, clipped or not, fp32 or bf16 */
        {"topo:2/2/8", {2, 2, 8}, 3, "adamw", "fp32", 0, false, 4, "0.05", "1024", false},
        {"topo:2/2/8", {2, 2, 8}, 3, "sgd", "bf16", 0, false, 2, NULL, "65536", false},
        {"topo-fp", {2, 2, 8}, 3, "adamw", "fp32", 0, false, 0, NULL, NULL, false},
        {"topo:2/4/8", {2, 4, 8}, 3, "adamw", "fp32", 0, false, 0, NULL, NULL, false}, /* w inside,
                                                                             g across nodes */
        {"zero2", {1, n, n}, 1, "adamw", "bf16", 0, false, 0, NULL, NULL, false},
        {"topo:2/2/8,sec=2", {2, 2, 8}, 3, "adamw", "fp32", 2, true, 0, NULL, NULL, false},
        {"topo:2/2/8,sec=1", {2, 2, 8}, 1, "sgd", "bf16", 1, true, 0, NULL, NULL, false},
        {"zero3", {n, n, n}, 3, "sgd", "fp32", 0, true, 0, NULL, NULL, false},
        {"zero3", {n, n, n}, 3, "sgd", "fp32", 0, true, 15, NULL, "4096", false},
        {"zero3,sec=2", {n, n, n}, 3, "sgd", "fp32", 2, true, 0, NULL, NULL, false},
        {"topo:4/4/8,sec=2", {4, 4, 8}, 1, "adamw", "bf16", 2, true, 0, NULL, NULL, false},
        {"topo:4/4/8,sec=2", {4, 4, 8}, 3, "sgd", "fp32", 2, true, 0, NULL, NULL, false},
        /* gradients across nodes in bf16 or fp16, summed in fp32 at their owners: the push
         * rounds' blocks (zero3), the hop reduce-scattered (topo:2/2/8) and all-reduced
         * (mics:4: two replica nodes, f_os inside the group) */
        {"zero3,gwire=bf16", {n, n, n}, 3, "sgd", "fp32", 0, false, 0, NULL, NULL, true},
        {"topo:2/2/8,gwire=bf16", {2, 2, 8}, 3, "sgd", "fp32", 0, false, 0, NULL, NULL, true},
        {"mics:4,gwire=fp16", {4, 4, 4}, 3, "sgd", "fp32", 0, false, 0, NULL, NULL, true},
    };
    bool four = N == 4;
    struct run *runs = four ? runs42 : runs24;
    size_t nr = four ? sizeof(runs42) / sizeof(runs42[0]) : sizeof(runs24) / sizeof(runs24[0]);
    for (size_t i = 0; i < nr; i++)
        run_one(&runs[i], (int)i);
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_topo");
}

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
 *          part; the weights' all-gather (f_w < f_os, f_os > k) sends each of the node's k os
 *          parts (S_w / f_os each) to every node of the os group that holds its w shard:
 *          G_os - 1 nodes when f_w <= k, else G_os / G_w - 1; 24 (N - 1) bytes of norm and
 *          schedule digest. */
#include "harness.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static struct th_cluster cl;
static int N, K;

struct run {
    const char *plan;
    uint32_t f[3]; /* what the plan means on this cluster, written out */
    int accum;
    const char *optimizer, *dtype;
};

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
    const char *args[] = {"--world",     world,        "--steps", steps,    "--accum",  accum,
                          "--plan",      r->plan,      "--seed",  "5",      "--hidden", "128",
                          "--optimizer", r->optimizer, "--dtype", r->dtype, "--quiet",  NULL};
    double t0 = th_now_s();
    bool bf16 = strcmp(r->dtype, "bf16") == 0;
    struct th_dump_diff dd;
    if (!th_cluster_train(&cl, job, args, r->plan, bf16 ? 1.0 / 128 : 1e-5, &dd))
        return;
    TH_CHECK(dd.outside == 0, "%s %s %s accum %d: %zu parameters outside the tolerance (max %g)",
             r->plan, r->optimizer, r->dtype, r->accum, dd.outside, dd.maxd);

    long long P = th_job_params(cl.d[0].sock, job), S = P * 4, Sw = P * (bf16 ? 2 : 4);
    uint32_t W = r->f[0], G = r->f[1], OS = r->f[2];
    long long Gw = nodes_of(W), Gg = nodes_of(G), Gos = nodes_of(OS), R = N / Gg;
    long long s = r->accum;
    long long B = Gg > 1 ? S / Gg : S;
    long long hop = R > 1 ? 2 * (R - 1) * B / R : 0;
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
        long long want[6] = {
            node == 0 ? (N - 1) * init_node : 0,
            node == 0 ? 0 : init_node,
            gathers * (Gw - 1) * (Sw / Gw),
            T * s * (Gg - 1) * B,
            T * s * (Gg - 1) * B,
            T * (hop + wag + 24LL * (N - 1)),
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
    /* the ring all-reduce for every size: the direct one for small units moves (R - 1) B */
    const char *extra[] = {"--op-timeout-ms", "20000", "--small-allreduce-bytes", "0", NULL};
    if (th_cluster_start(&cl, N, K, extra) != 0) {
        fprintf(stderr, "cannot start a cluster of %d nodes\n", N);
        return 1;
    }
    uint32_t n = (uint32_t)(N * K);
    /* 2 nodes x 4 ranks: ZeRO-1, ZeRO-2, the paper's weights-over-2 plan and a g group smaller
     * than the node; 4 nodes x 2 ranks: g over the node, os over all */
    struct run runs24[] = {
        {"zero1", {1, 1, n}, 1, "adamw", "fp32"},
        {"zero2", {1, n, n}, 3, "sgd", "fp32"},
        {"topo:2/4/8", {2, 4, 8}, 1, "sgd", "bf16"},
        {"topo:2/4/8", {2, 4, 8}, 3, "adamw", "fp32"},
        {"topo:1/2/8", {1, 2, 8}, 3, "adamw", "bf16"},
        {"topo:1/2/8", {1, 2, 8}, 1, "sgd", "fp32"},
    };
    struct run runs42[] = {
        {"topo:2/2/8", {2, 2, 8}, 1, "adamw", "fp32"},
        {"topo:2/2/8", {2, 2, 8}, 3, "sgd", "bf16"},
        {"topo", {2, 2, 8}, 3, "adamw", "fp32"},
        {"topo:2/4/8", {2, 4, 8}, 3, "adamw", "fp32"}, /* w inside, g across nodes */
        {"zero2", {1, n, n}, 1, "adamw", "bf16"},
    };
    bool four = N == 4;
    struct run *runs = four ? runs42 : runs24;
    size_t nr = four ? sizeof(runs42) / sizeof(runs42[0]) : sizeof(runs24) / sizeof(runs24[0]);
    for (size_t i = 0; i < nr; i++)
        run_one(&runs[i], (int)i);
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_topo");
}

/* A job's own ranks per node (issue 38's first step: shard_model_t.ranks_per_node, torchrun's
 * LOCAL_WORLD_SIZE) on a cluster of 3 daemons configured for 2 ranks per node (tcp;ofi_rxm on
 * loopback), real trainer processes:
 * - three jobs at the same time: world 3 with one rank per node (zero3, over nodes 0..2), world
 *   4 with the daemons' 2 (mics:2, nodes 0..1) and world 2 with both ranks on node 0 (zero3,
 *   one node): each ends within 1e-5 of its own plain data-parallel reference (mlp_train
 *   --reference), and each daemon lists each job it serves with its ranks per node and nodes
 *   (`shardctl jobs`, and `shardctl topology` prints each one's shape); node 2 serves only the
 *   first;
 * - refused, naming the numbers: a world that is not a multiple of the ranks per node, one that
 *   needs more nodes than the cluster has, two ranks of a node that disagree (EMISMATCH at
 *   once), and two nodes that disagree (the coordinator's EMISMATCH, told to every rank). */
#include "harness.h"

#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N 3
#define K 2

static struct th_cluster cl;

struct job_run {
    const char *job, *plan;
    int world, rpn;
    pid_t pids[TH_MAX_RANKS + 1];
    char dump[400], ref[400];
};

/* start every rank of r (rank i on node i / rpn) and its reference */
static void job_start(struct job_run *r)
{
    const char *dir = cl.d[0].dir;
    char world[16], rpn[16];
    snprintf(world, sizeof(world), "%d", r->world);
    snprintf(rpn, sizeof(rpn), "%d", r->rpn);
    snprintf(r->dump, sizeof(r->dump), "%s/%s.bin", dir, r->job);
    snprintf(r->ref, sizeof(r->ref), "%s/%s-ref.bin", dir, r->job);
    const char *args[] = {
        "--world",      world, "--plan",         r->plan, "--steps",          "12",
        "--accum",      "2",   "--hidden",       "96",    "--ranks-per-node", rpn,
        "--compute-ms", "2",   "--compute-mode", "sleep", "--quiet",          NULL};
    for (int rank = 0; rank <= r->world; rank++) {
        char log[400];
        snprintf(log, sizeof(log), "%s/%s-%d.log", dir, r->job, rank);
        const char *dumps[] = {"--dump-params", r->dump, NULL};
        const char *reference[] = {"--reference", "--dump-params", r->ref, NULL};
        r->pids[rank] = rank < r->world ? th_spawn_rank(cl.d[rank / r->rpn].sock, r->job, rank,
                                                        args, rank == 0 ? dumps : NULL, log)
                                        : th_spawn_rank(NULL, NULL, -1, args, reference, log);
    }
}

static void job_finish(struct job_run *r)
{
    int failed = 0;
    for (int rank = 0; rank <= r->world; rank++) {
        int rc = th_wait(r->pids[rank], 180000);
        TH_CHECK(rc == 0, "%s: process %d exit code %d (log %s/%s-%d.log)", r->job, rank, rc,
                 cl.d[0].dir, r->job, rank);
        failed += rc != 0;
    }
    if (failed)
        return;
    struct th_dump_diff dd;
    bool ok = th_compare_dumps(r->dump, r->ref, 1e-5, &dd);
    TH_CHECK(ok && dd.outside == 0,
             "%s (world %d, %d ranks per node, %s): %zu of %zu parameters outside 1e-5 of the "
             "reference (max %g)",
             r->job, r->world, r->rpn, r->plan, dd.outside, dd.n, dd.maxd);
    if (ok && dd.outside == 0)
        printf("%-12s world %d, %d per node over %d nodes, %-6s: %zu parameters within 1e-5 of "
               "the reference (max %g)\n",
               r->job, r->world, r->rpn, r->world / r->rpn, r->plan, dd.n, dd.maxd);
}

/* what node's `shardctl jobs` says of job: its ranks_per_node and nodes (-1: not listed) */
static void listed(int node, const char *job, int *rpn, int *nodes)
{
    *rpn = *nodes = -1;
    json_t *doc = th_admin_json(cl.d[node].sock, "jobs"), *j;
    size_t i;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "name")), job) != 0)
            continue;
        *rpn = (int)json_integer_value(json_object_get(j, "ranks_per_node"));
        *nodes = (int)json_integer_value(json_object_get(j, "nodes"));
    }
    json_decref(doc);
}

static void side_by_side(void)
{
    struct job_run runs[] = {{.job = "one-each", .plan = "zero3", .world = 3, .rpn = 1},
                             {.job = "two-each", .plan = "mics:2", .world = 4, .rpn = 2},
                             {.job = "one-node", .plan = "zero3", .world = 2, .rpn = 2}};
    size_t n = sizeof(runs) / sizeof(runs[0]);
    for (size_t i = 0; i < n; i++)
        job_start(&runs[i]);
    usleep(1500000); /* all three registered and training */
    for (size_t i = 0; i < n; i++) {
        int want_nodes = runs[i].world / runs[i].rpn;
        for (int node = 0; node < N; node++) {
            int rpn, nodes;
            listed(node, runs[i].job, &rpn, &nodes);
            if (node < want_nodes)
                TH_CHECK(rpn == runs[i].rpn && nodes == want_nodes,
                         "node %d lists %s with %d ranks per node over %d nodes, expected %d over "
                         "%d",
                         node, runs[i].job, rpn, nodes, runs[i].rpn, want_nodes);
            else
                TH_CHECK(rpn == -1, "node %d lists %s, which spans nodes 0..%d", node, runs[i].job,
                         want_nodes - 1);
        }
    }
    /* shardctl topology says each job's own shape (it printed the cluster's node count) */
    char out[400];
    snprintf(out, sizeof(out), "%s/topology.txt", cl.d[0].dir);
    const char *argv[] = {SHARDCTL_PATH, "--socket", cl.d[0].sock, "topology", NULL};
    int rc = th_wait(th_spawn(argv, out), 30000);
    char *t = th_read_file(out, NULL);
    TH_CHECK(rc == 0 && t && strstr(t, "job one-each: world 3 = 3 nodes x 1 ranks") &&
                 strstr(t, "job two-each: world 4 = 2 nodes x 2 ranks") &&
                 strstr(t, "job one-node: world 2 = 1 nodes x 2 ranks"),
             "shardctl topology on node 0 (exit %d) does not give each job's nodes and ranks per "
             "node:\n%s",
             rc, t ? t : "");
    free(t);
    for (size_t i = 0; i < n; i++)
        job_finish(&runs[i]);
}

/* ---- refusals, through libshard */

struct reg {
    int node, rank, world, rpn;
    const char *job;
    int st;
    char err[512];
};

static void *reg_thread(void *arg)
{
    struct reg *r = arg;
    r->st = th_register_one(cl.d[r->node].sock, r->job, (uint32_t)r->rank, (uint32_t)r->world,
                            (uint32_t)r->rpn, r->err, sizeof(r->err));
    return NULL;
}

/* the registrations in r at once; each must fail with st naming text */
static void refused(struct reg *r, int n, int st, const char *text, const char *what)
{
    pthread_t th[8];
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, reg_thread, &r[i]);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < n; i++)
        TH_CHECK(r[i].st == st && strstr(r[i].err, text) != NULL,
                 "%s: rank %d on node %d: %d '%s' (expected %d naming '%s')", what, r[i].rank,
                 r[i].node, r[i].st, r[i].err, st, text);
    printf("%s: refused: %s\n", what, r[0].err);
}

static void refusals(void)
{
    struct reg a[] = {{.node = 0, .rank = 0, .world = 4, .rpn = 3, .job = "bad-a"}};
    refused(a, 1, SHARD_EINVAL, "world size 4 is not a multiple of ranks_per_node 3",
            "world 4, 3 per node");
    struct reg b[] = {{.node = 0, .rank = 0, .world = 8, .rpn = 2, .job = "bad-b"}};
    refused(b, 1, SHARD_EINVAL, "world size 8 needs 4 nodes of 2 ranks; this cluster has 3",
            "world 8, 2 per node, 3 nodes");
    /* node 0's two ranks disagree: the second is refused and the first hears it at once */
    struct reg c[] = {{.node = 0, .rank = 0, .world = 4, .rpn = 2, .job = "bad-c"},
                      {.node = 0, .rank = 1, .world = 4, .rpn = 4, .job = "bad-c"}};
    refused(c, 2, SHARD_EMISMATCH, "ranks per node differ from", "two ranks of a node disagree");
    for (int i = 0; i < 2; i++) /* whichever registered first set the job's */
        TH_CHECK(strstr(c[i].err, "4 ranks per node differ from 2 of the other ranks") ||
                     strstr(c[i].err, "2 ranks per node differ from 4 of the other ranks"),
                 "two ranks of a node disagree: rank %d is not told both numbers: '%s'", i,
                 c[i].err);
    /* nodes that disagree, each consistent alone: node 0 serves ranks 0, 1 of 2 per node (3
     * nodes), node 1 ranks 3..5 of 3 per node (2 nodes); the coordinator refuses the job */
    struct reg d[] = {{.node = 0, .rank = 0, .world = 6, .rpn = 2, .job = "bad-d"},
                      {.node = 0, .rank = 1, .world = 6, .rpn = 2, .job = "bad-d"},
                      {.node = 1, .rank = 3, .world = 6, .rpn = 3, .job = "bad-d"},
                      {.node = 1, .rank = 4, .world = 6, .rpn = 3, .job = "bad-d"},
                      {.node = 1, .rank = 5, .world = 6, .rpn = 3, .job = "bad-d"}};
    refused(d, 5, SHARD_EMISMATCH, "every rank must give the same ranks_per_node",
            "two nodes disagree");
    for (int i = 0; i < N; i++)
        TH_CHECK(th_daemon_alive(&cl.d[i]), "node %d died", i);
}

int main(void)
{
    if (th_cluster_start(&cl, N, K, NULL) != 0) {
        fprintf(stderr, "cannot start a cluster of %d nodes\n", N);
        return 1;
    }
    side_by_side();
    refusals();
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_ranks_per_node");
}

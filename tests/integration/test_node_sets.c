/* Jobs on any set of a cluster's nodes (issue 38): an open cluster of 6 daemons (no node count,
 * no index but the coordinator's, no ranks per node), each in a network namespace of its own
 * with a veth on a private bridge (tcp;ofi_rxm; on loopback where namespaces cannot be made),
 * real trainer processes, each job's ranks placed on nodes of its own and giving its own ranks
 * per node, the job's node i serving ranks i * k .. i * k + k - 1 wherever it runs:
 * - job A on cluster nodes {1, 2, 4} (2 ranks each, zero3), B on {0, 3, 5} (2 each, mics:2,
 *   whose replication crosses the nodes) and C on {2, 3} (1 each, per-state topo:1/2/2), started
 *   C first, at the same time: each ends within 1e-5 of its one-process reference
 *   (mlp_train --reference); every daemon lists each job it serves with its node list; the
 *   bytes each job's nodes sent and received across nodes equal the formulas for A and B, by
 *   the job's own node numbers;
 * - the three again, and node 4's daemon killed while they train: A fails (its ranks exit with
 *   an error), B and C finish bitwise equal to their first runs, every other daemon stays up;
 *   A is mics:2 there and keeps its state (resume_timeout_ms): its node 0's daemon writes a
 *   checkpoint from its surviving nodes' replicas (its other node's refuses, naming node 0);
 * - node 4 restarted with nothing new to configure: a job on {1, 4} trains to its reference, and
 *   one on {0, 5} from A's recovered checkpoint to its reference's --load of it;
 * - a checkpoint saved by a job on {1, 0} (mics:2, world 4) loads into one on {3, 4, 5} (zero3,
 *   world 6), which trains on to its reference's --load;
 * - launched as srun does (SLURM_PROCID, SLURM_NTASKS, SLURM_NTASKS_PER_NODE, SLURM_JOB_ID,
 *   SLURM_STEP_ID) on nodes {5, 2} and as torchrun does (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
 *   TORCHELASTIC_RUN_ID) on {4, 3}, mlp_train given none of --rank, --world, --job: each job
 *   is named after its launcher's run and trains to its reference;
 * - refused, naming the nodes: two nodes that both register ranks 0..1 of a job. */
#include "harness.h"

#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N     6
#define K     2
#define T     10 /* steps */
#define S_ACC 2

static struct th_cluster cl;
/* "independent": the same jobs on daemons that know only themselves (nodes 1), each job's
 * ranks naming its leader (the daemon of its node 0) and giving a job secret */
static bool indep;

/* an independent cluster: the job's leader and secret for the ranks about to start (unset: the
 * variables go) */
static void job_env(const char *job, int leader_node)
{
    if (!indep)
        return;
    if (job == NULL) {
        unsetenv("SHARD_LEADER");
        unsetenv("MASTER_ADDR");
        unsetenv("SHARD_JOB_SECRET_FILE");
        return;
    }
    char leader[64], secret[400];
    th_cluster_leader(&cl, leader_node, leader, sizeof(leader));
    if (cl.netns) /* as torchrun names it: the host, shardd's port by default */
        setenv("MASTER_ADDR", cl.addr[leader_node], 1);
    else
        setenv("SHARD_LEADER", leader, 1);
    snprintf(secret, sizeof(secret), "%s/%s.secret", cl.base, job);
    FILE *f = fopen(secret, "w");
    if (f != NULL) {
        fprintf(f, "the secret of job %s, made once", job);
        fclose(f);
    }
    setenv("SHARD_JOB_SECRET_FILE", secret, 1);
}

struct job_run {
    const char *job, *plan;
    int world, rpn, n_nodes;
    int nodes[N]; /* the cluster node of each of the job's nodes */
    int steps;
    const char *extra[5]; /* more options for every rank and the reference (NULL-terminated) */
    pid_t pids[TH_MAX_RANKS + 1];
    char name[64], dump[400], ref[400];
};

/* start every rank of r (rank i on the cluster node of job node i / rpn) and its reference;
 * tag names this run's job and files */
static void job_start(struct job_run *r, const char *tag)
{
    const char *dir = cl.base;
    char world[16], rpn[16], steps[16], accum[16];
    snprintf(world, sizeof(world), "%d", r->world);
    snprintf(rpn, sizeof(rpn), "%d", r->rpn);
    snprintf(steps, sizeof(steps), "%d", r->steps);
    snprintf(accum, sizeof(accum), "%d", S_ACC);
    snprintf(r->name, sizeof(r->name), "%s-%s", r->job, tag);
    snprintf(r->dump, sizeof(r->dump), "%s/%s.bin", dir, r->name);
    snprintf(r->ref, sizeof(r->ref), "%s/%s-ref.bin", dir, r->job);
    const char *args[32] = {"--world",          world,   "--plan",       r->plan,
                            "--steps",          steps,   "--accum",      accum,
                            "--hidden",         "96",    "--seed",       "5",
                            "--ranks-per-node", rpn,     "--compute-ms", "2",
                            "--compute-mode",   "sleep", "--quiet"};
    int n = 19;
    for (int i = 0; r->extra[i] != NULL && n < 30; i++)
        args[n++] = r->extra[i];
    args[n] = NULL;
    job_env(r->name, r->nodes[0]);
    for (int rank = 0; rank < r->world; rank++) {
        char log[400];
        snprintf(log, sizeof(log), "%s/%s-%d.log", dir, r->name, rank);
        const char *dumps[] = {"--dump-params", r->dump, NULL};
        r->pids[rank] = th_spawn_rank(cl.d[r->nodes[rank / r->rpn]].sock, r->name, rank, args,
                                      rank == 0 ? dumps : NULL, log);
    }
    job_env(NULL, 0);
    r->pids[r->world] = -1;
    if (access(r->ref, R_OK) != 0) { /* the reference once per job */
        char log[400];
        snprintf(log, sizeof(log), "%s/%s-ref.log", dir, r->job);
        const char *reference[] = {"--reference", "--dump-params", r->ref, NULL};
        r->pids[r->world] = th_spawn_rank(NULL, NULL, -1, args, reference, log);
    }
}

/* wait for r's processes: how many exited non-zero (the reference's failure is a check's) */
static int job_wait(struct job_run *r)
{
    int failed = 0;
    for (int rank = 0; rank <= r->world; rank++) {
        if (r->pids[rank] <= 0)
            continue;
        int rc = th_wait(r->pids[rank], 240000);
        if (rank == r->world)
            TH_CHECK(rc == 0, "%s: the reference exited %d", r->job, rc);
        else
            failed += rc != 0;
    }
    return failed;
}

static void job_finish(struct job_run *r)
{
    int failed = job_wait(r);
    TH_CHECK(failed == 0, "%s: %d ranks failed (logs %s/%s-*.log)", r->name, failed, cl.base,
             r->name);
    if (failed)
        return;
    struct th_dump_diff dd;
    bool ok = th_compare_dumps(r->dump, r->ref, 1e-5, &dd);
    TH_CHECK(ok && dd.outside == 0,
             "%s (%s, world %d over %d nodes): %zu of %zu parameters outside 1e-5 of the "
             "reference (max %g)",
             r->name, r->plan, r->world, r->n_nodes, dd.outside, dd.n, dd.maxd);
    if (ok && dd.outside == 0)
        printf("%-10s %-12s world %d on nodes", r->name, r->plan, r->world);
    for (int i = 0; ok && dd.outside == 0 && i < r->n_nodes; i++)
        printf(" %d", r->nodes[i]);
    if (ok && dd.outside == 0)
        printf(": %zu parameters within 1e-5 of the reference (max %g)\n", dd.n, dd.maxd);
}

/* an independent daemon's id, as shardctl topology gives it ("" if none) */
static const char *daemon_id(int node)
{
    static char ids[N][16];
    json_t *doc = th_admin_json(cl.d[node].sock, "topology");
    json_t *self = json_array_get(json_object_get(doc, "topology"), 0);
    const char *id = json_string_value(json_object_get(self, "id"));
    snprintf(ids[node], sizeof(ids[node]), "%s", id != NULL ? id : "");
    json_decref(doc);
    return ids[node];
}

/* every daemon lists r exactly where it runs, as the job node it serves, with the node list
 * (checked: a failed check for each that does not; else only whether all do) */
static bool listed(const struct job_run *r, bool check)
{
    bool all = true;
    for (int node = 0; node < N; node++) {
        json_t *doc = th_admin_json(cl.d[node].sock, "jobs"), *j, *found = NULL;
        size_t i;
        json_array_foreach(json_object_get(doc, "jobs"), i, j)
        {
            if (strcmp(json_string_value(json_object_get(j, "name")), r->name) == 0)
                found = j;
        }
        int want = -1;
        for (int n = 0; n < r->n_nodes; n++)
            if (r->nodes[n] == node)
                want = n;
        bool ok;
        if (want < 0) {
            ok = found == NULL;
            TH_CHECK(ok || !check, "cluster node %d lists %s, which does not run there", node,
                     r->name);
        } else if (found == NULL) {
            ok = false;
            TH_CHECK(!check, "cluster node %d does not list %s (its node %d)", node, r->name, want);
        } else if (indep) { /* each numbers the others its own way: the daemons' ids agree */
            json_t *ids = json_object_get(found, "node_daemons");
            bool same = (int)json_array_size(ids) == r->n_nodes;
            for (int n = 0; same && n < r->n_nodes; n++) {
                const char *id = json_string_value(json_array_get(ids, (size_t)n));
                same = id != NULL && strcmp(id, daemon_id(r->nodes[n])) == 0;
            }
            ok = same && json_integer_value(json_object_get(found, "node")) == want;
            TH_CHECK(ok || !check,
                     "daemon %d lists %s as its node %lld of daemons %s, expected node %d", node,
                     r->name, (long long)json_integer_value(json_object_get(found, "node")),
                     json_dumps(ids, JSON_COMPACT), want);
        } else {
            json_t *ids = json_object_get(found, "node_ids");
            bool same = (int)json_array_size(ids) == r->n_nodes;
            for (int n = 0; same && n < r->n_nodes; n++)
                same = json_integer_value(json_array_get(ids, (size_t)n)) == r->nodes[n];
            ok = same && json_integer_value(json_object_get(found, "node")) == want;
            TH_CHECK(ok || !check,
                     "cluster node %d lists %s as its node %lld of nodes %s, expected node %d",
                     node, r->name, (long long)json_integer_value(json_object_get(found, "node")),
                     json_dumps(ids, JSON_COMPACT), want);
        }
        all &= ok;
        json_decref(doc);
    }
    return all;
}

/* the same once r registered (a loaded machine starts its ranks late), 30 s at most */
static void check_listed(const struct job_run *r)
{
    for (double end = th_now_s() + 30; !listed(r, false) && th_now_s() < end;)
        usleep(100000);
    listed(r, true);
}

/* the all-reduce bytes a node sends for r's units over R nodes: every unit of this model is
 * under small_allreduce_bytes (64 KiB), so each goes directly to the R - 1 others (coll.c) */
static long long allreduce_bytes(const struct job_run *r, int R, int G)
{
    json_t *doc = th_admin_json(cl.d[r->nodes[0]].sock, "groups"), *j, *u;
    long long sum = 0;
    size_t i, k;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "job")), r->name) != 0)
            continue;
        json_array_foreach(json_object_get(j, "units"), k, u)
        {
            long long b = json_integer_value(json_object_get(u, "numel")) * 4 / G;
            TH_CHECK(b <= 65536,
                     "%s: unit %zu of %lld bytes takes the ring, not the formula's "
                     "direct all-reduce",
                     r->name, k, b);
            sum += (long long)(R - 1) * b;
        }
    }
    json_decref(doc);
    return sum;
}

/* the bytes each of r's nodes moved across nodes, against test_cluster's formulas over the
 * job's own nodes (its node 0 sends the initial values and gathers the dump) */
static void check_bytes(const struct job_run *r)
{
    long long S = th_job_params(cl.d[r->nodes[0]].sock, r->name) * 4;
    int W = r->world, k = r->rpn, Nj = r->n_nodes;
    int p = strcmp(r->plan, "zero3") == 0 ? W : atoi(r->plan + 5);
    int G = p > k ? p / k : 1, R = Nj / G;
    long long block = S / G;
    for (int n = 0; n < Nj; n++) {
        json_t *st = th_job_stats(cl.d[r->nodes[n]].sock, r->name);
        TH_CHECK(st != NULL, "cluster node %d has no stats for %s", r->nodes[n], r->name);
        if (st == NULL)
            continue;
        long long init_node = p >= k ? S / p * k : S;
        long long init_sent = n == 0 ? (long long)(Nj - 1) * init_node : 0;
        long long init_recv = n == 0 ? 0 : init_node;
        long long gathers = G > 1 ? r->steps + (n == 0 ? 1 : 0) : 0;
        long long fetch_recv = gathers * (G - 1) * block;
        long long push = (long long)r->steps * S_ACC * (G - 1) * block;
        long long ar = R > 1 ? allreduce_bytes(r, R, G) : 0;
        long long step = (long long)r->steps * (ar + 32LL * (Nj - 1));
        long long got[5] = {th_json_int(st, "ops.init.bytes.inter_node_sent"),
                            th_json_int(st, "ops.init.bytes.inter_node_recv"),
                            th_json_int(st, "ops.fetch.bytes.inter_node_recv"),
                            th_json_int(st, "ops.push.bytes.inter_node_sent"),
                            th_json_int(st, "ops.step.bytes.inter_node_sent")};
        long long want[5] = {init_sent, init_recv, fetch_recv, push, step};
        static const char *const what[5] = {"init sent", "init received", "fetch received",
                                            "push sent", "step sent"};
        for (int i = 0; i < 5; i++)
            TH_CHECK(got[i] == want[i],
                     "%s (%s) job node %d (cluster node %d): %s %lld bytes, formula %lld (S %lld)",
                     r->name, r->plan, n, r->nodes[n], what[i], got[i], want[i], S);
        json_decref(st);
    }
    printf("%-10s bytes across nodes equal the formulas on each of its %d nodes\n", r->name, Nj);
}

/* in namespaces: what each node's daemon counted as sent across nodes for jobs (bytes of the
 * job's data, no headers) went over its link, which carried at least as much */
static void check_wire(const struct job_run *const *jobs, int n_jobs)
{
    if (!cl.netns)
        return;
    static const char *const ops[] = {"init", "fetch", "push", "step"};
    for (int node = 0; node < N; node++) {
        long long counted = 0;
        for (int j = 0; j < n_jobs; j++) {
            bool here = false; /* (a job a node does not serve it lists nowhere: not asked) */
            for (int n = 0; n < jobs[j]->n_nodes; n++)
                here |= jobs[j]->nodes[n] == node;
            json_t *st = here ? th_job_stats(cl.d[node].sock, jobs[j]->name) : NULL;
            for (int o = 0; st != NULL && o < 4; o++) {
                char key[64];
                snprintf(key, sizeof(key), "ops.%s.bytes.inter_node_sent", ops[o]);
                counted += th_json_int(st, key);
            }
            json_decref(st);
        }
        long long wire = th_node_wire_sent(&cl, node);
        TH_CHECK(counted > 0 && wire >= counted,
                 "cluster node %d: its daemon counted %lld bytes sent across nodes, its link "
                 "carried %lld",
                 node, counted, wire);
    }
    printf("every node's link carried at least the bytes its daemon counted as sent\n");
}

static struct job_run A = {.job = "a",
                           .plan = "zero3",
                           .world = 6,
                           .rpn = 2,
                           .n_nodes = 3,
                           .nodes = {1, 2, 4},
                           .steps = T};
static struct job_run B = {.job = "b",
                           .plan = "mics:2",
                           .world = 6,
                           .rpn = 2,
                           .n_nodes = 3,
                           .nodes = {0, 3, 5},
                           .steps = T};
static struct job_run C = {.job = "c",
                           .plan = "topo:1/2/2",
                           .world = 2,
                           .rpn = 1,
                           .n_nodes = 2,
                           .nodes = {2, 3},
                           .steps = T};

static void side_by_side(void)
{
    job_start(&C, "1");
    job_start(&B, "1");
    job_start(&A, "1");
    usleep(1500000); /* registered and training */
    check_listed(&A);
    check_listed(&B);
    check_listed(&C);
    job_finish(&A);
    job_finish(&B);
    job_finish(&C);
    check_bytes(&A);
    check_bytes(&B);
    const struct job_run *const all[] = {&A, &B, &C};
    check_wire(all, 3);
}

/* the steps job has taken at cluster node node (-1: not listed there) */
static long long job_steps(int node, const char *job)
{
    json_t *doc = th_admin_json(cl.d[node].sock, "jobs"), *j;
    long long steps = -1;
    size_t i;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "name")), job) == 0)
            steps = json_integer_value(json_object_get(j, "steps"));
    }
    json_decref(doc);
    return steps;
}

static char recovered[400]; /* node_killed's checkpoint of job a from the replicas */
static long long recovered_step;

/* shardctl checkpoint --job job dir on cluster node; the answer's document into *doc_p */
static int checkpoint_job(int node, const char *job, const char *dir, json_t **doc_p)
{
    return th_checkpoint_job(cl.base, cl.d[node].sock, job, dir, doc_p);
}

/* job a (mics:2: every node holds the optimizer states) lost its node 2 (cluster node 4) and
 * keeps its state (resume_timeout_ms): its node 0's daemon (cluster node 1) writes a
 * checkpoint from the replicas of its surviving nodes; its node 1's refuses, naming node 0 */
static void recover_a(const char *job)
{
    snprintf(recovered, sizeof(recovered), "%s/recovered", cl.base);
    json_t *doc = NULL;
    int rc = checkpoint_job(2, job, recovered, &doc);
    const char *err = json_string_value(json_object_get(doc, "error"));
    TH_CHECK(rc != 0 && err &&
                 strstr(err, indep ? "runs on the daemon of the job's node 0"
                                   : "runs on the daemon of the job's node 0 (cluster node 1"),
             "checkpoint --job %s on cluster node 2 (its node 1): exit %d, '%s'", job, rc,
             err ? err : "");
    json_decref(doc);
    rc = checkpoint_job(1, job, recovered, &doc);
    json_t *lost = json_object_get(doc, "lost_nodes");
    recovered_step = json_integer_value(json_object_get(doc, "step"));
    char *text = doc != NULL ? json_dumps(doc, JSON_COMPACT) : NULL;
    TH_CHECK(rc == 0 && json_array_size(lost) == 1 &&
                 json_integer_value(json_array_get(lost, 0)) == 2 && recovered_step > 0,
             "checkpoint --job %s on cluster node 1 (exit %d): %s", job, rc,
             text ? text : "(no answer)");
    free(text);
    if (rc == 0)
        printf("%-10s recovered from its surviving nodes' replicas: step %lld, lost job node 2\n",
               job, recovered_step);
    json_decref(doc);
}

/* the same three, node 4 killed under them: A alone fails */
static void node_killed(void)
{
    struct job_run a = A, b = B, c = C;
    a.steps = b.steps = c.steps = 400; /* long enough to be running when node 4 goes */
    a.plan = "mics:2";                 /* its states survive node 4: recover_a */
    a.extra[0] = "--resume-timeout-ms";
    a.extra[1] = "60000";
    char b1[400], c1[400];
    snprintf(b1, sizeof(b1), "%s", B.dump);
    snprintf(c1, sizeof(c1), "%s", C.dump);
    /* B and C as in their first runs (same steps): their results must not change */
    b.steps = c.steps = T;
    job_start(&c, "2");
    job_start(&b, "2");
    job_start(&a, "2");
    usleep(1200000);
    /* (a step taken everywhere, so that its replicas hold one: a loaded machine, the sanitizers,
     * may take longer than the wait above to register three jobs) */
    for (double end = th_now_s() + 30; th_now_s() < end && job_steps(1, a.name) < 2; usleep(50000))
        ;
    char four[16] = ""; /* (its fabric, and its id, are there once a job spans nodes) */
    for (double end = th_now_s() + 10; indep && four[0] == '\0' && th_now_s() < end; usleep(50000))
        snprintf(four, sizeof(four), "%s", daemon_id(4));
    kill(cl.d[4].pid, SIGKILL);
    th_wait(cl.d[4].pid, 10000);
    cl.d[4].pid = 0;
    int failed = job_wait(&a);
    TH_CHECK(failed > 0, "job a ran on the killed node 4, yet all its ranks exited 0");
    char log[400];
    snprintf(log, sizeof(log), "%s/%s-0.log", cl.base, a.name);
    char *text = th_read_file(log, NULL);
    /* (an independent daemon names the job's node 2 by its daemon's id and address) */
    char named[96] = "cluster node 4";
    if (indep)
        snprintf(named, sizeof(named), "node 2 (daemon %s at ", four);
    TH_CHECK(text && strstr(text, named) != NULL,
             "job a's rank 0 (on node 1) was not told that its node on daemon 4 went down "
             "('%s'):\n%s",
             named, text ? text : "(no log)");
    free(text);
    recover_a(a.name);
    for (struct job_run *r = &b; r != NULL; r = r == &b ? &c : NULL) {
        failed = job_wait(r);
        TH_CHECK(failed == 0, "%s: %d ranks failed after node 4 (not one of its nodes) died",
                 r->name, failed);
        struct th_dump_diff dd;
        bool ok = th_compare_dumps(r->dump, r == &b ? b1 : c1, 0, &dd);
        TH_CHECK(ok && dd.differ == 0,
                 "%s: %zu of %zu parameters differ from its first run (max %g): node 4's death "
                 "touched it",
                 r->name, dd.differ, dd.n, dd.maxd);
        if (ok && dd.differ == 0)
            printf("%-10s finished beside node 4's death, bitwise equal to its first run\n",
                   r->name);
    }
    for (int n = 0; n < N; n++)
        if (n != 4)
            TH_CHECK(th_daemon_alive(&cl.d[n]), "cluster node %d died", n);
}

/* node 4 back, with the arguments it had: a job on {1, 4} trains */
static void node_back(const char *const *extra)
{
    TH_CHECK(th_cluster_node_restart(&cl, 4, extra) == 0, "node 4 did not start again");
    struct job_run d = {.job = "d",
                        .plan = "zero3",
                        .world = 4,
                        .rpn = 2,
                        .n_nodes = 2,
                        .nodes = {1, 4},
                        .steps = T};
    /* it rejoins once the coordinator installed its new address: a registration before that
     * is refused ("the cluster has not formed yet"), so wait for node 0 to list it up */
    double end = th_now_s() + 20;
    bool up = indep; /* (an independent daemon meets it when a job names it) */
    while (!up && th_now_s() < end) {
        json_t *doc = th_admin_json(cl.d[1].sock, "topology");
        json_t *e = json_array_get(json_object_get(doc, "topology"), 4);
        const char *st = json_string_value(json_object_get(e, "state"));
        up = st && strcmp(st, "up") == 0;
        json_decref(doc);
        if (!up)
            usleep(100000);
    }
    TH_CHECK(up, "node 1 does not list the restarted node 4 as up within 20 s");
    job_start(&d, "3");
    job_finish(&d);
    /* job a's recovered checkpoint, loaded by a job on {0, 5}: 4 more steps */
    if (recovered_step <= 0)
        return;
    struct job_run e = {.job = "e",
                        .plan = "zero3",
                        .world = 4,
                        .rpn = 2,
                        .n_nodes = 2,
                        .nodes = {0, 5},
                        .steps = (int)recovered_step + 4,
                        .extra = {"--load", recovered, NULL}};
    job_start(&e, "3");
    job_finish(&e);
}

/* a checkpoint saved by a job on {1, 0} (mics:2, world 4: its node 0, which commits the saves,
 * on cluster node 1, so node 0's part comes relayed) loads into one on {3, 4, 5} (zero3, world
 * 6): it trains on to its reference's --load of the same checkpoint */
static void save_elsewhere(void)
{
    char dir[400];
    snprintf(dir, sizeof(dir), "%s/saved", cl.base);
    struct job_run s = {.job = "s",
                        .plan = "mics:2",
                        .world = 4,
                        .rpn = 2,
                        .n_nodes = 2,
                        .nodes = {1, 0},
                        .steps = T,
                        .extra = {"--save-every", "5", "--save-dir", dir, NULL}};
    job_start(&s, "4");
    job_finish(&s);
    struct job_run l = {.job = "l",
                        .plan = "zero3",
                        .world = 6,
                        .rpn = 2,
                        .n_nodes = 3,
                        .nodes = {3, 4, 5},
                        .steps = T + 4,
                        .extra = {"--load", dir, NULL}};
    job_start(&l, "4");
    job_finish(&l);
}

/* ---- launchers: the rank, world, job and ranks per node from the launcher's variables alone */

struct launch {
    const char *what, *job;      /* the launcher; the job name its variables give */
    const char *vars[4][2];      /* rank, world, ranks per node, run id: (name, value); value of the
                                  * rank: set per rank */
    const char *step_var, *step; /* Slurm's SLURM_STEP_ID (or NULL) */
    int nodes[2];                /* the cluster nodes of its job nodes 0 and 1 */
};

/* 4 ranks, 2 per node, launched as torchrun or srun would on node set l->nodes: mlp_train gets
 * no --rank, --world, --job or --ranks-per-node, only the variables; it trains to a reference
 * given the world explicitly */
static void launched(const struct launch *l)
{
    char dump[400], ref[400];
    snprintf(dump, sizeof(dump), "%s/%s.bin", cl.base, l->job);
    snprintf(ref, sizeof(ref), "%s/%s-ref.bin", cl.base, l->job);
    const char *common[] = {"--plan",         "zero3", "--steps", "8", "--accum",      "2",
                            "--hidden",       "96",    "--seed",  "5", "--compute-ms", "2",
                            "--compute-mode", "sleep", "--quiet"};
    size_t nc = sizeof(common) / sizeof(common[0]);
    pid_t pids[5];
    char list[64], port[16];
    if (indep) { /* the leader as the launcher names it: torchrun's MASTER_ADDR, srun's list */
        job_env(l->job, l->nodes[0]);
        if (l->step_var != NULL) {
            unsetenv("MASTER_ADDR");
            unsetenv("SHARD_LEADER");
            snprintf(list, sizeof(list), "%s,%s", cl.netns ? cl.addr[l->nodes[0]] : "127.0.0.1",
                     cl.netns ? cl.addr[l->nodes[1]] : "127.0.0.1");
            setenv("SLURM_STEP_NODELIST", list, 1);
            snprintf(port, sizeof(port), "%d", cl.port + l->nodes[0]);
            if (!cl.netns)
                setenv("SHARD_LEADER_PORT", port, 1);
        }
    }
    for (int rank = 0; rank < 4; rank++) {
        char rs[16], log[400];
        snprintf(rs, sizeof(rs), "%d", rank);
        snprintf(log, sizeof(log), "%s/%s-%d.log", cl.base, l->job, rank);
        setenv(l->vars[0][0], rs, 1);
        for (int v = 1; v < 4; v++)
            setenv(l->vars[v][0], l->vars[v][1], 1);
        if (l->step_var != NULL)
            setenv(l->step_var, l->step, 1);
        const char *argv[40] = {MLP_TRAIN_PATH, "--socket", cl.d[l->nodes[rank / 2]].sock};
        int n = 3;
        for (size_t i = 0; i < nc; i++)
            argv[n++] = common[i];
        if (rank == 0) {
            argv[n++] = "--dump-params";
            argv[n++] = dump;
        }
        argv[n] = NULL;
        pids[rank] = th_spawn(argv, log);
        for (int v = 0; v < 4; v++)
            unsetenv(l->vars[v][0]);
        if (l->step_var != NULL)
            unsetenv(l->step_var);
    }
    job_env(NULL, 0);
    unsetenv("SLURM_STEP_NODELIST");
    unsetenv("SHARD_LEADER_PORT");
    const char *rargv[40] = {MLP_TRAIN_PATH, "--reference", "--world", "4", "--dump-params", ref};
    int n = 6;
    for (size_t i = 0; i < nc; i++)
        rargv[n++] = common[i];
    rargv[n] = NULL;
    char rlog[400];
    snprintf(rlog, sizeof(rlog), "%s/%s-ref.log", cl.base, l->job);
    pids[4] = th_spawn(rargv, rlog);
    usleep(800000);
    json_t *doc = th_admin_json(cl.d[l->nodes[1]].sock, "jobs"), *j;
    size_t i;
    bool listed = false;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        listed |= strcmp(json_string_value(json_object_get(j, "name")), l->job) == 0 &&
                  json_integer_value(json_object_get(j, "world")) == 4 &&
                  json_integer_value(json_object_get(j, "ranks_per_node")) == 2 &&
                  json_integer_value(json_object_get(j, "node")) == 1;
    }
    json_decref(doc);
    TH_CHECK(listed,
             "%s: cluster node %d does not list job %s of world 4, 2 ranks per node, as "
             "its node 1",
             l->what, l->nodes[1], l->job);
    int failed = 0;
    for (int r = 0; r < 5; r++)
        failed += th_wait(pids[r], 120000) != 0;
    TH_CHECK(failed == 0, "%s: %d processes failed (logs %s/%s-*.log)", l->what, failed, cl.base,
             l->job);
    struct th_dump_diff dd;
    bool ok = failed == 0 && th_compare_dumps(dump, ref, 1e-5, &dd);
    TH_CHECK(ok && dd.outside == 0, "%s: job %s outside 1e-5 of its reference", l->what, l->job);
    if (ok && dd.outside == 0)
        printf("%-10s launched as %s on nodes %d %d: %zu parameters within 1e-5 of the reference "
               "(max %g)\n",
               l->job, l->what, l->nodes[0], l->nodes[1], dd.n, dd.maxd);
}

static void launchers(void)
{
    struct launch srun = {.what = "srun",
                          .job = "slurm-4242.0",
                          .vars = {{"SLURM_PROCID", NULL},
                                   {"SLURM_NTASKS", "4"},
                                   {"SLURM_NTASKS_PER_NODE", "2"},
                                   {"SLURM_JOB_ID", "4242"}},
                          .step_var = "SLURM_STEP_ID",
                          .step = "0",
                          .nodes = {5, 2}};
    struct launch torchrun = {.what = "torchrun",
                              .job = "torch-run7",
                              .vars = {{"RANK", NULL},
                                       {"WORLD_SIZE", "4"},
                                       {"LOCAL_WORLD_SIZE", "2"},
                                       {"TORCHELASTIC_RUN_ID", "run7"}},
                              .nodes = {4, 3}};
    launched(&srun);
    launched(&torchrun);
}

/* ---- refusals, through libshard */

struct reg {
    int node, rank;
    const char *job;
    int st;
    char err[512];
};

static void *reg_thread(void *arg)
{
    struct reg *r = arg;
    r->st = th_register_one(cl.d[r->node].sock, r->job, (uint32_t)r->rank, 4, 2, r->err,
                            sizeof(r->err));
    return NULL;
}

/* nodes 1 and 2 both register ranks 0..1 of a job of world 4 (its node 0): the coordinator
 * refuses it to both, naming them */
static void refusals(const char *job)
{
    struct reg r[] = {{.node = 1, .rank = 0, .job = job},
                      {.node = 1, .rank = 1, .job = job},
                      {.node = 2, .rank = 0, .job = job},
                      {.node = 2, .rank = 1, .job = job}};
    int n = (int)(sizeof(r) / sizeof(r[0]));
    pthread_t th[8];
    char leader[64];
    if (indep) { /* every rank names node 1's daemon the leader */
        setenv("SHARD_LEADER", th_cluster_leader(&cl, 1, leader, sizeof(leader)), 1);
        setenv("TH_JOB_SECRET", "the secret of the twice job", 1);
    }
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, reg_thread, &r[i]);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    unsetenv("SHARD_LEADER");
    unsetenv("TH_JOB_SECRET");
    for (int i = 0; i < n; i++)
        TH_CHECK(r[i].st == SHARD_EMISMATCH && strstr(r[i].err, "both registered ranks 0..1"),
                 "ranks 0..1 on nodes 1 and 2: rank %d on node %d got %d '%s'", r[i].rank,
                 r[i].node, r[i].st, r[i].err);
    printf("two nodes with the same ranks: refused: %s\n", r[0].err);
    for (int i = 0; i < N; i++) /* (those this test killed aside) */
        TH_CHECK(cl.d[i].pid == 0 || th_daemon_alive(&cl.d[i]), "node %d died", i);
}

/* what cluster node `at` says of node `of`: its state and whether a control link joins them */
static bool node_view(int at, int of, const char *state, bool link)
{
    json_t *doc = th_admin_json(cl.d[at].sock, "topology");
    json_t *e = json_array_get(json_object_get(doc, "topology"), (size_t)of);
    const char *st = json_string_value(json_object_get(e, "state"));
    bool ok = st && strcmp(st, state) == 0 && json_is_true(json_object_get(e, "link")) == link;
    json_decref(doc);
    return ok;
}

static bool wait_view(int at, int of, const char *state, bool link, double limit_s)
{
    for (double end = th_now_s() + limit_s; th_now_s() < end; usleep(100000))
        if (node_view(at, of, state, link))
            return true;
    return false;
}

/* the rank-0 log of r names text */
static void rank_log_names(const struct job_run *r, int rank, const char *text, const char *what)
{
    char log[400];
    snprintf(log, sizeof(log), "%s/%s-%d.log", cl.base, r->name, rank);
    char *t = th_read_file(log, NULL);
    TH_CHECK(t && strstr(t, text) != NULL, "%s: rank %d's log does not name '%s':\n%s", what, rank,
             text, t ? t : "(no log)");
    free(t);
}

/* The coordinator's daemon (cluster node 0) killed under four jobs: jobs between members go on
 * over their direct links and heartbeats. A on {1, 2, 4} and C on {2, 3} (as in their first
 * runs) end bitwise equal to those; F on {0, 5} fails, its ranks naming cluster node 0; while
 * the coordinator is away, a new job on {1, 3} registers (decided by the member its name picks)
 * and trains to its reference, and node 5 killed
 * fails G on {3, 5} alone, its rank on node 3 naming cluster node 5 (no coordinator told it: its
 * direct link to node 5 did). The coordinator and node 5 restarted with nothing new to
 * configure: the members rejoin with the numbers their jobs named (node 5's daemon, new to the
 * restarted coordinator, gets a number above theirs), the direct links that no job needs have
 * gone, and a job on daemons {5, 0, 1} trains to its reference. */
static void coordinator_killed(const char *const *extra)
{
    struct job_run a = A, c = C;
    char a1[400], c1[400];
    snprintf(a1, sizeof(a1), "%s", A.dump);
    snprintf(c1, sizeof(c1), "%s", C.dump);
    struct job_run f = {.job = "f",
                        .plan = "zero3",
                        .world = 2,
                        .rpn = 1,
                        .n_nodes = 2,
                        .nodes = {0, 5},
                        .steps = 400};
    struct job_run g = {.job = "g",
                        .plan = "zero3",
                        .world = 2,
                        .rpn = 1,
                        .n_nodes = 2,
                        .nodes = {3, 5},
                        .steps = 400};
    /* slower (the compute is a sleep: the numbers are the first runs'), so that the
     * coordinator goes while they run */
    a.extra[0] = c.extra[0] = "--compute-ms";
    a.extra[1] = c.extra[1] = "300";
    job_start(&c, "4");
    job_start(&a, "4");
    job_start(&f, "4");
    job_start(&g, "4");
    /* every job running (A and C a step in, not done) before the coordinator goes */
    bool started = false;
    for (double end = th_now_s() + 30; !started && th_now_s() < end; usleep(20000))
        started = job_steps(1, a.name) >= 1 && job_steps(2, c.name) >= 1 &&
                  job_steps(0, f.name) >= 1 && job_steps(3, g.name) >= 1;
    TH_CHECK(started, "the four jobs did not all start within 30 s");
    kill(cl.d[0].pid, SIGKILL);
    th_wait(cl.d[0].pid, 10000);
    cl.d[0].pid = 0;
    long long sa = job_steps(1, a.name), sc = job_steps(2, c.name);
    TH_CHECK(sa >= 0 && sa < T && sc >= 0 && sc < T,
             "A (%lld steps) and C (%lld) were not mid-run when the coordinator went", sa, sc);
    /* node 2's view while A and C still run: node 0 down, direct links (and heartbeats) with
     * A's and C's other nodes (taken before f's end is awaited, and shown to be mid-run) */
    TH_CHECK(wait_view(2, 0, "down", false, 10), "node 2 does not list node 0 down");
    for (int n = 1; n <= 4; n++)
        if (n != 2)
            TH_CHECK(node_view(2, n, "up", true),
                     "node 2 lists node %d without a direct link while A or C spans both", n);
    sc = job_steps(2, c.name);
    TH_CHECK(sc >= 0 && sc < T,
             "C ended (%lld steps) before node 2's view was read: the check "
             "above proved nothing (make C's steps slower)",
             sc);
    int failed = job_wait(&f);
    TH_CHECK(failed == f.world, "job f on {0, 5}: %d of its %d ranks failed after node 0 died",
             failed, f.world);
    rank_log_names(&f, 1, "cluster node 0", "job f (its rank on node 5)");
    /* a new job between members registers without the coordinator: one of the members up,
     * picked by the job's name, decides it, over the direct links */
    struct job_run m = {.job = "m",
                        .plan = "zero3",
                        .world = 2,
                        .rpn = 1,
                        .n_nodes = 2,
                        .nodes = {1, 3},
                        .steps = T};
    job_start(&m, "4");
    job_finish(&m);
    refusals("twice-4"); /* (and refused, naming both, by the member that decides it) */
    char *l1 = th_read_file(cl.d[1].log, NULL);
    TH_CHECK(l1 && strstr(l1, "job 'm-4' registers without the coordinator: node "),
             "node 1 does not say who decided job m-4 without the coordinator");
    free(l1);
    kill(cl.d[5].pid, SIGKILL);
    th_wait(cl.d[5].pid, 10000);
    cl.d[5].pid = 0;
    failed = job_wait(&g);
    TH_CHECK(failed > 0, "job g on {3, 5} went on after node 5 died");
    rank_log_names(&g, 0, "cluster node 5", "job g (its rank on node 3)");
    for (struct job_run *r = &a; r != NULL; r = r == &a ? &c : NULL) {
        failed = job_wait(r);
        TH_CHECK(failed == 0, "%s: %d ranks failed after the coordinator died", r->name, failed);
        struct th_dump_diff dd;
        bool ok = th_compare_dumps(r->dump, r == &a ? a1 : c1, 0, &dd);
        TH_CHECK(ok && dd.differ == 0,
                 "%s: %zu of %zu parameters differ from its first run (max %g)", r->name, dd.differ,
                 dd.n, dd.maxd);
        if (ok && dd.differ == 0)
            printf("%-10s finished without the coordinator, bitwise equal to its first run\n",
                   r->name);
    }
    /* the link C needed goes once no job needs it (A's to nodes 1 and 4 stay: the job that
     * lost node 4 keeps its state there for resume_timeout_ms, a recovery may need them) */
    TH_CHECK(wait_view(2, 3, "up", false, 15),
             "node 2 keeps a direct link to node 3 after C ended");
    TH_CHECK(th_cluster_node_restart(&cl, 0, extra) == 0, "the coordinator did not restart");
    for (int n = 1; n <= 4; n++) {
        TH_CHECK(wait_view(n, 0, "up", true, 20), "node %d did not rejoin the coordinator", n);
        json_t *doc = th_admin_json(cl.d[n].sock, "topology");
        TH_CHECK(json_integer_value(json_object_get(doc, "node")) == n,
                 "cluster node %d rejoined the restarted coordinator as node %lld", n,
                 json_integer_value(json_object_get(doc, "node")));
        json_decref(doc);
    }
    TH_CHECK(th_cluster_node_restart(&cl, 5, extra) == 0, "node 5 did not restart");
    /* a fresh daemon: numbered anew, above the numbers the members brought back (number 5,
     * which the restarted coordinator never saw, might be a member's still on its way) */
    int five = -1;
    for (double end = th_now_s() + 20; five < 0 && th_now_s() < end; usleep(100000)) {
        json_t *doc = th_admin_json(cl.d[5].sock, "topology");
        if (json_is_true(json_object_get(doc, "cluster_ready")))
            five = (int)json_integer_value(json_object_get(doc, "node"));
        json_decref(doc);
    }
    TH_CHECK(five >= N,
             "the restarted daemon 5 is node %d (the numbers below %d are the "
             "members')",
             five, N);
    TH_CHECK(five > 0 && wait_view(1, five, "up", false, 20),
             "node 1 does not list the restarted daemon 5 (node %d) up", five);
    struct job_run h = {.job = "h",
                        .plan = "zero3",
                        .world = 3,
                        .rpn = 1,
                        .n_nodes = 3,
                        .nodes = {5, 0, 1},
                        .steps = T};
    job_start(&h, "4");
    job_finish(&h);
    for (int n = 0; n < N; n++)
        TH_CHECK(th_daemon_alive(&cl.d[n]), "cluster node %d died", n);
}

int main(int argc, char **argv)
{
    indep = argc > 1 && strcmp(argv[1], "independent") == 0;
    const char *extra[] = {"--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "1500",
                           NULL};
    /* independent daemons configured for 4 ranks per node (nodes with more devices): every
     * job gives its own, 2 or 1 */
    const char *indep_extra[] = {"--heartbeat-interval-ms",
                                 "100",
                                 "--heartbeat-timeout-ms",
                                 "1500",
                                 "--ranks-per-node",
                                 "4",
                                 NULL};
    const char *const *args = indep ? indep_extra : extra;
    int rc =
        indep ? th_indep_cluster_start(&cl, N, true, args) : th_netns_cluster_start(&cl, N, args);
    if (rc == TH_NO_NETNS) { /* the same daemons on loopback: what the test shows holds there */
        printf("no network namespaces here (not root, or no iproute2): the nodes share "
               "loopback\n");
        rc = indep ? th_indep_cluster_start(&cl, N, false, args)
                   : th_open_cluster_start(&cl, N, args);
    }
    if (rc != 0) {
        fprintf(stderr, "cannot start %d daemons\n", N);
        return 1;
    }
    printf("%s of %d daemons%s: no node list, no ranks per node\n",
           indep ? "independent daemons (no cluster at all)" : "an open cluster", N,
           cl.netns ? ", each in a network namespace of its own" : "");
    side_by_side();
    node_killed();
    node_back(args);
    save_elsewhere();
    launchers();
    refusals("twice");
    if (!indep) /* (independent daemons have no coordinator) */
        coordinator_killed(extra);
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_node_sets");
}

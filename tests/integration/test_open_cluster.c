/* An open cluster (issue 38, daemons without a cluster list): every daemon starts with
 * --nodes 0 and nothing about its place (no index, no node count, no ranks per node); node 0
 * is the coordinator, and numbers the others as they join. On loopback (tcp;ofi_rxm), real
 * trainer processes:
 * - 4 daemons join one after the other and are numbered 0..3; jobs placed on daemons {3, 1}
 *   (2 ranks each, zero3) and {0, 2, 3} (1 each, topo:1/3/3) train to their references;
 * - a fifth daemon joins the running cluster (numbered 4) while a job on {3, 1} trains, which
 *   reaches its reference all the same (every node's address table grew under it); a job on
 *   {4, 0} trains;
 * - daemon 1 killed and started again with the same arguments: numbered 1 again, and a job on
 *   {1, 4} trains;
 * - the coordinator killed and started again: the members rejoin it with nothing to configure,
 *   each with the number it had, and a job on {2, 3} trains; meanwhile something at its port
 *   accepts their reconnects and closes them (a coordinator still exiting), and they go on;
 * - killed and started again under a job on {2, 3}, which trains on to its reference; the
 *   restarted coordinator confirms later jobs with transport tags that job does not use;
 * - refused with a clear message: a daemon of an open cluster given an index other than the
 *   coordinator's (at its start), and a fixed cluster's daemon (--nodes 3 --node 1) that tries
 *   to join the open coordinator (it calls itself node 1). */
#include "harness.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define N 4

static struct th_cluster cl;

/* the node the daemon at sock says it is, and how many the cluster has (-1: no answer) */
static void numbered(const char *sock, int *node, int *nodes)
{
    json_t *doc = th_admin_json(sock, "topology");
    *node = doc ? (int)json_integer_value(json_object_get(doc, "node")) : -1;
    *nodes = doc ? (int)json_integer_value(json_object_get(doc, "nodes")) : -1;
    json_decref(doc);
}

/* world ranks of job, k per daemon, on the daemons listed in on (its node i on daemon on[i]);
 * within 1e-5 of the one-process reference */
static const char *train_steps = "8", *train_compute_ms = "0";

static void train(const char *job, const char *plan, int k, int world, const int *on)
{
    const char *socks[N + 1];
    for (int i = 0; i < world / k; i++)
        socks[i] = cl.d[on[i]].sock;
    char w[16], ks[16], dump[400], ref[400];
    snprintf(w, sizeof(w), "%d", world);
    snprintf(ks, sizeof(ks), "%d", k);
    snprintf(dump, sizeof(dump), "%s/%s.bin", cl.base, job);
    snprintf(ref, sizeof(ref), "%s/%s-ref.bin", cl.base, job);
    const char *args[] = {"--world",          w,         "--plan", plan,       "--steps",
                          train_steps,        "--accum", "2",      "--hidden", "96",
                          "--ranks-per-node", ks,        "--seed", "7",        "--compute-ms",
                          train_compute_ms,   "--quiet", NULL};
    int rcs[TH_MAX_RANKS + 1];
    int failed = th_train(cl.base, job, socks, k, world, args, dump, ref, rcs);
    TH_CHECK(failed == 0, "%s: %d processes failed (logs %s/%s-*.log)", job, failed, cl.base, job);
    if (failed)
        return;
    struct th_dump_diff dd;
    bool ok = th_compare_dumps(dump, ref, 1e-5, &dd);
    TH_CHECK(ok && dd.outside == 0, "%s (%s): %zu of %zu parameters outside 1e-5 (max %g)", job,
             plan, dd.outside, dd.n, dd.maxd);
    if (ok && dd.outside == 0) {
        printf("%-8s %-8s world %d on daemons", job, plan, world);
        for (int i = 0; i < world / k; i++)
            printf(" %d", on[i]);
        printf(": within 1e-5 of the reference (max %g)\n", dd.maxd);
    }
}

/* wait until the daemon at sock has an address table of `nodes` nodes, 20 s at most */
static bool wait_nodes(const char *sock, int nodes)
{
    for (double end = th_now_s() + 20; th_now_s() < end; usleep(100000)) {
        int node, n;
        numbered(sock, &node, &n);
        json_t *doc = th_admin_json(sock, "topology");
        bool ready = json_is_true(json_object_get(doc, "cluster_ready"));
        json_decref(doc);
        if (ready && n == nodes && node >= 0)
            return true;
    }
    return false;
}

static void kill_daemon(int i)
{
    kill(cl.d[i].pid, SIGKILL);
    th_wait(cl.d[i].pid, 10000);
    cl.d[i].pid = 0;
}

static void joined_in_order(void)
{
    for (int i = 0; i < N; i++) {
        int node, nodes;
        numbered(cl.d[i].sock, &node, &nodes);
        TH_CHECK(node == i && nodes >= i + 1,
                 "daemon %d (joined %d-th) is node %d of %d, expected node %d", i, i, node, nodes,
                 i);
    }
    train("across", "zero3", 2, 4, (const int[]){3, 1});
    train("threes", "topo:1/3/3", 1, 3, (const int[]){0, 2, 3});
}

/* is job running at the daemon at sock? */
static bool job_running(const char *sock, const char *job)
{
    json_t *doc = th_admin_json(sock, "jobs");
    bool running = false;
    size_t i;
    json_t *j;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        const char *name = json_string_value(json_object_get(j, "name"));
        const char *state = json_string_value(json_object_get(j, "state"));
        running |= name && state && strcmp(name, job) == 0 && strcmp(state, "running") == 0;
    }
    json_decref(doc);
    return running;
}

/* a job on {3, 1} long enough to be running while the fifth daemon joins */
static void *train_during(void *arg)
{
    (void)arg;
    train("during", "zero3", 2, 4, (const int[]){3, 1});
    return NULL;
}

static void fifth_joins(const char *const *extra)
{
    cl.nodes = N + 1;
    train_steps = "40";
    train_compute_ms = "25";
    pthread_t th;
    pthread_create(&th, NULL, train_during, NULL);
    usleep(1500000); /* the job registered and trains */
    int started = th_cluster_node_restart(&cl, N, extra);
    bool joined = started == 0 && wait_nodes(cl.d[N].sock, N + 1);
    /* the job was still training once node 3 (one of its daemons) knew the fifth */
    bool running = joined && wait_nodes(cl.d[3].sock, N + 1) && job_running(cl.d[3].sock, "during");
    pthread_join(th, NULL); /* its checks: trained to its reference while the table grew */
    TH_CHECK(running, "the job on {3, 1} still trained when its daemons knew the fifth");
    train_steps = "8";
    train_compute_ms = "0";
    TH_CHECK(started == 0, "a fifth daemon did not start");
    int node, nodes;
    TH_CHECK(joined, "the fifth daemon did not join");
    numbered(cl.d[N].sock, &node, &nodes);
    TH_CHECK(node == N && nodes == N + 1, "the fifth daemon is node %d of %d", node, nodes);
    TH_CHECK(wait_nodes(cl.d[0].sock, N + 1), "node 0 does not list the fifth daemon");
    train("fifth", "zero3", 2, 4, (const int[]){4, 0});
}

static void member_restarts(const char *const *extra)
{
    kill_daemon(1);
    usleep(500000);
    TH_CHECK(th_cluster_node_restart(&cl, 1, extra) == 0, "daemon 1 did not start again");
    TH_CHECK(wait_nodes(cl.d[1].sock, N + 1), "daemon 1 did not rejoin");
    int node, nodes;
    numbered(cl.d[1].sock, &node, &nodes);
    TH_CHECK(node == 1, "daemon 1 restarted as node %d (the lowest free number is 1)", node);
    /* the others may still see it down for a moment: wait for node 4's view */
    for (double end = th_now_s() + 10; th_now_s() < end; usleep(100000)) {
        json_t *doc = th_admin_json(cl.d[4].sock, "topology");
        const char *st = json_string_value(
            json_object_get(json_array_get(json_object_get(doc, "topology"), 1), "state"));
        bool up = st && strcmp(st, "up") == 0;
        json_decref(doc);
        if (up)
            break;
    }
    train("back", "zero3", 2, 4, (const int[]){1, 4});
}

/* While the coordinator is away, something at its port accepts the members' reconnects and
 * closes them at once, for 2.5 s (a coordinator still exiting does that: its listening socket
 * outlives its loop): each member is connected, then reset, before any table; it must go on
 * trying. */
static void accept_and_close(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)cl.port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    int closed = 0;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 && listen(fd, 16) == 0) {
        for (double end = th_now_s() + 2.5; th_now_s() < end;) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            if (poll(&p, 1, 100) == 1) {
                int c = accept(fd, NULL, NULL);
                if (c >= 0) {
                    close(c);
                    closed++;
                }
            }
        }
    }
    close(fd);
    TH_CHECK(closed >= N, "the members reconnected %d times while the coordinator was away",
             closed);
}

/* the coordinator killed and started again with its arguments; every member rejoins it */
static void restart_coordinator(const char *const *extra, const char *when, bool impostor)
{
    kill_daemon(0);
    usleep(500000);
    if (impostor)
        accept_and_close();
    TH_CHECK(th_cluster_node_restart(&cl, 0, extra) == 0, "the coordinator did not start again%s",
             when);
    bool all = true;
    for (int i = 0; i <= N; i++)
        all &= wait_nodes(cl.d[i].sock, N + 1);
    TH_CHECK(all, "the members did not all rejoin the restarted coordinator%s", when);
}

static void coordinator_restarts(const char *const *extra)
{
    restart_coordinator(extra, "", true);
    for (int i = 1; i <= N; i++) { /* with the numbers they had, whatever order they came in */
        int node, nodes;
        numbered(cl.d[i].sock, &node, &nodes);
        TH_CHECK(node == i, "daemon %d rejoined the restarted coordinator as node %d", i, node);
    }
    for (int i = 2; i <= 3; i++) /* until both see each other up again */
        for (double end = th_now_s() + 10; th_now_s() < end; usleep(100000)) {
            json_t *doc = th_admin_json(cl.d[i].sock, "topology");
            size_t j;
            json_t *e;
            int up = 0;
            json_array_foreach(json_object_get(doc, "topology"), j, e)
            {
                const char *st = json_string_value(json_object_get(e, "state"));
                up += st && (strcmp(st, "up") == 0 || strcmp(st, "self") == 0);
            }
            json_decref(doc);
            if (up == N + 1)
                break;
        }
    train("again", "zero3", 2, 4, (const int[]){2, 3});
}

static void *train_survivor(void *arg)
{
    (void)arg;
    train("survivor", "zero3", 2, 4, (const int[]){2, 3});
    return NULL;
}

/* A job on {2, 3} (the restarted coordinator's second, so transport tag 2) trains while the
 * coordinator is killed and restarted again, and reaches its reference: it runs between members.
 * Then two jobs: the new coordinator gives the first tag 1, and the second, on {3, 1}, a tag
 * other than 2, which node 3's job still uses (node 3 reports it). */
static void coordinator_restarts_under_a_job(const char *const *extra)
{
    train_steps = "40"; /* about 16 s here (0.4 s a step, as "during"): the restart and two
                         * jobs take 6 */
    train_compute_ms = "25";
    pthread_t th;
    pthread_create(&th, NULL, train_survivor, NULL);
    bool running = false;
    for (double end = th_now_s() + 20; !running && th_now_s() < end; usleep(100000))
        running = job_running(cl.d[2].sock, "survivor") && job_running(cl.d[3].sock, "survivor");
    TH_CHECK(running, "the job on {2, 3} did not start");
    train_steps = "8";
    train_compute_ms = "0";
    restart_coordinator(extra, " (under a job)", false);
    TH_CHECK(job_running(cl.d[3].sock, "survivor"),
             "the job on {2, 3} did not outlive the coordinator");
    train("after1", "zero3", 2, 4, (const int[]){1, 4});
    train("after2", "zero3", 2, 4, (const int[]){3, 1});
    TH_CHECK(job_running(cl.d[3].sock, "survivor"),
             "the job on {2, 3} ended before the jobs after it were confirmed (the check of "
             "its tag did not happen)");
    pthread_join(th, NULL); /* its checks: its reference */
}

static void refusals(void)
{
    /* an index other than the coordinator's, in an open cluster: refused at its start */
    char out[400], key[128], coord[64];
    snprintf(out, sizeof(out), "%s/indexed.log", cl.base);
    snprintf(key, sizeof(key), "%s/cluster.key", cl.base);
    snprintf(coord, sizeof(coord), "127.0.0.1:%d", cl.port);
    const char *indexed[] = {SHARDD_PATH, "--runtime-dir",
                             cl.base,     "--nodes",
                             "0",         "--node",
                             "3",         "--coordinator",
                             coord,       "--cluster-secret-file",
                             key,         NULL};
    int rc = th_wait(th_spawn(indexed, out), 20000);
    char *text = th_read_file(out, NULL);
    TH_CHECK(rc == 2 && text && strstr(text, "option 'node' is 3 in an open cluster"),
             "a daemon of an open cluster given node 3: exit %d, '%s'", rc, text ? text : "");
    free(text);
    /* a fixed cluster's daemon at the open coordinator: another configuration */
    struct th_daemon fixed = {0};
    snprintf(fixed.dir, sizeof(fixed.dir), "%s/fixed", cl.base);
    const char *fargs[] = {"--nodes",
                           "3",
                           "--node",
                           "1",
                           "--ranks-per-node",
                           "1",
                           "--coordinator",
                           coord,
                           "--cluster-secret-file",
                           key,
                           "--rendezvous-timeout-ms",
                           "5000",
                           NULL};
    if (th_daemon_start(&fixed, fargs) == 0) {
        rc = th_wait(fixed.pid, 20000);
        fixed.pid = 0;
        text = th_read_file(fixed.log, NULL);
        TH_CHECK(rc != 0 && text && strstr(text, "joins an open cluster (nodes 0)"),
                 "a fixed cluster's daemon joining the open one: exit %d, log %s:\n%s", rc,
                 fixed.log, text ? text : "");
        free(text);
    } else {
        TH_CHECK(fixed.pid == 0, "the fixed cluster's daemon neither started nor exited");
    }
    for (int i = 0; i <= N; i++)
        TH_CHECK(th_daemon_alive(&cl.d[i]), "daemon %d died", i);
}

int main(void)
{
    const char *extra[] = {"--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "1500",
                           NULL};
    if (th_open_cluster_start(&cl, N, extra) != 0) {
        fprintf(stderr, "cannot start an open cluster of %d daemons\n", N);
        return 1;
    }
    joined_in_order();
    fifth_joins(extra);
    member_restarts(extra);
    coordinator_restarts(extra);
    coordinator_restarts_under_a_job(extra);
    refusals();
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_open_cluster");
}

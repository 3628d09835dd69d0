/* An independent daemon gives its fabric back when it has no job (fabric_idle_close_ms, issue
 * 61's idle cost): two independent daemons on loopback closing theirs 400 ms after their last
 * job went.
 * - job a across both (zero3, 1 rank a node, 10 steps of about 160 ms: longer than the 400 ms, so a
 *   close while a job is here would fail it) trains to its one-process reference;
 * - then each daemon closes its fabric: it logs so, the leader's peer port refuses connections
 *   and its resident memory comes back within 32 MB of what it was before the first job
 *   (ofi_rxm's pools on tcp are about 280 MB; the benchmark tools/bench/idle.sh measures it);
 * - job b across both opens them again (the daemons meet as restarted ones would: new ids) and
 *   trains to the same reference, twice in a row (open, close, open, close);
 * - shardd_fabric_open (GET /metrics) is 0 before any job and after each close, 1 while a job
 *   across nodes registers. */
#include "harness.h"
#include "shard.h"

#include <jansson.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static struct th_cluster cl;
static const char *const extra[] = {"--fabric-idle-close-ms",
                                    "400",
                                    "--metrics-listen",
                                    "127.0.0.1:0",
                                    "--register-timeout-ms",
                                    "3000",
                                    NULL};
static const char closed[] = "the fabric and the peer links are closed";

/* daemon i's log says text n times within 20 s */
static bool log_reaches(int i, const char *text, int n)
{
    for (double end = th_now_s() + 20; th_now_s() < end; usleep(50000))
        if (th_count_in_file(cl.d[i].log, text) >= n)
            return true;
    return false;
}

/* daemon i's resident memory (its pid as shardctl status gives it) */
static long rss_kb(int i)
{
    struct json_t *st = th_admin_json(cl.d[i].sock, "status");
    long long pid = st != NULL ? th_json_int(st, "pid") : -1;
    json_decref(st);
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%lld/status", pid);
    FILE *f = fopen(path, "r"); /* (a file of /proc has no size to read it by) */
    long kb = -1;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, "VmRSS:", 6) == 0)
            kb = strtol(line + 6, NULL, 10);
    if (f != NULL)
        fclose(f);
    return kb;
}

/* daemon i's GET /metrics: the value of shardd_fabric_open, or -1 */
static int fabric_open_metric(int i)
{
    struct json_t *st = th_admin_json(cl.d[i].sock, "status");
    const char *at = json_string_value(json_object_get(st, "metrics_listen"));
    char host[64] = "";
    snprintf(host, sizeof(host), "%s", at != NULL ? at : "");
    json_decref(st);
    char *colon = strrchr(host, ':');
    if (colon == NULL)
        return -1;
    *colon = '\0';
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, host, &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0), v = -1;
    static char buf[1 << 16];
    size_t got = 0;
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0) {
        const char req[] = "GET /metrics HTTP/1.0\r\n\r\n";
        if (write(fd, req, sizeof(req) - 1) == (ssize_t)sizeof(req) - 1)
            for (ssize_t n;
                 got < sizeof(buf) - 1 && (n = read(fd, buf + got, sizeof(buf) - 1 - got)) > 0;)
                got += (size_t)n;
    }
    if (fd >= 0)
        close(fd);
    buf[got] = '\0';
    const char *line = strstr(buf, "\nshardd_fabric_open ");
    if (line != NULL)
        v = atoi(line + strlen("\nshardd_fabric_open "));
    return v;
}

/* a TCP connection to host:port is accepted */
static bool accepts(const char *leader)
{
    char host[64];
    snprintf(host, sizeof(host), "%s", leader);
    char *colon = strrchr(host, ':');
    if (colon == NULL)
        return false;
    *colon = '\0';
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, host, &a.sin_addr);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* shardctl topology of daemon i after its n-th close: it says so, and the ended job still names
 * its two daemons by their ids (their numbers were the closed cluster's, which the next opening
 * reuses) */
static void topology_after_close(int i, int n, const char *job)
{
    struct json_t *t = th_admin_json(cl.d[i].sock, "topology");
    TH_CHECK(th_json_int(t, "fabric_closes") == n, "daemon %d's topology: fabric_closes %lld, %d",
             i, th_json_int(t, "fabric_closes"), n);
    size_t k, m;
    struct json_t *j, *d;
    int listed = 0, named = 0;
    char first[16] = "";
    json_array_foreach(json_object_get(t, "jobs"), k, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "name")), job) != 0)
            continue;
        listed++;
        json_array_foreach(json_object_get(j, "node_daemons"), m, d)
        {
            const char *id = json_string_value(d);
            named += id != NULL && strlen(id) == 8 && strcmp(id, first) != 0;
            if (id != NULL && m == 0)
                snprintf(first, sizeof(first), "%s", id);
        }
    }
    TH_CHECK(listed == 1 && named == 2,
             "daemon %d's topology after the close: job %s listed %d time(s), %d distinct daemon "
             "id(s) (2 expected)",
             i, job, listed, named);
    json_decref(t);
}

struct lone {
    int st;
    char err[512];
};

/* rank 0 of job "lone" (world 2 across 2 nodes, whose rank 1 never comes) on daemon 0 */
static void *register_lone(void *arg)
{
    struct lone *l = arg;
    char leader[64];
    l->st = th_register_secret(cl.d[0].sock, "lone", 0, 2, "the secret of job lone, 16+ bytes",
                               th_cluster_leader(&cl, 0, leader, sizeof(leader)), l->err,
                               sizeof(l->err));
    return NULL;
}

/* the metric says open while a job across nodes is here, closed once it went */
static void metric_follows(void)
{
    struct lone l = {0};
    pthread_t th;
    pthread_create(&th, NULL, register_lone, &l);
    int v = -1;
    for (double end = th_now_s() + 10; th_now_s() < end && v != 1; usleep(20000))
        v = fabric_open_metric(0);
    TH_CHECK(v == 1, "daemon 0's shardd_fabric_open while a job across nodes registers: %d", v);
    pthread_join(th, NULL);
    TH_CHECK(l.st == SHARD_ETIMEDOUT, "job lone's rank 0 alone: %d '%s'", l.st, l.err);
    for (double end = th_now_s() + 20; th_now_s() < end && v != 0; usleep(50000))
        v = fabric_open_metric(0);
    TH_CHECK(v == 0, "daemon 0's shardd_fabric_open after job lone went: %d", v);
}

static void train(const char *job, const char *what)
{
    const char *args[] = {"--world", "2",  "--ranks-per-node", "1",  "--plan",         "zero3",
                          "--steps", "10", "--compute-ms",     "20", "--compute-mode", "sleep",
                          "--quiet", NULL};
    struct th_dump_diff dd;
    bool ok = th_cluster_train(&cl, job, args, what, 1e-5, &dd) && dd.outside == 0;
    TH_CHECK(ok, "%s: outside 1e-5 of its reference", what);
    if (ok)
        printf("%s: trained to its reference (%zu parameters, max %g)\n", what, dd.n, dd.maxd);
}

int main(void)
{
    if (th_indep_cluster_start(&cl, 2, false, extra) != 0) {
        fprintf(stderr, "cannot start 2 independent daemons\n");
        return 1;
    }
    cl.k = 1;
    char leader[64], secret[400];
    th_cluster_leader(&cl, 0, leader, sizeof(leader));
    snprintf(secret, sizeof(secret), "%s/job.secret", cl.base);
    FILE *f = fopen(secret, "w");
    TH_CHECK(f != NULL && fputs("the jobs' secret, 16 bytes or more", f) >= 0 && fclose(f) == 0,
             "the jobs' secret");
    setenv("SHARD_LEADER", leader, 1);
    setenv("SHARD_JOB_SECRET_FILE", secret, 1);
    long fresh[2];
    for (int i = 0; i < 2; i++)
        fresh[i] = rss_kb(i);
    TH_CHECK(!accepts(leader), "daemon 0 listens at %s before any job spans nodes", leader);
    for (int i = 0; i < 2; i++)
        TH_CHECK(fabric_open_metric(i) == 0, "daemon %d's shardd_fabric_open before any job: %d", i,
                 fabric_open_metric(i));

    const char *jobs[] = {"a", "b", "c"};
    for (int round = 1; round <= 3; round++) {
        char what[64];
        snprintf(what, sizeof(what), "job %s (the fabric opened %s)", jobs[round - 1],
                 round == 1 ? "first" : "again");
        train(jobs[round - 1], what);
        for (int i = 0; i < 2; i++) {
            TH_CHECK(th_count_in_file(cl.d[i].log, "a job spans nodes: the fabric") == round,
                     "daemon %d opened its fabric %d times for %d jobs", i,
                     th_count_in_file(cl.d[i].log, "a job spans nodes: the fabric"), round);
            TH_CHECK(log_reaches(i, closed, round), "daemon %d did not close its fabric after %s",
                     i, what);
        }
        /* (the listener closes with the rest) */
        TH_CHECK(!accepts(leader), "daemon 0 still listens at %s after closing its fabric", leader);
        for (int i = 0; i < 2; i++) {
            TH_CHECK(fabric_open_metric(i) == 0, "daemon %d's shardd_fabric_open after %s: %d", i,
                     what, fabric_open_metric(i));
            topology_after_close(i, round, jobs[round - 1]);
        }
#ifdef TH_SANITIZED /* (AddressSanitizer's allocator keeps what is freed in its quarantine) */
        printf("resident memory: measured by the plain pass, not under the sanitizers\n");
        continue;
#endif
        for (int i = 0; i < 2; i++) {
            long kb = 0;
            /* (malloc_trim runs 100 ms after the close) */
            for (double end = th_now_s() + 5; th_now_s() < end; usleep(50000))
                if ((kb = rss_kb(i)) - fresh[i] < 32 * 1024)
                    break;
            TH_CHECK(kb > 0 && kb - fresh[i] < 32 * 1024,
                     "daemon %d after %s: %ld kB resident, %ld kB before the first job", i, what,
                     kb, fresh[i]);
            printf("daemon %d after %s closed its fabric: %ld kB resident (%ld kB fresh)\n", i,
                   what, kb, fresh[i]);
        }
    }
    metric_follows();
    for (int i = 0; i < 2; i++)
        TH_CHECK(th_daemon_alive(&cl.d[i]), "daemon %d died", i);
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_fabric_idle");
}

/* No local client can stall a daemon or split the cluster (issue 24). On a 2-node cluster a
 * 2-rank job (one rank per node) trains while, against node 1's socket:
 *   - a client registers a model of 64K tensors (the last two of one name: every check runs,
 *     then the registration is refused);
 *   - a client pipelines thousands of `status` requests and never reads a reply;
 *   - 30 connections each send 16 MiB - 1 bytes of a 16 MiB message and stop there.
 * Throughout, `status` answers within 1 s; afterwards the bystander's parameters equal its
 * reference's bitwise, its slowest step stays under 2 s (both measured and printed; asserted
 * with room for a loaded CI machine, see below), node 1's resident memory grew by less
 * than its control-memory limit (64 MiB) plus 32 MiB, no node was declared down, and the
 * daemon said why it dropped each hostile connection. */
#include "harness.h"
#include "shard.h"
#include "shard_internal.h"
#include "sd/frame.h"
#include "shard.pb-c.h"

#include <errno.h>
#include <jansson.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static struct th_cluster cl;
static atomic_int stop_polling;
static double worst_status_s;
static long peak_rss_kb;
static pid_t node1_pid;

static long rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, "VmRSS:", 6) == 0)
            kb = atol(line + 6);
    if (f != NULL)
        fclose(f);
    return kb;
}

/* status every 100 ms: the slowest answer, node 1's peak resident memory */
static void *poll_status(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop_polling)) {
        double t0 = th_now_s();
        char *js = th_admin(cl.d[1].sock, "status");
        double took = th_now_s() - t0;
        if (js == NULL || strstr(js, "\"version\"") == NULL)
            took = 99.0; /* no answer counts as the worst */
        free(js);
        if (took > worst_status_s)
            worst_status_s = took;
        long kb = rss_kb(node1_pid);
        if (kb > peak_rss_kb)
            peak_rss_kb = kb;
        usleep(100000);
    }
    return NULL;
}

static int raw_connect(const char *sock)
{
    int fd;
    char err[256];
    if (shard__connect(sock, &fd, err, sizeof(err)) != 0)
        return -1;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

/* a 64K-tensor registration, refused after every check ran */
static void *big_register(void *arg)
{
    double *took = arg;
    uint32_t n = 65536;
    shard_tensor_t *ts = th_many_tensors(n, true);
    shard_model_t m = {.job = "big",
                       .rank = 1,
                       .world = 2,
                       .plan = "zero3",
                       .tensors = ts,
                       .n_tensors = n,
                       .optimizer = {.name = "sgd", .lr = 0.1f}};
    shard_ctx_t *ctx;
    double t0 = th_now_s();
    int st = shard_attach(cl.d[1].sock, &ctx);
    if (st == 0)
        st = shard_register(ctx, &m);
    *took = th_now_s() - t0;
    TH_CHECK(st == SHARD_EINVAL && strstr(shard_last_error(ctx), "share the name"),
             "64K tensors: %d '%s'", st, shard_last_error(ctx));
    shard_detach(ctx);
    free(ts);
    return NULL;
}

/* pipelined status requests, never a reply read: returns how many went out before the daemon
 * closed the connection */
static long admin_flood(void)
{
    int fd = raw_connect(cl.d[1].sock);
    TH_CHECK(fd >= 0, "flood: connect");
    Shard__AdminRequest req = SHARD__ADMIN_REQUEST__INIT;
    req.command = "status";
    Shard__ClientMsg m = SHARD__CLIENT_MSG__INIT;
    m.msg_case = SHARD__CLIENT_MSG__MSG_ADMIN;
    m.admin = &req;
    uint8_t buf[256];
    size_t len = shard__client_msg__get_packed_size(&m);
    sd_frame_header(buf, len);
    shard__client_msg__pack(&m, buf + SD_FRAME_HDR);
    long sent = 0;
    double end = th_now_s() + 15;
    while (th_now_s() < end) {
        ssize_t w = send(fd, buf, len + SD_FRAME_HDR, MSG_NOSIGNAL);
        if (w == (ssize_t)(len + SD_FRAME_HDR)) {
            sent++;
            continue;
        }
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            usleep(1000);
            continue;
        }
        break; /* closed by the daemon */
    }
    close(fd);
    return sent;
}

/* 30 connections, each 16 MiB - 1 bytes into a 16 MiB message, round robin as the sockets take
 * them; returns how many the daemon dropped before the test gave up on them */
static int partial_frames(void)
{
    enum { N = 30 };
    const size_t total = 16u << 20;
    int fds[N];
    size_t off[N];
    bool gone[N];
    uint8_t *chunk = calloc(1, 1 << 16);
    for (int i = 0; i < N; i++) {
        fds[i] = raw_connect(cl.d[1].sock);
        off[i] = 0;
        gone[i] = fds[i] < 0;
        if (fds[i] >= 0) {
            uint8_t hdr[SD_FRAME_HDR];
            sd_frame_header(hdr, total);
            if (send(fds[i], hdr, sizeof(hdr), MSG_NOSIGNAL) != (ssize_t)sizeof(hdr))
                gone[i] = true;
        }
    }
    double end = th_now_s() + 12;
    int dropped = 0;
    while (th_now_s() < end) {
        bool moved = false;
        for (int i = 0; i < N; i++) {
            if (gone[i] || off[i] >= total - 1)
                continue;
            size_t want = total - 1 - off[i] < (1 << 16) ? total - 1 - off[i] : (1 << 16);
            ssize_t w = send(fds[i], chunk, want, MSG_NOSIGNAL);
            if (w > 0) {
                off[i] += (size_t)w;
                moved = true;
            } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
                gone[i] = true;
                dropped++;
            }
        }
        if (!moved)
            usleep(2000);
    }
    /* hold what is left open past frame_timeout_ms (3 s here): the daemon drops them */
    sleep(4);
    for (int i = 0; i < N; i++) {
        if (gone[i])
            continue;
        char c;
        ssize_t r = recv(fds[i], &c, 1, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
            dropped++;
        else { /* an error frame first: read until EOF */
            for (int k = 0; k < 100; k++) {
                char b[512];
                r = recv(fds[i], b, sizeof(b), MSG_DONTWAIT);
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
                    dropped++;
                    break;
                }
                usleep(10000);
            }
        }
        close(fds[i]);
    }
    free(chunk);
    return dropped;
}

/* n connections, each the header of a total-byte frame and sent bytes of it (blocking sends) */
static void open_partial(int *fds, int n, size_t total, size_t sent)
{
    uint8_t *chunk = calloc(1, 1 << 16);
    for (int i = 0; i < n; i++) {
        fds[i] = raw_connect(cl.d[1].sock);
        fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) & ~O_NONBLOCK);
        uint8_t hdr[SD_FRAME_HDR];
        sd_frame_header(hdr, total);
        bool ok = send(fds[i], hdr, sizeof(hdr), MSG_NOSIGNAL) == (ssize_t)sizeof(hdr);
        for (size_t off = 0; ok && off < sent; off += 1 << 16)
            ok = send(fds[i], chunk, 1 << 16, MSG_NOSIGNAL) == 1 << 16;
    }
    free(chunk);
}

/* how many of the n connections were told an error holding text; closes them */
static int close_told(const int *fds, int n, const char *text, int timeout_ms)
{
    int told = 0;
    for (int i = 0; i < n; i++) {
        uint8_t *buf = NULL;
        size_t len = 0;
        if (sd_frame_recv(fds[i], &buf, &len, NULL, 0, NULL, 1 << 16, timeout_ms) == 0) {
            Shard__DaemonMsg *m = shard__daemon_msg__unpack(NULL, len, buf);
            told += m != NULL && m->msg_case == SHARD__DAEMON_MSG__MSG_ERROR &&
                    strstr(m->error->message, text) != NULL;
            if (m)
                shard__daemon_msg__free_unpacked(m, NULL);
        }
        free(buf);
        close(fds[i]);
    }
    return told;
}

/* Hoarders first: 4 connections each send 9 MiB of a 16 MiB message and stop, which holds the
 * whole control memory (64 MiB: their buffers grew to 16 MiB); then a client sends a large
 * registration. The daemon drops the hoarders that stopped, telling them why, and serves the
 * registration (refused for its duplicate names, not reset). */
static void hoarders_first(void)
{
    enum { N = 4 };
    int fds[N];
    open_partial(fds, N, 16u << 20, 9u << 20);
    usleep(400000); /* they stopped */
    double took = 0;
    big_register(&took); /* checks the refusal for the names */
    int told = close_told(fds, N, "made no progress", 200);
    printf("4 connections hoarding the control memory: the 64K-tensor registration was served in "
           "%.2f s; %d hoarders were dropped and told why\n",
           took, told);
    TH_CHECK(told >= 1, "no hoarder was dropped for the registration");
}

static atomic_int trickling;

/* one byte to each of the connections every 50 ms: they never stall */
static void *trickle(void *arg)
{
    int *fds = arg;
    uint8_t b = 0;
    while (atomic_load(&trickling))
        for (int i = 0; i < 8 && atomic_load(&trickling); i++) {
            if (fds[i] >= 0 && send(fds[i], &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1)
                fds[i] = -1; /* dropped */
            usleep(50000 / 8);
        }
    return NULL;
}

/* Eight connections that keep sending hold the whole control memory in equal shares (8 MiB
 * each of 64 MiB): none has stopped, none holds more than the others, yet a newcomer's status
 * request is answered; one of them goes, told it held more than an equal share once the
 * newcomer counts (stopped in a loaded run of the whole suite, when the newcomer was not
 * counted among those sharing). */
static void steady_hoarders(void)
{
    enum { N = 8 };
    int fds[N], keep[N];
    open_partial(fds, N, 16u << 20, 5u << 20); /* buffers of 8 MiB */
    memcpy(keep, fds, sizeof(fds));
    atomic_store(&trickling, 1);
    pthread_t t;
    pthread_create(&t, NULL, trickle, keep);
    usleep(300000);
    double t0 = th_now_s();
    char *js = th_admin(cl.d[1].sock, "status");
    double took = th_now_s() - t0;
    TH_CHECK(js != NULL && strstr(js, "\"version\"") != NULL,
             "status beside 8 steady senders holding the control memory: %s",
             js ? js : "no answer");
    free(js);
    atomic_store(&trickling, 0);
    pthread_join(t, NULL);
    int told = close_told(fds, N, "more than an equal share", 100);
    printf("8 steady senders holding the control memory: status answered in %.3f s; %d of them "
           "dropped and told why\n",
           took, told);
    TH_CHECK(told >= 1, "no steady sender was dropped for the status request");
}

/* A client within its share that pauses mid-message (a starved process: a 64K-tensor
 * registration paused 200 ms beside the 30 senders of partial_frames and was dropped for them)
 * keeps its connection while nine senders ask for more than the control memory (9 x 8 MiB of
 * 64 MiB): the ones over a share go, and its 1 MiB status request, finished later, is answered. */
static void slow_within_share(void)
{
    static char job[1 << 20];
    memset(job, 'j', sizeof(job) - 1);
    Shard__AdminRequest req = SHARD__ADMIN_REQUEST__INIT;
    req.command = "status";
    req.job = job;
    Shard__ClientMsg m = SHARD__CLIENT_MSG__INIT;
    m.msg_case = SHARD__CLIENT_MSG__MSG_ADMIN;
    m.admin = &req;
    size_t len = shard__client_msg__get_packed_size(&m), first = 600u << 10;
    uint8_t *frame = malloc(len + SD_FRAME_HDR);
    sd_frame_header(frame, len);
    shard__client_msg__pack(&m, frame + SD_FRAME_HDR);
    int slow = raw_connect(cl.d[1].sock);
    fcntl(slow, F_SETFL, fcntl(slow, F_GETFL) & ~O_NONBLOCK);
    bool ok = send(slow, frame, first, MSG_NOSIGNAL) == (ssize_t)first;
    usleep(300000); /* it stopped */
    enum { N = 9 };
    int fds[N];
    open_partial(fds, N, 16u << 20, 5u << 20);
    ok = ok && send(slow, frame + first, len + SD_FRAME_HDR - first, MSG_NOSIGNAL) ==
                   (ssize_t)(len + SD_FRAME_HDR - first);
    uint8_t *buf = NULL;
    size_t n = 0;
    char what[256] = "no answer";
    if (ok && sd_frame_recv(slow, &buf, &n, NULL, 0, NULL, 1 << 20, 5000) == 0) {
        Shard__DaemonMsg *d = shard__daemon_msg__unpack(NULL, n, buf);
        snprintf(what, sizeof(what), "%s",
                 d == NULL                                     ? "an undecodable answer"
                 : d->msg_case == SHARD__DAEMON_MSG__MSG_ERROR ? d->error->message
                                                               : "answered");
        if (d)
            shard__daemon_msg__free_unpacked(d, NULL);
    }
    free(buf);
    free(frame);
    close(slow);
    /* some senders went: over their share, or (on a loaded machine, where filling takes long)
     * their messages incomplete past frame_timeout_ms; any error they were told counts */
    int told = close_told(fds, N, "", 100);
    printf("a 1 MiB request paused 0.3 s within its share while 9 senders filled the control "
           "memory: %s; %d senders dropped\n",
           what, told);
    TH_CHECK(strstr(what, "control memory") == NULL && strcmp(what, "no answer") != 0 &&
                 strstr(what, "undecodable") == NULL,
             "the slow client within its share: %s", what);
    TH_CHECK(told >= 1, "no sender was dropped: the control memory was never full");
}

static pid_t spawn_rank(int rank, const char *dump, const char *log)
{
    char rs[8];
    snprintf(rs, sizeof(rs), "%d", rank);
    const char *argv[] = {MLP_TRAIN_PATH,
                          "--socket",
                          cl.d[rank].sock,
                          "--job",
                          "bystander",
                          "--rank",
                          rs,
                          "--world",
                          "2",
                          "--steps",
                          "150",
                          "--plan",
                          "zero3",
                          "--hidden",
                          "128",
                          dump ? "--dump-params" : NULL,
                          dump,
                          NULL};
    return th_spawn(argv, log);
}

static double slowest_step(const char *log)
{
    char *s = th_read_file(log, NULL);
    double worst = -1;
    for (const char *p = s; p && (p = strstr(p, "step ")) != NULL; p++) {
        const char *q = strchr(p, '\n');
        const char *t = q ? q : p + strlen(p);
        while (t > p && t[-1] != ')') /* "... (rank 0 micro-batches) 0.0123 s" */
            t--;
        double v = atof(t);
        if (q && strncmp(q - 2, " s", 2) == 0 && v > worst)
            worst = v;
    }
    free(s);
    return worst;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const char *extra[] = {"--frame-timeout-ms", "3000", "--op-timeout-ms", "20000", NULL};
    if (th_cluster_start(&cl, 2, 1, extra) != 0) {
        fprintf(stderr, "cannot start a cluster of 2 nodes\n");
        return 1;
    }
    node1_pid = cl.d[1].pid;
    hoarders_first();
    steady_hoarders();
    slow_within_share();
    char dump[400], ref[400], log[2][400];
    snprintf(dump, sizeof(dump), "%s/bystander.bin", cl.d[0].dir);
    snprintf(ref, sizeof(ref), "%s/bystander-ref.bin", cl.d[0].dir);
    pid_t by[2];
    for (int r = 0; r < 2; r++) {
        snprintf(log[r], sizeof(log[r]), "%s/bystander-%d.log", cl.d[0].dir, r);
        by[r] = spawn_rank(r, r == 0 ? dump : NULL, log[r]);
    }
    usleep(1500000); /* the bystander registered: its memory is in the baseline */
    long rss0 = rss_kb(node1_pid);
    pthread_t poller, reg;
    pthread_create(&poller, NULL, poll_status, NULL);
    double reg_took = 0;
    pthread_create(&reg, NULL, big_register, &reg_took);
    long flood = admin_flood();
    int dropped = partial_frames();
    pthread_join(reg, NULL);
    for (int r = 0; r < 2; r++)
        TH_CHECK(th_wait(by[r], 120000) == 0, "bystander rank %d (log %s)", r, log[r]);
    atomic_store(&stop_polling, 1);
    pthread_join(poller, NULL);

    const char *argv[] = {MLP_TRAIN_PATH, "--reference",   "--world",  "2",
                          "--steps",      "150",           "--hidden", "128",
                          "--quiet",      "--dump-params", ref,        NULL};
    TH_CHECK(th_wait(th_spawn(argv, NULL), 60000) == 0, "bystander reference");
    struct th_dump_diff dd;
    TH_CHECK(th_compare_dumps(dump, ref, 0, &dd) && dd.differ == 0,
             "the bystander's parameters differ from its reference (%zu of %zu)", dd.differ, dd.n);
    double slow = slowest_step(log[0]);
    printf("status answered within %.3f s at worst; bystander's slowest step %.3f s; 64K-tensor "
           "registration refused in %.2f s; %ld status requests went out before the flood was "
           "cut; %d of 30 partial-frame connections dropped; node 1 RSS %ld -> %ld KiB at peak\n",
           worst_status_s, slow, reg_took, flood, dropped, rss0, peak_rss_kb);
    /* the targets are 1 s and 2 s (measured on a quiet machine: docs/benchmarks.md); ctest runs
     * beside other tests on 2 cores, so it asserts what separates a loop that is never held from
     * one that is (the stalls this guards against lasted 19 s and 150 s) */
    TH_CHECK(worst_status_s < 5.0, "status took %.3f s at worst", worst_status_s);
    TH_CHECK(slow >= 0 && slow < 5.0, "the bystander's slowest step took %.3f s", slow);
    TH_CHECK(dropped == 30, "%d of the 30 partial-frame connections were dropped", dropped);
#if defined(__SANITIZE_ADDRESS__)
    /* AddressSanitizer keeps freed memory in quarantine: resident memory says nothing here */
    printf("(ASan build: resident memory not checked)\n");
#else
    TH_CHECK(rss0 > 0 && peak_rss_kb - rss0 < (64 + 32) * 1024, "node 1 grew from %ld to %ld KiB",
             rss0, peak_rss_kb);
#endif
    json_t *st = th_admin_json(cl.d[1].sock, "status");
    TH_CHECK(th_json_int(st, "connections_dropped") >= 31,
             "node 1 counts %lld dropped connections (the flood and 30 partial frames)",
             th_json_int(st, "connections_dropped"));
    json_decref(st);
    for (int i = 0; i < 2; i++) {
        char *s = th_read_file(cl.d[i].log, NULL);
        TH_CHECK(s && !strstr(s, "is down"), "node %d declared a node down", i);
        if (i == 1) {
            TH_CHECK(s && strstr(s, "replies it has not read"), "no log line for the flood");
            TH_CHECK(s && (strstr(s, "control memory") || strstr(s, "incomplete for")),
                     "no log line for the partial frames");
        }
        free(s);
    }
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_hostile");
}

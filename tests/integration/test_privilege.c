/* Least privilege that holds (issue 24), with real daemons and real clients:
 *  - memory handed out read-only stays so: the gather pool's memfd refuses every route to a
 *    write (reopen through /proc, a writable mmap, mprotect of the client's own mapping,
 *    write(), hole punching, ftruncate); staging and ring memfds refuse resizing;
 *  - identity: with allowed_gid, a job registered by uid nobody cannot be joined by root, and
 *    nobody's shardctl sees only its own jobs and clients while root sees all; a uid outside
 *    the group is refused with a message;
 *  - fairness: one uid's 64 registrations that never complete (max_jobs 64) leave another uid's
 *    job registering at once: past max_jobs_per_uid (16) the uid's oldest are refused;
 *  - limits: past max_clients a client is told so before the close; at the process's fd limit
 *    the daemon refuses connections with a message instead of spinning on accept. */
#include "harness.h"
#include "shard.h"
#include "shard_internal.h"
#include "sd/frame.h"
#include "shard.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <grp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#define NOBODY 65534

static const float init_a[64] = {1, 2, 3, 4, 5, 6, 7, 8};

static int open_job(const char *sock, const char *name, uint32_t rank, uint32_t world,
                    shard_ctx_t **ctx_p)
{
    static uint64_t dims[1] = {64};
    static shard_tensor_t t = {.name = "a", .ndim = 1, .dims = dims, .dtype = SHARD_FP32};
    const float *init[1] = {init_a};
    shard_model_t m = {.job = name,
                       .rank = rank,
                       .world = world,
                       .plan = "zero3",
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 0.1f},
                       .init = init};
    int st = shard_attach(sock, ctx_p);
    if (st == 0)
        st = shard_register(*ctx_p, &m);
    return st;
}

/* An fd of this process's mapping of the memfd whose name holds part (libshard closes the
 * fds it maps; /proc/self/map_files reopens the mapping, as an attacker in this process would),
 * or -1. */
static int find_memfd(const char *part, int flags)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int fd = -1;
    while (f != NULL && fd < 0 && fgets(line, sizeof(line), f) != NULL) {
        char *name = strstr(line, "/memfd:");
        if (name == NULL)
            continue;
        char *end = strstr(name, " (deleted)");
        if (end == NULL)
            end = name + strcspn(name, "\n");
        *end = '\0';
        if (strstr(name, part) == NULL)
            continue;
        char range[64], path[128];
        sscanf(line, "%63s", range);
        snprintf(path, sizeof(path), "/proc/self/map_files/%s", range);
        fd = open(path, flags);
        if (fd < 0)
            fd = open(path, O_RDONLY);
    }
    if (f != NULL)
        fclose(f);
    return fd;
}

static void test_memfds(void)
{
    struct th_daemon d;
    TH_CHECK(th_daemon_start(&d, NULL) == 0, "start shardd");
    shard_ctx_t *ctx;
    TH_CHECK(open_job(d.sock, "ro", 0, 1, &ctx) == 0, "register: %s", shard_last_error(ctx));
    const void *p;
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch: %s", shard_last_error(ctx));
    int fd = find_memfd("-pool", O_RDONLY);
    TH_CHECK(fd >= 0, "the pool's memfd is mapped in this process");
    struct stat st;
    TH_CHECK(fd >= 0 && fstat(fd, &st) == 0 && (st.st_mode & 0777) == 0600,
             "pool memfd mode %o, want 0600", fd >= 0 ? (unsigned)(st.st_mode & 0777) : 0u);
    int rw = find_memfd("-pool", O_RDWR);
    float junk[4] = {-1, -1, -1, -1};
    TH_CHECK(rw < 0 || (write(rw, junk, sizeof(junk)) < 0 && errno == EPERM),
             "reopened the pool for writing and wrote into it");
    if (rw >= 0) { /* a writable fd: truncating and punching must fail on the seals too */
        TH_CHECK(ftruncate(rw, 0) != 0 && ftruncate(rw, 1 << 30) != 0, "resized the pool");
        TH_CHECK(fallocate(rw, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) != 0,
                 "punched a hole into the pool");
    }
    TH_CHECK(rw < 0 || pwrite(rw, junk, sizeof(junk), 0) < 0, "pwrite through a /proc reopen");
    if (rw >= 0) {
        void *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0);
        TH_CHECK(w == MAP_FAILED, "a writable shared mapping of the reopened pool");
        if (w != MAP_FAILED)
            munmap(w, 4096);
        close(rw);
    }
    void *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    TH_CHECK(w == MAP_FAILED, "a writable shared mapping of the pool");
    if (w != MAP_FAILED)
        munmap(w, 4096);
    /* libshard's view of the pool is private (its write guard lets a stray write land in a
     * private copy): mprotect may make a page writable, but what is written there stays in
     * this process's copy and never reaches the shared pool, which the page reads again once
     * the copy is dropped */
    void *page = (void *)((uintptr_t)p & ~(uintptr_t)4095);
    if (mprotect(page, 4096, PROT_READ | PROT_WRITE) == 0) {
        memcpy((void *)p, junk, sizeof(junk));
        TH_CHECK(madvise(page, 4096, MADV_DONTNEED) == 0 && mprotect(page, 4096, PROT_READ) == 0 &&
                     memcmp(p, init_a, sizeof(junk)) == 0,
                 "a write through an mprotect'ed view of the pool reached the shared memory");
    }
    const char *others[] = {"-staging", "shardd-ring-"};
    for (int i = 0; i < 2; i++) {
        int o = find_memfd(others[i], O_RDWR);
        TH_CHECK(o >= 0, "the %s memfd is mapped in this process", others[i]);
        TH_CHECK(o < 0 || (ftruncate(o, 0) != 0 && ftruncate(o, 1 << 30) != 0), "%s memfd resized",
                 others[i]);
        TH_CHECK(o < 0 || (fstat(o, &st) == 0 && (st.st_mode & 0777) == 0600), "%s mode %o",
                 others[i], (unsigned)(st.st_mode & 0777));
        if (o >= 0)
            close(o);
    }
    /* the weights are what they were */
    TH_CHECK(shard_release(ctx, 0) == 0 && shard_fetch(ctx, 0, &p) == 0 &&
                 memcmp(p, init_a, sizeof(init_a)) == 0,
             "the pool's weights changed");
    shard_detach(ctx);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
}

/* run fn as uid/gid in a child; its exit code */
static int as_user(uid_t uid, gid_t gid, int (*fn)(void *), void *arg)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (setgroups(0, NULL) != 0 || setgid(gid) != 0 || setuid(uid) != 0)
            _exit(99);
        _exit(fn(arg));
    }
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

struct who {
    struct th_daemon *d;
    int fd; /* a pipe: nobody's registration says when it is in */
};

/* nobody: registers rank 0 of a 2-rank job and waits (the registration blocks for rank 1) */
static int nobody_registers(void *arg)
{
    struct who *w = arg;
    shard_ctx_t *ctx;
    char one = 1;
    (void)!write(w->fd, &one, 1);
    int st = open_job(w->d->sock, "theirs", 0, 2, &ctx);
    return st == SHARD_ETIMEDOUT || st == 0 ? 0 : 1;
}

/* nobody's view: its job, no other */
static int nobody_looks(void *arg)
{
    struct who *w = arg;
    char *js = th_admin(w->d->sock, "status");
    int bad = js == NULL || strstr(js, "\"theirs\"") == NULL || strstr(js, "\"mine\"") != NULL ||
              strstr(js, "\"visibility\":\"own uid\"") == NULL;
    if (bad)
        fprintf(stderr, "nobody's status: %s\n", js ? js : "(none)");
    free(js);
    return bad;
}

static int outsider_connects(void *arg)
{
    struct who *w = arg;
    shard_ctx_t *ctx;
    int st = shard_attach(w->d->sock, &ctx);
    const char *e = shard_last_error(ctx);
    int ok = st != 0 && e != NULL && strstr(e, "allowed_gid") != NULL;
    if (!ok)
        fprintf(stderr, "outsider: %d '%s'\n", st, e ? e : "");
    if (st == 0)
        shard_detach(ctx);
    return !ok;
}

static void test_identity(void)
{
    struct th_daemon d;
    const char *args[] = {"--allowed-gid", "65534", "--register-timeout-ms", "4000", NULL};
    TH_CHECK(th_daemon_start(&d, args) == 0, "start shardd with allowed_gid");
    chmod(d.dir, 0711); /* the test's own directory, on the way to the socket */
    int p[2];
    TH_CHECK(pipe(p) == 0, "pipe");
    struct who w = {.d = &d, .fd = p[1]};
    pid_t reg = fork();
    if (reg == 0)
        _exit(as_user(NOBODY, NOBODY, nobody_registers, &w));
    char c;
    (void)!read(p[0], &c, 1);
    usleep(300000);
    /* root may not join nobody's job */
    shard_ctx_t *ctx, *mine;
    int st = open_job(d.sock, "theirs", 1, 2, &ctx);
    TH_CHECK(st == SHARD_EPERM && strstr(shard_last_error(ctx), "belongs to uid 65534"),
             "root joining nobody's job: %d '%s'", st, shard_last_error(ctx));
    shard_detach(ctx);
    TH_CHECK(open_job(d.sock, "mine", 0, 1, &mine) == 0, "root's own job: %s",
             shard_last_error(mine));
    TH_CHECK(as_user(NOBODY, NOBODY, nobody_looks, &w) == 0, "nobody sees only its own job");
    char *js = th_admin(d.sock, "status");
    TH_CHECK(js && strstr(js, "\"theirs\"") && strstr(js, "\"mine\"") &&
                 strstr(js, "\"visibility\":\"all\""),
             "root sees every job: %s", js ? js : "");
    free(js);
    /* an administrator who opens the socket to everyone: the daemon still checks the group */
    char run[400];
    snprintf(run, sizeof(run), "%s/run", d.dir);
    chmod(run, 0711);
    chmod(d.sock, 0666);
    TH_CHECK(as_user(1, 1, outsider_connects, &w) == 0, "uid 1 outside the group is refused");
    int rs;
    waitpid(reg, &rs, 0);
    TH_CHECK(WIFEXITED(rs) && WEXITSTATUS(rs) == 0, "nobody's registration");
    shard_detach(mine);
    close(p[0]);
    close(p[1]);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
}

/* ---- local fairness: one uid's registrations that never complete do not fill max_jobs */

struct hang {
    const char *sock;
    int i, st;
    char err[400];
};

static void *hang_one(void *arg)
{
    struct hang *h = arg;
    char name[32];
    snprintf(name, sizeof(name), "hang%d", h->i);
    shard_ctx_t *ctx = NULL;
    h->st = open_job(h->sock, name, 0, 2, &ctx); /* (rank 1 never comes) */
    snprintf(h->err, sizeof(h->err), "%s", ctx ? shard_last_error(ctx) : "");
    if (ctx)
        shard_detach(ctx);
    return NULL;
}

#define HANGS 64
/* nobody: 64 registrations at once, each of a job whose second rank never comes; how they
 * ended through the pipe fd */
static int nobody_hangs(void *arg)
{
    struct who *w = arg;
    static struct hang h[HANGS];
    pthread_t th[HANGS];
    for (int i = 0; i < HANGS; i++) {
        h[i] = (struct hang){.sock = w->d->sock, .i = i};
        pthread_create(&th[i], NULL, hang_one, &h[i]);
        usleep(5000); /* (in order: the oldest are refused first) */
    }
    int busy = 0, timed_out = 0;
    for (int i = 0; i < HANGS; i++) {
        pthread_join(th[i], NULL);
        busy += h[i].st == SHARD_EBUSY && strstr(h[i].err, "max_jobs_per_uid") != NULL;
        timed_out += h[i].st == SHARD_ETIMEDOUT;
        if (h[i].st != SHARD_EBUSY && h[i].st != SHARD_ETIMEDOUT)
            fprintf(stderr, "nobody's registration %d: %d '%s'\n", i, h[i].st, h[i].err);
    }
    int counts[2] = {busy, timed_out};
    return write(w->fd, counts, sizeof(counts)) == sizeof(counts) ? 0 : 1;
}

static void test_fairness(void)
{
    struct th_daemon d;
    const char *args[] = {"--allowed-gid", "65534", "--register-timeout-ms", "5000", NULL};
    TH_CHECK(th_daemon_start(&d, args) == 0, "start shardd with allowed_gid");
    chmod(d.dir, 0711);
    int p[2];
    TH_CHECK(pipe(p) == 0, "pipe");
    struct who w = {.d = &d, .fd = p[1]};
    pid_t hang = fork();
    if (hang == 0)
        _exit(as_user(NOBODY, NOBODY, nobody_hangs, &w));
    usleep(1500000); /* (nobody's 64 registrations are in) */
    json_t *doc = th_admin_json(d.sock, "status");
    size_t k, theirs = 0;
    json_t *j;
    json_array_foreach(json_object_get(doc, "jobs"), k, j) theirs +=
        th_json_int(j, "uid") == NOBODY;
    json_decref(doc);
    /* another uid's job registers at once */
    shard_ctx_t *ctx = NULL;
    double t0 = th_now_s();
    int st = open_job(d.sock, "roots", 0, 1, &ctx);
    double took = th_now_s() - t0;
    TH_CHECK(st == 0, "root's job beside nobody's 64 hanging registrations: %d '%s'", st,
             shard_last_error(ctx));
    printf("root's job registered in %.3f s beside nobody's %zu registering jobs (of %d tried)\n",
           took, theirs, HANGS);
    TH_CHECK(theirs <= 16, "nobody has %zu jobs registering (max_jobs_per_uid is 16)", theirs);
    shard_detach(ctx);
    int rs, counts[2] = {0, 0};
    waitpid(hang, &rs, 0);
    TH_CHECK(WIFEXITED(rs) && WEXITSTATUS(rs) == 0 &&
                 read(p[0], counts, sizeof(counts)) == sizeof(counts),
             "nobody's registrations");
    printf("nobody's registrations: %d refused for max_jobs_per_uid (the oldest first), %d timed "
           "out\n",
           counts[0], counts[1]);
    TH_CHECK(counts[0] == HANGS - 16 && counts[1] == 16,
             "nobody's registrations: %d refused, %d timed out", counts[0], counts[1]);
    close(p[0]);
    close(p[1]);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
}

/* the error frame a refused connection receives, or "" */
static void refusal(int fd, char *out, size_t len)
{
    uint8_t *buf = NULL;
    size_t n = 0;
    out[0] = '\0';
    int st = sd_frame_recv(fd, &buf, &n, NULL, 0, NULL, 1 << 16, 3000);
    if (st != 0) {
        snprintf(out, len, "(no message: %s)", shard_strerror(st));
        return;
    }
    Shard__DaemonMsg *m = shard__daemon_msg__unpack(NULL, n, buf);
    if (m != NULL && m->msg_case == SHARD__DAEMON_MSG__MSG_ERROR)
        snprintf(out, len, "%s", m->error->message);
    if (m != NULL)
        shard__daemon_msg__free_unpacked(m, NULL);
    free(buf);
}

static double cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL || fgets(buf, sizeof(buf), f) == NULL) {
        if (f)
            fclose(f);
        return -1;
    }
    fclose(f);
    const char *p = strrchr(buf, ')');
    unsigned long ut = 0, st = 0;
    /* fields after the name: state ... utime (14th) stime (15th) */
    sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st);
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static void test_limits(void)
{
    struct th_daemon d;
    const char *args[] = {"--max-clients", "2", NULL};
    TH_CHECK(th_daemon_start(&d, args) == 0, "start shardd with max_clients 2");
    int fds[24], n = 0;
    char err[256], msg[512] = "";
    /* connections until one is refused (max_clients, plus 8 kept for shardctl) */
    for (; n < 24; n++) {
        TH_CHECK(shard__connect(d.sock, &fds[n], err, sizeof(err)) == 0, "connect %d", n);
        struct pollfd pf = {.fd = fds[n], .events = POLLIN};
        if (poll(&pf, 1, 300) == 1) {
            refusal(fds[n], msg, sizeof(msg));
            break;
        }
    }
    TH_CHECK(n >= 2 && strstr(msg, "max_clients 2") != NULL,
             "after %d connections the refused client was told: '%s'", n, msg);
    for (int i = 0; i < n && i < 24; i++)
        close(fds[i]);
    usleep(200000); /* the daemon saw them go: room for the admin connection */
    json_t *st = th_admin_json(d.sock, "status");
    TH_CHECK(th_json_int(st, "connections_refused") >= 1, "status counts %lld refused connections",
             th_json_int(st, "connections_refused"));
    json_decref(st);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");

    /* a daemon with few fds: past them, connections are refused with a message, and the
     * daemon does not spin on accept */
    struct rlimit old, low = {.rlim_cur = 48, .rlim_max = 48};
    getrlimit(RLIMIT_NOFILE, &old);
    setrlimit(RLIMIT_NOFILE, &low); /* inherited by the daemon started now */
    int started = th_daemon_start(&d, NULL);
    setrlimit(RLIMIT_NOFILE, &old);
    TH_CHECK(started == 0, "start shardd with 48 fds");
    int many[64], m = 0;
    for (; m < 64; m++)
        if (shard__connect(d.sock, &many[m], err, sizeof(err)) != 0)
            break;
    usleep(300000);
    int refused = 0;
    for (int i = 0; i < m; i++) {
        char c;
        ssize_t r = recv(many[i], &c, 1, MSG_DONTWAIT | MSG_PEEK);
        if (r > 0) {
            refusal(many[i], msg, sizeof(msg));
            refused += strstr(msg, "out of file descriptors") != NULL;
        }
    }
    double c0 = cpu_s(d.pid);
    usleep(2000000);
    double used = cpu_s(d.pid) - c0;
    printf("fd limit 48: %d connections made, %d refused with the reason; the daemon used %.2f s "
           "of CPU in the next 2 s\n",
           m, refused, used);
    TH_CHECK(refused > 0, "no connection was refused with a reason at the fd limit");
    TH_CHECK(used >= 0 && used < 0.5, "the daemon spun at the fd limit: %.2f s of CPU in 2 s",
             used);
    char *js = th_admin(d.sock, "status");
    TH_CHECK(js == NULL || strstr(js, "\"version\""), "status at the fd limit");
    free(js);
    for (int i = 0; i < m; i++)
        close(many[i]);
    usleep(200000);
    js = th_admin(d.sock, "status");
    TH_CHECK(js && strstr(js, "\"version\""), "status once fds are free again");
    free(js);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
}

int main(void)
{
    test_memfds();
    bool root = geteuid() == 0;
    if (root) {
        test_identity();
        test_fairness();
    }
    test_limits();
    int rc = th_summary("test_privilege");
    if (rc == 0 && !root) {
        printf("SKIP: not root: the identity checks (setuid to nobody) did not run\n");
        return 77;
    }
    return rc;
}

/* systemd's notifications, read from the socket a service manager would listen on:
 *  - READY=1 once the client socket is up, then STATUS= naming jobs, clients (and peers);
 *  - WATCHDOG_USEC=200000: WATCHDOG=1 about every 100 ms, sent by the event loop itself: with
 *    the loop held 1.5 s (SHARDD_TEST_STALL_MS, SIGUSR1) the pings stop for that long;
 *  - a job training: STATUS= says "1 running" and the clients within its 5 s period;
 *  - SIGTERM: STOPPING=1 and a clean exit;
 *  - an abstract socket ('@name') works the same; WATCHDOG_PID naming another process gets no
 *    pings; a NOTIFY_SOCKET that is not an address is logged and the daemon serves all the same. */
#include "harness.h"

#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

struct msg {
    char text[300];
    double at; /* th_now_s() */
};

static int listen_on(const char *name, bool abstract)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    size_t len = strlen(name);
    memcpy(a.sun_path, name, len);
    if (abstract)
        a.sun_path[0] = '\0';
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0 ||
        bind(fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)))
        return -1;
    return fd;
}

/* the next datagram within limit_s, or false */
static bool next_msg(int fd, double limit_s, struct msg *m)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, (int)(limit_s * 1000)) != 1)
        return false;
    ssize_t n = recv(fd, m->text, sizeof(m->text) - 1, 0);
    if (n < 0)
        return false;
    m->text[n] = '\0';
    m->at = th_now_s();
    return true;
}

/* read until a message starting with prefix (within limit_s): true and it in *m */
static bool wait_msg(int fd, const char *prefix, double limit_s, struct msg *m)
{
    for (double end = th_now_s() + limit_s; th_now_s() < end;)
        if (next_msg(fd, end - th_now_s(), m) && strncmp(m->text, prefix, strlen(prefix)) == 0)
            return true;
    return false;
}

static void with_watchdog(const char *dir)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/notify.sock", dir);
    int fd = listen_on(path, false);
    TH_CHECK(fd >= 0, "bind %s: %s", path, strerror(errno));
    setenv("NOTIFY_SOCKET", path, 1);
    setenv("WATCHDOG_USEC", "200000", 1);
    unsetenv("WATCHDOG_PID");
    setenv("SHARDD_TEST_STALL_MS", "1500", 1);
    struct th_daemon d;
    TH_CHECK(th_daemon_start(&d, NULL) == 0, "start shardd");
    unsetenv("SHARDD_TEST_STALL_MS");
    struct msg m;
    TH_CHECK(wait_msg(fd, "READY=1", 10, &m), "no READY=1 within 10 s");
    TH_CHECK(access(d.sock, F_OK) == 0, "READY=1 came before the client socket %s existed", d.sock);
    TH_CHECK(next_msg(fd, 2, &m) && strncmp(m.text, "STATUS=jobs: 0 running", 22) == 0 &&
                 strstr(m.text, "clients") != NULL,
             "the first STATUS= after READY names the jobs and clients: '%s'", m.text);
    /* pings every ~100 ms: 10 within 1.5 s, no gap over 1 s */
    int pings = 0;
    double last = th_now_s(), gap = 0;
    for (double end = th_now_s() + 1.5; th_now_s() < end;)
        if (next_msg(fd, 0.5, &m) && strcmp(m.text, "WATCHDOG=1") == 0) {
            gap = m.at - last > gap ? m.at - last : gap;
            last = m.at;
            pings++;
        }
    TH_CHECK(pings >= 10 && gap < 1.0, "WATCHDOG=1: %d pings in 1.5 s (longest gap %.2f s)", pings,
             gap);
    printf("watchdog: %d pings in 1.5 s at WATCHDOG_USEC 200000, longest gap %.3f s\n", pings, gap);
#ifdef SD_TEST_HOOKS
    /* the loop held 1.5 s: no ping meanwhile (the loop sends them, no other thread) */
    while (next_msg(fd, 0, &m)) /* (drain) */
        ;
    TH_CHECK(wait_msg(fd, "WATCHDOG=1", 1, &m), "no ping before the stall");
    double before = m.at;
    kill(d.pid, SIGUSR1);
    double held = 0;
    for (double end = th_now_s() + 4; th_now_s() < end && held < 1.2;)
        if (wait_msg(fd, "WATCHDOG=1", end - th_now_s(), &m)) {
            held = m.at - before > held ? m.at - before : held;
            before = m.at;
        }
    TH_CHECK(held >= 1.2, "the loop held 1.5 s: the longest gap between pings was %.2f s", held);
    printf("loop held 1.5 s: no WATCHDOG=1 for %.2f s\n", held);
#endif
    /* a job running: STATUS= names it within its period (5 s) */
    const char *args[] = {"--world",      "2",  "--plan",  "zero3", "--steps", "400",
                          "--compute-ms", "20", "--quiet", NULL};
    char log0[400], log1[400];
    snprintf(log0, sizeof(log0), "%s/r0.log", dir);
    snprintf(log1, sizeof(log1), "%s/r1.log", dir);
    pid_t r0 = th_spawn_rank(d.sock, "n", 0, args, NULL, log0);
    pid_t r1 = th_spawn_rank(d.sock, "n", 1, args, NULL, log1);
    bool seen = false;
    for (double end = th_now_s() + 12; !seen && th_now_s() < end;)
        seen = wait_msg(fd, "STATUS=", end - th_now_s(), &m) &&
               strstr(m.text, "jobs: 1 running") != NULL && strstr(m.text, "2 clients") != NULL;
    TH_CHECK(seen, "no STATUS= naming the running job and its 2 clients within 12 s (last '%s')",
             m.text);
    if (seen)
        printf("while a job trains: %s\n", m.text);
    kill(r0, SIGKILL);
    kill(r1, SIGKILL);
    th_wait(r0, 10000);
    th_wait(r1, 10000);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not exit cleanly");
    TH_CHECK(wait_msg(fd, "STOPPING=1", 2, &m), "no STOPPING=1 after SIGTERM");
    close(fd);
    unsetenv("WATCHDOG_USEC");
}

static void abstract_and_other_pid(void)
{
    char name[64];
    snprintf(name, sizeof(name), "@shardd-test-notify-%d", (int)getpid());
    int fd = listen_on(name, true);
    TH_CHECK(fd >= 0, "bind the abstract %s: %s", name, strerror(errno));
    setenv("NOTIFY_SOCKET", name, 1);
    setenv("WATCHDOG_USEC", "100000", 1);
    setenv("WATCHDOG_PID", "1", 1); /* systemd's watchdog for another process */
    struct th_daemon d;
    TH_CHECK(th_daemon_start(&d, NULL) == 0, "start shardd");
    struct msg m;
    TH_CHECK(wait_msg(fd, "READY=1", 10, &m), "abstract socket: no READY=1 within 10 s");
    TH_CHECK(!wait_msg(fd, "WATCHDOG=1", 0.6, &m),
             "WATCHDOG_PID names another process, yet shardd pinged");
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not exit cleanly");
    TH_CHECK(wait_msg(fd, "STOPPING=1", 2, &m), "abstract socket: no STOPPING=1");
    close(fd);
    unsetenv("WATCHDOG_PID");
    unsetenv("WATCHDOG_USEC");

    /* not an address: logged, and the daemon serves all the same */
    setenv("NOTIFY_SOCKET", "relative/notify.sock", 1);
    TH_CHECK(th_daemon_start(&d, NULL) == 0, "start shardd with a bad NOTIFY_SOCKET");
    char *log = NULL;
    bool named = false;
    for (double end = th_now_s() + 10; !named && th_now_s() < end; usleep(50000)) {
        free(log);
        log = th_read_file(d.log, NULL);
        named = log && strstr(log, "NOTIFY_SOCKET 'relative/notify.sock' is neither a path");
    }
    TH_CHECK(named, "the log does not name the bad NOTIFY_SOCKET:\n%s", log ? log : "(none)");
    free(log);
    json_t *doc = th_admin_json(d.sock, "status");
    TH_CHECK(doc != NULL, "the daemon with a bad NOTIFY_SOCKET does not answer");
    json_decref(doc);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not exit cleanly");
    unsetenv("NOTIFY_SOCKET");
}

int main(void)
{
    char dir[] = "/tmp/shardd-notify-XXXXXX";
    TH_CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    with_watchdog(dir);
    abstract_and_other_pid();
    int rc = th_summary("test_notify");
    if (rc == 0) {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", dir);
    }
    return rc;
}

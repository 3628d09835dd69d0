/* Bad input never crashes shardd, never hangs, and never changes another job: each case gets a
 * clear error, and afterwards the daemon still answers `shardctl status`. A bystander job trains
 * beside all of it and must still match its reference bitwise. */
#include "harness.h"
#include "shard.h"
#include "shard_internal.h"
#include "sd/fence.h"
#include "sd/frame.h"
#include "sd/model.h"
#include "sd/ring.h"
#include "shard.pb-c.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <sched.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static struct th_daemon d;

static void expect_alive(const char *after)
{
    char *js = th_admin(d.sock, "status");
    TH_CHECK(js != NULL && strstr(js, "\"version\"") != NULL,
             "daemon does not answer status after %s", after);
    free(js);
}

/* A client call failed with status code, and its error names text. */
static void expect_error(shard_ctx_t *ctx, int st, int code, const char *text, const char *what)
{
    TH_CHECK(st == code && strstr(shard_last_error(ctx), text) != NULL, "%s: %d '%s'", what, st,
             shard_last_error(ctx));
}

static int raw_connect(void)
{
    int fd;
    char err[256];
    return shard__connect(d.sock, &fd, err, sizeof(err)) == 0 ? fd : -1;
}

/* Read one reply; returns the Error status (0 if another message) and copies its text. */
static int read_error(int fd, char *msg, size_t len)
{
    uint8_t *buf;
    size_t n;
    msg[0] = '\0';
    int st = sd_frame_recv(fd, &buf, &n, NULL, 0, NULL, 1 << 20, 5000);
    if (st != 0)
        return st;
    Shard__DaemonMsg *m = shard__daemon_msg__unpack(NULL, n, buf);
    free(buf);
    int status = 0;
    if (m && m->msg_case == SHARD__DAEMON_MSG__MSG_ERROR) {
        status = m->error->status;
        snprintf(msg, len, "%s", m->error->message);
    }
    if (m)
        shard__daemon_msg__free_unpacked(m, NULL);
    return status;
}

static void test_garbage(void)
{
    char msg[512];
    /* random bytes: the length prefix is huge, so the daemon answers EMSGSIZE and hangs up */
    int fd = raw_connect();
    unsigned char junk[4096];
    srand(42);
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (unsigned char)rand();
    junk[3] = 0xff;
    TH_CHECK(sd_frame_send_raw(fd, junk, sizeof(junk), NULL, 0, 2000) == 0, "send junk");
    int st = read_error(fd, msg, sizeof(msg));
    TH_CHECK(st == SHARD_EMSGSIZE && strstr(msg, "max_message_bytes"), "junk: status %d '%s'", st,
             msg);
    close(fd);
    expect_alive("random bytes");

    /* a well-framed message that is not protobuf */
    fd = raw_connect();
    unsigned char frame[4 + 64] = {64, 0, 0, 0};
    memset(frame + 4, 0xff, 64);
    sd_frame_send_raw(fd, frame, sizeof(frame), NULL, 0, 2000);
    st = read_error(fd, msg, sizeof(msg));
    TH_CHECK(st == SHARD_EPROTO && strstr(msg, "could not decode"), "garbage frame: %d '%s'", st,
             msg);
    close(fd);

    /* an empty ClientMsg (no body) */
    fd = raw_connect();
    unsigned char empty[4] = {0, 0, 0, 0};
    sd_frame_send_raw(fd, empty, sizeof(empty), NULL, 0, 2000);
    st = read_error(fd, msg, sizeof(msg));
    TH_CHECK(st == SHARD_EPROTO, "empty message: %d '%s'", st, msg);
    close(fd);

    /* register before attach, and an attach with the wrong protocol version */
    fd = raw_connect();
    Shard__Register reg = SHARD__REGISTER__INIT;
    reg.job = "x";
    Shard__ClientMsg m = SHARD__CLIENT_MSG__INIT;
    m.msg_case = SHARD__CLIENT_MSG__MSG_REGISTER;
    m.register_ = &reg;
    sd_frame_send(fd, &m.base, NULL, 0, 2000);
    st = read_error(fd, msg, sizeof(msg));
    TH_CHECK(st == SHARD_ESTATE && strstr(msg, "attach first"), "register before attach: %d '%s'",
             st, msg);
    Shard__Attach at = SHARD__ATTACH__INIT;
    at.protocol_version = 999;
    m.msg_case = SHARD__CLIENT_MSG__MSG_ATTACH;
    m.attach = &at;
    sd_frame_send(fd, &m.base, NULL, 0, 2000);
    st = read_error(fd, msg, sizeof(msg));
    TH_CHECK(st == SHARD_EVERSION && strstr(msg, "v999"), "bad version: %d '%s'", st, msg);
    close(fd);

    /* a client that connects and vanishes mid-frame */
    fd = raw_connect();
    unsigned char half[6] = {100, 0, 0, 0, 1, 2};
    sd_frame_send_raw(fd, half, sizeof(half), NULL, 0, 2000);
    close(fd);
    expect_alive("malformed messages");
}

/* A tiny model: unit 0 = "a" [n], unit 1 = "b" [3, 5]. */
struct tiny {
    uint64_t da[1], db[2];
    shard_tensor_t t[2];
    shard_model_t m;
};

static void tiny_init(struct tiny *x, const char *job, uint32_t rank, uint32_t world, uint64_t n)
{
    memset(x, 0, sizeof(*x));
    x->da[0] = n;
    x->db[0] = 3;
    x->db[1] = 5;
    x->t[0] =
        (shard_tensor_t){.name = "a", .ndim = 1, .dims = x->da, .dtype = SHARD_FP32, .unit = 0};
    x->t[1] =
        (shard_tensor_t){.name = "b", .ndim = 2, .dims = x->db, .dtype = SHARD_FP32, .unit = 1};
    x->m = (shard_model_t){.job = job,
                           .rank = rank,
                           .world = world,
                           .plan = "zero3",
                           .tensors = x->t,
                           .n_tensors = 2,
                           .optimizer = {.name = "sgd", .lr = 0.1f, .momentum = 0.0f}};
}

static void test_api_misuse(void)
{
    shard_ctx_t *ctx;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    const void *p;
    int st = shard_fetch(ctx, 0, &p);
    TH_CHECK(st == SHARD_ESTATE, "fetch before register (client): %d", st);
    st = shard__post_raw(ctx, SD_OP_FETCH, 0, 0, 0);
    expect_error(ctx, st, SHARD_ESTATE, "register a model first", "fetch before register (daemon)");
    st = shard__post_raw(ctx, 77, 0, 0, 0);
    expect_error(ctx, st, SHARD_EINVAL, "unknown operation", "unknown op");

    struct tiny x;
    tiny_init(&x, "misuse", 0, 1, 100);
    x.m.plan = "mics:3";
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "mics:3", "bad plan");
    x.m.plan = "topo:1/1/2"; /* f_os over a world of 1 */
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "f_os = 2 does not divide the world size", "topo factors");
    x.m.plan = "zero3,sec=2"; /* one rank per node here */
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "divides the ranks per node", "sec larger than the node");
    x.m.plan = "zero3";
    x.m.rank = 5;
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "rank 5", "bad rank");
    x.m.rank = 0;
    x.m.world = 65; /* a single daemon serves the whole world: 65 ranks on one node */
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "at most 64 ranks", "65 ranks on one node");
    x.m.world = 1;
    x.m.rank = 0;
    st = shard_register(ctx, &x.m);
    TH_CHECK(st == 0, "register: %s", shard_last_error(ctx));

    st = shard_fetch(ctx, 999, &p);
    expect_error(ctx, st, SHARD_ENOUNIT, "unit 999", "unknown unit");
    st = shard_release(ctx, 0);
    expect_error(ctx, st, SHARD_ENOTHELD, "does not hold", "release without fetch");
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch: %s", shard_last_error(ctx));
    TH_CHECK(shard_release(ctx, 0) == 0, "release: %s", shard_last_error(ctx));
    st = shard_release(ctx, 0);
    TH_CHECK(st == SHARD_ENOTHELD, "double release: %d", st);

    shard_unit_info_t ui;
    shard_unit_info(ctx, 0, &ui);
    float *g = calloc(ui.numel + 1, sizeof(float));
    st = shard_push_grad(ctx, 0, g, ui.bytes - 4);
    expect_error(ctx, st, SHARD_EMSGSIZE, "unit is", "wrong gradient size (client)");
    st = shard__post_raw(ctx, SD_OP_PUSH, 0, 0, ui.bytes + 4);
    expect_error(ctx, st, SHARD_EMSGSIZE, "gradient is", "wrong gradient size (daemon)");
    st = shard__post_raw(ctx, SD_OP_PUSH, 0, 999, ui.bytes);
    expect_error(ctx, st, SHARD_EINVAL, "staging slot 999", "bad staging slot");
    st = shard__post_raw(ctx, SD_OP_INIT, 0, 0, 0);
    TH_CHECK(st == SHARD_ESTATE, "init after ready: %d '%s'", st, shard_last_error(ctx));
    /* a push whose gradient was not signalled on the fence page (libshard signals each) */
    st = shard__post_raw(ctx, SD_OP_PUSH, 0, 0, ui.bytes);
    expect_error(ctx, st, SHARD_ESTATE, "was not signalled", "push without its fence signal");

    /* a correct step still works after all of that: a=0, grad 1, lr 0.1 -> a = -0.1 */
    for (uint64_t i = 0; i < 100; i++) /* the tensor's elements; the padding stays zero */
        g[i] = 1.0f;
    TH_CHECK(shard_push_grad(ctx, 0, g, ui.bytes) == 0, "push: %s", shard_last_error(ctx));
    shard_unit_info(ctx, 1, &ui);
    memset(g, 0, ui.bytes);
    TH_CHECK(shard_push_grad(ctx, 1, g, ui.bytes) == 0, "push 1: %s", shard_last_error(ctx));
    double norm = 0;
    TH_CHECK(shard_step(ctx, &norm) == 0, "step: %s", shard_last_error(ctx));
    TH_CHECK(norm > 9.99 && norm < 10.01, "grad norm %g, expected sqrt(100) = 10", norm);
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch");
    TH_CHECK(((const float *)p)[0] == -0.1f && ((const float *)p)[99] == -0.1f,
             "after one SGD step a[0] = %g, expected -0.1", ((const float *)p)[0]);
    /* the fence page counted libshard's two pushes and the two fetches answered */
    shard_fence_t f;
    TH_CHECK(shard_fence(ctx, &f) == 0, "shard_fence: %s", shard_last_error(ctx));
    TH_CHECK(*f.grad_seq == 2 && f.next_grad == 3 && *f.gather_seq == 2 && f.gathers == 2,
             "fence: grad_seq %u (next %u), gather_seq %u (seen %u); expected 2, 3, 2, 2",
             *f.grad_seq, f.next_grad, *f.gather_seq, f.gathers);
    shard_release(ctx, 0);
    free(g);
    shard_detach(ctx);
    expect_alive("API misuse");
}

/* A release of a unit the rank holds returns once posted (shardd answers later): it returns
 * while the daemon is stopped, the ring keeps its order (the next fetch of the unit works), and
 * a failure the daemon answers is told by the first call after the answer came, once. */
static void test_release_detached(void)
{
    shard_ctx_t *ctx;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    struct tiny x;
    tiny_init(&x, "detached", 0, 1, 100);
    TH_CHECK(shard_register(ctx, &x.m) == 0, "register: %s", shard_last_error(ctx));
    const void *p;
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch: %s", shard_last_error(ctx));
    TH_CHECK(kill(d.pid, SIGSTOP) == 0, "SIGSTOP the daemon");
    int st = shard_release(ctx, 0); /* (an answered one would wait for SHARD_TIMEOUT_MS) */
    TH_CHECK(kill(d.pid, SIGCONT) == 0, "SIGCONT the daemon");
    TH_CHECK(st == 0, "a release of a held unit with the daemon stopped: %d '%s'", st,
             shard_last_error(ctx));
    for (int i = 0; i < 3; i++) /* (in the ring's order: each fetch after its release) */
        TH_CHECK(shard_fetch(ctx, 0, &p) == 0 && shard_release(ctx, 0) == 0,
                 "fetch and release %d after a detached release: %s", i, shard_last_error(ctx));
    st = shard_release(ctx, 0);
    expect_error(ctx, st, SHARD_ENOTHELD, "does not hold", "a release beyond the fetches");
    /* released behind libshard's count: its own release then fails in the daemon, and the
     * next call says so */
    TH_CHECK(shard_fetch(ctx, 1, &p) == 0, "fetch 1: %s", shard_last_error(ctx));
    TH_CHECK(shard__post_raw(ctx, SD_OP_RELEASE, 1, 0, 0) == 0, "raw release: %s",
             shard_last_error(ctx));
    TH_CHECK(shard_release(ctx, 1) == 0, "the detached release: %s", shard_last_error(ctx));
    /* (a call made before the answer came passes) */
    int calls = 0;
    bool held = false; /* unit 0, when the failure came at its release */
    for (st = 0; st == 0 && calls < 200; calls++, usleep(10000)) {
        st = shard_fetch(ctx, 0, &p);
        held = st == 0;
        if (st == 0 && (st = shard_release(ctx, 0)) == 0)
            held = false;
    }
    expect_error(ctx, st, SHARD_ENOTHELD, "an earlier release of unit 1 failed",
                 "a call after a failed detached release");
    TH_CHECK(strstr(shard_last_error(ctx), "does not hold") != NULL,
             "the failure names the daemon's answer: '%s'", shard_last_error(ctx));
    printf("a detached release's failure, told by call %d after it: %s\n", calls,
           shard_last_error(ctx));
    const void *q;
    TH_CHECK(!held || shard_release(ctx, 0) == 0, "the release of unit 0 after the failure: %s",
             shard_last_error(ctx));
    TH_CHECK(shard_fetch(ctx, 1, &q) == 0 && shard_release(ctx, 1) == 0,
             "a fetch after the failure was told: %s", shard_last_error(ctx));
    shard_detach(ctx);
    expect_alive("detached releases");
}

static int count_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *dir = opendir(path);
    int n = 0;
    for (struct dirent *e; dir != NULL && (e = readdir(dir)) != NULL;)
        n += e->d_name[0] != '.';
    if (dir != NULL)
        closedir(dir);
    return n;
}

/* one rank of a one-rank job: register, fetch, push, step; the fence page's counts after */
static int fence_job(const char *job, bool detach)
{
    shard_ctx_t *ctx;
    if (shard_attach(d.sock, &ctx) != 0)
        return 1;
    struct tiny x;
    tiny_init(&x, job, 0, 1, 100);
    shard_unit_info_t ui;
    const void *p;
    double norm;
    shard_fence_t f;
    float g[128] = {0};
    int bad = shard_register(ctx, &x.m) != 0 || shard_unit_info(ctx, 0, &ui) != 0 ||
              shard_fetch(ctx, 0, &p) != 0 || shard_release(ctx, 0) != 0 ||
              shard_push_grad(ctx, 0, g, ui.bytes) != 0 || shard_unit_info(ctx, 1, &ui) != 0 ||
              shard_push_grad(ctx, 1, g, ui.bytes) != 0 || shard_step(ctx, &norm) != 0 ||
              shard_fence(ctx, &f) != 0 || *f.grad_seq != 2 || *f.gather_seq != 1;
    if (bad)
        fprintf(stderr, "fence job %s: %s\n", job, shard_last_error(ctx));
    if (detach)
        shard_detach(ctx);
    return bad;
}

/* The fence pages travel as memfds, as the pool and the staging slots do (issue 40, the paths
 * a device's fds will take): 30 jobs leave no fd behind in the client or the daemon; a client
 * killed holding them leaves none in the daemon once its job is gone; a client in an IPC
 * namespace of its own (a pod without hostIPC) trains. */
static void test_fence(void)
{
    int client0 = count_fds(getpid()), daemon0 = count_fds(d.pid);
    char job[32];
    for (int i = 0; i < 30; i++) {
        snprintf(job, sizeof(job), "fence-%d", i);
        TH_CHECK(fence_job(job, true) == 0, "fence job %d", i);
    }
    TH_CHECK(count_fds(getpid()) == client0, "the client holds %d fds after 30 jobs, %d before",
             count_fds(getpid()), client0);
    pid_t pid = fork();
    if (pid == 0) {
        if (fence_job("fence-killed", false) != 0)
            _exit(1);
        kill(getpid(), SIGKILL); /* holding the pool, staging and fence fds and maps */
        _exit(1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    TH_CHECK(WIFSIGNALED(status), "the killed client ended with status %d", status);
    pid = fork();
    if (pid == 0) {
        if (unshare(CLONE_NEWIPC) != 0) {
            fprintf(stderr, "unshare(CLONE_NEWIPC): %s\n", strerror(errno));
            _exit(2);
        }
        _exit(fence_job("fence-ipc", true));
    }
    waitpid(pid, &status, 0);
    TH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
             "a client in its own IPC namespace: status %d", status);
    int daemon1 = 0;
    for (int i = 0; i < 50 && (daemon1 = count_fds(d.pid)) > daemon0; i++)
        usleep(100000); /* the killed client's job is freed once the daemon sees it gone */
    TH_CHECK(daemon1 <= daemon0, "the daemon holds %d fds after the fence jobs, %d before", daemon1,
             daemon0);
    expect_alive("fence jobs");
}

/* Parameter groups and the step's arguments (shard_step_ex): bad ones refused naming what is
 * wrong, by the library and, written past it into the shared arguments, by the daemon, which
 * then skips the step and goes on; good ones change each group's lr from the step on, and a
 * tensor no rank gave a gradient is left alone. SGD, lr 0.1 and 0.2: a -= lr * grad. */
static void test_step_args(void)
{
    shard_ctx_t *ctx;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    struct tiny x;
    tiny_init(&x, "stepargs", 0, 1, 100);
    shard_hparams_t groups[2] = {{.lr = 0.1f}, {.lr = 0.2f}};
    x.m.groups = groups;
    x.m.n_groups = 2;
    x.m.flags = SHARD_SKIP_UNUSED;
    x.t[1].group = 5;
    int st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "parameter group 5", "a tensor of an unknown group");
    x.t[1].group = 1;
    groups[1].lr = NAN;
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "group 1: lr", "a group's lr NaN");
    groups[1].lr = 0.2f;
    TH_CHECK(shard_register(ctx, &x.m) == 0, "register: %s", shard_last_error(ctx));

    shard_unit_info_t u0, u1;
    shard_unit_info(ctx, 0, &u0);
    shard_unit_info(ctx, 1, &u1);
    float *g = calloc(u0.numel + u1.numel, sizeof(float));
    for (uint64_t i = 0; i < 100; i++)
        g[i] = 1.0f;
    for (uint64_t i = 0; i < 15; i++)
        g[u0.numel + i] = 1.0f;
    uint8_t has[2] = {1, 0};
    shard_step_args_t a = {.groups = groups, .n_groups = 1, .has_grad = has, .n_tensors = 2};
    st = shard_step_ex(ctx, &a, NULL);
    expect_error(ctx, st, SHARD_EINVAL, "1 groups' hyperparameters; the model has 2",
                 "step with a group missing");
    a.n_groups = 2;
    groups[0].momentum = 1.5f;
    st = shard_step_ex(ctx, &a, NULL);
    expect_error(ctx, st, SHARD_EINVAL, "group 0: momentum", "step with momentum 1.5");
    groups[0].momentum = 0.0f;
    st = shard__post_raw(ctx, SD_OP_STEP, 0, 0x80, 0);
    expect_error(ctx, st, SHARD_EINVAL, "unknown argument flags", "step with unknown flags");

    /* past the library: the daemon refuses, skips the step, and the job goes on */
    uint8_t *area = shard__step_args(ctx);
    struct sd_step_args bad = {.n_groups = 9, .n_tensors = 2};
    memcpy(area, &bad, sizeof(bad));
    st = shard__post_raw(ctx, SD_OP_STEP, 0, SD_STEP_ARG_HPARAMS, 0);
    expect_error(ctx, st, SHARD_EINVAL, "for 9 groups and 2 tensors; the job has 2 and 2",
                 "step arguments of the wrong shape");
    bad.n_groups = 2;
    memcpy(area, &bad, sizeof(bad));
    float nan = NAN;
    memcpy(area + sizeof(bad) + offsetof(shard_hparams_t, lr), &nan, sizeof(nan));
    st = shard__post_raw(ctx, SD_OP_STEP, 0, SD_STEP_ARG_HPARAMS, 0);
    expect_error(ctx, st, SHARD_EINVAL, "group 0: lr is nan", "a NaN lr past the library");

    /* good ones: b got no gradient in step 1 and stays; step 2 has lr 0.5 for group 0 */
    TH_CHECK(shard_push_grad(ctx, 0, g, u0.bytes) == 0, "push: %s", shard_last_error(ctx));
    TH_CHECK(shard_push_grad(ctx, 1, g + u0.numel, u1.bytes) == 0, "push 1");
    TH_CHECK(shard_step_ex(ctx, &a, NULL) == 0, "step 1: %s", shard_last_error(ctx));
    groups[0].lr = 0.5f;
    has[1] = 1;
    TH_CHECK(shard_push_grad(ctx, 0, g, u0.bytes) == 0, "push");
    TH_CHECK(shard_push_grad(ctx, 1, g + u0.numel, u1.bytes) == 0, "push 1");
    TH_CHECK(shard_step_ex(ctx, &a, NULL) == 0, "step 2: %s", shard_last_error(ctx));
    const void *p;
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0 && shard_release(ctx, 0) == 0, "fetch a");
    float a0 = ((const float *)p)[0];
    TH_CHECK(shard_fetch(ctx, 1, &p) == 0 && shard_release(ctx, 1) == 0, "fetch b");
    float b0 = ((const float *)p)[0];
    TH_CHECK(fabsf(a0 - -0.6f) < 1e-6f && fabsf(b0 - -0.2f) < 1e-6f,
             "a = -0.1 - 0.5 = %g (want -0.6), b skipped in step 1 then -0.2 = %g", a0, b0);
    shard_hparams_t now;
    TH_CHECK(shard_group_hparams(ctx, 0, &now) == 0 && now.lr == 0.5f, "group 0's lr now 0.5");
    json_t *js = th_job_stats(d.sock, "stepargs");
    TH_CHECK(js != NULL && th_json_int(js, "tensors_skipped") == 1 &&
                 th_json_int(js, "steps_refused") == 2 && th_json_int(js, "steps") == 2,
             "stats: %lld tensors skipped, %lld steps refused, %lld taken; want 1, 2, 2",
             js ? th_json_int(js, "tensors_skipped") : -1,
             js ? th_json_int(js, "steps_refused") : -1, js ? th_json_int(js, "steps") : -1);
    json_decref(js);
    free(g);
    shard_detach(ctx);
    expect_alive("step arguments");
}

/* The zero-copy push (shard_grad_buffer / shard_push_staged): misuse is refused with the unit
 * named, copying pushes of other units go around the held buffer, and the sums come out as the
 * formula says. */
static void test_zero_copy_push(void)
{
    shard_ctx_t *ctx;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    void *b = NULL, *again = NULL;
    int st = shard_grad_buffer(ctx, 0, &b);
    TH_CHECK(st == SHARD_ESTATE, "grad_buffer before register: %d", st);
    struct tiny x;
    tiny_init(&x, "zerocopy", 0, 1, 100);
    TH_CHECK(shard_register(ctx, &x.m) == 0, "register: %s", shard_last_error(ctx));
    shard_unit_info_t u0, u1;
    shard_unit_info(ctx, 0, &u0);
    shard_unit_info(ctx, 1, &u1);

    st = shard_push_staged(ctx, 0);
    expect_error(ctx, st, SHARD_ESTATE, "no gradient buffer is held",
                 "push_staged without a buffer");
    st = shard_grad_buffer(ctx, 999, &b);
    expect_error(ctx, st, SHARD_ENOUNIT, "unit 999", "grad_buffer of an unknown unit");
    TH_CHECK(shard_grad_buffer(ctx, 0, NULL) == SHARD_EINVAL, "grad_buffer with NULL buf_p");
    TH_CHECK(shard_grad_buffer(ctx, 0, &b) == 0 && shard_grad_buffer(ctx, 0, &again) == 0 &&
                 b != NULL && again == b,
             "asking twice for unit 0's buffer gives the same one: %p %p", b, again);
    st = shard_grad_buffer(ctx, 1, &again);
    expect_error(ctx, st, SHARD_EBUSY, "unit 0's gradient buffer is held",
                 "a second unit's buffer while unit 0's is held");
    st = shard_push_staged(ctx, 1);
    expect_error(ctx, st, SHARD_ESTATE, "unit 0's", "push_staged of another unit");
    double norm = 0;
    st = shard_step(ctx, &norm);
    expect_error(ctx, st, SHARD_EBUSY, "not pushed", "step while a buffer is held");

    /* unit 0's gradient (1 on the 100 elements of a) written in place; meanwhile five copying
     * pushes of unit 1 (2 on each element) cycle through the other staging slots */
    float *g0 = b;
    for (uint64_t i = 0; i < u0.numel; i++)
        g0[i] = i < 100 ? 1.0f : 0.0f;
    float g1[64] = {0};
    for (int i = 0; i < 15; i++)
        g1[i] = 2.0f;
    for (int i = 0; i < 5; i++)
        TH_CHECK(shard_push_grad(ctx, 1, g1, u1.bytes) == 0, "push %d of unit 1: %s", i,
                 shard_last_error(ctx));
    int intact = 1;
    for (uint64_t i = 0; i < 100; i++)
        intact &= g0[i] == 1.0f;
    TH_CHECK(intact, "the held buffer was overwritten by the copying pushes");
    TH_CHECK(shard_push_staged(ctx, 0) == 0, "push_staged: %s", shard_last_error(ctx));
    st = shard_push_staged(ctx, 0);
    TH_CHECK(st == SHARD_ESTATE, "pushing the same buffer twice: %d", st);
    /* SGD, lr 0.1, world 1: a = -0.1 * 1, b = -0.1 * 5 * 2; norm sqrt(100 * 1 + 15 * 10^2) */
    TH_CHECK(shard_step(ctx, &norm) == 0, "step: %s", shard_last_error(ctx));
    TH_CHECK(norm > 39.99 && norm < 40.01, "grad norm %g, expected 40", norm);
    const void *p;
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0 && ((const float *)p)[0] == -0.1f &&
                 ((const float *)p)[99] == -0.1f,
             "a after the step: %g, expected -0.1", ((const float *)p)[0]);
    shard_release(ctx, 0);
    TH_CHECK(shard_fetch(ctx, 1, &p) == 0 && fabsf(((const float *)p)[14] + 1.0f) < 1e-6f,
             "b after the step: %g, expected -1", ((const float *)p)[14]);
    shard_release(ctx, 1);
    shard_detach(ctx);

    /* with a single staging slot the held buffer is the only one: a copying push is refused */
    struct th_daemon one;
    const char *args[] = {"--staging-slots", "1", NULL};
    if (th_daemon_start(&one, args) != 0) {
        TH_CHECK(0, "cannot start shardd with one staging slot");
        return;
    }
    TH_CHECK(shard_attach(one.sock, &ctx) == 0, "attach (one slot)");
    tiny_init(&x, "zerocopy1", 0, 1, 100);
    TH_CHECK(shard_register(ctx, &x.m) == 0, "register (one slot): %s", shard_last_error(ctx));
    TH_CHECK(shard_grad_buffer(ctx, 0, &b) == 0, "grad_buffer (one slot)");
    st = shard_push_grad(ctx, 1, g1, u1.bytes);
    expect_error(ctx, st, SHARD_EBUSY, "only staging slot",
                 "copying push while the only slot is held");
    memset(b, 0, u0.bytes);
    TH_CHECK(shard_push_staged(ctx, 0) == 0 && shard_push_grad(ctx, 1, g1, u1.bytes) == 0 &&
                 shard_step(ctx, &norm) == 0,
             "push, push, step (one slot): %s", shard_last_error(ctx));
    TH_CHECK(norm > 7.74 && norm < 7.75, "grad norm %g, expected sqrt(15 * 4) = 7.746", norm);
    shard_detach(ctx);
    TH_CHECK(th_daemon_stop(&one) == 0, "shardd (one slot) did not shut down cleanly");
    expect_alive("zero-copy push");
}

static void test_null_and_pool(void)
{
    const void *p;
    double norm;
    shard_req_t req;
    TH_CHECK(shard_fetch(NULL, 0, &p) == SHARD_EINVAL && shard_step(NULL, &norm) == SHARD_EINVAL &&
                 shard_release(NULL, 0) == SHARD_EINVAL &&
                 shard_register(NULL, NULL) == SHARD_EINVAL && shard_detach(NULL) == SHARD_EINVAL &&
                 shard_attach(d.sock, NULL) == SHARD_EINVAL,
             "NULL context");
    shard_ctx_t *ctx;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    TH_CHECK(shard_register(ctx, NULL) == SHARD_EINVAL, "NULL model");
    struct tiny x;
    tiny_init(&x, "pool", 0, 1, 100);
    x.m.optimizer.name = "lamb";
    TH_CHECK(shard_register(ctx, &x.m) == SHARD_EINVAL && strstr(shard_last_error(ctx), "lamb"),
             "unknown optimizer: %s", shard_last_error(ctx));
    x.m.optimizer.name = "sgd";
    x.m.max_live_bytes = 512; /* one 128-element fp32 unit */
    TH_CHECK(shard_register(ctx, &x.m) == 0, "register: %s", shard_last_error(ctx));
    TH_CHECK(shard_fetch_async(ctx, 0, NULL) == SHARD_EINVAL, "NULL req");
    TH_CHECK(shard_push_grad(ctx, 0, NULL, 512) == SHARD_EMSGSIZE, "NULL gradient");
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch 0");
    int st = shard_fetch(ctx, 1, &p);
    expect_error(ctx, st, SHARD_ENOSPC, "max_live_bytes", "pool full while unit 0 is held");
    TH_CHECK(shard_release(ctx, 0) == 0, "release 0");
    TH_CHECK(shard_fetch(ctx, 1, &p) == 0, "fetch 1 evicts the released unit 0: %s",
             shard_last_error(ctx));
    TH_CHECK(shard_release(ctx, 1) == 0 && shard_fetch_async(ctx, 0, &req) == 0 &&
                 shard_wait(ctx, req, &p) == 0 && shard_wait(ctx, req, &p) == SHARD_EINVAL,
             "async fetch, and a second wait on the same request is refused");
    shard_release(ctx, 0);

    /* a release with a flag it does not know, or a signal wider than the page's counter: refused
     * naming what was wrong, the unit still held */
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch 0 again: %s", shard_last_error(ctx));
    expect_error(ctx, shard__post_raw(ctx, SD_OP_RELEASE, 0, 4, 0), SHARD_EINVAL, "flags 0x4",
                 "release with an unknown flag");
    expect_error(ctx, shard__post_raw(ctx, SD_OP_RELEASE, 0, SD_RELEASE_SIGNAL_LATER, 1ULL << 32),
                 SHARD_EINVAL, "32-bit release_seq", "release signalled with a 33-bit value");
    TH_CHECK(shard_release(ctx, 0) == 0 && shard_release(ctx, 0) == SHARD_ENOTHELD,
             "the refused releases left the unit held once: %s", shard_last_error(ctx));

    /* random ring entries: every one is answered, none crashes or wedges the daemon */
    srand(7);
    int answered = 0;
    for (int i = 0; i < 2000; i++) {
        uint32_t op = (uint32_t)(rand() % 10);
        uint32_t unit = (uint32_t)(rand() % 4);
        uint64_t a0 = (uint64_t)(rand() % 6), a1 = (uint64_t)(rand() % 3) * 256;
        if (op == SD_OP_FETCH) /* keep the pool usable: release what we fetched */
            op = SD_OP_RELEASE;
        st = shard__post_raw(ctx, op, unit, a0, a1);
        answered += st <= 0 && st != SHARD_ETIMEDOUT && st != SHARD_ECONNRESET;
    }
    TH_CHECK(answered == 2000, "%d of 2000 random entries answered", answered);
    /* the job still computes right: one SGD step with gradient 1 on the 100 elements of a */
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0, "fetch after fuzz: %s", shard_last_error(ctx));
    float before = ((const float *)p)[0];
    shard_release(ctx, 0);
    float g[128] = {0};
    for (int i = 0; i < 100; i++)
        g[i] = 1.0f;
    float g1[32] = {0};
    shard_unit_info_t u1;
    shard_unit_info(ctx, 1, &u1);
    TH_CHECK(shard_push_grad(ctx, 0, g, sizeof(g)) == 0 &&
                 shard_push_grad(ctx, 1, g1, u1.bytes) == 0 && shard_step(ctx, &norm) == 0,
             "step after fuzz: %s", shard_last_error(ctx));
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0 && ((const float *)p)[0] == before - 0.1f,
             "SGD after fuzz: %g -> %g", before, ((const float *)p)[0]);
    shard_release(ctx, 0);
    shard_detach(ctx);
    expect_alive("random ring entries");
}

/* attach and register, keeping the context (for jobs of several ranks in one process) */
struct joined {
    struct tiny x;
    shard_ctx_t *ctx;
    int st;
    char err[512];     /* shard_last_error when st != 0 */
    volatile int done; /* the registration returned */
};

static void *join_thread(void *arg)
{
    struct joined *j = arg;
    j->st = shard_attach(d.sock, &j->ctx);
    if (j->st == 0)
        j->st = shard_register(j->ctx, &j->x.m);
    if (j->st != 0)
        snprintf(j->err, sizeof(j->err), "%s", shard_last_error(j->ctx));
    __atomic_store_n(&j->done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

/* fn on a and b at once (two ranks' calls that wait for each other) */
static void run_pair(void *(*fn)(void *), void *a, void *b)
{
    pthread_t th;
    pthread_create(&th, NULL, fn, a);
    fn(b);
    pthread_join(th, NULL);
}

/* Two ranks of one job (their models set up) register at once, as they must; false after the
 * failed check when either did not. */
static bool join_pair(struct joined *r0, struct joined *r1, const char *what)
{
    run_pair(join_thread, r0, r1);
    TH_CHECK(r0->st == 0 && r1->st == 0, "%s: 2 ranks register: %d %d", what, r0->st, r1->st);
    return r0->st == 0 && r1->st == 0;
}

static void test_registration(void)
{
    /* rank 0 waits for rank 1; a rank 1 with another model is refused, and rank 0 hears it at
     * once (not at the registration's deadline), naming the difference; then both register */
    struct joined r0 = {0};
    struct tiny bad;
    tiny_init(&r0.x, "dup", 0, 2, 100);
    tiny_init(&bad, "dup", 1, 2, 101);
    pthread_t th;
    pthread_create(&th, NULL, join_thread, &r0);
    usleep(200000);
    shard_ctx_t *ctx;
    shard_attach(d.sock, &ctx);
    double t0 = th_now_s();
    int st = shard_register(ctx, &bad.m);
    expect_error(ctx, st, SHARD_EMISMATCH, "dims[0] 100 vs 101", "different model");
    shard_detach(ctx);
    pthread_join(th, NULL);
    TH_CHECK(r0.st == SHARD_EMISMATCH && strstr(r0.err, "rank 1 (pid ") &&
                 strstr(r0.err, "registered it differently") &&
                 strstr(r0.err, "dims[0] 100 vs 101"),
             "rank 0 is told why the job cannot start: %d '%s'", r0.st, r0.err);
    TH_CHECK(th_now_s() - t0 < 2.0, "rank 0 heard it before the registration's deadline (2 s)");
    if (r0.ctx)
        shard_detach(r0.ctx);
    struct joined a = {0}, b = {0};
    tiny_init(&a.x, "dup", 0, 2, 100);
    tiny_init(&b.x, "dup", 1, 2, 100);
    join_pair(&a, &b, "after the refusal");
    if (a.ctx)
        shard_detach(a.ctx);
    if (b.ctx)
        shard_detach(b.ctx);

    /* the job's secret: two ranks of a node with different ones refused (the second, naming
     * it; the first hears it at once), one of 8 bytes refused by libshard, and a token of 5
     * bytes (a hostile client's: libshard sends 32) by the daemon */
    static const char sec_a[] = "0123456789abcdef0123", sec_b[] = "fedcba98765432100123";
    struct joined s0 = {0};
    struct tiny s1;
    tiny_init(&s0.x, "secrets", 0, 2, 100);
    tiny_init(&s1, "secrets", 1, 2, 100);
    s0.x.m.job_secret = sec_a;
    s0.x.m.job_secret_len = sizeof(sec_a) - 1;
    s1.m.job_secret = sec_b;
    s1.m.job_secret_len = sizeof(sec_b) - 1;
    pthread_create(&th, NULL, join_thread, &s0);
    usleep(200000);
    shard_attach(d.sock, &ctx);
    st = shard_register(ctx, &s1.m);
    expect_error(ctx, st, SHARD_EMISMATCH, "another job secret than the other ranks of this node",
                 "a rank with another job secret");
    shard_detach(ctx);
    pthread_join(th, NULL);
    TH_CHECK(s0.st == SHARD_EMISMATCH, "rank 0 is told: %d '%s'", s0.st, s0.err);
    if (s0.ctx)
        shard_detach(s0.ctx);
    s1.m.job_secret_len = 8;
    shard_attach(d.sock, &ctx);
    st = shard_register(ctx, &s1.m);
    expect_error(ctx, st, SHARD_EINVAL, "a job secret of 8 bytes; give 16-4096",
                 "a job secret of 8 bytes");
    shard_detach(ctx);
    int fd = raw_connect();
    Shard__Attach at = SHARD__ATTACH__INIT;
    at.protocol_version = SD_PROTOCOL_VERSION;
    Shard__ClientMsg cm = SHARD__CLIENT_MSG__INIT;
    cm.msg_case = SHARD__CLIENT_MSG__MSG_ATTACH;
    cm.attach = &at;
    char msg[512];
    sd_frame_send(fd, &cm.base, NULL, 0, 2000);
    TH_CHECK(read_error(fd, msg, sizeof(msg)) == 0, "a raw client attaches: '%s'", msg);
    uint8_t five[5] = {1, 2, 3, 4, 5};
    Shard__Register rg = SHARD__REGISTER__INIT;
    rg.job = "tokens";
    rg.world = 1;
    rg.job_token.data = five;
    rg.job_token.len = sizeof(five);
    cm.msg_case = SHARD__CLIENT_MSG__MSG_REGISTER;
    cm.register_ = &rg;
    sd_frame_send(fd, &cm.base, NULL, 0, 2000);
    st = read_error(fd, msg, sizeof(msg));
    TH_CHECK(st == SHARD_EINVAL && strstr(msg, "a job token of 5 bytes"),
             "a job token of 5 bytes refused: %d '%s'", st, msg);
    close(fd);

    /* a model larger than the memory budget is refused with the numbers */
    struct tiny big;
    tiny_init(&big, "huge", 0, 1, 1ULL << 36);
    shard_attach(d.sock, &ctx);
    st = shard_register(ctx, &big.m);
    TH_CHECK(st == SHARD_ENOSPC && strstr(shard_last_error(ctx), "needs") &&
                 strstr(shard_last_error(ctx), "memory budget"),
             "over budget: %d '%s'", st, shard_last_error(ctx));
    shard_detach(ctx);

    /* a job whose second rank never comes: deadline, error naming the missing rank */
    struct tiny lone;
    tiny_init(&lone, "lonely", 0, 2, 100);
    shard_attach(d.sock, &ctx);
    t0 = th_now_s();
    st = shard_register(ctx, &lone.m);
    double took = th_now_s() - t0;
    expect_error(ctx, st, SHARD_ETIMEDOUT, "ranks 1 did not register", "register deadline");
    TH_CHECK(took < 2.0 + 1.5, "register deadline took %.2f s (register_timeout_ms 2000)", took);
    shard_detach(ctx);
    expect_alive("registration errors");
}

/* Hyperparameters, plan options, job names and sizes a client controls: refused with the field
 * named, the daemon unharmed (issue 24). */
static void test_validation(void)
{
    shard_ctx_t *ctx;
    struct tiny x;
    struct {
        float *field;
        float value;
        const char *name;
    } bad[] = {{&x.m.optimizer.lr, INFINITY, "lr is inf"},
               {&x.m.optimizer.lr, -0.5f, "lr is -0.5; it must be finite and at least 0"},
               {&x.m.optimizer.weight_decay, NAN, "weight_decay is nan"},
               {&x.m.optimizer.eps, -1.0f, "eps is -1"},
               {&x.m.optimizer.max_grad_norm, INFINITY, "max_grad_norm is inf"},
               {&x.m.optimizer.beta2, 1.0f, "beta2 is 1"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tiny_init(&x, "hyper", 0, 1, 100);
        *bad[i].field = bad[i].value;
        TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
        int st = shard_register(ctx, &x.m);
        expect_error(ctx, st, SHARD_EINVAL, bad[i].name, bad[i].name);
        shard_detach(ctx);
    }
    const char *plans[] = {"zero3,", "zero3,,no-hier", "mics:2,"};
    for (size_t i = 0; i < 3; i++) {
        tiny_init(&x, "plans", 0, 1, 100);
        x.m.plan = plans[i];
        shard_attach(d.sock, &ctx);
        int st = shard_register(ctx, &x.m);
        expect_error(ctx, st, SHARD_EINVAL, "empty option", plans[i]);
        shard_detach(ctx);
    }
    const char *names[] = {"../../etc/x", "a/b", ".hidden", "-x", "sp ace", "t\x01"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        tiny_init(&x, names[i], 0, 1, 100);
        shard_attach(d.sock, &ctx);
        int st = shard_register(ctx, &x.m);
        expect_error(ctx, st, SHARD_EINVAL, "A-Z a-z 0-9 . _ - : , + = @", names[i]);
        shard_detach(ctx);
    }
    /* a pool size near 2^64: the budget sum must not wrap into a small number */
    tiny_init(&x, "wrap", 0, 1, 100);
    x.m.max_live_bytes = UINT64_MAX - 4096;
    shard_attach(d.sock, &ctx);
    int st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_ENOSPC, "memory budget", "max_live_bytes near 2^64");
    shard_detach(ctx);

    /* 64K tensors, the last two of one name: refused in well under a second (comparing every
     * pair took 19 s and stopped the heartbeats) */
    uint32_t n = 65536;
    shard_tensor_t *ts = th_many_tensors(n, true);
    tiny_init(&x, "many", 0, 1, 100);
    x.m.tensors = ts;
    x.m.n_tensors = n;
    shard_attach(d.sock, &ctx);
    double t0 = th_now_s();
    st = shard_register(ctx, &x.m);
    double took = th_now_s() - t0;
    expect_error(ctx, st, SHARD_EINVAL, "share the name 't65534'", "64K tensors, one name twice");
    printf("64K-tensor registration refused in %.3f s\n", took);
    shard_detach(ctx);
    /* more tensors than max_tensors (65536 by default) */
    free(ts);
    ts = th_many_tensors(n + 1, false);
    x.m.tensors = ts;
    x.m.n_tensors = n + 1;
    shard_attach(d.sock, &ctx);
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "max_tensors", "65537 tensors");
    shard_detach(ctx);
    free(ts);
    expect_alive("validation");
}

/* libshard's own completion ring corrupted (by this process): the next wait fails with the
 * reason, in bounded time, instead of spinning through 2^64 entries */
static void test_corrupt_cq(void)
{
    shard_ctx_t *ctx;
    struct tiny x;
    tiny_init(&x, "corrupt", 0, 1, 100);
    TH_CHECK(shard_attach(d.sock, &ctx) == 0 && shard_register(ctx, &x.m) == 0, "register: %s",
             shard_last_error(ctx));
    struct sd_ring_hdr *h = shard__ring(ctx);
    atomic_store(&h->cq_head, atomic_load(&h->cq_tail) + (1ULL << 40));
    const void *p;
    double t0 = th_now_s();
    int st = shard_fetch(ctx, 0, &p);
    TH_CHECK(st == SHARD_EPROTO && strstr(shard_last_error(ctx), "corrupt") &&
                 th_now_s() - t0 < 5.0,
             "fetch with a corrupt completion ring: %d '%s' after %.2f s", st,
             shard_last_error(ctx), th_now_s() - t0);
    shard_detach(ctx);
    expect_alive("corrupt completion ring");
}

static void *step_thread(void *arg)
{
    struct joined *j = arg;
    double norm;
    j->st = shard_step(j->ctx, &norm);
    return NULL;
}

static long long poll_passes(void)
{
    char *js = th_admin(d.sock, "status");
    const char *p = js ? strstr(js, "\"poll_passes\":") : NULL;
    long long n = p ? atoll(p + strlen("\"poll_passes\":")) : -1;
    free(js);
    return n;
}

/* Requests queued behind one that must wait (a push a micro-step ahead of its group) are
 * neither lost nor a reason to poll: the daemon sleeps until the group catches up. It used to
 * spin for as long as the ring held them (hundreds of thousands of passes a second). */
static void test_stalled_requests(void)
{
    struct joined r[2];
    for (int i = 0; i < 2; i++)
        tiny_init(&r[i].x, "stall", (uint32_t)i, 2, 100);
    if (!join_pair(&r[0], &r[1], "stall"))
        return;
    shard_unit_info_t ui;
    shard_unit_info(r[0].ctx, 0, &ui);
    float *g = calloc(ui.numel, sizeof(float));
    for (uint64_t i = 0; i < 100; i++)
        g[i] = 1.0f;
    /* rank 0 runs a micro-step ahead: its second push of unit 0 waits for rank 1's first, and
     * a fetch queues behind it */
    TH_CHECK(shard_push_grad(r[0].ctx, 0, g, ui.bytes) == 0, "push 1");
    TH_CHECK(shard_push_grad(r[0].ctx, 0, g, ui.bytes) == 0, "push 2");
    shard_req_t req;
    TH_CHECK(shard_fetch_async(r[0].ctx, 1, &req) == 0, "fetch behind the stalled push");
    usleep(100000);
    long long p0 = poll_passes();
    usleep(1000000);
    long long p1 = poll_passes();
    TH_CHECK(p0 >= 0 && p1 - p0 < 5000,
             "the daemon polled %lld times in 1 s with nothing it could do (it should sleep)",
             p1 - p0);
    /* rank 1 catches up: everything queued completes, nothing lost */
    TH_CHECK(shard_push_grad(r[1].ctx, 0, g, ui.bytes) == 0, "rank 1 push 1");
    TH_CHECK(shard_push_grad(r[1].ctx, 0, g, ui.bytes) == 0, "rank 1 push 2");
    const void *p;
    TH_CHECK(shard_wait(r[0].ctx, req, &p) == 0 && p != NULL, "the queued fetch: %s",
             shard_last_error(r[0].ctx));
    TH_CHECK(shard_release(r[0].ctx, 1) == 0, "release");
    /* the same calls on both ranks of the group, as the schedule check wants */
    TH_CHECK(shard_fetch(r[1].ctx, 1, &p) == 0 && shard_release(r[1].ctx, 1) == 0,
             "rank 1 fetch: %s", shard_last_error(r[1].ctx));
    run_pair(step_thread, &r[0], &r[1]);
    TH_CHECK(r[0].st == 0 && r[1].st == 0, "step: %d %d", r[0].st, r[1].st);
    /* 2 micro-steps x 2 ranks of gradient 1, averaged over the 2 ranks: 2; SGD lr 0.1 */
    TH_CHECK(shard_fetch(r[1].ctx, 0, &p) == 0 && ((const float *)p)[0] == -0.2f &&
                 ((const float *)p)[99] == -0.2f,
             "after the step a[0] = %g, expected -0.2", ((const float *)p)[0]);
    shard_release(r[1].ctx, 0);
    free(g);
    for (int i = 0; i < 2; i++)
        shard_detach(r[i].ctx);
    expect_alive("requests queued behind a stalled push");
}

/* A rank that never comes to the step: after op_timeout (3 s here) the rank waiting in it fails
 * naming the missing rank, and the other rank hears that its job failed; the daemon unharmed. */
static void test_barrier_deadline(void)
{
    struct joined r[2];
    for (int i = 0; i < 2; i++)
        tiny_init(&r[i].x, "lagging", (uint32_t)i, 2, 100);
    if (!join_pair(&r[0], &r[1], "lagging"))
        return;
    double norm, t0 = th_now_s();
    int st = shard_step(r[0].ctx, &norm);
    double took = th_now_s() - t0;
    expect_error(r[0].ctx, st, SHARD_ETIMEDOUT, "step 1: ranks 1 did not call step within 3000 ms",
                 "a step rank 1 never calls");
    TH_CHECK(took >= 2.9 && took < 3.0 + 2.0, "the step's deadline came after %.2f s (3 s)", took);
    const void *p;
    st = shard_fetch(r[1].ctx, 0, &p);
    TH_CHECK(st != 0 && strstr(shard_last_error(r[1].ctx), "did not call step") != NULL,
             "rank 1's next call hears why the job failed: %d '%s'", st,
             shard_last_error(r[1].ctx));
    for (int i = 0; i < 2; i++)
        shard_detach(r[i].ctx);
    expect_alive("a rank that never steps");
}

/* A client that dies while the daemon backs its job's buffers (on a worker thread, so that
 * the daemon answers meanwhile): the job goes, its bytes return to the budget, nothing leaks,
 * and the same name registers again. */
static void test_leave_while_allocating(void)
{
    const char *backend = getenv("SHARD_TEST_BACKEND");
    if (backend != NULL && backend[0] != '\0' && strcmp(backend, "host") != 0 &&
        strcmp(backend, "host-deferred") != 0 && strcmp(backend, "emu") != 0) {
        /* a device's memory is allocated on the loop: no window in which the job allocates */
        printf("skipped: a client killed while allocating (backend %s allocates on the loop)\n",
               backend);
        return;
    }
    struct tiny big;
    tiny_init(&big, "alloc-victim", 0, 1, 1ULL << 25); /* ~1 GiB with pool and staging */
    pid_t pid = fork();
    if (pid == 0) {
        shard_ctx_t *ctx;
        if (shard_attach(d.sock, &ctx) == 0)
            shard_register(ctx, &big.m);
        _exit(0);
    }
    bool seen = false;
    double t0 = th_now_s();
    while (!seen && th_now_s() - t0 < 20) {
        char *js = th_admin(d.sock, "jobs");
        seen = js && strstr(js, "\"alloc-victim\"") && strstr(js, "\"allocating\":true");
        free(js);
        if (!seen)
            usleep(1000);
    }
    TH_CHECK(seen, "never saw the job allocating (the daemon did not answer while it allocated)");
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    bool gone = false;
    for (t0 = th_now_s(); !gone && th_now_s() - t0 < 20; usleep(10000)) {
        char *js = th_admin(d.sock, "status");
        gone = js && !strstr(js, "\"alloc-victim\"") && strstr(js, "\"memory_used_bytes\":0");
        free(js);
    }
    TH_CHECK(gone, "the job of a client killed while allocating is still there, or its memory");
    expect_alive("a client killed while its job allocated");
    shard_ctx_t *ctx;
    struct tiny again;
    tiny_init(&again, "alloc-victim", 0, 1, 1000);
    TH_CHECK(shard_attach(d.sock, &ctx) == 0 && shard_register(ctx, &again.m) == 0,
             "the name registers again: %s", shard_last_error(ctx));
    shard_detach(ctx);
}

static pid_t spawn_rank(const char *job, int rank, int world, int steps, const char *plan,
                        const char *dump, const char *log)
{
    char r[16], w[16], s[16];
    snprintf(r, sizeof(r), "%d", rank);
    snprintf(w, sizeof(w), "%d", world);
    snprintf(s, sizeof(s), "%d", steps);
    const char *argv[] = {MLP_TRAIN_PATH,
                          "--socket",
                          d.sock,
                          "--job",
                          job,
                          "--rank",
                          r,
                          "--world",
                          w,
                          "--steps",
                          s,
                          "--plan",
                          plan,
                          "--hidden",
                          "128",
                          "--quiet",
                          dump ? "--dump-params" : NULL,
                          dump,
                          NULL};
    return th_spawn(argv, log);
}

static void test_kill_mid_step(void)
{
    char log[4][400], bdump[400], bref[400], blog[2][400];
    /* the bystander: another job, 2 ranks, trains through all of this */
    pid_t by[2];
    snprintf(bdump, sizeof(bdump), "%s/bystander.bin", d.dir);
    snprintf(bref, sizeof(bref), "%s/bystander-ref.bin", d.dir);
    for (int r = 0; r < 2; r++) {
        snprintf(blog[r], sizeof(blog[r]), "%s/bystander-%d.log", d.dir, r);
        by[r] = spawn_rank("bystander", r, 2, 400, "zero3", r == 0 ? bdump : NULL, blog[r]);
    }
    pid_t v[4];
    for (int r = 0; r < 4; r++) {
        snprintf(log[r], sizeof(log[r]), "%s/victim-%d.log", d.dir, r);
        v[r] = spawn_rank("victim", r, 4, 100000, "mics:2", NULL, log[r]);
    }
    usleep(700000);
    char *js = th_admin(d.sock, "jobs");
    TH_CHECK(js && strstr(js, "\"victim\"") && strstr(js, "\"running\""), "victim running: %s", js);
    free(js);
    kill(v[2], SIGKILL);
    double t0 = th_now_s();
    for (int r = 0; r < 4; r++) {
        int rc = th_wait(v[r], 3000 + 1000 + 2000);
        if (r == 2)
            continue;
        double took = th_now_s() - t0;
        TH_CHECK(rc == 1, "victim rank %d exit code %d", r, rc);
        TH_CHECK(took <= 3.0 + 1.0, "victim rank %d failed after %.2f s (op_timeout 3 s)", r, took);
        char *out = th_read_file(log[r], NULL);
        TH_CHECK(out && strstr(out, "rank 2") && strstr(out, "disconnected"),
                 "victim rank %d error does not name the dead rank: %s", r, out ? out : "");
        free(out);
    }
    expect_alive("a client killed mid-step");
    for (int r = 0; r < 2; r++)
        TH_CHECK(th_wait(by[r], 60000) == 0, "bystander rank %d failed (log %s)", r, blog[r]);
    const char *argv[] = {MLP_TRAIN_PATH, "--reference",   "--world",  "2",
                          "--steps",      "400",           "--hidden", "128",
                          "--quiet",      "--dump-params", bref,       NULL};
    TH_CHECK(th_wait(th_spawn(argv, NULL), 60000) == 0, "bystander reference");
    size_t a, b;
    char *x = th_read_file(bdump, &a), *y = th_read_file(bref, &b);
    TH_CHECK(x && y && a == b && memcmp(x, y, a) == 0,
             "the bystander job's parameters changed: they differ from its reference");
    free(x);
    free(y);
    /* the victim's job is kept as a failed record with its memory returned to the budget */
    js = th_admin(d.sock, "status");
    TH_CHECK(js && strstr(js, "\"failed\"") && strstr(js, "rank 2 (pid") &&
                 strstr(js, "\"memory_used_bytes\":0"),
             "victim not listed as failed, or memory still accounted: %s", js);
    free(js);
    /* and its name can be used by a new job */
    pid_t again[2];
    for (int r = 0; r < 2; r++)
        again[r] = spawn_rank("victim", r, 2, 3, "ddp", NULL, log[r]);
    for (int r = 0; r < 2; r++)
        TH_CHECK(th_wait(again[r], 30000) == 0, "a new job named victim, rank %d (log %s)", r,
                 log[r]);
}

/* A job's name while that job goes (a restarted trainer registering before its old job ended):
 * a job that runs on refuses the name at once; one whose ranks are detaching (closing, failed)
 * makes the registration wait for them and then go on; one whose ranks stay past
 * register_timeout_ms (2 s here) refuses it then, naming what it waited for. A waiting
 * registration whose process dies is forgotten. */
static void test_name_in_use(void)
{
    struct joined a = {0}, b = {0}, dup = {0};
    tiny_init(&a.x, "inuse", 0, 2, 100);
    tiny_init(&b.x, "inuse", 1, 2, 100);
    tiny_init(&dup.x, "inuse", 1, 2, 100);
    if (!join_pair(&a, &b, "job 'inuse'"))
        return;
    double t0 = th_now_s();
    join_thread(&dup); /* a third process's rank 1 while both run */
    TH_CHECK(dup.st == SHARD_EEXIST && strstr(dup.err, "already running") && th_now_s() - t0 < 1.0,
             "a registration of a running job's name: %d '%s' after %.2f s (refused at once "
             "expected)",
             dup.st, dup.err, th_now_s() - t0);
    if (dup.ctx)
        shard_detach(dup.ctx);

    /* rank 1 detaches: the job closes; a new rank 1 waits until rank 0 detached too */
    shard_detach(b.ctx);
    struct joined n0 = {0}, n1 = {0};
    tiny_init(&n0.x, "inuse", 0, 2, 100);
    tiny_init(&n1.x, "inuse", 1, 2, 100);
    pthread_t th;
    pthread_create(&th, NULL, join_thread, &n1);
    usleep(500000);
    TH_CHECK(!n1.done, "a registration while the job's ranks detach returned at once: %d '%s'",
             n1.st, n1.err);
    /* a waiting registration whose process dies: forgotten (the daemon reads nothing of it) */
    char log[400];
    snprintf(log, sizeof(log), "%s/inuse-dies.log", d.dir);
    pid_t dies = spawn_rank("inuse", 0, 2, 1, "zero3", NULL, log);
    usleep(300000);
    kill(dies, SIGKILL);
    th_wait(dies, 5000);
    usleep(100000);
    shard_detach(a.ctx); /* the old job ends: the waiting registration makes the new one */
    join_thread(&n0);
    pthread_join(th, NULL);
    TH_CHECK(n0.st == 0 && n1.st == 0,
             "after the old job ended, the waiting rank 1 and a new rank 0 register: %d '%s', "
             "%d '%s'",
             n1.st, n1.err, n0.st, n0.err);
    char *dl = th_read_file(d.log, NULL);
    TH_CHECK(dl && strstr(dl, "rank 1 (pid ") &&
                 strstr(dl, "waits to register: the job of that name is closing; 1 of its 2 "
                            "ranks on this node have not detached yet"),
             "the daemon does not log why the registration waits");
    free(dl);

    /* the new job's rank 1 detaches, rank 0 stays: a registration waits 2 s, then is refused */
    if (n1.ctx)
        shard_detach(n1.ctx);
    struct joined late = {0};
    tiny_init(&late.x, "inuse", 1, 2, 100);
    t0 = th_now_s();
    join_thread(&late);
    double took = th_now_s() - t0;
    TH_CHECK(late.st == SHARD_ETIMEDOUT && strstr(late.err, "waited 2000 ms") &&
                 strstr(late.err, "closing; 1 of its 2 ranks on this node have not detached") &&
                 took > 1.9 && took < 2.0 + 1.5,
             "a registration waiting for ranks that stay: %d '%s' after %.2f s (refused after "
             "register_timeout_ms, 2 s, expected)",
             late.st, late.err, took);
    if (late.ctx)
        shard_detach(late.ctx);
    if (n0.ctx)
        shard_detach(n0.ctx);
    expect_alive("a job's name while that job goes");
}

/* Rank 0's broadcast with the step (shard_step_args_t.bcast): every other rank gets its bytes,
 * also in a step skipped as non-finite; ranks that disagree on giving them fail the step with
 * EMISMATCH, and a wrong size or a model without bcast_bytes is refused before the step. */
struct bjoined {
    struct joined j;
    shard_step_args_t a;
    uint64_t buf[3];
};

static void *bcast_thread(void *arg)
{
    struct bjoined *b = arg;
    b->j.st = shard_step_ex(b->j.ctx, &b->a, NULL);
    return NULL;
}

static void bcast_step(struct bjoined r[2])
{
    run_pair(bcast_thread, &r[0], &r[1]);
}

static void test_bcast(void)
{
    struct bjoined r[2];
    memset(r, 0, sizeof(r));
    for (int i = 0; i < 2; i++) {
        tiny_init(&r[i].j.x, "bcast", (uint32_t)i, 2, 100);
        r[i].j.x.m.bcast_bytes = sizeof(r[i].buf);
    }
    if (!join_pair(&r[0].j, &r[1].j, "with bcast_bytes"))
        return;
    for (int i = 0; i < 2; i++) {
        r[i].a = (shard_step_args_t){.bcast = r[i].buf, .bcast_bytes = sizeof(r[i].buf)};
        for (int w = 0; w < 3; w++)
            r[i].buf[w] = 0x1111111111111111ull * (uint64_t)(i + 1) + (uint64_t)w;
    }
    bcast_step(r);
    TH_CHECK(r[0].j.st == 0 && r[1].j.st == 0, "a step with a broadcast: %d %d (%s)", r[0].j.st,
             r[1].j.st, shard_last_error(r[1].j.ctx));
    TH_CHECK(memcmp(r[1].buf, r[0].buf, sizeof(r[0].buf)) == 0 &&
                 r[0].buf[2] == 0x1111111111111113ull,
             "rank 1 holds rank 0's bytes after the step: %llx (rank 0 %llx)",
             (unsigned long long)r[1].buf[2], (unsigned long long)r[0].buf[2]);

    /* a step skipped as non-finite delivers them all the same */
    shard_unit_info_t ui;
    shard_unit_info(r[0].j.ctx, 0, &ui);
    float *g = calloc(ui.numel, sizeof(float));
    TH_CHECK(shard_push_grad(r[1].j.ctx, 0, g, ui.bytes) == 0, "push zeros");
    g[0] = NAN;
    TH_CHECK(shard_push_grad(r[0].j.ctx, 0, g, ui.bytes) == 0, "push a NaN");
    free(g);
    r[0].buf[0] = 42;
    r[1].buf[0] = 7;
    bcast_step(r);
    TH_CHECK(r[0].j.st == SHARD_ENONFINITE && r[1].j.st == SHARD_ENONFINITE && r[1].buf[0] == 42,
             "a non-finite step: %d %d, rank 1 holds %llu (rank 0 gave 42)", r[0].j.st, r[1].j.st,
             (unsigned long long)r[1].buf[0]);

    /* rank 1 gives none: both fail with EMISMATCH, and rank 1's buffer is left alone */
    r[1].a.bcast = NULL;
    r[0].buf[0] = 43;
    r[1].buf[0] = 8;
    bcast_step(r);
    TH_CHECK(r[0].j.st == SHARD_EMISMATCH && r[1].j.st == SHARD_EMISMATCH &&
                 strstr(shard_last_error(r[0].j.ctx), "buffers to broadcast") != NULL &&
                 r[1].buf[0] == 8,
             "ranks that disagree on broadcasting: %d %d '%s'", r[0].j.st, r[1].j.st,
             shard_last_error(r[0].j.ctx));
    r[1].a.bcast = r[1].buf;
    r[1].a.bcast_bytes = 8;
    int st = shard_step_ex(r[1].j.ctx, &r[1].a, NULL);
    expect_error(r[1].j.ctx, st, SHARD_EINVAL, "8 bytes to broadcast; the model registered",
                 "a broadcast of the wrong size");
    r[1].a.bcast_bytes = sizeof(r[1].buf);
    bcast_step(r); /* and the job goes on */
    TH_CHECK(r[0].j.st == 0 && r[1].j.st == 0 && r[1].buf[0] == 43,
             "the step after the refusals: %d %d, rank 1 holds %llu", r[0].j.st, r[1].j.st,
             (unsigned long long)r[1].buf[0]);
    for (int i = 0; i < 2; i++)
        shard_detach(r[i].j.ctx);

    /* a model that registered no broadcast bytes */
    shard_ctx_t *ctx;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    struct tiny x;
    tiny_init(&x, "nobcast", 0, 1, 100);
    TH_CHECK(shard_register(ctx, &x.m) == 0, "register: %s", shard_last_error(ctx));
    uint64_t one = 1;
    shard_step_args_t a = {.bcast = &one, .bcast_bytes = 8};
    st = shard_step_ex(ctx, &a, NULL);
    expect_error(ctx, st, SHARD_EINVAL, "registered bcast_bytes 0", "a broadcast of no model's");
    st = shard__post_raw(ctx, SD_OP_STEP, 0, SD_STEP_ARG_BCAST, 0);
    expect_error(ctx, st, SHARD_EINVAL, "registered none", "a broadcast flag past the library");
    shard_detach(ctx);
    TH_CHECK(shard_attach(d.sock, &ctx) == 0, "attach");
    tiny_init(&x, "bigbcast", 0, 1, 100);
    x.m.bcast_bytes = (64ull << 20) + 1;
    st = shard_register(ctx, &x.m);
    expect_error(ctx, st, SHARD_EINVAL, "to broadcast with each step; at most",
                 "bcast_bytes over 64 MiB");
    shard_detach(ctx);
    expect_alive("broadcasts");
}

/* A write into the gathered weights (a torch optimizer's in-place update, a stray pointer) does
 * not kill the process: it lands in a private copy, the other rank still reads the shared
 * value, and the writer's next call fails naming the unit and the tensor, after which its view
 * reads the shared value again. A fault anywhere else still reaches the process's own handler,
 * or kills it as before. */
static void chained_segv(int sig)
{
    (void)sig;
    _exit(7);
}

static int segv_child(bool own_handler)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (own_handler)
            signal(SIGSEGV, chained_segv);
        shard_ctx_t *ctx;
        struct tiny x;
        tiny_init(&x, own_handler ? "segv-own" : "segv-dfl", 0, 1, 100);
        if (shard_attach(d.sock, &ctx) != 0 || shard_register(ctx, &x.m) != 0)
            _exit(3);
        volatile char *ro = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ro[1] = 1; /* outside the pool */
        _exit(0);
    }
    int ws;
    waitpid(pid, &ws, 0);
    return ws;
}

static void test_pool_write(void)
{
    struct joined r[2];
    for (int i = 0; i < 2; i++)
        tiny_init(&r[i].x, "scribble", (uint32_t)i, 2, 100);
    if (!join_pair(&r[0], &r[1], "scribble"))
        return;
    const void *p0, *p1;
    TH_CHECK(shard_fetch(r[0].ctx, 1, &p0) == 0 && shard_fetch(r[1].ctx, 1, &p1) == 0, "fetch: %s",
             shard_last_error(r[0].ctx));
    float *w0 = (float *)p0;
    const float *w1 = p1;
    float was = w1[4];
    w0[4] = was + 42.0f; /* tensor b (3x5), element 4 */
    TH_CHECK(w0[4] == was + 42.0f, "the write did not land in the writer's copy");
    TH_CHECK(w1[4] == was, "rank 1 reads %g after rank 0's write, not the shared %g", w1[4], was);
    int st = shard_release(r[0].ctx, 1);
    expect_error(r[0].ctx, st, SHARD_EPERM, "gathered weights of unit 1 (tensor 1, element 4)",
                 "the call after a write into the pool");
    TH_CHECK(strstr(shard_last_error(r[0].ctx), "optimizer") != NULL,
             "the error does not say what to use instead: %s", shard_last_error(r[0].ctx));
    TH_CHECK(w0[4] == was, "after the error the writer reads %g, not the shared %g", w0[4], was);
    TH_CHECK(shard_release(r[0].ctx, 1) == 0 && shard_release(r[1].ctx, 1) == 0,
             "release after the error: %s", shard_last_error(r[0].ctx));
    /* the page is read-only again: a second write is caught as the first was */
    TH_CHECK(shard_fetch(r[0].ctx, 1, &p0) == 0 && shard_fetch(r[1].ctx, 1, &p1) == 0,
             "fetch again: %s", shard_last_error(r[0].ctx));
    ((float *)p0)[0] = -1.0f;
    st = shard_release(r[0].ctx, 1);
    expect_error(r[0].ctx, st, SHARD_EPERM, "unit 1 (tensor 1, element 0)", "a second write");
    TH_CHECK(shard_release(r[0].ctx, 1) == 0 && shard_release(r[1].ctx, 1) == 0, "release");
    for (int i = 0; i < 2; i++)
        shard_detach(r[i].ctx);
    expect_alive("writes into the pool");

    int ws = segv_child(true);
    TH_CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 7,
             "a fault outside the pool did not reach the process's own handler (status %#x)", ws);
    ws = segv_child(false);
#if defined(__SANITIZE_ADDRESS__) /* ASan's handler was there before: it reports and aborts */
    TH_CHECK(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGABRT,
             "a fault outside the pool did not reach AddressSanitizer's handler (status %#x)", ws);
#else
    TH_CHECK(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGSEGV,
             "a fault outside the pool did not kill the process with SIGSEGV (status %#x)", ws);
#endif
}

int main(void)
{
    const char *args[] = {"--op-timeout-ms", "3000", "--register-timeout-ms", "2000", NULL};
    if (th_daemon_start(&d, args) != 0) {
        fprintf(stderr, "cannot start shardd\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    test_garbage();
    test_api_misuse();
    test_release_detached();
    test_fence();
    test_zero_copy_push();
    test_step_args();
    test_pool_write();
    test_bcast();
    test_null_and_pool();
    test_registration();
    test_validation();
    test_corrupt_cq();
    test_leave_while_allocating();
    test_stalled_requests();
    test_barrier_deadline();
    test_kill_mid_step();
    test_name_in_use();
    TH_CHECK(th_daemon_alive(&d), "daemon died");
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
    return th_summary("test_badinput");
}

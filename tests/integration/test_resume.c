/* Jobs that outlive their trainers (issue 22, item 3): with a resume timeout a rank that dies
 * pauses the job; the other ranks are told (SHARD_EPAUSED, naming the rank and the step) and
 * register again, the killed rank is restarted, and the job continues from the step it paused
 * at. The final parameters must equal an uninterrupted run's bit for bit.
 *
 * Runs of mlp_train --resume-timeout-ms (a rank told the job paused registers again by itself):
 * - 1 node x 4 ranks, zero3: SIGKILL one rank at a random moment and restart it (3 trials);
 *   SIGKILL all four and restart them;
 * - 2 nodes x 2 ranks, zero3 and mics:2: the same (the pause crosses nodes);
 * - a paused job not registered again within its timeout is dropped (shardctl jobs shows it
 *   paused meanwhile), and a registration of another model is refused naming the step;
 * - 2 x 2, through libshard: a rank killed while its node's step waits for the other node's
 *   norm, restarted at once: its registration waits for the pause (not refused: the job is
 *   still running then) and resumes the job with the others;
 * - a restart whose registration the daemon reads before its predecessor's hang-up (the loop
 *   held by a test hook meanwhile) waits for it and resumes the job;
 * - a resuming registration refused while its memory is allocated leaves the paused job
 *   resumable at once (test hooks only: the allocation held by SHARDD_TEST_ALLOC_STALL_MS).
 * Each interrupted run is compared with an uninterrupted run of the same cluster and plan. With
 * the argument "independent": the 2 x 2 mics:2 runs on independent daemons (no cluster
 * arguments), the ranks naming their leader and giving the job's secret. */
#include "harness.h"

#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define STEPS "24"

static char base[256];

/* rank r of job on cluster c; dump: its final parameters; timeout: --resume-timeout-ms */
static pid_t start_rank(const struct th_cluster *c, const char *job, const char *plan, int r,
                        const char *timeout, const char *dump, const char *hidden, int attempt)
{
    char world[16], log[400];
    snprintf(world, sizeof(world), "%d", c->nodes * c->k);
    snprintf(log, sizeof(log), "%s/%s-%d.%d.log", base, job, r, attempt);
    const char *args[] = {"--world",  world,  "--plan",       plan, "--steps",        STEPS,
                          "--hidden", hidden, "--layers",     "6",  "--accum",        "2",
                          "--seed",   "5",    "--compute-ms", "3",  "--compute-mode", "sleep",
                          "--quiet",  NULL};
    const char *more[5];
    int n = 0;
    if (timeout != NULL) {
        more[n++] = "--resume-timeout-ms";
        more[n++] = timeout;
    }
    if (dump != NULL) {
        more[n++] = "--dump-params";
        more[n++] = dump;
    }
    more[n] = NULL;
    return th_spawn_rank(c->d[r / c->k].sock, job, r, args, more, log);
}

/* an uninterrupted run: its rank 0's parameters in ref */
static bool run_plain(const struct th_cluster *c, const char *job, const char *plan,
                      const char *ref)
{
    int world = c->nodes * c->k, failed = 0;
    pid_t pids[TH_MAX_RANKS];
    for (int r = 0; r < world; r++)
        pids[r] = start_rank(c, job, plan, r, NULL, r == 0 ? ref : NULL, "192", 0);
    for (int r = 0; r < world; r++)
        failed += th_wait(pids[r], 120000) != 0;
    TH_CHECK(failed == 0, "%s: %d ranks of the uninterrupted run failed", job, failed);
    return failed == 0;
}

/* the step rank 0 resumed after (its log of run attempt: 0 registered again by itself, 1
 * restarted), or -1 */
static int paused_step(const char *job, int attempt)
{
    char p[400];
    snprintf(p, sizeof(p), "%s/%s-0.%d.log", base, job, attempt);
    char *t = th_read_file(p, NULL);
    const char *at = t ? strstr(t, "resumed the paused job after step ") : NULL;
    int step = at ? atoi(at + strlen("resumed the paused job after step ")) : -1;
    free(t);
    return step;
}

/* Kill ranks (all, or one at random) of a running job at a random moment, restart them, and
 * compare the final parameters with ref's bit for bit. */
static void kill_and_resume(const struct th_cluster *c, const char *job, const char *plan, bool all,
                            const char *ref)
{
    int world = c->nodes * c->k, failed = 0;
    char dump[400];
    snprintf(dump, sizeof(dump), "%s/%s.bin", base, job);
    pid_t pids[TH_MAX_RANKS];
    for (int r = 0; r < world; r++)
        pids[r] = start_rank(c, job, plan, r, "30000", r == 0 ? dump : NULL, "192", 0);
    int victim = rand() % world;
    useconds_t delay = 600000 + (useconds_t)(rand() % 1400) * 1000;
    usleep(delay);
    for (int r = 0; r < world; r++) { /* all: as a launcher restarting the whole job */
        if (!all && r != victim)
            continue;
        kill(pids[r], SIGKILL);
        th_wait(pids[r], 10000);
    }
    for (int r = 0; r < world; r++)
        if (all || r == victim)
            pids[r] = start_rank(c, job, plan, r, "30000", r == 0 ? dump : NULL, "192", 1);
    for (int r = 0; r < world; r++)
        failed += th_wait(pids[r], 180000) != 0;
    TH_CHECK(failed == 0, "%s: %d ranks failed after the restart", job, failed);
    int step = paused_step(job, all || victim == 0 ? 1 : 0);
    TH_CHECK(step > 0 && step < atoi(STEPS), "%s: rank 0 did not resume mid-run (step %d)", job,
             step);
    struct th_dump_diff dd;
    bool same = th_compare_dumps(ref, dump, 0.0, &dd);
    TH_CHECK(same && dd.differ == 0,
             "%s: %zu of %zu parameters differ from the uninterrupted run "
             "(max %g)",
             job, dd.differ, dd.n, dd.maxd);
    printf("%s: killed %s (rank %d) %.2f s in; rank 0 resumed after step %d; %zu parameters, %zu "
           "differ from the uninterrupted run\n",
           job, all ? "every rank" : "one rank", all ? -1 : victim, delay / 1e6, step, dd.n,
           dd.differ);
}

/* A paused job not registered again in time is dropped; another model is refused. */
static void timeout_and_mismatch(const struct th_cluster *c)
{
    pid_t pids[TH_MAX_RANKS] = {0};
    int world = c->nodes * c->k;
    for (int r = 0; r < world; r++)
        pids[r] = start_rank(c, "drop", "zero3", r, "2500", NULL, "192", 0);
    usleep(900000);
    for (int r = 0; r < world; r++) { /* every trainer dies; nobody registers again */
        kill(pids[r], SIGKILL);
        th_wait(pids[r], 10000);
    }
    json_t *jobs = th_admin_json(c->d[0].sock, "jobs");
    const char *state = "";
    json_t *arr = jobs ? json_object_get(jobs, "jobs") : NULL, *j;
    size_t i;
    json_array_foreach(arr, i, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "name")), "drop") == 0 &&
            json_object_get(j, "resume") != NULL &&
            json_is_true(json_object_get(json_object_get(j, "resume"), "paused")))
            state = json_string_value(json_object_get(j, "state"));
    }
    TH_CHECK(strcmp(state, "paused") == 0, "shardctl jobs does not show job 'drop' paused");
    json_decref(jobs);
    /* another model (hidden 128) under the paused name: refused, naming the step */
    pid_t p = start_rank(c, "drop", "zero3", 0, "2500", NULL, "128", 2);
    TH_CHECK(th_wait(p, 30000) != 0, "another model resumed the paused job");
    char lp[400];
    snprintf(lp, sizeof(lp), "%s/drop-0.2.log", base);
    char *t = th_read_file(lp, NULL);
    TH_CHECK(t && strstr(t, "paused after step") && strstr(t, "another model"),
             "the refusal does not say the job is paused with another model: %s", t ? t : "");
    if (t)
        printf("another model refused: %s", t);
    free(t);
    usleep(3000000); /* past the timeout: dropped */
    char *log = th_read_file(c->d[0].log, NULL);
    TH_CHECK(log && strstr(log, "was not registered again within 2500 ms"),
             "the daemon did not drop the paused job after its timeout");
    free(log);
}

#ifdef SD_TEST_HOOKS
/* A resuming registration refused while its memory is allocated (a rank killed then; the daemon's
 * SHARDD_TEST_ALLOC_STALL_MS holds every allocation 1.5 s) leaves the paused job resumable at
 * once: ranks that register again right after resume it. They used to start a new job at step
 * 0 until the refused registration's memory was gone (across nodes: refused, "node 0 resumes a
 * paused job after step 6, node 1 starts at step 0"). */
static void refused_resume(void)
{
    setenv("SHARDD_TEST_ALLOC_STALL_MS", "1500", 1);
    struct th_cluster c = {.nodes = 1, .k = 2};
    bool up = th_daemon_start(&c.d[0], NULL) == 0;
    unsetenv("SHARDD_TEST_ALLOC_STALL_MS");
    TH_CHECK(up, "shardd with its allocations held");
    if (!up)
        return;
    snprintf(base, sizeof(base), "%s", c.d[0].dir);
    char ref[400], dump[400];
    snprintf(ref, sizeof(ref), "%s/ref-refused.bin", base);
    snprintf(dump, sizeof(dump), "%s/refused.bin", base);
    if (!run_plain(&c, "plain-refused", "zero3", ref)) {
        th_daemon_stop(&c.d[0]);
        return;
    }
    pid_t p[2];
    for (int r = 0; r < 2; r++)
        p[r] = start_rank(&c, "refused", "zero3", r, "30000", r == 0 ? dump : NULL, "192", 0);
    usleep(1500000 + 900000); /* allocated, then a few steps */
    kill(p[0], SIGKILL);      /* paused; rank 1, told so, registers again by itself */
    th_wait(p[0], 10000);
    p[0] = start_rank(&c, "refused", "zero3", 0, "30000", dump, "192", 1);
    usleep(700000); /* both registered: the resuming job's allocation is held */
    kill(p[1], SIGKILL);
    th_wait(p[1], 10000);
    int rc = th_wait(p[0], 10000);
    TH_CHECK(rc != 0, "the registration a rank left while it was allocated was not refused");
    char *log = th_read_file(c.d[0].log, NULL);
    TH_CHECK(log && strstr(log, "disconnected while the job registered"),
             "the daemon does not say the resuming registration was refused");
    free(log);
    for (int r = 0; r < 2; r++) /* at once: the refused job's memory is still being allocated */
        p[r] = start_rank(&c, "refused", "zero3", r, "30000", r == 0 ? dump : NULL, "192", 2);
    int failed = 0;
    for (int r = 0; r < 2; r++)
        failed += th_wait(p[r], 120000) != 0;
    TH_CHECK(failed == 0, "refused: %d ranks failed after the refused resume", failed);
    int step = paused_step("refused", 2);
    TH_CHECK(step > 0 && step < atoi(STEPS),
             "refused: the ranks registered again did not resume the paused job (step %d)", step);
    struct th_dump_diff dd;
    bool same = th_compare_dumps(ref, dump, 0.0, &dd);
    TH_CHECK(same && dd.differ == 0,
             "refused: %zu of %zu parameters differ from the uninterrupted "
             "run",
             dd.differ, dd.n);
    printf("refused: a resuming registration refused mid-allocation; the next resumed after step "
           "%d, %zu parameters, %zu differ\n",
           step, dd.n, dd.differ);
    th_daemon_stop(&c.d[0]);
}
#endif

/* ---- a restart that registers before its job paused (through libshard) */

#define IS_NUMEL 1024 /* a multiple of the world: no padding */

struct is_rank {
    const struct th_cluster *c;
    int rank;
    volatile int *fetched; /* the resumed job's ranks that fetched (or failed) */
    volatile int *go;      /* node 1's ranks enter step 1 once set */
    int st;                /* the first failure, 0: none */
    char err[320];
    volatile int done; /* the registration of the resumed job returned */
    int resumed;
    uint64_t start;
    float w;
};

/* a model of one fp32 tensor of numel elements, SGD lr 1, resumable for 30 s */
static void one_tensor_model(shard_model_t *m, shard_tensor_t *t, uint64_t *dims, const char *job,
                             int rank, int world, uint64_t numel)
{
    dims[0] = numel;
    *t = (shard_tensor_t){.name = "x", .ndim = 1, .dims = dims, .dtype = SHARD_FP32, .unit = 0};
    *m = (shard_model_t){.job = job,
                         .rank = (uint32_t)rank,
                         .world = (uint32_t)world,
                         .plan = "zero3",
                         .tensors = t,
                         .n_tensors = 1,
                         .optimizer = {.name = "sgd", .lr = 1.0f},
                         .resume_timeout_ms = 30000};
}

static void is_model(shard_model_t *m, shard_tensor_t *t, uint64_t *dims, int rank)
{
    one_tensor_model(m, t, dims, "instep", rank, 4, IS_NUMEL);
}

static int is_fail(struct is_rank *r, shard_ctx_t *ctx, int st, const char *what)
{
    if (r->st == 0)
        snprintf(r->err, sizeof(r->err), "rank %d: %s: %d %s", r->rank, what, st,
                 ctx ? shard_last_error(ctx) : "");
    if (r->st == 0)
        r->st = st != 0 ? st : -1;
    return st;
}

/* register the resumed job; fetch the weights its step 1 left, then wait for the others */
static void is_resume(struct is_rank *r)
{
    shard_model_t m;
    shard_tensor_t t;
    uint64_t dims[1];
    is_model(&m, &t, dims, r->rank);
    shard_ctx_t *ctx = NULL;
    int st = shard_attach(r->c->d[r->rank / 2].sock, &ctx);
    if (st == 0)
        st = shard_register(ctx, &m);
    r->done = 1;
    const void *p = NULL;
    if (st != 0) {
        is_fail(r, ctx, st, "register again");
    } else {
        r->resumed = shard_resumed(ctx);
        r->start = shard_start_step(ctx);
        if ((st = shard_fetch(ctx, 0, &p)) != 0 || (st = shard_copy(ctx, &r->w, p, 4)) != 0)
            is_fail(r, ctx, st, "fetch the resumed weights");
        if (p != NULL)
            shard_release(ctx, 0);
    }
    __atomic_add_fetch(r->fetched, 1, __ATOMIC_SEQ_CST);
    for (int i = 0; i < 400 && __atomic_load_n(r->fetched, __ATOMIC_SEQ_CST) < 4; i++)
        usleep(50000); /* no rank detaches before every one fetched (20 s at most) */
    if (ctx)
        shard_detach(ctx);
}

/* One rank's first life: register, push a gradient of ones, step 1 (node 1's once told), then
 * wait for the pause; child: rank 1, killed in its step (it writes to fd first). */
static void *is_first(void *arg)
{
    struct is_rank *r = arg;
    shard_model_t m;
    shard_tensor_t t;
    uint64_t dims[1];
    is_model(&m, &t, dims, r->rank);
    float *g = malloc(IS_NUMEL * sizeof(float));
    for (int i = 0; g && i < IS_NUMEL; i++)
        g[i] = 1.0f;
    shard_ctx_t *ctx = NULL;
    int st = g ? shard_attach(r->c->d[r->rank / 2].sock, &ctx) : -1;
    if (st == 0)
        st = shard_register(ctx, &m);
    if (st == 0)
        st = shard_push_grad(ctx, 0, g, IS_NUMEL * sizeof(float));
    free(g);
    if (st != 0) {
        is_fail(r, ctx, st, "register and push");
        if (ctx)
            shard_detach(ctx);
        __atomic_add_fetch(r->fetched, 1, __ATOMIC_SEQ_CST);
        return NULL;
    }
    while (r->rank >= 2 && !*r->go)
        usleep(10000);
    double norm;
    if ((st = shard_step(ctx, &norm)) != 0)
        is_fail(r, ctx, st, "step 1 (it completes on every node before the pause)");
    const void *p; /* the pause reaches this rank's next call */
    for (int i = 0; st == 0 && i < 200; i++, usleep(50000))
        if ((st = shard_fetch(ctx, 0, &p)) == 0)
            shard_release(ctx, 0);
    if (st != SHARD_EPAUSED || !strstr(shard_last_error(ctx), "rank 1"))
        is_fail(r, ctx, st, "a call after the pause: SHARD_EPAUSED naming rank 1 expected");
    shard_detach(ctx);
    is_resume(r);
    return NULL;
}

static void *is_again(void *arg)
{
    is_resume(arg);
    return NULL;
}

static void restart_in_step(const struct th_cluster *c)
{
    int pfd[2];
    if (pipe(pfd) != 0)
        return;
    pid_t child = fork();
    if (child == 0) { /* rank 1: register, push, then tell the parent and enter step 1 */
        close(pfd[0]);
        shard_model_t m;
        shard_tensor_t t;
        uint64_t dims[1];
        is_model(&m, &t, dims, 1);
        static float g[IS_NUMEL];
        for (int i = 0; i < IS_NUMEL; i++)
            g[i] = 1.0f;
        shard_ctx_t *ctx;
        double norm;
        if (shard_attach(c->d[0].sock, &ctx) != 0 || shard_register(ctx, &m) != 0 ||
            shard_push_grad(ctx, 0, g, sizeof(g)) != 0 || write(pfd[1], "s", 1) != 1)
            _exit(1);
        shard_step(ctx, &norm); /* waits for node 1's norm: killed meanwhile */
        _exit(2);
    }
    close(pfd[1]);
    volatile int go = 0;
    volatile int fetched = 0;
    struct is_rank r[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        r[i] = (struct is_rank){.c = c, .rank = i, .fetched = &fetched, .go = &go};
        if (i != 1)
            pthread_create(&th[i], NULL, is_first, &r[i]);
    }
    char b;
    bool in_step = read(pfd[0], &b, 1) == 1;
    close(pfd[0]);
    TH_CHECK(in_step, "rank 1 (a child) registered and pushed");
    usleep(400000); /* ranks 0 and 1 in step 1, waiting for node 1's norm */
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    pthread_create(&th[1], NULL, is_again, &r[1]); /* restarted at once */
    usleep(600000);
    TH_CHECK(!r[1].done, "the restarted rank 1's registration returned before the job paused: %s",
             r[1].err);
    char *log = th_read_file(c->d[0].log, NULL);
    TH_CHECK(log && strstr(log, "rank 1 (pid ") &&
                 strstr(log, "waits to register: the job of that name is a rank died in step 1: "
                             "it pauses once the step is over"),
             "node 0 does not log the restarted rank waiting for the pause");
    free(log);
    go = 1; /* node 1 enters step 1: it completes everywhere, then the job pauses */
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++)
        TH_CHECK(r[i].st == 0 && r[i].resumed == 1 && r[i].start == 1 && r[i].w == -1.0f,
                 "rank %d: %s; resumed %d from step %llu, weight %g (expected resumed from step "
                 "1, -1: zeros less lr 1 x the mean gradient 1)",
                 i, r[i].st ? r[i].err : "ok", r[i].resumed, (unsigned long long)r[i].start,
                 r[i].w);
    if (r[0].st == 0 && r[1].st == 0 && r[2].st == 0 && r[3].st == 0)
        printf("instep: rank 1 killed in step 1 and restarted at once: its registration waited for "
               "the pause; the job resumed after step 1 on 4 ranks\n");
}

#ifdef SD_TEST_HOOKS
/* ---- a restart whose registration the daemon reads before its predecessor's hang-up */

struct hu_reg {
    const char *sock;
    int rank;
    shard_ctx_t *ctx;
    int st, resumed;
    char err[320];
};

/* register r->ctx (attached already) as r->rank */
static void *hu_register(void *arg)
{
    struct hu_reg *r = arg;
    shard_model_t m;
    shard_tensor_t t;
    uint64_t dims[1];
    one_tensor_model(&m, &t, dims, "hungup", r->rank, 2, 512);
    r->st = shard_register(r->ctx, &m);
    r->resumed = r->st == 0 && shard_resumed(r->ctx);
    snprintf(r->err, sizeof(r->err), "%s", r->st ? shard_last_error(r->ctx) : "");
    return NULL;
}

/* The daemon's loop held 1.2 s (SIGUSR1, SHARDD_TEST_STALL_MS): meanwhile a restarted rank 1
 * sends its registration and only then its predecessor dies, so the loop reads the
 * registration first, while the job still runs and the old rank's connection hung up unread.
 * It must wait (it was refused "already running"), and resume the job, which pauses once the
 * loop reads the hang-up, with rank 0 registering again. */
static void restart_before_hangup(void)
{
    setenv("SHARDD_TEST_STALL_MS", "1200", 1);
    struct th_daemon d;
    bool up = th_daemon_start(&d, NULL) == 0;
    unsetenv("SHARDD_TEST_STALL_MS");
    TH_CHECK(up, "shardd with its loop stall hook");
    if (!up)
        return;
    int pfd[2];
    if (pipe(pfd) != 0)
        return;
    pid_t child = fork();
    if (child == 0) { /* the first rank 1: registers, then waits to be killed */
        close(pfd[0]);
        struct hu_reg r = {.sock = d.sock, .rank = 1};
        if (shard_attach(d.sock, &r.ctx) != 0)
            _exit(1);
        hu_register(&r);
        if (r.st != 0 || write(pfd[1], "r", 1) != 1)
            _exit(1);
        for (;;)
            pause();
    }
    close(pfd[1]);
    struct hu_reg r0 = {.sock = d.sock, .rank = 0}, r1 = {.sock = d.sock, .rank = 1};
    bool ok = shard_attach(d.sock, &r0.ctx) == 0;
    if (ok)
        hu_register(&r0);
    char b;
    ok = ok && r0.st == 0 && read(pfd[0], &b, 1) == 1 && shard_attach(d.sock, &r1.ctx) == 0;
    close(pfd[0]);
    TH_CHECK(ok, "job 'hungup' running on 2 ranks: %s", r0.err);
    if (ok) {
        kill(d.pid, SIGUSR1);
        usleep(200000); /* the loop is held */
        pthread_t th;
        pthread_create(&th, NULL, hu_register, &r1); /* the restart's registration, sent */
        usleep(100000);
        kill(child, SIGKILL); /* then the first rank 1 dies */
        waitpid(child, NULL, 0);
        child = -1;
        /* rank 0 hears of the pause, and registers again */
        const void *p;
        int st = 0;
        for (int i = 0; i < 200 && st == 0; i++, usleep(50000))
            if ((st = shard_fetch(r0.ctx, 0, &p)) == 0)
                shard_release(r0.ctx, 0);
        TH_CHECK(st == SHARD_EPAUSED, "rank 0 is told the job paused: %d %s", st,
                 shard_last_error(r0.ctx));
        shard_detach(r0.ctx);
        r0.ctx = NULL;
        if (shard_attach(d.sock, &r0.ctx) == 0)
            hu_register(&r0);
        pthread_join(th, NULL);
        TH_CHECK(r1.st == 0 && r1.resumed && r0.st == 0 && r0.resumed,
                 "the restarted rank 1 (%d '%s') and rank 0 (%d '%s') resume the job", r1.st,
                 r1.err, r0.st, r0.err);
        char *log = th_read_file(d.log, NULL);
        bool unread = log && strstr(log, "rank 1's process (pid ") &&
                      strstr(log, "hung up and is being reaped");
        if (r1.st == 0 && r0.st == 0)
            printf("hungup: a restart registered while the loop was held, before its "
                   "predecessor's hang-up was read: it waited (%s) and resumed the job\n",
                   unread ? "for the hang-up to be read" : "the hang-up was read first");
        free(log);
    }
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
    }
    if (r1.ctx)
        shard_detach(r1.ctx);
    if (r0.ctx)
        shard_detach(r0.ctx);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
}
#endif

/* The 2 x 2 runs on independent daemons (no cluster arguments; every rank names node 0's
 * daemon the leader and gives the job's secret): a pause crosses daemons that met per job. */
static int independent(unsigned seed)
{
    struct th_cluster two;
    const char *extra[] = {"--ranks-per-node", "2", NULL}; /* (the jobs' default) */
    TH_CHECK(th_indep_cluster_start(&two, 2, false, extra) == 0, "2 independent daemons");
    two.k = 2;
    snprintf(base, sizeof(base), "%s", two.base);
    char leader[64], secret[400], ref[400];
    snprintf(secret, sizeof(secret), "%s/job.secret", base);
    FILE *f = fopen(secret, "w");
    TH_CHECK(f != NULL && fputs("the jobs' secret, 16 bytes or more", f) >= 0 && fclose(f) == 0,
             "the jobs' secret");
    setenv("SHARD_LEADER", th_cluster_leader(&two, 0, leader, sizeof(leader)), 1);
    setenv("SHARD_JOB_SECRET_FILE", secret, 1);
    snprintf(ref, sizeof(ref), "%s/ref2.bin", base); /* (mics:2: replicas across the nodes) */
    if (run_plain(&two, "plain2", "mics:2", ref)) {
        kill_and_resume(&two, "one2", "mics:2", false, ref);
        kill_and_resume(&two, "all2", "mics:2", true, ref);
    }
    TH_CHECK(th_cluster_stop(&two) == 0, "daemons did not shut down cleanly");
    printf("independent daemons, seed %u\n", seed);
    return th_summary("test_resume");
}

int main(int argc, char **argv)
{
    unsigned seed = (unsigned)time(NULL);
    srand(seed);
    printf("seed %u\n", seed);
    if (argc > 1 && strcmp(argv[1], "independent") == 0)
        return independent(seed);
    struct th_cluster one = {.nodes = 1, .k = 4}, two;
    TH_CHECK(th_daemon_start(&one.d[0], NULL) == 0, "shardd");
    snprintf(base, sizeof(base), "%s", one.d[0].dir);
    char ref[400];
    snprintf(ref, sizeof(ref), "%s/ref1.bin", base);
    /* TEST_RESUME_QUICK: one node's resumes alone (test_resume_deferred runs them on a backend
     * whose kernels run only when waited for: the take-over's copies are polled for) */
    bool quick = getenv("TEST_RESUME_QUICK") != NULL;
    if (run_plain(&one, "plain1", "zero3", ref)) {
        char job[32];
        for (int t = 0; t < (quick ? 1 : 3); t++) {
            snprintf(job, sizeof(job), "one%d", t);
            kill_and_resume(&one, job, "zero3", false, ref);
        }
        kill_and_resume(&one, "all1", "zero3", true, ref);
    }
    if (quick) {
        TH_CHECK(th_daemon_stop(&one.d[0]) == 0, "shardd did not shut down cleanly");
        return th_summary("test_resume");
    }
    timeout_and_mismatch(&one);
    th_daemon_stop(&one.d[0]);
#ifdef SD_TEST_HOOKS
    refused_resume();
    restart_before_hangup();
#else
    printf("test_resume: the refused-resume and the unread-hang-up cases need shardd's test hooks "
           "(-DSHARD_TEST_HOOKS=ON): not run\n");
#endif

    TH_CHECK(th_cluster_start(&two, 2, 2, NULL) == 0, "2 x 2 cluster");
    snprintf(base, sizeof(base), "%s", two.base);
    const char *plans[] = {"zero3", "mics:2"};
    for (int p = 0; p < 2; p++) {
        char job[32];
        snprintf(ref, sizeof(ref), "%s/ref2-%d.bin", base, p);
        snprintf(job, sizeof(job), "plain2-%d", p);
        if (!run_plain(&two, job, plans[p], ref))
            continue;
        snprintf(job, sizeof(job), "one2-%d", p);
        kill_and_resume(&two, job, plans[p], false, ref);
        snprintf(job, sizeof(job), "all2-%d", p);
        kill_and_resume(&two, job, plans[p], true, ref);
    }
    restart_in_step(&two);
    th_cluster_stop(&two);
    return th_summary("test_resume");
}

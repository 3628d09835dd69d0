/* A gradient signalled after its push (issue 40, item 5): the trainer's stream writes the fence
 * page's grad_seq once the kernels that produce the gradient are done, and libshard pushes at
 * once (shard_push_staged_signalled, what shard_push_staged_on_stream does for a CUDA stream).
 * Here a thread plays the stream: it writes the gradient into the staging slot and signals it
 * 300 ms after the push. The daemon must take the gradient only then (the step's result is that
 * of the late gradient, not of what the slot held at the push), keep serving another job
 * meanwhile (its loop does not wait), and fail a job whose signal never comes after
 * op_timeout_ms, naming the fence page, while the other job goes on.
 *
 *   test_fence BACKEND    host (memfds) or emu-gpu (device memory the host cannot touch); cuda
 *                         (built where CUDA's headers are, label gpu: exit 77 without a GPU):
 *                         the same on a GPU, and then with a real stream, held shut by a wait
 *                         on a host word, that copies the gradient in and signals it through
 *                         shard_push_staged_on_stream, and reads a slot it then releases
 *                         through shard_release_on_stream
 *
 * The same for a release (shard_release_signalled, what shard_release_on_stream does for a
 * stream): the daemon gathers nothing into a released place before the page counts the release,
 * serves the other job meanwhile, and fails a job whose release never comes. */
#include "harness.h"
#include "shard.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define N_A        4099 /* unit 0's elements: not a multiple of anything */
#define LATE_MS    300
#define TIMEOUT_MS 1500

static struct th_daemon d;

struct tiny {
    uint64_t da[1], db[1];
    shard_tensor_t t[2];
    shard_model_t m;
};

static void tiny_init(struct tiny *x, const char *job)
{
    memset(x, 0, sizeof(*x));
    x->da[0] = N_A;
    x->db[0] = 7;
    x->t[0] = (shard_tensor_t){.name = "a", .ndim = 1, .dims = x->da, .dtype = SHARD_FP32};
    x->t[1] =
        (shard_tensor_t){.name = "b", .ndim = 1, .dims = x->db, .dtype = SHARD_FP32, .unit = 1};
    x->m = (shard_model_t){.job = job,
                           .rank = 0,
                           .world = 1,
                           .plan = "zero3",
                           .tensors = x->t,
                           .n_tensors = 2,
                           .optimizer = {.name = "sgd", .lr = 0.1f, .momentum = 0.0f}};
}

/* a client of a new job of the tiny model, registered */
static shard_ctx_t *join(const char *job)
{
    shard_ctx_t *ctx = NULL;
    struct tiny x;
    tiny_init(&x, job);
    TH_CHECK(shard_attach(d.sock, &ctx) == 0 && shard_register(ctx, &x.m) == 0, "register %s: %s",
             job, shard_last_error(ctx));
    return ctx;
}

/* a number in the job's entry of shardctl stats (0 where there is none) */
static double job_stat(const char *job, const char *field)
{
    json_t *js = th_admin_json(d.sock, "stats"), *j;
    size_t i;
    double v = 0;
    json_array_foreach(json_object_get(js, "jobs"), i, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "job")), job) == 0)
            v = json_number_value(json_object_get(j, field));
    }
    json_decref(js);
    return v;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* push a zero gradient for unit u through the copying path */
static int push_zeros(shard_ctx_t *ctx, uint32_t u)
{
    shard_unit_info_t ui;
    if (shard_unit_info(ctx, u, &ui) != 0)
        return -1;
    float *g = calloc(1, ui.bytes);
    int st = shard_push_grad(ctx, u, g, ui.bytes);
    free(g);
    return st;
}

/* unit 0's values after a fetch, copied to host memory (device memory on emu-gpu) */
static int read_a(shard_ctx_t *ctx, float *out)
{
    const void *p;
    if (shard_fetch(ctx, 0, &p) != 0)
        return -1;
    int st = shard_copy(ctx, out, p, N_A * sizeof(float));
    shard_release(ctx, 0);
    return st;
}

/* the other job on the daemon: one step of zero gradients, start to end */
static int bystander_step(shard_ctx_t *ctx)
{
    const void *p;
    if (shard_fetch(ctx, 0, &p) != 0 || shard_release(ctx, 0) != 0)
        return -1;
    if (push_zeros(ctx, 0) != 0 || push_zeros(ctx, 1) != 0)
        return -1;
    return shard_step(ctx, NULL);
}

/* the stream's part: the gradient into the slot, then its signal */
struct late {
    shard_ctx_t *ctx;
    void *slot;
    uint32_t *grad_seq, value;
    int delay_ms;
    int copy_status;
    atomic_bool signalled;
};

static void *late_writer(void *arg)
{
    struct late *l = arg;
    usleep((useconds_t)l->delay_ms * 1000u);
    float *g = malloc(N_A * sizeof(float));
    for (uint32_t i = 0; i < N_A; i++)
        g[i] = 1.0f + (float)(i % 5);
    l->copy_status = shard_copy(l->ctx, l->slot, g, N_A * sizeof(float));
    free(g);
    __atomic_store_n(l->grad_seq, l->value, __ATOMIC_RELEASE);
    atomic_store(&l->signalled, true);
    return NULL;
}

static void test_late_signal(shard_ctx_t *by)
{
    shard_ctx_t *ctx = join("late");
    float *a = malloc(N_A * sizeof(float));
    TH_CHECK(read_a(ctx, a) == 0 && a[0] == 0.0f && a[N_A - 1] == 0.0f, "a starts at zero");
    TH_CHECK(push_zeros(ctx, 1) == 0, "push unit 1: %s", shard_last_error(ctx));

    /* unit 0's slot holds zeros now: a daemon that read it at the push would step by 0 */
    void *slot;
    shard_fence_t f;
    TH_CHECK(shard_grad_buffer(ctx, 0, &slot) == 0, "grad_buffer: %s", shard_last_error(ctx));
    TH_CHECK(shard_fence(ctx, &f) == 0, "fence: %s", shard_last_error(ctx));
    float *zeros = calloc(N_A, sizeof(float));
    TH_CHECK(shard_copy(ctx, slot, zeros, N_A * sizeof(float)) == 0, "zero the slot");
    free(zeros);
    uint32_t before = *f.grad_seq;
    struct late l = {.ctx = ctx,
                     .slot = slot,
                     .grad_seq = f.grad_seq,
                     .value = f.next_grad,
                     .delay_ms = LATE_MS};
    TH_CHECK(shard_push_staged_signalled(ctx, 0) == 0, "push_staged_signalled: %s",
             shard_last_error(ctx));
    TH_CHECK(*f.grad_seq == before, "the push signalled the fence itself (%u, was %u)", *f.grad_seq,
             before);
    pthread_t th;
    pthread_create(&th, NULL, late_writer, &l);
    /* the loop serves the other job while this push waits */
    int by_steps = 0, by_bad = 0;
    while (!atomic_load(&l.signalled)) {
        if (bystander_step(by) == 0)
            by_steps += !atomic_load(&l.signalled);
        else
            by_bad++;
    }
    pthread_join(th, NULL);
    TH_CHECK(l.copy_status == 0, "the late gradient's copy: %d", l.copy_status);
    TH_CHECK(by_bad == 0 && by_steps >= 1,
             "the other job while a push waited for its signal: %d steps, %d failed", by_steps,
             by_bad);
    double t_signal = now_s(), norm = 0;
    TH_CHECK(shard_step(ctx, &norm) == 0, "step: %s", shard_last_error(ctx));
    printf("the step answered %.2f ms after the signal\n", (now_s() - t_signal) * 1e3);
    double waits = job_stat("late", "signal_waits"), wait_ms = job_stat("late", "signal_wait_ms");
    TH_CHECK(waits == 1 && wait_ms >= 0.5 * LATE_MS,
             "shardctl stats: signal_waits %g, signal_wait_ms %.1f; want 1 wait of about %d ms",
             waits, wait_ms, LATE_MS);
    /* SGD: a = -0.1 * g with the late gradient g[i] = 1 + i % 5 */
    double want_sq = 0;
    for (uint32_t i = 0; i < N_A; i++)
        want_sq += (1.0 + i % 5) * (1.0 + i % 5);
    TH_CHECK(norm > 0.999 * __builtin_sqrt(want_sq) && norm < 1.001 * __builtin_sqrt(want_sq),
             "grad norm %g, the late gradient's is %g (0: the slot was read at the push)", norm,
             __builtin_sqrt(want_sq));
    TH_CHECK(read_a(ctx, a) == 0, "fetch after the step: %s", shard_last_error(ctx));
    int wrong = 0;
    for (uint32_t i = 0; i < N_A; i++)
        wrong += a[i] != -0.1f * (1.0f + (float)(i % 5));
    TH_CHECK(wrong == 0, "%d of %d elements are not -0.1 * the late gradient (a[0] = %g)", wrong,
             N_A, a[0]);

    /* a second micro-batch, signalled 100 ms after the push with nothing else for the loop
     * to do: the push is taken when the daemon's polling sees the signal (printed; the
     * sweep's timer would see it within 100 ms) */
    TH_CHECK(push_zeros(ctx, 1) == 0, "push unit 1 again");
    TH_CHECK(shard_grad_buffer(ctx, 0, &slot) == 0 && shard_fence(ctx, &f) == 0, "buffer again");
    l = (struct late){
        .ctx = ctx, .slot = slot, .grad_seq = f.grad_seq, .value = f.next_grad, .delay_ms = 100};
    TH_CHECK(shard_push_staged_signalled(ctx, 0) == 0, "push 2: %s", shard_last_error(ctx));
    pthread_create(&th, NULL, late_writer, &l);
    pthread_join(th, NULL);
    usleep(200000);
    TH_CHECK(shard_step(ctx, NULL) == 0, "a push signalled 100 ms later: %s",
             shard_last_error(ctx));
    printf("quiet loop: the push waited %.2f ms for a signal 100 ms after it\n",
           job_stat("late", "signal_wait_ms") - wait_ms);
    TH_CHECK(read_a(ctx, a) == 0 && a[1] == -0.2f * 2.0f, "after two steps a[1] = %g, want %g",
             a[1], -0.2f * 2.0f);

    /* memory without streams takes only a NULL stream (on a GPU's, a stream is a real one:
     * test_cuda_stream) */
    TH_CHECK(push_zeros(ctx, 1) == 0 && shard_grad_buffer(ctx, 0, &slot) == 0, "third buffer");
    if (strcmp(shard_memory(ctx), "cuda") != 0 && strcmp(shard_memory(ctx), "hip") != 0) {
        int st = shard_push_staged_on_stream(ctx, 0, (void *)&st);
        TH_CHECK(st == SHARD_EINVAL && strstr(shard_last_error(ctx), "has no streams") != NULL,
                 "a stream on %s memory: %d '%s'", shard_memory(ctx), st, shard_last_error(ctx));
    }
    float *g = malloc(N_A * sizeof(float));
    for (uint32_t i = 0; i < N_A; i++)
        g[i] = 1.0f;
    TH_CHECK(shard_copy(ctx, slot, g, N_A * sizeof(float)) == 0, "fill the third buffer");
    free(g);
    TH_CHECK(shard_push_staged_on_stream(ctx, 0, NULL) == 0 && shard_step(ctx, NULL) == 0,
             "on_stream with NULL: %s", shard_last_error(ctx));
    TH_CHECK(read_a(ctx, a) == 0 && a[1] == -0.4f - 0.1f, "after three steps a[1] = %g, want %g",
             a[1], -0.4f - 0.1f);
    free(a);
    shard_detach(ctx);
}

/* a gradient never signalled: the job fails after op_timeout_ms naming the fence page; the
 * other job goes on */
static void test_never_signalled(shard_ctx_t *by)
{
    shard_ctx_t *ctx = join("never");
    void *slot;
    TH_CHECK(push_zeros(ctx, 1) == 0 && shard_grad_buffer(ctx, 0, &slot) == 0, "buffer: %s",
             shard_last_error(ctx));
    double t0 = now_s();
    TH_CHECK(shard_push_staged_signalled(ctx, 0) == 0, "push: %s", shard_last_error(ctx));
    int by_steps = 0;
    while (now_s() - t0 < TIMEOUT_MS / 1000.0 / 2)
        by_steps += bystander_step(by) == 0;
    int st = shard_step(ctx, NULL);
    double took = now_s() - t0;
    TH_CHECK(st != 0 && strstr(shard_last_error(ctx), "fence page") != NULL &&
                 strstr(shard_last_error(ctx), "unit 0") != NULL,
             "a push never signalled: step %d '%s'", st, shard_last_error(ctx));
    TH_CHECK(took < 30.0, "the failure took %.1f s (op_timeout_ms %d)", took, TIMEOUT_MS);
    TH_CHECK(by_steps >= 1, "the other job made %d steps meanwhile", by_steps);
    shard_detach(ctx);
    TH_CHECK(bystander_step(by) == 0, "the other job after the failure: %s", shard_last_error(by));
}

/* the stream's part of a release: nothing reads the slot any more, then the signal (the flag
 * first: whoever sees the signal's effect sees the flag) */
struct late_rel {
    uint32_t *word, value;
    int delay_ms;
    atomic_bool signalled;
};

static void *late_release(void *arg)
{
    struct late_rel *l = arg;
    usleep((useconds_t)l->delay_ms * 1000u);
    atomic_store(&l->signalled, true);
    __atomic_store_n(l->word, l->value, __ATOMIC_RELEASE);
    return NULL;
}

struct stepper {
    shard_ctx_t *ctx;
    atomic_bool stop;
    int steps, bad;
};

static void *stepper_run(void *arg)
{
    struct stepper *b = arg;
    while (!atomic_load(&b->stop)) {
        if (bystander_step(b->ctx) == 0)
            b->steps++;
        else
            b->bad++;
    }
    return NULL;
}

/* A release signalled after it is made (what shard_release_on_stream does for a CUDA stream
 * whose kernels still read the slot): the pool holds one unit, so the next fetch needs the
 * released unit's place, and the daemon must gather into it only once the page counts the
 * release, its loop serving the other job meanwhile. One never signalled fails its job after
 * op_timeout_ms naming release_seq, the other job going on. */
static void test_late_release(shard_ctx_t *by)
{
    shard_unit_info_t u0;
    TH_CHECK(shard_unit_info(by, 0, &u0) == 0, "unit 0's size");
    struct tiny x;
    tiny_init(&x, "late-release");
    x.m.max_live_bytes = u0.bytes; /* room for one unit: unit 1 takes unit 0's place */
    shard_ctx_t *ctx = NULL;
    TH_CHECK(shard_attach(d.sock, &ctx) == 0 && shard_register(ctx, &x.m) == 0, "register: %s",
             shard_last_error(ctx));
    const void *p;
    shard_fence_t f;
    TH_CHECK(shard_fetch(ctx, 0, &p) == 0 && shard_fence(ctx, &f) == 0, "fetch 0: %s",
             shard_last_error(ctx));
    uint32_t before = *f.release_seq;
    if (strcmp(shard_memory(ctx), "cuda") != 0) /* a stream that is none: refused unused */
        TH_CHECK(shard_release_on_stream(ctx, 0, (void *)0x5151) == SHARD_EINVAL &&
                     strstr(shard_last_error(ctx), "has no streams") != NULL,
                 "a stream on %s memory: '%s'", shard_memory(ctx), shard_last_error(ctx));
    TH_CHECK(shard_release_signalled(ctx, 0) == 0, "release_signalled: %s", shard_last_error(ctx));
    TH_CHECK(*f.release_seq == before && f.next_release == before + 1,
             "the release left its signal to the caller (page %u, next %u, was %u)", *f.release_seq,
             f.next_release, before);

    struct late_rel l = {.word = f.release_seq, .value = f.next_release, .delay_ms = LATE_MS};
    struct stepper b = {.ctx = by};
    pthread_t th, bt;
    pthread_create(&bt, NULL, stepper_run, &b);
    double t0 = now_s();
    pthread_create(&th, NULL, late_release, &l);
    int st = shard_fetch(ctx, 1, &p);
    bool signalled = atomic_load(&l.signalled);
    double took = now_s() - t0;
    pthread_join(th, NULL);
    usleep(50 * 1000);
    atomic_store(&b.stop, true);
    pthread_join(bt, NULL);
    TH_CHECK(st == 0, "fetch 1: %s", shard_last_error(ctx));
    TH_CHECK(signalled,
             "unit 1 was gathered into unit 0's place %.0f ms after its release, before "
             "the release was signalled (%d ms)",
             took * 1e3, LATE_MS);
    TH_CHECK(b.bad == 0 && b.steps >= 1, "the other job meanwhile: %d steps, %d failed", b.steps,
             b.bad);
    TH_CHECK(job_stat("late-release", "fenced_releases") == 1, "fenced_releases %g, want 1",
             job_stat("late-release", "fenced_releases"));
    TH_CHECK(shard_release_on_stream(ctx, 1, NULL) == 0 && shard_fetch(ctx, 0, &p) == 0,
             "a release with no stream is a release: %s", shard_last_error(ctx));

    /* never signalled: the fetch that needs the place fails the job, naming the page */
    TH_CHECK(shard_release_signalled(ctx, 0) == 0, "release_signalled: %s", shard_last_error(ctx));
    b = (struct stepper){.ctx = by};
    pthread_create(&bt, NULL, stepper_run, &b);
    t0 = now_s();
    st = shard_fetch(ctx, 1, &p);
    took = now_s() - t0;
    atomic_store(&b.stop, true);
    pthread_join(bt, NULL);
    TH_CHECK(st != 0 && strstr(shard_last_error(ctx), "release_seq") != NULL,
             "a release never signalled: fetch %d '%s'", st, shard_last_error(ctx));
    TH_CHECK(took < 30.0, "the failure took %.1f s (op_timeout_ms %d)", took, TIMEOUT_MS);
    TH_CHECK(b.bad == 0 && b.steps >= 1, "the other job meanwhile: %d steps, %d failed", b.steps,
             b.bad);
    shard_detach(ctx);
    TH_CHECK(bystander_step(by) == 0, "the other job after the failure: %s", shard_last_error(by));
}

/* wait (5 s at most) until the daemon shows job in state */
static bool wait_job_state(const char *job, const char *state)
{
    bool there = false;
    for (int i = 0; i < 500 && !there; i++) {
        json_t *js = th_admin_json(d.sock, "jobs"), *j;
        size_t k;
        json_array_foreach(json_object_get(js, "jobs"), k, j)
        {
            const char *name = json_string_value(json_object_get(j, "name"));
            const char *st = json_string_value(json_object_get(j, "state"));
            there |= name && st && strcmp(name, job) == 0 && strcmp(st, state) == 0;
        }
        json_decref(js);
        if (!there)
            usleep(10000);
    }
    return there;
}

struct rank_reg {
    struct tiny x;
    shard_ctx_t *ctx;
    int st;
};

static void *rank_register(void *arg)
{
    struct rank_reg *r = arg;
    r->st = shard_attach(d.sock, &r->ctx) == 0 ? shard_register(r->ctx, &r->x.m) : -1;
    return NULL;
}

/* A rank that leaves with a release its stream never signalled (its process, and the GPU work
 * that would have signalled it, gone): its hold goes with it. The other rank of the job, still
 * reading the final weights (a job closing after a clean detach serves fetches), gets the place
 * at once, not a stall until op_timeout_ms. */
static void test_release_detach(bool parked_first)
{
    const char *job = parked_first ? "release-detach-parked" : "release-detach";
    shard_unit_info_t u0 = {0};
    struct rank_reg r[2];
    pthread_t th;
    for (int pass = 0; pass < 2; pass++) { /* unit 0's size at world 2, then the job */
        for (uint32_t i = 0; i < 2; i++) {
            tiny_init(&r[i].x, pass == 0 ? "release-detach-sizes" : job);
            r[i].x.m.world = 2;
            r[i].x.m.rank = i;
            r[i].x.m.max_live_bytes = u0.bytes; /* room for one unit: unit 1 takes 0's place */
        }
        pthread_create(&th, NULL, rank_register, &r[1]);
        rank_register(&r[0]);
        pthread_join(th, NULL);
        if (pass == 0) {
            TH_CHECK(r[0].st == 0 && r[1].st == 0 && shard_unit_info(r[0].ctx, 0, &u0) == 0,
                     "unit 0's size at world 2: %s", shard_last_error(r[0].ctx));
            shard_detach(r[0].ctx);
            shard_detach(r[1].ctx);
        }
    }
    TH_CHECK(r[0].st == 0 && r[1].st == 0, "both ranks registered: %s %s",
             shard_last_error(r[0].ctx), shard_last_error(r[1].ctx));
    const void *p;
    TH_CHECK(shard_fetch(r[1].ctx, 0, &p) == 0 && shard_release_signalled(r[1].ctx, 0) == 0,
             "rank 1 fetched unit 0 and released it, to be signalled: %s",
             shard_last_error(r[1].ctx));
    shard_req_t req;
    if (parked_first) { /* rank 0's fetch waits for the place before rank 1 leaves */
        TH_CHECK(shard_fetch_async(r[0].ctx, 1, &req) == 0, "fetch_async: %s",
                 shard_last_error(r[0].ctx));
        usleep(200 * 1000);
    }
    shard_detach(r[1].ctx);
    /* the job closes; a closing job still serves fetches */
    TH_CHECK(wait_job_state(job, "closing"), "%s closes once rank 1 detached", job);
    double t0 = now_s();
    int st = parked_first ? shard_wait(r[0].ctx, req, &p) : shard_fetch(r[0].ctx, 1, &p);
    TH_CHECK(st == 0 && now_s() - t0 < TIMEOUT_MS / 1000.0 / 2,
             "%s: the unsignalled release of the rank that left let go of the place: fetch %d "
             "after %.0f ms (%s)",
             job, st, (now_s() - t0) * 1e3, shard_last_error(r[0].ctx));
    shard_detach(r[0].ctx);
}

#ifdef SD_TEST_HOOKS
/* A fetch whose slot the device is still writing is answered by the loop's poll once the device
 * is there, also when its peer detaches meanwhile: the job closes and serves it (the closing
 * failed it with "rank 1 detached", which on a GPU took the final fetches of a rank saving the
 * trained weights). A daemon of its own on emu-gpu-deferred, every ticket "not yet" for 400 ms
 * as a busy GPU's. */
static void test_detach_answer_pending(void)
{
    setenv("SHARDD_EMU_LAG_MS", "400", 1);
    const char *args[] = {"--backend", "emu-gpu-deferred", NULL};
    int started = th_daemon_start(&d, args);
    unsetenv("SHARDD_EMU_LAG_MS");
    TH_CHECK(started == 0, "shardd on emu-gpu-deferred with a 400 ms lag started");
    if (started != 0)
        return;
    struct rank_reg r[2];
    pthread_t th;
    for (uint32_t i = 0; i < 2; i++) {
        tiny_init(&r[i].x, "answer-pending");
        r[i].x.m.world = 2;
        r[i].x.m.rank = i;
    }
    pthread_create(&th, NULL, rank_register, &r[1]);
    rank_register(&r[0]);
    pthread_join(th, NULL);
    TH_CHECK(r[0].st == 0 && r[1].st == 0, "both ranks registered: %s %s",
             shard_last_error(r[0].ctx), shard_last_error(r[1].ctx));
    shard_req_t req;
    const void *p = NULL;
    TH_CHECK(shard_fetch_async(r[0].ctx, 0, &req) == 0, "fetch_async: %s",
             shard_last_error(r[0].ctx));
    usleep(100 * 1000); /* the daemon gathered it; the device is not there for 300 ms more */
    shard_detach(r[1].ctx);
    TH_CHECK(wait_job_state("answer-pending", "closing"), "the job closes once rank 1 detached");
    int st = shard_wait(r[0].ctx, req, &p);
    float a0 = -1;
    int copied = st == 0 ? shard_copy(r[0].ctx, &a0, p, sizeof(a0)) : -1;
    TH_CHECK(st == 0 && copied == 0 && a0 == 0.0f,
             "the fetch waiting for the device was answered after its peer detached: %d (%s), "
             "its slot read %d, a[0] %g (the initial 0)",
             st, shard_last_error(r[0].ctx), copied, a0);
    shard_detach(r[0].ctx);
    TH_CHECK(th_daemon_alive(&d), "the lagging daemon died");
    TH_CHECK(th_daemon_stop(&d) == 0, "the lagging shardd did not shut down cleanly");
}
#endif

/* A job closing (a rank detached) still serves fetches, and a fetch that cannot get its place
 * (another rank holds it) fails after op_timeout_ms naming what it waited for, alone: it used
 * to wait until the client's own timeout, the deadlines of a closing job never swept. */
static void test_closing_stall(void)
{
    shard_unit_info_t u0 = {0};
    struct rank_reg r[3];
    pthread_t th[2];
    for (int pass = 0; pass < 2; pass++) { /* unit 0's size at world 3, then the job */
        for (uint32_t i = 0; i < 3; i++) {
            tiny_init(&r[i].x, pass == 0 ? "closing-stall-sizes" : "closing-stall");
            r[i].x.m.world = 3;
            r[i].x.m.rank = i;
            r[i].x.m.max_live_bytes = u0.bytes;
        }
        for (int i = 0; i < 2; i++)
            pthread_create(&th[i], NULL, rank_register, &r[i + 1]);
        rank_register(&r[0]);
        for (int i = 0; i < 2; i++)
            pthread_join(th[i], NULL);
        TH_CHECK(r[0].st == 0 && r[1].st == 0 && r[2].st == 0, "3 ranks registered: %s",
                 shard_last_error(r[0].ctx));
        if (pass == 0) {
            TH_CHECK(shard_unit_info(r[0].ctx, 0, &u0) == 0, "unit 0's size at world 3");
            for (int i = 0; i < 3; i++)
                shard_detach(r[i].ctx);
        }
    }
    const void *p;
    TH_CHECK(shard_fetch(r[1].ctx, 0, &p) == 0, "rank 1 holds unit 0: %s",
             shard_last_error(r[1].ctx));
    shard_detach(r[2].ctx);
    TH_CHECK(wait_job_state("closing-stall", "closing"), "the job closes once rank 2 detached");
    double t0 = now_s();
    int st = shard_fetch(r[0].ctx, 1, &p);
    double took = now_s() - t0;
    TH_CHECK(st == SHARD_ETIMEDOUT && strstr(shard_last_error(r[0].ctx), "op_timeout_ms") &&
                 took < 5 * TIMEOUT_MS / 1000.0,
             "a fetch whose place stays held fails after op_timeout_ms: %d after %.1f s '%s'", st,
             took, shard_last_error(r[0].ctx));
    TH_CHECK(shard_release(r[1].ctx, 0) == 0 && shard_fetch(r[0].ctx, 1, &p) == 0,
             "once rank 1 released it the fetch works: %s", shard_last_error(r[0].ctx));
    shard_detach(r[1].ctx);
    shard_detach(r[0].ctx);
}

/* A trainer that dies with a release its stream never signalled: the job pauses
 * (resume_timeout_ms), and the trainer that resumes it gets the place at once, its own
 * releases counted on from what the page holds. */
static void test_release_dies(shard_ctx_t *by)
{
    shard_unit_info_t u0;
    TH_CHECK(shard_unit_info(by, 0, &u0) == 0, "unit 0's size");
    struct tiny x;
    tiny_init(&x, "release-dies");
    x.m.max_live_bytes = u0.bytes;
    x.m.resume_timeout_ms = 30000;
    pid_t pid = fork();
    if (pid == 0) { /* the trainer that dies holding the place */
        shard_ctx_t *c = NULL;
        const void *p;
        int ok = shard_attach(d.sock, &c) == 0 && shard_register(c, &x.m) == 0 &&
                 shard_fetch(c, 0, &p) == 0 && shard_release_signalled(c, 0) == 0;
        _exit(ok ? 0 : 1);
    }
    TH_CHECK(th_wait(pid, 30000) == 0, "the trainer that dies registered, fetched, released");
    shard_ctx_t *ctx = NULL;
    const void *p;
    int st = -1;
    for (int i = 0; i < 100 && st != 0; i++) { /* once the daemon saw it die: paused */
        if (ctx != NULL)
            shard_detach(ctx);
        ctx = NULL;
        st = shard_attach(d.sock, &ctx) == 0 ? shard_register(ctx, &x.m) : -1;
        if (st != 0)
            usleep(20000);
    }
    TH_CHECK(st == 0 && shard_resumed(ctx) == 1, "the job resumed: %d %s", st,
             shard_last_error(ctx));
    double t0 = now_s();
    st = shard_fetch(ctx, 1, &p);
    TH_CHECK(st == 0 && now_s() - t0 < TIMEOUT_MS / 1000.0 / 2,
             "the dead trainer's unsignalled release let go of the place: fetch %d after %.0f ms "
             "(%s)",
             st, (now_s() - t0) * 1e3, shard_last_error(ctx));
    shard_fence_t f;
    TH_CHECK(shard_fence(ctx, &f) == 0 && f.next_release == *f.release_seq + 1,
             "the resumed trainer counts on from the page (next %u, page %u)", f.next_release,
             *f.release_seq);
    struct late_rel l = {.word = f.release_seq, .value = f.next_release, .delay_ms = 100};
    pthread_t th;
    TH_CHECK(shard_release_signalled(ctx, 1) == 0, "release_signalled: %s", shard_last_error(ctx));
    pthread_create(&th, NULL, late_release, &l);
    st = shard_fetch(ctx, 0, &p);
    bool signalled = atomic_load(&l.signalled);
    pthread_join(th, NULL);
    TH_CHECK(st == 0 && signalled, "after the resume a signalled release holds its place: %d %s",
             st, shard_last_error(ctx));
    shard_release(ctx, 0);
    shard_detach(ctx);
}

#ifdef TEST_FENCE_CUDA
#include <cuda.h>
#include <dlfcn.h>

#define CU_FUNCS(X)                                                                                \
    X(cuInit)                                                                                      \
    X(cuDeviceGet)                                                                                 \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuCtxSetCurrent)                                                                             \
    X(cuStreamCreate)                                                                              \
    X(cuStreamDestroy)                                                                             \
    X(cuStreamSynchronize)                                                                         \
    X(cuStreamWaitValue32)                                                                         \
    X(cuMemHostRegister)                                                                           \
    X(cuMemHostUnregister)                                                                         \
    X(cuMemHostGetDevicePointer)                                                                   \
    X(cuMemcpyHtoDAsync)                                                                           \
    X(cuMemcpyDtoHAsync)
#define CU_STR2(x) #x
#define CU_STR(x)  CU_STR2(x)
#define CU_PTR(f)  static __typeof__(&f) p_##f;
CU_FUNCS(CU_PTR)
#undef CU_PTR

/* A CUDA stream that will not run until the host opens its gate: a wait on a host word, then the
 * gradient's copy into the slot, then (shard_push_staged_on_stream's) the fence write. The push
 * returns at once; the step must see the gradient, which reaches the slot only after the gate. */
static void test_cuda_stream(shard_ctx_t *by)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TH_CHECK(lib != NULL, "libcuda.so.1: %s", dlerror());
    if (lib == NULL)
        return;
#define CU_LOAD(f)                                                                                 \
    TH_CHECK((p_##f = (__typeof__(&f))dlsym(lib, CU_STR(f))) != NULL, "%s", CU_STR(f));
    CU_FUNCS(CU_LOAD)
#undef CU_LOAD
    CUdevice dev;
    CUcontext cx;
    CUstream st;
    TH_CHECK(p_cuInit(0) == 0 && p_cuDeviceGet(&dev, 0) == 0 &&
                 p_cuDevicePrimaryCtxRetain(&cx, dev) == 0 && p_cuCtxSetCurrent(cx) == 0 &&
                 p_cuStreamCreate(&st, CU_STREAM_NON_BLOCKING) == 0,
             "a CUDA stream on device 0");
    shard_ctx_t *ctx = join("stream");
    TH_CHECK(strcmp(shard_memory(ctx), "cuda") == 0, "memory %s", shard_memory(ctx));
    uint32_t *gate = aligned_alloc(4096, 4096);
    float *g = aligned_alloc(4096, ((N_A * sizeof(float) + 4095) / 4096) * 4096);
    *gate = 0;
    for (uint32_t i = 0; i < N_A; i++)
        g[i] = 1.0f + (float)(i % 5);
    CUdeviceptr gate_d = 0;
    void *slot;
    TH_CHECK(p_cuMemHostRegister(gate, 4096, CU_MEMHOSTREGISTER_DEVICEMAP) == 0 &&
                 p_cuMemHostGetDevicePointer(&gate_d, gate, 0) == 0 &&
                 p_cuMemHostRegister(g, ((N_A * sizeof(float) + 4095) / 4096) * 4096, 0) == 0,
             "host memory registered");
    TH_CHECK(push_zeros(ctx, 1) == 0 && shard_grad_buffer(ctx, 0, &slot) == 0, "buffer: %s",
             shard_last_error(ctx));
    TH_CHECK(p_cuStreamWaitValue32(st, gate_d, 1, CU_STREAM_WAIT_VALUE_GEQ) == 0 &&
                 p_cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)slot, g, N_A * sizeof(float), st) == 0,
             "the stream's gate and copy");
    double t0 = now_s();
    TH_CHECK(shard_push_staged_on_stream(ctx, 0, st) == 0, "push_staged_on_stream: %s",
             shard_last_error(ctx));
    TH_CHECK(now_s() - t0 < 1.0, "the push waited for the stream (%.2f s)", now_s() - t0);
    int by_steps = 0;
    while (now_s() - t0 < LATE_MS / 1000.0)
        by_steps += bystander_step(by) == 0;
    TH_CHECK(by_steps >= 1, "the other job trained %d steps meanwhile", by_steps);
    __atomic_store_n(gate, 1u, __ATOMIC_RELEASE);
    double norm = 0;
    TH_CHECK(shard_step(ctx, &norm) == 0, "step: %s", shard_last_error(ctx));
    float *a = malloc(N_A * sizeof(float));
    int wrong = read_a(ctx, a) == 0 ? 0 : N_A;
    for (uint32_t i = 0; i < N_A && wrong == 0; i++)
        wrong += a[i] != -0.1f * (1.0f + (float)(i % 5));
    TH_CHECK(wrong == 0, "the step did not use the stream's gradient (a[0] = %g)", a[0]);
    free(a);

    /* a release whose slot the stream still reads (a copy behind the gate): the next fetch
     * needs the place (the pool holds one unit) and waits for the stream's signal */
    shard_unit_info_t u0;
    struct tiny x;
    tiny_init(&x, "stream-release");
    x.m.max_live_bytes = shard_unit_info(by, 0, &u0) == 0 ? u0.bytes : 0;
    shard_ctx_t *rc = NULL;
    const void *p0, *p1;
    TH_CHECK(shard_attach(d.sock, &rc) == 0 && shard_register(rc, &x.m) == 0 &&
                 shard_fetch(rc, 0, &p0) == 0,
             "a job whose pool holds one unit: %s", shard_last_error(rc));
    TH_CHECK(p_cuStreamWaitValue32(st, gate_d, 2, CU_STREAM_WAIT_VALUE_GEQ) == 0 &&
                 p_cuMemcpyDtoHAsync(g, (CUdeviceptr)(uintptr_t)p0, N_A * sizeof(float), st) == 0,
             "the stream's gate and its read of unit 0's slot");
    t0 = now_s();
    TH_CHECK(shard_release_on_stream(rc, 0, st) == 0, "release_on_stream: %s",
             shard_last_error(rc));
    TH_CHECK(now_s() - t0 < 1.0, "the release waited for the stream (%.2f s)", now_s() - t0);
    struct late_rel opener = {.word = gate, .value = 2, .delay_ms = LATE_MS};
    pthread_t th;
    pthread_create(&th, NULL, late_release, &opener);
    int fst = shard_fetch(rc, 1, &p1);
    bool opened = atomic_load(&opener.signalled);
    pthread_join(th, NULL);
    TH_CHECK(fst == 0 && opened,
             "unit 1 gathered into unit 0's place before the stream read it (fetch %d: %s)", fst,
             shard_last_error(rc));
    TH_CHECK(job_stat("stream-release", "fenced_releases") == 1, "fenced_releases %g",
             job_stat("stream-release", "fenced_releases"));
    shard_detach(rc);
    p_cuStreamSynchronize(st);
    p_cuStreamDestroy(st);
    p_cuMemHostUnregister(gate);
    p_cuMemHostUnregister(g);
    free(gate);
    free(g);
    shard_detach(ctx);
}
#endif

int main(int argc, char **argv)
{
    const char *backend = argc > 1 ? argv[1] : "host";
    char timeout[16];
    snprintf(timeout, sizeof(timeout), "%d", TIMEOUT_MS);
    const char *args[] = {"--backend", backend, "--op-timeout-ms", timeout, NULL};
    signal(SIGPIPE, SIG_IGN);
    if (th_daemon_start(&d, args) != 0) {
        /* a GPU backend on a machine without that GPU: a skip, said as one, with the reason */
        char line[512] = "", last[512] = "";
        FILE *f = fopen(d.log, "r");
        while (f != NULL && fgets(line, sizeof(line), f) != NULL)
            snprintf(last, sizeof(last), "%s", line);
        if (f != NULL)
            fclose(f);
        bool gpu = strcmp(backend, "cuda") == 0;
        fprintf(stderr, "%scannot start shardd --backend %s: %s", gpu ? "SKIP: " : "", backend,
                last[0] ? last : "(no log)\n");
        return gpu ? 77 : 1;
    }
    shard_ctx_t *by = join("bystander");
    TH_CHECK(strcmp(shard_memory(by), backend) == 0, "the job's memory is %s on backend %s",
             shard_memory(by), backend);
    test_late_signal(by);
    test_never_signalled(by);
    test_late_release(by);
    test_release_detach(false);
    test_release_detach(true);
    test_closing_stall();
    if (strcmp(backend, "cuda") != 0) /* (its trainer is a forked child: CUDA, initialized by
                                       * this process, does not survive a fork) */
        test_release_dies(by);
#ifdef TEST_FENCE_CUDA
    if (strcmp(backend, "cuda") == 0)
        test_cuda_stream(by);
#endif
    shard_detach(by);
    TH_CHECK(th_daemon_alive(&d), "daemon died");
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
    if (strcmp(backend, "emu-gpu") == 0) {
#ifdef SD_TEST_HOOKS
        test_detach_answer_pending();
#else
        printf("skipped: a detach with fetches pending on a lagging device (SHARDD_EMU_LAG_MS: "
               "a build with SHARD_TEST_HOOKS)\n");
#endif
    }
    return th_summary("test_fence");
}

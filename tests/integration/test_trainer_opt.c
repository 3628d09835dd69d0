/* A trainer optimizer (optimizer "trainer1": the trainer runs it on its own shard at each step's
 * hand-off) through libshard against a real daemon, with the update computed here and checked
 * against a second copy of it kept here (an SGD with a momentum state):
 *   - 3 steps of 2 ranks (threads) on one daemon, clipped at a norm of 0.5: at each hand-off
 *     the norm and the factor are the formula's from the reference's gradients (within 1e-6:
 *     the sum of squares in another order), the gradient each rank reads of its own shard,
 *     times the factor, is the two ranks' sum times it (bitwise), the masters and the state
 *     read are the reference's; the weights
 *     fetched after shard_step_update_done are the reference's masters, bitwise; shard_read
 *     gathers the momentum state (every rank's shard) as the reference's;
 *   - refused, naming why, and the job going on: a write of the own shard or a read of the
 *     gradient outside the hand-off (SHARD_ESTATE), shard_step_update_done without one, a
 *     second shard_step or a save at the hand-off, a write of the wrong length, a state the
 * optimizer has not, an own-shard read on a job whose optimizer runs in the daemon (SHARD_EINVAL);
 *   - a rank that never gives its update back fails the job after op_timeout_ms naming it,
 *     and the daemon serves a new job after.
 *
 *   test_trainer_opt BACKEND    host or emu-gpu */
#include "harness.h"
#include "shard.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_A   1031 /* unit 0 */
#define N_B   70   /* unit 1 */
#define STEPS 3
#define LR    0.1f
#define MOM   0.9f

static struct th_daemon d;

struct job {
    const char *name;
    const char *optim;
    uint32_t world;
    shard_ctx_t *ctx[2];
    /* the reference: each unit's masters and momentum, all of it */
    float *master[2], *mom[2];
    float max_grad_norm; /* clipping (0: none) */
};

static const size_t numel[2] = {N_A, N_B};

static float init_value(uint32_t u, size_t i)
{
    return u == 0 ? (float)((i * 37) % 101) / 101.0f - 0.5f : (float)i * 0.01f;
}

/* rank r's gradient of step s: a function of the weights it read */
static float grad_value(uint32_t u, size_t i, const float *w, int s, uint32_t r)
{
    return 0.25f * w[i] + (float)((int)((i + u) % 11) - 5) * 0.01f * (float)(s + 1 + r);
}

static void join(struct job *j, uint32_t r)
{
    uint64_t da[1] = {N_A}, db[1] = {N_B};
    shard_tensor_t t[2] = {
        {.name = "a", .ndim = 1, .dims = da, .dtype = SHARD_FP32},
        {.name = "b", .ndim = 1, .dims = db, .dtype = SHARD_FP32, .unit = 1},
    };
    float *ia = malloc(N_A * sizeof(float)), *ib = malloc(N_B * sizeof(float));
    for (size_t i = 0; i < N_A; i++)
        ia[i] = init_value(0, i);
    for (size_t i = 0; i < N_B; i++)
        ib[i] = init_value(1, i);
    const float *init[2] = {ia, ib};
    shard_model_t m = {.job = j->name,
                       .rank = r,
                       .world = j->world,
                       .plan = "zero3",
                       .tensors = t,
                       .n_tensors = 2,
                       .init = r == 0 ? init : NULL,
                       .optimizer = {.name = j->optim,
                                     .lr = LR,
                                     .beta1 = 0.9f,
                                     .beta2 = 0.999f,
                                     .max_grad_norm = j->max_grad_norm}};
    TH_CHECK(shard_attach(d.sock, &j->ctx[r]) == 0 && shard_register(j->ctx[r], &m) == 0,
             "register %s rank %u: %s", j->name, r, shard_last_error(j->ctx[r]));
    free(ia);
    free(ib);
}

struct rank_arg {
    struct job *j;
    uint32_t r;
};

static void *join_thread(void *p)
{
    struct rank_arg *a = p;
    join(a->j, a->r);
    return NULL;
}

/* every rank of j registered (rank 0 loads the initial values while the others wait) */
static void join_all(struct job *j)
{
    pthread_t th[2];
    struct rank_arg a[2];
    for (uint32_t r = 0; r < j->world; r++) {
        a[r] = (struct rank_arg){j, r};
        pthread_create(&th[r], NULL, join_thread, &a[r]);
    }
    for (uint32_t r = 0; r < j->world; r++)
        pthread_join(th[r], NULL);
}

/* unit u's weights as rank r fetches them (aside: outside the step's schedule, which every
 * rank of the job makes alike) */
static int fetch_weights(shard_ctx_t *c, uint32_t u, float *out, bool aside)
{
    const void *p = NULL;
    int st = aside ? shard_fetch_aside(c, u, &p) : shard_fetch(c, u, &p);
    if (st == 0)
        st = shard_copy(c, out, p, numel[u] * sizeof(float));
    int rs = aside ? shard_release_aside(c, u) : shard_release(c, u);
    return st != 0 ? st : rs;
}

/* rank r's micro-step of step s: both units fetched, their gradients pushed (the padding 0) */
static int micro_step(struct job *j, uint32_t r, int s)
{
    shard_ctx_t *c = j->ctx[r];
    for (uint32_t u = 0; u < 2; u++) {
        shard_unit_info_t ui;
        float *w = malloc(numel[u] * sizeof(float));
        int st = shard_unit_info(c, u, &ui);
        if (st == 0)
            st = fetch_weights(c, u, w, false);
        float *g = calloc(1, ui.bytes);
        for (size_t i = 0; st == 0 && i < numel[u]; i++)
            g[i] = grad_value(u, i, w, s, r);
        if (st == 0)
            st = shard_push_grad(c, u, g, ui.bytes);
        free(w);
        free(g);
        if (st != 0)
            return st;
    }
    return 0;
}

struct handoff {
    struct job *j;
    uint32_t r;
    int s;
    int status;
    bool give_back; /* false: the rank never calls shard_step_update_done */
    bool grad_ok, master_ok, mom_ok;
    double norm, scale; /* the hand-off's */
};

/* the rank's step: the hand-off, its own shard updated as the reference updates it (the
 * reference's arrays are read here, written by the caller after both ranks) */
static void *rank_step(void *p)
{
    struct handoff *h = p;
    shard_ctx_t *c = h->j->ctx[h->r];
    double norm = 0.0;
    h->grad_ok = h->master_ok = h->mom_ok = true;
    if ((h->status = shard_step(c, &norm)) != 0)
        return NULL;
    double scale = shard_step_grad_scale(c);
    h->norm = norm;
    h->scale = scale;
    for (uint32_t u = 0; u < 2; u++) {
        shard_unit_info_t ui;
        shard_unit_info(c, u, &ui);
        size_t max = ui.bytes / sizeof(float);
        float *g = malloc(ui.bytes), *m = malloc(ui.bytes), *v = malloc(ui.bytes);
        uint64_t first = 0, count = 0, f2 = 0, c2 = 0;
        h->status = shard_read_own(c, u, SHARD_OWN_GRAD, g, max, &first, &count);
        if (h->status == 0)
            h->status = shard_read_own(c, u, 0, m, max, &f2, &c2);
        if (h->status == 0)
            h->status = shard_read_own(c, u, 1, v, max, &f2, &c2);
        if (h->status != 0 || f2 != first || c2 != count) {
            h->grad_ok = false;
            free(g);
            free(m);
            free(v);
            return NULL;
        }
        for (uint64_t k = 0; k < count; k++) {
            size_t i = first + k;
            float want = 0.0f, gs = g[k] * (float)scale;
            if (i < numel[u]) { /* the mean of the two ranks' gradients (none clipped) */
                float *w = h->j->master[u];
                float sum = grad_value(u, i, w, h->s, 0);
                for (uint32_t q = 1; q < h->j->world; q++)
                    sum += grad_value(u, i, w, h->s, q);
                want = sum * (float)scale; /* (the factor is checked on its own) */
                h->master_ok &= m[k] == w[i];
                h->mom_ok &= v[k] == h->j->mom[u][i];
            }
            h->grad_ok &= gs == want;
            v[k] = MOM * v[k] + gs; /* the update, as the reference's */
            m[k] = m[k] - LR * v[k];
        }
        if (h->give_back) {
            h->status = shard_write_own(c, u, 0, m, count);
            if (h->status == 0)
                h->status = shard_write_own(c, u, 1, v, count);
        }
        free(g);
        free(m);
        free(v);
        if (h->status != 0)
            return NULL;
    }
    if (h->give_back)
        h->status = shard_step_update_done(c, NULL);
    return NULL;
}

/* the step's norm and the factor of the gradient sums, from the reference's weights: the
 * formula of the header (1 / world, times max_grad_norm / (norm + 1e-6) when above it) */
static void reference_factor(const struct job *j, int s, double *norm_p, double *scale_p)
{
    double sumsq = 0.0;
    for (uint32_t u = 0; u < 2; u++)
        for (size_t i = 0; i < numel[u]; i++) {
            float sum = grad_value(u, i, j->master[u], s, 0);
            for (uint32_t q = 1; q < j->world; q++)
                sum += grad_value(u, i, j->master[u], s, q);
            sumsq += (double)sum * (double)sum;
        }
    double norm = sqrt(sumsq) / (double)j->world;
    float scale = 1.0f / (float)j->world;
    if (j->max_grad_norm > 0.0f && norm > (double)j->max_grad_norm)
        scale = scale * (float)((double)j->max_grad_norm / (norm + 1e-6));
    *norm_p = norm;
    *scale_p = scale;
}

/* scale: the hand-off's factor (the reference multiplies by the daemon's, whose sum of squares
 * is taken in another order: reference_factor checks it within 1e-6) */
static void reference_step(struct job *j, int s, float scale)
{
    for (uint32_t u = 0; u < 2; u++) {
        float *w = j->master[u], *v = j->mom[u];
        float *g = malloc(numel[u] * sizeof(float));
        for (size_t i = 0; i < numel[u]; i++) {
            float sum = grad_value(u, i, w, s, 0);
            for (uint32_t q = 1; q < j->world; q++)
                sum += grad_value(u, i, w, s, q);
            g[i] = sum * scale;
        }
        for (size_t i = 0; i < numel[u]; i++) {
            v[i] = MOM * v[i] + g[i];
            w[i] = w[i] - LR * v[i];
        }
        free(g);
    }
}

/* both ranks' steps, in threads; give_back[r]: rank r gives its update back */
static void both_steps(struct job *j, int s, const bool *give_back, struct handoff *h)
{
    pthread_t th[2];
    for (uint32_t r = 0; r < j->world; r++) {
        h[r] = (struct handoff){.j = j, .r = r, .s = s, .give_back = give_back[r]};
        pthread_create(&th[r], NULL, rank_step, &h[r]);
    }
    for (uint32_t r = 0; r < j->world; r++)
        pthread_join(th[r], NULL);
}

static void job_init(struct job *j, const char *name, const char *optim)
{
    memset(j, 0, sizeof(*j));
    j->name = name;
    j->optim = optim;
    j->world = 2;
    for (uint32_t u = 0; u < 2; u++) {
        j->master[u] = malloc(numel[u] * sizeof(float));
        j->mom[u] = calloc(numel[u], sizeof(float));
        for (size_t i = 0; i < numel[u]; i++)
            j->master[u][i] = init_value(u, i);
    }
}

static void job_free(struct job *j)
{
    for (uint32_t r = 0; r < j->world; r++)
        if (j->ctx[r] != NULL)
            shard_detach(j->ctx[r]);
    for (uint32_t u = 0; u < 2; u++) {
        free(j->master[u]);
        free(j->mom[u]);
    }
}

/* st must be want with every word in the message */
static void refused(shard_ctx_t *c, int st, int want, const char *what, const char *w1,
                    const char *w2)
{
    const char *msg = shard_last_error(c);
    TH_CHECK(st == want && strstr(msg, w1) != NULL && (w2 == NULL || strstr(msg, w2) != NULL),
             "%s: refused (%d) naming '%s'%s%s: %d '%s'", what, want, w1, w2 ? " and " : "",
             w2 ? w2 : "", st, msg);
}

/* the rank's masters read and written back as they are (a no-op update), then update_done */
static void *give_back_thread(void *p)
{
    struct handoff *h = p;
    shard_ctx_t *c = h->j->ctx[h->r];
    float buf[N_A + 64];
    for (uint32_t u = 0; u < 2 && h->status == 0; u++) {
        uint64_t f, n;
        h->status = shard_read_own(c, u, 0, buf, N_A + 64, &f, &n);
        if (h->status == 0)
            h->status = shard_write_own(c, u, 0, buf, n);
    }
    if (h->status == 0)
        h->status = shard_step_update_done(c, NULL);
    return NULL;
}

static void test_training(void)
{
    struct job j;
    job_init(&j, "trainer", "trainer1");
    j.max_grad_norm = 0.5f; /* (the gradients' norm is about 2.9: every step clipped) */
    join_all(&j);
    shard_ctx_t *c0 = j.ctx[0];
    float buf[N_A + 64];
    const bool both[2] = {true, true};
    for (int s = 0; s < STEPS; s++) {
        /* outside the hand-off: refused, nothing changed */
        refused(c0, shard_write_own(c0, 0, 0, buf, 10), SHARD_ESTATE, "write own, between steps",
                "hand-off", NULL);
        refused(c0, shard_read_own(c0, 0, SHARD_OWN_GRAD, buf, N_A + 64, NULL, NULL), SHARD_ESTATE,
                "the gradient read between steps", "hand-off", NULL);
        refused(c0, shard_step_update_done(c0, NULL), SHARD_ESTATE, "update_done between steps",
                "no optimizer update is awaited", NULL);
        refused(c0, shard_read_own(c0, 0, 2, buf, N_A + 64, NULL, NULL), SHARD_EINVAL,
                "a state trainer1 has not", "state 2", "states 0..1");
        for (uint32_t r = 0; r < 2; r++)
            TH_CHECK(micro_step(&j, r, s) == 0, "step %d rank %u micro-step: %s", s, r,
                     shard_last_error(j.ctx[r]));
        struct handoff h[2];
        both_steps(&j, s, both, h);
        for (uint32_t r = 0; r < 2; r++)
            TH_CHECK(h[r].status == 0 && h[r].grad_ok && h[r].master_ok && h[r].mom_ok,
                     "step %d rank %u: the hand-off's gradient (the ranks' mean), masters and "
                     "momentum are the reference's, bitwise (%d %d %d): %d %s",
                     s, r, h[r].grad_ok, h[r].master_ok, h[r].mom_ok, h[r].status,
                     shard_last_error(j.ctx[r]));
        double norm, scale;
        reference_factor(&j, s, &norm, &scale);
        TH_CHECK(fabs(h[0].norm - norm) <= 1e-6 * norm && norm > 0.5 &&
                     fabs(h[0].scale - scale) <= 1e-6 * scale && h[1].scale == h[0].scale,
                 "step %d: the hand-off's norm %.9g and factor %.9g are the formula's (%.9g, "
                 "%.9g: clipped to 0.5)",
                 s, h[0].norm, h[0].scale, norm, scale);
        reference_step(&j, s, (float)h[0].scale);
        for (uint32_t u = 0; u < 2; u++) {
            float *w = malloc(numel[u] * sizeof(float));
            TH_CHECK(fetch_weights(c0, u, w, true) == 0 &&
                         memcmp(w, j.master[u], numel[u] * sizeof(float)) == 0,
                     "step %d unit %u: the weights after the update are the reference's", s, u);
            free(w);
        }
    }
    /* the momentum of every rank's shard, gathered */
    for (uint32_t u = 0; u < 2; u++) {
        shard_unit_info_t ui;
        shard_unit_info(c0, u, &ui);
        float *v = malloc(ui.bytes);
        TH_CHECK(shard_read(c0, u, 1, v, ui.bytes / sizeof(float)) == 0 &&
                     memcmp(v, j.mom[u], numel[u] * sizeof(float)) == 0,
                 "unit %u: shard_read of state 1 is the reference's momentum: %s", u,
                 shard_last_error(c0));
        uint64_t steps = 0;
        TH_CHECK(shard_read_steps(c0, u, &steps) == 0 && steps == STEPS,
                 "tensor %u: %llu steps counted", u, (unsigned long long)steps);
        free(v);
    }
    /* at a hand-off: a second step, a wrong length; then the update, and the job goes on */
    for (uint32_t r = 0; r < 2; r++)
        TH_CHECK(micro_step(&j, r, STEPS) == 0, "micro-step: %s", shard_last_error(j.ctx[r]));
    const bool none[2] = {false, false};
    struct handoff h[2];
    both_steps(&j, STEPS, none, h);
    TH_CHECK(h[0].status == 0 && h[1].status == 0, "the hand-off without the update: %d %d",
             h[0].status, h[1].status);
    refused(c0, shard_step(c0, NULL), SHARD_ESTATE, "a step at the hand-off",
            "waits for its ranks' optimizer updates", NULL);
    refused(c0, shard_save(c0, "/tmp/shardd-trainer-opt-ck", NULL), SHARD_ESTATE,
            "a save at the hand-off", "hand-off", NULL);
    uint64_t first = 0, count = 0;
    TH_CHECK(shard_read_own(c0, 0, 0, buf, N_A + 64, &first, &count) == 0 && first == 0,
             "the masters of rank 0's shard: %s", shard_last_error(c0));
    refused(c0, shard_write_own(c0, 0, 0, buf, count - 1), SHARD_EINVAL, "a short write", "values",
            "shard has");
    pthread_t th[2];
    for (uint32_t r = 0; r < 2; r++) {
        h[r] = (struct handoff){.j = &j, .r = r};
        pthread_create(&th[r], NULL, give_back_thread, &h[r]);
    }
    for (uint32_t r = 0; r < 2; r++) {
        pthread_join(th[r], NULL);
        TH_CHECK(h[r].status == 0, "rank %u: its masters as they were given back: %s", r,
                 shard_last_error(j.ctx[r]));
    }
    for (uint32_t r = 0; r < 2; r++)
        TH_CHECK(micro_step(&j, r, STEPS + 1) == 0, "the job goes on: %s",
                 shard_last_error(j.ctx[r]));
    job_free(&j);
}

static void *update_done_thread(void *p)
{
    struct handoff *h = p;
    h->status = shard_step_update_done(h->j->ctx[h->r], NULL);
    return NULL;
}

static void test_missing_update(void)
{
    struct job j;
    job_init(&j, "stuck", "trainer1");
    join_all(&j);
    for (uint32_t r = 0; r < 2; r++)
        TH_CHECK(micro_step(&j, r, 0) == 0, "micro-step: %s", shard_last_error(j.ctx[r]));
    const bool only0[2] = {false, false};
    struct handoff h[2];
    both_steps(&j, 0, only0, h);
    /* rank 0 gives its update back; rank 1 never does */
    pthread_t th;
    h[0] = (struct handoff){.j = &j, .r = 0};
    double t0 = th_now_s();
    pthread_create(&th, NULL, update_done_thread, &h[0]);
    pthread_join(th, NULL);
    double took = th_now_s() - t0;
    const char *msg = shard_last_error(j.ctx[0]);
    TH_CHECK(h[0].status != 0 && strstr(msg, "ranks 1") != NULL &&
                 strstr(msg, "shard_step_update_done") != NULL && took < 10.0,
             "a rank that never gives its update back fails the job naming it (%.1f s): %d '%s'",
             took, h[0].status, msg);
    job_free(&j);
    /* and a job whose optimizer runs in the daemon has no own shard to read */
    struct job k;
    job_init(&k, "daemon-opt", "adamw");
    k.world = 1;
    join(&k, 0);
    float buf[N_A + 64];
    refused(k.ctx[0], shard_read_own(k.ctx[0], 0, 0, buf, N_A + 64, NULL, NULL), SHARD_EINVAL,
            "an own-shard read of an adamw job", "runs its optimizer (adamw) in the daemon", NULL);
    TH_CHECK(micro_step(&k, 0, 0) == 0 && shard_step(k.ctx[0], NULL) == 0,
             "the daemon serves a new job after: %s", shard_last_error(k.ctx[0]));
    job_free(&k);
}

int main(int argc, char **argv)
{
    const char *backend = argc > 1 ? argv[1] : "host";
    const char *args[] = {"--backend", backend, "--op-timeout-ms", "2000", NULL};
    signal(SIGPIPE, SIG_IGN);
    if (th_daemon_start(&d, args) != 0) {
        fprintf(stderr, "cannot start shardd --backend %s (log %s)\n", backend, d.log);
        return 1;
    }
    test_training();
    test_missing_update();
    TH_CHECK(th_daemon_alive(&d), "daemon died");
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
    return th_summary("test_trainer_opt");
}

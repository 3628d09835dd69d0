/* The one call per operation (shard_fetchx, shard_releasex, shard_pushx with a
 * shard_op_param_t) against the named variants, on a real daemon: two jobs of the same model and
 * initial values, one trained through the named calls (shard_fetch, shard_fetch_async +
 * shard_wait, shard_fetch_aside, shard_push_grad, shard_grad_buffer + shard_push_staged), the
 * other through the x calls with the parameters the header says each named call is; after 4
 * steps every unit of both is bitwise equal (and moved: the gradients were not zero). Then every
 * bad parameter is refused with SHARD_EINVAL naming it (an unknown mask bit or flag, a flag the
 * operation does not take, ASYNC without req_p or with ASIDE, GRAD with STAGED or with neither,
 * a stream with SIGNALLED or with a copied gradient, a stream on memory without streams), and
 * the job trains on after each.
 *
 *   test_op_param BACKEND    host or emu-gpu */
#include "harness.h"
#include "shard.h"

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_A   1031
#define N_B   7
#define STEPS 4

static struct th_daemon d;

struct model {
    uint64_t da[1], db[1];
    shard_tensor_t t[2];
    float *init_a, *init_b;
    const float *init[2];
    shard_model_t m;
};

static void model_init(struct model *x, const char *job)
{
    memset(x, 0, sizeof(*x));
    x->da[0] = N_A;
    x->db[0] = N_B;
    x->t[0] = (shard_tensor_t){.name = "a", .ndim = 1, .dims = x->da, .dtype = SHARD_FP32};
    x->t[1] =
        (shard_tensor_t){.name = "b", .ndim = 1, .dims = x->db, .dtype = SHARD_FP32, .unit = 1};
    x->init_a = malloc(N_A * sizeof(float));
    x->init_b = malloc(N_B * sizeof(float));
    for (int i = 0; i < N_A; i++)
        x->init_a[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    for (int i = 0; i < N_B; i++)
        x->init_b[i] = (float)i * 0.25f;
    x->init[0] = x->init_a;
    x->init[1] = x->init_b;
    x->m = (shard_model_t){.job = job,
                           .rank = 0,
                           .world = 1,
                           .plan = "zero3",
                           .tensors = x->t,
                           .n_tensors = 2,
                           .init = x->init,
                           .optimizer = {.name = "adamw",
                                         .lr = 0.01f,
                                         .beta1 = 0.9f,
                                         .beta2 = 0.999f,
                                         .eps = 1e-8f,
                                         .weight_decay = 0.01f}};
}

static shard_ctx_t *join(const char *job)
{
    shard_ctx_t *ctx = NULL;
    struct model x;
    model_init(&x, job);
    TH_CHECK(shard_attach(d.sock, &ctx) == 0 && shard_register(ctx, &x.m) == 0, "register %s: %s",
             job, shard_last_error(ctx));
    free(x.init_a);
    free(x.init_b);
    return ctx;
}

/* the gradient of step s for unit u (bytes long, the unit's padded size): a function of the
 * weights read, so that both jobs stay equal only if every read and push matched */
static void gradient(const float *w, size_t n, int s, float *g, size_t bytes)
{
    memset(g, 0, bytes);
    for (size_t i = 0; i < n; i++)
        g[i] = 0.5f * w[i] + (float)((int)(i % 13) - 6) * 0.01f * (float)(s + 1);
}

/* one unit's fetch, read, release and push; named: the named calls, else the x calls */
static int unit_round(shard_ctx_t *ctx, uint32_t u, int s, bool named)
{
    shard_unit_info_t ui;
    if (shard_unit_info(ctx, u, &ui) != 0)
        return -1;
    size_t n = u == 0 ? N_A : N_B;
    float *w = malloc(ui.bytes), *g = malloc(ui.bytes);
    const void *p = NULL;
    int st;
    /* step parity picks the fetch: waited for, or posted and waited */
    if (s % 2 == 0) {
        st = named ? shard_fetch(ctx, u, &p) : shard_fetchx(ctx, u, NULL, &p);
    } else {
        shard_req_t req = 0;
        shard_op_param_t fp = {.op_attr_mask = SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_REQUEST,
                               .flags = SHARD_OP_FLAG_ASYNC,
                               .req_p = &req};
        st = named ? shard_fetch_async(ctx, u, &req) : shard_fetchx(ctx, u, &fp, NULL);
        if (st == 0)
            st = shard_wait(ctx, req, &p);
    }
    if (st == 0)
        st = shard_copy(ctx, w, p, ui.bytes);
    if (st == 0)
        st = named ? shard_release(ctx, u) : shard_releasex(ctx, u, NULL);
    gradient(w, n, s, g, ui.bytes);
    /* unit 0 copied, unit 1 staged */
    if (st == 0 && u == 0) {
        shard_op_param_t pp = {.op_attr_mask = SHARD_OP_ATTR_GRAD, .grad = g, .bytes = ui.bytes};
        st = named ? shard_push_grad(ctx, u, g, ui.bytes) : shard_pushx(ctx, u, &pp);
    } else if (st == 0) {
        void *buf = NULL;
        st = shard_grad_buffer(ctx, u, &buf);
        if (st == 0)
            st = shard_copy(ctx, buf, g, ui.bytes);
        shard_op_param_t pp = {.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_STAGED};
        if (st == 0)
            st = named ? shard_push_staged(ctx, u) : shard_pushx(ctx, u, &pp);
    }
    free(w);
    free(g);
    return st;
}

/* unit u read aside (named or x), into out */
static int read_aside(shard_ctx_t *ctx, uint32_t u, bool named, float *out, size_t bytes)
{
    const void *p = NULL;
    shard_op_param_t ap = {.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_ASIDE};
    int st = named ? shard_fetch_aside(ctx, u, &p) : shard_fetchx(ctx, u, &ap, &p);
    if (st == 0)
        st = shard_copy(ctx, out, p, bytes);
    int rs = named ? shard_release_aside(ctx, u) : shard_releasex(ctx, u, &ap);
    return st != 0 ? st : rs;
}

static void test_same_training(void)
{
    shard_ctx_t *a = join("named"), *b = join("param");
    for (int s = 0; s < STEPS; s++) {
        for (uint32_t u = 0; u < 2; u++) {
            TH_CHECK(unit_round(a, u, s, true) == 0, "named calls, step %d unit %u: %s", s, u,
                     shard_last_error(a));
            TH_CHECK(unit_round(b, u, s, false) == 0, "x calls, step %d unit %u: %s", s, u,
                     shard_last_error(b));
        }
        TH_CHECK(shard_step(a, NULL) == 0 && shard_step(b, NULL) == 0, "step %d: %s / %s", s,
                 shard_last_error(a), shard_last_error(b));
    }
    for (uint32_t u = 0; u < 2; u++) {
        shard_unit_info_t ui;
        TH_CHECK(shard_unit_info(a, u, &ui) == 0, "unit info");
        float *wa = calloc(1, ui.bytes), *wb = calloc(1, ui.bytes);
        TH_CHECK(read_aside(a, u, true, wa, ui.bytes) == 0, "named aside read of unit %u: %s", u,
                 shard_last_error(a));
        TH_CHECK(read_aside(b, u, false, wb, ui.bytes) == 0, "x aside read of unit %u: %s", u,
                 shard_last_error(b));
        size_t n = u == 0 ? N_A : N_B, moved = 0;
        for (size_t i = 0; i < n; i++)
            moved += wa[i] != (u == 0 ? (float)((i * 37) % 101) / 101.0f - 0.5f : i * 0.25f);
        TH_CHECK(memcmp(wa, wb, n * sizeof(float)) == 0,
                 "unit %u after %d steps: the x calls' job is bitwise the named calls' job", u,
                 STEPS);
        TH_CHECK(moved == n, "unit %u: every weight moved (%zu of %zu)", u, moved, n);
        free(wa);
        free(wb);
    }
    shard_detach(a);
    shard_detach(b);
}

/* st must be SHARD_EINVAL with every word in the message */
static void refused(shard_ctx_t *ctx, int st, const char *what, const char *w1, const char *w2)
{
    const char *msg = shard_last_error(ctx);
    TH_CHECK(st == SHARD_EINVAL && strstr(msg, w1) != NULL && (w2 == NULL || strstr(msg, w2)),
             "%s: refused with SHARD_EINVAL naming %s%s%s: %d '%s'", what, w1, w2 ? " and " : "",
             w2 ? w2 : "", st, msg);
}

static void test_bad_params(void)
{
    shard_ctx_t *c = join("bad");
    shard_unit_info_t ui;
    TH_CHECK(shard_unit_info(c, 0, &ui) == 0, "unit info");
    float *g = calloc(1, ui.bytes);
    const void *p = NULL;
    shard_req_t req = 0;
    int stream_dummy = 0;

    shard_op_param_t bad = {.op_attr_mask = 1u << 9};
    refused(c, shard_fetchx(c, 0, &bad, &p), "fetch, mask bit 9", "op_attr_mask", "(unknown)");
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = 1u << 7};
    refused(c, shard_releasex(c, 0, &bad), "release, flag bit 7", "flag", "(unknown)");
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_GRAD, .grad = g, .bytes = ui.bytes};
    refused(c, shard_fetchx(c, 0, &bad, &p), "fetch with a gradient", "SHARD_OP_ATTR_GRAD",
            "not one fetch takes");
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_STAGED};
    refused(c, shard_releasex(c, 0, &bad), "release, STAGED", "SHARD_OP_FLAG_STAGED", NULL);
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_ASIDE};
    refused(c, shard_pushx(c, 0, &bad), "push, ASIDE", "SHARD_OP_FLAG_ASIDE", NULL);
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_ASYNC};
    refused(c, shard_fetchx(c, 0, &bad, &p), "fetch ASYNC without req_p", "req_p", NULL);
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_REQUEST,
                             .flags = SHARD_OP_FLAG_ASYNC | SHARD_OP_FLAG_ASIDE,
                             .req_p = &req};
    refused(c, shard_fetchx(c, 0, &bad, &p), "fetch ASYNC with ASIDE", "SHARD_OP_FLAG_ASIDE",
            "waited for");
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_GRAD,
                             .flags = SHARD_OP_FLAG_STAGED,
                             .grad = g,
                             .bytes = ui.bytes};
    refused(c, shard_pushx(c, 0, &bad), "push GRAD and STAGED", "one of them", NULL);
    refused(c, shard_pushx(c, 0, NULL), "push with neither", "SHARD_OP_ATTR_GRAD",
            "SHARD_OP_FLAG_STAGED");
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_GRAD | SHARD_OP_ATTR_STREAM,
                             .grad = g,
                             .bytes = ui.bytes,
                             .stream = &stream_dummy};
    refused(c, shard_pushx(c, 0, &bad), "push GRAD with a stream", "takes no stream", NULL);
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_STREAM,
                             .flags = SHARD_OP_FLAG_SIGNALLED,
                             .stream = &stream_dummy};
    refused(c, shard_releasex(c, 0, &bad), "release, stream and SIGNALLED", "one signals", NULL);
    /* the header's unchanged variants keep their names in messages */
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_GRAD, .grad = g, .bytes = 3};
    int st = shard_pushx(c, 0, &bad);
    TH_CHECK(st == SHARD_EMSGSIZE && strstr(shard_last_error(c), "push_grad unit 0") != NULL,
             "a copied gradient of the wrong size: push_grad's message: %d '%s'", st,
             shard_last_error(c));
    /* a stream on memory without streams (host, emu-gpu) */
    TH_CHECK(shard_fetchx(c, 0, NULL, &p) == 0, "fetch: %s", shard_last_error(c));
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_STREAM, .stream = &stream_dummy};
    refused(c, shard_releasex(c, 0, &bad), "release on a stream of host memory", "no streams",
            NULL);
    /* a NULL stream is no stream: the plain release */
    bad = (shard_op_param_t){.op_attr_mask = SHARD_OP_ATTR_STREAM, .stream = NULL};
    TH_CHECK(shard_releasex(c, 0, &bad) == 0, "release with a NULL stream: %s",
             shard_last_error(c));
    /* and the job trains on */
    for (uint32_t u = 0; u < 2; u++)
        TH_CHECK(unit_round(c, u, 0, false) == 0, "after the refusals, unit %u: %s", u,
                 shard_last_error(c));
    TH_CHECK(shard_step(c, NULL) == 0, "after the refusals, a step: %s", shard_last_error(c));
    free(g);
    shard_detach(c);
}

int main(int argc, char **argv)
{
    const char *backend = argc > 1 ? argv[1] : "host";
    const char *args[] = {"--backend", backend, NULL};
    signal(SIGPIPE, SIG_IGN);
    if (th_daemon_start(&d, args) != 0) {
        fprintf(stderr, "cannot start shardd --backend %s (log %s)\n", backend, d.log);
        return 1;
    }
    test_same_training();
    test_bad_params();
    TH_CHECK(th_daemon_alive(&d), "daemon died");
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
    return th_summary("test_op_param");
}

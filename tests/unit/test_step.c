/* The step's logic (daemon/ops/step.c, step_state.c) without a daemon: the module is linked alone
 * with the host backend, a job built by hand (plan, layout, each rank's g arena and control page)
 * and fakes of what it asks of the rest, a fake engine among them: the all-reduces and exchanges
 * it starts are recorded, and the test completes them when and how it chooses (in any order, or
 * failed), as test_coll drives the engine with a fake transport. Checked against references
 * computed here:
 *  - one node (ddp, 4 ranks): nothing happens before the last rank's call; the replicas of each
 *    g shard are summed in rank order on every rank, bit for bit; the optimizer gets the sum of
 *    squares of the distinct shards (to 1e-12); every rank is answered once with its own tag and
 *    step 1;
 *  - it waits: for the pushes (until SD_JOB_EV_PUSHED), for a checkpoint's worker on the shards
 *    (until SD_JOB_EV_OS_FREE with the worker gone), for the device (sd_step_queue_poll);
 *  - refusals: a rank calling twice (EBUSY), unknown flags (EINVAL), two ranks' hyperparameters
 *    differing (EMISMATCH on every rank, naming the rank, the optimizer not run), a loss scale
 *    not finite or not positive (EINVAL at the call), two ranks' loss scales differing or given
 *    by one only (EMISMATCH); the same one reaches the optimizer (1 in a step without), a NaN
 *    (ENONFINITE naming the unit; gradients zeroed, the step count kept);
 *  - two nodes (mics:2, node 0 of 2): one all-reduce per unit, in descending unit order (the
 *    boundary hop's, the same on every node), the next started
 *    only once the one before completed, with the node's block summed over its replicas; the norm
 *    exchanged with node 1 and completed in either order; the optimizer gets both nodes' sums;
 *    the weights' exchange across nodes (SD_JOB_EV_EXCHANGED per transfer) holds the answer until
 *    its last transfer; a failed transfer fails the job naming the node; a node whose ranks gave
 *    other hyperparameters refuses the step on every rank;
 *  - early hops (mics:2, node 0 of 2, round 0's buffer free): a unit whose local rounds were all
 *    marked last goes at once, in the hop order only (unit 0 final first waits for unit 1), in
 *    the round buffer; the step's SYNC sends the rest; the g shards end as without early hops;
 *    in the next step a unit not final waits for the step's SYNC. */
#include "check.h"
#include "job_fixture.h"
#include "net.h"
#include "session.h"
#include "fetch.h"
#include "hop.h"
#include "optimizer.h"
#include "push.h"
#include "quant.h"
#include "schedule.h"
#include "session.h"
#include "step.h"
#include "weights.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_K 4

/* ---- what the step's own fakes record (job_fixture.h's record the rest), and how they answer */
static struct {
    /* the optimizer */
    int applied, handed, taken; /* sd_optimizer_apply, _handoff, _take_update */
    double sumsq, loss_scale;
    /* switches */
    bool push_idle, shards_busy, weights_remote;
    float *round_buf;  /* sd_push_idle_round_buf: the early hops' buffer, or NULL */
    uint32_t w_posted; /* transfers each unit's weights exchange starts */
    int n_wx;
} F;

static struct sd_hparams hp_job = {.lr = 0.1f};

bool sd_job_shards_busy(const struct sd_job *job)
{
    (void)job;
    return F.shards_busy;
}

bool sd_job_weights_remote(const struct sd_job *job)
{
    (void)job;
    return F.weights_remote;
}

bool sd_push_partial_round(struct sd_job *job, char *msg, size_t len)
{
    (void)job;
    (void)msg;
    (void)len;
    return false;
}

bool sd_push_idle(const struct sd_job *job)
{
    (void)job;
    return F.push_idle;
}

float *sd_push_idle_round_buf(const struct sd_job *job)
{
    (void)job;
    return F.round_buf;
}

static float ar_tmp[1 << 16];
float *sd_push_ar_tmp(const struct sd_job *job)
{
    (void)job;
    return ar_tmp;
}

size_t sd_push_ar_tmp_count(const struct sd_job *job)
{
    (void)job;
    return sizeof(ar_tmp) / sizeof(ar_tmp[0]);
}

int sd_qg_hop_codec(const struct sd_job *job, uint32_t u)
{
    (void)job;
    (void)u;
    return 0;
}

/* (never asked for: sd_qg_hop_codec says no hop is encoded) */
uint8_t *sd_qg_hop_buf(struct sd_job *job)
{
    (void)job;
    return NULL;
}

float *sd_qg_hop_ef(struct sd_job *job, uint32_t u)
{
    (void)job;
    (void)u;
    return NULL;
}

void sd_fetch_local_gather(struct sd_job *job, struct sd_unit_state *us)
{
    (void)job;
    (void)us;
}

bool sd_fetch_queue_waiting(const struct sd_job *job)
{
    (void)job;
    return false;
}

bool sd_fetch_fenced_poll(struct sd_job *job)
{
    (void)job;
    return false;
}

int sd_fetch_gather_start(struct sd_job *job, struct sd_unit_state *us)
{
    (void)job;
    (void)us;
    return SD_OK;
}

void sd_fetch_serve_queue(struct sd_job *job)
{
    (void)job;
}

void sd_weights_local(struct sd_job *job)
{
    (void)job;
}

void sd_weights_encode(struct sd_job *job, uint32_t u)
{
    (void)job;
    (void)u;
}

int sd_weights_exchange(struct sd_job *job, uint32_t u, uint32_t *posted_p, uint32_t *suspect_p)
{
    (void)job;
    (void)u;
    (void)suspect_p;
    F.n_wx++;
    *posted_p = F.w_posted;
    return SD_OK;
}

double sd_optimizer_apply(struct sd_job *job, const struct sd_hparams *hp, double sumsq,
                          double loss_scale, const uint64_t *used)
{
    (void)job;
    (void)hp;
    (void)used;
    F.applied++;
    F.sumsq = sumsq;
    F.loss_scale = loss_scale;
    return sqrt(sumsq);
}

double sd_optimizer_handoff(struct sd_job *job, const struct sd_hparams *hp, double sumsq,
                            double loss_scale, const uint64_t *used)
{
    (void)job;
    (void)hp;
    (void)used;
    F.handed++;
    F.sumsq = sumsq;
    F.loss_scale = loss_scale;
    return sqrt(sumsq);
}

float sd_optimizer_handoff_scale(const struct sd_job *job)
{
    (void)job;
    return 0.25f;
}

void sd_optimizer_take_update(struct sd_job *job)
{
    (void)job;
    F.taken++;
}

const struct sd_hparams *sd_optim_hparams(const struct sd_job *job)
{
    (void)job;
    return &hp_job;
}

double sd_optim_grad_norm(const struct sd_job *job)
{
    (void)job;
    return sqrt(F.sumsq);
}

void sd_optim_weights_new(struct sd_job *job)
{
    (void)job;
}

void sd_sched_recorded(const struct sd_job *job, uint64_t *digest_p, uint64_t *n_p)
{
    (void)job;
    *digest_p = 0;
    *n_p = 0;
}

bool sd_sched_step_check(struct sd_job *job)
{
    (void)job;
    return true;
}

bool sd_sched_check_node(struct sd_job *job, uint32_t m, const struct sd_norm_part *part)
{
    (void)job;
    (void)m;
    (void)part;
    return true;
}

void sd_sched_step_done(struct sd_job *job)
{
    (void)job;
}

void sd_bulk_put(struct sd_bulk_pool *pool, struct sd_bulk *b)
{
    (void)pool;
    (void)b;
}

/* ---- the job */
struct fixture {
    struct th_job tj;
    struct sd_job *job;
    struct sd_mem control[MAX_K];
    struct sd_session *ranks[MAX_K];
    uint32_t members[8];
    float *grad[MAX_K]; /* each rank's g arena as the ranks pushed it */
};

/* two units of 3000 and 5000 fp32 elements under plan on node `node` of nodes x k ranks */
static bool setup(struct fixture *fx, const char *plan, uint32_t nodes, uint32_t k, uint32_t node)
{
    memset(fx, 0, sizeof(*fx));
    memset(&F, 0, sizeof(F));
    th_fake_reset();
    F.push_idle = true;
    static const uint64_t sizes[2] = {3000, 5000};
    if (!th_job_build(&fx->tj, plan, nodes, k, node, sizes, 2, SD_DTYPE_FP32))
        return false;
    struct sd_job *job = fx->job = &fx->tj.job;
    th_job_g_arenas(&fx->tj);
    job->mem.fence = fx->control;
    job->mem.step_args_off = 0;
    job->mem.scratch = calloc(job->layout.max_unit_numel, sizeof(float));
    job->xfer.members = fx->members;
    job->ranks = fx->ranks;
    uint64_t g_numel = job->layout.arena_numel[SD_STATE_G];
    for (uint32_t r = 0; r < k; r++) {
        fx->control[r].bytes = 4096;
        fx->control[r].ptr = calloc(1, 4096);
        fx->grad[r] = th_job_g(&fx->tj, r);
        for (uint64_t i = 0; i < g_numel; i++)
            fx->grad[r][i] *= (float)(1 + rand() % 100);
        fx->ranks[r] = &fx->tj.s[r];
    }
    TH_CHECK(sd_step_module.create(job) == SD_OK && sd_step_module.alloc(job) == SD_OK,
             "the step's state for %s", plan);
    return true;
}

static void teardown(struct fixture *fx)
{
    sd_step_module.destroy(fx->job);
    for (uint32_t r = 0; r < fx->job->k; r++)
        free(fx->control[r].ptr);
    free(fx->job->mem.scratch);
    th_job_free(&fx->tj);
}

/* rank r's step call with tag 100 + r and arg0 flags */
static void call_step(struct fixture *fx, uint32_t r, uint64_t flags)
{
    struct sd_sqe e = {.tag = 100 + r, .arg0 = flags};
    sd_step(fx->job, &fx->tj.s[r], &e);
}

/* the same with a loss scale (SD_STEP_ARG_SCALED, arg1 the double's bits) */
static void call_scaled(struct fixture *fx, uint32_t r, double scale)
{
    struct sd_sqe e = {.tag = 100 + r, .arg0 = SD_STEP_ARG_SCALED};
    memcpy(&e.arg1, &scale, sizeof(scale));
    sd_step(fx->job, &fx->tj.s[r], &e);
}

static void all_call(struct fixture *fx)
{
    for (uint32_t r = 0; r < fx->job->k; r++)
        call_step(fx, r, 0);
}

static bool event(struct fixture *fx, enum sd_job_event kind, int status, uint32_t peer)
{
    struct sd_job_ev ev = {.kind = kind, .status = status, .peer = peer};
    return sd_step_module.event(fx->job, &ev);
}

/* local rank r's answer to its step call (tag 100 + r), or NULL */
static const struct th_answer *answer(uint32_t r)
{
    int i = th_answered(r, 100 + r);
    return i >= 0 ? &th_fake.ans[i] : NULL;
}

/* its message ("" without an answer) */
static const char *msg_of(uint32_t r)
{
    const struct th_answer *a = answer(r);
    return a != NULL ? a->msg : "";
}

static void reset_answers(void)
{
    th_fake.done = 0;
}

/* every local rank answered once, with its tag, status and the step count */
static void check_answers(const char *what, struct fixture *fx, int status, uint64_t steps)
{
    uint32_t ok = 0;
    for (uint32_t r = 0; r < fx->job->k; r++) {
        const struct th_answer *a = answer(r);
        ok += a != NULL && a->status == status && (status != SD_OK || a->v1 == steps);
    }
    const struct th_answer *a0 = answer(0);
    TH_CHECK(th_fake.done == (int)fx->job->k && ok == fx->job->k,
             "%s: %d answers, %u with their tag, status %s and step %llu (rank 0: %s, '%s')", what,
             th_fake.done, ok, sd_status_str(status), (unsigned long long)steps,
             a0 ? sd_status_str(a0->status) : "none", a0 ? a0->msg : "");
}

/* ---- one node */

/* ddp on 1 x 4: the replicas summed in rank order, bit for bit; the optimizer's sum of squares */
static void test_one_node(void)
{
    struct fixture fx;
    if (!setup(&fx, "ddp", 1, 4, 0))
        return;
    struct sd_job *job = fx.job;
    uint64_t n = job->layout.arena_numel[SD_STATE_G];
    float *want = malloc(n * sizeof(float));
    double sumsq = 0.0;
    for (uint64_t i = 0; i < n; i++) {
        float acc = fx.grad[0][i];
        for (uint32_t r = 1; r < 4; r++)
            acc += fx.grad[r][i];
        want[i] = acc;
    }
    for (uint32_t u = 0; u < job->layout.n_units; u++) /* the padding is zero */
        for (uint64_t i = 0; i < job->layout.units[u].numel; i++) {
            double v = want[job->layout.units[u].arena_off[SD_STATE_G] + i];
            sumsq += v * v;
        }
    for (uint32_t r = 0; r < 3; r++)
        call_step(&fx, r, 0);
    TH_CHECK(th_fake.done == 0 && F.applied == 0 && sd_step_arrived(job) == 3,
             "three of four ranks: nothing runs (%d answers, %d applies, %u arrived)", th_fake.done,
             F.applied, sd_step_arrived(job));
    call_step(&fx, 1, 0);
    TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_EBUSY &&
                 strstr(th_fake.fail_msg, "already waits"),
             "a rank calling twice: EBUSY (%s: %s)", sd_status_str(th_fake.fail_status),
             th_fake.fail_msg);
    call_step(&fx, 3, 0);
    check_answers("one node", &fx, SD_OK, 1);
    TH_CHECK(F.applied == 1 && fabs(F.sumsq - sumsq) <= 1e-12 * sumsq,
             "the optimizer's sum of squares %.17g, the reference %.17g", F.sumsq, sumsq);
    uint32_t same = 0;
    for (uint32_t r = 0; r < 4; r++)
        same += memcmp(fx.grad[r], want, n * sizeof(float)) == 0;
    TH_CHECK(same == 4, "every rank's g arena is the rank-order sum, bit for bit (%u of 4)", same);
    TH_CHECK(job->steps == 1 && job->weights_gen == 1 && th_fake.events[SD_JOB_EV_STEP_OVER] == 1 &&
                 !sd_step_running(job),
             "one step, one generation, STEP_OVER raised once (%llu, %llu, %d)",
             (unsigned long long)job->steps, (unsigned long long)job->weights_gen,
             th_fake.events[SD_JOB_EV_STEP_OVER]);
    free(want);
    teardown(&fx);
}

/* the step waits for the pushes, a checkpoint's worker and the device, and goes on at their
 * events */
static void test_waits(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero2", 1, 2, 0))
        return;
    struct sd_job *job = fx.job;
    F.push_idle = false;
    all_call(&fx);
    TH_CHECK(th_fake.done == 0 && sd_step_running(job), "pushes not idle: the step waits in SYNC");
    TH_CHECK(!event(&fx, SD_JOB_EV_W_SENT, SD_OK, UINT32_MAX) && th_fake.done == 0,
             "an event SYNC does not wait for: not taken, nothing answered");
    F.push_idle = true;
    F.shards_busy = true;
    TH_CHECK(event(&fx, SD_JOB_EV_PUSHED, SD_OK, UINT32_MAX), "PUSHED: taken");
    TH_CHECK(th_fake.done == 0 && F.applied == 0 && sd_step_running(job),
             "a checkpoint's worker on the shards: the optimizer waits");
    TH_CHECK(!event(&fx, SD_JOB_EV_OS_FREE, SD_OK, UINT32_MAX) && F.applied == 0,
             "OS_FREE while a worker is still busy: not taken");
    F.shards_busy = false;
    th_fake.queue_eagain = 1;
    TH_CHECK(event(&fx, SD_JOB_EV_OS_FREE, SD_OK, UINT32_MAX) && F.applied == 1,
             "OS_FREE with the worker gone: the optimizer runs");
    TH_CHECK(th_fake.done == 0 && sd_step_running(job), "the device behind: the new weights wait");
    TH_CHECK(sd_step_queue_poll(job), "the loop's poll finds the device done");
    check_answers("after the waits", &fx, SD_OK, 1);
    teardown(&fx);
}

/* refusals at the call, hyperparameters that differ, a NaN */
static void test_refusals(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero2", 1, 2, 0))
        return;
    struct sd_job *job = fx.job;
    call_step(&fx, 0, 0x40);
    TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_EINVAL &&
                 strstr(th_fake.fail_msg, "0x40") && sd_step_arrived(job) == 0,
             "unknown flags: EINVAL naming them, nobody waits (%s)", th_fake.fail_msg);
    /* both give hyperparameters, rank 1 another lr */
    for (uint32_t r = 0; r < 2; r++) {
        struct sd_step_args hdr = {.n_groups = 1, .n_tensors = 2};
        struct sd_hparams h = hp_job;
        h.lr = r == 0 ? 0.1f : 0.2f;
        memcpy(fx.control[r].ptr, &hdr, sizeof(hdr));
        memcpy((uint8_t *)fx.control[r].ptr + sizeof(hdr), &h, sizeof(h));
        call_step(&fx, r, SD_STEP_ARG_HPARAMS);
    }
    check_answers("hyperparameters that differ", &fx, SD_EMISMATCH, 0);
    TH_CHECK(strstr(msg_of(0), "rank 1's hyperparameters") && F.applied == 0 && job->steps == 0,
             "named rank 1, the optimizer not run, no step (%s)", msg_of(0));
    /* loss scales: not finite or not positive refused at the call; two ranks' that differ
     * refuse the step on both, naming the rank; the same one reaches the optimizer */
    static const double bad[] = {0.0, -2.0, 1e-320, INFINITY, NAN};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        th_fake.fails = 0;
        call_scaled(&fx, 0, bad[i]);
        TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_EINVAL &&
                     strstr(th_fake.fail_msg, "loss scale") && sd_step_arrived(job) == 0,
                 "loss scale %g: EINVAL naming it, nobody waits (%s)", bad[i], th_fake.fail_msg);
    }
    reset_answers();
    call_scaled(&fx, 0, 1024.0);
    call_scaled(&fx, 1, 2048.0);
    check_answers("loss scales that differ", &fx, SD_EMISMATCH, 0);
    TH_CHECK(strstr(msg_of(0), "rank 1's loss scale (2048)") && F.applied == 0 && job->steps == 0,
             "named rank 1's loss scale, the optimizer not run (%s)", msg_of(0));
    reset_answers();
    call_scaled(&fx, 0, 1024.0);
    call_step(&fx, 1, 0);
    check_answers("a loss scale on one rank only", &fx, SD_EMISMATCH, 0);
    reset_answers();
    call_scaled(&fx, 0, 65536.0);
    call_scaled(&fx, 1, 65536.0);
    check_answers("the same loss scale", &fx, SD_OK, 1);
    TH_CHECK(F.applied == 1 && F.loss_scale == 65536.0, "the optimizer got loss scale %g",
             F.loss_scale);
    reset_answers();
    all_call(&fx); /* and the next step without one: 1 */
    check_answers("no loss scale", &fx, SD_OK, 2);
    TH_CHECK(F.applied == 2 && F.loss_scale == 1.0, "the optimizer got loss scale %g",
             F.loss_scale);
    F.applied = 0;
    uint64_t steps0 = job->steps;
    /* a NaN in unit 1 */
    reset_answers();
    const struct sd_unit_layout *u1 = &job->layout.units[1];
    fx.grad[1][u1->arena_off[SD_STATE_G] + 7] = NAN;
    all_call(&fx);
    check_answers("a NaN", &fx, SD_ENONFINITE, steps0);
    uint64_t nonzero = 0;
    for (uint32_t r = 0; r < 2; r++)
        for (uint64_t i = 0; i < job->layout.arena_numel[SD_STATE_G]; i++)
            nonzero += fx.grad[r][i] != 0.0f;
    TH_CHECK(strstr(msg_of(0), "unit 1") && F.applied == 0 && job->steps == steps0 && nonzero == 0,
             "named unit 1, no optimizer, no step, gradients zeroed (%llu left): %s",
             (unsigned long long)nonzero, msg_of(0));
    teardown(&fx);
}

/* ---- two nodes: the fake engine's collectives completed by the test */

/* complete the norm exchange: node 1's part (sumsq, hparams) in, then its two transfers in the
 * order given (recv first or not), with status for the receive */
static void complete_norm(double peer_sumsq, uint32_t hparams, bool recv_first, int status)
{
    struct sd_exchange_param *x = &th_fake.ex[th_fake.n_ex - 1];
    struct sd_norm_part part;
    memcpy(&part, x->send.buf, sizeof(part)); /* node 0's, as a model for node 1's */
    part.sumsq = peer_sumsq;
    part.hparams = hparams;
    part.nonfinite_unit = UINT32_MAX;
    memcpy(x->recv.buf, &part, sizeof(part));
    struct sd_bulk recv = {
        .peer = x->peer, .is_send = false, .bytes = x->recv.bytes, .arg = x->arg, .arg2 = x->arg2};
    struct sd_bulk send = {
        .peer = x->peer, .is_send = true, .bytes = x->send.bytes, .arg = x->arg, .arg2 = x->arg2};
    if (recv_first) {
        x->cb(&recv, status);
        x->cb(&send, SD_OK);
    } else {
        x->cb(&send, SD_OK);
        x->cb(&recv, status);
    }
}

/* node 0 of 2 under mics:2 (2 ranks a node): the 2-hop all-reduce unit by unit, the norm, the
 * weights' exchange */
static void test_two_nodes(bool recv_first)
{
    struct fixture fx;
    if (!setup(&fx, "mics:2", 2, 2, 0))
        return;
    struct sd_job *job = fx.job;
    TH_CHECK(job->plan.two_hop && job->gnodes[SD_STATE_G] == 1, "mics:2 on 2x2: 2-hop, g in node");
    const struct sd_layout *l = &job->layout;
    uint32_t f = job->plan.f[SD_STATE_G];
    /* the reference: per unit, the node's block (replicas summed, here f = k: each rank's shard
     * at its place) plus node 1's, a constant 0.5 per element */
    uint64_t n = l->arena_numel[SD_STATE_G];
    float *want[MAX_K];
    for (uint32_t r = 0; r < 2; r++) {
        want[r] = malloc(n * sizeof(float));
        for (uint64_t i = 0; i < n; i++)
            want[r][i] = fx.grad[r][i] + 0.5f;
    }
    F.weights_remote = true;
    F.w_posted = 2;
    all_call(&fx);
    double local_sumsq = 0.0;
    for (uint32_t p = 0; p < l->n_units; p++) {
        uint32_t u = l->n_units - 1 - p; /* the hop order: descending units */
        TH_CHECK(th_fake.n_ar == (int)p + 1, "unit %u's all-reduce started alone (%d so far)", u,
                 th_fake.n_ar);
        struct sd_job_allreduce *a = &th_fake.ar[p];
        TH_CHECK(a->unit == u && a->R == 2 && a->count == l->units[u].numel && a->step_sync,
                 "unit %u: R %u, %zu floats (the unit's %llu), the step's sync", u, a->R, a->count,
                 (unsigned long long)l->units[u].numel);
        uint32_t match = 0;
        uint64_t len = l->units[u].numel / f;
        for (uint32_t j = 0; j < 2; j++) /* the packed block: rank j's shard at its place */
            match += memcmp(a->buf + sd_job_g_block_off(job, j, len),
                            sd_job_g_shard(job, j, &l->units[u]), len * sizeof(float)) == 0;
        TH_CHECK(match == 2, "unit %u's block packed from both ranks' shards (%u)", u, match);
        for (size_t i = 0; i < a->count; i++)
            a->buf[i] += 0.5f; /* node 1's block */
        a->cb(a->ar, SD_OK, 1);
    }
    uint32_t same = 0;
    for (uint32_t r = 0; r < 2; r++) {
        same += memcmp(fx.grad[r], want[r], n * sizeof(float)) == 0;
        for (uint32_t u = 0; u < l->n_units; u++)
            for (uint64_t i = 0; i < l->units[u].numel / f; i++) {
                double v = sd_job_g_shard(job, r, &l->units[u])[i];
                local_sumsq += v * v;
            }
    }
    TH_CHECK(same == 2, "both ranks' g shards hold the two nodes' sums (%u)", same);
    TH_CHECK(th_fake.n_ex == 1 && th_fake.ex[0].peer == 1 && F.applied == 0,
             "the norm exchange with node 1 posted, the optimizer waits (%d exchanges)",
             th_fake.n_ex);
    struct sd_norm_part mine;
    memcpy(&mine, th_fake.ex[0].send.buf, sizeof(mine));
    TH_CHECK(fabs(mine.sumsq - local_sumsq) <= 1e-12 * local_sumsq,
             "node 0's part: sum of squares %.17g, the reference %.17g", mine.sumsq, local_sumsq);
    complete_norm(123.25, mine.hparams, recv_first, SD_OK);
    TH_CHECK(F.applied == 1 && fabs(F.sumsq - (local_sumsq + 123.25)) <= 1e-12 * F.sumsq,
             "the optimizer got both nodes' sums: %.17g", F.sumsq);
    TH_CHECK(F.n_wx == 1 && th_fake.done == 0,
             "the weights' exchange of unit 0 started; no answer yet");
    TH_CHECK(event(&fx, SD_JOB_EV_EXCHANGED, SD_OK, 1) && F.n_wx == 1 && th_fake.done == 0,
             "one of its two transfers: still waiting");
    event(&fx, SD_JOB_EV_EXCHANGED, SD_OK, 1);
    TH_CHECK(F.n_wx == 2 && th_fake.done == 0, "unit 1's exchange started after unit 0's");
    event(&fx, SD_JOB_EV_EXCHANGED, SD_OK, 1);
    event(&fx, SD_JOB_EV_EXCHANGED, SD_OK, 1);
    check_answers(recv_first ? "two nodes, receive first" : "two nodes, send first", &fx, SD_OK, 1);
    TH_CHECK(th_fake.job_fails == 0, "the job did not fail: %s", th_fake.job_msg);
    for (uint32_t r = 0; r < 2; r++)
        free(want[r]);
    teardown(&fx);
}

static void test_early_hops(void)
{
    struct fixture fx;
    if (!setup(&fx, "mics:2", 2, 2, 0))
        return;
    struct sd_job *job = fx.job;
    const struct sd_layout *l = &job->layout;
    TH_CHECK(l->n_units == 2, "two units (%u)", l->n_units);
    F.round_buf = calloc(l->max_unit_numel, sizeof(float));
    uint64_t n = l->arena_numel[SD_STATE_G];
    float *want[2];
    for (uint32_t r = 0; r < 2; r++) {
        want[r] = malloc(n * sizeof(float));
        for (uint64_t i = 0; i < n; i++)
            want[r][i] = fx.grad[r][i] + 0.5f;
    }
    sd_hop_unit_final(job, 0);
    TH_CHECK(th_fake.n_ar == 0,
             "unit 0 final first: it waits for unit 1, before it in the hop order (%d)",
             th_fake.n_ar);
    sd_hop_unit_final(job, 1);
    TH_CHECK(th_fake.n_ar == 1 && th_fake.ar[0].unit == 1 && th_fake.ar[0].buf == F.round_buf &&
                 th_fake.ar[0].step_sync && th_fake.ar[0].count == l->units[1].numel,
             "unit 1 final: its hop started at once, in round 0's buffer (%d)", th_fake.n_ar);
    struct sd_job_allreduce *a = &th_fake.ar[0];
    for (size_t i = 0; i < a->count; i++)
        a->buf[i] += 0.5f;
    a->cb(a->ar, SD_OK, 1);
    TH_CHECK(th_fake.n_ar == 2 && th_fake.ar[1].unit == 0,
             "unit 1's end starts unit 0's, final already (%d)", th_fake.n_ar);
    a = &th_fake.ar[1];
    for (size_t i = 0; i < a->count; i++)
        a->buf[i] += 0.5f;
    a->cb(a->ar, SD_OK, 1);
    TH_CHECK(th_fake.n_ar == 2 && th_fake.n_ex == 0,
             "both units went before the step: nothing more, no norm yet");
    all_call(&fx);
    TH_CHECK(th_fake.n_ar == 2 && th_fake.n_ex == 1,
             "the step: no hop left, the norm exchange posted (%d all-reduces, %d exchanges)",
             th_fake.n_ar, th_fake.n_ex);
    uint32_t same = 0;
    for (uint32_t r = 0; r < 2; r++)
        same += memcmp(fx.grad[r], want[r], n * sizeof(float)) == 0;
    TH_CHECK(same == 2, "both ranks' g shards hold the two nodes' sums (%u)", same);
    struct sd_norm_part mine;
    memcpy(&mine, th_fake.ex[0].send.buf, sizeof(mine));
    complete_norm(1.0, mine.hparams, true, SD_OK);
    check_answers("early hops", &fx, SD_OK, 1);
    /* the next step: one unit early, the other (final in step 1, not now) at the step's SYNC */
    sd_hop_unit_final(job, 1);
    TH_CHECK(th_fake.n_ar == 3 && th_fake.ar[2].unit == 1, "step 2: unit 1 early (%d)",
             th_fake.n_ar);
    th_fake.ar[2].cb(th_fake.ar[2].ar, SD_OK, 1);
    TH_CHECK(th_fake.n_ar == 3, "unit 0 not final: it waits for the step");
    all_call(&fx);
    TH_CHECK(th_fake.n_ar == 4 && th_fake.ar[3].unit == 0 && th_fake.ar[3].buf == F.round_buf,
             "the step sends unit 0 (%d)", th_fake.n_ar);
    TH_CHECK(th_fake.job_fails == 0, "the job did not fail: %s", th_fake.job_msg);
    for (uint32_t r = 0; r < 2; r++)
        free(want[r]);
    free(F.round_buf);
    teardown(&fx);
}

/* failures across nodes: a norm transfer, a weights transfer, another node's hyperparameters */
static void test_two_node_failures(void)
{
    struct fixture fx;
    if (!setup(&fx, "mics:2", 2, 2, 0))
        return;
    all_call(&fx);
    for (uint32_t u = 0; u < fx.job->layout.n_units; u++)
        th_fake.ar[u].cb(th_fake.ar[u].ar, SD_OK, 1);
    complete_norm(1.0, 0, true, SD_EPEER);
    TH_CHECK(th_fake.job_fails == 1 && th_fake.job_status == SD_EPEER &&
                 strstr(th_fake.job_msg, "transfer with node 1 failed") && F.applied == 0,
             "a failed norm transfer fails the job naming node 1: %s", th_fake.job_msg);
    teardown(&fx);

    if (!setup(&fx, "mics:2", 2, 2, 0))
        return;
    F.weights_remote = true;
    F.w_posted = 2;
    all_call(&fx);
    for (uint32_t u = 0; u < fx.job->layout.n_units; u++)
        th_fake.ar[u].cb(th_fake.ar[u].ar, SD_OK, 1);
    struct sd_norm_part mine;
    memcpy(&mine, th_fake.ex[0].send.buf, sizeof(mine));
    complete_norm(1.0, mine.hparams, false, SD_OK);
    event(&fx, SD_JOB_EV_EXCHANGED, SD_ETIMEDOUT, 1);
    TH_CHECK(th_fake.job_fails == 0, "the first failed transfer waits for the unit's other one");
    event(&fx, SD_JOB_EV_EXCHANGED, SD_OK, 1);
    TH_CHECK(th_fake.job_fails == 1 && strstr(th_fake.job_msg, "node 1") && th_fake.done == 0 &&
                 F.n_wx == 1,
             "a failed weights transfer fails the job naming node 1, unit 1 not started: %s",
             th_fake.job_msg);
    teardown(&fx);

    if (!setup(&fx, "mics:2", 2, 2, 0))
        return;
    all_call(&fx);
    for (uint32_t u = 0; u < fx.job->layout.n_units; u++)
        th_fake.ar[u].cb(th_fake.ar[u].ar, SD_OK, 1);
    memcpy(&mine, th_fake.ex[0].send.buf, sizeof(mine));
    complete_norm(1.0, mine.hparams ^ 1u, true, SD_OK);
    check_answers("node 1's other hyperparameters", &fx, SD_EMISMATCH, 0);
    TH_CHECK(strstr(msg_of(0), "the ranks of node 1 gave other hyperparameters") && F.applied == 0,
             "named node 1, the optimizer not run: %s", msg_of(0));
    teardown(&fx);
}

int main(void)
{
    srand(7);
    test_one_node();
    test_waits();
    test_refusals();
    test_two_nodes(true);
    test_two_nodes(false);
    test_two_node_failures();
    test_early_hops();
    return th_summary("test_step");
}

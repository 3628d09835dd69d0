/* Loading the initial values and the ready barrier (daemon/ops/loading.c), and values written
 * into and read out of a running job (daemon/ops/values.c), without a daemon: the
 * module is linked alone with the host backend, a job built by hand (plan, layout, each rank's
 * w and os arenas, staging slots, scratch) and fakes of the rest; the transfers between nodes it
 * posts are recorded and completed by the test (with the bytes the test chooses, or failed).
 * Checked against references computed here (each rank's shard from the definition: unit i is cut
 * into f[state] equal pieces, rank r holds piece r mod f[state]; bf16 by round-to-nearest-even):
 *  - one node (zero3, 4 ranks; fp32 and bf16 weights): rank 0's values land in every rank's
 *    master and weight shard, bit for bit; the calls of other ranks (EPERM), of units and
 *    staging slots out of range (EINVAL), of a job that loads a checkpoint or is ready already
 *    (ESTATE, naming why) are refused; the ready barrier answers nobody before rank 0's call,
 *    refuses a rank that calls twice (EBUSY), then answers every rank with its own tag;
 *  - a device at work (the queue's mark answers "not yet"): the init is answered only by the
 *    loop's poll, and the next init waits for it;
 *  - node 0 of 2 (zero3 2x2): each init sends node 1 exactly the elements its ranks hold (and no
 *    more), and is answered once the send completed; a failed send answers EPEER; its ready call
 *    tells the other nodes (the cluster's job_ready);
 *  - node 1 of 2 (zero3 and mics:2): it receives unit after unit into scratch at the elements it
 *    holds (the whole unit under mics:2), writes them into its ranks' shards; ready once node 0
 *    says so and the last unit arrived (in either order); a failed receive fails the job naming
 *    node 0;
 *  - the sweep fails a job whose ranks wait at the barrier past the timeout, and the parked
 *    calls are answered with the failure;
 *  - values written into the running job (bf16 weights): refusals (a tensor out of range, a
 *    state the optimizer has not, another count, during a step, while the rank holds a unit,
 *    after its write_done); each rank writes its own master and weight shards, or momentum, and
 *    no other rank's; a device behind (answered by the poll); a tensor's step count; the
 *    written barrier (a rank twice; waits for a gather of the old weights in flight; a new
 *    generation once all ended, the one before still served to peers; none when only moments
 *    were written); a rank that never ends its writes fails the job at the timeout, the waiting
 *    rank answered;
 *  - a rank's read of a unit's state: on one node the node's shards (masters, momentum), a
 *    tensor's step count, refusals (a unit or state out of range), a read while the other rank
 *    is in the next step; node 0 of 2:
 *    one request to node 1 (the state, unit, generation) and one receive of its shards at their
 *    places, another rank's read waiting meanwhile, then the whole unit in the slot; a lost
 *    transfer answering EPEER and failing the job naming the node. */
#include "check.h"
#include "job_fixture.h"
#include "barrier.h"
#include "bulk_fake.h"
#include "cluster/cluster.h"
#include "fetch.h"
#include "loading.h"
#include "values.h"
#include "net.h"
#include "pull.h"
#include "optimizer.h"
#include "schedule.h"
#include "step.h"
#include "session.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_K 4
#define SLOTS 2

/* ---- what loading's own fakes record, and how they answer */
static struct {
    const char *values_from; /* sd_job_values_from */
    int job_ready, serve_queue, prefetches;
    uint32_t step_arrived;
    bool shards_busy;
    uint64_t steps_set[2];
} F;

uint32_t sd_step_arrived(const struct sd_job *job)
{
    (void)job;
    return F.step_arrived;
}

bool sd_step_running(const struct sd_job *job)
{
    (void)job;
    return false;
}

bool sd_step_handoff(const struct sd_job *job, uint32_t local)
{
    (void)job;
    (void)local;
    return false;
}

void sd_optim_set_tensor_steps(struct sd_job *job, uint32_t tensor, uint64_t steps)
{
    (void)job;
    if (tensor < 2)
        F.steps_set[tensor] = steps;
}

void sd_sched_prefetch(struct sd_job *job)
{
    (void)job;
    F.prefetches++;
}

static uint64_t tensor_steps[2] = {7, 9};

const uint64_t *sd_optim_tensor_steps(const struct sd_job *job)
{
    (void)job;
    return tensor_steps;
}

const char *sd_job_values_from(const struct sd_job *job)
{
    (void)job;
    return F.values_from;
}

bool sd_job_shards_busy(const struct sd_job *job)
{
    (void)job;
    return F.shards_busy;
}

struct sd_cluster *sd_job_cluster(const struct sd_job *job)
{
    (void)job;
    return NULL;
}

void sd_cluster_job_ready(struct sd_cluster *cl, const char *job, const uint32_t *ids, uint32_t n)
{
    (void)cl;
    (void)job;
    (void)ids;
    (void)n;
    F.job_ready++;
}

void sd_fetch_serve_queue(struct sd_job *job)
{
    (void)job;
    F.serve_queue++;
}

/* ---- the job */
struct fixture {
    struct th_job tj;
    struct sd_job *job;
    struct sd_mem staging[MAX_K];
    struct sd_session *ranks[MAX_K];
    uint32_t node_ids[4];
    struct sd_transport tp;
    struct sd_req_msg read_req;
};

static const uint64_t sizes[2] = {3000, 5000};

static bool setup(struct fixture *fx, const char *plan, uint32_t nodes, uint32_t k, uint32_t node,
                  int dtype)
{
    memset(fx, 0, sizeof(*fx));
    memset(&F, 0, sizeof(F));
    th_fake_reset();
    th_bulks_reset();
    if (!th_job_build(&fx->tj, plan, nodes, k, node, sizes, 2, dtype))
        return false;
    struct sd_job *job = fx->job = &fx->tj.job;
    job->state = SD_JOB_LOADING;
    job->created_ns = sd_now_ns();
    th_job_state_arenas(&fx->tj);
    job->mem.scratch = calloc(job->layout.max_unit_numel, sizeof(float));
    job->mem.staging = fx->staging;
    job->mem.staging_slots = SLOTS;
    job->mem.staging_slot_bytes = job->layout.max_unit_numel * sizeof(float);
    job->ranks = fx->ranks;
    job->xfer.node_ids = fx->node_ids;
    fx->tp = (struct sd_transport){.ops = &th_send_ops, .n_peers = nodes, .self = node};
    job->xfer.tp = &fx->tp;
    job->xfer.read_req = &fx->read_req;
    job->xfer.bulks.n = TH_MAX_BULKS;
    for (uint32_t r = 0; r < k; r++) {
        fx->staging[r].bytes = SLOTS * job->mem.staging_slot_bytes;
        fx->staging[r].ptr = calloc(1, fx->staging[r].bytes);
        fx->ranks[r] = &fx->tj.s[r];
    }
    TH_CHECK(sd_loading_create(job) == SD_OK && sd_values_module.create(job) == SD_OK,
             "loading's and values' state for %s", plan);
    return true;
}

static void teardown(struct fixture *fx)
{
    sd_loading_destroy(fx->job);
    sd_values_module.destroy(fx->job);
    for (uint32_t r = 0; r < fx->job->k; r++)
        free(fx->staging[r].ptr);
    free(fx->job->mem.scratch);
    th_job_free(&fx->tj);
}

/* unit u's values (padding included): distinct, not representable in bf16 */
static void values_of(const struct sd_job *job, uint32_t u, float *out)
{
    for (uint64_t i = 0; i < job->layout.units[u].numel; i++)
        out[i] = (float)(u + 1) * 1000.0f + (float)i * 0.0137f + 1.0f / 3.0f;
}

/* Every local rank's master and weight shard of unit u against values (the unit's, element 0
 * first), from the definition of the shards; the number of elements that differ. */
static int check_shards(struct fixture *fx, uint32_t u, const float *values)
{
    struct sd_job *job = fx->job;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    int bad = 0;
    for (uint32_t r = 0; r < job->k; r++) {
        uint32_t rank = job->first_rank + r;
        uint64_t len = ul->numel / job->plan.f[SD_STATE_OS];
        uint64_t b = (rank % job->plan.f[SD_STATE_OS]) * len;
        const float *master =
            (const float *)sd_job_state(job, r, SD_STATE_OS) + ul->arena_off[SD_STATE_OS];
        for (uint64_t i = 0; i < len; i++)
            bad += memcmp(&master[i], &values[b + i], sizeof(float)) != 0;
        len = ul->numel / job->plan.f[SD_STATE_W];
        b = (rank % job->plan.f[SD_STATE_W]) * len;
        const uint8_t *w = sd_job_w_shard(job, r, u);
        for (uint64_t i = 0; i < len; i++) {
            if (ul->dtype == SD_DTYPE_BF16) {
                uint16_t want = th_bf16(values[b + i]), got;
                memcpy(&got, w + 2 * i, 2);
                bad += got != want;
            } else {
                bad += memcmp(w + 4 * i, &values[b + i], 4) != 0;
            }
        }
    }
    return bad;
}

static void call(struct fixture *fx, uint32_t r, int op, uint32_t unit, uint64_t slot, uint64_t tag)
{
    struct sd_sqe e = {.op = (uint8_t)op, .unit = unit, .arg0 = slot, .tag = tag};
    if (op == SD_OP_INIT)
        sd_loading_init(fx->job, &fx->tj.s[r], &e, sd_now_ns());
    else
        sd_loading_ready(fx->job, &fx->tj.s[r], &e, sd_now_ns());
}

/* rank 0's values of unit u into its staging slot `slot` */
static void stage(struct fixture *fx, uint32_t u, uint32_t slot, float *values)
{
    values_of(fx->job, u, values);
    memcpy(sd_job_staging_slot(fx->job, 0, slot), values,
           fx->job->layout.units[u].numel * sizeof(float));
}

/* ---- one node */
static void test_one_node(int dtype)
{
    const char *dt = dtype == SD_DTYPE_BF16 ? "bf16" : "fp32";
    struct fixture fx;
    if (!setup(&fx, "zero3", 1, 4, 0, dtype))
        return;
    struct sd_job *job = fx.job;
    float *v0 = calloc(job->layout.max_unit_numel, sizeof(float));
    float *v1 = calloc(job->layout.max_unit_numel, sizeof(float));

    stage(&fx, 0, 0, v0); /* (what a refused call must not write) */
    call(&fx, 1, SD_OP_INIT, 0, 0, 7);
    TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_EPERM &&
                 strstr(th_fake.fail_msg, "only rank 0") != NULL,
             "%s: rank 1's init refused EPERM (%d: %s)", dt, th_fake.fail_status, th_fake.fail_msg);
    call(&fx, 0, SD_OP_INIT, 2, 0, 8);
    TH_CHECK(th_fake.fails == 2 && th_fake.fail_status == SD_EINVAL, "%s: unit 2 refused (%d)", dt,
             th_fake.fail_status);
    call(&fx, 0, SD_OP_INIT, 0, SLOTS, 9);
    TH_CHECK(th_fake.fails == 3 && th_fake.fail_status == SD_EINVAL &&
                 strstr(th_fake.fail_msg, "staging slot") != NULL,
             "%s: staging slot %d refused (%d: %s)", dt, SLOTS, th_fake.fail_status,
             th_fake.fail_msg);
    F.values_from = "loading checkpoint /x/step-5";
    call(&fx, 0, SD_OP_INIT, 0, 0, 10);
    TH_CHECK(th_fake.fails == 4 && th_fake.fail_status == SD_ESTATE &&
                 strstr(th_fake.fail_msg, "/x/step-5") != NULL,
             "%s: init of a job that loads a checkpoint refused naming it (%d: %s)", dt,
             th_fake.fail_status, th_fake.fail_msg);
    F.values_from = NULL;
    TH_CHECK(th_fake.done == 0 && check_shards(&fx, 0, v0) > 0,
             "%s: nothing answered or written by the refused calls", dt);

    call(&fx, 0, SD_OP_INIT, 0, 0, 11);
    stage(&fx, 1, 1, v1);
    call(&fx, 0, SD_OP_INIT, 1, 1, 12);
    int a = th_answered(0, 11), b = th_answered(0, 12);
    TH_CHECK(a >= 0 && b > a && th_fake.ans[a].status == SD_OK && th_fake.ans[b].status == SD_OK,
             "%s: both inits answered, in order, OK", dt);
    int bad0 = check_shards(&fx, 0, v0), bad1 = check_shards(&fx, 1, v1);
    TH_CHECK(bad0 == 0 && bad1 == 0,
             "%s: every rank's master and weight shards hold rank 0's values (%d, %d differ)", dt,
             bad0, bad1);
    TH_CHECK(job->stats.ops[SD_OP_INIT] == 2, "%s: two inits counted", dt);

    /* the ready barrier: the other ranks wait for rank 0 */
    for (uint32_t r = 1; r < 4; r++)
        call(&fx, r, SD_OP_READY, 0, 0, 200 + r);
    TH_CHECK(th_answered(1, 201) < 0 && th_answered(3, 203) < 0 && job->state == SD_JOB_LOADING,
             "%s: no rank is ready before rank 0", dt);
    int fails = th_fake.fails;
    call(&fx, 2, SD_OP_READY, 0, 0, 299);
    TH_CHECK(th_fake.fails == fails + 1 && th_fake.fail_status == SD_EBUSY,
             "%s: rank 2 calling ready twice refused EBUSY (%d)", dt, th_fake.fail_status);
    call(&fx, 0, SD_OP_READY, 0, 0, 200);
    TH_CHECK(job->state == SD_JOB_READY, "%s: ready after rank 0's call", dt);
    bool all = true;
    for (uint32_t r = 0; r < 4; r++) {
        int i = th_answered(r, 200 + r);
        all &= i >= 0 && th_fake.ans[i].status == SD_OK;
    }
    TH_CHECK(all && th_answered(2, 299) < 0, "%s: every rank answered once, with its own tag", dt);
    TH_CHECK(F.job_ready == 0, "%s: one node tells no other node", dt);

    /* after: an init is refused, a ready answered at once */
    fails = th_fake.fails;
    call(&fx, 0, SD_OP_INIT, 0, 0, 13);
    TH_CHECK(th_fake.fails == fails + 1 && th_fake.fail_status == SD_ESTATE &&
                 strstr(th_fake.fail_msg, "ready, not loading") != NULL,
             "%s: init of a ready job refused (%s)", dt, th_fake.fail_msg);
    call(&fx, 1, SD_OP_READY, 0, 0, 300);
    TH_CHECK(th_fake.op_done == 1 && th_answered(1, 300) >= 0, "%s: ready of a ready job answered",
             dt);
    free(v0);
    free(v1);
    teardown(&fx);
}

/* the device at work: the conversion is waited for by the loop's poll */
static void test_deferred(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 1, 2, 0, SD_DTYPE_FP32))
        return;
    struct sd_job *job = fx.job;
    float *v0 = calloc(job->layout.max_unit_numel, sizeof(float));
    float *v1 = calloc(job->layout.max_unit_numel, sizeof(float));
    stage(&fx, 0, 0, v0);
    th_fake.queue_eagain = 1;
    call(&fx, 0, SD_OP_INIT, 0, 0, 21);
    TH_CHECK(th_answered(0, 21) < 0 && sd_loading_queue_waiting(job),
             "deferred: the init waits for the device");
    stage(&fx, 1, 1, v1);
    struct sd_sqe e = {.op = SD_OP_INIT, .unit = 1, .arg0 = 1, .tag = 22};
    TH_CHECK(!sd_loading_init(job, &fx.tj.s[0], &e, sd_now_ns()),
             "deferred: the next init waits (its ring entry kept)");
    TH_CHECK(sd_loading_queue_poll(job) && th_answered(0, 21) >= 0 &&
                 !sd_loading_queue_waiting(job),
             "deferred: the loop's poll answers it");
    TH_CHECK(sd_loading_init(job, &fx.tj.s[0], &e, sd_now_ns()) && th_answered(0, 22) >= 0,
             "deferred: then the next init goes");
    TH_CHECK(check_shards(&fx, 0, v0) == 0 && check_shards(&fx, 1, v1) == 0,
             "deferred: both units' shards hold the values");
    TH_CHECK(!sd_loading_queue_poll(job), "deferred: nothing more to poll");
    free(v0);
    free(v1);
    teardown(&fx);
}

/* [lo, hi) of unit u that node m's ranks hold (their w shards), from the definition */
static void node_range(const struct sd_job *job, uint32_t m, uint32_t u, uint64_t *lo, uint64_t *hi)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint32_t f = job->plan.f[SD_STATE_W];
    uint64_t len = ul->numel / f;
    *lo = ul->numel;
    *hi = 0;
    for (uint32_t r = m * job->k; r < (m + 1) * job->k; r++) {
        uint64_t b = (r % f) * len;
        *lo = b < *lo ? b : *lo;
        *hi = b + len > *hi ? b + len : *hi;
    }
}

/* node 0 of 2: it sends node 1 its part of each unit */
static void test_node0(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 2, 2, 0, SD_DTYPE_FP32))
        return;
    struct sd_job *job = fx.job;
    float *v = calloc(job->layout.max_unit_numel, sizeof(float));
    uint64_t sent = 0;
    for (uint32_t u = 0; u < 2; u++) {
        stage(&fx, u, u, v);
        const float *slot = (const float *)(void *)sd_job_staging_slot(job, 0, u);
        call(&fx, 0, SD_OP_INIT, u, u, 31 + u);
        int t = th_bulk_in_flight();
        uint64_t lo, hi;
        node_range(job, 1, u, &lo, &hi);
        TH_CHECK(t >= 0 && th_bulks.post[t].is_send && th_bulks.post[t].peer == 1 &&
                     th_bulks.pieces[t][0] == (const void *)(slot + lo) &&
                     th_bulks.post[t].piece_len == (hi - lo) * sizeof(float) &&
                     th_bulks.post[t].n_pieces == 1,
                 "node 0: unit %u sends node 1 elements [%llu, %llu) of the staged values", u,
                 (unsigned long long)lo, (unsigned long long)hi);
        TH_CHECK(hi - lo == job->layout.units[u].numel / 2,
                 "node 0: under zero3 on 2x2 that is half the unit, not all of it");
        TH_CHECK(th_answered(0, 31 + u) < 0, "node 0: unit %u's init waits for the send", u);
        if (t < 0)
            break;
        th_bulk_complete(t, u == 0 ? SD_OK : SD_EPEER);
        int i = th_answered(0, 31 + u);
        TH_CHECK(i >= 0 && th_fake.ans[i].status == (u == 0 ? SD_OK : SD_EPEER),
                 "node 0: unit %u's init answered with the send's outcome (%d)", u,
                 i >= 0 ? th_fake.ans[i].status : -1);
        TH_CHECK(check_shards(&fx, u, v) == 0, "node 0: its own ranks' shards of unit %u", u);
        sent += th_bulks.post[t].piece_len;
        TH_CHECK(job->stats.bytes[SD_OP_INIT][SD_LINK_INTER_SENT] == sent,
                 "node 0: the bytes sent counted (%llu)", (unsigned long long)sent);
    }
    call(&fx, 1, SD_OP_READY, 0, 0, 41);
    call(&fx, 0, SD_OP_READY, 0, 0, 40);
    TH_CHECK(F.job_ready == 1 && job->state == SD_JOB_READY && th_answered(0, 40) >= 0 &&
                 th_answered(1, 41) >= 0,
             "node 0: rank 0's ready tells the other nodes and answers its ranks");
    free(v);
    teardown(&fx);
}

/* node 1 of 2: it receives its part of each unit; ready_first: node 0 says it is ready before
 * the last unit arrived */
static void test_node1(const char *plan, bool ready_first)
{
    struct fixture fx;
    if (!setup(&fx, plan, 2, 2, 1, SD_DTYPE_BF16))
        return;
    struct sd_job *job = fx.job;
    float *v = calloc(job->layout.max_unit_numel, sizeof(float));
    sd_loading_start(job);
    call(&fx, 0, SD_OP_READY, 0, 0, 50);
    call(&fx, 1, SD_OP_READY, 0, 0, 51);
    for (uint32_t u = 0; u < 2; u++) {
        int t = th_bulk_in_flight();
        uint64_t lo, hi;
        node_range(job, 1, u, &lo, &hi);
        TH_CHECK(t >= 0 && !th_bulks.post[t].is_send && th_bulks.post[t].peer == 0 &&
                     th_bulks.pieces[t][0] == (void *)(job->mem.scratch + lo) &&
                     th_bulks.post[t].piece_len == (hi - lo) * sizeof(float),
                 "%s node 1: unit %u received from node 0 into scratch at [%llu, %llu)", plan, u,
                 (unsigned long long)lo, (unsigned long long)hi);
        if (t < 0)
            break;
        if (strcmp(plan, "mics:2") == 0)
            TH_CHECK(lo == 0 && hi == job->layout.units[u].numel,
                     "mics:2 node 1: all of unit %u (its ranks hold every shard)", u);
        values_of(job, u, v);
        memcpy(job->mem.scratch + lo, v + lo, (hi - lo) * sizeof(float));
        if (ready_first && u == 1) {
            sd_loading_remote_ready(job);
            TH_CHECK(job->state == SD_JOB_LOADING,
                     "%s node 1: node 0 ready, the last unit not here: not ready", plan);
        }
        th_bulk_complete(t, SD_OK);
        TH_CHECK(check_shards(&fx, u, v) == 0, "%s node 1: unit %u in its ranks' shards", plan, u);
    }
    TH_CHECK(th_bulk_in_flight() < 0 && th_bulks.posted == 2,
             "%s node 1: one receive per unit, no more", plan);
    if (!ready_first) {
        TH_CHECK(job->state == SD_JOB_LOADING && th_answered(0, 50) < 0,
                 "%s node 1: every unit here, node 0 not ready: not ready", plan);
        sd_loading_remote_ready(job);
    }
    TH_CHECK(job->state == SD_JOB_READY && th_answered(0, 50) >= 0 && th_answered(1, 51) >= 0 &&
                 F.serve_queue > 0,
             "%s node 1: ready, its ranks answered, the queued pull requests served", plan);
    free(v);
    teardown(&fx);
}

/* a receive fails: the job fails naming node 0, the waiting ranks are answered with it */
static void test_node1_fails(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 2, 2, 1, SD_DTYPE_FP32))
        return;
    struct sd_job *job = fx.job;
    sd_loading_start(job);
    call(&fx, 1, SD_OP_READY, 0, 0, 61);
    int t = th_bulk_in_flight();
    TH_CHECK(t >= 0, "node 1: a receive posted");
    if (t >= 0)
        th_bulk_complete(t, SD_ETIMEDOUT);
    TH_CHECK(th_fake.job_fails == 1 && th_fake.job_status == SD_EPEER &&
                 strstr(th_fake.job_msg, "unit 0 from node 0") != NULL,
             "node 1: a failed receive fails the job naming the unit and node 0 (%s)",
             th_fake.job_msg);
    TH_CHECK(th_bulk_in_flight() < 0 && th_bulks.posted == 1,
             "node 1: nothing more is posted after it");
    sd_loading_module.fail_parked(job, SD_EPEER, "failed", false);
    int i = th_answered(1, 61);
    TH_CHECK(i >= 0 && th_fake.ans[i].status == SD_EPEER,
             "node 1: the rank waiting at the barrier answered with the failure");
    teardown(&fx);
}

/* ranks at the barrier while rank 0 never loads */
static void test_sweep(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 1, 2, 0, SD_DTYPE_FP32))
        return;
    struct sd_job *job = fx.job;
    fx.tj.cfg.register_timeout_ms = 100;
    uint64_t op_timeout = 1000ull * 1000000ull, now = sd_now_ns();
    TH_CHECK(!sd_loading_module.sweep(job, now + op_timeout * 10, op_timeout),
             "sweep: nobody waits, nothing to sweep");
    call(&fx, 1, SD_OP_READY, 0, 0, 71);
    TH_CHECK(!sd_loading_module.sweep(job, now + op_timeout / 2, op_timeout),
             "sweep: within the timeout, nothing happens");
    TH_CHECK(sd_loading_module.sweep(job, now + op_timeout + 200ull * 1000000ull, op_timeout) &&
                 th_fake.job_fails == 1 && th_fake.job_status == SD_ETIMEDOUT &&
                 strstr(th_fake.job_msg, "rank 0") != NULL,
             "sweep: past the timeout and the registration's, the job fails naming rank 0 (%s)",
             th_fake.job_msg);
    char what[128];
    uint64_t since;
    TH_CHECK(!sd_loading_module.activity(job, what, sizeof(what), &since),
             "sweep: a failed job is not loading any more");
    teardown(&fx);
}

/* ---- values written into a running job */

/* local rank r's shards of tensor t against values (the tensor's): its os state `what` and,
 * with what 0, its weight shard; elements that differ */
static int check_written(struct fixture *fx, uint32_t r, uint32_t t, uint32_t what,
                         const float *values)
{
    struct sd_job *job = fx->job;
    const struct sd_unit_layout *ul = &job->layout.units[t]; /* (tensor t is unit t's) */
    uint32_t rank = job->first_rank + r;
    int bad = 0;
    uint64_t len = ul->numel / job->plan.f[SD_STATE_OS],
             b = (rank % job->plan.f[SD_STATE_OS]) * len;
    const float *os = sd_job_os_state(job, r, what, ul);
    for (uint64_t i = b; i < b + len && i < sizes[t]; i++)
        bad += memcmp(&os[i - b], &values[i], 4) != 0;
    if (what != 0)
        return bad;
    len = ul->numel / job->plan.f[SD_STATE_W];
    b = (rank % job->plan.f[SD_STATE_W]) * len;
    const uint8_t *w = sd_job_w_shard(job, r, t);
    for (uint64_t i = b; i < b + len && i < sizes[t]; i++) {
        uint16_t want = th_bf16(values[i]), got;
        memcpy(&got, w + 2 * (i - b), 2);
        bad += got != want;
    }
    return bad;
}

/* local rank r writes tensor t's values as what through staging slot 1, tag */
static void write_tensor(struct fixture *fx, uint32_t r, uint32_t t, uint32_t what,
                         const float *values, uint64_t count, uint64_t tag)
{
    memcpy(sd_job_staging_slot(fx->job, r, 1), values, (t < 2 ? sizes[t] : 0) * sizeof(float));
    struct sd_sqe e = {
        .op = SD_OP_WRITE, .unit = t, .arg0 = 1 | (uint64_t)what << 32, .arg1 = count, .tag = tag};
    sd_values_write(fx->job, &fx->tj.s[r], &e, sd_now_ns());
}

static void written(struct fixture *fx, uint32_t r, uint64_t tag)
{
    struct sd_sqe e = {.op = SD_OP_WRITTEN, .tag = tag};
    sd_values_written(fx->job, &fx->tj.s[r], &e);
}

static void test_write(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 1, 2, 0, SD_DTYPE_BF16))
        return;
    struct sd_job *job = fx.job;
    job->state = SD_JOB_READY;
    uint32_t holds[2][2] = {{0}};
    fx.tj.s[0].holds = holds[0];
    fx.tj.s[1].holds = holds[1];
    float *v = calloc(job->layout.max_unit_numel, sizeof(float));
    float *m = calloc(job->layout.max_unit_numel, sizeof(float));
    for (uint64_t i = 0; i < sizes[0]; i++) {
        v[i] = 7.0f + (float)i * 0.013f + 1.0f / 3.0f;
        m[i] = -0.5f + (float)i * 0.001f;
    }
    /* refusals */
    write_tensor(&fx, 0, 2, 0, v, 3000, 1);
    TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_EINVAL, "write: tensor 2 of 2 (%s)",
             th_fake.fail_msg);
    write_tensor(&fx, 0, 0, 2, v, 3000, 2);
    TH_CHECK(th_fake.fails == 2 && th_fake.fail_status == SD_EINVAL &&
                 strstr(th_fake.fail_msg, "state 2") != NULL,
             "write: SGD has no state 2 (%s)", th_fake.fail_msg);
    write_tensor(&fx, 0, 0, 0, v, 2999, 3);
    TH_CHECK(th_fake.fails == 3 && th_fake.fail_status == SD_EINVAL &&
                 strstr(th_fake.fail_msg, "2999 values") != NULL,
             "write: another count (%s)", th_fake.fail_msg);
    F.step_arrived = 1;
    write_tensor(&fx, 0, 0, 0, v, 3000, 4);
    TH_CHECK(th_fake.fails == 4 && th_fake.fail_status == SD_ESTATE &&
                 strstr(th_fake.fail_msg, "in step 1") != NULL,
             "write: refused while ranks are in a step (%s)", th_fake.fail_msg);
    F.step_arrived = 0;
    holds[0][1] = 1;
    write_tensor(&fx, 0, 0, 0, v, 3000, 5);
    TH_CHECK(th_fake.fails == 5 && th_fake.fail_status == SD_ESTATE &&
                 strstr(th_fake.fail_msg, "holds unit 1") != NULL,
             "write: refused while the rank holds a unit (%s)", th_fake.fail_msg);
    holds[0][1] = 0;
    TH_CHECK(th_fake.done == 0 && check_written(&fx, 0, 0, 0, v) > 0, "write: nothing written");

    /* each rank writes its own shards */
    write_tensor(&fx, 0, 0, 0, v, 3000, 10);
    TH_CHECK(th_answered(0, 10) >= 0 && check_written(&fx, 0, 0, 0, v) == 0 &&
                 check_written(&fx, 1, 0, 0, v) > 0,
             "write: rank 0's own master and weight shards written, not rank 1's");
    th_fake.queue_eagain = 1; /* a device at work: answered by the poll */
    write_tensor(&fx, 1, 0, 0, v, 3000, 11);
    TH_CHECK(th_answered(1, 11) < 0 && sd_values_module.queue_waiting(job),
             "write: answered once the device read the slot");
    TH_CHECK(sd_values_module.queue_poll(job) && th_answered(1, 11) >= 0 &&
                 check_written(&fx, 1, 0, 0, v) == 0,
             "write: the poll answers it, rank 1's shards written");
    write_tensor(&fx, 1, 0, 1, m, 3000, 12);
    TH_CHECK(th_answered(1, 12) >= 0 && check_written(&fx, 1, 0, 1, m) == 0 &&
                 check_written(&fx, 0, 0, 1, m) > 0,
             "write: the momentum of rank 1's shard");
    struct sd_sqe st = {.op = SD_OP_WRITE,
                        .unit = 1,
                        .arg0 = (uint64_t)SD_WRITE_STEPS << 32,
                        .arg1 = 42,
                        .tag = 13};
    sd_values_write(job, &fx.tj.s[0], &st, sd_now_ns());
    TH_CHECK(th_answered(0, 13) >= 0 && F.steps_set[1] == 42, "write: tensor 1's step count");

    /* the barrier: a new generation once both ended, and no gather is in flight */
    written(&fx, 0, 20);
    TH_CHECK(th_answered(0, 20) < 0 && job->weights_gen == 0, "written: rank 0 waits for rank 1");
    written(&fx, 0, 21);
    TH_CHECK(th_fake.fail_status == SD_EBUSY, "written: rank 0 twice refused");
    write_tensor(&fx, 0, 0, 0, v, 3000, 22);
    TH_CHECK(th_fake.fail_status == SD_EBUSY && strstr(th_fake.fail_msg, "ended its writes"),
             "write: after its write_done refused (%s)", th_fake.fail_msg);
    job->xfer.gathers_inflight = 1;
    written(&fx, 1, 23);
    TH_CHECK(th_answered(0, 20) < 0 && th_answered(1, 23) < 0 && job->weights_gen == 0,
             "written: a gather of the old weights in flight: it waits");
    job->xfer.gathers_inflight = 0;
    struct sd_job_ev ev = {.kind = SD_JOB_EV_TRANSFERS};
    TH_CHECK(sd_values_module.event(job, &ev), "written: the gather's end takes it on");
    int a0 = th_answered(0, 20), a1 = th_answered(1, 23);
    TH_CHECK(a0 >= 0 && a1 >= 0 && job->weights_gen == 1 && th_fake.ans[a0].v0 == 1 &&
                 F.prefetches == 1,
             "written: both answered, the weights a new generation (1), prefetching again");
    TH_CHECK(job->xfer.pre_write_gen1 == 1,
             "written: the generation before the write (0) is still served to peers");

    /* only optimizer states written: the same generation */
    write_tensor(&fx, 0, 0, 1, m, 3000, 30);
    written(&fx, 0, 31);
    written(&fx, 1, 32);
    TH_CHECK(th_answered(1, 32) >= 0 && job->weights_gen == 1,
             "written: moments only, the weights' generation stays");

    /* a rank that never ends its writes */
    written(&fx, 0, 40);
    uint64_t op = 1000ull * 1000000ull;
    TH_CHECK(!sd_values_module.sweep(job, sd_now_ns(), op), "written: within the timeout");
    TH_CHECK(sd_values_module.sweep(job, sd_now_ns() + 2 * op, op) && th_fake.job_fails == 1 &&
                 th_fake.job_status == SD_ETIMEDOUT && strstr(th_fake.job_msg, "ranks ?") != NULL,
             "written: past the timeout the job fails naming the ranks missing (%s)",
             th_fake.job_msg);
    sd_values_module.fail_parked(job, SD_ETIMEDOUT, "failed", true);
    int i = th_answered(0, 40);
    TH_CHECK(i >= 0 && th_fake.ans[i].status == SD_ETIMEDOUT,
             "written: the waiting rank answered with the failure");
    free(v);
    free(m);
    teardown(&fx);
}

/* ---- a rank's read of a unit's state */

/* local rank r reads unit u's state what into staging slot 0, tag */
static bool read_unit(struct fixture *fx, uint32_t r, uint32_t u, uint32_t what, uint64_t tag)
{
    struct sd_sqe e = {.op = SD_OP_READ, .unit = u, .arg0 = (uint64_t)what << 32, .tag = tag};
    return sd_values_read(fx->job, &fx->tj.s[r], &e, sd_now_ns());
}

/* every local rank's os state `what` of unit u set to value(i) of its elements */
static void set_os(struct fixture *fx, uint32_t u, uint32_t what, float base)
{
    struct sd_job *job = fx->job;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_OS];
    for (uint32_t r = 0; r < job->k; r++) {
        uint64_t b = ((job->first_rank + r) % job->plan.f[SD_STATE_OS]) * len;
        float *os = sd_job_os_state(job, r, what, ul);
        for (uint64_t i = 0; i < len; i++)
            os[i] = base + (float)(b + i);
    }
}

/* elements of unit u in local rank r's staging slot 0 that are not base + i */
static int check_read(struct fixture *fx, uint32_t r, uint32_t u, float base)
{
    const float *slot = (const float *)(void *)sd_job_staging_slot(fx->job, r, 0);
    int bad = 0;
    for (uint64_t i = 0; i < fx->job->layout.units[u].numel; i++)
        bad += slot[i] != base + (float)i;
    return bad;
}

static void test_read(void)
{
    struct fixture fx;
    /* one node: the node's shards, replicas alike */
    if (!setup(&fx, "zero3", 1, 2, 0, SD_DTYPE_FP32))
        return;
    struct sd_job *job = fx.job;
    job->state = SD_JOB_READY;
    uint32_t holds[2][2] = {{0}};
    fx.tj.s[0].holds = holds[0];
    fx.tj.s[1].holds = holds[1];
    set_os(&fx, 1, 0, 100.0f);
    set_os(&fx, 1, 1, -5000.0f);
    TH_CHECK(read_unit(&fx, 1, 1, 0, 10) && th_answered(1, 10) >= 0 &&
                 check_read(&fx, 1, 1, 100.0f) == 0 && th_sends.n == 0,
             "read, one node: the unit's masters from both ranks' shards, nothing sent");
    TH_CHECK(read_unit(&fx, 0, 1, 1, 11) && th_answered(0, 11) >= 0 &&
                 check_read(&fx, 0, 1, -5000.0f) == 0,
             "read, one node: the momentum");
    struct sd_sqe st = {
        .op = SD_OP_READ, .unit = 1, .arg0 = (uint64_t)SD_WRITE_STEPS << 32, .tag = 12};
    sd_values_read(job, &fx.tj.s[0], &st, sd_now_ns());
    int a = th_answered(0, 12);
    TH_CHECK(a >= 0 && th_fake.ans[a].v0 == 9, "read: tensor 1's step count");
    read_unit(&fx, 0, 2, 0, 13);
    TH_CHECK(th_fake.fail_status == SD_EINVAL, "read: unit 2 of 2 refused");
    read_unit(&fx, 0, 1, 2, 14);
    TH_CHECK(th_fake.fail_status == SD_EINVAL, "read: SGD's state 2 refused");
    F.step_arrived = 1; /* (rank 1 in the next step: the optimizer waits for rank 0) */
    TH_CHECK(read_unit(&fx, 0, 1, 0, 15) && th_answered(0, 15) >= 0 &&
                 check_read(&fx, 0, 1, 100.0f) == 0,
             "read: rank 0 alone reads while rank 1 waits in the next step");
    F.step_arrived = 0;
    teardown(&fx);

    /* node 0 of 2 (zero3 2x2): node 1's shards pulled */
    for (int fail = 0; fail < 2; fail++) {
        if (!setup(&fx, "zero3", 2, 2, 0, SD_DTYPE_FP32))
            return;
        job = fx.job;
        job->state = SD_JOB_READY;
        job->weights_gen = 4;
        fx.tj.s[0].holds = holds[0];
        fx.tj.s[1].holds = holds[1];
        set_os(&fx, 0, 0, 1.0f);
        TH_CHECK(read_unit(&fx, 0, 0, 0, 20) && th_answered(0, 20) < 0,
                 "read across nodes: waits for node 1");
        TH_CHECK(!read_unit(&fx, 1, 0, 0, 21), "read across nodes: rank 1's read waits for it");
        int t = th_bulk_in_flight();
        const struct sd_unit_layout *ul = &job->layout.units[0];
        uint64_t len = ul->numel / 4;
        float *slot = (float *)(void *)sd_job_staging_slot(job, 0, 0);
        TH_CHECK(th_sends.n == 1 && th_sends.peer == 1 && th_sends.msg.magic == SD_REQ_MAGIC &&
                     th_sends.msg.state == 1 && th_sends.msg.unit == 0 && th_sends.msg.gen == 4 &&
                     th_sends.msg.src == 0 && t >= 0 && !th_bulks.post[t].is_send &&
                     th_bulks.post[t].peer == 1 && th_bulks.post[t].n_pieces == 2 &&
                     th_bulks.pieces[t][0] == slot + 2 * len &&
                     th_bulks.pieces[t][1] == slot + 3 * len &&
                     th_bulk_piece_len(t, 0) == len * sizeof(float),
                 "read across nodes: one request for the masters (state 1) of unit 0 at "
                 "generation 4, one receive of node 1's two shards at their places");
        if (t < 0)
            break;
        for (uint64_t i = 2 * len; i < 4 * len; i++)
            slot[i] = 1.0f + (float)i;
        th_sends.x->cb(th_sends.x, SD_OK);
        th_bulk_complete(t, fail ? SD_ETIMEDOUT : SD_OK);
        a = th_answered(0, 20);
        if (!fail) {
            TH_CHECK(a >= 0 && th_fake.ans[a].status == SD_OK && check_read(&fx, 0, 0, 1.0f) == 0,
                     "read across nodes: answered, the whole unit's masters in the slot");
            TH_CHECK(read_unit(&fx, 1, 0, 0, 21) && th_sends.n == 2 && th_sends.msg.lslot == 2,
                     "read across nodes: then rank 1's read goes, its own number");
        } else {
            TH_CHECK(a >= 0 && th_fake.ans[a].status == SD_EPEER && th_fake.job_fails == 1 &&
                         strstr(th_fake.job_msg, "node 1") != NULL,
                     "read across nodes: a lost transfer answers EPEER and fails the job naming "
                     "node 1 (%s)",
                     th_fake.job_msg);
        }
        teardown(&fx);
    }
}

int main(void)
{
    srand(5);
    test_one_node(SD_DTYPE_FP32);
    test_one_node(SD_DTYPE_BF16);
    test_deferred();
    test_node0();
    test_node1("zero3", false);
    test_node1("zero3", true);
    test_node1("mics:2", false);
    test_node1_fails();
    test_sweep();
    test_write();
    test_read();
    return th_summary("test_loading");
}

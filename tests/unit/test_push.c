/* The push module's logic (daemon/ops/push.c with push_round.c) without a daemon: a job built by
 * hand (plan, layout, the ranks' staging slots and fence pages, their g arenas), the host backend,
 * and fakes of the rest, a fake engine among them: the exchanges and all-reduces a node round
 * starts are recorded, and the test delivers their chunks and completions in the order it chooses
 * (or failed), as test_coll drives the engine with a fake transport. Against references computed
 * here from the definitions, bit for bit:
 *  - one node (zero2, 2 ranks): a round completes when its group's last rank pushed, every g
 *    shard + the rank-order sum of the ranks' gradients over that shard; every pusher answered
 *    with its tag and micro-step; a rank a round ahead of its group stalls; bad slots, sizes, an
 *    unsignalled gradient and a busy slot refused by name; a partly filled round described; a
 *    device behind holds the answers until the loop's poll;
 *  - two nodes (zero2, node 0 of 2): the node partial's other block sent to node 1, this node's
 *    block summed in node order once every chunk of node 1's arrived (chunks in a random order);
 *    two micro-steps' rounds on the wire at once (push_rounds 2), completed last first, applied
 *    and answered in the order they started, held (answers and buffers) while the device is behind
 *    the results they add until the loop's poll; a third waits for a round's buffers; a failed
 *    transfer fails the job naming the node;
 *  - pushes marked the last of the step (SD_PUSH_LAST): a round whose every push carried it
 *    raises SD_JOB_EV_UNIT_FINAL for its unit once reduced, one where a rank did not does not; a
 *    later push of that unit is refused (ESTATE) and fails the job, naming the promise; after
 *    the step's end (SD_JOB_EV_STEP_OVER) the unit takes pushes again;
 *  - four nodes of one rank under topo:1/2/4,no-2hop (reduce-scatter in pairs, then an all-reduce
 * across the replication pair): the all-reduce starts only after the reduce-scatter, with this
 * node's block, and its result is what the g shard gets. */
#include "check.h"
#include "job_fixture.h"
#include "net.h"
#include "push.h"
#include "push_round.h"
#include "quant.h"
#include "session.h"
#include "sd/fence.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_K 2
#define CHUNK 4096u

/* ---- the rest of the daemon, as push sees it (job_fixture.c fakes the common part) */
/* the job's shape as job.c answers it (the same rules, kept here as the test's model) */
bool sd_job_node_rounds(const struct sd_job *job)
{
    return job->nodes > 1 && (job->plan.f[SD_STATE_G] > job->k || !job->plan.two_hop);
}

uint32_t sd_job_push_gens(const struct sd_job *job)
{
    return sd_job_node_rounds(job) ? (uint32_t)job->reg->cfg->push_rounds : 1;
}

/* room for a node round: partial, G blocks, the all-reduce's temporary, slack */
size_t sd_job_net_ar_tmp_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    (void)cfg;
    return job->layout.max_unit_numel + 16;
}

bool sd_job_net_round_buf(const struct sd_job *job)
{
    (void)job;
    return true;
}

size_t sd_job_net_round_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    return 3 * job->layout.max_unit_numel + sd_job_net_ar_tmp_floats(job, cfg) + 4 * 16;
}

bool sd_job_net_rounds_accumulate(const struct sd_job *job)
{
    (void)job;
    return false;
}

int sd_qg_codec(const struct sd_job *job, uint32_t u)
{
    (void)job;
    (void)u;
    return 0;
}

uint8_t *sd_qg_send(struct sd_job *job, uint32_t r, uint32_t o)
{
    (void)job;
    (void)r;
    (void)o;
    return NULL;
}

uint8_t *sd_qg_recv(struct sd_job *job, uint32_t r, uint32_t o)
{
    (void)job;
    (void)r;
    (void)o;
    return NULL;
}

float *sd_qg_ef(struct sd_job *job, uint32_t u, uint32_t i)
{
    (void)job;
    (void)u;
    (void)i;
    return NULL;
}

size_t sd_bulk_chunk_bytes(size_t bytes, uint32_t pieces, size_t chunk_bytes)
{
    (void)bytes;
    (void)pieces;
    return chunk_bytes;
}

void sd_bulk_put(struct sd_bulk_pool *pool, struct sd_bulk *b)
{
    (void)pool;
    (void)b;
}

/* the fake engine */
/* ---- the job */
struct fixture {
    struct th_job tj;
    struct sd_job *job;
    struct sd_mem staging[MAX_K];
    struct sd_mem fence[MAX_K];
    uint32_t fence_count[2 * MAX_K];
    uint32_t members[8];
};

/* two units of 3000 and 5000 fp32 elements under plan on node `node` of nodes x k ranks, three
 * staging slots a rank, push_rounds 2 */
static bool setup(struct fixture *fx, const char *plan, uint32_t nodes, uint32_t k, uint32_t node)
{
    memset(fx, 0, sizeof(*fx));
    th_fake_reset();
    static const uint64_t sizes[2] = {3000, 5000};
    if (!th_job_build(&fx->tj, plan, nodes, k, node, sizes, 2, SD_DTYPE_FP32))
        return false;
    fx->tj.cfg.push_rounds = 2;
    fx->tj.cfg.chunk_bytes = CHUNK;
    struct sd_job *job = fx->job = &fx->tj.job;
    th_job_g_arenas(&fx->tj);
    job->mem.staging = fx->staging;
    job->mem.fence = fx->fence;
    job->mem.fence_count = fx->fence_count;
    job->mem.staging_slots = 3;
    job->mem.staging_slot_bytes = job->layout.max_unit_bytes;
    job->mem.scratch = calloc(job->layout.max_unit_numel, sizeof(float));
    job->xfer.members = fx->members;
    for (uint32_t r = 0; r < k; r++) {
        fx->staging[r].bytes = 3 * job->mem.staging_slot_bytes;
        fx->staging[r].ptr = calloc(1, fx->staging[r].bytes);
        fx->fence[r].bytes = SD_FENCE_BYTES;
        fx->fence[r].ptr = calloc(1, SD_FENCE_BYTES);
    }
    bool ok = sd_push_module.create(job) == SD_OK && sd_push_module.alloc(job) == SD_OK;
    if (ok && nodes > 1) {
        float *mem;
        size_t floats;
        ok = sd_push_net_setup(job, &mem, &floats) == SD_OK;
    }
    TH_CHECK(ok, "the push state for %s on %ux%u", plan, nodes, k);
    return ok;
}

static void teardown(struct fixture *fx)
{
    sd_push_module.destroy(fx->job);
    for (uint32_t r = 0; r < fx->job->k; r++) {
        free(fx->staging[r].ptr);
        free(fx->fence[r].ptr);
    }
    free(fx->job->mem.scratch);
    th_job_free(&fx->tj);
}

static float *g_of(struct fixture *fx, uint32_t r)
{
    return th_job_g(&fx->tj, r);
}

/* a copy of every rank's g arena */
static float *g_copy(struct fixture *fx)
{
    uint64_t n = fx->job->layout.arena_numel[SD_STATE_G];
    float *c = malloc(fx->job->k * n * sizeof(float));
    for (uint32_t r = 0; r < fx->job->k; r++)
        memcpy(c + r * n, g_of(fx, r), n * sizeof(float));
    return c;
}

static float *slot_of(struct fixture *fx, uint32_t r, uint32_t slot)
{
    return (float *)(void *)sd_job_staging_slot(fx->job, r, slot);
}

/* rank r's gradient of unit u (random) into slot, signalled; then the push: its return */
static bool push(struct fixture *fx, uint32_t r, uint32_t u, uint32_t slot, uint64_t tag)
{
    const struct sd_unit_layout *ul = &fx->job->layout.units[u];
    float *g = slot_of(fx, r, slot);
    for (uint64_t i = 0; i < ul->numel; i++)
        g[i] = th_rand_unit() * 4.0f;
    struct sd_fence_page *page = fx->fence[r].ptr;
    page->grad_seq++;
    struct sd_sqe e = {.tag = tag, .unit = u, .arg0 = slot, .arg1 = sd_unit_bytes(ul)};
    return sd_push(fx->job, &fx->tj.s[r], &e);
}

/* rank r's push of unit u from slot, marked last or not */
static bool push_marked(struct fixture *fx, uint32_t r, uint32_t u, uint32_t slot, uint64_t tag,
                        bool last)
{
    const struct sd_unit_layout *ul = &fx->job->layout.units[u];
    struct sd_fence_page *page = fx->fence[r].ptr;
    page->grad_seq++;
    struct sd_sqe e = {
        .tag = tag, .unit = u, .arg0 = slot | (last ? SD_PUSH_LAST : 0), .arg1 = sd_unit_bytes(ul)};
    return sd_push(fx->job, &fx->tj.s[r], &e);
}

static void test_marked_last(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero2", 1, 2, 0))
        return;
    push_marked(&fx, 0, 1, 0, 40, true);
    push_marked(&fx, 1, 1, 0, 41, false);
    TH_CHECK(th_fake.done == 2 && th_fake.events[SD_JOB_EV_UNIT_FINAL] == 0,
             "a round with one push not marked last: reduced, the unit not final (%d)",
             th_fake.events[SD_JOB_EV_UNIT_FINAL]);
    push_marked(&fx, 0, 1, 1, 42, true);
    push_marked(&fx, 1, 1, 1, 43, true);
    TH_CHECK(th_fake.done == 4 && th_fake.events[SD_JOB_EV_UNIT_FINAL] == 1 &&
                 th_fake.last_event_unit == 1,
             "a round every push of which was marked last: unit 1 final (%d events, unit %u)",
             th_fake.events[SD_JOB_EV_UNIT_FINAL], th_fake.last_event_unit);
    struct sd_job_ev over = {.kind = SD_JOB_EV_STEP_OVER, .peer = UINT32_MAX, .unit = UINT32_MAX};
    push_marked(&fx, 0, 1, 0, 44, false);
    TH_CHECK(th_fake.fail_status == SD_ESTATE &&
                 strstr(th_fake.fail_msg, "marked an earlier push") &&
                 strstr(th_fake.fail_msg, "shard_last_micro_step") && th_fake.job_fails == 1 &&
                 th_fake.job_status == SD_ESTATE,
             "a push of a final unit: refused and the job failed: %s / %s", th_fake.fail_msg,
             th_fake.job_msg);
    sd_push_module.event(fx.job, &over);
    int done = th_fake.done;
    push_marked(&fx, 0, 1, 0, 45, false);
    push_marked(&fx, 1, 1, 0, 46, false);
    TH_CHECK(th_fake.done == done + 2, "after the step's end the unit takes pushes again (%d)",
             th_fake.done - done);
    teardown(&fx);
    /* ddp: each rank its own group: the unit is final once both promised; the group that
     * promised is refused a later push while the other still pushes */
    if (!setup(&fx, "ddp", 1, 2, 0))
        return;
    push_marked(&fx, 0, 1, 0, 50, true);
    TH_CHECK(th_fake.events[SD_JOB_EV_UNIT_FINAL] == 0 && th_fake.done == 1,
             "ddp: rank 0's promise alone: not final (%d)", th_fake.events[SD_JOB_EV_UNIT_FINAL]);
    push_marked(&fx, 1, 1, 0, 51, false);
    push_marked(&fx, 1, 1, 1, 52, true);
    TH_CHECK(th_fake.events[SD_JOB_EV_UNIT_FINAL] == 1 && th_fake.job_fails == 0,
             "ddp: rank 1 pushes on, then promises: final (%d)",
             th_fake.events[SD_JOB_EV_UNIT_FINAL]);
    push_marked(&fx, 0, 1, 1, 53, false);
    TH_CHECK(th_fake.job_fails == 1 && strstr(th_fake.fail_msg, "marked an earlier push"),
             "ddp: rank 0 after its promise: refused (%s)", th_fake.fail_msg);
    teardown(&fx);
}

/* ---- one node */
static void test_one_node(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero2", 1, 2, 0))
        return;
    struct sd_job *job = fx.job;
    const struct sd_unit_layout *ul = &job->layout.units[1];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
    float *before = g_copy(&fx);
    uint64_t n = job->layout.arena_numel[SD_STATE_G];
    TH_CHECK(push(&fx, 0, 1, 0, 10) && th_fake.done == 0,
             "rank 0's push of unit 1 waits for rank 1");
    char msg[256];
    TH_CHECK(sd_push_partial_round(job, msg, sizeof(msg)) &&
                 strstr(msg, "unit 1 has gradients from ranks 0 but not"),
             "a partly filled round described: %s", msg);
    TH_CHECK(!push(&fx, 0, 1, 1, 11), "rank 0 a round ahead of rank 1: it stalls");
    TH_CHECK(push(&fx, 1, 1, 0, 20), "rank 1's push");
    TH_CHECK(th_fake.done == 2 && th_answered(0, 10) >= 0 && th_answered(1, 20) >= 0 &&
                 th_fake.ans[0].status == SD_OK && th_fake.ans[0].v0 == 0 && th_fake.ans[1].v0 == 0,
             "both answered, micro-step 0 (%d answers)", th_fake.done);
    uint32_t same = 0;
    for (uint32_t h = 0; h < 2; h++) { /* rank h holds shard h: + (s0 + s1) over it */
        const float *g = g_of(&fx, h) + ul->arena_off[SD_STATE_G];
        const float *b = before + h * n + ul->arena_off[SD_STATE_G];
        uint64_t bad = 0;
        uint32_t i = sd_plan_shard(&job->plan, SD_STATE_G, h);
        for (uint64_t e = 0; e < len; e++) {
            float sum = slot_of(&fx, 0, 0)[i * len + e];
            sum += slot_of(&fx, 1, 0)[i * len + e];
            float want = b[e] + sum;
            bad += memcmp(&want, &g[e], sizeof(float)) != 0;
        }
        same += bad == 0;
    }
    TH_CHECK(same == 2, "each holder's g shard + the rank-order sum, bit for bit (%u of 2)", same);
    /* refusals */
    struct sd_sqe e = {
        .tag = 30, .unit = 0, .arg0 = 9, .arg1 = sd_unit_bytes(&job->layout.units[0])};
    sd_push(job, &fx.tj.s[0], &e);
    TH_CHECK(th_fake.fail_status == SD_EINVAL &&
                 strstr(th_fake.fail_msg, "staging slot 9 does not exist"),
             "a slot that does not exist: %s", th_fake.fail_msg);
    e.arg0 = 0;
    e.arg1 = 12;
    sd_push(job, &fx.tj.s[0], &e);
    TH_CHECK(th_fake.fail_status == SD_EMSGSIZE && strstr(th_fake.fail_msg, "gradient is 12 bytes"),
             "a gradient of the wrong size: %s", th_fake.fail_msg);
    e.arg1 = sd_unit_bytes(&job->layout.units[0]);
    sd_push(job, &fx.tj.s[1], &e); /* rank 1's page counts the one gradient it pushed */
    TH_CHECK(th_fake.fail_status == SD_ESTATE && strstr(th_fake.fail_msg, "was not signalled"),
             "a gradient not signalled on the fence page: %s", th_fake.fail_msg);
    TH_CHECK(push(&fx, 0, 0, 0, 31), "rank 0 pushes unit 0 from slot 0");
    TH_CHECK(push(&fx, 0, 1, 0, 32) && th_fake.fail_status == SD_EBUSY &&
                 strstr(th_fake.fail_msg, "slot 0 still holds an earlier push"),
             "slot 0 again before its push completed: %s", th_fake.fail_msg);
    /* the device behind: answered from the loop's poll */
    th_fake.queue_eagain = 1;
    int before_done = th_fake.done;
    TH_CHECK(push(&fx, 1, 0, 1, 33) && th_fake.done == before_done && !sd_push_idle(job),
             "the round's kernels not done: no answer, not idle");
    TH_CHECK(sd_push_queue_poll(job) && th_fake.done == before_done + 2 && sd_push_idle(job) &&
                 th_fake.events[SD_JOB_EV_PUSHED] >= 1,
             "the loop's poll answers both and raises PUSHED (%d events)",
             th_fake.events[SD_JOB_EV_PUSHED]);
    free(before);
    teardown(&fx);
}

/* deliver node 1's side of exchange x: its block (random, into the receive buffer, kept in
 * *peer_p), every chunk in a random order, then the receive's end with status, then the send's */
static void deliver(struct sd_exchange_param *x, float **peer_p, int status)
{
    size_t floats = x->recv.bytes / sizeof(float);
    float *peer = malloc(x->recv.bytes);
    for (size_t i = 0; i < floats; i++)
        peer[i] = th_rand_unit() * 8.0f;
    memcpy(x->recv.buf, peer, x->recv.bytes);
    *peer_p = peer;
    struct sd_bulk recv = {
        .peer = x->peer, .is_send = false, .bytes = x->recv.bytes, .arg = x->arg, .arg2 = x->arg2};
    struct sd_bulk send = {
        .peer = x->peer, .is_send = true, .bytes = x->send.bytes, .arg = x->arg, .arg2 = x->arg2};
    uint32_t chunks = (uint32_t)((x->recv.bytes + CHUNK - 1) / CHUNK), order[64];
    for (uint32_t c = 0; c < chunks; c++)
        order[c] = c;
    for (uint32_t c = chunks; c > 1; c--) {
        uint32_t j = (uint32_t)rand() % c, t = order[c - 1];
        order[c - 1] = order[j];
        order[j] = t;
    }
    for (uint32_t c = 0; status == SD_OK && x->chunk_cb != NULL && c < chunks; c++) {
        size_t off = (size_t)order[c] * CHUNK;
        x->chunk_cb(&recv, 0, off, SD_MIN((size_t)CHUNK, x->recv.bytes - off));
    }
    x->cb(&recv, status);
    x->cb(&send, SD_OK);
}

/* node 0 of 2 under zero2 (f_g 4: blocks of two shards a node), unit u's micro-steps */
static void test_two_nodes(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero2", 2, 2, 0))
        return;
    struct sd_job *job = fx.job;
    const uint32_t u = 1;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t n = job->layout.arena_numel[SD_STATE_G], block = ul->numel / 2;
    uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
    float *before = g_copy(&fx);
    float part[3][8192]; /* each micro-step's node partial (s0 + s1) of block 0 */
    /* micro-step 0 and 1: both rounds go on the wire */
    for (uint32_t step = 0; step < 2; step++) {
        push(&fx, 0, u, step, 100 + step);
        push(&fx, 1, u, step, 200 + step);
        for (uint64_t i = 0; i < block; i++) {
            part[step][i] = slot_of(&fx, 0, step)[i];
            part[step][i] += slot_of(&fx, 1, step)[i];
        }
    }
    TH_CHECK(th_fake.n_ex == 2 && th_fake.ex[0].peer == 1 && th_fake.ex[1].peer == 1 &&
                 th_fake.done == 0,
             "two rounds on the wire, each exchanging with node 1 (%d), nobody answered",
             th_fake.n_ex);
    uint32_t sent_ok = 0;
    for (uint32_t step = 0; step < 2; step++) { /* block 1 of the partial goes to node 1 */
        const float *sent = th_fake.ex[step].send.buf;
        uint64_t bad = 0;
        for (uint64_t i = 0; i < block; i++) {
            float want = slot_of(&fx, 0, step)[block + i];
            want += slot_of(&fx, 1, step)[block + i];
            bad += memcmp(&want, &sent[i], sizeof(float)) != 0;
        }
        sent_ok += bad == 0 && th_fake.ex[step].send.bytes == block * sizeof(float);
    }
    TH_CHECK(sent_ok == 2, "each round sends block 1 of its node partial (%u of 2)", sent_ok);
    /* unit 0's pushes (slot 2): their round waits for a round's buffers */
    const struct sd_unit_layout *u0 = &job->layout.units[0];
    uint64_t block0 = u0->numel / 2, len0 = u0->numel / job->plan.f[SD_STATE_G];
    push(&fx, 0, 0, 2, 102);
    push(&fx, 1, 0, 2, 202);
    TH_CHECK(th_fake.n_ex == 2, "a third round waits for buffers (%d exchanges)", th_fake.n_ex);
    for (uint64_t i = 0; i < block0; i++) {
        part[2][i] = slot_of(&fx, 0, 2)[i];
        part[2][i] += slot_of(&fx, 1, 2)[i];
    }
    float *peer[3];
    deliver(&th_fake.ex[1], &peer[1], SD_OK);
    TH_CHECK(th_fake.done == 0 && th_fake.n_ex == 2,
             "the later round done first: nothing applied or answered");
    /* the device behind the results the rounds add into the g shards: the pushes and the
     * rounds' buffers wait for the loop's poll, the loop not blocked */
    th_fake.queue_eagain = 1;
    deliver(&th_fake.ex[0], &peer[0], SD_OK);
    TH_CHECK(th_fake.done == 0 && th_fake.n_ex == 2 && !sd_push_idle(job) &&
                 sd_push_queue_waiting(job),
             "the device behind: nothing answered, no round started in the buffers it reads, "
             "the poll wanted (%d answers, %d exchanges)",
             th_fake.done, th_fake.n_ex);
    TH_CHECK(sd_push_queue_poll(job), "the loop's poll retires the rounds");
    TH_CHECK(th_fake.done == 4 && th_fake.ans[0].v0 == 0 && th_fake.ans[2].v0 == 1 &&
                 th_answered(0, 100) == 0 && th_answered(1, 201) >= 2,
             "both answered, micro-step 0 first (%d answers)", th_fake.done);
    TH_CHECK(th_fake.n_ex == 3, "the waiting round started once a round's buffers were free (%d)",
             th_fake.n_ex);
    deliver(&th_fake.ex[2], &peer[2], SD_OK);
    TH_CHECK(th_fake.done == 6 && th_answered(1, 202) >= 0, "unit 0's round answered");
    /* rank j's shard of block 0 (j * len ..): g + (part + peer) per micro-step, in order */
    uint32_t same = 0;
    for (uint32_t j = 0; j < 2; j++) {
        const float *g = g_of(&fx, j) + ul->arena_off[SD_STATE_G];
        const float *b = before + j * n + ul->arena_off[SD_STATE_G];
        const float *g0 = g_of(&fx, j) + u0->arena_off[SD_STATE_G];
        const float *b0 = before + j * n + u0->arena_off[SD_STATE_G];
        uint64_t bad = 0;
        for (uint64_t e = 0; e < len; e++) {
            float want = b[e];
            for (uint32_t step = 0; step < 2; step++) {
                float sum = part[step][j * len + e];
                sum += peer[step][j * len + e];
                want += sum;
            }
            bad += memcmp(&want, &g[e], sizeof(float)) != 0;
        }
        for (uint64_t e = 0; e < len0; e++) {
            float sum = part[2][j * len0 + e];
            sum += peer[2][j * len0 + e];
            float want = b0[e] + sum;
            bad += memcmp(&want, &g0[e], sizeof(float)) != 0;
        }
        same += bad == 0;
    }
    TH_CHECK(same == 2, "each rank's g shards: + the node-order sums, micro-steps in order (%u)",
             same);
    TH_CHECK(sd_push_idle(job) && th_fake.job_fails == 0, "idle, the job fine: %s",
             th_fake.job_msg);
    for (uint32_t i = 0; i < 3; i++)
        free(peer[i]);
    /* a failed transfer */
    push(&fx, 0, 0, 0, 300);
    push(&fx, 1, 0, 0, 400);
    float *p;
    deliver(&th_fake.ex[th_fake.n_ex - 1], &p, SD_EPEER);
    free(p);
    TH_CHECK(th_fake.job_fails == 1 && th_fake.job_status == SD_EPEER &&
                 strstr(th_fake.job_msg, "transfer with node 1 failed") && th_answered(0, 300) < 0,
             "a failed transfer fails the job naming node 1, the push unanswered: %s",
             th_fake.job_msg);
    free(before);
    teardown(&fx);
}

/* four nodes of one rank under topo:1/2/4 without the 2-hop sync, node 2: reduce-scatter with node
 * 3, then the all-reduce across the replication pair */
static void test_allreduce(void)
{
    struct fixture fx;
    if (!setup(&fx, "topo:1/2/4,no-2hop", 4, 1, 2))
        return;
    struct sd_job *job = fx.job;
    TH_CHECK(job->gnodes[SD_STATE_G] == 2 && !job->plan.two_hop,
             "topo:1/2/4,no-2hop on 4x1: g over 2 nodes, no 2-hop");
    const struct sd_unit_layout *ul = &job->layout.units[0];
    uint64_t block = ul->numel / 2, n = job->layout.arena_numel[SD_STATE_G];
    float *before = g_copy(&fx);
    push(&fx, 0, 0, 0, 7);
    TH_CHECK(th_fake.n_ex == 1 && th_fake.ex[0].peer == 3 && th_fake.n_ar == 0,
             "the reduce-scatter with node 3 first, no all-reduce yet (peer %u, %d)",
             th_fake.n_ex ? th_fake.ex[0].peer : 99, th_fake.n_ar);
    float own[8192];
    for (uint64_t i = 0; i < block; i++)
        own[i] = slot_of(&fx, 0, 0)[i]; /* node 2 is block 0 of its pair */
    float *peer;
    deliver(&th_fake.ex[0], &peer, SD_OK);
    TH_CHECK(th_fake.n_ar == 1 && th_fake.ar[0].R == 2 && th_fake.ar[0].count == block &&
                 th_fake.done == 0,
             "then the all-reduce of this node's block across the pair (R %u, %zu floats)",
             th_fake.n_ar ? th_fake.ar[0].R : 0, th_fake.n_ar ? th_fake.ar[0].count : 0);
    if (th_fake.n_ar != 1) {
        free(peer);
        free(before);
        teardown(&fx);
        return;
    }
    uint64_t bad = 0;
    for (uint64_t i = 0; i < block; i++) {
        float want = own[i];
        want += peer[i];
        bad += memcmp(&want, &th_fake.ar[0].buf[i], sizeof(float)) != 0;
    }
    TH_CHECK(bad == 0, "its buffer: this node's block summed in node order (%llu differ)",
             (unsigned long long)bad);
    for (uint64_t i = 0; i < block; i++)
        th_fake.ar[0].buf[i] = (float)i * 0.25f; /* the all-reduce's result */
    th_fake.ar[0].cb(th_fake.ar[0].ar, SD_OK, 0);
    TH_CHECK(th_fake.done == 1 && th_answered(0, 7) == 0, "answered once the all-reduce completed");
    const float *g = g_of(&fx, 0) + ul->arena_off[SD_STATE_G];
    bad = 0;
    for (uint64_t i = 0; i < block; i++) {
        float want = before[ul->arena_off[SD_STATE_G] + i] + (float)i * 0.25f;
        bad += memcmp(&want, &g[i], sizeof(float)) != 0;
    }
    TH_CHECK(bad == 0 && n > 0, "the g shard + the all-reduce's result (%llu differ)",
             (unsigned long long)bad);
    free(peer);
    free(before);
    teardown(&fx);
}

int main(void)
{
    srand(11);
    test_one_node();
    test_marked_last();
    test_two_nodes();
    test_allreduce();
    return th_summary("test_push");
}

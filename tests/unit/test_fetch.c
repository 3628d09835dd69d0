/* Fetch, release and drop, and the other side, serving peers' pull requests (daemon/ops/fetch.c,
 * fetch_serve.c, with the unit cache and the slot pool) without a daemon: the modules linked
 * alone with the host backend, a job built by hand (plan, layout, each rank's w arena holding
 * values the test knows, the gather pool, the ranks' control pages and holds) and fakes of the
 * rest (the frozen schedule, the secondary copy and ,qw are off); the transfers it starts are
 * recorded, and the test completes them (writing what the peer would send, or failed). Checked
 * against the unit's values, element by element (each rank's w shard from the definition: unit
 * i cut into f equal pieces, rank r holds piece r mod f):
 *  - one node (zero3, 4 ranks; fp32 and bf16): a fetch is answered at once with the slot
 *    (offset, bytes), which holds the whole unit; another rank's fetch is a cache hit of the same
 *    slot; each answer counted on the rank's fence page; a release of a unit the rank does not
 *    hold (ENOTHELD) or with unknown flags (EINVAL) refused; after a step (a new weights
 *    generation) the fetch gathers the new values; a pool too small: the fetch waits while
 *    another rank holds the space, and is refused naming max_live_bytes when the caller itself
 *    holds it; a dropped copy is gathered again; a rank that leaves gives back what it held;
 *  - node 0 of 2 (zero3, 2 x 2, hierarchical): a fetch sends node 1 one pull request (its unit,
 *    weights generation, this node, the magic) and posts one receive of node 1's block (its 2
 *    ranks' shards, at their places in the slot) while this node's block is copied; the other
 *    local rank's fetch joins the gather; both are answered once the request was sent and the
 *    block arrived, with the whole unit in the slot; a block that does not arrive fails the job
 *    naming node 1, and the waiting ranks are answered with the failure;
 *  - serving (node 0 of 2): a peer's request of this generation is answered with this node's
 *    block (its ranks' shards, in rank order); one of the next generation waits and is served
 *    once the weights reach it; one of an older generation, of a unit or node out of range, or
 *    from this node itself is dropped (nothing sent, nothing queued), but one of the generation
 *    before weights written here (its requester drops the copy). */
#include "check.h"
#include "bulk_fake.h"
#include "job_fixture.h"
#include "fetch.h"
#include "net.h"
#include "pull.h"
#include "quant.h"
#include "schedule.h"
#include "secondary.h"
#include "session.h"
#include "unit_cache.h"
#include "sd/fence.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_K 4

/* ---- the rest of the daemon, as fetch sees it: the schedule not frozen, no secondary copy,
 * no ,qw; the transport's sends recorded */
static struct {
    int prefetches;
} F;

int sd_sched_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p)
{
    (void)job;
    (void)bytes;
    (void)off_p;
    return SD_ENOENT;
}

uint64_t sd_sched_issue_clock(const struct sd_job *job)
{
    (void)job;
    return 0;
}

void sd_sched_issue_count(struct sd_job *job, uint64_t cpu0)
{
    (void)job;
    (void)cpu0;
}

bool sd_sched_answer_begin(const struct sd_job *job, uint64_t *cpu0_p)
{
    (void)job;
    (void)cpu0_p;
    return false;
}

void sd_sched_answer_end(struct sd_job *job, uint64_t cpu0)
{
    (void)job;
    (void)cpu0;
}

void sd_sched_prefetch(struct sd_job *job)
{
    (void)job;
    F.prefetches++;
}

bool sd_sec_ready(const struct sd_job *job, const struct sd_unit_state *us)
{
    (void)job;
    (void)us;
    return false;
}

bool sd_sec_keep(struct sd_job *job, struct sd_unit_state *us)
{
    (void)job;
    (void)us;
    return false;
}

void sd_sec_load(struct sd_job *job, struct sd_unit_state *us)
{
    (void)job;
    (void)us;
}

bool sd_qw_rx_enabled(const struct sd_job *job)
{
    (void)job;
    return false;
}

bool sd_qw_rx_available(const struct sd_job *job)
{
    (void)job;
    return true;
}

bool sd_qw_rx_waiting(const struct sd_job *job)
{
    (void)job;
    return false;
}

bool sd_qw_rx_poll(struct sd_job *job)
{
    (void)job;
    return false;
}

bool sd_qw_rx_fits(const struct sd_job *job, uint64_t bytes)
{
    (void)job;
    (void)bytes;
    return true;
}

uint64_t sd_qw_remote_bytes(const struct sd_job *job, uint32_t u)
{
    (void)job;
    (void)u;
    return 0;
}

/* (never asked for: ,qw is off) */
int sd_qw_rx_take(struct sd_job *job)
{
    (void)job;
    return -1;
}

uint8_t *sd_qw_rx(struct sd_job *job, int slot)
{
    (void)job;
    (void)slot;
    return NULL;
}

void sd_qw_rx_put(struct sd_job *job, int slot)
{
    (void)job;
    (void)slot;
}

void sd_qw_rx_put_after(struct sd_job *job, int slot, uint64_t ticket)
{
    (void)job;
    (void)slot;
    (void)ticket;
}

uint8_t *sd_qw_shard(struct sd_job *job, uint32_t local, uint32_t u, bool *fresh_p)
{
    (void)job;
    (void)local;
    (void)u;
    (void)fresh_p;
    return NULL;
}

uint64_t sd_qw_shard_bytes(const struct sd_job *job, uint32_t u)
{
    (void)job;
    (void)u;
    return 0;
}

/* (the os arenas' registration of a peer's read: nothing to register without a fabric) */
int sd_job_net_reg_os(struct sd_job *job)
{
    (void)job;
    return SD_OK;
}

void sd_job_pool_publish(struct sd_job *job, uint64_t off, uint64_t bytes)
{
    (void)job;
    (void)off;
    (void)bytes;
}

/* ---- the job */
struct fixture {
    struct th_job tj;
    struct sd_job *job;
    struct sd_transport tp;
    struct sd_mem control[MAX_K];
    struct sd_session *ranks[MAX_K];
    uint32_t holds[MAX_K][2];
    uint32_t node_ids[4];
    struct sd_req_msg req_queue[16];
};

static const uint64_t sizes[2] = {3000, 5000};

/* element i of unit u in weights generation gen */
static float value(uint32_t u, uint64_t i, uint64_t gen)
{
    return (float)(u + 1) * 1000.0f + (float)i * 0.0137f + (float)gen + 1.0f / 3.0f;
}

/* element i of unit u as the weights hold it (its dtype) into out */
static void put_value(const struct sd_unit_layout *ul, uint8_t *out, uint64_t i, float v)
{
    if (ul->dtype == SD_DTYPE_BF16) {
        uint16_t h = th_bf16(v);
        memcpy(out + 2 * i, &h, 2);
    } else {
        memcpy(out + 4 * i, &v, 4);
    }
}

/* [b, e) of unit ul that global rank holds of w, from the definition */
static void w_range(const struct sd_job *job, const struct sd_unit_layout *ul, uint32_t rank,
                    uint64_t *b, uint64_t *e)
{
    uint64_t len = ul->numel / job->plan.f[SD_STATE_W];
    *b = (rank % job->plan.f[SD_STATE_W]) * len;
    *e = *b + len;
}

/* every local rank's w shards hold generation gen's values */
static void fill_weights(struct fixture *fx, uint64_t gen)
{
    struct sd_job *job = fx->job;
    for (uint32_t u = 0; u < job->layout.n_units; u++) {
        const struct sd_unit_layout *ul = &job->layout.units[u];
        for (uint32_t r = 0; r < job->k; r++) {
            uint64_t b, e;
            w_range(job, ul, job->first_rank + r, &b, &e);
            for (uint64_t i = b; i < e; i++)
                put_value(ul, sd_job_w_shard(job, r, u), i - b, value(u, i, gen));
        }
    }
}

/* elements of unit u in the pool at off that differ from generation gen's values */
static int check_slot(struct fixture *fx, uint32_t u, uint64_t off, uint64_t gen)
{
    const struct sd_unit_layout *ul = &fx->job->layout.units[u];
    const uint8_t *slot = (const uint8_t *)fx->job->mem.pool.ptr + off;
    size_t es = ul->dtype == SD_DTYPE_BF16 ? 2 : 4;
    uint8_t want[4];
    int bad = 0;
    for (uint64_t i = 0; i < ul->numel; i++) {
        put_value(ul, want, 0, value(u, i, gen));
        bad += memcmp(slot + es * i, want, es) != 0;
    }
    return bad;
}

/* pool: bytes of the gather pool (0: room for every unit; 1: for the larger unit only) */
static bool setup(struct fixture *fx, const char *plan, uint32_t nodes, uint32_t k, uint32_t node,
                  int dtype, uint64_t pool)
{
    memset(fx, 0, sizeof(*fx));
    memset(&F, 0, sizeof(F));
    th_fake_reset();
    th_bulks_reset();
    if (!th_job_build(&fx->tj, plan, nodes, k, node, sizes, 2, dtype))
        return false;
    struct sd_job *job = fx->job = &fx->tj.job;
    th_job_state_arenas(&fx->tj);
    fx->tj.cfg.chunk_bytes = 1 << 20;
    fx->tj.cfg.coalesce_bytes = 0;
    job->weights_gen = 1;
    job->slots_per_unit = job->gnodes[SD_STATE_W] > 1 && !job->plan.hierarchical ? k : 1;
    job->n_slots = job->layout.n_units * job->slots_per_unit;
    if (pool == 0)
        pool = job->layout.total_bytes * job->slots_per_unit + 4096;
    else if (pool == 1) /* room for the larger unit, not for both */
        pool = sd_unit_bytes(&job->layout.units[1]) + 64;
    TH_CHECK(sd_unit_cache_init(&job->cache, job->layout.n_units, job->slots_per_unit, pool) ==
                 SD_OK,
             "the unit cache");
    job->mem.pool.bytes = pool;
    job->mem.pool.ptr = calloc(1, pool);
    uint32_t Gw = job->gnodes[SD_STATE_W];
    for (uint32_t i = 0; i < job->n_slots; i++) {
        job->cache.units[i].job = job;
        job->cache.units[i].rb = calloc(Gw, sizeof(*job->cache.units[i].rb));
        job->cache.units[i].req_x = calloc(Gw, sizeof(*job->cache.units[i].req_x));
    }
    job->mem.fence = fx->control;
    job->mem.fence_count = calloc(2 * (size_t)k, sizeof(*job->mem.fence_count));
    job->xfer.wait_tags = calloc((size_t)job->n_slots * k, sizeof(*job->xfer.wait_tags));
    job->xfer.answer_q = calloc(job->n_slots, sizeof(*job->xfer.answer_q));
    job->xfer.rel_pending = calloc((size_t)job->n_slots * k, sizeof(*job->xfer.rel_pending));
    job->xfer.rel_need = calloc((size_t)job->n_slots * k, sizeof(*job->xfer.rel_need));
    job->xfer.bulks.n = TH_MAX_BULKS;
    job->xfer.tag = 3;
    job->xfer.node_ids = fx->node_ids;
    job->xfer.req_queue = fx->req_queue;
    job->xfer.req_cap = sizeof(fx->req_queue) / sizeof(fx->req_queue[0]);
    fx->tp = (struct sd_transport){.ops = &th_send_ops, .n_peers = nodes, .self = node};
    job->xfer.tp = &fx->tp;
    job->ranks = fx->ranks;
    for (uint32_t r = 0; r < k; r++) {
        fx->control[r].bytes = 4096;
        fx->control[r].ptr = calloc(1, 4096);
        fx->tj.s[r].holds = fx->holds[r];
        fx->ranks[r] = &fx->tj.s[r];
    }
    fill_weights(fx, 1);
    return true;
}

static void teardown(struct fixture *fx)
{
    struct sd_job *job = fx->job;
    for (uint32_t i = 0; i < job->n_slots; i++) {
        free(job->cache.units[i].rb);
        free(job->cache.units[i].req_x);
    }
    sd_unit_cache_fini(&job->cache);
    sd_slot_pool_fini(&job->cache.spool);
    free(job->mem.pool.ptr);
    free(job->mem.fence_count);
    free(job->xfer.wait_tags);
    free(job->xfer.answer_q);
    free(job->xfer.rel_pending);
    free(job->xfer.rel_need);
    for (uint32_t r = 0; r < job->k; r++)
        free(fx->control[r].ptr);
    th_job_free(&fx->tj);
}

static bool fetch(struct fixture *fx, uint32_t r, uint32_t unit, uint64_t tag)
{
    struct sd_sqe e = {.op = SD_OP_FETCH, .unit = unit, .tag = tag};
    return sd_fetch(fx->job, &fx->tj.s[r], &e, sd_now_ns());
}

static void release(struct fixture *fx, uint32_t r, uint32_t unit, uint64_t flags, uint64_t tag)
{
    struct sd_sqe e = {.op = SD_OP_RELEASE, .unit = unit, .arg0 = flags, .tag = tag};
    sd_fetch_release(fx->job, &fx->tj.s[r], &e, sd_now_ns());
}

/* rank r's answer to tag: SD_OK with the slot's offset in *off_p, else its status (-1: none) */
static int answer(uint32_t r, uint64_t tag, uint64_t *off_p)
{
    int i = th_answered(r, tag);
    if (i < 0)
        return -1;
    if (off_p != NULL)
        *off_p = th_fake.ans[i].v0;
    return th_fake.ans[i].status;
}

static uint32_t gathers_counted(struct fixture *fx, uint32_t r)
{
    return ((const struct sd_fence_page *)fx->control[r].ptr)->gather_seq;
}

/* ---- one node */
static void test_one_node(int dtype)
{
    const char *dt = dtype == SD_DTYPE_BF16 ? "bf16" : "fp32";
    struct fixture fx;
    if (!setup(&fx, "zero3", 1, 4, 0, dtype, 0))
        return;
    struct sd_job *job = fx.job;
    uint64_t off = 0, off2 = 1;
    TH_CHECK(fetch(&fx, 0, 1, 10) && answer(0, 10, &off) == SD_OK,
             "%s: rank 0's fetch of unit 1 answered at once", dt);
    int i = th_answered(0, 10);
    TH_CHECK(i >= 0 && th_fake.ans[i].v1 == sd_unit_bytes(&job->layout.units[1]),
             "%s: with the unit's bytes", dt);
    int bad = check_slot(&fx, 1, off, 1);
    TH_CHECK(bad == 0, "%s: the slot holds the whole unit, every rank's shard in place (%d differ)",
             dt, bad);
    TH_CHECK(fetch(&fx, 2, 1, 12) && answer(2, 12, &off2) == SD_OK && off2 == off &&
                 job->stats.cache_hits == 1,
             "%s: rank 2's fetch is a cache hit of the same slot", dt);
    TH_CHECK(fx.holds[0][1] == 1 && fx.holds[2][1] == 1 && gathers_counted(&fx, 0) == 1 &&
                 gathers_counted(&fx, 2) == 1 && gathers_counted(&fx, 1) == 0,
             "%s: each answer held and counted on its rank's fence page", dt);

    release(&fx, 1, 1, 0, 20);
    TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_ENOTHELD &&
                 strstr(th_fake.fail_msg, "does not hold") != NULL,
             "%s: a release of a unit rank 1 does not hold refused (%d: %s)", dt,
             th_fake.fail_status, th_fake.fail_msg);
    release(&fx, 0, 1, 0x40, 21);
    TH_CHECK(th_fake.fails == 2 && th_fake.fail_status == SD_EINVAL && fx.holds[0][1] == 1,
             "%s: a release with unknown flags refused, the hold kept", dt);
    release(&fx, 0, 1, 0, 22);
    release(&fx, 2, 1, 0, 23);
    TH_CHECK(th_fake.op_done == 2 && fx.holds[0][1] == 0 && fx.holds[2][1] == 0 &&
                 answer(0, 22, NULL) == SD_OK,
             "%s: the releases answered, the holds gone", dt);

    /* a step: the next fetch gathers the new generation */
    job->weights_gen = 2;
    fill_weights(&fx, 2);
    TH_CHECK(fetch(&fx, 3, 1, 30) && answer(3, 30, &off) == SD_OK &&
                 check_slot(&fx, 1, off, 2) == 0,
             "%s: after a step the fetch gathers the new weights", dt);
    release(&fx, 3, 1, 0, 31);

    /* a rank that leaves gives back its holds */
    TH_CHECK(fetch(&fx, 1, 0, 40) && answer(1, 40, NULL) == SD_OK && fx.holds[1][0] == 1,
             "%s: rank 1 holds unit 0", dt);
    sd_fetch_release_holds(job, &fx.tj.s[1]);
    TH_CHECK(fx.holds[1][0] == 0 && !sd_unit_cache_others_hold(&job->cache, fx.holds[0]),
             "%s: after it left nobody holds anything", dt);

    /* a dropped copy is gathered again */
    uint32_t gathers = (uint32_t)job->stats.gathers;
    struct sd_sqe e = {.op = SD_OP_DROP, .unit = 0, .tag = 50};
    sd_fetch_drop(job, &fx.tj.s[0], &e, sd_now_ns());
    TH_CHECK(fetch(&fx, 0, 0, 51) && answer(0, 51, &off) == SD_OK &&
                 job->stats.gathers == gathers + 1 && check_slot(&fx, 0, off, 2) == 0,
             "%s: a dropped copy gathered again", dt);
    teardown(&fx);
}

/* a pool with room for the larger unit only */
static void test_pool_full(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 1, 2, 0, SD_DTYPE_FP32, 1))
        return;
    struct sd_job *job = fx.job;
    uint64_t off;
    TH_CHECK(fetch(&fx, 1, 1, 10) && answer(1, 10, &off) == SD_OK, "pool: rank 1 holds unit 1");
    TH_CHECK(!fetch(&fx, 0, 0, 11) && answer(0, 11, NULL) < 0 && th_fake.fails == 0,
             "pool: rank 0's fetch of unit 0 waits while rank 1 holds the space");
    release(&fx, 1, 1, 0, 12);
    TH_CHECK(fetch(&fx, 0, 0, 11) && answer(0, 11, &off) == SD_OK &&
                 check_slot(&fx, 0, off, 1) == 0,
             "pool: once released, the fetch evicts the copy nobody holds and gathers");
    TH_CHECK(job->cache.evictions == 1, "pool: one eviction counted");
    TH_CHECK(fetch(&fx, 0, 1, 13) && th_fake.fails == 1 && th_fake.fail_status == SD_ENOSPC &&
                 strstr(th_fake.fail_msg, "max_live_bytes") != NULL,
             "pool: the caller holding the space itself is refused naming max_live_bytes (%s)",
             th_fake.fail_msg);
    teardown(&fx);
}

/* ---- across nodes */
static void test_gather_remote(bool fail)
{
    const char *how = fail ? "a lost block" : "node 0 of 2";
    struct fixture fx;
    if (!setup(&fx, "zero3", 2, 2, 0, SD_DTYPE_FP32, 0))
        return;
    struct sd_job *job = fx.job;
    const struct sd_unit_layout *ul = &job->layout.units[1];
    TH_CHECK(job->gnodes[SD_STATE_W] == 2 && job->plan.hierarchical && job->slots_per_unit == 1,
             "%s: zero3 on 2x2 gathers across the 2 nodes, hierarchically", how);
    TH_CHECK(fetch(&fx, 0, 1, 10) && answer(0, 10, NULL) < 0, "%s: the fetch waits for node 1",
             how);
    TH_CHECK(th_sends.n == 1 && th_sends.peer == 1 && th_sends.msg.magic == SD_REQ_MAGIC &&
                 th_sends.msg.unit == 1 && th_sends.msg.gen == 1 && th_sends.msg.src == 0 &&
                 th_sends.msg.job_tag == job->xfer.tag && th_sends.msg.n_units == 1,
             "%s: one pull request to node 1 naming the unit, the generation and this node", how);
    int t = th_bulk_in_flight();
    struct sd_unit_state *us = sd_unit_cache_slot(&job->cache, 1, 0);
    uint8_t *slot = (uint8_t *)job->mem.pool.ptr + us->pool_off;
    size_t len = ul->numel / 4 * sizeof(float);
    TH_CHECK(t >= 0 && !th_bulks.post[t].is_send && th_bulks.post[t].peer == 1 &&
                 th_bulks.post[t].n_pieces == 2 && th_bulks.pieces[t][0] == slot + 2 * len &&
                 th_bulks.pieces[t][1] == slot + 3 * len && th_bulk_piece_len(t, 0) == len,
             "%s: one receive of node 1's block: its 2 ranks' shards at their places", how);
    TH_CHECK(fetch(&fx, 1, 1, 11) && answer(1, 11, NULL) < 0 && th_sends.n == 1 &&
                 th_bulks.posted == 1,
             "%s: rank 1's fetch joins the gather (no second request)", how);
    if (t < 0) {
        teardown(&fx);
        return;
    }
    /* what node 1 sends: its ranks' shards of generation 1 */
    for (uint32_t q = 0; q < 2; q++) {
        uint64_t b, e;
        w_range(job, ul, 2 + q, &b, &e);
        float *p = th_bulks.pieces[t][q];
        for (uint64_t i = b; i < e; i++)
            p[i - b] = value(1, i, 1);
    }
    th_sends.x->cb(th_sends.x, SD_OK);
    TH_CHECK(answer(0, 10, NULL) < 0, "%s: the request sent, the block not here: no answer", how);
    th_bulk_complete(t, fail ? SD_ETIMEDOUT : SD_OK);
    if (!fail) {
        uint64_t o0 = 1, o1 = 2;
        TH_CHECK(answer(0, 10, &o0) == SD_OK && answer(1, 11, &o1) == SD_OK && o0 == o1,
                 "%s: both ranks answered with the one slot", how);
        int bad = check_slot(&fx, 1, o0, 1);
        TH_CHECK(bad == 0, "%s: the slot holds the whole unit, both nodes' blocks (%d differ)", how,
                 bad);
        TH_CHECK(job->stats.bytes[SD_OP_FETCH][SD_LINK_INTER_RECV] == 2 * len &&
                     job->xfer.gathers_inflight == 0,
                 "%s: the bytes received counted, no gather in flight", how);
    } else {
        TH_CHECK(th_fake.job_fails == 1 && th_fake.job_status == SD_EPEER &&
                     strstr(th_fake.job_msg, "node 1") != NULL &&
                     strstr(th_fake.job_msg, "unit 1") != NULL,
                 "%s: the job fails naming the unit and node 1 (%s)", how, th_fake.job_msg);
        sd_fetch_module.fail_parked(job, SD_EPEER, th_fake.job_msg, true);
        TH_CHECK(answer(0, 10, NULL) == SD_EPEER && answer(1, 11, NULL) == SD_EPEER,
                 "%s: both waiting ranks answered with the failure", how);
    }
    teardown(&fx);
}

/* ---- serving a peer's pull requests */
static void test_serve(void)
{
    struct fixture fx;
    if (!setup(&fx, "zero3", 2, 2, 0, SD_DTYPE_FP32, 0))
        return;
    struct sd_job *job = fx.job;
    job->state = SD_JOB_READY;
    struct sd_req_msg m = {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 1, .unit = 0, .gen = 1};
    sd_fetch_on_request(job, &m);
    int t = th_bulk_in_flight();
    const struct sd_unit_layout *ul = &job->layout.units[0];
    size_t len = ul->numel / 4 * sizeof(float);
    TH_CHECK(
        t >= 0 && th_bulks.post[t].is_send && th_bulks.post[t].peer == 1 &&
            th_bulks.post[t].n_pieces == 2 && th_bulks.pieces[t][0] == sd_job_w_shard(job, 0, 0) &&
            th_bulks.pieces[t][1] == sd_job_w_shard(job, 1, 0) && th_bulk_piece_len(t, 1) == len,
        "serve: node 1's request answered with this node's block, its ranks' shards in order");
    if (t >= 0)
        th_bulk_complete(t, SD_OK);
    TH_CHECK(job->stats.bytes[SD_OP_FETCH][SD_LINK_INTER_SENT] == 2 * len &&
                 job->xfer.w_sends_inflight == 0,
             "serve: the bytes sent counted");

    /* the next generation waits for the weights */
    m.gen = 2;
    m.unit = 1;
    sd_fetch_on_request(job, &m);
    TH_CHECK(th_bulks.posted == 1 && job->xfer.req_queued == 1,
             "serve: a request of the next generation is queued, nothing sent");
    job->weights_gen = 2;
    sd_fetch_serve_queue(job);
    t = th_bulk_in_flight();
    TH_CHECK(t >= 0 && job->xfer.req_queued == 0 &&
                 th_bulks.pieces[t][0] == sd_job_w_shard(job, 0, 1),
             "serve: once the weights reach it, it is served");
    if (t >= 0)
        th_bulk_complete(t, SD_OK);

    /* dropped: an older generation, units or nodes out of range, this node itself */
    struct sd_req_msg bad[] = {
        {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 1, .unit = 0, .gen = 1},
        {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 1, .unit = 2, .gen = 2},
        {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 1, .unit = 1, .gen = 2, .n_units = 2},
        {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 2, .unit = 0, .gen = 2},
        {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 0, .unit = 0, .gen = 2},
        {.magic = SD_REQ_MAGIC, .job_tag = 3, .src = 1, .unit = 0, .gen = 2, .lslot = 1},
    };
    const char *what[] = {"an older generation", "unit 2 of 2", "units 1..2 of 2",
                          "node 2 of 2",         "this node",   "copy 1 of 1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int posted = th_bulks.posted;
        sd_fetch_on_request(job, &bad[i]);
        TH_CHECK(th_bulks.posted == posted && job->xfer.req_queued == 0,
                 "serve: a request of %s dropped (nothing sent or queued)", what[i]);
    }
    /* the generation before weights written here (loading.c): served, with the written ones */
    job->xfer.pre_write_gen1 = 2;
    sd_fetch_on_request(job, &bad[0]);
    int t2 = th_bulk_in_flight();
    TH_CHECK(t2 >= 0 && th_bulks.pieces[t2][0] == sd_job_w_shard(job, 0, 0),
             "serve: a request of the generation before a write is served");
    if (t2 >= 0)
        th_bulk_complete(t2, SD_OK);
    teardown(&fx);
}

int main(void)
{
    srand(7);
    test_one_node(SD_DTYPE_FP32);
    test_one_node(SD_DTYPE_BF16);
    test_pool_full();
    test_gather_remote(false);
    test_gather_remote(true);
    test_serve();
    return th_summary("test_fetch");
}

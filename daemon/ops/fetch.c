/* Fetch: a unit's weights gathered into a slot of the gather pool (DESIGN.md section 3, step
 * 2), release and drop; and the other side, serving peers' pull requests.
 *
 * Within a node the gather copies the partition group's w shards into the slot. When the
 * partition group of state w spans G nodes, a node pulls each remote node's block of the unit
 * (the shards of that node's k ranks, contiguous in the unit) once and places it in the slot its
 * local ranks share (hierarchical: (p - k) / p * S bytes per node); without the hierarchy every
 * local rank pulls for itself into its own slot. Gathers the frozen schedule issues for small
 * consecutive units leave as one transfer per peer. The other side, answering peers' pull
 * requests, is fetch_serve.c's. */
#include "schedule.h"
#include "net.h"
#include "job_module.h"
#include "fetch.h"
#include "quant.h"
#include "secondary.h"
#include "session.h"
#include "sd/fence.h"
#include "sd/codec.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void gather_copy_local(struct sd_job *job, struct sd_unit_state *const *units, uint32_t n);
static bool gather_resources(const struct sd_job *job);
static void gather_begin(struct sd_job *job, struct sd_unit_state *us);
static void gather_post(struct sd_job *job, struct sd_unit_state *const *units, uint32_t n);

/* slot us was written: onto the pool's copies on the job's other GPUs (once a fill) */
static void publish(struct sd_job *job, struct sd_unit_state *us)
{
    if (job->mem.n_pool_copies == 0 || us->published)
        return;
    us->published = true;
    sd_job_pool_publish(job, us->pool_off, sd_unit_bytes(&job->layout.units[us->unit]));
}

/* A gather inside the node, done when this returns (one node: the whole gather): a refresh of a
 * held copy, or the schedule's prefetch. From the secondary copy when it holds this weights
 * generation, else within the w group, refilling the secondary copy. */
void sd_fetch_local_gather(struct sd_job *job, struct sd_unit_state *us)
{
    uint64_t cpu0 = sd_sched_issue_clock(job);
    us->published = false;
    if (sd_sec_ready(job, us)) {
        sd_sec_load(job, us);
    } else {
        gather_copy_local(job, &us, 1);
        sd_sec_keep(job, us);
    }
    publish(job, us);
    job->stats.gathers++;
    sd_sched_issue_count(job, cpu0);
}

/* Fill slot us (pool place set) from the node's secondary copy, which holds this generation:
 * a copy inside the node, complete when this returns. */
static void gather_from_sec(struct sd_job *job, struct sd_unit_state *us)
{
    uint64_t cpu0 = sd_sched_issue_clock(job);
    gather_begin(job, us);
    sd_sec_load(job, us);
    us->inflight = false;
    us->resident = true;
    job->stats.gathers++;
    sd_sched_issue_count(job, cpu0);
    sd_fetch_complete(job, us);
}

/* Room in the pool: the frozen schedule's place, else the cache's, evicting cached copies nobody
 * holds (least recently released first). */
int sd_fetch_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p)
{
    int planned = sd_sched_reserve(job, bytes, off_p); /* the frozen schedule's place */
    if (planned != SD_ENOENT)
        return planned;
    return sd_unit_cache_reserve(&job->cache, bytes, SD_CACHELINE, off_p);
}

static void answer_waiters(struct sd_job *job, struct sd_unit_state *us, int synced);

/* A gather finished (or failed): answer every rank waiting for it, once the device wrote the
 * slot (the clients read it from then on; read_out: the device also reads it, waiters or not). The
 * job's queue is not waited for on the loop (DESIGN.md 7b): where it has not reached the slot's
 * kernels yet (a device at work), the unit stays in flight, later fetches join its waiters, and the
 * loop's poll (sd_fetch_queue_poll) answers them all, in order. The host backends are there at
 * once. */
static void fetch_complete(struct sd_job *job, struct sd_unit_state *us, bool read_out)
{
    int synced = SD_OK;
    if (us->status == SD_OK)
        publish(job, us);
    if (us->status == SD_OK && (us->waiters || read_out)) {
        if (us->answer_pending)
            return; /* answered with the others once the device wrote the slot */
        uint64_t ticket = 0;
        synced = sd_job_queue_mark(job, job->xfer.aq_len > 0, &ticket);
        if (synced == SD_EAGAIN) {
            us->answer_pending = true;
            us->inflight = true;
            us->ready_ticket = ticket;
            struct sd_job_xfer *x = &job->xfer;
            x->answer_q[(x->aq_head + x->aq_len++) % job->n_slots] = us;
            return;
        }
        us->status = synced;
    }
    answer_waiters(job, us, synced);
}

void sd_fetch_complete(struct sd_job *job, struct sd_unit_state *us)
{
    fetch_complete(job, us, false);
}

/* the oldest unit waiting for the device, out of the queue and answered with status (synced:
 * what the device said, SD_OK where the job failed already) */
static void answer_oldest(struct sd_job *job, int status, int synced)
{
    struct sd_job_xfer *x = &job->xfer;
    struct sd_unit_state *us = x->answer_q[x->aq_head];
    x->aq_head = (x->aq_head + 1) % job->n_slots;
    x->aq_len--;
    us->answer_pending = false;
    us->inflight = false;
    us->status = status;
    answer_waiters(job, us, synced);
}

bool sd_fetch_queue_poll(struct sd_job *job)
{
    struct sd_job_xfer *x = &job->xfer;
    bool moved = false;
    if (x->enc_wait) { /* ,qw encodings for peers' requests: served once the device wrote them */
        int st = job->state == SD_JOB_FAILED ? SD_OK
                                             : job->reg->dev->query(job->mem.queue, x->enc_ticket);
        if (st != SD_EAGAIN) {
            x->enc_wait = false;
            moved = true;
            if (st != SD_OK)
                sd_job_backend_failed(job, st);
            else
                sd_fetch_serve_queue(job);
        }
    }
    while (x->aq_len > 0 && job->state != SD_JOB_FAILED) {
        int st = job->reg->dev->query(job->mem.queue, x->answer_q[x->aq_head]->ready_ticket);
        if (st == SD_EAGAIN)
            break;
        answer_oldest(job, st, st);
        moved = true;
    }
    if (moved)
        sd_job_event(job, SD_JOB_EV_ANSWERED);
    /* ,qw receive slots whose decodes the device passed: gathers that waited for one go on */
    if (sd_qw_rx_waiting(job) && sd_qw_rx_poll(job)) {
        moved = true;
        if (job->state != SD_JOB_FAILED && !sd_job_event(job, SD_JOB_EV_TRANSFERS))
            sd_sched_prefetch(job);
    }
    return moved;
}

bool sd_fetch_queue_waiting(const struct sd_job *job)
{
    return job->xfer.aq_len > 0 || job->xfer.enc_wait || sd_qw_rx_waiting(job);
}

/* the loop polls for the module also while a gather waits for a place that a signalled release
 * still holds (the step does not wait for that: it asks sd_fetch_queue_waiting, not this) */
static bool fetch_loop_waiting(const struct sd_job *job)
{
    return sd_fetch_queue_waiting(job) || (job->xfer.rel_blocked && job->xfer.rel_total > 0);
}

static bool fetch_loop_poll(struct sd_job *job)
{
    bool moved = sd_fetch_queue_poll(job);
    if (job->xfer.rel_blocked && sd_fetch_fenced_poll(job)) {
        /* what waited tries again, and says so again if it still waits (a stalled fetch is
         * retried by its session's progress): no polling for holds nothing waits for */
        moved = true;
        job->xfer.rel_blocked = false;
        if (job->state == SD_JOB_READY)
            sd_sched_prefetch(job);
    }
    return moved;
}

/* ---- releases a trainer's stream signals later (sd/fence.h, release_seq) */

/* Rank r's holds whose releases its page counts now are let go; all: every one of them (its
 * trainer is gone) */
static bool fenced_let_go(struct sd_job *job, uint32_t r, bool all)
{
    struct sd_job_xfer *x = &job->xfer;
    const struct sd_fence_page *page = job->mem.fence[r].ptr;
    uint32_t seen = sd_fence_load(&page->release_seq);
    bool any = false;
    for (uint32_t i = 0; i < job->n_slots && x->rel_total > 0; i++) {
        size_t at = (size_t)i * job->k + r;
        uint32_t n = x->rel_pending[at];
        if (n == 0 || (!all && !sd_fence_reached(seen, x->rel_need[at])))
            continue;
        x->rel_pending[at] = 0;
        x->rel_total -= n;
        sd_unit_cache_unhold(&job->cache, &job->cache.units[i], n);
        any = true;
    }
    return any;
}

bool sd_fetch_fenced_poll(struct sd_job *job)
{
    bool any = false;
    for (uint32_t r = 0; r < job->k && job->xfer.rel_total > 0; r++)
        any |= fenced_let_go(job, r, false);
    if (job->xfer.rel_total == 0)
        job->xfer.rel_blocked = false;
    return any;
}

void sd_fetch_fenced_blocked(struct sd_job *job)
{
    if (job->xfer.rel_total > 0)
        job->xfer.rel_blocked = true;
}

/* the waiters of us, answered: the slot (synced: the device wrote it) or the gather's error */
static void answer_waiters(struct sd_job *job, struct sd_unit_state *us, int synced)
{
    /* answering a fetch is part of what it costs: inside its call scheduled_op counts it; a
     * fetch that waited for its gather is answered here, later */
    uint64_t cpu0 = 0;
    bool timed = sd_sched_answer_begin(job, &cpu0);
    const struct sd_unit_layout *ul = &job->layout.units[us->unit];
    uint64_t now = sd_now_ns();
    for (uint32_t r = 0; r < job->k && us->waiters; r++) {
        if (!(us->waiters & (1ULL << r)))
            continue;
        us->waiters &= ~(1ULL << r);
        struct sd_session *s = job->ranks[r];
        uint64_t tag = job->xfer.wait_tags[(size_t)(us - job->cache.units) * job->k + r];
        if (s == NULL)
            continue;
        if (us->status != SD_OK) {
            char msg[SD_OP_MSG_LEN];
            snprintf(msg, sizeof(msg), "fetch unit %u: job '%.40s' %s: %.140s", us->unit, job->name,
                     sd_job_state_name(job->state), job->fail_msg);
            job->stats.errors++;
            sd_session_complete(s, tag, SD_OP_FETCH,
                                job->fail_status ? job->fail_status : us->status, 0, 0, msg);
            continue;
        }
        sd_unit_cache_hold(&job->cache, us);
        s->holds[us->unit]++;
        /* counted on the rank's fence page before the answer (sd/fence.h) */
        uint32_t *answered = &job->mem.fence_count[2 * (size_t)r + 1];
        sd_fence_store(&((struct sd_fence_page *)job->mem.fence[r].ptr)->gather_seq, ++*answered);
        job->stats.ops[SD_OP_FETCH]++;
        sd_latency_add(&job->stats.lat[SD_OP_FETCH], now - us->start_ns);
        sd_session_complete(s, tag, SD_OP_FETCH, SD_OK, us->pool_off, sd_unit_bytes(ul), NULL);
    }
    if (timed)
        sd_sched_answer_end(job, cpu0);
    if (synced != SD_OK)
        sd_job_fail(job, synced, "fetch of unit %u: the %s backend failed: %s", us->unit,
                    job->reg->dev->name, sd_status_str(synced));
}

/* A fetch: a copy of the unit that is resident (of this weights generation) answers at once; one
 * in flight takes the rank as a waiter; otherwise a gather into a new place starts, which inside
 * a node (the degenerate gather: no peers) completes before this returns. */
bool sd_fetch(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t start)
{
    struct sd_unit_state *us = sd_job_slot(job, e->unit, s->local);
    const struct sd_unit_layout *ul = &job->layout.units[e->unit];
    uint64_t bit = 1ULL << s->local;
    uint64_t *wait_tag = &job->xfer.wait_tags[(size_t)(us - job->cache.units) * job->k + s->local];
    if (us->inflight) {
        if (us->waiters & bit)
            return false; /* the same rank twice: wait for the first */
        us->waiters |= bit;
        *wait_tag = e->tag;
        return true;
    }
    sd_unit_cache_drop_stale(&job->cache, us, job->weights_gen);
    if (us->resident) {
        job->stats.cache_hits++;
        us->start_ns = start;
        us->waiters |= bit;
        *wait_tag = e->tag;
        sd_fetch_complete(job, us);
        return true;
    }
    bool from_sec = sd_sec_ready(job, us);
    if (!from_sec && !gather_resources(job))
        return false;
    uint64_t off;
    int st = sd_fetch_reserve(job, sd_unit_bytes(ul), &off);
    if ((st == SD_EAGAIN || st == SD_ENOSPC) && sd_fetch_fenced_poll(job))
        st = sd_fetch_reserve(job, sd_unit_bytes(ul), &off); /* a stream signalled a release */
    if (st == SD_EAGAIN || (st == SD_ENOSPC && sd_unit_cache_others_hold(&job->cache, s->holds))) {
        sd_fetch_fenced_blocked(job);
        return false; /* other ranks (or gathers in flight) still use the space: wait for them */
    }
    if (st != SD_OK) {
        char b1[32], b2[32], b3[32];
        sd_session_fail(s, e, SD_ENOSPC,
                        "fetch unit %u needs %s; the gather pool (%s) has %s held by unreleased "
                        "or in-flight units: release units or raise max_live_bytes",
                        e->unit, sd_fmt_bytes(b1, sizeof(b1), sd_unit_bytes(ul)),
                        sd_fmt_bytes(b2, sizeof(b2), job->cache.spool.capacity),
                        sd_fmt_bytes(b3, sizeof(b3), sd_slot_pool_used_bytes(&job->cache.spool)));
        return true;
    }
    us->pool_off = off;
    us->waiters |= bit;
    *wait_tag = e->tag;
    if (from_sec) {
        gather_from_sec(job, us);
        return true;
    }
    gather_begin(job, us);
    gather_post(job, &us, 1);
    return true;
}

void sd_fetch_release(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start)
{
    struct sd_unit_state *us = sd_job_slot(job, e->unit, s->local);
    if (s->holds[e->unit] == 0) {
        sd_session_fail(s, e, SD_ENOTHELD,
                        "release of unit %u which rank %u does not hold (released twice, or "
                        "never fetched)",
                        e->unit, s->rank);
        return;
    }
    if ((e->arg0 & ~(SD_OP_ASIDE | SD_RELEASE_SIGNAL_LATER)) != 0 ||
        ((e->arg0 & SD_RELEASE_SIGNAL_LATER) && e->arg1 > UINT32_MAX)) {
        sd_session_fail(
            s, e, SD_EINVAL,
            "release of unit %u: flags %#llx or signal value %llu not understood (flags "
            "SD_OP_ASIDE, SD_RELEASE_SIGNAL_LATER; a 32-bit release_seq)",
            e->unit, (unsigned long long)e->arg0, (unsigned long long)e->arg1);
        return;
    }
    s->holds[e->unit]--;
    if (e->arg0 & SD_RELEASE_SIGNAL_LATER) { /* held until the rank's page counts arg1 */
        size_t at = (size_t)(us - job->cache.units) * job->k + s->local;
        job->xfer.rel_pending[at]++;
        job->xfer.rel_need[at] = (uint32_t)e->arg1;
        job->xfer.rel_total++;
        job->stats.fenced_releases++;
    } else {
        sd_unit_cache_unhold(&job->cache, us, 1);
    }
    sd_op_done(job, s, e, 0, 0, start);
}

void sd_fetch_drop(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t start)
{
    sd_fetch_fenced_poll(job); /* a copy whose release its stream signalled is dropped too */
    sd_unit_cache_drop(&job->cache, sd_job_slot(job, e->unit, s->local));
    sd_op_done(job, s, e, 0, 0, start);
}

void sd_fetch_release_holds(struct sd_job *job, struct sd_session *s)
{
    if (s->holds == NULL || job->cache.units == NULL)
        return;
    fenced_let_go(job, s->local, true);
    for (uint32_t u = 0; u < job->layout.n_units; u++) {
        struct sd_unit_state *us = sd_job_slot(job, u, s->local);
        sd_unit_cache_unhold(&job->cache, us, s->holds[u]);
        s->holds[u] = 0;
        us->waiters &= ~(1ULL << s->local);
    }
}

/* ---- fetch across nodes */

/* With ,qw: the remote blocks of the gather us leads arrived as int8 blocks in its receive slot,
 * node by node, unit by unit, rank by rank (as gather_post laid them out): decode each shard
 * into its place in the slot. The decodes are queued, not waited for: where the device has not
 * reached them yet, the receive slot goes back once it has (sd_qw_rx_put_after; us->qrx -1), and
 * the units' waiters are answered after them (sd_fetch_complete's ticket comes later on the same
 * queue). */
static int gather_decode(struct sd_job *job, struct sd_unit_state *us)
{
    uint32_t G = job->gnodes[SD_STATE_W], k = job->k;
    uint32_t me = job->node - sd_job_group_first(job, G);
    const uint8_t *src = sd_qw_rx(job, us->qrx);
    for (uint32_t i = 0; i < G; i++) {
        if (i == me)
            continue;
        for (struct sd_unit_state *u = us; u; u = u->batch_next) {
            const struct sd_unit_layout *ul = &job->layout.units[u->unit];
            size_t len = sd_job_w_shard_bytes(job, u->unit);
            uint64_t n = ul->numel / job->plan.f[SD_STATE_W], enc = sd_qw_shard_bytes(job, u->unit);
            uint8_t *slot = (uint8_t *)job->mem.pool.ptr + u->pool_off;
            for (uint32_t q = 0; q < k; q++, src += enc)
                job->reg->dev->dequantize(job->mem.queue, slot + ((size_t)i * k + q) * len,
                                          ul->dtype, src, SD_CODEC_INT8, n, job->plan.qblock,
                                          false);
        }
    }
    uint64_t ticket;
    int st = sd_job_queue_mark(job, false, &ticket);
    if (st == SD_EAGAIN) {
        sd_qw_rx_put_after(job, us->qrx, ticket);
        us->qrx = -1;
        return SD_OK;
    }
    if (st != SD_OK) {
        sd_job_backend_failed(job, st);
        return SD_EIO;
    }
    return SD_OK;
}

/* a gather (maybe coalesced: us leads the units linked by batch_next) completed or failed */
static void gather_finish(struct sd_job *job, struct sd_unit_state *us)
{
    int status = us->status;
    uint32_t suspect = us->suspect;
    job->xfer.gathers_inflight--;
    if (us->qrx >= 0) {
        if (status == SD_OK)
            status = gather_decode(job, us);
        sd_qw_rx_put(job, us->qrx);
        us->qrx = -1;
        if (job->state == SD_JOB_FAILED)
            return;
    }
    if (status != SD_OK) {
        char what[256], peer[64];
        snprintf(what, sizeof(what),
                 "fetch of unit %u (weights generation %llu): the transfer from %s failed: %s",
                 us->unit, (unsigned long long)us->gen,
                 sd_job_peer_name(job, suspect, peer, sizeof(peer)), sd_status_str(status));
        for (struct sd_unit_state *u = us, *next; u; u = next) {
            next = u->batch_next;
            u->batch_next = NULL;
            u->inflight = false;
            u->resident = false;
            sd_slot_pool_free(&job->cache.spool, u->pool_off);
        }
        sd_job_fail(job, SD_EPEER, "%s", what);
        return;
    }
    for (struct sd_unit_state *u = us, *next; u; u = next) {
        next = u->batch_next; /* completing a fetch may start new gathers */
        u->batch_next = NULL;
        u->inflight = false;
        u->resident = true;
        job->stats.gathers++;
        /* a refill of the secondary copy reads the slot on the device: the unit stays in flight
         * (not evicted, its place not refilled by the network) until the queue passed it */
        bool read_out = u->gen == job->weights_gen && sd_sec_keep(job, u);
        fetch_complete(job, u, read_out);
    }
    if (job->gnodes[SD_STATE_W] == 1)
        return; /* a gather inside the node: it took no transfer resources, freed none */
    if (!sd_job_event(job, SD_JOB_EV_TRANSFERS)) /* a refresh, or a step waiting for gathers */
        sd_sched_prefetch(job);                  /* else: transfer resources are free again */
}

static void gather_recv_done(struct sd_bulk *b, int status)
{
    struct sd_unit_state *us = b->arg;
    struct sd_job *job = us->job;
    job->stats.bytes[SD_OP_FETCH][SD_LINK_INTER_RECV] += b->bytes;
    job->stats.saved[SD_OP_FETCH][SD_LINK_INTER_RECV] += (int64_t)b->arg2 - (int64_t)b->bytes;
    if (status != SD_OK && us->status == SD_OK) {
        us->status = status;
        us->suspect = b->peer;
    }
    sd_bulk_put(&job->xfer.bulks, b);
    if (--us->remaining == 0)
        gather_finish(job, us);
}

static void gather_req_sent(struct sd_xfer *x, int status)
{
    struct sd_unit_state *us = x->arg;
    struct sd_job *job = us->job;
    if (status != SD_OK && us->status == SD_OK) {
        us->status = status;
        us->suspect = x->peer;
    }
    if (--us->remaining == 0)
        gather_finish(job, us);
}

static bool gather_resources(const struct sd_job *job)
{
    return job->xfer.bulks.n - job->xfer.bulks.in_use >= job->gnodes[SD_STATE_W] - 1 &&
           job->xfer.gathers_inflight < SD_MAX_GATHERS_INFLIGHT && sd_qw_rx_available(job);
}

/* slot us (pool space reserved) is in flight; gather_post fills in this node's block */
static void gather_begin(struct sd_job *job, struct sd_unit_state *us)
{
    us->inflight = true;
    us->published = false;
    us->status = SD_OK;
    us->gen = job->weights_gen;
    us->start_ns = sd_now_ns();
    us->batch_next = NULL;
    us->qrx = -1;
}

/* This node's part of each of units[0..n) into its slot: the w shards of the partition group's
 * members on this node, each at its place in the unit. When the group spans nodes those are the
 * node's k ranks (its block); inside the node, the group of the copy's first rank (every
 * partition group on the node holds the same weights). */
static void gather_copy_local(struct sd_job *job, struct sd_unit_state *const *units, uint32_t n)
{
    uint32_t f = job->plan.f[SD_STATE_W], np = 0;
    struct sd_gpu_piece pieces[32]; /* the copies, enqueued together (one launch on a GPU) */
    for (uint32_t i = 0; i < n; i++) {
        uint32_t u = units[i]->unit;
        size_t len = sd_job_w_shard_bytes(job, u);
        uint8_t *slot = (uint8_t *)job->mem.pool.ptr + units[i]->pool_off;
        struct sd_group grp = sd_group_partition(f, job->first_rank + units[i]->lslot);
        for (uint32_t m = 0; m < grp.count; m++) {
            uint32_t rank = sd_group_member(&grp, m);
            if (rank < job->first_rank || rank >= job->first_rank + job->k)
                continue; /* another node's: pulled from there */
            uint32_t local = rank - job->first_rank;
            if (job->plan.qw) { /* its int8 blocks, as every other copy of it sees them */
                const struct sd_unit_layout *ul = &job->layout.units[u];
                job->reg->dev->dequantize(job->mem.queue, slot + (size_t)m * len, ul->dtype,
                                          sd_qw_shard(job, local, u, NULL), SD_CODEC_INT8,
                                          ul->numel / f, job->plan.qblock, false);
                sd_job_count_coded(job, SD_OP_FETCH, local, units[i]->lslot, len,
                                   sd_qw_shard_bytes(job, u));
                continue;
            }
            if (np == sizeof(pieces) / sizeof(pieces[0])) {
                sd_gpu_copy_many(job->reg->dev, job->mem.queue, pieces, np);
                np = 0;
            }
            pieces[np++] = (struct sd_gpu_piece){
                .dst = slot + (size_t)m * len, .src = sd_job_w_shard(job, local, u), .bytes = len};
            sd_job_count_copy(job, SD_OP_FETCH, local, units[i]->lslot, len);
        }
    }
    sd_gpu_copy_many(job->reg->dev, job->mem.queue, pieces, np);
}

/* Pull the remote blocks of units[0..n) (begun, consecutive ids ascending, one copy) from every
 * node of the partition group: one request and one transfer per peer for all of them, then copy
 * this node's block while the peers answer. units[0] leads: it holds the transfers, and its
 * completion completes the others. */
static void gather_post(struct sd_job *job, struct sd_unit_state *const *units, uint32_t n)
{
    uint64_t cpu0 = sd_sched_issue_clock(job);
    struct sd_unit_state *us = units[0];
    uint32_t G = job->gnodes[SD_STATE_W], k = job->k;
    uint32_t first = sd_job_group_first(job, job->gnodes[SD_STATE_W]);
    for (uint32_t j = 1; j < n; j++)
        units[j - 1]->batch_next = units[j];
    us->remaining = 2 * (G - 1);
    us->req = (struct sd_req_msg){.magic = SD_REQ_MAGIC,
                                  .job_tag = (uint16_t)job->xfer.tag,
                                  .src = (uint16_t)job->node,
                                  .unit = us->unit,
                                  .lslot = us->lslot,
                                  .gen = us->gen,
                                  .n_units = n};
    job->xfer.gathers_inflight++;
    uint32_t seq = 0;
    int tag_st = sd_tag_weights_seq(us->gen, us->lslot, &seq);
    /* with ,qw the blocks arrive as int8 in a receive slot, node by node (gather_decode) */
    uint8_t *rx = NULL;
    if (sd_qw_rx_enabled(job)) {
        us->qrx = sd_qw_rx_take(job);
        if (us->qrx < 0 && tag_st == SD_OK)
            tag_st = SD_EAGAIN; /* gather_resources saw one free: never */
        rx = us->qrx >= 0 ? sd_qw_rx(job, us->qrx) : NULL;
    }
    for (uint32_t i = 0, o = 0; i < G; i++) {
        uint32_t m = first + i;
        if (m == job->node)
            continue;
        void *pieces[SD_BULK_MAX_PIECES];
        size_t lens[SD_BULK_MAX_PIECES];
        uint64_t raw = 0;
        for (uint32_t j = 0, p = 0; j < n; j++) {
            size_t len = sd_job_w_shard_bytes(job, units[j]->unit);
            uint8_t *slot = (uint8_t *)job->mem.pool.ptr + units[j]->pool_off;
            raw += (uint64_t)k * len;
            for (uint32_t q = 0; q < k; q++, p++) {
                if (rx != NULL) {
                    lens[p] = sd_qw_shard_bytes(job, units[j]->unit);
                    pieces[p] = rx;
                    rx += lens[p];
                    continue;
                }
                pieces[p] = slot + ((size_t)i * k + q) * len;
                lens[p] = len;
            }
        }
        uint64_t data_tag = 0, req_tag = 0;
        int st = tag_st;
        if (st == SD_OK)
            st = sd_tag_make(SD_TAG_WDATA, job->xfer.tag, us->unit, seq, m, &data_tag);
        if (st == SD_OK)
            st = sd_tag_make(SD_TAG_REQ, job->xfer.tag, us->unit, seq, job->node, &req_tag);
        int req_st = st;
        struct sd_bulk *b = sd_bulk_get(&job->xfer.bulks);
        us->rb[o] = b;
        if (st == SD_OK)
            st = sd_bulk_start(b, &(struct sd_bulk_param){.tp = sd_job_tp(job),
                                                          .peer = m,
                                                          .tag = data_tag,
                                                          .pieces = pieces,
                                                          .lens = lens,
                                                          .n_pieces = n * k,
                                                          .chunk_bytes = job->reg->cfg->chunk_bytes,
                                                          .desc = sd_job_net_desc(job, pieces[0]),
                                                          .cb = gather_recv_done,
                                                          .arg = us,
                                                          .arg2 = raw});
        if (st != SD_OK) {
            sd_bulk_put(&job->xfer.bulks, b);
            us->status = st;
            us->suspect = m;
            us->remaining--;
        }
        struct sd_xfer *x = &us->req_x[o];
        x->cb = gather_req_sent;
        x->arg = us;
        st = req_st != SD_OK
                 ? req_st
                 : sd_job_tp(job)->ops->send(sd_job_tp(job), m, req_tag, &us->req, sizeof(us->req),
                                             sd_job_net_desc(job, &us->req), x);
        if (st != SD_OK) {
            us->status = st;
            us->suspect = m;
            us->remaining--;
        }
        o++;
    }
    /* no completion runs before the loop polls again, so the slots are still ours */
    gather_copy_local(job, units, n);
    sd_sched_issue_count(job, cpu0);
    if (us->remaining == 0)
        gather_finish(job, us);
}

int sd_fetch_gather_start(struct sd_job *job, struct sd_unit_state *us)
{
    if (sd_sec_ready(job, us)) {
        gather_from_sec(job, us);
        return SD_OK;
    }
    if (!gather_resources(job))
        return SD_EAGAIN;
    gather_begin(job, us);
    gather_post(job, &us, 1);
    return SD_OK;
}

bool sd_fetch_would_join(const struct sd_job *job, uint32_t unit, uint32_t lslot)
{
    const struct sd_gather_batch *bt = &job->xfer.batch;
    uint64_t bytes = sd_unit_bytes(&job->layout.units[unit]);
    uint64_t limit = (uint64_t)job->reg->cfg->coalesce_bytes;
    return bytes < limit && bt->n > 0 && bt->lslot == lslot && bt->bytes + bytes <= limit &&
           (bt->n + 1) * job->k <= SD_BULK_MAX_PIECES &&
           (unit == bt->hi + 1 || unit + 1 == bt->lo) &&
           (!job->plan.qw || sd_qw_rx_fits(job, bt->qbytes + sd_qw_remote_bytes(job, unit)));
}

/* A gather the frozen schedule issues: small units join the open batch while their ids stay
 * consecutive and the batch under coalesce_bytes; sd_fetch_prefetch_flush sends it. */
int sd_fetch_prefetch(struct sd_job *job, struct sd_unit_state *us)
{
    if (sd_sec_ready(job, us)) { /* a copy from the secondary partition, done now */
        gather_from_sec(job, us);
        return SD_OK;
    }
    if (job->gnodes[SD_STATE_W] == 1) { /* the partition group is on this node: a copy, done now */
        sd_fetch_local_gather(job, us);
        us->resident = true;
        us->gen = job->weights_gen;
        return SD_OK;
    }
    struct sd_gather_batch *bt = &job->xfer.batch;
    uint64_t bytes = sd_unit_bytes(&job->layout.units[us->unit]);
    uint64_t limit = (uint64_t)job->reg->cfg->coalesce_bytes;
    bool small = bytes < limit && job->k <= SD_BULK_MAX_PIECES / 2;
    bool joins = sd_fetch_would_join(job, us->unit, us->lslot);
    if (!joins)
        sd_fetch_prefetch_flush(job);
    if (!small)
        return sd_fetch_gather_start(job, us);
    if (bt->n == 0) {
        if (!gather_resources(job))
            return SD_EAGAIN; /* the batch, once open, needs nothing more */
        bt->lo = bt->hi = us->unit;
        bt->lslot = us->lslot;
        bt->bytes = bt->qbytes = 0;
    }
    gather_begin(job, us);
    bt->lo = SD_MIN(bt->lo, us->unit);
    bt->hi = SD_MAX(bt->hi, us->unit);
    bt->bytes += bytes;
    bt->qbytes += job->plan.qw ? sd_qw_remote_bytes(job, us->unit) : 0;
    bt->units[bt->n++] = us;
    return SD_OK;
}

void sd_fetch_prefetch_flush(struct sd_job *job)
{
    struct sd_gather_batch *bt = &job->xfer.batch;
    uint32_t n = bt->n;
    if (n == 0)
        return;
    bt->n = 0;
    for (uint32_t i = 1; i < n; i++) /* ascending ids, as the request names them */
        for (uint32_t j = i; j > 0 && bt->units[j - 1]->unit > bt->units[j]->unit; j--) {
            struct sd_unit_state *t = bt->units[j];
            bt->units[j] = bt->units[j - 1];
            bt->units[j - 1] = t;
        }
    if (n > 1) {
        job->stats.coalesced_gathers++;
        job->stats.coalesced_units += n;
    }
    gather_post(job, bt->units, n);
}

/* ---- the job's common paths (job_module.h) */

/* ranks waiting for an in-flight gather: answered with status. A job closing (with_fetches
 * false: a rank detached) still serves fetches: one whose slot the device is still writing is
 * answered by the loop's poll, as before the close (failing it here failed the last fetches of a
 * rank saving the final weights on a GPU, where the device had not reached the slot yet when its
 * peer detached) */
static void fetch_fail_parked(struct sd_job *job, int status, const char *text, bool with_fetches)
{
    (void)text;
    /* answers waiting for the device: nothing else would give them once the job failed */
    while (with_fetches && job->xfer.answer_q != NULL && job->xfer.aq_len > 0)
        answer_oldest(job, status, SD_OK);
    for (uint32_t i = 0; with_fetches && job->cache.units != NULL && i < job->n_slots; i++) {
        struct sd_unit_state *us = &job->cache.units[i];
        if (us->waiters == 0)
            continue;
        us->status = status;
        sd_fetch_complete(job, us);
    }
}

/* gathers on the wire: the first one's unit, since the oldest began */
static bool fetch_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns)
{
    if (job->xfer.gathers_inflight == 0)
        return false;
    const struct sd_unit_state *first = NULL;
    *since_ns = 0;
    for (uint32_t i = 0; i < job->n_slots; i++) {
        const struct sd_unit_state *us = &job->cache.units[i];
        first = first == NULL && us->inflight ? us : first;
        if (us->inflight && (*since_ns == 0 || us->start_ns < *since_ns))
            *since_ns = us->start_ns;
    }
    snprintf(what, len, "fetch of unit %u (weights generation %llu; last completed step %llu)",
             first != NULL ? first->unit : 0, (unsigned long long)job->weights_gen,
             (unsigned long long)job->steps);
    return true;
}

const struct sd_job_module sd_fetch_module = {.name = "fetch",
                                              .fail_parked = fetch_fail_parked,
                                              .activity = fetch_activity,
                                              .queue_waiting = fetch_loop_waiting,
                                              .queue_poll = fetch_loop_poll};

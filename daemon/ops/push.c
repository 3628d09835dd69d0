/* Push: the gradients of one micro-step, from the local ranks' staging slots to the fp32 g shards
 * (DESIGN.md section 3, step 4). A push round owns the whole way: it collects a unit's pushes
 * from the ranks of a g-partition group, and once all arrived either reduces them inside the node
 * (summed in rank order into scratch, then added to each holder's g shard) or, across nodes, sums
 * the node partial, reduce-scatters it among the group's nodes (each node sums the partials of
 * its block in node order, chunk by chunk as they arrive) and, without the 2-hop sync, all-reduces
 * the result across the replication group. Up to push_rounds node rounds are on the wire at once,
 * each with its own buffers; they are retired into the g shards in the order they started, so the
 * sums do not depend on which finishes first. */
#include "net.h"
#include "job_module.h"
#include "push.h"
#include "push_int.h"
#include "push_round.h"
#include "quant.h"
#include "session.h"
#include "sd/fence.h"
#include "sd/codec.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct sd_push_round {
    uint32_t arrived;
    uint64_t first_ns;
    uint64_t seq; /* which round of its (unit, group) it collects: the micro-step */
};

struct sd_round_wait {
    uint32_t unit, group;
    uint64_t ticket;
};

/* Push rounds are kept [unit][group][generation]: round n of (unit u, g-partition group g)
 * collects in generation n % round_gens. gi indexes job->push->rounds; its members' entries start
 * at gi * g_members in job->push->round_entries. */
static inline size_t round_index(const struct sd_job *job, uint32_t u, uint32_t g, uint64_t n)
{
    return ((size_t)u * job->push->g_groups + g) * job->push->round_gens +
           (size_t)(n % job->push->round_gens);
}

static inline struct sd_push_entry *round_ents(struct sd_job *job, size_t gi)
{
    return &job->push->round_entries[gi * job->push->g_members];
}

/* the unit and the group of round slot gi */
static inline uint32_t round_unit(const struct sd_job *job, size_t gi)
{
    return (uint32_t)(gi / job->push->round_gens / job->push->g_groups);
}

static inline uint32_t round_group(const struct sd_job *job, size_t gi)
{
    return (uint32_t)(gi / job->push->round_gens % job->push->g_groups);
}

static void node_round_ready(struct sd_job *job, uint32_t unit, uint64_t seq);

/* Complete the pushes of the oldest round of (u, g), whose reduction the device finished. */
static void complete_round(struct sd_job *job, uint32_t u, uint32_t g)
{
    uint64_t *done = &job->push->rounds_done[(size_t)u * job->push->g_groups + g];
    size_t gi = round_index(job, u, g, *done);
    struct sd_push_round *rd = &job->push->rounds[gi];
    struct sd_push_entry *ent = round_ents(job, gi);
    uint64_t now = sd_now_ns();
    bool last = true; /* every member marked it its last push of the unit in this step */
    for (uint32_t m = 0; m < job->push->g_members; m++)
        last &= ent[m].s != NULL && ent[m].last;
    for (uint32_t m = 0; m < job->push->g_members; m++) {
        struct sd_session *s = ent[m].s;
        if (s == NULL)
            continue;
        s->staging_busy &= ~(1ULL << ent[m].slot);
        job->stats.ops[SD_OP_PUSH]++;
        sd_latency_add(&job->stats.lat[SD_OP_PUSH], now - ent[m].arrive_ns);
        sd_session_complete(s, ent[m].tag, SD_OP_PUSH, SD_OK, rd->seq, 0, NULL);
        ent[m].s = NULL;
    }
    rd->arrived = 0;
    (*done)++;
    if (last) { /* the group's promise; the unit is final once every group's is in */
        uint8_t *fin = &job->push->final[(size_t)u * job->push->g_groups];
        fin[g] = 1;
        uint32_t n = 0;
        for (uint32_t i = 0; i < job->push->g_groups; i++)
            n += fin[i];
        if (n == job->push->g_groups)
            sd_job_event_unit(job, SD_JOB_EV_UNIT_FINAL, u); /* it may cross nodes now */
    }
}

/* The same without blocking the loop on a device (DESIGN.md 7b): the round completes once the
 * job's queue reached the kernels just enqueued, at once where it already has (the host
 * backends), else from the loop's poll (sd_push_queue_poll), in order. Until then the round's
 * members and later pushes wait as they would for a slow reduction, and the step for the push
 * to be idle. */
static void finish_round_later(struct sd_job *job, uint32_t u, uint32_t g)
{
    struct sd_push_state *ps = job->push;
    uint64_t ticket = 0;
    int st = sd_job_queue_mark(job, ps->w_len > 0, &ticket);
    if (st == SD_OK) {
        complete_round(job, u, g);
        return;
    }
    if (st != SD_EAGAIN) {
        sd_job_backend_failed(job, st);
        return;
    }
    ps->waits[(ps->w_head + ps->w_len++) % ps->w_cap] =
        (struct sd_round_wait){.unit = u, .group = g, .ticket = ticket};
}

static bool round_post_blocks(struct sd_node_round *rd);
static void rs_all_done(struct sd_node_round *rd);

/* the node rounds whose blocks wait for the device to write them: posted once it did */
static bool blocks_poll(struct sd_job *job)
{
    struct sd_push_state *ps = job->push;
    bool moved = false;
    for (uint32_t j = 0; j < ps->nr_len && job->state != SD_JOB_FAILED; j++) {
        struct sd_node_round *rd = &ps->nr[(ps->nr_head + j) % ps->round_gens];
        uint32_t before = rd->next;
        if (rd->next >= job->gnodes[SD_STATE_G])
            continue;
        bool all = round_post_blocks(rd);
        moved |= rd->next != before;
        if (all && rd->pending == 0)
            rs_all_done(rd);
    }
    return moved;
}

static void rounds_retire(struct sd_job *job);

/* the oldest node round waits for the job's queue to pass its result */
static bool head_retiring(const struct sd_push_state *ps)
{
    return ps->nr != NULL && ps->nr_len > 0 && ps->nr[ps->nr_head].retiring;
}

/* the node rounds' all-reduces whose sums the device has not passed yet (coll.h): each goes on
 * once it did (a failed job's were given up: push_fail_parked) */
static bool allreduces_poll(struct sd_job *job)
{
    struct sd_push_state *ps = job->push;
    bool moved = false;
    for (uint32_t j = 0; ps->nr != NULL && j < ps->round_gens; j++)
        if (sd_allreduce_waiting(&ps->nr[j].ar))
            moved |= sd_allreduce_poll(&ps->nr[j].ar);
    return moved;
}

static bool allreduces_waiting(const struct sd_push_state *ps)
{
    for (uint32_t j = 0; ps->nr != NULL && j < ps->round_gens; j++)
        if (sd_allreduce_waiting(&ps->nr[j].ar))
            return true;
    return false;
}

bool sd_push_queue_poll(struct sd_job *job)
{
    struct sd_push_state *ps = job->push;
    if (ps == NULL)
        return false;
    bool moved = allreduces_poll(job);
    moved |= ps->nr != NULL && blocks_poll(job);
    if (head_retiring(ps) && job->state != SD_JOB_FAILED) {
        uint32_t before = ps->nr_len;
        rounds_retire(job); /* raises PUSHED when the last one went */
        moved |= ps->nr_len != before;
    }
    if (ps->w_len == 0)
        return moved;
    const struct sd_gpu_ops *dev = job->reg->dev;
    while (ps->w_len > 0 && job->state != SD_JOB_FAILED) {
        struct sd_round_wait w = ps->waits[ps->w_head];
        int st = dev->query(job->mem.queue, w.ticket);
        if (st == SD_EAGAIN)
            break;
        ps->w_head = (ps->w_head + 1) % ps->w_cap;
        ps->w_len--;
        if (st != SD_OK) {
            sd_job_backend_failed(job, st);
            break;
        }
        complete_round(job, w.unit, w.group);
        moved = true;
    }
    if (moved)
        sd_job_event(job, SD_JOB_EV_PUSHED);
    return moved;
}

bool sd_push_queue_waiting(const struct sd_job *job)
{
    const struct sd_push_state *ps = job->push;
    if (ps == NULL)
        return false;
    for (uint32_t j = 0; ps->nr != NULL && j < ps->nr_len; j++)
        if (ps->nr[(ps->nr_head + j) % ps->round_gens].next < job->gnodes[SD_STATE_G])
            return true;
    return ps->w_len > 0 || head_retiring(ps) || allreduces_waiting(ps);
}

/* All members of a g-partition group (inside this node) pushed unit u: reduce-scatter into
 * their g shards. */
static void reduce_round(struct sd_job *job, uint32_t u, uint32_t g)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t n = job->push->rounds_done[(size_t)u * job->push->g_groups + g];
    struct sd_push_entry *ent = round_ents(job, round_index(job, u, g, n));
    uint32_t f = job->push->g_members;
    uint64_t len = ul->numel / f;
    size_t esz = sd_dtype_size(ul->dtype);

    for (uint32_t h = 0; h < f; h++) {
        uint32_t holder = g * f + h; /* local index of the rank holding shard i */
        uint32_t i = sd_plan_shard(&job->plan, SD_STATE_G, job->first_rank + holder);
        float *dst = sd_job_g_shard(job, holder, ul);
        for (uint32_t m = 0; m < f; m++) {
            const uint8_t *src =
                sd_job_staging_slot(job, ent[m].s->local, ent[m].slot) + i * len * esz;
            if (m == 0)
                dev->to_f32(job->mem.queue, job->mem.scratch, src, ul->dtype, len);
            else
                dev->reduce_add(job->mem.queue, job->mem.scratch, src, ul->dtype, len);
            sd_job_count_copy(job, SD_OP_PUSH, ent[m].s->local, holder, len * esz);
        }
        dev->reduce_add(job->mem.queue, dst, job->mem.scratch, SD_DTYPE_FP32, len);
    }
    finish_round_later(job, u, g);
}

#define PUSHED_AFTER_LAST                                                                          \
    "after its node's ranks marked an earlier push of it the last of the step "                    \
    "(shard_last_micro_step, set_requires_gradient_sync(True))"

/* Returns false to stall: this rank already has a push of this unit waiting in every round
 * generation (it is round_gens micro-steps ahead of its group). */
bool sd_push(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    const struct sd_unit_layout *ul = &job->layout.units[e->unit];
    bool signal_later = (e->arg0 & SD_PUSH_SIGNAL_LATER) != 0;
    bool marked_last = (e->arg0 & SD_PUSH_LAST) != 0;
    uint64_t slot = e->arg0 & ~(SD_PUSH_SIGNAL_LATER | SD_PUSH_LAST);
    if (slot >= job->mem.staging_slots) {
        sd_session_fail(s, e, SD_EINVAL,
                        "push unit %u: staging slot %llu does not exist (%u "
                        "slots)",
                        e->unit, (unsigned long long)slot, job->mem.staging_slots);
        return true;
    }
    if (e->arg1 != sd_unit_bytes(ul)) {
        sd_session_fail(s, e, SD_EMSGSIZE,
                        "push unit %u: gradient is %llu bytes but the unit is %llu bytes (%llu "
                        "%s elements, padded)",
                        e->unit, (unsigned long long)e->arg1, (unsigned long long)sd_unit_bytes(ul),
                        (unsigned long long)ul->numel, sd_dtype_name(ul->dtype));
        return true;
    }
    uint32_t g = s->local / job->push->g_members, m = s->local % job->push->g_members;
    if (job->push->final[(size_t)e->unit * job->push->g_groups + g]) { /* it may have left */
        sd_session_fail(s, e, SD_ESTATE, "push unit %u: %s", e->unit, PUSHED_AFTER_LAST);
        sd_job_fail(job, SD_ESTATE, "rank %u pushed unit %u: %s", s->rank, e->unit,
                    PUSHED_AFTER_LAST);
        return true;
    }
    /* a rank's pushes fill the rounds in order: its next is the oldest round it is not in */
    uint64_t n = job->push->rounds_done[(size_t)e->unit * job->push->g_groups + g];
    uint64_t last = n + job->push->round_gens;
    while (n < last && round_ents(job, round_index(job, e->unit, g, n))[m].s != NULL)
        n++;
    if (n == last)
        return false; /* ahead of its group: wait for the oldest round to finish */
    if (s->staging_busy & (1ULL << slot)) {
        sd_session_fail(s, e, SD_EBUSY,
                        "push unit %u: staging slot %llu still holds an earlier push that has "
                        "not completed",
                        e->unit, (unsigned long long)slot);
        return true;
    }
    /* the gradient must have been signalled on the rank's fence page (sd/fence.h): libshard
     * writes it before each push, or the trainer's stream writes it after the kernels that
     * produce the gradient (SD_PUSH_SIGNAL_LATER): the push waits for it, the loop polling the
     * page (a stream's write wakes nothing), and the job fails after op_timeout_ms without it.
     * The daemon's own queue never waits on a value a client writes. */
    uint32_t *taken = &job->mem.fence_count[2 * (size_t)s->local];
    uint32_t signalled =
        sd_fence_load(&((const struct sd_fence_page *)job->mem.fence[s->local].ptr)->grad_seq);
    if (!sd_fence_reached(signalled, *taken + 1) && signal_later) {
        s->stall_polls = true;
        return false;
    }
    if (!sd_fence_reached(signalled, *taken + 1)) {
        sd_session_fail(s, e, SD_ESTATE,
                        "push unit %u: rank %u's fence page counts %u gradients and this is push "
                        "%u: its gradient was not signalled (write grad_seq before pushing)",
                        e->unit, s->rank, signalled, *taken + 1);
        return true;
    }
    (*taken)++;
    if (signal_later && s->has_stalled) { /* the retry of a stalled call */
        job->stats.signal_waits++;
        job->stats.signal_wait_ns += sd_now_ns() - s->stalled_ns;
    }
    size_t gi = round_index(job, e->unit, g, n);
    struct sd_push_round *rd = &job->push->rounds[gi];
    struct sd_push_entry *ent = &round_ents(job, gi)[m];
    uint64_t now = sd_now_ns();
    s->staging_busy |= 1ULL << slot;
    *ent = (struct sd_push_entry){
        .s = s, .tag = e->tag, .arrive_ns = now, .slot = (uint32_t)slot, .last = marked_last};
    if (rd->arrived++ == 0) {
        rd->first_ns = now;
        rd->seq = n;
    }
    if (rd->arrived == job->push->g_members) {
        if (job->push->node_rounds)
            node_round_ready(job, e->unit, n);
        else
            reduce_round(job, e->unit, g);
    }
    return true;
}

/* Is any push round partly filled? Describes the first in msg. */
bool sd_push_partial_round(struct sd_job *job, char *msg, size_t len)
{
    size_t n = (size_t)job->layout.n_units * job->push->g_groups * job->push->round_gens;
    for (size_t gi = 0; gi < n; gi++) {
        if (job->push->rounds[gi].arrived == 0)
            continue;
        uint32_t u = round_unit(job, gi);
        struct sd_push_entry *ent = round_ents(job, gi);
        size_t off = (size_t)snprintf(msg, len, "step %llu: unit %u has gradients from ranks",
                                      (unsigned long long)job->steps + 1, u);
        for (uint32_t m = 0; m < job->push->g_members && off < len; m++)
            if (ent[m].s != NULL)
                off += (size_t)snprintf(msg + off, len - off, " %u", ent[m].s->rank);
        if (off < len)
            snprintf(msg + off, len - off,
                     " but not from the rest of their group; every "
                     "rank must push the same units");
        return true;
    }
    return false;
}

/* ---- push rounds across nodes */

static void round_start_next(struct sd_job *job);

/* The node's result of round rd into each rank's g shard, on the job's queue; then is the
 * queue past it? SD_OK: yes, the round retires now; SD_EAGAIN: the poll retires it once the
 * queue passed rd->retire_ticket (without blocking the loop on a device, DESIGN.md 7b); else
 * the backend failed. */
static int round_apply(struct sd_job *job, struct sd_node_round *rd)
{
    const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
    const float *B = job->gnodes[SD_STATE_G] > 1 ? rd->rs_out : rd->part;
    for (uint32_t j = 0; j < job->k; j++) {     /* the node's result into each rank's g shard */
        if (!sd_job_net_rounds_accumulate(job)) /* else the all-reduce added it */
            job->reg->dev->reduce_add(job->mem.queue, sd_job_g_shard(job, j, ul),
                                      B + sd_job_g_block_off(job, j, len), SD_DTYPE_FP32, len);
        sd_job_count_copy(job, SD_OP_PUSH, 0, j, len * sizeof(float));
    }
    rd->net_done = false;
    /* the clients reuse their staging slots once their pushes complete, and the next round
     * receives into this one's buffers: the kernels that read them must be done */
    int st = sd_job_queue_mark(job, false, &rd->retire_ticket);
    rd->retiring = st == SD_EAGAIN;
    return st;
}

/* Apply the oldest node rounds whose transfers are done, in the order they started (the g
 * shards get each unit's micro-steps in order, whichever round finished first), retire those
 * the job's queue is past, then start the rounds waiting for buffers. */
static void rounds_retire(struct sd_job *job)
{
    while (job->push->nr_len > 0 && job->state != SD_JOB_FAILED) {
        struct sd_node_round *rd = &job->push->nr[job->push->nr_head];
        int st;
        if (rd->retiring)
            st = job->reg->dev->query(job->mem.queue, rd->retire_ticket);
        else if (rd->net_done)
            st = round_apply(job, rd);
        else
            break;
        if (st == SD_EAGAIN)
            break;
        rd->retiring = false;
        if (st != SD_OK) {
            sd_job_backend_failed(job, st);
            return;
        }
        job->push->nr_head = (job->push->nr_head + 1) % job->push->round_gens;
        job->push->nr_len--;
        SD_DEBUG("net", "job '%s': push round of unit %u done in %.1f us", job->name, rd->unit,
                 (double)(sd_now_ns() - rd->start_ns) / 1e3);
        complete_round(job, rd->unit, 0);
    }
    if (job->state == SD_JOB_FAILED)
        return;
    round_start_next(job);
    if (job->push->nr_len == 0)
        sd_job_event(job, SD_JOB_EV_PUSHED);
}

/* a round's transfers are over: a failure fails the job now, whatever rounds precede it */
static void round_net_done(struct sd_node_round *rd)
{
    struct sd_job *job = rd->job;
    rd->net_done = true;
    if (job->state == SD_JOB_FAILED)
        return;
    if (rd->status != SD_OK) {
        char what[256];
        sd_job_net_describe(job, what, sizeof(what));
        char peer[64];
        sd_job_fail(job, SD_EPEER, "%s: transfer with %s failed: %s", what,
                    sd_job_peer_name(job, rd->suspect, peer, sizeof(peer)),
                    sd_status_str(rd->status));
        return;
    }
    rounds_retire(job);
}

static void round_ar_done(struct sd_allreduce *ar, int status, uint32_t suspect)
{
    struct sd_node_round *rd = ar->p.arg;
    struct sd_job *job = rd->job;
    job->stats.bytes[SD_OP_PUSH][SD_LINK_INTER_SENT] += ar->bytes_sent;
    job->stats.bytes[SD_OP_PUSH][SD_LINK_INTER_RECV] += ar->bytes_recv;
    if (status != SD_OK && rd->status == SD_OK) {
        rd->status = status;
        rd->suspect = suspect;
    }
    round_net_done(rd);
}

/* after the reduce-scatter: without 2-hop, all-reduce across the replication group */
static void round_after_rs(struct sd_node_round *rd)
{
    struct sd_job *job = rd->job;
    if (rd->status == SD_OK && !job->plan.two_hop && job->state != SD_JOB_FAILED) {
        uint32_t R = sd_job_replication_nodes(job, job->xfer.members);
        const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
        uint64_t count =
            job->gnodes[SD_STATE_G] > 1 ? ul->numel / job->gnodes[SD_STATE_G] : ul->numel;
        float *B = job->gnodes[SD_STATE_G] > 1 ? rd->rs_out : rd->part;
        if (R > 1) {
            float *acc = sd_job_net_rounds_accumulate(job) ? sd_job_g_shard(job, 0, ul) : NULL;
            int st = sd_job_net_allreduce(
                job, &(struct sd_job_allreduce){.ar = &rd->ar,
                                                .R = R,
                                                .unit = rd->unit,
                                                .round = rd->seq,
                                                .buf = B,
                                                .count = count,
                                                .tmp = rd->ar_tmp,
                                                .tmp_count = job->push->ar_tmp_count,
                                                .acc = acc,
                                                .cb = round_ar_done,
                                                .arg = rd});
            if (st == SD_OK)
                return;
            rd->status = st;
        }
    }
    round_net_done(rd);
}

/* every block of the round was exchanged */
static void rs_all_done(struct sd_node_round *rd)
{
    if (rd->codec != 0 && rd->status == SD_OK && rd->job->state != SD_JOB_FAILED)
        sd_round_decode(rd);
    round_after_rs(rd);
}

static void rs_done(struct sd_bulk *b, int status)
{
    struct sd_node_round *rd = b->arg;
    struct sd_job *job = rd->job;
    int c = b->is_send ? SD_LINK_INTER_SENT : SD_LINK_INTER_RECV;
    job->stats.bytes[SD_OP_PUSH][c] += b->bytes;
    job->stats.saved[SD_OP_PUSH][c] += (int64_t)b->arg2 - (int64_t)b->bytes;
    if (status != SD_OK && rd->status == SD_OK) {
        rd->status = status;
        rd->suspect = b->peer;
    }
    sd_bulk_put(&job->xfer.bulks, b);
    if (--rd->pending == 0 && rd->next >= job->gnodes[SD_STATE_G]) /* else more to come */
        rs_all_done(rd);
}

static bool unit_in_round(const struct sd_job *job, uint32_t unit)
{
    for (uint32_t i = 0; i < job->push->nr_len; i++)
        if (job->push->nr[(job->push->nr_head + i) % job->push->round_gens].unit == unit)
            return true;
    return false;
}

/* Post the exchanges of the round's blocks, in block order, each once the device wrote its
 * partial (its ticket reached: at once on the host backends, else from the loop's poll,
 * sd_push_queue_poll), never blocking the loop on the device; true once all are posted. */
static bool round_post_blocks(struct sd_node_round *rd)
{
    struct sd_job *job = rd->job;
    const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
    uint32_t G = job->gnodes[SD_STATE_G], me = job->node % G, r = rd->index;
    uint32_t first = sd_job_group_first(job, G);
    size_t block = ul->numel / G, bytes = block * sizeof(float);
    size_t wire = rd->codec ? sd_codec_bytes(rd->codec, block, job->plan.qblock) : bytes;
    for (; rd->next < G && job->state != SD_JOB_FAILED; rd->next++) {
        uint32_t i = rd->next, o = i < me ? i : i - 1;
        if (i == me)
            continue;
        int st = rd->ticket[i] ? job->reg->dev->query(job->mem.queue, rd->ticket[i]) : SD_OK;
        if (st == SD_EAGAIN)
            return false;
        if (st != SD_OK) {
            sd_job_backend_failed(job, st);
            return false;
        }
        struct sd_exchange_param x = {
            .peer = first + i,
            .recv = {.buf = rd->codec ? sd_qg_recv(job, r, o)
                                      : (void *)(rd->rs_recv + (size_t)o * block),
                     .bytes = wire},
            .send = {.buf =
                         rd->codec ? sd_qg_send(job, r, o) : (void *)(rd->part + (size_t)i * block),
                     .bytes = wire},
            .chunk_bytes = job->reg->cfg->chunk_bytes,
            .cb = rs_done,
            .chunk_cb = rd->codec ? NULL : sd_round_chunk,
            .arg = rd,
            .arg2 = bytes};
        rd->pending +=
            sd_job_net_exchange(job, &x, SD_TAG_GRAD, rd->unit,
                                sd_tag_wrap(rd->seq, SD_TAG_SEQ_BITS), &rd->status, &rd->suspect);
    }
    return rd->next >= G;
}

/* Start node rounds for the local rounds waiting, while a round's buffers are free (in order:
 * one whose unit must wait for an earlier round of it holds back those behind it). */
static void round_start_next(struct sd_job *job)
{
    while (job->push->nr_len < job->push->round_gens && job->push->rq_len > 0 &&
           job->state != SD_JOB_FAILED) {
        struct sd_round_ref ref = job->push->round_queue[job->push->rq_head];
        if (sd_job_net_rounds_accumulate(job) && unit_in_round(job, ref.unit))
            break; /* rounds_retire starts it */
        job->push->rq_head = (job->push->rq_head + 1) % job->push->rq_cap;
        job->push->rq_len--;
        struct sd_node_round *rd =
            &job->push->nr[(job->push->nr_head + job->push->nr_len) % job->push->round_gens];
        job->push->nr_len++;
        job->stats.push_rounds_peak = SD_MAX(job->stats.push_rounds_peak, job->push->nr_len);
        uint32_t u = ref.unit;
        const struct sd_unit_layout *ul = &job->layout.units[u];
        const struct sd_push_entry *ent = round_ents(job, round_index(job, u, 0, ref.seq));
        memset(rd->chunk_arrivals, 0, sizeof(rd->chunk_arrivals));
        rd->net_done = false;
        rd->retiring = false;
        rd->unit = u;
        rd->seq = ref.seq;
        rd->start_ns = sd_now_ns();
        SD_DEBUG("net", "job '%s': push round of unit %u (micro-step %llu) starts", job->name, u,
                 (unsigned long long)rd->seq + 1);
        rd->status = SD_OK;
        rd->pending = 0;
        rd->codec = 0;
        for (uint32_t j = 0; j < job->k; j++) /* each rank's gradient into the node partial */
            sd_job_count_copy(job, SD_OP_PUSH, j, 0, sd_unit_bytes(ul));
        /* One rank's fp32 gradient is the node partial as it stands: the reduce-scatter's
         * blocks leave straight from its staging slot (held until the round finishes), and
         * within one node the all-reduce runs in place there. Otherwise the partial is summed
         * into the round's buffer, across nodes block by block, each just before it leaves,
         * this node's own block last: the first send starts after 1/G of the work instead of
         * all of it. */
        uint32_t G = job->gnodes[SD_STATE_G];
        bool direct = job->k == 1 && ul->dtype == SD_DTYPE_FP32 && job->push->g_ident;
        rd->part = direct ? (float *)(void *)sd_job_staging_slot(job, ent[0].s->local, ent[0].slot)
                          : rd->buf;
        rd->next = G; /* no block to post (G 1), or set back to 0 below */
        if (G == 1) {
            if (!direct)
                sd_round_partial(job, rd, ent, ul, 0, ul->numel);
            round_after_rs(rd);
            continue;
        }
        size_t block = ul->numel / G, bytes = block * sizeof(float);
        uint32_t me = job->node % G;
        uint32_t r = rd->index;
        /* ,qg: each block leaves as int4, quantized once (with ,ef after adding the error its
         * last quantization left); ,gwire: rounded once to bf16 or fp16; the received ones are
         * decoded and summed in fp32 when all are in */
        rd->codec = sd_qg_codec(job, u);
        if (job->plan.qg && rd->codec != SD_CODEC_INT4)
            job->stats.quant_fallbacks++;
        size_t wire = rd->codec ? sd_codec_bytes(rd->codec, block, job->plan.qblock) : bytes;
        rd->chunk = sd_bulk_chunk_bytes(wire, 1, job->reg->cfg->chunk_bytes);
        rd->next = 0;
        for (uint32_t i = 0, o = 0; i < G; i++) {
            rd->ticket[i] = 0;
            if (i == me)
                continue;
            if (!direct)
                sd_round_partial(job, rd, ent, ul, (uint64_t)i * block, (uint64_t)(i + 1) * block);
            const float *sp = rd->part + (size_t)i * block;
            if (rd->codec == SD_CODEC_INT4 && job->plan.ef) {
                job->reg->dev->quantize_ef(job->mem.queue, sd_qg_send(job, r, o), SD_CODEC_INT4, sp,
                                           sd_qg_ef(job, u, i), block, job->plan.qblock);
                job->stats.quant_encodes++;
            } else if (rd->codec != 0) {
                sd_gpu_encode(job->reg->dev, job->mem.queue, sd_qg_send(job, r, o), rd->codec, sp,
                              block, job->plan.qblock);
                job->stats.quant_encodes++;
            }
            int st = (!direct || rd->codec) /* the block leaves once the device wrote it */
                         ? job->reg->dev->record(job->mem.queue, &rd->ticket[i])
                         : SD_OK;
            if (st != SD_OK) {
                sd_job_backend_failed(job, st);
                return;
            }
            o++;
        }
        if (!direct)
            sd_round_partial(job, rd, ent, ul, (uint64_t)me * block, (uint64_t)(me + 1) * block);
        if (round_post_blocks(rd) && rd->pending == 0)
            round_after_rs(rd);
    }
}

static void node_round_ready(struct sd_job *job, uint32_t unit, uint64_t seq)
{
    uint32_t tail = (job->push->rq_head + job->push->rq_len) % job->push->rq_cap;
    job->push->round_queue[tail] = (struct sd_round_ref){.unit = unit, .seq = seq};
    job->push->rq_len++;
    round_start_next(job);
}

/* ---- the job's common paths (job_module.h) */

static void push_fail_parked(struct sd_job *job, int status, const char *text, bool with_fetches)
{
    (void)with_fetches;
    if (job->push == NULL || job->push->round_entries == NULL)
        return;
    size_t n = (size_t)job->layout.n_units * job->push->g_groups * job->push->round_gens;
    for (size_t ri = 0; ri < n; ri++) {
        for (uint32_t m = 0; m < job->push->g_members; m++) {
            struct sd_push_entry *ent = &round_ents(job, ri)[m];
            if (ent->s == NULL)
                continue;
            ent->s->staging_busy &= ~(1ULL << ent->slot);
            sd_session_complete(ent->s, ent->tag, SD_OP_PUSH, status, 0, 0, text);
            ent->s = NULL;
        }
        job->push->rounds[ri].arrived = 0;
    }
    job->push->w_len = 0; /* their kernels finish on their own; nothing waits for them */
    for (uint32_t j = 0; job->push->nr != NULL && j < job->push->round_gens; j++)
        sd_allreduce_abort(&job->push->nr[j].ar, status); /* its round ends with it */
}

/* a push round that some ranks of its group joined and others not within op_timeout */
static bool push_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    if (job->state == SD_JOB_LOADING || job->push == NULL || job->push->rounds == NULL)
        return false;
    size_t n_gens = (size_t)job->layout.n_units * job->push->g_groups * job->push->round_gens;
    for (size_t gi = 0; gi < n_gens; gi++) {
        struct sd_push_round *rd = &job->push->rounds[gi];
        if (rd->arrived == 0 || rd->arrived == job->push->g_members ||
            now - rd->first_ns <= op_timeout)
            continue;
        uint32_t g = round_group(job, gi), u = round_unit(job, gi);
        struct sd_push_entry *ent = round_ents(job, gi);
        bool present[1024];
        char missing[128];
        for (uint32_t r = 0; r < job->k && r < 1024; r++)
            present[r] = r / job->push->g_members != g || ent[r % job->push->g_members].s != NULL;
        sd_job_missing_ranks(job, present, missing, sizeof(missing));
        sd_job_fail(job, SD_ETIMEDOUT,
                    "push of unit %u (micro-step %llu): ranks %s did not push within "
                    "%lld ms (op_timeout_ms)",
                    u, (unsigned long long)rd->seq + 1, missing,
                    (long long)job->reg->cfg->op_timeout_ms);
        return true;
    }
    return false;
}

static bool push_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns);

/* a step's end: the next step's pushes are new (the marked last ones counted again) */
static bool push_event(struct sd_job *job, const struct sd_job_ev *ev)
{
    if (ev->kind == SD_JOB_EV_STEP_OVER && job->push->final != NULL)
        memset(job->push->final, 0, (size_t)job->layout.n_units * job->push->g_groups);
    return false;
}

const struct sd_job_module sd_push_module = {.name = "push",
                                             .create = sd_push_create,
                                             .destroy = sd_push_destroy,
                                             .alloc = sd_push_alloc,
                                             .release = sd_push_free,
                                             .fail_parked = push_fail_parked,
                                             .sweep = push_sweep,
                                             .activity = push_activity,
                                             .event = push_event,
                                             .queue_waiting = sd_push_queue_waiting,
                                             .queue_poll = sd_push_queue_poll};

/* ---- its state: geometry, bookkeeping, the node rounds' buffers */

int sd_push_create(struct sd_job *job)
{
    struct sd_push_state *ps = calloc(1, sizeof(*ps));
    if (ps == NULL)
        return SD_ENOMEM;
    uint32_t k = job->k, fg = job->plan.f[SD_STATE_G];
    ps->node_rounds = sd_job_node_rounds(job);
    ps->g_ident = sd_job_net_g_ident(job);
    /* a round inside the node is reduced as soon as it is complete: one generation is enough */
    ps->round_gens = sd_job_push_gens(job);
    if (ps->node_rounds) { /* one round per unit over all local ranks, then the network */
        ps->g_members = k;
        ps->g_groups = 1;
    } else {
        ps->g_members = SD_MIN(fg, k);
        ps->g_groups = k / ps->g_members;
    }
    ps->nr_mem.fd = -1;
    job->push = ps;
    return SD_OK;
}

int sd_push_alloc(struct sd_job *job)
{
    struct sd_push_state *ps = job->push;
    size_t n_rounds = (size_t)job->layout.n_units * ps->g_groups;
    ps->rounds = calloc(n_rounds * ps->round_gens, sizeof(*ps->rounds));
    ps->round_entries =
        calloc(n_rounds * ps->round_gens * ps->g_members, sizeof(*ps->round_entries));
    ps->rounds_done = calloc(n_rounds, sizeof(*ps->rounds_done));
    ps->final = calloc(n_rounds, sizeof(*ps->final));
    ps->w_cap = (uint32_t)(n_rounds * ps->round_gens);
    ps->waits = calloc(ps->w_cap, sizeof(*ps->waits));
    return ps->rounds && ps->round_entries && ps->rounds_done && ps->final && ps->waits ? SD_OK
                                                                                        : SD_ENOMEM;
}

void sd_push_free(struct sd_job *job)
{
    struct sd_push_state *ps = job->push;
    if (ps == NULL)
        return;
    if (ps->nr_mem.ptr != NULL)
        job->reg->dev->free(&ps->nr_mem);
    free(ps->rounds);
    free(ps->round_entries);
    free(ps->rounds_done);
    free(ps->final);
    free(ps->waits);
    ps->final = NULL;
    ps->rounds = NULL;
    ps->round_entries = NULL;
    ps->rounds_done = NULL;
    ps->waits = NULL;
    ps->w_len = ps->w_cap = 0;
}

void sd_push_destroy(struct sd_job *job)
{
    sd_push_net_teardown(job);
    sd_push_free(job);
    free(job->push);
    job->push = NULL;
}

bool sd_push_idle(const struct sd_job *job)
{
    return job->push == NULL ||
           (job->push->nr_len == 0 && job->push->rq_len == 0 && job->push->w_len == 0);
}

/* the job's common paths (job_module.h): the oldest node round on the wire */
static bool push_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns)
{
    const struct sd_push_state *ps = job->push;
    if (ps == NULL || ps->nr_len == 0)
        return false;
    const struct sd_node_round *rd = &ps->nr[ps->nr_head];
    snprintf(what, len, "push of unit %u (micro-step %llu; last completed %llu)", rd->unit,
             (unsigned long long)rd->seq + 1, (unsigned long long)rd->seq);
    *since_ns = rd->start_ns;
    return true;
}

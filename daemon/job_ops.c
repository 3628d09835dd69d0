/* The data-plane operations of a job among the ranks of this node (DESIGN.md section 3):
 * fetch (all-gather of a unit's w shards into a slot of the gather pool, shared by the node's
 * ranks), release, push (reduce-scatter of the ranks' gradients into fp32 g shards, every
 * micro-step), step (all-reduce of g shards across the replication group, the 2-hop sync, then
 * the optimizer on fp32 master weights and the cast into w), init and ready.
 *
 * Reduction order is fixed: within a partition group contributions are summed in rank order
 * into a scratch buffer that is then added to the g shard; across the replication group the
 * group partials are summed in group order. */
#include "daemon.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define OP_MSG_LEN SD_CQE_MSG_LEN

static void complete_ok(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                        uint64_t v0, uint64_t v1, uint64_t start_ns)
{
    job->stats.ops[e->op]++;
    sd_latency_add(&job->stats.lat[e->op], sd_now_ns() - start_ns);
    sd_session_complete(s, e->tag, (int)e->op, SD_OK, v0, v1, NULL);
}

/* Common checks; returns false after failing the entry. */
static bool check_ready(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                        bool needs_unit)
{
    /* after a clean detach the shards are intact: fetch and release still work (to read the
     * final weights); collectives that need every rank do not */
    bool local_op = e->op == SD_OP_FETCH || e->op == SD_OP_RELEASE;
    if (job->state == SD_JOB_FAILED || (job->state == SD_JOB_CLOSING && !local_op)) {
        sd_session_fail(s, e, SD_EJOBFAILED, "%s: job '%s' %s: %s", sd_op_name((int)e->op),
                        job->name, sd_job_state_name(job->state), job->fail_msg);
        return false;
    }
    if (job->state != SD_JOB_READY && job->state != SD_JOB_CLOSING) {
        sd_session_fail(s, e, SD_ESTATE,
                        "%s: job '%s' is still %s (rank 0 has not loaded the initial values)",
                        sd_op_name((int)e->op), job->name, sd_job_state_name(job->state));
        return false;
    }
    if (needs_unit && e->unit >= job->layout.n_units) {
        sd_session_fail(s, e, SD_ENOUNIT, "%s: unit %u does not exist (job '%s' has units 0..%u)",
                        sd_op_name((int)e->op), e->unit, job->name, job->layout.n_units - 1);
        return false;
    }
    return true;
}

/* Gather unit u's w shards of the partition group of `rank` (inside this node) into the slot. */
void sd_job_local_gather(struct sd_job *job, struct sd_unit_state *us, uint32_t rank)
{
    uint64_t cpu0 = sd_job_issue_clock(job);
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint32_t u = us->unit;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint32_t f = job->plan.f[SD_STATE_W];
    struct sd_group grp = sd_group_partition(f, rank);
    uint64_t shard_bytes = sd_job_w_shard_bytes(job, u);
    uint8_t *dst = (uint8_t *)job->pool.ptr + us->pool_off;
    for (uint32_t i = 0; i < grp.count; i++) {
        uint32_t local = sd_group_member(&grp, i) - job->first_rank;
        dev->copy(dst + i * shard_bytes, sd_job_w_shard(job, local, u), shard_bytes);
    }
    job->stats.bytes[SD_OP_FETCH][SD_LINK_INTRA] += sd_unit_bytes(ul);
    job->stats.gathers++;
    sd_job_issue_count(job, cpu0);
}

/* Find room in the pool, evicting cached slots nobody holds (least recently released first). */
int sd_job_pool_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p)
{
    int planned = sd_sched_reserve(job, bytes, off_p); /* the frozen schedule's place */
    if (planned != SD_ENOENT)
        return planned;
    for (;;) {
        if (sd_slot_pool_alloc(&job->spool, bytes, SD_CACHELINE, off_p) == SD_OK)
            return SD_OK;
        uint32_t victim = UINT32_MAX;
        uint64_t oldest = UINT64_MAX;
        for (uint32_t v = 0; v < job->n_slots; v++) {
            struct sd_unit_state *us = &job->units[v];
            if (us->resident && !us->inflight && us->refs == 0 && us->lru_tick < oldest) {
                oldest = us->lru_tick;
                victim = v;
            }
        }
        if (victim == UINT32_MAX)
            return SD_ENOSPC;
        sd_job_evict(job, &job->units[victim]);
    }
}

void sd_job_evict(struct sd_job *job, struct sd_unit_state *us)
{
    sd_slot_pool_free(&job->spool, us->pool_off);
    us->resident = false;
    us->plan_iv = SD_SCHED_NONE;
    job->stats.evictions++;
}

/* Does another rank hold a gathered unit (space it will give back)? A rank that fills the pool
 * by itself gets an error; one that waits for the others' releases waits. */
bool sd_job_others_hold(const struct sd_job *job, const struct sd_session *s)
{
    for (uint32_t i = 0; i < job->n_slots; i++) {
        const struct sd_unit_state *us = &job->units[i];
        if (us->inflight || (us->resident && us->refs > s->holds[us->unit]))
            return true;
    }
    return false;
}

/* A gather finished (or failed): answer every rank waiting for it. */
void sd_job_complete_fetch(struct sd_job *job, struct sd_unit_state *us)
{
    /* answering a fetch is part of what it costs: inside its call scheduled_op counts it; a
     * fetch that waited for its gather is answered here, later */
    struct sd_job_sched *sc = &job->sched;
    bool timed = !sc->in_call;
    uint64_t cpu0 = timed ? sd_thread_cpu_ns() : 0;
    const struct sd_unit_layout *ul = &job->layout.units[us->unit];
    uint64_t now = sd_now_ns();
    for (uint32_t r = 0; r < job->k && us->waiters; r++) {
        if (!(us->waiters & (1ULL << r)))
            continue;
        us->waiters &= ~(1ULL << r);
        struct sd_session *s = job->ranks[r];
        uint64_t tag = job->wait_tags[(size_t)(us - job->units) * job->k + r];
        if (s == NULL)
            continue;
        if (us->status != SD_OK) {
            char msg[OP_MSG_LEN];
            snprintf(msg, sizeof(msg), "fetch unit %u: job '%.40s' %s: %.100s", us->unit, job->name,
                     sd_job_state_name(job->state), job->fail_msg);
            job->stats.errors++;
            sd_session_complete(s, tag, SD_OP_FETCH,
                                job->fail_status ? job->fail_status : us->status, 0, 0, msg);
            continue;
        }
        us->refs++;
        s->holds[us->unit]++;
        job->stats.ops[SD_OP_FETCH]++;
        sd_latency_add(&job->stats.lat[SD_OP_FETCH], now - us->start_ns);
        sd_session_complete(s, tag, SD_OP_FETCH, SD_OK, us->pool_off, sd_unit_bytes(ul), NULL);
    }
    if (timed)
        sc->cpu_ns[sc->state == SD_SCHED_FROZEN && !sc->deviated] += sd_thread_cpu_ns() - cpu0;
}

static bool op_fetch(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start)
{
    struct sd_unit_state *us = sd_job_slot(job, e->unit, s->local);
    const struct sd_unit_layout *ul = &job->layout.units[e->unit];
    if (job->group_nodes > 1)
        return sd_job_net_fetch(job, s, e, us);
    if (us->resident && us->gen != job->weights_gen && us->refs == 0) {
        sd_slot_pool_free(&job->spool, us->pool_off);
        us->resident = false;
    }
    if (!us->resident) {
        uint64_t off;
        int st = sd_job_pool_reserve(job, sd_unit_bytes(ul), &off);
        if (st == SD_EAGAIN || (st == SD_ENOSPC && sd_job_others_hold(job, s)))
            return false; /* other ranks still use the space: wait for their releases */
        if (st != SD_OK) {
            char b1[32], b2[32], b3[32];
            sd_session_fail(s, e, SD_ENOSPC,
                            "fetch unit %u needs %s; the gather pool (%s) has %s held by "
                            "unreleased units: release units or raise max_live_bytes",
                            e->unit, sd_fmt_bytes(b1, sizeof(b1), sd_unit_bytes(ul)),
                            sd_fmt_bytes(b2, sizeof(b2), job->spool.capacity),
                            sd_fmt_bytes(b3, sizeof(b3), sd_slot_pool_used_bytes(&job->spool)));
            return true;
        }
        us->pool_off = off;
        sd_job_local_gather(job, us, s->rank);
        us->resident = true;
        us->gen = job->weights_gen;
    } else {
        job->stats.cache_hits++;
    }
    us->refs++;
    s->holds[e->unit]++;
    complete_ok(job, s, e, us->pool_off, sd_unit_bytes(ul), start);
    return true;
}

static void op_release(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
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
    s->holds[e->unit]--;
    us->refs--;
    if (us->refs == 0)
        us->lru_tick = ++job->tick;
    complete_ok(job, s, e, 0, 0, start);
}

void sd_job_release_holds(struct sd_job *job, struct sd_session *s)
{
    if (s->holds == NULL || job->units == NULL)
        return;
    for (uint32_t u = 0; u < job->layout.n_units; u++) {
        struct sd_unit_state *us = sd_job_slot(job, u, s->local);
        us->refs -= s->holds[u];
        if (s->holds[u] && us->refs == 0)
            us->lru_tick = ++job->tick;
        s->holds[u] = 0;
        us->waiters &= ~(1ULL << s->local);
    }
}

/* All members of a g-partition group (inside this node) pushed unit u: reduce-scatter into
 * their g shards. */
static void reduce_round(struct sd_job *job, uint32_t u, uint32_t g)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t n = job->rounds_done[(size_t)u * job->g_groups + g];
    struct sd_push_entry *ent = sd_job_round_ents(job, sd_job_round_index(job, u, g, n));
    uint32_t f = job->g_members;
    uint64_t len = ul->numel / f;
    size_t esz = sd_dtype_size(ul->dtype);

    for (uint32_t i = 0; i < f; i++) {
        uint32_t holder = g * f + i; /* local index of the rank holding shard i */
        float *dst = sd_job_g_shard(job, holder, ul);
        for (uint32_t m = 0; m < f; m++) {
            const uint8_t *src =
                sd_job_staging_slot(job, ent[m].s->local, ent[m].slot) + i * len * esz;
            if (m == 0)
                dev->to_f32(job->scratch, src, ul->dtype, len);
            else
                dev->reduce_add(job->scratch, src, ul->dtype, len);
        }
        dev->reduce_add(dst, job->scratch, SD_DTYPE_FP32, len);
    }
    job->stats.bytes[SD_OP_PUSH][SD_LINK_INTRA] += (uint64_t)f * sd_unit_bytes(ul);
    sd_job_finish_round(job, u, g);
}

/* Complete the pushes of the oldest round of (u, g), which just finished, and free its
 * generation for round n + round_gens. */
void sd_job_finish_round(struct sd_job *job, uint32_t u, uint32_t g)
{
    uint64_t *done = &job->rounds_done[(size_t)u * job->g_groups + g];
    size_t gi = sd_job_round_index(job, u, g, *done);
    struct sd_push_round *rd = &job->rounds[gi];
    struct sd_push_entry *ent = sd_job_round_ents(job, gi);
    uint64_t now = sd_now_ns();
    for (uint32_t m = 0; m < job->g_members; m++) {
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
}

/* Returns false to stall: this rank already has a push of this unit waiting in every round
 * generation (it is round_gens micro-steps ahead of its group). */
static bool op_push(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    const struct sd_unit_layout *ul = &job->layout.units[e->unit];
    if (e->arg0 >= job->staging_slots) {
        sd_session_fail(s, e, SD_EINVAL,
                        "push unit %u: staging slot %llu does not exist (%u "
                        "slots)",
                        e->unit, (unsigned long long)e->arg0, job->staging_slots);
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
    uint32_t g = s->local / job->g_members, m = s->local % job->g_members;
    /* a rank's pushes fill the rounds in order: its next is the oldest round it is not in */
    uint64_t n = job->rounds_done[(size_t)e->unit * job->g_groups + g];
    uint64_t last = n + job->round_gens;
    while (n < last && sd_job_round_ents(job, sd_job_round_index(job, e->unit, g, n))[m].s != NULL)
        n++;
    if (n == last)
        return false; /* ahead of its group: wait for the oldest round to finish */
    if (s->staging_busy & (1ULL << e->arg0)) {
        sd_session_fail(s, e, SD_EBUSY,
                        "push unit %u: staging slot %llu still holds an earlier push that has "
                        "not completed",
                        e->unit, (unsigned long long)e->arg0);
        return true;
    }
    size_t gi = sd_job_round_index(job, e->unit, g, n);
    struct sd_push_round *rd = &job->rounds[gi];
    struct sd_push_entry *ent = &sd_job_round_ents(job, gi)[m];
    uint64_t now = sd_now_ns();
    s->staging_busy |= 1ULL << e->arg0;
    *ent =
        (struct sd_push_entry){.s = s, .tag = e->tag, .arrive_ns = now, .slot = (uint32_t)e->arg0};
    if (rd->arrived++ == 0) {
        rd->first_ns = now;
        rd->seq = n;
    }
    if (rd->arrived == job->g_members) {
        if (job->node_rounds)
            sd_job_net_round_ready(job, e->unit, n);
        else
            reduce_round(job, e->unit, g);
    }
    return true;
}

/* Is any push round partly filled? Describes the first in msg. */
static bool partial_round(struct sd_job *job, char *msg, size_t len)
{
    size_t n = (size_t)job->layout.n_units * job->g_groups * job->round_gens;
    for (size_t gi = 0; gi < n; gi++) {
        if (job->rounds[gi].arrived == 0)
            continue;
        uint32_t u = sd_job_round_unit(job, gi);
        struct sd_push_entry *ent = sd_job_round_ents(job, gi);
        size_t off = (size_t)snprintf(msg, len, "step %llu: unit %u has gradients from ranks",
                                      (unsigned long long)job->steps + 1, u);
        for (uint32_t m = 0; m < job->g_members && off < len; m++)
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

/* Re-gather units that are held across the step so their holders see the new weights. */
static void refresh_held(struct sd_job *job)
{
    for (uint32_t i = 0; i < job->n_slots; i++) {
        struct sd_unit_state *us = &job->units[i];
        if (!us->resident || us->refs == 0)
            continue;
        sd_job_local_gather(job, us, job->first_rank + us->lslot);
        us->gen = job->weights_gen;
    }
}

/* The optimizer part of a step on this node, once the gradients are synchronized and the
 * global sum of squares is known. */
void sd_job_step_apply(struct sd_job *job, double sumsq)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_layout *l = &job->layout;
    const struct sd_optim *o = &job->model.optim;
    uint32_t f = job->plan.f[SD_STATE_G];
    uint64_t t = job->steps + 1;
    double norm = sqrt(sumsq) / (double)job->world;
    float scale = 1.0f / (float)job->world;
    if (o->max_grad_norm > 0.0f && norm > (double)o->max_grad_norm)
        scale = scale * (float)((double)o->max_grad_norm / (norm + 1e-6));

    /* every rank's optimizer shard: master weights, moments, cast into its w shard */
    uint64_t os_stride = sd_arena_os_stride(l->arena_numel[SD_STATE_OS]);
    for (uint32_t r = 0; r < job->k; r++) {
        float *os = sd_job_state(job, r, SD_STATE_OS);
        float *g = sd_job_state(job, r, SD_STATE_G);
        uint8_t *w = sd_job_state(job, r, SD_STATE_W);
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            uint64_t off = ul->arena_off[SD_STATE_OS], len = ul->numel / f;
            float *gp = g + ul->arena_off[SD_STATE_G];
            if (o->kind == SD_OPTIM_ADAMW) {
                struct sd_adamw_args a = {.lr = o->lr,
                                          .beta1 = o->beta1,
                                          .beta2 = o->beta2,
                                          .eps = o->eps,
                                          .weight_decay = o->weight_decay,
                                          .step = t};
                dev->adamw(&a, os + off, os + os_stride + off, os + 2 * os_stride + off, gp, scale,
                           w + job->w_off[u], ul->dtype, len);
            } else {
                struct sd_sgd_args a = {
                    .lr = o->lr, .momentum = o->momentum, .weight_decay = o->weight_decay};
                dev->sgd(&a, os + off, os + os_stride + off, gp, scale, w + job->w_off[u],
                         ul->dtype, len);
            }
        }
    }
    job->steps = t;
    job->weights_gen++;
    job->last_grad_norm = norm;
    if (job->group_nodes == 1)
        refresh_held(job);
}

/* Answer every rank waiting in step. */
void sd_job_step_done(struct sd_job *job)
{
    sd_sched_step_done(job); /* freeze or rewind the schedule; first prefetches */
    uint64_t bits, now = sd_now_ns();
    double norm = job->last_grad_norm;
    memcpy(&bits, &norm, sizeof(bits));
    for (uint32_t r = 0; r < job->k; r++) {
        if (!job->step_waiting[r] || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_STEP]++;
        sd_latency_add(&job->stats.lat[SD_OP_STEP], now - job->step_arrive_ns[r]);
        sd_session_complete(job->ranks[r], job->step_tags[r], SD_OP_STEP, SD_OK, bits, job->steps,
                            NULL);
        job->step_waiting[r] = false;
    }
    job->step_arrived = 0;
}

static void do_step(struct sd_job *job)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_layout *l = &job->layout;
    uint32_t f = job->plan.f[SD_STATE_G];
    uint32_t replicas = job->k / f;
    char msg[OP_MSG_LEN];

    if (partial_round(job, msg, sizeof(msg))) {
        sd_job_fail(job, SD_EMISMATCH, "%s", msg);
        return;
    }
    if (job->nodes > 1) {
        sd_job_net_step(job);
        return;
    }
    /* one node: all-reduce across each replication group (the 2-hop sync), and the norm */
    double sumsq = 0.0;
    for (uint32_t u = 0; u < l->n_units; u++) {
        const struct sd_unit_layout *ul = &l->units[u];
        uint64_t len = ul->numel / f;
        for (uint32_t i = 0; i < f; i++) {
            float *acc = sd_job_g_shard(job, i, ul);
            for (uint32_t j = 1; j < replicas; j++)
                dev->reduce_add(acc, sd_job_g_shard(job, j * f + i, ul), SD_DTYPE_FP32, len);
            sumsq += dev->sum_sq(acc, len);
            for (uint32_t j = 1; j < replicas; j++)
                dev->copy(sd_job_g_shard(job, j * f + i, ul), acc, len * sizeof(float));
        }
        if (replicas > 1)
            job->stats.bytes[SD_OP_STEP][SD_LINK_INTRA] +=
                2ULL * (replicas - 1) * ul->numel * sizeof(float);
    }
    sd_job_step_apply(job, sumsq);
    sd_job_step_done(job);
}

static void op_step(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    if (job->step_waiting[s->local]) {
        sd_session_fail(s, e, SD_EBUSY, "step: rank %u already waits in step %llu", s->rank,
                        (unsigned long long)job->steps + 1);
        return;
    }
    uint64_t now = sd_now_ns();
    job->step_waiting[s->local] = true;
    job->step_tags[s->local] = e->tag;
    job->step_arrive_ns[s->local] = now;
    if (job->step_arrived++ == 0)
        job->step_first_ns = now;
    if (job->step_arrived == job->k && sd_sched_step_check(job))
        do_step(job);
}

/* Initial fp32 values of a whole unit into this node's shards (master and w). */
void sd_job_load_unit(struct sd_job *job, uint32_t unit, const float *src)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[unit];
    uint32_t f = job->plan.f[SD_STATE_OS];
    uint64_t len = ul->numel / f;
    for (uint32_t r = 0; r < job->k; r++) {
        uint64_t b, end;
        sd_layout_shard(ul, f, job->first_rank + r, &b, &end);
        float *master = (float *)sd_job_state(job, r, SD_STATE_OS) + ul->arena_off[SD_STATE_OS];
        dev->copy(master, src + b, len * sizeof(float));
        dev->from_f32(sd_job_w_shard(job, r, unit), ul->dtype, src + b, len);
    }
}

static void op_init(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                    uint64_t start)
{
    if (s->rank != 0) {
        sd_session_fail(s, e, SD_EPERM, "init: only rank 0 loads initial values (this is rank %u)",
                        s->rank);
        return;
    }
    if (job->state != SD_JOB_LOADING) {
        sd_session_fail(s, e, SD_ESTATE, "init: job '%s' is %s, not loading", job->name,
                        sd_job_state_name(job->state));
        return;
    }
    if (e->unit >= job->layout.n_units || e->arg0 >= job->staging_slots) {
        sd_session_fail(s, e, SD_EINVAL, "init: unit %u or staging slot %llu out of range", e->unit,
                        (unsigned long long)e->arg0);
        return;
    }
    const float *src = (const float *)(void *)sd_job_staging_slot(job, s->local, (uint32_t)e->arg0);
    sd_job_load_unit(job, e->unit, src);
    if (job->nodes > 1) {
        job->stats.ops[SD_OP_INIT]++;
        sd_latency_add(&job->stats.lat[SD_OP_INIT], sd_now_ns() - start);
        sd_job_net_init_sent(job, s, e, src); /* completes once the other nodes have it */
        return;
    }
    complete_ok(job, s, e, 0, 0, start);
}

/* The job is ready on this node: answer every rank waiting in the ready barrier. */
void sd_job_set_ready(struct sd_job *job)
{
    if (job->state != SD_JOB_LOADING)
        return;
    job->state = SD_JOB_READY;
    job->was_ready = true;
    SD_INFO("job", "job '%s' ready", job->name);
    for (uint32_t r = 0; r < job->k; r++) {
        if (!job->ready_waiting[r] || job->ranks[r] == NULL)
            continue;
        job->ready_waiting[r] = false;
        job->stats.ops[SD_OP_READY]++;
        sd_session_complete(job->ranks[r], job->ready_tags[r], SD_OP_READY, SD_OK, 0, 0, NULL);
    }
}

static void op_ready(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start)
{
    if (job->state == SD_JOB_READY || (job->state == SD_JOB_CLOSING && job->was_ready)) {
        complete_ok(job, s, e, 0, 0, start);
        return;
    }
    job->ready_waiting[s->local] = true;
    job->ready_tags[s->local] = e->tag;
    if (s->rank != 0)
        return;
    if (job->nodes > 1)
        sd_job_net_ready(job); /* tells the other nodes */
    sd_job_set_ready(job);
}

/* fetch, release and push: matched against the schedule, recorded, counted */
static bool scheduled_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                         uint64_t start)
{
    uint64_t allocs0 = sd_alloc_calls();
    uint64_t cpu0 = e->op == SD_OP_FETCH ? sd_thread_cpu_ns() : 0;
    uint64_t issue0 = job->sched.issue_ns_in_call;
    job->sched.in_call = e->op == SD_OP_FETCH; /* its answer, if at once, is timed here */
    uint32_t pos = sd_sched_before(job, s, e);
    bool consumed = true;
    if (e->op == SD_OP_FETCH)
        consumed = op_fetch(job, s, e, start);
    else if (e->op == SD_OP_RELEASE)
        op_release(job, s, e, start);
    else
        consumed = op_push(job, s, e);
    /* what the call cost, the prefetches it issued included */
    bool frozen = sd_sched_after(job, s, e, pos, consumed);
    job->sched.in_call = false;
    uint64_t allocs = sd_alloc_calls() - allocs0;
    job->stats.allocs_after_register += allocs;
    if (frozen)
        job->sched.allocs_frozen += allocs;
    if (e->op == SD_OP_FETCH) {
        job->sched.cpu_ns[frozen] += sd_thread_cpu_ns() - cpu0;
        job->sched.issue_ns[frozen] += job->sched.issue_ns_in_call - issue0;
        job->sched.fetches[frozen] += consumed;
    }
    return consumed;
}

bool sd_job_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    uint64_t start = sd_now_ns();
    switch (e->op) {
    case SD_OP_FETCH:
    case SD_OP_RELEASE:
    case SD_OP_PUSH:
        if (check_ready(job, s, e, true))
            return scheduled_op(job, s, e, start);
        return true;
    case SD_OP_STEP:
        if (check_ready(job, s, e, false))
            op_step(job, s, e);
        return true;
    case SD_OP_DROP:
        if (check_ready(job, s, e, true)) {
            struct sd_unit_state *us = sd_job_slot(job, e->unit, s->local);
            if (us->resident && !us->inflight && us->refs == 0) {
                sd_slot_pool_free(&job->spool, us->pool_off);
                us->resident = false;
            }
            complete_ok(job, s, e, 0, 0, start);
        }
        return true;
    case SD_OP_INIT:
        if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
            check_ready(job, s, e, false);
        else
            op_init(job, s, e, start);
        return true;
    case SD_OP_READY:
        if (job->state == SD_JOB_FAILED || (job->state == SD_JOB_CLOSING && !job->was_ready))
            check_ready(job, s, e, false);
        else
            op_ready(job, s, e, start);
        return true;
    default:
        sd_session_fail(s, e, SD_EINVAL, "unknown operation code %u", e->op);
        return true;
    }
}

void sd_job_fail_parked(struct sd_job *job, int status, const char *msg, bool with_fetches)
{
    char text[OP_MSG_LEN];
    snprintf(text, sizeof(text), "job '%s' failed: %s", job->name, msg);
    if (job->round_entries != NULL) {
        size_t n = (size_t)job->layout.n_units * job->g_groups * job->round_gens;
        for (size_t ri = 0; ri < n; ri++) {
            for (uint32_t m = 0; m < job->g_members; m++) {
                struct sd_push_entry *ent = &sd_job_round_ents(job, ri)[m];
                if (ent->s == NULL)
                    continue;
                ent->s->staging_busy &= ~(1ULL << ent->slot);
                sd_session_complete(ent->s, ent->tag, SD_OP_PUSH, status, 0, 0, text);
                ent->s = NULL;
            }
            job->rounds[ri].arrived = 0;
        }
    }
    for (uint32_t i = 0; with_fetches && job->units != NULL && i < job->n_slots; i++) {
        struct sd_unit_state *us = &job->units[i];
        if (us->waiters == 0)
            continue;
        us->status = status;
        sd_job_complete_fetch(job, us);
    }
    if (job->init_waiter != NULL) {
        sd_session_complete(job->init_waiter, job->init_tag, SD_OP_INIT, status, 0, 0, text);
        job->init_waiter = NULL;
    }
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        if (job->step_waiting[r] && s != NULL)
            sd_session_complete(s, job->step_tags[r], SD_OP_STEP, status, 0, 0, text);
        if (job->ready_waiting[r] && s != NULL)
            sd_session_complete(s, job->ready_tags[r], SD_OP_READY, status, 0, 0, text);
        job->step_waiting[r] = job->ready_waiting[r] = false;
        if (s != NULL && s->has_stalled) {
            sd_session_complete(s, s->stalled.tag, (int)s->stalled.op, status, 0, 0, text);
            s->has_stalled = false;
        }
    }
    job->step_arrived = 0;
}

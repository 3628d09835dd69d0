/* Step: the barrier of the local ranks at the accumulation boundary, then one phase machine
 * (DESIGN.md section 3, step 5): SYNC waits for the micro-steps' rounds and gathers, and with the
 * 2-hop sync all-reduces the g shards across the replication group once per step; NORM exchanges
 * each node's squared norm (summed in node order) with the schedule digests; APPLY runs the
 * optimizer once no peer still reads this generation's weights; REFRESH gathers the units held
 * across the step again. On one node SYNC reduces the replicas inside the node, NORM has
 * nothing to exchange, and the phases run through in one call. */
#include "schedule.h"
#include "net.h"
#include "job_module.h"
#include "fetch.h"
#include "push.h"
#include "step.h"
#include "step_int.h"
#include "hop.h"
#include "optimizer.h"
#include "weights.h"
#include "quant.h"
#include "session.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

_Static_assert(sizeof(struct sd_norm_part) == 32, "the norm exchange is 32 bytes (schedule.h)");

/* Re-gather units that are held across the step so their holders see the weights of
 * generation gen. The job is still at the generation before (declared once the queue ran the
 * step's kernels): the gathers are made as of gen, so that the int8 encodings and secondary
 * copies labelled with the current generation are encoded and refilled from the new w shards
 * (behind the update on the queue) instead of read: read, they put the old weights into the
 * slots under the new generation's label. */
static void refresh_held(struct sd_job *job, uint64_t gen)
{
    uint64_t current = job->weights_gen;
    job->weights_gen = gen;
    for (uint32_t i = 0; i < job->n_slots; i++) {
        struct sd_unit_state *us = &job->cache.units[i];
        if (!us->resident || us->refs == 0)
            continue;
        sd_fetch_local_gather(job, us);
        us->gen = gen;
    }
    job->weights_gen = current;
}

/* The optimizer updated every os shard, and the weights' all-gather brought every w shard the
 * parts other ranks own: the w copies are written, and units held across the step are gathered
 * again so their holders see them (across nodes the REFRESH phase does it). Kernels only: the
 * generation is declared (weights_new) once the queue reached them. */
static void weights_write(struct sd_job *job)
{
    sd_weights_local(job);
    /* releases the trainers' streams signalled by now are no holds to refresh */
    sd_fetch_fenced_poll(job);
    if (job->gnodes[SD_STATE_W] == 1)
        refresh_held(job, job->weights_gen + 1);
}

/* the weights of the next generation are there: served to peers, read by their holders */
static void weights_new(struct sd_job *job)
{
    job->steps++;
    sd_optim_weights_new(job);
    job->weights_gen++;
}

/* Wait for the kernels enqueued so far without blocking the loop (DESIGN.md 7b): true when they
 * are done (at once on the host backends); false when the phase machine must wait for them
 * (q_wait: the loop polls, sd_step_queue_poll, and the machine goes on from its phase) or the
 * job failed (a backend's error). */
static bool step_queue_done(struct sd_job *job)
{
    int st = job->step->q_wait ? job->reg->dev->query(job->mem.queue, job->step->q_ticket)
                               : sd_job_queue_mark(job, false, &job->step->q_ticket);
    job->step->q_wait = st == SD_EAGAIN;
    if (st == SD_OK)
        return true;
    if (st != SD_EAGAIN)
        sd_job_backend_failed(job, st);
    return false;
}

bool sd_step_queue_poll(struct sd_job *job)
{
    /* the boundary hop's all-reduce: its end goes on with the step (step_ar_done) */
    bool moved = sd_allreduce_waiting(&job->step->ar) && sd_allreduce_poll(&job->step->ar);
    if (!job->step->q_wait)
        return moved;
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING) {
        job->step->q_wait = false;
        return moved;
    }
    sd_step_progress(job);
    return moved || !job->step->q_wait;
}

/* Answer every rank waiting in step: SD_OK with the norm, or status and msg. */
static void step_answer(struct sd_job *job, int status, const char *msg)
{
    sd_hop_reset(job);
    sd_sched_step_done(job); /* freeze or rewind the schedule; first prefetches */
    uint64_t bits, now = sd_now_ns();
    double norm = sd_optim_grad_norm(job);
    memcpy(&bits, &norm, sizeof(bits));
    struct sd_req q;
    for (uint32_t r = 0; r < job->k; r++) {
        if (!sd_barrier_take(&job->step->bar, r, &q) || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_STEP]++;
        sd_latency_add(&job->stats.lat[SD_OP_STEP], now - q.since_ns);
        sd_session_complete(job->ranks[r], q.tag, SD_OP_STEP, status, bits, job->steps, msg);
    }
    sd_job_event(job, SD_JOB_EV_STEP_OVER); /* a rank died in the step: the job pauses now */
}

static void step_done(struct sd_job *job)
{
    step_answer(job, SD_OK, NULL);
}

/* A trainer optimizer's hand-off: every local rank's step call answered with the norm and the
 * gradient sums' factor; each rank reads its gradient, masters and states (SD_STATE_OWN), writes
 * the updated ones and calls step again with SD_STEP_ARG_UPDATED (handoff_taken). */
static void handoff(struct sd_job *job)
{
    job->step->phase = SD_STEP_TRAINER;
    job->step->handoff_ns = sd_now_ns();
    double norm = sd_optim_grad_norm(job), scale = (double)sd_optimizer_handoff_scale(job);
    uint64_t nbits, sbits;
    memcpy(&nbits, &norm, sizeof(nbits));
    memcpy(&sbits, &scale, sizeof(sbits));
    struct sd_req q;
    for (uint32_t r = 0; r < job->k; r++)
        if (sd_barrier_take(&job->step->bar, r, &q) && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], q.tag, SD_OP_STEP, SD_OK, nbits, sbits, NULL);
}

/* the os shards hold the step's update: its weights go out (WEIGHTS, after the update's
 * kernels when they cross nodes); false when the queue must reach them first */
static bool weights_phase(struct sd_job *job)
{
    job->step->phase = SD_STEP_WEIGHTS;
    job->step->unit = 0;
    job->step->pending = 0;
    job->step->status = SD_OK;
    job->step->encoded = false;
    /* the exchanges send the owners' new parts */
    return !sd_job_weights_remote(job) || step_queue_done(job);
}

/* every local rank wrote its trainer optimizer's update */
static void handoff_taken(struct sd_job *job)
{
    sd_optimizer_take_update(job);
    if (weights_phase(job))
        sd_step_progress(job);
}

/* the first unit whose sum of squares among n parts is not finite (unit of part p: unit_of),
 * or UINT32_MAX */
static uint32_t nonfinite_unit(const double *parts, size_t n, uint32_t (*unit_of)(size_t, uint32_t),
                               uint32_t arg)
{
    uint32_t bad = UINT32_MAX;
    for (size_t p = 0; p < n; p++)
        if (!isfinite(parts[p]))
            bad = SD_MIN(bad, unit_of(p, arg));
    return bad;
}

static uint32_t unit_major(size_t p, uint32_t per_unit)
{
    return (uint32_t)(p / per_unit);
}

static uint32_t rank_major(size_t p, uint32_t n_units)
{
    return (uint32_t)(p % n_units);
}

/* A skipped step: every rank's step fails with status and msg, the accumulated gradients are
 * discarded, the weights, the optimizer state and the step count stay as they were, and the job
 * goes on (the next micro-steps accumulate afresh, like a GradScaler's skipped step). Every node
 * decides alike from the exchanged norm parts. */
static void step_skip(struct sd_job *job, int status, const char *msg, bool routine)
{
    /* enqueued, not waited for: whatever reads the g shards next (a push round's reduction, the
     * step's sums and packing, a node round's partial) is a kernel on the same queue */
    for (uint32_t r = 0; r < job->k; r++)
        job->reg->dev->zero(job->mem.queue, sd_job_state(job, r, SD_STATE_G),
                            job->layout.arena_numel[SD_STATE_G] * sizeof(float));
    if (routine)
        SD_INFO("job", "job '%s': %s", job->name, msg);
    else
        SD_WARN("job", "job '%s': %s", job->name, msg);
    job->step->phase = SD_STEP_IDLE;
    step_answer(job, status, msg);
}

/* A gradient that is not finite (a NaN or an infinity in unit `unit`, or UINT32_MAX: finite parts
 * whose sum of squares overflowed) fails the step on every rank with SD_ENONFINITE, as torch's
 * clip_grad_norm_(error_if_nonfinite=True) raises, and the step is skipped. Under a loss scale
 * that is a dynamic scaler's overflow, GradScaler's found_inf: routine, logged as information. */
static void step_nonfinite(struct sd_job *job, uint32_t unit)
{
    double S = job->step->rank_scale[0];
    job->stats.steps_nonfinite++;
    job->stats.steps_nonfinite_scaled += S != 1.0;
    job->stats.loss_scale = S;
    char msg[SD_OP_MSG_LEN], under[64] = "";
    unsigned long long step = (unsigned long long)job->steps + 1;
    if (S != 1.0)
        snprintf(under, sizeof(under), " under loss scale %g", S);
    if (unit != UINT32_MAX)
        snprintf(msg, sizeof(msg),
                 "step %llu: unit %u (first tensor '%.60s') has a non-finite gradient (NaN or "
                 "inf)%s: step skipped, gradients discarded, weights unchanged",
                 step, unit, job->model.tensors[job->layout.units[unit].first_tensor].name, under);
    else
        snprintf(msg, sizeof(msg),
                 "step %llu: the gradient norm is not finite (its sum of squares overflowed)%s: "
                 "step skipped, gradients discarded, weights unchanged",
                 step, under);
    step_skip(job, SD_ENONFINITE, msg, S != 1.0);
}

/* One node: the replicas of each g shard are all here (rank i of the first g-partition group
 * holds some shard, the rank i + j f_g of group j the same one). Each shard is reduced into its
 * first replica and copied back to the others (the 2-hop sync), and its sum of squares taken
 * (node_sums reads them): this node's squared norm is the whole one. */
static void sync_in_node(struct sd_job *job)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_layout *l = &job->layout;
    uint32_t f = job->plan.f[SD_STATE_G];
    uint32_t replicas = job->k / f;
    double *parts = job->step->sumsq_parts;
    for (uint32_t u = 0; u < l->n_units; u++) {
        const struct sd_unit_layout *ul = &l->units[u];
        uint64_t len = ul->numel / f;
        for (uint32_t i = 0; i < f; i++) {
            float *acc = sd_job_g_shard(job, i, ul);
            for (uint32_t j = 1; j < replicas; j++)
                dev->reduce_add(job->mem.queue, acc, sd_job_g_shard(job, j * f + i, ul),
                                SD_DTYPE_FP32, len);
            dev->sum_sq(job->mem.queue, acc, len, &parts[(size_t)u * f + i]);
            for (uint32_t j = 1; j < replicas; j++) {
                dev->copy(job->mem.queue, sd_job_g_shard(job, j * f + i, ul), acc,
                          len * sizeof(float));
                /* in from the replica, and back */
                sd_job_count_copy(job, SD_OP_STEP, j * f + i, i, 2 * len * sizeof(float));
            }
        }
    }
}

/* sync_in_node's sums of squares, once the device wrote them */
static void node_sums(struct sd_job *job)
{
    const struct sd_layout *l = &job->layout;
    uint32_t f = job->plan.f[SD_STATE_G];
    double *parts = job->step->sumsq_parts;
    double sumsq = 0.0;
    for (size_t p = 0; p < (size_t)l->n_units * f; p++)
        sumsq += parts[p];
    sd_step__part(job, 0)->sumsq = sumsq;
    sd_step__part(job, 0)->nonfinite_unit =
        nonfinite_unit(parts, (size_t)l->n_units * f, unit_major, f);
}

/* every local rank called step */
static void do_step(struct sd_job *job)
{
    char msg[SD_OP_MSG_LEN];
    if (sd_push_partial_round(job, msg, sizeof(msg))) {
        sd_job_fail(job, SD_EMISMATCH, "%s", msg);
        return;
    }
    sd_step__args_collect(job);
    sd_step_progress(job);
}

void sd_step(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    if (sd_barrier_waits(&job->step->bar, s->local)) {
        sd_session_fail(s, e, SD_EBUSY, "step: rank %u already waits in step %llu", s->rank,
                        (unsigned long long)job->steps + 1);
        return;
    }
    if ((e->arg0 & ~(uint64_t)(SD_STEP_ARG_HPARAMS | SD_STEP_ARG_HAS_GRAD | SD_STEP_ARG_BCAST |
                               SD_STEP_ARG_UPDATED | SD_STEP_ARG_SCALED)) != 0) {
        sd_session_fail(s, e, SD_EINVAL, "step: unknown argument flags 0x%llx",
                        (unsigned long long)e->arg0);
        return;
    }
    bool updated = (e->arg0 & SD_STEP_ARG_UPDATED) != 0;
    if (updated != (job->step->phase == SD_STEP_TRAINER)) {
        sd_session_fail(
            s, e, SD_ESTATE, "step: %s",
            updated ? "no optimizer update is awaited (a trainer optimizer's update follows the "
                      "step that handed the gradients over)"
                    : "this node's step waits for its ranks' optimizer updates "
                      "(shard_step_update_done after the hand-off)");
        return;
    }
    if (updated) {
        sd_barrier_arrive(&job->step->bar, s->local, e->tag, sd_now_ns());
        if (sd_barrier_full(&job->step->bar))
            handoff_taken(job);
        return;
    }
    if ((e->arg0 & SD_STEP_ARG_BCAST) && job->model.bcast_bytes == 0) {
        sd_session_fail(s, e, SD_EINVAL,
                        "step: buffers to broadcast, but the model registered none (bcast_bytes "
                        "0)");
        return;
    }
    double scale = 1.0;
    if (e->arg0 & SD_STEP_ARG_SCALED) {
        memcpy(&scale, &e->arg1, sizeof(scale));
        if (!isfinite(scale) || !(scale >= DBL_MIN)) {
            sd_session_fail(s, e, SD_EINVAL,
                            "step: loss scale %g: it must be a finite positive number (the factor "
                            "the gradients were multiplied by)",
                            scale);
            return;
        }
    }
    job->step->rank_scale[s->local] = scale;
    job->step->arg_flags[s->local] = (uint32_t)e->arg0;
    uint64_t now = sd_now_ns();
    sd_barrier_arrive(&job->step->bar, s->local, e->tag, now);
    if (sd_barrier_full(&job->step->bar) && sd_sched_step_check(job))
        do_step(job);
}

/* ---- step across nodes */

void sd_step__fail(struct sd_job *job, int status, uint32_t suspect)
{
    char what[256];
    sd_job_net_describe(job, what, sizeof(what));
    job->step->phase = SD_STEP_IDLE;
    char peer[64];
    sd_job_fail(job, SD_EPEER, "%s: transfer with %s failed: %s", what,
                sd_job_peer_name(job, suspect, peer, sizeof(peer)), sd_status_str(status));
}

/* the nodes of this node's partition group must have recorded the same schedule */
static bool check_schedules(struct sd_job *job)
{
    uint32_t Gw = job->gnodes[SD_STATE_W], first = sd_job_group_first(job, Gw);
    for (uint32_t m = first; Gw > 1 && m < first + Gw; m++)
        if (!sd_sched_check_node(job, m, sd_step__part(job, m))) {
            job->step->phase = SD_STEP_IDLE;
            return false;
        }
    return true;
}

/* One of a phase's transfers ended with status with peer: the first failure is kept; true when
 * it was the last of them. */
static bool transfer_ended(struct sd_step_state *st, int status, uint32_t peer)
{
    if (status != SD_OK && st->status == SD_OK) {
        st->status = status;
        st->suspect = peer;
    }
    return --st->pending == 0;
}

static void norm_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = (struct sd_job *)(uintptr_t)b->arg2;
    job->stats.bytes[SD_OP_STEP][b->is_send ? SD_LINK_INTER_SENT : SD_LINK_INTER_RECV] += b->bytes;
    uint32_t peer = b->peer;
    sd_bulk_put(&job->xfer.bulks, b);
    if (!transfer_ended(job->step, status, peer))
        return;
    if (job->step->status != SD_OK) {
        sd_step__fail(job, job->step->status, job->step->suspect);
        return;
    }
    if (!check_schedules(job))
        return;
    job->step->phase = SD_STEP_APPLY;
    sd_step_progress(job);
}

/* this node's sums of squares of its distinct g shards, one part per shard and unit: taken on
 * the device where enqueue (norm_start reads them once it wrote them); the number of parts.
 * Where the hop's block is owned (f_os = world), of each local rank's os part instead: every
 * element's once, the parts the hop surely summed. */
static size_t norm_sums(struct sd_job *job, bool enqueue)
{
    /* each distinct shard counts once: the replica in partition group 0 */
    uint32_t f = job->plan.f[SD_STATE_G];
    bool owned = sd_hop_owned(job);
    double *parts = job->step->sumsq_parts;
    size_t n_parts = 0;
    for (uint32_t j = 0; j < job->k; j++) {
        if (!owned && job->first_rank + j >= f)
            continue;
        for (uint32_t u = 0; u < job->layout.n_units; u++) {
            const struct sd_unit_layout *ul = &job->layout.units[u];
            if (enqueue)
                job->reg->dev->sum_sq(
                    job->mem.queue, owned ? sd_job_os_grad(job, j, u) : sd_job_g_shard(job, j, ul),
                    ul->numel / (owned ? job->plan.f[SD_STATE_OS] : f), &parts[n_parts]);
            n_parts++;
        }
    }
    return n_parts;
}

/* the norm parts' exchange, once the device wrote this node's sums */
static void norm_start(struct sd_job *job)
{
    uint32_t me = job->node;
    double *parts = job->step->sumsq_parts;
    size_t n_parts = norm_sums(job, false);
    double local = 0.0;
    for (size_t p = 0; p < n_parts; p++)
        local += parts[p];
    struct sd_norm_part *mine = sd_step__part(job, me); /* its hparams and used: set already */
    mine->sumsq = local;
    sd_sched_recorded(job, &mine->digest, &mine->n);
    mine->nonfinite_unit = nonfinite_unit(parts, n_parts, rank_major, job->layout.n_units);
    job->step->phase = SD_STEP_NORM;
    job->step->status = SD_OK;
    job->step->pending = 0;
    uint32_t seq = sd_tag_wrap(job->steps, SD_TAG_SEQ_BITS);
    for (uint32_t m = 0; m < job->nodes; m++) {
        if (m == me)
            continue;
        void *rp = sd_step__part(job, m), *sp = mine;
        struct sd_exchange_param x = {.peer = m,
                                      .recv = {.buf = rp, .bytes = job->step->norm_stride},
                                      .send = {.buf = sp, .bytes = job->step->norm_stride},
                                      .chunk_bytes = 4096,
                                      .cb = norm_done,
                                      .arg = job,
                                      .arg2 = (uint64_t)(uintptr_t)job};
        job->step->pending += sd_job_net_exchange(job, &x, SD_TAG_SCALAR, 0, seq,
                                                  &job->step->status, &job->step->suspect);
    }
    if (job->step->pending == 0) {
        if (job->step->status != SD_OK) {
            sd_step__fail(job, job->step->status, job->step->suspect);
            return;
        }
        job->step->phase = SD_STEP_APPLY;
        sd_step_progress(job);
    }
}

/* Drive the step forward as far as it can go now; called again by every completion. */
void sd_step_progress(struct sd_job *job)
{
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
        return;
    if (job->step->q_wait && !step_queue_done(job))
        return; /* the device is still at the kernels of the phase before: polled again */
    if (job->step->phase == SD_STEP_IDLE) {
        job->step->phase = SD_STEP_SYNC;
        job->step->unit = 0;
        job->step->start_ns = sd_now_ns();
    }
    if (job->step->phase == SD_STEP_SYNC) {
        /* everything of this step's micro-steps must be reduced, every gather finished and
         * answered (a unit held across the step is refreshed for its holder) */
        if (!sd_push_idle(job) || job->xfer.gathers_inflight > 0 || job->step->pending > 0 ||
            sd_fetch_queue_waiting(job))
            return;
        if (job->nodes == 1) { /* the replicas are here, and the norm needs no exchange */
            sync_in_node(job);
            job->step->phase = SD_STEP_SUMS;
            if (!step_queue_done(job))
                return;
        } else {
            /* the boundary hop of the units that did not go during the backward */
            if (!sd_hop_sync(job))
                return; /* its end continues with the next unit */
            norm_sums(job, true);
            job->step->phase = SD_STEP_SUMS;
            if (!step_queue_done(job))
                return;
        }
    }
    if (job->step->phase == SD_STEP_SUMS) {
        if (job->nodes > 1) {
            norm_start(job); /* NORM, then APPLY from the exchanges' completions */
            return;
        }
        node_sums(job);
        job->step->phase = SD_STEP_APPLY;
    }
    if (job->step->phase == SD_STEP_APPLY) {
        if (job->xfer.w_sends_inflight > 0)
            return; /* peers still read this node's weights of the current generation */
        if (sd_job_shards_busy(job))
            return; /* a checkpoint's worker reads the os shards: its end calls again */
        int refused;
        char msg[SD_OP_MSG_LEN];
        if (!sd_step__args_agree(job, &refused, msg, sizeof(msg))) {
            job->stats.steps_refused++;
            step_skip(job, refused, msg, false); /* on every node alike */
            return;
        }
        sd_step__bcast_deliver(job); /* a step skipped as non-finite broadcasts all the same */
        double sumsq = 0.0;
        uint32_t bad = UINT32_MAX;
        for (uint32_t m = 0; m < job->nodes; m++) {
            sumsq += sd_step__part(job, m)->sumsq;
            bad = SD_MIN(bad, sd_step__part(job, m)->nonfinite_unit);
        }
        if (bad != UINT32_MAX || !isfinite(sumsq)) {
            step_nonfinite(job, bad);
            return;
        }
        job->stats.loss_scale = job->step->rank_scale[0];
        if (sd_optim_in_trainer(job->model.optim.kind)) {
            sd_optimizer_handoff(job, job->step->hp_next, sumsq, job->step->rank_scale[0],
                                 sd_step__used(job));
            handoff(job);
            return;
        }
        sd_optimizer_apply(job, job->step->hp_next, sumsq, job->step->rank_scale[0],
                           sd_step__used(job));
        if (!weights_phase(job))
            return;
    }
    if (job->step->phase == SD_STEP_WEIGHTS) {
        if (job->step->pending > 0)
            return; /* the unit's exchanges call again */
        if (job->step->status != SD_OK) {
            sd_step__fail(job, job->step->status, job->step->suspect);
            return;
        }
        while (sd_job_weights_remote(job) && job->step->unit < job->layout.n_units) {
            if (job->plan.qw && !job->step->encoded) {
                sd_weights_encode(job, job->step->unit);
                job->step->encoded = true;
                if (!step_queue_done(job))
                    return; /* the encodings leave once the device wrote them */
            }
            job->step->encoded = false;
            uint32_t posted = 0, suspect = 0;
            job->step->status = SD_OK;
            int st = sd_weights_exchange(job, job->step->unit++, &posted, &suspect);
            job->step->pending += posted; /* each completion: SD_JOB_EV_EXCHANGED */
            if (job->state == SD_JOB_FAILED)
                return;
            if (st != SD_OK) {
                sd_step__fail(job, st, suspect);
                return;
            }
            if (job->step->pending > 0)
                return;
        }
        weights_write(job);
        job->step->phase = SD_STEP_NEWGEN;
        if (!step_queue_done(job))
            return;
    }
    if (job->step->phase == SD_STEP_NEWGEN) {
        weights_new(job);
        sd_fetch_serve_queue(job);
        sd_fetch_fenced_poll(job); /* as in weights_write: no gathers across nodes for them */
        job->step->phase = SD_STEP_REFRESH;
    }
    if (job->step->phase == SD_STEP_REFRESH) {
        /* units held across the step are gathered again in place; one that cannot start now
         * (transfer resources busy) is retried when a transfer completes */
        bool pending = false;
        for (uint32_t i = 0; job->gnodes[SD_STATE_W] > 1 && i < job->n_slots; i++) {
            struct sd_unit_state *us = &job->cache.units[i];
            if (!us->resident || us->refs == 0 || us->inflight || us->gen == job->weights_gen)
                continue;
            if (sd_fetch_gather_start(job, us) != SD_OK) {
                pending = true;
                break;
            }
            if (job->state == SD_JOB_FAILED || job->step->phase != SD_STEP_REFRESH)
                return; /* finished (or failed) inside: that call completed the step */
        }
        if (pending || job->xfer.gathers_inflight > 0)
            return;
        job->step->phase = SD_STEP_IDLE;
        step_done(job);
    }
}

/* ---- what the other modules ask of the step, and tell it */

bool sd_step_running(const struct sd_job *job)
{
    return job->step->phase != SD_STEP_IDLE;
}

bool sd_step_before_apply(const struct sd_job *job)
{
    enum sd_step_phase ph = job->step->phase;
    return ph == SD_STEP_SYNC || ph == SD_STEP_SUMS || ph == SD_STEP_NORM;
}

uint32_t sd_step_arrived(const struct sd_job *job)
{
    return job->step->bar.arrived;
}

bool sd_step_handoff(const struct sd_job *job, uint32_t local)
{
    return job->step->phase == SD_STEP_TRAINER && !sd_barrier_waits(&job->step->bar, local);
}

bool sd_step_queue_waiting(const struct sd_job *job)
{
    return job->step->q_wait || sd_allreduce_waiting(&job->step->ar);
}

/* the job's common paths (job_module.h): what the step does now, and its stop at a failure */
static bool step_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns)
{
    static const char *const names[] = {[SD_STEP_IDLE] = "idle",
                                        [SD_STEP_SYNC] = "gradient all-reduce",
                                        [SD_STEP_SUMS] = "sums of squares on the device",
                                        [SD_STEP_NORM] = "norm exchange",
                                        [SD_STEP_APPLY] = "optimizer",
                                        [SD_STEP_TRAINER] = "the trainers' optimizer",
                                        [SD_STEP_WEIGHTS] = "weights' all-gather",
                                        [SD_STEP_NEWGEN] = "new weights on the device",
                                        [SD_STEP_REFRESH] = "refresh of held units"};
    const struct sd_step_state *st = job->step;
    _Static_assert(sizeof(names) / sizeof(names[0]) == SD_STEP_REFRESH + 1, "a name per phase");
    if (st == NULL || st->phase == SD_STEP_IDLE)
        return false;
    snprintf(what, len, "step %llu (%s, unit %u; last completed step %llu)",
             (unsigned long long)job->steps + 1, names[st->phase], st->unit,
             (unsigned long long)job->steps);
    *since_ns = st->start_ns;
    return true;
}

static void step_failing(struct sd_job *job, int was)
{
    (void)was;
    job->step->phase = SD_STEP_IDLE;
}

/* the job's events (job_module.h): those a phase waits for drive it on */
static bool step_event(struct sd_job *job, const struct sd_job_ev *ev)
{
    enum sd_step_phase ph = job->step->phase;
    bool waits = false;
    switch (ev->kind) {
    case SD_JOB_EV_EXCHANGED: /* the weights' exchange: the last transfer's end goes on */
        if (transfer_ended(job->step, ev->status, ev->peer))
            sd_step_progress(job);
        return true;
    case SD_JOB_EV_UNIT_FINAL: /* the unit's boundary hop may go before the step */
        sd_hop_unit_final(job, ev->unit);
        return false;
    case SD_JOB_EV_STEP_OVER: /* raised here, for resume */
    case SD_JOB_EV_LET_GO:    /* for the job's life */
    case SD_JOB_EV_OPENED:
        return false;
    case SD_JOB_EV_PUSHED:    /* the sync waits for the pushes to be idle */
    case SD_JOB_EV_TRANSFERS: /* a refresh, or a step waiting for gathers */
        waits = ph != SD_STEP_IDLE;
        break;
    case SD_JOB_EV_ANSWERED: /* the sync waits for the answers */
        waits = ph == SD_STEP_SYNC;
        break;
    case SD_JOB_EV_W_SENT: /* the optimizer waits until no peer reads the weights */
        waits = ph == SD_STEP_APPLY;
        break;
    case SD_JOB_EV_OS_FREE: /* ... and until no checkpoint's worker reads the os shards */
        waits = ph == SD_STEP_APPLY && job->state == SD_JOB_READY && !sd_job_shards_busy(job);
        break;
    }
    if (waits && job->state != SD_JOB_FAILED)
        sd_step_progress(job);
    return waits;
}

/* ---- the job's common paths (job_module.h) */

static void step_fail_parked(struct sd_job *job, int status, const char *text, bool with_fetches)
{
    (void)with_fetches;
    job->step->q_wait = false; /* its kernels finish on their own; nothing goes on after them */
    sd_allreduce_abort(&job->step->ar, status); /* the step's boundary hop ends with it */
    struct sd_req q;
    for (uint32_t r = 0; r < job->k; r++)
        if (sd_barrier_take(&job->step->bar, r, &q) && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], q.tag, SD_OP_STEP, status, 0, 0, text);
}

/* a step barrier that waits too long */
static bool step_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    bool present[SD_MAX_LOCAL_RANKS];
    char missing[128];
    if (job->step->phase == SD_STEP_TRAINER && now - job->step->handoff_ns > op_timeout) {
        for (uint32_t r = 0; r < job->k; r++)
            present[r] = sd_barrier_waits(&job->step->bar, r);
        sd_job_missing_ranks(job, present, missing, sizeof(missing));
        sd_job_fail(job, SD_ETIMEDOUT,
                    "step %llu: ranks %s did not give back their optimizer update "
                    "(shard_step_update_done) within %lld ms (op_timeout_ms)",
                    (unsigned long long)job->steps + 1, missing,
                    (long long)job->reg->cfg->op_timeout_ms);
        return true;
    }
    if (!sd_barrier_overdue(&job->step->bar, now, op_timeout, present))
        return false;
    sd_job_missing_ranks(job, present, missing, sizeof(missing));
    sd_job_fail(
        job, SD_ETIMEDOUT, "step %llu: ranks %s did not call step within %lld ms (op_timeout_ms)",
        (unsigned long long)job->steps + 1, missing, (long long)job->reg->cfg->op_timeout_ms);
    return true;
}

const struct sd_job_module sd_step_module = {.name = "step",
                                             .create = sd_step_create,
                                             .destroy = sd_step_destroy,
                                             .alloc = sd_step_alloc,
                                             .release = sd_step_free,
                                             .fail_parked = step_fail_parked,
                                             .failing = step_failing,
                                             .activity = step_activity,
                                             .sweep = step_sweep,
                                             .event = step_event,
                                             .queue_waiting = sd_step_queue_waiting,
                                             .queue_poll = sd_step_queue_poll};

/* Values written into a running job between steps and read out of it (DESIGN.md section 3):
 * torch's load_state_dict on a wrapped model or its optimizer (every rank writes its own shards
 * from the same values, then the node's barrier after which written weights are a new
 * generation), and a rank's read of a unit's master weights or optimizer state (gathered from
 * its os group's nodes: an optimizer's state_dict, the masters under quantized plans). */
#include "barrier.h"
#include "net.h"
#include "job_module.h"
#include "fetch.h"
#include "optimizer.h"
#include "schedule.h"
#include "session.h"
#include "step.h"
#include "values.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <stdlib.h>

struct sd_values_state {
    /* writes (sd_values_write): a rank's write whose copies the job's queue has not passed yet
     * (its staging slot is read until then), answered by the poll */
    struct sd_write_wait {
        bool waiting;
        uint64_t ticket, tag, start_ns;
    } * w;                     /* [k] */
    uint32_t w_waiting;        /* of them */
    struct sd_barrier written; /* the ranks' SD_OP_WRITTEN */
    bool weights_written;      /* since the last barrier: the weights changed */
    bool draining;             /* the barrier is full, and waits for the node's gathers in flight */
    /* a rank's read of a unit's master weights or optimizer state (sd_values_read): one at a
     * time on a node, its other ranks' reads wait on their rings */
    struct sd_state_read {
        bool active, copying;
        uint32_t local, unit, what, seq, remaining, suspect;
        int status;
        uint64_t tag, start_ns, ticket;
        uint64_t v0, v1;    /* the answer's values (an own shard's first element and length) */
        struct sd_xfer *xs; /* [os group nodes - 1]: the pull requests' sends */
    } rd;
};

static int values_create(struct sd_job *job)
{
    struct sd_values_state *vs = calloc(1, sizeof(*vs));
    job->load.values = vs;
    uint32_t G = job->gnodes[SD_STATE_OS];
    if (vs == NULL || (vs->w = calloc(job->k, sizeof(*vs->w))) == NULL ||
        (vs->rd.xs = calloc(G > 1 ? G - 1 : 1, sizeof(*vs->rd.xs))) == NULL)
        return SD_ENOMEM;
    return sd_barrier_init(&vs->written, job->k);
}

static void values_destroy(struct sd_job *job)
{
    struct sd_values_state *vs = job->load.values;
    if (vs == NULL)
        return;
    sd_barrier_fini(&vs->written);
    free(vs->w);
    free(vs->rd.xs);
    free(vs);
    job->load.values = NULL;
}

static bool writes_poll(struct sd_job *job);
static bool read_poll(struct sd_job *job);
static void read_finish(struct sd_job *job);

/* ---- values written into a running job (SD_OP_WRITE, SD_OP_WRITTEN) */

/* the rank's fetched units: a write while it holds one would change what it reads */
static bool holds_any(const struct sd_job *job, const struct sd_session *s, uint32_t *unit_p)
{
    for (uint32_t u = 0; s->holds != NULL && u < job->layout.n_units; u++)
        if (s->holds[u] != 0) {
            *unit_p = u;
            return true;
        }
    return false;
}

/* why a rank cannot write or end its writes now (between steps, nothing held), or NULL */
static const char *write_refusal(struct sd_job *job, struct sd_session *s, char *buf, size_t len)
{
    uint32_t u;
    if (sd_step_arrived(job) > 0 || sd_step_running(job))
        snprintf(buf, len,
                 "ranks of this node are in step %llu; every rank writes between the same two "
                 "steps",
                 (unsigned long long)job->steps + 1);
    else if (holds_any(job, s, &u))
        snprintf(buf, len, "rank %u holds unit %u (fetched, not released): release it first",
                 s->rank, u);
    else if (sd_job_shards_busy(job))
        snprintf(buf, len, "a checkpoint's worker reads the shards; retry once the save ended");
    else
        return NULL;
    return buf;
}

/* src (the tensor's values) into rank r's shard of state (SD_STATE_OS: optimizer state what;
 * SD_STATE_W: the weights in the unit's dtype), where the shard meets the tensor */
static void write_range(struct sd_job *job, uint32_t r, int state, uint32_t what, uint32_t t,
                        const float *src)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_tensor_layout *tl = &job->layout.tensors[t];
    const struct sd_unit_layout *ul = &job->layout.units[job->model.tensors[t].unit];
    uint64_t b, e;
    sd_layout_shard(ul, &job->plan, state, job->first_rank + r, &b, &e);
    uint64_t lo = SD_MAX(b, tl->offset), hi = SD_MIN(e, tl->offset + tl->numel);
    if (lo >= hi)
        return;
    const float *from = src + (lo - tl->offset);
    if (state == SD_STATE_OS)
        dev->copy(job->mem.queue, sd_job_os_state(job, r, what, ul) + (lo - b), from,
                  (hi - lo) * sizeof(float));
    else
        dev->from_f32(job->mem.queue,
                      sd_job_w_shard(job, r, job->model.tensors[t].unit) +
                          (lo - b) * sd_dtype_size(ul->dtype),
                      ul->dtype, from, hi - lo);
}

/* ---- a trainer optimizer's own shards (SD_STATE_OWN) */

/* rank local's own os shard of unit u in state what (SD_STATE_GRAD: its part of the g shard,
 * the gradient sums), its first element in the unit and its length */
static float *own_shard(struct sd_job *job, uint32_t local, uint32_t u, uint32_t what,
                        uint64_t *first_p, uint64_t *len_p)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint32_t rank = job->first_rank + local;
    uint64_t e;
    sd_layout_shard(ul, &job->plan, SD_STATE_OS, rank, first_p, &e);
    *len_p = e - *first_p;
    return what == SD_STATE_GRAD ? sd_job_os_grad(job, local, u)
                                 : sd_job_os_state(job, local, what, ul);
}

/* why an own-shard read or write of unit u, state what, slot cannot be, or NULL */
static const char *own_refusal(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                               bool write, int *status_p, char *buf, size_t len)
{
    uint32_t u = e->unit, slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32) & 0xffu;
    uint32_t states = sd_optim_state_floats(job->model.optim.kind);
    const char *op = write ? "write" : "read";
    *status_p = SD_EINVAL;
    if (!sd_optim_in_trainer(job->model.optim.kind))
        snprintf(buf, len, "%s own shard: job '%s' runs its optimizer (%s) in the daemon", op,
                 job->name, sd_optim_name(job->model.optim.kind));
    else if (u >= job->layout.n_units || slot >= job->mem.staging_slots ||
             (what >= states && (write || what != SD_STATE_GRAD)))
        snprintf(buf, len,
                 "%s own shard: unit %u, state %u, staging slot %u (the job has units 0..%u, "
                 "states 0..%u%s, %u slots a rank)",
                 op, u, what, slot, job->layout.n_units - 1, states - 1,
                 write ? "" : " and the gradient", job->mem.staging_slots);
    else if ((write || what == SD_STATE_GRAD) && !sd_step_handoff(job, s->local)) {
        *status_p = SD_ESTATE;
        snprintf(buf, len,
                 "%s own shard of unit %u: only at a trainer optimizer's hand-off, between the "
                 "step's answer and this rank's shard_step_update_done",
                 op, u);
    } else
        return NULL;
    return buf;
}

/* this rank's own shard of a unit's state into its staging slot */
static bool own_read(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start)
{
    struct sd_state_read *rd = &job->load.values->rd;
    char why[256];
    int st;
    if (own_refusal(job, s, e, false, &st, why, sizeof(why)) != NULL) {
        sd_session_fail(s, e, st, "%s", why);
        return true;
    }
    if (rd->active)
        return false; /* another rank's read: the ring entry waits */
    uint32_t slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32) & 0xffu;
    uint64_t first, len;
    const float *src = own_shard(job, s->local, e->unit, what, &first, &len);
    job->reg->dev->copy(job->mem.queue, sd_job_staging_slot(job, s->local, slot), src,
                        len * sizeof(float));
    *rd = (struct sd_state_read){.active = true,
                                 .local = s->local,
                                 .unit = e->unit,
                                 .what = what,
                                 .seq = rd->seq,
                                 .tag = e->tag,
                                 .start_ns = start,
                                 .v0 = first,
                                 .v1 = len,
                                 .xs = rd->xs};
    read_finish(job);
    return true;
}

static bool write_wait(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                       uint64_t start);

/* the staging slot into this rank's own shard of a unit's master or state */
static bool own_write(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start)
{
    char why[256];
    int st;
    if (own_refusal(job, s, e, true, &st, why, sizeof(why)) != NULL) {
        sd_session_fail(s, e, st, "%s", why);
        return true;
    }
    uint32_t slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32) & 0xffu;
    uint64_t first, len;
    float *dst = own_shard(job, s->local, e->unit, what, &first, &len);
    if (e->arg1 != len) {
        sd_session_fail(s, e, SD_EINVAL,
                        "write own shard of unit %u: %llu values; rank %u's shard has %llu",
                        e->unit, (unsigned long long)e->arg1, s->rank, (unsigned long long)len);
        return true;
    }
    job->reg->dev->copy(job->mem.queue, dst, sd_job_staging_slot(job, s->local, slot),
                        len * sizeof(float));
    return write_wait(job, s, e, start);
}

bool sd_values_write(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start)
{
    struct sd_values_state *vs = job->load.values;
    const struct sd_layout *l = &job->layout;
    uint32_t t = e->unit, slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32);
    uint32_t states = sd_optim_state_floats(job->model.optim.kind);
    char why[256];
    if (vs->w[s->local].waiting)
        return false; /* its previous write is still read from its slot */
    if ((what & ~0xffu) == SD_STATE_OWN)
        return own_write(job, s, e, start);
    if (t >= l->n_tensors) {
        sd_session_fail(s, e, SD_EINVAL, "write: tensor %u does not exist (job '%s' has 0..%u)", t,
                        job->name, l->n_tensors - 1);
        return true;
    }
    if (what != SD_WRITE_STEPS && what >= states) {
        sd_session_fail(s, e, SD_EINVAL,
                        "write tensor %u: state %u is not one of this optimizer's (0 the "
                        "weights, 1..%u its states, %u the step count)",
                        t, what, states - 1, SD_WRITE_STEPS);
        return true;
    }
    if (what != SD_WRITE_STEPS &&
        (slot >= job->mem.staging_slots || e->arg1 != l->tensors[t].numel)) {
        sd_session_fail(s, e, SD_EINVAL,
                        "write tensor %u: %llu values in staging slot %u; the tensor has %llu "
                        "elements and the rank %u slots",
                        t, (unsigned long long)e->arg1, slot,
                        (unsigned long long)l->tensors[t].numel, job->mem.staging_slots);
        return true;
    }
    if (write_refusal(job, s, why, sizeof(why)) != NULL) {
        sd_session_fail(s, e, SD_ESTATE, "write tensor %u: %s", t, why);
        return true;
    }
    if (sd_barrier_waits(&vs->written, s->local)) {
        sd_session_fail(s, e, SD_EBUSY, "write tensor %u: rank %u already ended its writes", t,
                        s->rank);
        return true;
    }
    if (what == SD_WRITE_STEPS) { /* (the node's count: every rank gives the same) */
        sd_optim_set_tensor_steps(job, t, e->arg1);
        sd_op_done(job, s, e, 0, 0, start);
        return true;
    }
    const float *src = (const float *)(void *)sd_job_staging_slot(job, s->local, slot);
    write_range(job, s->local, SD_STATE_OS, what, t, src);
    if (what == SD_WRITE_WEIGHTS) {
        write_range(job, s->local, SD_STATE_W, 0, t, src);
        vs->weights_written = true;
    }
    return write_wait(job, s, e, start);
}

/* the client refills the slot once answered: answered once the copies read it */
static bool write_wait(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                       uint64_t start)
{
    struct sd_values_state *vs = job->load.values;
    struct sd_write_wait *w = &vs->w[s->local];
    int st = sd_job_queue_mark(job, false, &w->ticket);
    if (st == SD_EAGAIN) {
        w->waiting = true;
        w->tag = e->tag;
        w->start_ns = start;
        vs->w_waiting++;
        return true;
    }
    if (st != SD_OK) {
        sd_job_backend_failed(job, st);
        sd_session_fail(s, e, job->fail_status, "write %u: %s", e->unit, job->fail_msg);
        return true;
    }
    sd_op_done(job, s, e, 0, 0, start);
    return true;
}

/* the writes whose copies the job's queue passed: answered */
static bool writes_poll(struct sd_job *job)
{
    struct sd_values_state *vs = job->load.values;
    bool moved = false;
    for (uint32_t r = 0; r < job->k && vs->w_waiting > 0; r++) {
        struct sd_write_wait *w = &vs->w[r];
        if (!w->waiting)
            continue;
        int st = job->reg->dev->query(job->mem.queue, w->ticket);
        if (st == SD_EAGAIN)
            continue;
        w->waiting = false;
        vs->w_waiting--;
        moved = true;
        if (st != SD_OK) {
            sd_job_backend_failed(job, st); /* answers the others through fail_parked */
            if (job->ranks[r] != NULL)
                sd_session_complete(job->ranks[r], w->tag, SD_OP_WRITE, st, 0, 0,
                                    "write: the backend failed");
            continue;
        }
        if (job->ranks[r] != NULL) {
            job->stats.ops[SD_OP_WRITE]++;
            sd_latency_add(&job->stats.lat[SD_OP_WRITE], sd_now_ns() - w->start_ns);
            sd_session_complete(job->ranks[r], w->tag, SD_OP_WRITE, SD_OK, 0, 0, NULL);
        }
    }
    return moved;
}

/* Every local rank ended its writes: once no gather is in flight here (they read the weights
 * before the write, and are of the generation before), the written weights are a new
 * generation: cached copies, the secondary copy and ,qw's encodings of the old one are not used
 * again, and peers' requests of it are served (those of the one before it too, see
 * xfer.pre_write_gen1). Then every rank is answered. */
static void written_try(struct sd_job *job)
{
    struct sd_values_state *vs = job->load.values;
    if (!sd_barrier_full(&vs->written) || job->state != SD_JOB_READY)
        return;
    if (job->xfer.gathers_inflight > 0 || vs->w_waiting > 0) {
        vs->draining = true; /* SD_JOB_EV_TRANSFERS, or the poll, comes back */
        return;
    }
    vs->draining = false;
    if (vs->weights_written) {
        job->xfer.pre_write_gen1 = job->weights_gen + 1;
        job->weights_gen++;
        vs->weights_written = false;
        SD_INFO("job", "job '%s': written weights after step %llu (generation %llu)", job->name,
                (unsigned long long)job->steps, (unsigned long long)job->weights_gen);
    }
    struct sd_req q;
    uint64_t now = sd_now_ns();
    for (uint32_t r = 0; r < job->k; r++) {
        if (!sd_barrier_take(&vs->written, r, &q) || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_WRITTEN]++;
        sd_latency_add(&job->stats.lat[SD_OP_WRITTEN], now - q.since_ns);
        sd_session_complete(job->ranks[r], q.tag, SD_OP_WRITTEN, SD_OK, job->weights_gen, 0, NULL);
    }
    sd_fetch_serve_queue(job); /* requests of the new generation, waiting here */
    sd_sched_prefetch(job);
}

void sd_values_written(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    struct sd_values_state *vs = job->load.values;
    char why[256];
    if (write_refusal(job, s, why, sizeof(why)) != NULL) {
        sd_session_fail(s, e, SD_ESTATE, "write_done: %s", why);
        return;
    }
    if (!sd_barrier_arrive(&vs->written, s->local, e->tag, sd_now_ns())) {
        sd_session_fail(s, e, SD_EBUSY, "write_done: rank %u already waits for the others",
                        s->rank);
        return;
    }
    written_try(job);
}

/* ---- a rank's read of a unit's state (SD_OP_READ) */

static void read_answer(struct sd_job *job, int status, const char *msg)
{
    struct sd_state_read *rd = &job->load.values->rd;
    struct sd_session *s = job->ranks[rd->local];
    rd->active = rd->copying = false;
    if (s == NULL)
        return;
    if (status == SD_OK) {
        job->stats.ops[SD_OP_READ]++;
        sd_latency_add(&job->stats.lat[SD_OP_READ], sd_now_ns() - rd->start_ns);
    }
    sd_session_complete(s, rd->tag, SD_OP_READ, status, status == SD_OK ? rd->v0 : 0,
                        status == SD_OK ? rd->v1 : 0, msg);
}

/* the transfers of the read ended (or none was needed): answered once the device wrote the
 * slot */
static void read_finish(struct sd_job *job)
{
    struct sd_state_read *rd = &job->load.values->rd;
    if (!rd->active)
        return; /* answered by the job's failure */
    if (rd->status != SD_OK) {
        char peer[64], msg[SD_OP_MSG_LEN];
        snprintf(msg, sizeof(msg), "read of unit %u: the transfer from %s failed: %s", rd->unit,
                 sd_job_peer_name(job, rd->suspect, peer, sizeof(peer)), sd_status_str(rd->status));
        read_answer(job, SD_EPEER, msg);
        sd_job_fail(job, SD_EPEER, "%s", msg);
        return;
    }
    int st = sd_job_queue_mark(job, false, &rd->ticket);
    if (st == SD_EAGAIN) {
        rd->copying = true;
        return;
    }
    if (st != SD_OK) {
        read_answer(job, st, "read: the backend failed");
        sd_job_backend_failed(job, st);
        return;
    }
    read_answer(job, SD_OK, NULL);
}

static bool read_poll(struct sd_job *job)
{
    struct sd_state_read *rd = &job->load.values->rd;
    int st = job->reg->dev->query(job->mem.queue, rd->ticket);
    if (st == SD_EAGAIN)
        return false;
    rd->copying = false;
    read_answer(job, st, st == SD_OK ? NULL : "read: the backend failed");
    if (st != SD_OK)
        sd_job_backend_failed(job, st);
    return true;
}

static void read_recv_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    struct sd_state_read *rd = &job->load.values->rd;
    job->stats.bytes[SD_OP_READ][SD_LINK_INTER_RECV] += b->bytes;
    if (status != SD_OK && rd->status == SD_OK) {
        rd->status = status;
        rd->suspect = b->peer;
    }
    sd_bulk_put(&job->xfer.bulks, b);
    if (--rd->remaining == 0)
        read_finish(job);
}

static void read_req_sent(struct sd_xfer *x, int status)
{
    struct sd_job *job = x->arg;
    struct sd_state_read *rd = &job->load.values->rd;
    if (status != SD_OK && rd->status == SD_OK) {
        rd->status = status;
        rd->suspect = x->peer;
    }
    if (--rd->remaining == 0)
        read_finish(job);
}

/* Pull node m's shards of the read's unit and state into dst (each at its shard's place): a
 * request and a receive of its ranks' shards, in its local ranks' order. */
static void read_post(struct sd_job *job, uint32_t m, uint32_t o, float *dst)
{
    struct sd_state_read *rd = &job->load.values->rd;
    const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_OS];
    uint32_t seq = rd->seq & ((1u << SD_TAG_SEQ_BITS) - 1);
    void *pieces[SD_BULK_MAX_PIECES];
    for (uint32_t q = 0; q < job->k; q++)
        pieces[q] = dst + (uint64_t)sd_plan_shard(&job->plan, SD_STATE_OS, m * job->k + q) * len;
    uint64_t data_tag = 0, req_tag = 0;
    int st = sd_tag_make(SD_TAG_SDATA, job->xfer.tag, rd->unit, seq, m, &data_tag);
    if (st == SD_OK)
        st = sd_tag_make(SD_TAG_REQ, job->xfer.tag, rd->unit, seq, job->node, &req_tag);
    struct sd_bulk *b = sd_bulk_get(&job->xfer.bulks);
    if (st == SD_OK && b == NULL)
        st = SD_EBUSY;
    if (st == SD_OK)
        st = sd_bulk_start(b, &(struct sd_bulk_param){.tp = sd_job_tp(job),
                                                      .peer = m,
                                                      .tag = data_tag,
                                                      .pieces = pieces,
                                                      .n_pieces = job->k,
                                                      .piece_len = len * sizeof(float),
                                                      .chunk_bytes = job->reg->cfg->chunk_bytes,
                                                      .desc = sd_job_net_desc(job, dst),
                                                      .cb = read_recv_done,
                                                      .arg = job});
    if (st == SD_OK) {
        rd->remaining++;
    } else {
        if (b != NULL)
            sd_bulk_put(&job->xfer.bulks, b);
        if (rd->status == SD_OK) {
            rd->status = st;
            rd->suspect = m;
        }
        return;
    }
    struct sd_xfer *x = &rd->xs[o];
    x->cb = read_req_sent;
    x->arg = job;
    st = sd_job_tp(job)->ops->send(sd_job_tp(job), m, req_tag, job->xfer.read_req,
                                   sizeof(*job->xfer.read_req),
                                   sd_job_net_desc(job, job->xfer.read_req), x);
    if (st == SD_OK) {
        rd->remaining++;
    } else if (rd->status == SD_OK) {
        rd->status = st;
        rd->suspect = m;
    }
}

bool sd_values_read(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                    uint64_t start)
{
    struct sd_values_state *vs = job->load.values;
    struct sd_state_read *rd = &vs->rd;
    const struct sd_layout *l = &job->layout;
    uint32_t slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32);
    uint32_t states = sd_optim_state_floats(job->model.optim.kind);
    if ((what & ~0xffu) == SD_STATE_OWN)
        return own_read(job, s, e, start);
    if (what == SD_WRITE_STEPS) {
        if (e->unit >= l->n_tensors) {
            sd_session_fail(s, e, SD_EINVAL, "read: tensor %u does not exist (0..%u)", e->unit,
                            l->n_tensors - 1);
            return true;
        }
        sd_op_done(job, s, e, sd_optim_tensor_steps(job)[e->unit], 0, start);
        return true;
    }
    if (e->unit >= l->n_units || what >= states || slot >= job->mem.staging_slots) {
        sd_session_fail(s, e, SD_EINVAL,
                        "read: unit %u, state %u, staging slot %u (the job has units 0..%u, "
                        "states 0..%u, %u slots a rank)",
                        e->unit, what, slot, l->n_units - 1, states - 1, job->mem.staging_slots);
        return true;
    }
    /* (no step can apply the optimizer meanwhile, here or on another node: every step needs
     * this rank's; the other ranks may be in the next step already, as when rank 0 alone
     * saves) */
    uint32_t G = job->gnodes[SD_STATE_OS];
    if (rd->active || (G > 1 && job->xfer.bulks.n - job->xfer.bulks.in_use < G - 1))
        return false; /* another rank's read, or transfers busy: the ring entry waits */
    const struct sd_unit_layout *ul = &l->units[e->unit];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_OS];
    float *dst = (float *)(void *)sd_job_staging_slot(job, s->local, slot);
    for (uint32_t q = 0; q < job->k; q++) /* this node's shards (replicas alike) */
        job->reg->dev->copy(
            job->mem.queue,
            dst + (uint64_t)sd_plan_shard(&job->plan, SD_STATE_OS, job->first_rank + q) * len,
            sd_job_os_state(job, q, what, ul), len * sizeof(float));
    *rd = (struct sd_state_read){.active = true,
                                 .local = s->local,
                                 .unit = e->unit,
                                 .what = what,
                                 .seq = rd->seq + 1,
                                 .tag = e->tag,
                                 .start_ns = start,
                                 .xs = rd->xs};
    if (G > 1) {
        *job->xfer.read_req = (struct sd_req_msg){.magic = SD_REQ_MAGIC,
                                                  .job_tag = (uint16_t)job->xfer.tag,
                                                  .src = (uint16_t)job->node,
                                                  .unit = e->unit,
                                                  .lslot = rd->seq,
                                                  .gen = job->weights_gen,
                                                  .n_units = 1,
                                                  .state = what + 1};
        uint32_t first = sd_job_group_first(job, G);
        for (uint32_t i = 0, o = 0; i < G; i++)
            if (first + i != job->node)
                read_post(job, first + i, o++, dst);
    }
    if (rd->remaining == 0)
        read_finish(job);
    return true;
}

/* ---- the job's common paths (job_module.h) */

static bool values_queue_waiting(const struct sd_job *job)
{
    const struct sd_values_state *vs = job->load.values;
    return vs != NULL && (vs->w_waiting > 0 || vs->rd.copying);
}

static bool values_queue_poll(struct sd_job *job)
{
    struct sd_values_state *vs = job->load.values;
    if (!values_queue_waiting(job) || job->state == SD_JOB_FAILED)
        return false;
    bool moved = vs->rd.copying && read_poll(job);
    return (vs->w_waiting > 0 && writes_poll(job)) || moved;
}

static void values_fail_parked(struct sd_job *job, int status, const char *text, bool with_fetches)
{
    struct sd_values_state *vs = job->load.values;
    struct sd_req q;
    for (uint32_t r = 0; r < job->k; r++) {
        if (sd_barrier_take(&vs->written, r, &q) && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], q.tag, SD_OP_WRITTEN, status, 0, 0, text);
        if (vs->w[r].waiting && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], vs->w[r].tag, SD_OP_WRITE, status, 0, 0, text);
        vs->w[r].waiting = false;
    }
    vs->w_waiting = 0;
    vs->draining = false;
    /* a read goes on while the job closes (with_fetches false: a rank detached), as fetches
     * do; (a failure's transfers, if any, end without answering again) */
    if (vs->rd.active && with_fetches)
        read_answer(job, status, text);
}

/* ranks that ended their writes while others of the node do not */
static bool values_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    bool present[SD_MAX_LOCAL_RANKS];
    if (job->state != SD_JOB_READY ||
        !sd_barrier_overdue(&job->load.values->written, now, op_timeout, present))
        return false;
    char missing[128];
    sd_job_missing_ranks(job, present, missing, sizeof(missing));
    sd_job_fail(job, SD_ETIMEDOUT,
                "write_done after step %llu: ranks %s did not end their writes within %lld ms "
                "(op_timeout_ms; every rank loads the same state_dict)",
                (unsigned long long)job->steps, missing, (long long)job->reg->cfg->op_timeout_ms);
    return true;
}

/* a gather's transfers ended: a full written barrier that waited for them goes on */
static bool values_event(struct sd_job *job, const struct sd_job_ev *ev)
{
    struct sd_values_state *vs = job->load.values;
    if (ev->kind != SD_JOB_EV_TRANSFERS || vs == NULL || !vs->draining)
        return false;
    written_try(job);
    return !vs->draining;
}

const struct sd_job_module sd_values_module = {.name = "values",
                                               .create = values_create,
                                               .destroy = values_destroy,
                                               .event = values_event,
                                               .fail_parked = values_fail_parked,
                                               .sweep = values_sweep,
                                               .queue_waiting = values_queue_waiting,
                                               .queue_poll = values_queue_poll};

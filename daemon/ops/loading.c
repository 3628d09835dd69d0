/* Loading: rank 0's initial values into every node's shards (node 0 sends each node the part of
 * each unit it holds), and the ready barrier every rank waits in before its first fetch; and
 * values written into a running job between steps (model.load_state_dict, an optimizer's
 * load_state_dict: every rank writes its own shards from the same values), then the node's
 * barrier after which the written weights are a new generation. */
#include "barrier.h"
#include "cluster/cluster.h"
#include "net.h"
#include "job_module.h"
#include "fetch.h"
#include "loading.h"
#include "optimizer.h"
#include "schedule.h"
#include "session.h"
#include "step.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <stdlib.h>

/* Loading the initial values and the ready barrier. */
struct sd_loading_state {
    struct sd_barrier ready; /* the local ranks' ready calls */
    uint32_t next_unit;      /* the unit this node receives next (not node 0) */
    bool done, remote_ready;
    struct sd_bulk *rb;
    struct sd_session *waiter; /* rank 0's init call, until the other nodes have the values */
    uint64_t tag;
    uint32_t sends;
    /* the job's queue has not passed the conversion of the values yet (ticket): rank 0's init
     * call (converted) or the next receive (received), until the loop's poll saw it pass; the
     * staging slot or scratch they were read from is not reused before (DESIGN.md 7b) */
    bool converted, received;
    uint64_t ticket, start_ns;
    uint32_t unit;
    const float *values;
    /* writes into the running job (sd_loading_write): a rank's write whose copies the job's
     * queue has not passed yet (its staging slot is read until then), answered by the poll */
    struct sd_write_wait {
        bool waiting;
        uint64_t ticket, tag, start_ns;
    } * w;                     /* [k] */
    uint32_t w_waiting;        /* of them */
    struct sd_barrier written; /* the ranks' SD_OP_WRITTEN */
    bool weights_written;      /* since the last barrier: the weights changed */
    bool draining;             /* the barrier is full, and waits for the node's gathers in flight */
    /* a rank's read of a unit's master weights or optimizer state (sd_loading_read): one at a
     * time on a node, its other ranks' reads wait on their rings */
    struct sd_state_read {
        bool active, copying;
        uint32_t local, unit, what, seq, remaining, suspect;
        int status;
        uint64_t tag, start_ns, ticket;
        struct sd_xfer *xs; /* [os group nodes - 1]: the pull requests' sends */
    } rd;
};

int sd_loading_create(struct sd_job *job)
{
    struct sd_loading_state *ls = calloc(1, sizeof(*ls));
    job->load.init = ls;
    uint32_t G = job->gnodes[SD_STATE_OS];
    if (ls == NULL || (ls->w = calloc(job->k, sizeof(*ls->w))) == NULL ||
        (ls->rd.xs = calloc(G > 1 ? G - 1 : 1, sizeof(*ls->rd.xs))) == NULL)
        return SD_ENOMEM;
    int st = sd_barrier_init(&ls->ready, job->k);
    return st == SD_OK ? sd_barrier_init(&ls->written, job->k) : st;
}

void sd_loading_destroy(struct sd_job *job)
{
    if (job->load.init == NULL)
        return;
    sd_barrier_fini(&job->load.init->ready);
    sd_barrier_fini(&job->load.init->written);
    free(job->load.init->w);
    free(job->load.init->rd.xs);
    free(job->load.init);
    job->load.init = NULL;
}

/* the job's common paths (job_module.h): loading the initial values, waiting for no node in
 * particular */
static bool loading_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns)
{
    if (job->state != SD_JOB_LOADING || job->load.init == NULL)
        return false;
    snprintf(what, len, "loading the initial values (unit %u of %u)", job->load.init->next_unit,
             job->layout.n_units);
    *since_ns = 0;
    return true;
}

static void init_sent(struct sd_job *job, struct sd_session *s, uint64_t tag, uint32_t unit,
                      const float *values);
static void tell_ready(struct sd_job *job);

void sd_loading_unit(struct sd_job *job, uint32_t unit, const float *src, uint64_t src_off,
                     bool host_src)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[unit];
    /* a device's kernels read device memory only: host values pass through scratch (in queue
     * order, so each rank's conversion reads its own copy) */
    bool staged = host_src && !dev->host_memory;
    for (uint32_t r = 0; r < job->k; r++) {
        uint64_t b, e;
        sd_layout_shard(ul, &job->plan, SD_STATE_OS, job->first_rank + r, &b, &e);
        float *master = (float *)sd_job_state(job, r, SD_STATE_OS) + ul->arena_off[SD_STATE_OS];
        dev->copy(job->mem.queue, master, src + (b - src_off), (e - b) * sizeof(float));
        sd_layout_shard(ul, &job->plan, SD_STATE_W, job->first_rank + r, &b, &e);
        const float *w_src = src + (b - src_off);
        if (staged) {
            dev->copy(job->mem.queue, job->mem.scratch, w_src, (e - b) * sizeof(float));
            w_src = job->mem.scratch;
        }
        dev->from_f32(job->mem.queue, sd_job_w_shard(job, r, unit), ul->dtype, w_src, e - b);
    }
}

/* rank 0's init of unit from values, once the job's queue converted them */
static void init_converted(struct sd_job *job, struct sd_session *s, uint64_t tag, uint32_t unit,
                           const float *values, uint64_t start)
{
    job->stats.ops[SD_OP_INIT]++;
    sd_latency_add(&job->stats.lat[SD_OP_INIT], sd_now_ns() - start);
    if (job->nodes > 1)
        init_sent(job, s, tag, unit, values); /* completes once the other nodes have it */
    else
        sd_session_complete(s, tag, SD_OP_INIT, SD_OK, 0, 0, NULL);
}

bool sd_loading_init(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start)
{
    struct sd_loading_state *ls = job->load.init;
    if (s->rank != 0) {
        sd_session_fail(s, e, SD_EPERM, "init: only rank 0 loads initial values (this is rank %u)",
                        s->rank);
        return true;
    }
    const char *from = sd_job_values_from(job); /* a checkpoint, a paused job's state */
    if (job->state != SD_JOB_LOADING || from != NULL) {
        sd_session_fail(s, e, SD_ESTATE, "init: job '%s' is %s, not loading initial values",
                        job->name, from != NULL ? from : sd_job_state_name(job->state));
        return true;
    }
    if (e->unit >= job->layout.n_units || e->arg0 >= job->mem.staging_slots) {
        sd_session_fail(s, e, SD_EINVAL, "init: unit %u or staging slot %llu out of range", e->unit,
                        (unsigned long long)e->arg0);
        return true;
    }
    if (ls->waiter != NULL)
        return false; /* the previous init is still converted or sent: this one waits */
    const float *src = (const float *)(void *)sd_job_staging_slot(job, s->local, (uint32_t)e->arg0);
    sd_loading_unit(job, e->unit, src, 0, false);
    /* the kernels read the staging slot the client refills next: answered once they are done */
    int st = sd_job_queue_mark(job, false, &ls->ticket);
    if (st == SD_EAGAIN) { /* the loop's poll answers it (sd_loading_queue_poll) */
        ls->waiter = s;
        ls->tag = e->tag;
        ls->converted = true;
        ls->start_ns = start;
        ls->unit = e->unit;
        ls->values = src;
        return true;
    }
    if (st != SD_OK) {
        sd_job_backend_failed(job, st);
        sd_session_fail(s, e, job->fail_status, "init: %s", job->fail_msg);
        return true;
    }
    init_converted(job, s, e->tag, e->unit, src, start);
    return true;
}

/* The job is ready on this node: answer every rank waiting in the ready barrier. */
static void set_ready(struct sd_job *job)
{
    if (job->state != SD_JOB_LOADING)
        return;
    job->state = SD_JOB_READY;
    job->was_ready = true;
    SD_INFO("job", "job '%s' ready", job->name);
    struct sd_req q;
    for (uint32_t r = 0; r < job->k; r++) {
        if (!sd_barrier_take(&job->load.init->ready, r, &q) || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_READY]++;
        sd_session_complete(job->ranks[r], q.tag, SD_OP_READY, SD_OK, 0, 0, NULL);
    }
}

void sd_loading_ready(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start)
{
    if (job->state == SD_JOB_READY || (job->state == SD_JOB_CLOSING && job->was_ready)) {
        sd_op_done(job, s, e, 0, 0, start);
        return;
    }
    if (!sd_barrier_arrive(&job->load.init->ready, s->local, e->tag, sd_now_ns())) {
        sd_session_fail(s, e, SD_EBUSY, "ready: rank %u already waits for job '%s' to be ready",
                        s->rank, job->name);
        return;
    }
    if (sd_job_values_from(job) != NULL) {
        /* ready once this node read (or took over) its part (sd_loading_loaded) */
        if (job->load.init->done)
            set_ready(job);
        return;
    }
    if (s->rank != 0)
        return;
    if (job->nodes > 1)
        tell_ready(job); /* tells the other nodes */
    set_ready(job);
}

/* ---- initial values: node 0 sends each node the part of each unit it holds */

void sd_loading_range(const struct sd_job *job, uint32_t m, const struct sd_unit_layout *ul,
                      uint64_t *lo, uint64_t *hi)
{
    *lo = ul->numel;
    *hi = 0;
    for (uint32_t r = m * job->k; r < (m + 1) * job->k; r++) {
        uint64_t b, e;
        sd_layout_shard(ul, &job->plan, SD_STATE_W, r, &b, &e);
        *lo = SD_MIN(*lo, b);
        *hi = SD_MAX(*hi, e);
    }
}

static void init_recv_done(struct sd_bulk *b, int status);
static void init_send_done(struct sd_bulk *b, int status);

/* count initial values of unit u, from node 0 (a receive into base) or to node peer (a send from
 * base): one chunked transfer on a bulk of the job's pool. */
static int init_transfer(struct sd_job *job, bool is_send, uint32_t peer, uint32_t u, void *base,
                         uint64_t count, struct sd_bulk **b_p)
{
    struct sd_bulk *b = sd_bulk_get(&job->xfer.bulks);
    uint64_t tag = 0;
    int st = sd_tag_make(SD_TAG_INIT, job->xfer.tag, u, 0, 0, &tag);
    if (st == SD_OK)
        st = sd_bulk_start(b,
                           &(struct sd_bulk_param){.tp = sd_job_tp(job),
                                                   .is_send = is_send,
                                                   .peer = peer,
                                                   .tag = tag,
                                                   .pieces = &base,
                                                   .n_pieces = 1,
                                                   .piece_len = count * sizeof(float),
                                                   .chunk_bytes = job->reg->cfg->chunk_bytes,
                                                   .desc = sd_job_net_desc(job, base),
                                                   .cb = is_send ? init_send_done : init_recv_done,
                                                   .arg = job});
    if (st != SD_OK) {
        if (b != NULL)
            sd_bulk_put(&job->xfer.bulks, b);
        return st;
    }
    if (b_p != NULL)
        *b_p = b;
    return SD_OK;
}

static void init_post_next(struct sd_job *job)
{
    if (job->load.init->next_unit >= job->layout.n_units) {
        job->load.init->done = true;
        if (job->load.init->remote_ready) {
            set_ready(job);
            sd_fetch_serve_queue(job);
        }
        return;
    }
    uint32_t u = job->load.init->next_unit;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t lo, hi;
    sd_loading_range(job, job->node, ul, &lo, &hi);
    /* into scratch where sd_loading_unit looks for elements [lo, hi) */
    int st = init_transfer(job, false, 0, u, job->mem.scratch + lo, hi - lo, &job->load.init->rb);
    if (st != SD_OK)
        sd_job_fail(job, st, "cannot receive the initial values of unit %u from node 0", u);
}

static void init_recv_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    job->stats.bytes[SD_OP_INIT][SD_LINK_INTER_RECV] += b->bytes;
    sd_bulk_put(&job->xfer.bulks, b);
    job->load.init->rb = NULL;
    if (status != SD_OK) {
        char peer[64];
        sd_job_fail(job, SD_EPEER, "receiving the initial values of unit %u from %s failed: %s",
                    job->load.init->next_unit, sd_job_peer_name(job, 0, peer, sizeof(peer)),
                    sd_status_str(status));
        return;
    }
    sd_loading_unit(job, job->load.init->next_unit, job->mem.scratch, 0, false);
    /* the next unit's values arrive where these are read: received once the kernels are done */
    int st = sd_job_queue_mark(job, false, &job->load.init->ticket);
    job->load.init->received = st == SD_EAGAIN;
    if (st == SD_EAGAIN)
        return; /* the loop's poll goes on (sd_loading_queue_poll) */
    if (st != SD_OK) {
        sd_job_backend_failed(job, st);
        return;
    }
    job->load.init->next_unit++;
    init_post_next(job);
}

bool sd_loading_queue_waiting(const struct sd_job *job)
{
    const struct sd_loading_state *ls = job->load.init;
    return ls != NULL && (ls->converted || ls->received || ls->w_waiting > 0 || ls->rd.copying);
}

static bool writes_poll(struct sd_job *job);
static bool read_poll(struct sd_job *job);

bool sd_loading_queue_poll(struct sd_job *job)
{
    struct sd_loading_state *ls = job->load.init;
    if (!sd_loading_queue_waiting(job) || job->state == SD_JOB_FAILED)
        return false;
    if (ls->rd.copying)
        return read_poll(job);
    if (ls->w_waiting > 0)
        return writes_poll(job);
    int st = job->reg->dev->query(job->mem.queue, ls->ticket);
    if (st == SD_EAGAIN)
        return false;
    bool converted = ls->converted;
    ls->converted = ls->received = false;
    if (st != SD_OK) {
        sd_job_backend_failed(job, st); /* answers a parked init with the failure */
        return true;
    }
    if (converted) {
        struct sd_session *s = ls->waiter;
        ls->waiter = NULL;
        init_converted(job, s, ls->tag, ls->unit, ls->values, ls->start_ns);
    } else {
        ls->next_unit++;
        init_post_next(job);
    }
    return true;
}

void sd_loading_start(struct sd_job *job)
{
    if (job->node != 0)
        init_post_next(job);
}

static void init_send_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    job->stats.bytes[SD_OP_INIT][SD_LINK_INTER_SENT] += b->bytes;
    sd_bulk_put(&job->xfer.bulks, b);
    if (status != SD_OK && job->load.init->waiter != NULL) {
        sd_session_complete(job->load.init->waiter, job->load.init->tag, SD_OP_INIT, SD_EPEER, 0, 0,
                            "sending the initial values to another node failed");
        job->load.init->waiter = NULL;
    }
    if (--job->load.init->sends > 0 || job->load.init->waiter == NULL)
        return;
    sd_session_complete(job->load.init->waiter, job->load.init->tag, SD_OP_INIT, SD_OK, 0, 0, NULL);
    job->load.init->waiter = NULL;
}

static void init_sent(struct sd_job *job, struct sd_session *s, uint64_t tag, uint32_t unit,
                      const float *values)
{
    const struct sd_unit_layout *ul = &job->layout.units[unit];
    job->load.init->waiter = s;
    job->load.init->tag = tag;
    job->load.init->sends = 0;
    for (uint32_t m = 1; m < job->nodes; m++) {
        uint64_t lo, hi;
        sd_loading_range(job, m, ul, &lo, &hi);
        if (init_transfer(job, true, m, unit, (void *)(values + lo), hi - lo, NULL) == SD_OK)
            job->load.init->sends++;
    }
    if (job->load.init->sends == 0) {
        sd_session_complete(s, tag, SD_OP_INIT, SD_OK, 0, 0, NULL);
        job->load.init->waiter = NULL;
    }
}

static void tell_ready(struct sd_job *job)
{
    sd_cluster_job_ready(sd_job_cluster(job), job->name, job->xfer.node_ids, job->nodes);
    job->load.init->remote_ready = job->load.init->done = true;
    sd_fetch_serve_queue(job);
}

void sd_loading_loaded(struct sd_job *job)
{
    job->load.init->done = job->load.init->remote_ready = true;
    set_ready(job);
    sd_fetch_serve_queue(job);
}

void sd_loading_remote_ready(struct sd_job *job)
{
    /* (a job confirmed here may still wait for its nodes' data paths when node 0 is done:
     * kept for when its loading ends) */
    if (job->state != SD_JOB_LOADING && job->state != SD_JOB_REGISTERING)
        return;
    job->load.init->remote_ready = true;
    if (job->state != SD_JOB_LOADING)
        return;
    if (job->load.init->done) {
        set_ready(job);
        sd_fetch_serve_queue(job);
    }
}

/* ---- values written into a running job */

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

/* local rank r's optimizer state s of unit ul, its os shard */
static float *os_state(struct sd_job *job, uint32_t r, uint32_t s, const struct sd_unit_layout *ul)
{
    uint64_t stride = sd_arena_os_stride(job->layout.arena_numel[SD_STATE_OS]);
    return (float *)sd_job_state(job, r, SD_STATE_OS) + s * stride + ul->arena_off[SD_STATE_OS];
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
        dev->copy(job->mem.queue, os_state(job, r, what, ul) + (lo - b), from,
                  (hi - lo) * sizeof(float));
    else
        dev->from_f32(job->mem.queue,
                      sd_job_w_shard(job, r, job->model.tensors[t].unit) +
                          (lo - b) * sd_dtype_size(ul->dtype),
                      ul->dtype, from, hi - lo);
}

bool sd_loading_write(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start)
{
    struct sd_loading_state *ls = job->load.init;
    const struct sd_layout *l = &job->layout;
    uint32_t t = e->unit, slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32);
    uint32_t states = sd_optim_state_floats(job->model.optim.kind);
    char why[256];
    if (ls->w[s->local].waiting)
        return false; /* its previous write is still read from its slot */
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
    if (sd_barrier_waits(&ls->written, s->local)) {
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
        ls->weights_written = true;
    }
    /* the client refills the slot once answered: answered once the copies read it */
    struct sd_write_wait *w = &ls->w[s->local];
    int st = sd_job_queue_mark(job, false, &w->ticket);
    if (st == SD_EAGAIN) {
        w->waiting = true;
        w->tag = e->tag;
        w->start_ns = start;
        ls->w_waiting++;
        return true;
    }
    if (st != SD_OK) {
        sd_job_backend_failed(job, st);
        sd_session_fail(s, e, job->fail_status, "write tensor %u: %s", t, job->fail_msg);
        return true;
    }
    sd_op_done(job, s, e, 0, 0, start);
    return true;
}

/* the writes whose copies the job's queue passed: answered */
static bool writes_poll(struct sd_job *job)
{
    struct sd_loading_state *ls = job->load.init;
    bool moved = false;
    for (uint32_t r = 0; r < job->k && ls->w_waiting > 0; r++) {
        struct sd_write_wait *w = &ls->w[r];
        if (!w->waiting)
            continue;
        int st = job->reg->dev->query(job->mem.queue, w->ticket);
        if (st == SD_EAGAIN)
            continue;
        w->waiting = false;
        ls->w_waiting--;
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
    struct sd_loading_state *ls = job->load.init;
    if (!sd_barrier_full(&ls->written) || job->state != SD_JOB_READY)
        return;
    if (job->xfer.gathers_inflight > 0 || ls->w_waiting > 0) {
        ls->draining = true; /* SD_JOB_EV_TRANSFERS, or the poll, comes back */
        return;
    }
    ls->draining = false;
    if (ls->weights_written) {
        job->xfer.pre_write_gen1 = job->weights_gen + 1;
        job->weights_gen++;
        ls->weights_written = false;
        SD_INFO("job", "job '%s': written weights after step %llu (generation %llu)", job->name,
                (unsigned long long)job->steps, (unsigned long long)job->weights_gen);
    }
    struct sd_req q;
    uint64_t now = sd_now_ns();
    for (uint32_t r = 0; r < job->k; r++) {
        if (!sd_barrier_take(&ls->written, r, &q) || job->ranks[r] == NULL)
            continue;
        job->stats.ops[SD_OP_WRITTEN]++;
        sd_latency_add(&job->stats.lat[SD_OP_WRITTEN], now - q.since_ns);
        sd_session_complete(job->ranks[r], q.tag, SD_OP_WRITTEN, SD_OK, job->weights_gen, 0, NULL);
    }
    sd_fetch_serve_queue(job); /* requests of the new generation, waiting here */
    sd_sched_prefetch(job);
}

void sd_loading_written(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    struct sd_loading_state *ls = job->load.init;
    char why[256];
    if (write_refusal(job, s, why, sizeof(why)) != NULL) {
        sd_session_fail(s, e, SD_ESTATE, "write_done: %s", why);
        return;
    }
    if (!sd_barrier_arrive(&ls->written, s->local, e->tag, sd_now_ns())) {
        sd_session_fail(s, e, SD_EBUSY, "write_done: rank %u already waits for the others",
                        s->rank);
        return;
    }
    written_try(job);
}

/* ---- a rank's read of a unit's state (SD_OP_READ) */

static void read_answer(struct sd_job *job, int status, const char *msg)
{
    struct sd_state_read *rd = &job->load.init->rd;
    struct sd_session *s = job->ranks[rd->local];
    rd->active = rd->copying = false;
    if (s == NULL)
        return;
    if (status == SD_OK) {
        job->stats.ops[SD_OP_READ]++;
        sd_latency_add(&job->stats.lat[SD_OP_READ], sd_now_ns() - rd->start_ns);
    }
    sd_session_complete(s, rd->tag, SD_OP_READ, status, 0, 0, msg);
}

/* the transfers of the read ended (or none was needed): answered once the device wrote the
 * slot */
static void read_finish(struct sd_job *job)
{
    struct sd_state_read *rd = &job->load.init->rd;
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
    struct sd_state_read *rd = &job->load.init->rd;
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
    struct sd_state_read *rd = &job->load.init->rd;
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
    struct sd_state_read *rd = &job->load.init->rd;
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
    struct sd_state_read *rd = &job->load.init->rd;
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

bool sd_loading_read(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start)
{
    struct sd_loading_state *ls = job->load.init;
    struct sd_state_read *rd = &ls->rd;
    const struct sd_layout *l = &job->layout;
    uint32_t slot = (uint32_t)e->arg0, what = (uint32_t)(e->arg0 >> 32);
    uint32_t states = sd_optim_state_floats(job->model.optim.kind);
    char why[256];
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
    if (write_refusal(job, s, why, sizeof(why)) != NULL) {
        sd_session_fail(s, e, SD_ESTATE, "read unit %u: %s", e->unit, why);
        return true;
    }
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
            os_state(job, q, what, ul), len * sizeof(float));
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

static void loading_fail_parked(struct sd_job *job, int status, const char *text, bool with_fetches)
{
    (void)with_fetches;
    job->load.init->converted = job->load.init->received = false; /* nothing goes on after it */
    if (job->load.init->waiter != NULL) {
        sd_session_complete(job->load.init->waiter, job->load.init->tag, SD_OP_INIT, status, 0, 0,
                            text);
        job->load.init->waiter = NULL;
    }
    struct sd_req q;
    struct sd_loading_state *ls = job->load.init;
    for (uint32_t r = 0; r < job->k; r++) {
        if (sd_barrier_take(&ls->ready, r, &q) && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], q.tag, SD_OP_READY, status, 0, 0, text);
        if (sd_barrier_take(&ls->written, r, &q) && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], q.tag, SD_OP_WRITTEN, status, 0, 0, text);
        if (ls->w[r].waiting && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], ls->w[r].tag, SD_OP_WRITE, status, 0, 0, text);
        ls->w[r].waiting = false;
    }
    ls->w_waiting = 0;
    ls->draining = false;
    if (ls->rd.active) /* (its transfers, if any, end without answering again) */
        read_answer(job, status, text);
}

/* ranks at the ready barrier while rank 0's initial values do not come; ranks that ended their
 * writes while others of the node do not */
static bool loading_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    bool present[SD_MAX_LOCAL_RANKS];
    if (job->state == SD_JOB_READY &&
        sd_barrier_overdue(&job->load.init->written, now, op_timeout, present)) {
        char missing[128];
        sd_job_missing_ranks(job, present, missing, sizeof(missing));
        sd_job_fail(job, SD_ETIMEDOUT,
                    "write_done after step %llu: ranks %s did not end their writes within %lld ms "
                    "(op_timeout_ms; every rank loads the same state_dict)",
                    (unsigned long long)job->steps, missing,
                    (long long)job->reg->cfg->op_timeout_ms);
        return true;
    }
    if (job->state != SD_JOB_LOADING)
        return false;
    if (job->load.init->ready.arrived == 0 || sd_job_shards_busy(job) ||
        now - job->created_ns <=
            op_timeout + (uint64_t)job->reg->cfg->register_timeout_ms * 1000000ULL)
        return false;
    sd_job_fail(job, SD_ETIMEDOUT, "rank 0 did not finish loading the initial values in time");
    return true;
}

/* a gather's transfers ended: a full written barrier that waited for them goes on */
static bool loading_event(struct sd_job *job, const struct sd_job_ev *ev)
{
    struct sd_loading_state *ls = job->load.init;
    if (ev->kind != SD_JOB_EV_TRANSFERS || ls == NULL || !ls->draining)
        return false;
    written_try(job);
    return !ls->draining;
}

const struct sd_job_module sd_loading_module = {.name = "loading",
                                                .event = loading_event,
                                                .create = sd_loading_create,
                                                .destroy = sd_loading_destroy,
                                                .fail_parked = loading_fail_parked,
                                                .sweep = loading_sweep,
                                                .activity = loading_activity,
                                                .queue_waiting = sd_loading_queue_waiting,
                                                .queue_poll = sd_loading_queue_poll};

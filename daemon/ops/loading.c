/* Loading: rank 0's initial values into every node's shards (node 0 sends each node the part of
 * each unit it holds), and the ready barrier every rank waits in before its first fetch. */
#include "barrier.h"
#include "cluster/cluster.h"
#include "net.h"
#include "job_module.h"
#include "fetch.h"
#include "loading.h"
#include "session.h"
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
};

int sd_loading_create(struct sd_job *job)
{
    struct sd_loading_state *ls = calloc(1, sizeof(*ls));
    job->load.init = ls;
    return ls != NULL ? sd_barrier_init(&ls->ready, job->k) : SD_ENOMEM;
}

void sd_loading_destroy(struct sd_job *job)
{
    if (job->load.init == NULL)
        return;
    sd_barrier_fini(&job->load.init->ready);
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
    return ls != NULL && (ls->converted || ls->received);
}

bool sd_loading_queue_poll(struct sd_job *job)
{
    struct sd_loading_state *ls = job->load.init;
    if (!sd_loading_queue_waiting(job) || job->state == SD_JOB_FAILED)
        return false;
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
    for (uint32_t r = 0; r < job->k; r++)
        if (sd_barrier_take(&job->load.init->ready, r, &q) && job->ranks[r] != NULL)
            sd_session_complete(job->ranks[r], q.tag, SD_OP_READY, status, 0, 0, text);
}

/* ranks at the ready barrier while rank 0's initial values do not come */
static bool loading_sweep(struct sd_job *job, uint64_t now, uint64_t op_timeout)
{
    if (job->state != SD_JOB_LOADING)
        return false;
    if (job->load.init->ready.arrived == 0 || sd_job_shards_busy(job) ||
        now - job->created_ns <=
            op_timeout + (uint64_t)job->reg->cfg->register_timeout_ms * 1000000ULL)
        return false;
    sd_job_fail(job, SD_ETIMEDOUT, "rank 0 did not finish loading the initial values in time");
    return true;
}

const struct sd_job_module sd_loading_module = {.name = "loading",
                                                .create = sd_loading_create,
                                                .destroy = sd_loading_destroy,
                                                .fail_parked = loading_fail_parked,
                                                .sweep = loading_sweep,
                                                .activity = loading_activity,
                                                .queue_waiting = sd_loading_queue_waiting,
                                                .queue_poll = sd_loading_queue_poll};

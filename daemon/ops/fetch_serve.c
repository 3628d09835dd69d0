/* Fetch's other side: a peer's pull request for a unit's block answered from this node's w
 * arenas (or their ,qw encodings) once this node reached the requested weights generation;
 * requests that come early wait in the job's queue (DESIGN.md section 3, step 2). */
#include "net.h"
#include "job_module.h"
#include "fetch.h"
#include "quant.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <string.h>

static void serve_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    job->stats.bytes[SD_OP_FETCH][SD_LINK_INTER_SENT] += b->bytes;
    job->stats.saved[SD_OP_FETCH][SD_LINK_INTER_SENT] += (int64_t)b->arg2 - (int64_t)b->bytes;
    job->xfer.w_sends_inflight--;
    uint32_t peer = b->peer;
    sd_bulk_put(&job->xfer.bulks, b);
    if (status != SD_OK)
        SD_WARN_SPARSE("net", "job '%s': sending weights to node %u failed: %s", job->name, peer,
                       sd_status_str(status));
    sd_job_event(job, SD_JOB_EV_W_SENT);
}

static void state_sent(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    job->stats.bytes[SD_OP_READ][SD_LINK_INTER_SENT] += b->bytes;
    uint32_t peer = b->peer;
    sd_bulk_put(&job->xfer.bulks, b);
    if (status != SD_OK)
        SD_WARN_SPARSE("net", "job '%s': sending optimizer state to node %u failed: %s", job->name,
                       peer, sd_status_str(status));
}

/* A peer's rank reads a unit's optimizer state (SD_OP_READ, loading.c): this node's ranks'
 * shards of it, in local rank order. The state is a step's: a request of a later generation
 * waits for this node's step (false), one of an earlier one (a write since) reads what is
 * there. */
static bool serve_state(struct sd_job *job, const struct sd_req_msg *m)
{
    if (job->state != SD_JOB_READY && job->state != SD_JOB_CLOSING)
        return job->state != SD_JOB_LOADING && job->state != SD_JOB_REGISTERING;
    if (m->gen > job->weights_gen)
        return false;
    struct sd_bulk *b = sd_bulk_get(&job->xfer.bulks);
    if (b == NULL)
        return false;
    int st = sd_job_net_reg_os(job);
    if (st != SD_OK)
        SD_WARN_SPARSE("net", "job '%s': registering its optimizer state with the fabric: %s",
                       job->name, sd_status_str(st));
    const struct sd_unit_layout *ul = &job->layout.units[m->unit];
    void *pieces[SD_BULK_MAX_PIECES];
    for (uint32_t q = 0; q < job->k; q++)
        pieces[q] = sd_job_os_state(job, q, m->state - 1, ul);
    uint64_t tag = 0;
    st = sd_tag_make(SD_TAG_SDATA, job->xfer.tag, m->unit, m->lslot & ((1u << SD_TAG_SEQ_BITS) - 1),
                     job->node, &tag);
    if (st == SD_OK)
        st = sd_bulk_start(b, &(struct sd_bulk_param){
                                  .tp = sd_job_tp(job),
                                  .is_send = true,
                                  .peer = m->src,
                                  .tag = tag,
                                  .pieces = pieces,
                                  .n_pieces = job->k,
                                  .piece_len = ul->numel / job->plan.f[SD_STATE_OS] * sizeof(float),
                                  .chunk_bytes = job->reg->cfg->chunk_bytes,
                                  .desc = sd_job_net_desc(job, pieces[0]),
                                  .cb = state_sent,
                                  .arg = job});
    if (st != SD_OK) {
        sd_bulk_put(&job->xfer.bulks, b);
        SD_WARN("net", "job '%s': cannot send unit %u's optimizer state to node %u: %s", job->name,
                m->unit, m->src, sd_status_str(st));
    }
    return true;
}

/* Returns false if the request must wait. */
static bool serve(struct sd_job *job, const struct sd_req_msg *m)
{
    if (m->state != 0)
        return serve_state(job, m);
    /* a job confirmed here that still waits for its nodes' data paths (sd_job_confirm), or
     * loads, keeps the request; a failed job drops it */
    if (job->state != SD_JOB_READY && job->state != SD_JOB_CLOSING)
        return job->state != SD_JOB_LOADING && job->state != SD_JOB_REGISTERING;
    if (m->gen > job->weights_gen)
        return false;
    if (m->gen < job->weights_gen && m->gen + 1 != job->xfer.pre_write_gen1) {
        SD_WARN_SPARSE("net",
                       "job '%s': node %u asks for weights generation %llu of unit %u, "
                       "this node is at %llu",
                       job->name, m->src, (unsigned long long)m->gen, m->unit,
                       (unsigned long long)job->weights_gen);
        return true;
    }
    struct sd_bulk *b = sd_bulk_get(&job->xfer.bulks);
    if (b == NULL)
        return false;
    /* this node's block of each unit asked for: its ranks' shards, unit by unit */
    /* (with ,qw their int8 blocks, encoded once per generation) */
    uint32_t n_units = m->n_units ? m->n_units : 1;
    void *pieces[SD_BULK_MAX_PIECES];
    size_t lens[SD_BULK_MAX_PIECES];
    uint64_t raw = 0;
    bool fresh = false;
    for (uint32_t i = 0, p = 0; i < n_units; i++) {
        for (uint32_t j = 0; j < job->k; j++, p++) {
            raw += sd_job_w_shard_bytes(job, m->unit + i);
            if (job->plan.qw) {
                pieces[p] = sd_qw_shard(job, j, m->unit + i, &fresh);
                lens[p] = sd_qw_shard_bytes(job, m->unit + i);
                continue;
            }
            pieces[p] = sd_job_w_shard(job, j, m->unit + i);
            lens[p] = sd_job_w_shard_bytes(job, m->unit + i);
        }
    }
    /* ,qw: the encodings leave once the device wrote them; until then requests wait (queued)
     * and the loop polls the queue (sd_fetch_queue_poll). A request of this generation cannot be
     * outlived by it: this node's optimizer waits for every node's norm, which waits for their
     * gathers. */
    int qst = fresh ? sd_job_queue_mark(job, false, &job->xfer.enc_ticket) : SD_OK;
    if (qst != SD_OK && qst != SD_EAGAIN) {
        sd_bulk_put(&job->xfer.bulks, b);
        sd_job_backend_failed(job, qst);
        return true;
    }
    job->xfer.enc_wait |= qst == SD_EAGAIN;
    if (job->xfer.enc_wait) {
        sd_bulk_put(&job->xfer.bulks, b);
        return false;
    }
    uint32_t seq = 0;
    uint64_t tag = 0;
    int st = sd_tag_weights_seq(m->gen, m->lslot, &seq);
    if (st == SD_OK)
        st = sd_tag_make(SD_TAG_WDATA, job->xfer.tag, m->unit, seq, job->node, &tag);
    if (st == SD_OK)
        st = sd_bulk_start(b, &(struct sd_bulk_param){.tp = sd_job_tp(job),
                                                      .is_send = true,
                                                      .peer = m->src,
                                                      .tag = tag,
                                                      .pieces = pieces,
                                                      .lens = lens,
                                                      .n_pieces = n_units * job->k,
                                                      .chunk_bytes = job->reg->cfg->chunk_bytes,
                                                      .desc = sd_job_net_desc(job, pieces[0]),
                                                      .cb = serve_done,
                                                      .arg = job,
                                                      .arg2 = raw});
    if (st != SD_OK) {
        sd_bulk_put(&job->xfer.bulks, b);
        SD_WARN("net", "job '%s': cannot send unit %u to node %u: %s", job->name, m->unit, m->src,
                sd_status_str(st));
        return true;
    }
    job->xfer.w_sends_inflight++;
    return true;
}

void sd_fetch_serve_queue(struct sd_job *job)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < job->xfer.req_queued; i++)
        if (!serve(job, &job->xfer.req_queue[i]))
            job->xfer.req_queue[kept++] = job->xfer.req_queue[i];
    job->xfer.req_queued = kept;
}

/* A pull request for job (found by its tag): checked against the job, then served now or
 * queued until the requested generation is reached. */
void sd_fetch_on_request(struct sd_job *job, const struct sd_req_msg *m)
{
    uint32_t n_units = m->n_units ? m->n_units : 1;
    if (m->state != 0 &&
        (job->cache.units == NULL || m->unit >= job->layout.n_units || n_units != 1 ||
         m->state > sd_optim_state_floats(job->model.optim.kind) || m->src >= job->nodes ||
         m->src == job->node || job->k > SD_BULK_MAX_PIECES)) {
        SD_WARN_SPARSE("net",
                       "dropping a read of job '%s' (tag %u) unit %u state %u from node %u: no "
                       "such unit, state or node here",
                       job->name, m->job_tag, m->unit, m->state - 1, m->src);
        return;
    }
    if (m->state == 0 &&
        (job->cache.units == NULL || m->unit >= job->layout.n_units ||
         n_units > job->layout.n_units - m->unit || n_units * job->k > SD_BULK_MAX_PIECES ||
         m->lslot >= job->slots_per_unit || m->src >= job->nodes || m->src == job->node)) {
        SD_WARN_SPARSE("net",
                       "dropping a pull request for job '%s' (tag %u) units %u..%u from node %u: "
                       "no such units or node here",
                       job->name, m->job_tag, m->unit, m->unit + n_units - 1, m->src);
        return;
    }
    if (serve(job, m))
        return;
    if (job->xfer.req_queued < job->xfer.req_cap)
        job->xfer.req_queue[job->xfer.req_queued++] = *m;
    else
        SD_WARN_SPARSE("net", "job '%s': pull request queue full", job->name);
}

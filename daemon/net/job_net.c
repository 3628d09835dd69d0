/* A job's resources across nodes (MiCS, DESIGN.md section 3) for the operations that use the
 * collective engine: buffer sizes, memory registrations, the bulk pool and the node rounds'
 * buffers; the job's all-reduces and exchanges with their tags; and what its unfinished transfers
 * tell a failure message and the deadline sweep. */
#include "loading.h"
#include "step.h"
#include "checkpoint.h"
#include "net.h"
#include "quant.h"
#include "sd/codec.h"
#include "push.h"
#include "registry.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *sd_job_net_desc(const struct sd_job *job, const void *p)
{
    for (uint32_t i = 0; i < job->xfer.n_mrs; i++)
        if ((const char *)p >= (const char *)job->xfer.mr_base[i] &&
            (const char *)p < (const char *)job->xfer.mr_base[i] + job->xfer.mr_len[i])
            return job->xfer.mr_descs[i];
    return NULL;
}

int sd_job_net_allreduce(struct sd_job *job, const struct sd_job_allreduce *a)
{
    struct sd_allreduce_param p = {.group = {.tp = sd_job_tp(job),
                                             .pool = &job->xfer.bulks,
                                             .members = job->xfer.members,
                                             .n_members = a->R,
                                             .self = job->node},
                                   .dev = job->reg->dev,
                                   .queue = job->mem.queue,
                                   .dtype = SD_DTYPE_FP32,
                                   .buf = a->buf,
                                   .count = a->count,
                                   .tmp = a->tmp,
                                   .tmp_count = sd_push_ar_tmp_count(job),
                                   .acc = a->acc,
                                   .buf_desc = sd_job_net_desc(job, a->buf),
                                   .tmp_desc = sd_job_net_desc(job, a->tmp),
                                   .acc_desc = sd_job_net_desc(job, a->acc),
                                   .chunk_bytes = job->reg->cfg->chunk_bytes,
                                   .small_bytes = job->reg->cfg->small_allreduce_bytes,
                                   .cb = a->cb,
                                   .arg = a->arg};
    if (a->quantized) { /* int4 blocks (quant.h): the boundary hop under ,qg */
        p.qbits = SD_CODEC_INT4;
        p.qblock = job->plan.qblock;
        p.qbuf = sd_qg_hop_buf(job);
        p.qbuf_desc = sd_job_net_desc(job, p.qbuf);
        p.qerr = sd_qg_hop_ef(job, a->unit);
    }
    int st = sd_tag_make(SD_TAG_AR, job->xfer.tag, a->unit,
                         sd_tag_allreduce_seq(a->round, a->step_sync), 0, &p.tag_base);
    return st == SD_OK ? sd_allreduce_start(a->ar, &p) : st;
}

/* An exchange of kind with node peer: this node receives the message peer sends (src peer) and
 * sends its own (src self). Fails like a post that failed when a tag field does not fit. */
uint32_t sd_job_net_exchange(struct sd_job *job, struct sd_exchange_param *x, uint32_t kind,
                             uint32_t unit, uint32_t seq, int *status_p, uint32_t *suspect_p)
{
    x->pool = &job->xfer.bulks;
    x->tp = sd_job_tp(job);
    x->recv.desc = sd_job_net_desc(job, x->recv.buf);
    x->send.desc = sd_job_net_desc(job, x->send.buf);
    int st = sd_tag_make(kind, job->xfer.tag, unit, seq, x->peer, &x->recv.tag);
    if (st == SD_OK)
        st = sd_tag_make(kind, job->xfer.tag, unit, seq, job->node, &x->send.tag);
    if (st == SD_OK)
        return sd_bulk_exchange(x, NULL, status_p, suspect_p);
    if (*status_p == SD_OK) {
        *status_p = st;
        *suspect_p = x->peer;
    }
    return 0;
}

/* ---- sizes and set-up */

static uint32_t bulks_needed(const struct sd_job *job)
{
    uint32_t Gw = job->gnodes[SD_STATE_W], G = job->gnodes[SD_STATE_G], N = job->nodes;
    uint32_t gathers = SD_MAX_GATHERS_INFLIGHT * (Gw - 1);
    uint32_t serve = SD_MAX_GATHERS_INFLIGHT * (N - 1) * job->slots_per_unit;
    uint32_t round = sd_job_push_gens(job) * (2 * (G - 1) + 2 * (N - 1));
    uint32_t step =
        2 * (N - 1) + 2 + 2 * (job->gnodes[SD_STATE_OS] - 1); /* + the weights' all-gather */
    uint32_t init = N;
    return gathers + serve + round + step + init + 4;
}

/* Pinned buffers for device memory in flight: every chunk of every bulk this job may have on
 * the wire at once (bulks_needed bounds the bulks, a unit the chunks of one), each of the
 * largest chunk a bulk of the job may use, at most SD_STAGE_RESERVE_BYTES together (beyond
 * that a receive makes one, counted in shardctl's staging_buffer_bytes, and sends wait). */
#define SD_STAGE_RESERVE_BYTES (256ull << 20)

static void stage_buffers(const struct sd_job *job, const struct sd_config *cfg, size_t *bytes_p,
                          uint32_t *count_p)
{
    size_t chunk = sd_bulk_chunk_bytes(job->layout.max_unit_bytes, job->k, cfg->chunk_bytes);
    uint64_t per_bulk = (job->layout.max_unit_bytes + chunk - 1) / chunk;
    uint64_t count = (uint64_t)bulks_needed(job) * (per_bulk ? per_bulk : 1);
    *bytes_p = chunk;
    *count_p = (uint32_t)SD_MAX(8, SD_MIN(count, SD_STAGE_RESERVE_BYTES / chunk));
}

/* Does each round's all-reduce add its sum into the g shard itself (sd_allreduce's acc)? With
 * one rank per node the node's block of a unit is that rank's g shard, which every node of the
 * replication group keeps identical without 2-hop (the same sums added in the same order from
 * zero). Two rounds of one unit must not run at once then: the later one's all-gather could
 * land before the earlier one's. */
size_t sd_job_net_ar_tmp_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    uint32_t R = job->gnodes[SD_STATE_G] > 1 ? job->nodes / job->gnodes[SD_STATE_G] : job->nodes;
    uint64_t maxn = job->layout.max_unit_numel;
    uint64_t block = job->gnodes[SD_STATE_G] > 1 ? maxn / job->gnodes[SD_STATE_G] : maxn;
    /* the largest all-reduce is one block */
    size_t need = sd_allreduce_tmp_floats(block, R, cfg->small_allreduce_bytes);
    /* smaller units may take the direct path with (R - 1) * count floats */
    size_t small = cfg->small_allreduce_bytes / sizeof(float);
    return SD_MAX(need, (size_t)(R > 1 ? R - 1 : 0) * SD_MIN(small, block)) + 16;
}

/* Not when one rank's fp32 gradient is the partial: one rank a node, its g blocks the unit's
 * elements in order, every unit fp32. */
bool sd_job_net_round_buf(const struct sd_job *job)
{
    if (job->k > 1 || !sd_job_net_g_ident(job))
        return true;
    for (uint32_t u = 0; u < job->layout.n_units; u++)
        if (job->layout.units[u].dtype != SD_DTYPE_FP32)
            return true;
    return false;
}

/* partial, the G - 1 received blocks, the summed block and the all-reduce's temporary */
size_t sd_job_net_round_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    uint64_t maxn = job->layout.max_unit_numel;
    uint32_t G = job->gnodes[SD_STATE_G];
    uint64_t block = G > 1 ? maxn / G : 0;
    return (sd_job_net_round_buf(job) ? maxn : 0) + (G > 1 ? (uint64_t)G * block : 0) +
           sd_job_net_ar_tmp_floats(job, cfg) + 4 * 16; /* + 16 floats of slack each */
}

bool sd_job_net_rounds_accumulate(const struct sd_job *job)
{
    return job->k == 1 && !job->plan.two_hop && job->nodes / job->gnodes[SD_STATE_G] > 1 &&
           job->plan.f[SD_STATE_G] == job->gnodes[SD_STATE_G];
}

uint64_t sd_job_net_bytes(const struct sd_job *job, const struct sd_config *cfg)
{
    if (job->nodes <= 1)
        return 0;
    uint32_t Gw = job->gnodes[SD_STATE_W];
    uint64_t b = (uint64_t)sd_push_net_floats(job, cfg) * sizeof(float);
    b += (uint64_t)bulks_needed(job) * sizeof(struct sd_bulk);
    b += (uint64_t)job->n_slots * (Gw ? Gw - 1 : 0) * (sizeof(struct sd_xfer) + sizeof(void *));
    return b;
}

static int reg_mr(struct sd_job *job, const void *p, size_t len)
{
    if (p == NULL || len == 0)
        return SD_OK;
    uint32_t i = job->xfer.n_mrs;
    int st = sd_job_tp(job)->ops->mr_reg(sd_job_tp(job), (void *)p, len, &job->xfer.mr_descs[i],
                                         &job->xfer.mr_handles[i]);
    if (st == SD_OK) {
        job->xfer.mr_base[i] = p;
        job->xfer.mr_len[i] = len;
        job->xfer.n_mrs++;
    }
    return st;
}

int sd_job_net_setup(struct sd_job *job, char *err, size_t errlen)
{
    uint32_t Gw = job->gnodes[SD_STATE_W], N = job->nodes;
    uint64_t maxn = job->layout.max_unit_numel;
    job->xfer.net = job->reg->net;
    if (job->xfer.net == NULL) {
        snprintf(err, errlen, "this daemon has no cluster (nodes = 1)");
        return SD_ENOSYS;
    }
    if (job->k > 64 || Gw - 1 > 64 || job->k > SD_BULK_MAX_PIECES) {
        snprintf(err, errlen, "at most 64 ranks per node across nodes (have %u)", job->k);
        return SD_ENOSYS;
    }
    if (sd_job_tp_open(job) != SD_OK)
        goto err_nomem;
    int st = sd_bulk_pool_init(&job->xfer.bulks, bulks_needed(job));
    if (st != SD_OK)
        goto err_nomem;
    /* device memory crosses nodes through pinned buffers: ready before the first transfer */
    size_t stage_bytes;
    uint32_t stage_count;
    stage_buffers(job, job->reg->cfg, &stage_bytes, &stage_count);
    st = sd_transport_stage_reserve(sd_net_transport(job->xfer.net), stage_bytes, stage_count);
    if (st != SD_OK) {
        snprintf(err, errlen, "reserving pinned staging buffers failed: %s", sd_status_str(st));
        return st;
    }
    float *nr_mem = NULL;
    size_t nr_floats = 0;
    if (sd_push_net_setup(job, &nr_mem, &nr_floats) != SD_OK)
        goto err_nomem;
    if (Gw > 1) {
        for (uint32_t i = 0; i < job->n_slots; i++) {
            job->cache.units[i].rb = calloc(Gw, sizeof(*job->cache.units[i].rb));
            job->cache.units[i].req_x = calloc(Gw, sizeof(*job->cache.units[i].req_x));
            if (!job->cache.units[i].rb || !job->cache.units[i].req_x)
                goto err_nomem;
        }
    }
    job->xfer.members = calloc(N, sizeof(*job->xfer.members));
    job->xfer.req_cap = N * job->n_slots + 16;
    job->xfer.req_queue = calloc(job->xfer.req_cap, sizeof(*job->xfer.req_queue));
    uint32_t max_mrs = 2 * job->k + 7;
    job->xfer.mr_handles = calloc(max_mrs, sizeof(void *));
    job->xfer.mr_descs = calloc(max_mrs, sizeof(void *));
    job->xfer.mr_base = calloc(max_mrs, sizeof(void *));
    job->xfer.mr_len = calloc(max_mrs, sizeof(size_t));
    if (!job->xfer.members || !job->xfer.req_queue || !job->xfer.mr_handles ||
        !job->xfer.mr_descs || !job->xfer.mr_base || !job->xfer.mr_len)
        goto err_nomem;
    /* memory registered once per job */
    const struct sd_mem *quant = sd_quant_mem(job);
    st = reg_mr(job, job->mem.pool.ptr, job->mem.pool.bytes);
    for (uint32_t r = 0; st == SD_OK && r < job->k; r++) {
        st = reg_mr(job, sd_job_arena(job, r, SD_STATE_W)->ptr,
                    sd_job_arena(job, r, SD_STATE_W)->bytes);
        if (st == SD_OK)
            st = reg_mr(job, job->mem.staging[r].ptr, job->mem.staging[r].bytes);
    }
    if (st == SD_OK)
        st = reg_mr(job, job->mem.scratch, maxn * sizeof(float));
    if (st == SD_OK)
        st = reg_mr(job, nr_mem, nr_floats * sizeof(float));
    size_t norm_bytes;
    void *norm_buf = sd_step_net_buf(job, &norm_bytes);
    if (st == SD_OK)
        st = reg_mr(job, norm_buf, norm_bytes);
    if (st == SD_OK) /* encoded w shards, gather receive slots, int4 blocks */
        st = quant != NULL ? reg_mr(job, quant->ptr, quant->bytes) : SD_OK;
    if (st == SD_OK) /* the pull requests each gather sends live in its unit state */
        st = reg_mr(job, job->cache.units, job->n_slots * sizeof(*job->cache.units));
    const struct sd_mem *g_arena = sd_job_arena(job, 0, SD_STATE_G);
    if (st == SD_OK &&
        sd_job_net_rounds_accumulate(job)) /* the all-gathers of the rounds land there */
        st = reg_mr(job, g_arena->ptr, g_arena->bytes);
    if (st != SD_OK) {
        snprintf(err, errlen, "registering the job's memory with the fabric failed: %s",
                 sd_status_str(st));
        return st;
    }
    return SD_OK;

err_nomem:
    snprintf(err, errlen, "out of memory for the job's network buffers");
    return SD_ENOMEM;
}

void sd_job_net_teardown(struct sd_job *job)
{
    for (uint32_t i = 0; job->xfer.net && i < job->xfer.n_mrs; i++)
        sd_job_tp(job)->ops->mr_dereg(sd_job_tp(job), job->xfer.mr_handles[i]);
    job->xfer.n_mrs = 0;
    sd_job_tp_close(job);
    for (uint32_t i = 0; job->cache.units != NULL && i < job->n_slots; i++) {
        free(job->cache.units[i].rb);
        free(job->cache.units[i].req_x);
        job->cache.units[i].rb = NULL;
        job->cache.units[i].req_x = NULL;
    }
    sd_bulk_pool_fini(&job->xfer.bulks);
    sd_push_net_teardown(job); /* the rounds' buffer goes with the job's other big buffers */
    free(job->xfer.members);
    free(job->xfer.req_queue);
    free(job->xfer.mr_handles);
    free(job->xfer.mr_descs);
    free(job->xfer.mr_base);
    free(job->xfer.mr_len);
    job->xfer.members = NULL;
    job->xfer.req_queue = NULL;
    job->xfer.mr_handles = job->xfer.mr_descs = NULL;
    job->xfer.mr_base = NULL;
    job->xfer.mr_len = NULL;
}

bool sd_job_net_idle(const struct sd_job *job)
{
    if (sd_ckpt_busy(job)) /* a checkpoint's worker reads or writes its memory */
        return false;
    return job->xfer.net == NULL ||
           (job->xfer.bulks.in_use == 0 && job->xfer.w_sends_inflight == 0 &&
            job->xfer.gathers_inflight == 0);
}

void sd_job_net_cancel(struct sd_job *job)
{
    if (job->xfer.net == NULL || job->xfer.bulks.all == NULL)
        return;
    struct sd_transport *tp = sd_job_tp(job);
    /* receives, and sends that wait for a clear-to-send (rendezvous_bytes) */
    for (uint32_t i = 0; i < job->xfer.bulks.n; i++) {
        struct sd_bulk *b = &job->xfer.bulks.all[i];
        if (!b->active)
            continue;
        for (uint32_t c = 0; c < b->n; c++)
            tp->ops->cancel(tp, &b->xs[c].x);
    }
}

/* ---- failure messages */

static size_t list_pending_peers(const struct sd_job *job, bool (*want)(const struct sd_bulk *),
                                 char *out, size_t len)
{
    size_t off = 0;
    uint64_t seen[SD_MAX_NODES / 64] = {0};
    out[0] = '\0';
    for (uint32_t i = 0; job->xfer.bulks.all && i < job->xfer.bulks.n && off < len; i++) {
        const struct sd_bulk *b = &job->xfer.bulks.all[i];
        if (!b->active || (want && !want(b)) || (seen[b->peer / 64] & (1ULL << (b->peer % 64))))
            continue;
        seen[b->peer / 64] |= 1ULL << (b->peer % 64);
        off += (size_t)snprintf(out + off, len - off, "%s%u", off ? ", " : "", b->peer);
    }
    return off;
}

void sd_job_net_pending_peers(const struct sd_job *job, char *out, size_t len)
{
    list_pending_peers(job, NULL, out, len);
}

static bool is_recv(const struct sd_bulk *b)
{
    return !b->is_send;
}

void sd_job_net_describe(const struct sd_job *job, char *out, size_t len)
{
    char peers[128];
    uint32_t unit;
    uint64_t seq, start;
    if (list_pending_peers(job, is_recv, peers, sizeof(peers)) == 0)
        list_pending_peers(job, NULL, peers, sizeof(peers));
    if (peers[0] == '\0')
        snprintf(peers, sizeof(peers), "none");
    const char *phase;
    if (sd_step_activity(job, &phase, &unit, &start)) {
        snprintf(
            out, len, "step %llu (%s, unit %u; last completed step %llu) waiting for node(s) %s",
            (unsigned long long)job->steps + 1, phase, unit, (unsigned long long)job->steps, peers);
    } else if (sd_push_oldest(job, &unit, &seq, &start)) {
        snprintf(out, len,
                 "push of unit %u (micro-step %llu; last completed %llu) waiting for node(s) %s",
                 unit, (unsigned long long)seq + 1, (unsigned long long)seq, peers);
    } else if (job->xfer.gathers_inflight > 0) {
        uint32_t u = 0;
        for (uint32_t i = 0; i < job->n_slots; i++)
            if (job->cache.units[i].inflight) {
                u = job->cache.units[i].unit;
                break;
            }
        snprintf(out, len,
                 "fetch of unit %u (weights generation %llu; last completed step %llu) waiting "
                 "for node(s) %s",
                 u, (unsigned long long)job->weights_gen, (unsigned long long)job->steps, peers);
    } else if (job->state == SD_JOB_LOADING) {
        snprintf(out, len, "loading the initial values (unit %u of %u)", sd_loading_next_unit(job),
                 job->layout.n_units);
    } else {
        snprintf(out, len, "no operation in flight (last completed step %llu)",
                 (unsigned long long)job->steps);
    }
}

/* ---- deadlines */

void sd_job_net_sweep(struct sd_job *job, uint64_t now)
{
    uint64_t timeout = (uint64_t)job->reg->cfg->op_timeout_ms * 1000000ULL;
    uint64_t started = 0, seq, since;
    uint32_t unit;
    const char *phase;
    if (sd_step_activity(job, &phase, &unit, &since) || sd_push_oldest(job, &unit, &seq, &since))
        started = since;
    else if (job->xfer.gathers_inflight > 0)
        for (uint32_t i = 0; i < job->n_slots; i++)
            if (job->cache.units[i].inflight &&
                (started == 0 || job->cache.units[i].start_ns < started))
                started = job->cache.units[i].start_ns;
    if (started == 0 || now - started <= timeout)
        return;
    char what[256];
    sd_job_net_describe(job, what, sizeof(what));
    sd_job_fail(job, SD_ETIMEDOUT, "%s for %lld ms (op_timeout_ms)", what,
                (long long)job->reg->cfg->op_timeout_ms);
}

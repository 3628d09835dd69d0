/* The parts of a job that cross nodes (MiCS, DESIGN.md section 3), over the collective engine.
 *
 * Fetch: when the partition group of state w spans G nodes, a node pulls each remote node's block
 * of the unit (the shards of that node's k ranks, contiguous in the unit) once and places it in
 * the slot its local ranks share (hierarchical: (p - k) / p * S bytes per node). Without the
 * hierarchy every local rank pulls for itself into its own slot. A node answers pull requests
 * from its w arenas once it reached the requested weights generation.
 *
 * Push: all local ranks' gradients are summed in rank order into a node partial, then
 * reduce-scattered among the group's nodes (each node receives the partials of its block and sums
 * them in node order, chunk by chunk as they arrive). Without the 2-hop sync the result is then
 * all-reduced across the replication group every micro-step.
 *
 * Step: with the 2-hop sync, the g shards are all-reduced across the replication group once per
 * step; then the global squared norm is exchanged (summed in node order), the optimizer runs on
 * each node's shards, and units held across the step are gathered again. */
#include "cluster.h"
#include "daemon.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GATHERS_INFLIGHT 8

static inline struct sd_transport *tp_of(const struct sd_job *job)
{
    return job->net->tp;
}

static inline uint32_t self_node(const struct sd_job *job)
{
    return job->node;
}

static void *desc_of(const struct sd_job *job, const void *p)
{
    for (uint32_t i = 0; i < job->n_mrs; i++)
        if ((const char *)p >= (const char *)job->mr_base[i] &&
            (const char *)p < (const char *)job->mr_base[i] + job->mr_len[i])
            return job->mr_descs[i];
    return NULL;
}

/* nodes of the replication group of this node's shards, ascending */
static uint32_t replication_nodes(const struct sd_job *job, uint32_t *out)
{
    uint32_t n = 0, G = job->group_nodes;
    for (uint32_t m = 0; m < job->nodes; m++)
        if (G == 1 || m % G == self_node(job) % G)
            out[n++] = m;
    return n;
}

static uint32_t group_first(const struct sd_job *job)
{
    return self_node(job) - self_node(job) % job->group_nodes;
}

/* An all-reduce of count floats of buf across the replication group (job->members, R of them)
 * with tmp of ar_tmp_count floats; acc as sd_allreduce_param's. The tag's seq names the round
 * (a micro-step) or the step. */
static int job_allreduce(struct sd_job *job, struct sd_allreduce *ar, uint32_t R, uint32_t unit,
                         uint64_t round, bool step_sync, float *buf, size_t count, float *tmp,
                         float *acc, sd_allreduce_cb cb, void *arg)
{
    struct sd_allreduce_param p = {.group = {.tp = tp_of(job),
                                             .pool = &job->bulks,
                                             .members = job->members,
                                             .n_members = R,
                                             .self = self_node(job)},
                                   .dev = job->reg->dev,
                                   .dtype = SD_DTYPE_FP32,
                                   .codec = SD_CODEC_IDENTITY,
                                   .buf = buf,
                                   .count = count,
                                   .tmp = tmp,
                                   .tmp_count = job->ar_tmp_count,
                                   .acc = acc,
                                   .buf_desc = desc_of(job, buf),
                                   .tmp_desc = desc_of(job, tmp),
                                   .acc_desc = desc_of(job, acc),
                                   .chunk_bytes = job->reg->cfg->chunk_bytes,
                                   .small_bytes = job->reg->cfg->small_allreduce_bytes,
                                   .cb = cb,
                                   .arg = arg};
    int st = sd_tag_make(SD_TAG_AR, job->tag, unit, sd_tag_allreduce_seq(round, step_sync), 0,
                         &p.tag_base);
    return st == SD_OK ? sd_allreduce_start(ar, &p) : st;
}

/* An exchange of kind with node peer: this node receives the message peer sends (src peer) and
 * sends its own (src self). Fails like a post that failed when a tag field does not fit. */
static uint32_t job_exchange(struct sd_job *job, struct sd_exchange_param *x, uint32_t kind,
                             uint32_t unit, uint32_t seq, int *status_p, uint32_t *suspect_p)
{
    x->pool = &job->bulks;
    x->tp = tp_of(job);
    x->recv.desc = desc_of(job, x->recv.buf);
    x->send.desc = desc_of(job, x->send.buf);
    int st = sd_tag_make(kind, job->tag, unit, seq, x->peer, &x->recv.tag);
    if (st == SD_OK)
        st = sd_tag_make(kind, job->tag, unit, seq, self_node(job), &x->send.tag);
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
    uint32_t G = job->group_nodes, N = job->nodes;
    uint32_t gathers = MAX_GATHERS_INFLIGHT * (G - 1);
    uint32_t serve = MAX_GATHERS_INFLIGHT * (N - 1) * job->slots_per_unit;
    uint32_t round = job->round_gens * (2 * (G - 1) + 2 * (N - 1));
    uint32_t step = 2 * (N - 1) + 2;
    uint32_t init = N;
    return gathers + serve + round + step + init + 4;
}

static size_t ar_tmp_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    uint32_t R = job->group_nodes > 1 ? job->nodes / job->group_nodes : job->nodes;
    uint64_t maxn = job->layout.max_unit_numel;
    uint64_t block = job->group_nodes > 1 ? maxn / job->group_nodes : maxn;
    /* the largest all-reduce is one block */
    size_t need = sd_allreduce_tmp_floats(block, R, cfg->small_allreduce_bytes);
    /* smaller units may take the direct path with (R - 1) * count floats */
    size_t small = cfg->small_allreduce_bytes / sizeof(float);
    return SD_MAX(need, (size_t)(R > 1 ? R - 1 : 0) * SD_MIN(small, block)) + 16;
}

/* Does each round's all-reduce add its sum into the g shard itself (sd_allreduce's acc)? With
 * one rank per node the node's block of a unit is that rank's g shard, which every node of the
 * replication group keeps identical without 2-hop (the same sums added in the same order from
 * zero). Two rounds of one unit must not run at once then: the later one's all-gather could
 * land before the earlier one's. */
static bool rounds_accumulate(const struct sd_job *job)
{
    return job->k == 1 && !job->plan.two_hop && job->nodes / job->group_nodes > 1 &&
           job->plan.f[SD_STATE_G] == job->group_nodes;
}

/* Does a node round sum its partial into a buffer of its own? Not when one rank's fp32
 * gradient is the partial. */
static bool rounds_need_buf(const struct sd_job *job)
{
    if (job->k > 1)
        return true;
    for (uint32_t u = 0; u < job->layout.n_units; u++)
        if (job->layout.units[u].dtype != SD_DTYPE_FP32)
            return true;
    return false;
}

/* floats of one node round's buffers: partial, the G - 1 received blocks, the summed block and
 * the all-reduce's temporary */
static size_t round_floats(const struct sd_job *job, const struct sd_config *cfg)
{
    uint64_t maxn = job->layout.max_unit_numel;
    uint32_t G = job->group_nodes;
    uint64_t block = G > 1 ? maxn / G : 0;
    return (rounds_need_buf(job) ? maxn : 0) + (G > 1 ? (uint64_t)G * block : 0) +
           ar_tmp_floats(job, cfg) + 4 * 16; /* + 16 floats of slack after each buffer */
}

uint64_t sd_job_net_bytes(const struct sd_job *job, const struct sd_config *cfg)
{
    if (job->nodes <= 1)
        return 0;
    uint32_t G = job->group_nodes;
    uint64_t b = (uint64_t)job->round_gens * round_floats(job, cfg) * sizeof(float);
    b += (uint64_t)bulks_needed(job) * sizeof(struct sd_bulk);
    b += (uint64_t)job->n_slots * (G ? G - 1 : 0) * (sizeof(struct sd_xfer) + sizeof(void *));
    return b;
}

static int reg_mr(struct sd_job *job, const void *p, size_t len)
{
    if (p == NULL || len == 0)
        return SD_OK;
    uint32_t i = job->n_mrs;
    int st =
        tp_of(job)->ops->mr_reg(tp_of(job), (void *)p, len, &job->mr_descs[i], &job->mr_handles[i]);
    if (st == SD_OK) {
        job->mr_base[i] = p;
        job->mr_len[i] = len;
        job->n_mrs++;
    }
    return st;
}

int sd_job_net_setup(struct sd_job *job, char *err, size_t errlen)
{
    const struct sd_config *cfg = job->reg->cfg;
    uint32_t G = job->group_nodes, N = job->nodes;
    uint64_t maxn = job->layout.max_unit_numel;
    uint64_t block = G > 1 ? maxn / G : 0;
    job->net = job->reg->net;
    if (job->net == NULL) {
        snprintf(err, errlen, "this daemon has no cluster (nodes = 1)");
        return SD_ENOSYS;
    }
    if (job->k > 64 || G - 1 > 64 || job->k > SD_BULK_MAX_PIECES) {
        snprintf(err, errlen, "at most 64 ranks per node across nodes (have %u)", job->k);
        return SD_ENOSYS;
    }
    int st = sd_bulk_pool_init(&job->bulks, bulks_needed(job));
    if (st != SD_OK)
        goto err_nomem;
    job->ar_tmp_count = ar_tmp_floats(job, cfg);
    size_t per_round = round_floats(job, cfg);
    job->nr = calloc(job->round_gens, sizeof(*job->nr));
    job->nr_mem = calloc((size_t)job->round_gens * per_round, sizeof(float));
    if (!job->nr || !job->nr_mem)
        goto err_nomem;
    bool need_buf = rounds_need_buf(job);
    for (uint32_t i = 0; i < job->round_gens; i++) {
        struct sd_node_round *rd = &job->nr[i];
        float *p = job->nr_mem + (size_t)i * per_round;
        rd->job = job;
        if (need_buf) {
            rd->buf = p;
            p += maxn + 16;
        }
        if (G > 1) {
            rd->rs_recv = p;
            p += (size_t)(G - 1) * block + 16;
            rd->rs_out = p;
            p += block + 16;
        }
        rd->ar_tmp = p;
    }
    if (G > 1) {
        for (uint32_t i = 0; i < job->n_slots; i++) {
            job->units[i].rb = calloc(G, sizeof(*job->units[i].rb));
            job->units[i].req_x = calloc(G, sizeof(*job->units[i].req_x));
            if (!job->units[i].rb || !job->units[i].req_x)
                goto err_nomem;
        }
    }
    job->members = calloc(N, sizeof(*job->members));
    job->norm_parts = calloc(N, sizeof(*job->norm_parts));
    job->norm_b = calloc(2 * N, sizeof(*job->norm_b));
    job->rq_cap = job->layout.n_units * job->round_gens;
    job->round_queue = calloc(job->rq_cap, sizeof(*job->round_queue));
    job->req_cap = N * job->n_slots + 16;
    job->req_queue = calloc(job->req_cap, sizeof(*job->req_queue));
    job->wait_tags = calloc((size_t)job->n_slots * job->k, sizeof(*job->wait_tags));
    uint32_t max_mrs = 2 * job->k + 6;
    job->mr_handles = calloc(max_mrs, sizeof(void *));
    job->mr_descs = calloc(max_mrs, sizeof(void *));
    job->mr_base = calloc(max_mrs, sizeof(void *));
    job->mr_len = calloc(max_mrs, sizeof(size_t));
    if (!job->members || !job->norm_parts || !job->norm_b || !job->round_queue || !job->req_queue ||
        !job->wait_tags || !job->mr_handles || !job->mr_descs || !job->mr_base || !job->mr_len)
        goto err_nomem;
    /* memory registered once per job */
    st = reg_mr(job, job->pool.ptr, job->pool.bytes);
    for (uint32_t r = 0; st == SD_OK && r < job->k; r++) {
        st = reg_mr(job, sd_job_arena(job, r, SD_STATE_W)->ptr,
                    sd_job_arena(job, r, SD_STATE_W)->bytes);
        if (st == SD_OK)
            st = reg_mr(job, job->staging[r].ptr, job->staging[r].bytes);
    }
    if (st == SD_OK)
        st = reg_mr(job, job->scratch, maxn * sizeof(float));
    if (st == SD_OK)
        st = reg_mr(job, job->nr_mem, (size_t)job->round_gens * per_round * sizeof(float));
    if (st == SD_OK)
        st = reg_mr(job, job->norm_parts, N * sizeof(*job->norm_parts));
    if (st == SD_OK) /* the pull requests each gather sends live in its unit state */
        st = reg_mr(job, job->units, job->n_slots * sizeof(*job->units));
    const struct sd_mem *g_arena = sd_job_arena(job, 0, SD_STATE_G);
    if (st == SD_OK && rounds_accumulate(job)) /* the all-gathers of the rounds land there */
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
    for (uint32_t i = 0; job->net && i < job->n_mrs; i++)
        tp_of(job)->ops->mr_dereg(tp_of(job), job->mr_handles[i]);
    job->n_mrs = 0;
    for (uint32_t i = 0; job->units != NULL && i < job->n_slots; i++) {
        free(job->units[i].rb);
        free(job->units[i].req_x);
        job->units[i].rb = NULL;
        job->units[i].req_x = NULL;
    }
    sd_bulk_pool_fini(&job->bulks);
    free(job->nr); /* nr_mem goes with the job's other big buffers (job_free_memory) */
    free(job->members);
    free(job->norm_parts);
    free(job->norm_b);
    free(job->round_queue);
    free(job->req_queue);
    free(job->wait_tags);
    free(job->mr_handles);
    free(job->mr_descs);
    free(job->mr_base);
    free(job->mr_len);
    job->nr = NULL;
    job->members = NULL;
    job->norm_parts = NULL;
    job->norm_b = NULL;
    job->round_queue = NULL;
    job->req_queue = NULL;
    job->wait_tags = NULL;
    job->mr_handles = job->mr_descs = NULL;
    job->mr_base = NULL;
    job->mr_len = NULL;
}

bool sd_job_net_idle(const struct sd_job *job)
{
    return job->net == NULL ||
           (job->bulks.in_use == 0 && job->w_sends_inflight == 0 && job->gathers_inflight == 0);
}

void sd_job_net_cancel(struct sd_job *job)
{
    if (job->net == NULL || job->bulks.all == NULL)
        return;
    struct sd_transport *tp = tp_of(job);
    /* receives, and sends that wait for a clear-to-send (rendezvous_bytes) */
    for (uint32_t i = 0; i < job->bulks.n; i++) {
        struct sd_bulk *b = &job->bulks.all[i];
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
    for (uint32_t i = 0; job->bulks.all && i < job->bulks.n && off < len; i++) {
        const struct sd_bulk *b = &job->bulks.all[i];
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
    if (list_pending_peers(job, is_recv, peers, sizeof(peers)) == 0)
        list_pending_peers(job, NULL, peers, sizeof(peers));
    if (peers[0] == '\0')
        snprintf(peers, sizeof(peers), "none");
    if (job->step_phase != SD_STEP_IDLE) {
        static const char *const phase[] = {"idle", "gradient all-reduce", "norm exchange",
                                            "optimizer", "refresh of held units"};
        snprintf(out, len,
                 "step %llu (%s, unit %u; last completed step %llu) waiting for node(s) %s",
                 (unsigned long long)job->steps + 1, phase[job->step_phase], job->step_unit,
                 (unsigned long long)job->steps, peers);
    } else if (job->nr_len > 0) {
        const struct sd_node_round *rd = &job->nr[job->nr_head];
        snprintf(out, len,
                 "push of unit %u (micro-step %llu; last completed %llu) waiting for node(s) %s",
                 rd->unit, (unsigned long long)rd->seq + 1, (unsigned long long)rd->seq, peers);
    } else if (job->gathers_inflight > 0) {
        uint32_t u = 0;
        for (uint32_t i = 0; i < job->n_slots; i++)
            if (job->units[i].inflight) {
                u = job->units[i].unit;
                break;
            }
        snprintf(out, len,
                 "fetch of unit %u (weights generation %llu; last completed step %llu) waiting "
                 "for node(s) %s",
                 u, (unsigned long long)job->weights_gen, (unsigned long long)job->steps, peers);
    } else if (job->state == SD_JOB_LOADING) {
        snprintf(out, len, "loading the initial values (unit %u of %u)", job->init_next_unit,
                 job->layout.n_units);
    } else {
        snprintf(out, len, "no operation in flight (last completed step %llu)",
                 (unsigned long long)job->steps);
    }
}

/* ---- serving pull requests */

static void serve_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    job->stats.bytes[SD_OP_FETCH][SD_LINK_INTER_SENT] += b->bytes;
    job->w_sends_inflight--;
    sd_bulk_put(&job->bulks, b);
    if (status != SD_OK)
        SD_WARN_SPARSE("net", "job '%s': sending weights to node %u failed: %s", job->name, b->peer,
                       sd_status_str(status));
    if (job->step_phase == SD_STEP_APPLY)
        sd_job_net_step(job);
}

/* Returns false if the request must wait. */
static bool serve(struct sd_job *job, const struct sd_req_msg *m)
{
    if (job->state != SD_JOB_READY && job->state != SD_JOB_CLOSING)
        return job->state != SD_JOB_LOADING; /* failed jobs: drop the request */
    if (m->gen > job->weights_gen)
        return false;
    if (m->gen < job->weights_gen) {
        SD_WARN_SPARSE("net",
                       "job '%s': node %u asks for weights generation %llu of unit %u, "
                       "this node is at %llu",
                       job->name, m->src, (unsigned long long)m->gen, m->unit,
                       (unsigned long long)job->weights_gen);
        return true;
    }
    struct sd_bulk *b = sd_bulk_get(&job->bulks);
    if (b == NULL)
        return false;
    /* this node's block of each unit asked for: its ranks' shards, unit by unit */
    uint32_t n_units = m->n_units ? m->n_units : 1;
    void *pieces[SD_BULK_MAX_PIECES];
    size_t lens[SD_BULK_MAX_PIECES];
    for (uint32_t i = 0, p = 0; i < n_units; i++) {
        for (uint32_t j = 0; j < job->k; j++, p++) {
            pieces[p] = sd_job_w_shard(job, j, m->unit + i);
            lens[p] = sd_job_w_shard_bytes(job, m->unit + i);
        }
    }
    uint32_t seq = 0;
    uint64_t tag = 0;
    int st = sd_tag_weights_seq(m->gen, m->lslot, &seq);
    if (st == SD_OK)
        st = sd_tag_make(SD_TAG_WDATA, job->tag, m->unit, seq, self_node(job), &tag);
    if (st == SD_OK)
        st = sd_bulk_startv(b, tp_of(job), true, m->src, tag, pieces, lens, n_units * job->k,
                            job->reg->cfg->chunk_bytes, desc_of(job, pieces[0]), serve_done, NULL,
                            job);
    if (st != SD_OK) {
        sd_bulk_put(&job->bulks, b);
        SD_WARN("net", "job '%s': cannot send unit %u to node %u: %s", job->name, m->unit, m->src,
                sd_status_str(st));
        return true;
    }
    job->w_sends_inflight++;
    return true;
}

static void serve_queue(struct sd_job *job)
{
    uint32_t kept = 0;
    for (uint32_t i = 0; i < job->req_queued; i++)
        if (!serve(job, &job->req_queue[i]))
            job->req_queue[kept++] = job->req_queue[i];
    job->req_queued = kept;
}

static void on_request(struct sd_registry *reg, const struct sd_req_msg *m)
{
    if (m->magic != SD_REQ_MAGIC) {
        SD_WARN_SPARSE("net", "dropping a malformed pull request");
        return;
    }
    struct sd_job *job = sd_registry_find_tag(reg, m->job_tag);
    if (job == NULL) { /* maybe confirmed here a moment from now */
        struct sd_net *net = reg->net;
        uint64_t now = sd_now_ns(), keep = (uint64_t)reg->cfg->op_timeout_ms * 1000000ULL;
        uint32_t kept = 0;
        for (uint32_t i = 0; i < net->n_early; i++)
            if (now - net->early_ns[i] < keep) {
                net->early[kept] = net->early[i];
                net->early_ns[kept++] = net->early_ns[i];
            }
        net->n_early = kept;
        if (kept < SD_NET_EARLY_REQS) {
            net->early[kept] = *m;
            net->early_ns[kept] = now;
            net->n_early++;
            return;
        }
        SD_WARN_SPARSE("net", "too many pull requests for unknown jobs; dropping one for tag %u",
                       m->job_tag);
        return;
    }
    uint32_t n_units = m->n_units ? m->n_units : 1;
    if (job == NULL || job->units == NULL || m->unit >= job->layout.n_units ||
        n_units > job->layout.n_units - m->unit || n_units * job->k > SD_BULK_MAX_PIECES ||
        m->lslot >= job->slots_per_unit || m->src >= job->nodes || m->src == self_node(job)) {
        SD_WARN_SPARSE("net",
                       "dropping a pull request for job tag %u units %u..%u from node %u: no such "
                       "job, units or node here",
                       m->job_tag, m->unit, m->unit + n_units - 1, m->src);
        return;
    }
    if (serve(job, m))
        return;
    if (job->req_queued < job->req_cap)
        job->req_queue[job->req_queued++] = *m;
    else
        SD_WARN_SPARSE("net", "job '%s': pull request queue full", job->name);
}

void sd_net_job_confirmed(struct sd_registry *reg, struct sd_job *job)
{
    struct sd_net *net = reg->net;
    if (net == NULL)
        return;
    uint32_t kept = 0, n = net->n_early;
    struct sd_req_msg mine[SD_NET_EARLY_REQS];
    uint32_t n_mine = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (net->early[i].job_tag == job->tag) {
            mine[n_mine++] = net->early[i];
            continue;
        }
        net->early[kept] = net->early[i];
        net->early_ns[kept++] = net->early_ns[i];
    }
    net->n_early = kept;
    for (uint32_t i = 0; i < n_mine; i++)
        on_request(reg, &mine[i]);
}

bool sd_net_busy(const struct sd_registry *reg)
{
    return reg->net != NULL && reg->net->tp->inflight > (reg->net->posted ? SD_NET_REQ_SLOTS : 0);
}

static void req_recv_cb(struct sd_xfer *x, int status);

static int post_req_recv(struct sd_net_req *r, struct sd_net *net)
{
    struct sd_transport *tp = net->tp;
    r->x.cb = req_recv_cb;
    return tp->ops->recv(tp, SD_PEER_ANY, sd_tag_of_kind(SD_TAG_REQ), sd_tag_any_but_kind(),
                         &r->msg, sizeof(r->msg), net->reqs_desc, &r->x);
}

static void req_recv_cb(struct sd_xfer *x, int status)
{
    struct sd_net_req *r = (struct sd_net_req *)x;
    struct sd_registry *reg = r->reg;
    if (status != SD_OK || reg->net == NULL)
        return; /* cancelled at shutdown */
    if (x->len == sizeof(r->msg))
        on_request(reg, &r->msg);
    post_req_recv(r, reg->net);
}

int sd_net_start(struct sd_registry *reg, struct sd_transport *tp, struct sd_cluster *cl)
{
    struct sd_net *net = calloc(1, sizeof(*net));
    if (net == NULL)
        return SD_ENOMEM;
    net->tp = tp;
    net->cl = cl;
    net->self = (uint32_t)reg->cfg->node;
    net->n = (uint32_t)reg->cfg->nodes;
    reg->net = net;
    return SD_OK;
}

/* Standing receives for pull requests, once the peers are known. */
int sd_net_post_requests(struct sd_registry *reg)
{
    if (reg->net == NULL || reg->net->posted)
        return SD_OK;
    struct sd_net *net = reg->net;
    net->posted = true;
    int st =
        net->tp->ops->mr_reg(net->tp, net->reqs, sizeof(net->reqs), &net->reqs_desc, &net->reqs_mr);
    if (st != SD_OK)
        return st;
    for (uint32_t i = 0; i < SD_NET_REQ_SLOTS; i++) {
        net->reqs[i].reg = reg;
        st = post_req_recv(&net->reqs[i], net);
        if (st != SD_OK)
            return st;
    }
    return SD_OK;
}

/* After the transport was quiesced and every job freed. */
void sd_net_stop(struct sd_registry *reg)
{
    if (reg->net != NULL && reg->net->reqs_mr != NULL)
        reg->net->tp->ops->mr_dereg(reg->net->tp, reg->net->reqs_mr);
    free(reg->net);
    reg->net = NULL;
}

/* ---- fetch across nodes */

/* a gather (maybe coalesced: us leads the units linked by batch_next) completed or failed */
static void gather_finish(struct sd_job *job, struct sd_unit_state *us)
{
    int status = us->status;
    uint32_t suspect = us->suspect;
    job->gathers_inflight--;
    if (status != SD_OK) {
        char what[256];
        snprintf(what, sizeof(what),
                 "fetch of unit %u (weights generation %llu): the transfer "
                 "from node %u failed: %s",
                 us->unit, (unsigned long long)us->gen, suspect, sd_status_str(status));
        for (struct sd_unit_state *u = us, *next; u; u = next) {
            next = u->batch_next;
            u->batch_next = NULL;
            u->inflight = false;
            u->resident = false;
            sd_slot_pool_free(&job->spool, u->pool_off);
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
        sd_job_complete_fetch(job, u);
    }
    if (job->step_phase != SD_STEP_IDLE) /* a refresh, or a step waiting for gathers */
        sd_job_net_step(job);
    else
        sd_sched_prefetch(job); /* transfer resources are free again */
}

static void gather_recv_done(struct sd_bulk *b, int status)
{
    struct sd_unit_state *us = b->arg;
    struct sd_job *job = us->job;
    job->stats.bytes[SD_OP_FETCH][SD_LINK_INTER_RECV] += b->bytes;
    if (status != SD_OK && us->status == SD_OK) {
        us->status = status;
        us->suspect = b->peer;
    }
    sd_bulk_put(&job->bulks, b);
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
    return job->bulks.n - job->bulks.in_use >= job->group_nodes - 1 &&
           job->gathers_inflight < MAX_GATHERS_INFLIGHT;
}

/* slot us (pool space reserved) is in flight; gather_post fills in this node's block */
static void gather_begin(struct sd_job *job, struct sd_unit_state *us)
{
    us->inflight = true;
    us->status = SD_OK;
    us->gen = job->weights_gen;
    us->start_ns = sd_now_ns();
    us->batch_next = NULL;
}

/* this node's block of units[0..n), its ranks' shards, into their slots */
static void gather_copy_local(struct sd_job *job, struct sd_unit_state *const *units, uint32_t n)
{
    uint32_t G = job->group_nodes, k = job->k, me = self_node(job) % G;
    for (uint32_t i = 0; i < n; i++) {
        size_t len = sd_job_w_shard_bytes(job, units[i]->unit);
        uint8_t *slot = (uint8_t *)job->pool.ptr + units[i]->pool_off;
        for (uint32_t j = 0; j < k; j++)
            job->reg->dev->copy(slot + ((size_t)me * k + j) * len,
                                sd_job_w_shard(job, j, units[i]->unit), len);
        job->stats.bytes[SD_OP_FETCH][SD_LINK_INTRA] += (uint64_t)k * len;
    }
}

/* Pull the remote blocks of units[0..n) (begun, consecutive ids ascending, one copy) from every
 * node of the partition group: one request and one transfer per peer for all of them, then copy
 * this node's block while the peers answer. units[0] leads: it holds the transfers, and its
 * completion completes the others. */
static void gather_post(struct sd_job *job, struct sd_unit_state *const *units, uint32_t n)
{
    uint64_t cpu0 = sd_job_issue_clock(job);
    struct sd_unit_state *us = units[0];
    uint32_t G = job->group_nodes, k = job->k;
    uint32_t first = group_first(job);
    for (uint32_t j = 1; j < n; j++)
        units[j - 1]->batch_next = units[j];
    us->remaining = 2 * (G - 1);
    us->req = (struct sd_req_msg){.magic = SD_REQ_MAGIC,
                                  .job_tag = (uint16_t)job->tag,
                                  .src = (uint16_t)self_node(job),
                                  .unit = us->unit,
                                  .lslot = us->lslot,
                                  .gen = us->gen,
                                  .n_units = n};
    job->gathers_inflight++;
    uint32_t seq = 0;
    int tag_st = sd_tag_weights_seq(us->gen, us->lslot, &seq);
    for (uint32_t i = 0, o = 0; i < G; i++) {
        uint32_t m = first + i;
        if (m == self_node(job))
            continue;
        void *pieces[SD_BULK_MAX_PIECES];
        size_t lens[SD_BULK_MAX_PIECES];
        for (uint32_t j = 0, p = 0; j < n; j++) {
            size_t len = sd_job_w_shard_bytes(job, units[j]->unit);
            uint8_t *slot = (uint8_t *)job->pool.ptr + units[j]->pool_off;
            for (uint32_t q = 0; q < k; q++, p++) {
                pieces[p] = slot + ((size_t)i * k + q) * len;
                lens[p] = len;
            }
        }
        uint64_t data_tag = 0, req_tag = 0;
        int st = tag_st;
        if (st == SD_OK)
            st = sd_tag_make(SD_TAG_WDATA, job->tag, us->unit, seq, m, &data_tag);
        if (st == SD_OK)
            st = sd_tag_make(SD_TAG_REQ, job->tag, us->unit, seq, self_node(job), &req_tag);
        int req_st = st;
        struct sd_bulk *b = sd_bulk_get(&job->bulks);
        us->rb[o] = b;
        if (st == SD_OK)
            st = sd_bulk_startv(b, tp_of(job), false, m, data_tag, pieces, lens, n * k,
                                job->reg->cfg->chunk_bytes, desc_of(job, job->pool.ptr),
                                gather_recv_done, NULL, us);
        if (st != SD_OK) {
            sd_bulk_put(&job->bulks, b);
            us->status = st;
            us->suspect = m;
            us->remaining--;
        }
        struct sd_xfer *x = &us->req_x[o];
        x->cb = gather_req_sent;
        x->arg = us;
        st = req_st != SD_OK ? req_st
                             : tp_of(job)->ops->send(tp_of(job), m, req_tag, &us->req,
                                                     sizeof(us->req), desc_of(job, &us->req), x);
        if (st != SD_OK) {
            us->status = st;
            us->suspect = m;
            us->remaining--;
        }
        o++;
    }
    /* no completion runs before the loop polls again, so the slots are still ours */
    gather_copy_local(job, units, n);
    sd_job_issue_count(job, cpu0);
    if (us->remaining == 0)
        gather_finish(job, us);
}

/* Start pulling the remote blocks of slot us (pool space reserved). */
static int gather_start(struct sd_job *job, struct sd_unit_state *us)
{
    if (!gather_resources(job))
        return SD_EAGAIN;
    gather_begin(job, us);
    gather_post(job, &us, 1);
    return SD_OK;
}

bool sd_job_net_would_join(const struct sd_job *job, uint32_t unit, uint32_t lslot)
{
    const struct sd_gather_batch *bt = &job->batch;
    uint64_t bytes = sd_unit_bytes(&job->layout.units[unit]);
    uint64_t limit = (uint64_t)job->reg->cfg->coalesce_bytes;
    return bytes < limit && bt->n > 0 && bt->lslot == lslot && bt->bytes + bytes <= limit &&
           (bt->n + 1) * job->k <= SD_BULK_MAX_PIECES && (unit == bt->hi + 1 || unit + 1 == bt->lo);
}

/* A gather the frozen schedule issues: small units join the open batch while their ids stay
 * consecutive and the batch under coalesce_bytes; sd_job_net_prefetch_flush sends it. */
int sd_job_net_prefetch(struct sd_job *job, struct sd_unit_state *us)
{
    struct sd_gather_batch *bt = &job->batch;
    uint64_t bytes = sd_unit_bytes(&job->layout.units[us->unit]);
    uint64_t limit = (uint64_t)job->reg->cfg->coalesce_bytes;
    bool small = bytes < limit && job->k <= SD_BULK_MAX_PIECES / 2;
    bool joins = sd_job_net_would_join(job, us->unit, us->lslot);
    if (!joins)
        sd_job_net_prefetch_flush(job);
    if (!small)
        return gather_start(job, us);
    if (bt->n == 0) {
        if (!gather_resources(job))
            return SD_EAGAIN; /* the batch, once open, needs nothing more */
        bt->lo = bt->hi = us->unit;
        bt->lslot = us->lslot;
        bt->bytes = 0;
    }
    gather_begin(job, us);
    bt->lo = SD_MIN(bt->lo, us->unit);
    bt->hi = SD_MAX(bt->hi, us->unit);
    bt->bytes += bytes;
    bt->units[bt->n++] = us;
    return SD_OK;
}

void sd_job_net_prefetch_flush(struct sd_job *job)
{
    struct sd_gather_batch *bt = &job->batch;
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

bool sd_job_net_fetch(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      struct sd_unit_state *us)
{
    uint64_t bit = 1ULL << s->local;
    if (us->inflight) {
        if (us->waiters & bit)
            return false; /* the same rank twice: wait for the first */
        us->waiters |= bit;
        job->wait_tags[(size_t)(us - job->units) * job->k + s->local] = e->tag;
        return true;
    }
    if (us->resident && us->gen != job->weights_gen && us->refs == 0) {
        sd_slot_pool_free(&job->spool, us->pool_off);
        us->resident = false;
    }
    us->waiters |= bit;
    job->wait_tags[(size_t)(us - job->units) * job->k + s->local] = e->tag;
    if (us->resident) {
        job->stats.cache_hits++;
        us->start_ns = sd_now_ns();
        sd_job_complete_fetch(job, us);
        return true;
    }
    const struct sd_unit_layout *ul = &job->layout.units[e->unit];
    uint64_t off;
    if (job->gathers_inflight >= MAX_GATHERS_INFLIGHT ||
        job->bulks.n - job->bulks.in_use < job->group_nodes - 1) {
        us->waiters &= ~bit;
        return false;
    }
    int rst = sd_job_pool_reserve(job, sd_unit_bytes(ul), &off);
    if (rst == SD_EAGAIN || (rst == SD_ENOSPC && sd_job_others_hold(job, s))) {
        /* other ranks (or gathers in flight) still use the space: wait for them */
        us->waiters &= ~bit;
        return false;
    }
    if (rst != SD_OK) {
        us->waiters &= ~bit;
        char b1[32], b2[32];
        sd_session_fail(s, e, SD_ENOSPC,
                        "fetch unit %u needs %s; the gather pool (%s) is held by unreleased or "
                        "in-flight units: release units or raise max_live_bytes",
                        e->unit, sd_fmt_bytes(b1, sizeof(b1), sd_unit_bytes(ul)),
                        sd_fmt_bytes(b2, sizeof(b2), job->spool.capacity));
        return true;
    }
    us->pool_off = off;
    if (gather_start(job, us) != SD_OK) {
        sd_slot_pool_free(&job->spool, off);
        us->waiters &= ~bit;
        return false;
    }
    return true;
}

/* ---- push rounds across nodes */

static void round_start_next(struct sd_job *job);

/* Where local rank j's g shard of a unit sits in this node's reduced block of it (len floats
 * per shard): the block holds the k ranks' shards when the partition group spans nodes, else
 * the f shards of the whole unit, which rank j holds shard j % f of. */
static uint64_t g_block_off(const struct sd_job *job, uint32_t j, uint64_t len)
{
    return job->group_nodes > 1 ? (uint64_t)j * len : (uint64_t)(j % job->plan.f[SD_STATE_G]) * len;
}

/* Apply the oldest node rounds whose transfers are done, in the order they started (the g
 * shards get each unit's micro-steps in order, whichever round finished first), then start
 * the rounds waiting for buffers. */
static void rounds_retire(struct sd_job *job)
{
    while (job->nr_len > 0 && job->state != SD_JOB_FAILED) {
        struct sd_node_round *rd = &job->nr[job->nr_head];
        if (!rd->net_done)
            break;
        if (!rounds_accumulate(job)) { /* else the all-reduce added it */
            const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
            uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
            const float *B = job->group_nodes > 1 ? rd->rs_out : rd->part;
            for (uint32_t j = 0; j < job->k; j++)
                job->reg->dev->reduce_add(sd_job_g_shard(job, j, ul), B + g_block_off(job, j, len),
                                          SD_DTYPE_FP32, len);
        }
        rd->net_done = false;
        job->nr_head = (job->nr_head + 1) % job->round_gens;
        job->nr_len--;
        SD_DEBUG("net", "job '%s': push round of unit %u done in %.1f us", job->name, rd->unit,
                 (double)(sd_now_ns() - rd->start_ns) / 1e3);
        sd_job_finish_round(job, rd->unit, 0);
    }
    if (job->state == SD_JOB_FAILED)
        return;
    round_start_next(job);
    if (job->nr_len == 0 && job->step_phase != SD_STEP_IDLE)
        sd_job_net_step(job);
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
        sd_job_fail(job, SD_EPEER, "%s: transfer with node %u failed: %s", what, rd->suspect,
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
        uint32_t R = replication_nodes(job, job->members);
        const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
        uint64_t count = job->group_nodes > 1 ? ul->numel / job->group_nodes : ul->numel;
        float *B = job->group_nodes > 1 ? rd->rs_out : rd->part;
        if (R > 1) {
            float *acc = rounds_accumulate(job) ? sd_job_g_shard(job, 0, ul) : NULL;
            int st = job_allreduce(job, &rd->ar, R, rd->unit, rd->seq, false, B, count, rd->ar_tmp,
                                   acc, round_ar_done, rd);
            if (st == SD_OK)
                return;
            rd->status = st;
        }
    }
    round_net_done(rd);
}

/* chunk c of the partials of this node's block arrived from some node: once all did, sum it */
static void rs_chunk(struct sd_bulk *b, uint32_t piece, size_t off, size_t len)
{
    struct sd_node_round *rd = b->arg;
    struct sd_job *job = rd->job;
    (void)piece;
    uint32_t c = (uint32_t)(off / rd->chunk);
    uint32_t G = job->group_nodes;
    if (++rd->chunk_arrivals[c] < G - 1)
        return;
    const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
    size_t block = ul->numel / G, e0 = off / sizeof(float), e1 = (off + len) / sizeof(float);
    uint32_t me = self_node(job) % G;
    const float *src[64] = {NULL};
    for (uint32_t i = 0, o = 0; i < G; i++)
        src[i] = i == me ? rd->part + (size_t)me * block : rd->rs_recv + (size_t)(o++) * block;
    /* node order, as the reference would add them: ((s0 + s1) + s2) + ... */
    const struct sd_gpu_ops *dev = job->reg->dev;
    dev->copy(rd->rs_out + e0, src[0] + e0, (e1 - e0) * sizeof(float));
    for (uint32_t i = 1; i < G; i++)
        dev->reduce_add(rd->rs_out + e0, src[i] + e0, SD_DTYPE_FP32, e1 - e0);
}

static void rs_done(struct sd_bulk *b, int status)
{
    struct sd_node_round *rd = b->arg;
    struct sd_job *job = rd->job;
    job->stats.bytes[SD_OP_PUSH][b->is_send ? SD_LINK_INTER_SENT : SD_LINK_INTER_RECV] += b->bytes;
    if (status != SD_OK && rd->status == SD_OK) {
        rd->status = status;
        rd->suspect = b->peer;
    }
    sd_bulk_put(&job->bulks, b);
    if (--rd->pending == 0)
        round_after_rs(rd);
}

/* elements [lo, hi) of the node partial, into rd->buf: the local ranks' gradients summed in
 * rank order */
static void node_partial(struct sd_job *job, struct sd_node_round *rd,
                         const struct sd_push_entry *ent, const struct sd_unit_layout *ul,
                         uint64_t lo, uint64_t hi)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    size_t esz = sd_dtype_size(ul->dtype);
    for (uint32_t m = 0; m < job->k; m++) {
        const uint8_t *src = sd_job_staging_slot(job, ent[m].s->local, ent[m].slot) + lo * esz;
        if (m == 0)
            dev->to_f32(rd->buf + lo, src, ul->dtype, hi - lo);
        else
            dev->reduce_add(rd->buf + lo, src, ul->dtype, hi - lo);
    }
}

static bool unit_in_round(const struct sd_job *job, uint32_t unit)
{
    for (uint32_t i = 0; i < job->nr_len; i++)
        if (job->nr[(job->nr_head + i) % job->round_gens].unit == unit)
            return true;
    return false;
}

/* Start node rounds for the local rounds waiting, while a round's buffers are free (in order:
 * one whose unit must wait for an earlier round of it holds back those behind it). */
static void round_start_next(struct sd_job *job)
{
    while (job->nr_len < job->round_gens && job->rq_len > 0 && job->state != SD_JOB_FAILED) {
        struct sd_round_ref ref = job->round_queue[job->rq_head];
        if (rounds_accumulate(job) && unit_in_round(job, ref.unit))
            break; /* rounds_retire starts it */
        job->rq_head = (job->rq_head + 1) % job->rq_cap;
        job->rq_len--;
        struct sd_node_round *rd = &job->nr[(job->nr_head + job->nr_len) % job->round_gens];
        job->nr_len++;
        job->stats.push_rounds_peak = SD_MAX(job->stats.push_rounds_peak, job->nr_len);
        uint32_t u = ref.unit;
        const struct sd_unit_layout *ul = &job->layout.units[u];
        const struct sd_push_entry *ent =
            sd_job_round_ents(job, sd_job_round_index(job, u, 0, ref.seq));
        memset(rd->chunk_arrivals, 0, sizeof(rd->chunk_arrivals));
        rd->net_done = false;
        rd->unit = u;
        rd->seq = ref.seq;
        rd->start_ns = sd_now_ns();
        SD_DEBUG("net", "job '%s': push round of unit %u (micro-step %llu) starts", job->name, u,
                 (unsigned long long)rd->seq + 1);
        rd->status = SD_OK;
        rd->pending = 0;
        job->stats.bytes[SD_OP_PUSH][SD_LINK_INTRA] += (uint64_t)job->k * sd_unit_bytes(ul);
        /* One rank's fp32 gradient is the node partial as it stands: the reduce-scatter's
         * blocks leave straight from its staging slot (held until the round finishes), and
         * within one node the all-reduce runs in place there. Otherwise the partial is summed
         * into the round's buffer, across nodes block by block, each just before it leaves,
         * this node's own block last: the first send starts after 1/G of the work instead of
         * all of it. */
        uint32_t G = job->group_nodes;
        bool direct = job->k == 1 && ul->dtype == SD_DTYPE_FP32;
        rd->part = direct ? (float *)(void *)sd_job_staging_slot(job, ent[0].s->local, ent[0].slot)
                          : rd->buf;
        if (G == 1) {
            if (!direct)
                node_partial(job, rd, ent, ul, 0, ul->numel);
            round_after_rs(rd);
            continue;
        }
        size_t block = ul->numel / G, bytes = block * sizeof(float);
        uint32_t first = group_first(job), me = self_node(job) % G;
        rd->chunk = sd_bulk_chunk_bytes(bytes, 1, job->reg->cfg->chunk_bytes);
        uint32_t seq = sd_tag_wrap(rd->seq, SD_TAG_SEQ_BITS);
        for (uint32_t i = 0, o = 0; i < G; i++) {
            uint32_t m = first + i;
            if (i == me)
                continue;
            if (!direct)
                node_partial(job, rd, ent, ul, (uint64_t)i * block, (uint64_t)(i + 1) * block);
            void *rp = rd->rs_recv + (size_t)o * block, *sp = rd->part + (size_t)i * block;
            struct sd_exchange_param x = {.peer = m,
                                          .recv = {.buf = rp, .bytes = bytes},
                                          .send = {.buf = sp, .bytes = bytes},
                                          .chunk_bytes = job->reg->cfg->chunk_bytes,
                                          .cb = rs_done,
                                          .chunk_cb = rs_chunk,
                                          .arg = rd};
            rd->pending += job_exchange(job, &x, SD_TAG_GRAD, u, seq, &rd->status, &rd->suspect);
            o++;
        }
        if (!direct)
            node_partial(job, rd, ent, ul, (uint64_t)me * block, (uint64_t)(me + 1) * block);
        if (rd->pending == 0)
            round_after_rs(rd);
    }
}

void sd_job_net_round_ready(struct sd_job *job, uint32_t unit, uint64_t seq)
{
    uint32_t tail = (job->rq_head + job->rq_len) % job->rq_cap;
    job->round_queue[tail] = (struct sd_round_ref){.unit = unit, .seq = seq};
    job->rq_len++;
    round_start_next(job);
}

/* ---- step across nodes */

static void step_fail(struct sd_job *job, int status, uint32_t suspect)
{
    char what[256];
    sd_job_net_describe(job, what, sizeof(what));
    job->step_phase = SD_STEP_IDLE;
    sd_job_fail(job, SD_EPEER, "%s: transfer with node %u failed: %s", what, suspect,
                sd_status_str(status));
}

/* this node's copy of unit u's gradient block, into scratch (summing local replicas) */
static uint64_t step_pack(struct sd_job *job, uint32_t u)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint32_t f = job->plan.f[SD_STATE_G];
    uint64_t len = ul->numel / f;
    if (job->group_nodes > 1) {
        for (uint32_t j = 0; j < job->k; j++)
            dev->copy(job->scratch + (uint64_t)j * len, sd_job_g_shard(job, j, ul),
                      len * sizeof(float));
        return (uint64_t)job->k * len;
    }
    for (uint32_t i = 0; i < f; i++)
        for (uint32_t j = i; j < job->k; j += f) {
            const float *g = sd_job_g_shard(job, j, ul);
            if (j == i)
                dev->copy(job->scratch + (uint64_t)i * len, g, len * sizeof(float));
            else
                dev->reduce_add(job->scratch + (uint64_t)i * len, g, SD_DTYPE_FP32, len);
        }
    job->stats.bytes[SD_OP_STEP][SD_LINK_INTRA] += (uint64_t)(job->k / f) * ul->numel * 4;
    return ul->numel;
}

static void step_unpack(struct sd_job *job, uint32_t u)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
    for (uint32_t j = 0; j < job->k; j++)
        job->reg->dev->copy(sd_job_g_shard(job, j, ul), job->scratch + g_block_off(job, j, len),
                            len * sizeof(float));
}

static void step_ar_done(struct sd_allreduce *ar, int status, uint32_t suspect)
{
    struct sd_job *job = ar->p.arg;
    job->stats.bytes[SD_OP_STEP][SD_LINK_INTER_SENT] += ar->bytes_sent;
    job->stats.bytes[SD_OP_STEP][SD_LINK_INTER_RECV] += ar->bytes_recv;
    job->step_pending = 0;
    if (status != SD_OK) {
        step_fail(job, status, suspect);
        return;
    }
    step_unpack(job, job->step_unit);
    job->step_unit++;
    sd_job_net_step(job);
}

/* the nodes of this node's partition group must have recorded the same schedule */
static bool check_schedules(struct sd_job *job)
{
    if (job->group_nodes < 2 ||
        sd_sched_check_nodes(job, group_first(job), job->group_nodes, job->norm_parts))
        return true;
    job->step_phase = SD_STEP_IDLE;
    return false;
}

static void norm_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = (struct sd_job *)(uintptr_t)b->arg2;
    job->stats.bytes[SD_OP_STEP][b->is_send ? SD_LINK_INTER_SENT : SD_LINK_INTER_RECV] += b->bytes;
    if (status != SD_OK && job->step_status == SD_OK) {
        job->step_status = status;
        job->step_suspect = b->peer;
    }
    sd_bulk_put(&job->bulks, b);
    if (--job->step_pending > 0)
        return;
    if (job->step_status != SD_OK) {
        step_fail(job, job->step_status, job->step_suspect);
        return;
    }
    if (!check_schedules(job))
        return;
    job->step_phase = SD_STEP_APPLY;
    sd_job_net_step(job);
}

static void norm_start(struct sd_job *job)
{
    /* each distinct shard counts once: the replica in partition group 0 */
    uint32_t f = job->plan.f[SD_STATE_G], me = self_node(job);
    double local = 0.0;
    for (uint32_t j = 0; j < job->k; j++) {
        if (job->first_rank + j >= f)
            continue;
        for (uint32_t u = 0; u < job->layout.n_units; u++) {
            const struct sd_unit_layout *ul = &job->layout.units[u];
            local += job->reg->dev->sum_sq(sd_job_g_shard(job, j, ul), ul->numel / f);
        }
    }
    job->norm_parts[me] = (struct sd_norm_part){
        .sumsq = local, .digest = job->sched.digest, .n = job->sched.rec_len[0]};
    job->step_phase = SD_STEP_NORM;
    job->step_status = SD_OK;
    job->step_pending = 0;
    uint32_t seq = sd_tag_wrap(job->steps, SD_TAG_SEQ_BITS);
    for (uint32_t m = 0; m < job->nodes; m++) {
        if (m == me)
            continue;
        void *rp = &job->norm_parts[m], *sp = &job->norm_parts[me];
        struct sd_exchange_param x = {.peer = m,
                                      .recv = {.buf = rp, .bytes = sizeof(*job->norm_parts)},
                                      .send = {.buf = sp, .bytes = sizeof(*job->norm_parts)},
                                      .chunk_bytes = 4096,
                                      .cb = norm_done,
                                      .arg = job,
                                      .arg2 = (uint64_t)(uintptr_t)job};
        job->step_pending +=
            job_exchange(job, &x, SD_TAG_SCALAR, 0, seq, &job->step_status, &job->step_suspect);
    }
    if (job->step_pending == 0) {
        if (job->step_status != SD_OK) {
            step_fail(job, job->step_status, job->step_suspect);
            return;
        }
        job->step_phase = SD_STEP_APPLY;
        sd_job_net_step(job);
    }
}

/* Drive the step forward as far as it can go now; called again by every completion. */
void sd_job_net_step(struct sd_job *job)
{
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
        return;
    if (job->step_phase == SD_STEP_IDLE) {
        job->step_phase = SD_STEP_SYNC;
        job->step_unit = 0;
        job->step_start_ns = sd_now_ns();
    }
    if (job->step_phase == SD_STEP_SYNC) {
        /* everything of this step's micro-steps must be reduced, every gather finished */
        if (job->nr_len > 0 || job->rq_len > 0 || job->gathers_inflight > 0 ||
            job->step_pending > 0)
            return;
        uint32_t R = replication_nodes(job, job->members);
        while (job->plan.two_hop && R > 1 && job->step_unit < job->layout.n_units) {
            uint32_t u = job->step_unit;
            uint64_t count = step_pack(job, u);
            job->step_pending = 1;
            /* no round runs during the step: it borrows round 0's all-reduce temporary */
            int st = job_allreduce(job, &job->step_ar, R, u, job->steps, true, job->scratch, count,
                                   job->nr[0].ar_tmp, NULL, step_ar_done, job);
            if (st != SD_OK) {
                job->step_pending = 0;
                step_fail(job, st, job->members[0]);
            }
            return; /* step_ar_done continues with the next unit */
        }
        norm_start(job);
        return;
    }
    if (job->step_phase == SD_STEP_APPLY) {
        if (job->w_sends_inflight > 0)
            return; /* peers still read this node's weights of the current generation */
        double sumsq = 0.0;
        for (uint32_t m = 0; m < job->nodes; m++)
            sumsq += job->norm_parts[m].sumsq;
        sd_job_step_apply(job, sumsq);
        serve_queue(job);
        job->step_phase = SD_STEP_REFRESH;
    }
    if (job->step_phase == SD_STEP_REFRESH) {
        /* units held across the step are gathered again in place; one that cannot start now
         * (transfer resources busy) is retried when a transfer completes */
        bool pending = false;
        for (uint32_t i = 0; job->group_nodes > 1 && i < job->n_slots; i++) {
            struct sd_unit_state *us = &job->units[i];
            if (!us->resident || us->refs == 0 || us->inflight || us->gen == job->weights_gen)
                continue;
            if (gather_start(job, us) != SD_OK) {
                pending = true;
                break;
            }
            if (job->state == SD_JOB_FAILED || job->step_phase != SD_STEP_REFRESH)
                return; /* finished (or failed) inside: that call completed the step */
        }
        if (pending || job->gathers_inflight > 0)
            return;
        job->step_phase = SD_STEP_IDLE;
        sd_job_step_done(job);
    }
}

/* ---- initial values: node 0 sends each node the part of each unit it holds */

/* Elements [lo, hi) of unit ul cover the optimizer-state shards of node m's ranks, which are all
 * sd_job_load_unit reads (the weights are made from them): a zero3 node gets 1/N of the unit,
 * not all of it. */
static void init_range(const struct sd_job *job, uint32_t m, const struct sd_unit_layout *ul,
                       uint64_t *lo, uint64_t *hi)
{
    *lo = ul->numel;
    *hi = 0;
    for (uint32_t r = m * job->k; r < (m + 1) * job->k; r++) {
        uint64_t b, e;
        sd_layout_shard(ul, job->plan.f[SD_STATE_OS], r, &b, &e);
        *lo = SD_MIN(*lo, b);
        *hi = SD_MAX(*hi, e);
    }
}

static void init_recv_done(struct sd_bulk *b, int status);

static void init_post_next(struct sd_job *job)
{
    if (job->init_next_unit >= job->layout.n_units) {
        job->init_done = true;
        if (job->remote_ready) {
            sd_job_set_ready(job);
            serve_queue(job);
        }
        return;
    }
    uint32_t u = job->init_next_unit;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t lo, hi;
    init_range(job, self_node(job), ul, &lo, &hi);
    void *p = job->scratch + lo; /* where sd_job_load_unit looks for elements [lo, hi) */
    struct sd_bulk *b = sd_bulk_get(&job->bulks);
    uint64_t tag = 0;
    int st = sd_tag_make(SD_TAG_INIT, job->tag, u, 0, 0, &tag);
    if (st == SD_OK)
        st = sd_bulk_start(b, tp_of(job), false, 0, tag, &p, 1, (hi - lo) * sizeof(float),
                           job->reg->cfg->chunk_bytes, desc_of(job, p), init_recv_done, NULL, job);
    b->arg2 = (uint64_t)(uintptr_t)job;
    if (st != SD_OK) {
        sd_bulk_put(&job->bulks, b);
        sd_job_fail(job, st, "cannot receive the initial values of unit %u from node 0", u);
        return;
    }
    job->init_rb = b;
}

static void init_recv_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = (struct sd_job *)(uintptr_t)b->arg2;
    job->stats.bytes[SD_OP_INIT][SD_LINK_INTER_RECV] += b->bytes;
    sd_bulk_put(&job->bulks, b);
    job->init_rb = NULL;
    if (status != SD_OK) {
        sd_job_fail(job, SD_EPEER, "receiving the initial values of unit %u from node 0 failed: %s",
                    job->init_next_unit, sd_status_str(status));
        return;
    }
    sd_job_load_unit(job, job->init_next_unit, job->scratch);
    job->init_next_unit++;
    init_post_next(job);
}

void sd_job_net_loading(struct sd_job *job)
{
    if (self_node(job) != 0)
        init_post_next(job);
}

static void init_send_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = (struct sd_job *)(uintptr_t)b->arg2;
    job->stats.bytes[SD_OP_INIT][SD_LINK_INTER_SENT] += b->bytes;
    sd_bulk_put(&job->bulks, b);
    if (status != SD_OK && job->init_waiter != NULL) {
        sd_session_complete(job->init_waiter, job->init_tag, SD_OP_INIT, SD_EPEER, 0, 0,
                            "sending the initial values to another node failed");
        job->init_waiter = NULL;
    }
    if (--job->init_sends > 0 || job->init_waiter == NULL)
        return;
    sd_session_complete(job->init_waiter, job->init_tag, SD_OP_INIT, SD_OK, 0, 0, NULL);
    job->init_waiter = NULL;
}

void sd_job_net_init_sent(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                          const float *values)
{
    const struct sd_unit_layout *ul = &job->layout.units[e->unit];
    job->init_waiter = s;
    job->init_tag = e->tag;
    job->init_sends = 0;
    for (uint32_t m = 1; m < job->nodes; m++) {
        uint64_t lo, hi;
        init_range(job, m, ul, &lo, &hi);
        void *p = (void *)(values + lo);
        struct sd_bulk *b = sd_bulk_get(&job->bulks);
        uint64_t tag = 0;
        int st = sd_tag_make(SD_TAG_INIT, job->tag, e->unit, 0, 0, &tag);
        if (st == SD_OK)
            st = sd_bulk_start(b, tp_of(job), true, m, tag, &p, 1, (hi - lo) * sizeof(float),
                               job->reg->cfg->chunk_bytes, desc_of(job, p), init_send_done, NULL,
                               job);
        b->arg2 = (uint64_t)(uintptr_t)job;
        if (st == SD_OK)
            job->init_sends++;
        else
            sd_bulk_put(&job->bulks, b);
    }
    if (job->init_sends == 0) {
        sd_session_complete(s, e->tag, SD_OP_INIT, SD_OK, 0, 0, NULL);
        job->init_waiter = NULL;
    }
}

void sd_job_net_ready(struct sd_job *job)
{
    sd_cluster_job_ready(job->net->cl, job->name, job->nodes);
    job->remote_ready = job->init_done = true;
    serve_queue(job);
}

void sd_job_remote_ready(struct sd_registry *reg, const char *name)
{
    struct sd_job *job = sd_registry_find(reg, name);
    if (job == NULL || job->state != SD_JOB_LOADING)
        return;
    job->remote_ready = true;
    if (job->init_done) {
        sd_job_set_ready(job);
        serve_queue(job);
    }
}

/* ---- deadlines */

void sd_job_net_sweep(struct sd_job *job, uint64_t now)
{
    uint64_t timeout = (uint64_t)job->reg->cfg->op_timeout_ms * 1000000ULL;
    uint64_t started = 0;
    if (job->step_phase != SD_STEP_IDLE)
        started = job->step_start_ns;
    else if (job->nr_len > 0)
        started = job->nr[job->nr_head].start_ns;
    else if (job->gathers_inflight > 0)
        for (uint32_t i = 0; i < job->n_slots; i++)
            if (job->units[i].inflight && (started == 0 || job->units[i].start_ns < started))
                started = job->units[i].start_ns;
    if (started == 0 || now - started <= timeout)
        return;
    char what[256];
    sd_job_net_describe(job, what, sizeof(what));
    sd_job_fail(job, SD_ETIMEDOUT, "%s for %lld ms (op_timeout_ms)", what,
                (long long)job->reg->cfg->op_timeout_ms);
}

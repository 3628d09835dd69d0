/* A job's transfers across nodes (MiCS, DESIGN.md section 3) for the operations that use the
 * collective engine: its all-reduces and exchanges bound to its transport, registrations and
 * tags; the node rounds' sizes; and what its unfinished transfers tell a failure message and the
 * deadline sweep (the operations in flight: sd_job_activity). Below every operation: the
 * buffers are the callers'; the set-up is job_mem.c's. */
#include "job_module.h"
#include "net.h"
#include "sd/codec.h"
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

int sd_job_net_reg(struct sd_job *job, const void *p, size_t len)
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

int sd_job_net_reg_os(struct sd_job *job)
{
    if (job->xfer.os_registered)
        return SD_OK;
    job->xfer.os_registered = true; /* (tried once: the table has room for one try) */
    int st = SD_OK;
    for (uint32_t r = 0; st == SD_OK && r < job->k; r++)
        st = sd_job_net_reg(job, sd_job_arena(job, r, SD_STATE_OS)->ptr,
                            sd_job_arena(job, r, SD_STATE_OS)->bytes);
    return st;
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
                                   .tmp_count = a->tmp_count,
                                   .acc = a->acc,
                                   .scatter = a->scatter,
                                   .buf_desc = sd_job_net_desc(job, a->buf),
                                   .tmp_desc = sd_job_net_desc(job, a->tmp),
                                   .acc_desc = sd_job_net_desc(job, a->acc),
                                   .chunk_bytes = job->reg->cfg->chunk_bytes,
                                   .small_bytes = job->reg->cfg->small_allreduce_bytes,
                                   .cb = a->cb,
                                   .arg = a->arg};
    if (a->codec != 0) { /* encoded (quant.h): the boundary hop under ,qg or ,gwire */
        p.qbits = a->codec;
        p.qblock = sd_codec_is_float(a->codec) ? 1 : job->plan.qblock;
        p.qbuf = a->qbuf;
        p.qbuf_desc = sd_job_net_desc(job, p.qbuf);
        p.qerr = a->qerr;
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

/* the job failed (job_module.h): its transfers across nodes are cancelled (a registration's
 * job has none) */
static void net_failing(struct sd_job *job, int was)
{
    if (job->nodes > 1 && was != SD_JOB_REGISTERING)
        sd_job_net_cancel(job);
}

const struct sd_job_module sd_net_module = {.name = "net", .failing = net_failing};

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
    char peers[128], what[200];
    uint64_t since;
    if (list_pending_peers(job, is_recv, peers, sizeof(peers)) == 0)
        list_pending_peers(job, NULL, peers, sizeof(peers));
    if (peers[0] == '\0')
        snprintf(peers, sizeof(peers), "none");
    if (!sd_job_activity(job, what, sizeof(what), &since))
        snprintf(out, len, "no operation in flight (last completed step %llu)",
                 (unsigned long long)job->steps);
    else if (since == 0) /* (loading: it waits for no node in particular) */
        snprintf(out, len, "%s", what);
    else
        snprintf(out, len, "%s waiting for node(s) %s", what, peers);
}

/* ---- deadlines */

void sd_job_net_sweep(struct sd_job *job, uint64_t now)
{
    uint64_t timeout = (uint64_t)job->reg->cfg->op_timeout_ms * 1000000ULL, since;
    char what[200];
    if (!sd_job_activity(job, what, sizeof(what), &since) || since == 0 || now - since <= timeout)
        return;
    char text[256];
    sd_job_net_describe(job, text, sizeof(text));
    sd_job_fail(job, SD_ETIMEDOUT, "%s for %lld ms (op_timeout_ms)", text,
                (long long)job->reg->cfg->op_timeout_ms);
}

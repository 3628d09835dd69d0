/* The weights' all-gather after the optimizer (DESIGN.md section 3b). Each rank's optimizer
 * updated only its os shard, which is one of the f_os / f_w parts of its w shard (the nesting of
 * model.h); the other parts of that w shard are other ranks' os shards in the same os-partition
 * group. Parts whose owner is on this node are copied; across nodes (f_os > k), each node
 * receives every part it needs once, from the part's one owner in its os group, straight into
 * the w shard of the first local rank that holds it, and copies it to the others: the
 * hierarchical all-gather, each remote byte received once per node. Unit by unit; a unit's
 * exchanges with every peer of the os group are in flight together.
 *
 * With ,qw the parts cross nodes as int8 blocks (quant.h's wx slots): each owner encodes its
 * part once and decodes it back into its own w shard, so that every copy of the weights holds
 * the same values; receivers decode into the first local holder's w shard. The fp32 master in
 * the os shard never sees them. */
#include "net.h"
#include "job_module.h"
#include "weights.h"
#include "quant.h"
#include "sd/codec.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>

/* os parts in one w shard */
static uint32_t parts_per_w(const struct sd_job *job)
{
    return job->plan.f[SD_STATE_OS] / job->plan.f[SD_STATE_W];
}

/* the local index of the first rank on node m whose w shard is iw, or -1 */
static int32_t first_with_w(const struct sd_job *job, uint32_t m, uint32_t iw)
{
    uint32_t W = job->plan.f[SD_STATE_W], first = m * job->k;
    if (W <= job->k) /* every w shard is on every node; rank first + iw holds shard iw */
        return (int32_t)iw;
    uint32_t lo = first % W; /* the node holds w shards [lo, lo + k) */
    return iw >= lo && iw < lo + job->k ? (int32_t)(iw - lo) : -1;
}

/* the rank that owns os part p in the os-partition group of rank r */
static uint32_t part_owner(const struct sd_job *job, uint32_t r, uint32_t p)
{
    uint32_t OS = job->plan.f[SD_STATE_OS];
    return r - r % OS + sd_plan_shard_pos(&job->plan, SD_STATE_OS, p);
}

/* bytes of one os part of unit ul in the weights' dtype, and where part p sits in its w shard */
static uint64_t part_bytes(const struct sd_job *job, const struct sd_unit_layout *ul)
{
    return ul->numel / job->plan.f[SD_STATE_OS] * sd_dtype_size(ul->dtype);
}

static uint64_t part_off(const struct sd_job *job, const struct sd_unit_layout *ul, uint32_t p)
{
    return (uint64_t)(p % parts_per_w(job)) * part_bytes(job, ul);
}

void sd_weights_local(struct sd_job *job)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint32_t W = job->plan.f[SD_STATE_W], per = parts_per_w(job);
    if (per == 1)
        return; /* every w shard is its rank's os shard */
    for (uint32_t u = 0; u < job->layout.n_units; u++) {
        const struct sd_unit_layout *ul = &job->layout.units[u];
        uint64_t bytes = part_bytes(job, ul);
        for (uint32_t r = 0; r < job->k; r++) {
            uint32_t rank = job->first_rank + r, iw = rank % W;
            for (uint32_t e = 0; e < per; e++) {
                uint32_t p = iw * per + e, owner = part_owner(job, rank, p), from;
                if (owner == rank)
                    continue;
                if (owner / job->k == job->node) {
                    from = owner - job->first_rank;
                } else { /* received into the first local holder of this w shard */
                    int32_t f = first_with_w(job, job->node, iw);
                    if (f < 0 || (uint32_t)f == r)
                        continue;
                    from = (uint32_t)f;
                }
                uint64_t off = part_off(job, ul, p);
                dev->copy(job->mem.queue, sd_job_w_shard(job, r, u) + off,
                          sd_job_w_shard(job, from, u) + off, bytes);
                sd_job_count_copy(job, SD_OP_STEP, from, r, bytes);
            }
        }
    }
}

/* The os parts of unit u that go from node src to node dst: owned by a rank of src, in a w
 * shard of a rank of dst; in ascending part order, which both ends compute alike. Each is at
 * the owner's w shard (send) or the first local holder's (receive); encoded (,qw), the sender's
 * is its owner's wx slot and the receiver's wx slot k + rx_base + i. */
static uint32_t transfer_parts(struct sd_job *job, uint32_t u, uint32_t src, uint32_t dst,
                               bool encoded, uint32_t rx_base, void **pieces, size_t *lens)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint32_t OS = job->plan.f[SD_STATE_OS], per = parts_per_w(job), n = 0;
    uint32_t base = job->first_rank - job->first_rank % OS; /* f_os > k: one os group */
    bool sending = src == job->node;
    for (uint32_t p = 0; p < OS && n < SD_BULK_MAX_PIECES; p++) {
        uint32_t owner = base + sd_plan_shard_pos(&job->plan, SD_STATE_OS, p);
        if (owner / job->k != src)
            continue;
        int32_t holder = first_with_w(job, dst, p / per);
        if (holder < 0)
            continue;
        uint32_t local = sending ? owner - job->first_rank : (uint32_t)holder;
        if (encoded) {
            pieces[n] = sd_qw_wx(job, sending ? local : job->k + rx_base + n);
            lens[n++] = sd_qw_part_bytes(job, u);
        } else {
            pieces[n] = sd_job_w_shard(job, local, u) + part_off(job, ul, p);
            lens[n++] = part_bytes(job, ul);
        }
    }
    return n;
}

/* ,qw: the parts a bulk received, decoded into place; what it saved counted */
static void exchange_decode(struct sd_job *job, struct sd_bulk *b, int status)
{
    uint32_t u = (uint32_t)(b->arg2 >> 32), rx_base = (uint32_t)b->arg2;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    void *places[SD_BULK_MAX_PIECES];
    size_t lens[SD_BULK_MAX_PIECES];
    uint32_t src = b->is_send ? job->node : b->peer, dst = b->is_send ? b->peer : job->node;
    uint32_t n = transfer_parts(job, u, src, dst, false, 0, places, lens);
    enum sd_link_class c = b->is_send ? SD_LINK_INTER_SENT : SD_LINK_INTER_RECV;
    job->stats.saved[SD_OP_STEP][c] += (int64_t)(n * part_bytes(job, ul)) - (int64_t)b->bytes;
    if (b->is_send || status != SD_OK)
        return;
    for (uint32_t i = 0; i < n; i++)
        job->reg->dev->dequantize(job->mem.queue, places[i], ul->dtype,
                                  sd_qw_wx(job, job->k + rx_base + i), SD_CODEC_INT8,
                                  ul->numel / job->plan.f[SD_STATE_OS], job->plan.qblock, false);
}

static void exchange_done(struct sd_bulk *b, int status)
{
    struct sd_job *job = b->arg;
    job->stats.bytes[SD_OP_STEP][b->is_send ? SD_LINK_INTER_SENT : SD_LINK_INTER_RECV] += b->bytes;
    if (job->plan.qw)
        exchange_decode(job, b, status);
    uint32_t peer = b->peer;
    sd_bulk_put(&job->xfer.bulks, b);
    sd_job_event_ended(job, SD_JOB_EV_EXCHANGED, status, peer); /* the step counts them */
}

/* *rx_base: the receive slots (,qw) taken so far for unit u; *posted: the transfers started */
static int post(struct sd_job *job, uint32_t u, uint32_t peer, bool is_send, uint32_t *rx_base,
                uint32_t *posted)
{
    void *pieces[SD_BULK_MAX_PIECES];
    size_t lens[SD_BULK_MAX_PIECES];
    bool q = job->plan.qw;
    uint32_t n = is_send ? transfer_parts(job, u, job->node, peer, q, 0, pieces, lens)
                         : transfer_parts(job, u, peer, job->node, q, *rx_base, pieces, lens);
    if (n == 0)
        return SD_OK;
    uint64_t arg2 = (uint64_t)u << 32 | (is_send ? 0 : *rx_base);
    if (!is_send)
        *rx_base += n;
    uint64_t tag;
    int st = sd_tag_make(SD_TAG_WSTEP, job->xfer.tag, u, sd_tag_wrap(job->steps, SD_TAG_SEQ_BITS),
                         is_send ? job->node : peer, &tag);
    if (st != SD_OK)
        return st;
    struct sd_bulk *b = sd_bulk_get(&job->xfer.bulks);
    st = sd_bulk_start(b, &(struct sd_bulk_param){.tp = sd_job_tp(job),
                                                  .is_send = is_send,
                                                  .peer = peer,
                                                  .tag = tag,
                                                  .pieces = pieces,
                                                  .lens = lens,
                                                  .n_pieces = n,
                                                  .chunk_bytes = job->reg->cfg->chunk_bytes,
                                                  .desc = sd_job_net_desc(job, pieces[0]),
                                                  .cb = exchange_done,
                                                  .arg = job,
                                                  .arg2 = arg2});
    if (st != SD_OK) {
        if (b != NULL)
            sd_bulk_put(&job->xfer.bulks, b);
        return st;
    }
    (*posted)++;
    return SD_OK;
}

void sd_weights_encode(struct sd_job *job, uint32_t u)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t n = ul->numel / job->plan.f[SD_STATE_OS];
    for (uint32_t r = 0; r < job->k; r++) {
        uint8_t *part = sd_job_os_weights(job, r, u);
        dev->quantize(job->mem.queue, sd_qw_wx(job, r), SD_CODEC_INT8, part, ul->dtype, n,
                      job->plan.qblock);
        dev->dequantize(job->mem.queue, part, ul->dtype, sd_qw_wx(job, r), SD_CODEC_INT8, n,
                        job->plan.qblock, false);
        job->stats.quant_encodes++;
    }
}

int sd_weights_exchange(struct sd_job *job, uint32_t u, uint32_t *posted_p, uint32_t *suspect_p)
{
    uint32_t first = sd_job_group_first(job, job->gnodes[SD_STATE_OS]), rx_base = 0;
    *posted_p = 0;
    for (uint32_t i = 0; i < job->gnodes[SD_STATE_OS]; i++) {
        uint32_t m = first + i;
        if (m == job->node)
            continue;
        int st = post(job, u, m, false, &rx_base, posted_p);
        if (st == SD_OK)
            st = post(job, u, m, true, &rx_base, posted_p);
        if (st != SD_OK) {
            *suspect_p = m;
            return st;
        }
    }
    return SD_OK;
}

/* The work of a push round across nodes that needs nothing else of the push module's
 * (push_round.h): the node partial, this node's block summed chunk by chunk, ,qg's decodes. */
#include "push_round.h"
#include "net.h"
#include "quant.h"
#include "session.h"
#include "sd/codec.h"
#include "sd/util.h"

/* elements [lo, hi) of the node partial, into rd->buf: the local ranks' gradients summed in
 * rank order */
static void partial_range(struct sd_job *job, struct sd_node_round *rd,
                          const struct sd_push_entry *ent, const struct sd_unit_layout *ul,
                          uint64_t lo, uint64_t hi, uint64_t src_lo)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    size_t esz = sd_dtype_size(ul->dtype);
    for (uint32_t m = 0; m < job->k; m++) {
        const uint8_t *src = sd_job_staging_slot(job, ent[m].s->local, ent[m].slot) + src_lo * esz;
        if (m == 0)
            dev->to_f32(job->mem.queue, rd->buf + lo, src, ul->dtype, hi - lo);
        else
            dev->reduce_add(job->mem.queue, rd->buf + lo, src, ul->dtype, hi - lo);
    }
}

/* Elements [lo, hi) of the node partial in block order: across nodes, block i of the partial is
 * the g shards of the group's i-th node's ranks in local order, which with f_w > 1 are not the
 * unit's elements in order (the nesting of model.h): each g-shard-long piece comes from the
 * shard that rank holds. */
void sd_round_partial(struct sd_job *job, struct sd_node_round *rd, const struct sd_push_entry *ent,
                      const struct sd_unit_layout *ul, uint64_t lo, uint64_t hi)
{
    if (sd_job_net_g_ident(job)) {
        partial_range(job, rd, ent, ul, lo, hi, lo);
        return;
    }
    uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
    uint32_t first = sd_job_group_first(job, job->gnodes[SD_STATE_G]) * job->k;
    for (uint64_t q = lo / len; q * len < hi; q++) { /* block ranges are whole shards */
        uint32_t shard = sd_plan_shard(&job->plan, SD_STATE_G, first + (uint32_t)q);
        partial_range(job, rd, ent, ul, q * len, (q + 1) * len, (uint64_t)shard * len);
    }
}

/* chunk c of the partials of this node's block arrived from some node: once all did, sum it */
void sd_round_chunk(struct sd_bulk *b, uint32_t piece, size_t off, size_t len)
{
    struct sd_node_round *rd = b->arg;
    struct sd_job *job = rd->job;
    (void)piece;
    uint32_t c = (uint32_t)(off / rd->chunk);
    uint32_t G = job->gnodes[SD_STATE_G];
    if (++rd->chunk_arrivals[c] < G - 1)
        return;
    const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
    size_t block = ul->numel / G, e0 = off / sizeof(float), e1 = (off + len) / sizeof(float);
    uint32_t me = job->node % G;
    /* node order, as the reference would add them: ((s0 + s1) + s2) + ...; node i's partial is
     * this node's own (me) or the received one in its place */
    const struct sd_gpu_ops *dev = job->reg->dev;
    for (uint32_t i = 0; i < G; i++) {
        const float *src = i == me ? rd->part + (size_t)me * block
                                   : rd->rs_recv + (size_t)(i < me ? i : i - 1) * block;
        if (i == 0)
            dev->copy(job->mem.queue, rd->rs_out + e0, src + e0, (e1 - e0) * sizeof(float));
        else
            dev->reduce_add(job->mem.queue, rd->rs_out + e0, src + e0, SD_DTYPE_FP32, e1 - e0);
    }
}

/* With ,qg or ,gwire every other node's block arrived encoded (int4, bf16, fp16): this node's
 * block of the sum, in fp32 in node order as the exact path adds them, from its own partial and
 * the decoded others. */
void sd_round_decode(struct sd_node_round *rd)
{
    struct sd_job *job = rd->job;
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[rd->unit];
    uint32_t G = job->gnodes[SD_STATE_G], me = job->node % G, r = rd->index;
    size_t block = ul->numel / G;
    for (uint32_t i = 0, o = 0; i < G; i++) {
        if (i == me) {
            const float *own = rd->part + (size_t)me * block;
            if (i == 0)
                dev->copy(job->mem.queue, rd->rs_out, own, block * sizeof(float));
            else
                dev->reduce_add(job->mem.queue, rd->rs_out, own, SD_DTYPE_FP32, block);
            continue;
        }
        sd_gpu_decode(dev, job->mem.queue, rd->rs_out, sd_qg_recv(job, r, o++), rd->codec, block,
                      job->plan.qblock, i != 0);
    }
}

/* The quantized collectives' buffers (plan options ,qw ,qg ,ef; the format is sd/codec.h), laid
 * out once at registration in one allocation of the backend's memory:
 *   qw   each local rank's w shards as int8 blocks, re-encoded lazily once per weights
 *        generation by their owner (the first gather or pull request of the generation);
 *   rx   receive slots of gathers across nodes: the remote blocks arrive encoded and are decoded
 *        into the gather's pool place when the last one is in;
 *   qg   per node round, the int4 blocks sent to and received from the other nodes of the
 *        g-partition group;
 *   ef   per unit, the node partial's quantization error (error feedback), added to the next
 *        micro-step's partial before it is quantized;
 *   hop  the boundary hop's quantized all-reduce (coll.h), and with ,ef its residuals per unit;
 *   wx   the weights' exchange after the optimizer: the local ranks' os parts as int8 blocks,
 *        and the parts received from the other nodes. */
#include "job_module.h"
#include "job.h"
#include "quant.h"
#include "sd/codec.h"
#include "sd/config.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>

#define QALIGN 64u

struct quant_layout {
    uint64_t qw_rank, rx_slot, qg_block, ef_floats, hop, hop_ef_floats, wx_part;
    uint64_t off_qw, off_rx, off_qg, off_ef, off_hop, off_hop_ef, off_wx, total;
};

/* The quantized collectives' buffers of a job (quant.h): only this file reads or writes them. */
struct sd_quant_state {
    struct sd_mem mem;
    uint8_t *qw; /* [k][qw_rank_bytes]: each rank's w shards as int8 blocks */
    uint64_t qw_rank_bytes;
    uint64_t *qw_off; /* [n_units]: where unit u's encoded shard is in a rank's part */
    uint64_t *qw_gen; /* [n_units * k]: the weights generation encoded, UINT64_MAX: none */
    uint8_t *rx;      /* [SD_QUANT_RX_SLOTS][rx_slot_bytes]: encoded remote blocks of a gather */
    uint64_t rx_slot_bytes;
    uint32_t rx_busy; /* bit i: slot i is a gather's */
    /* bit i: slot i's gather is over, its decodes queued: free once the job's queue reached
     * rx_ticket[i] (sd_qw_rx_poll), still busy meanwhile */
    uint32_t rx_pending;
    uint64_t rx_ticket[SD_QUANT_RX_SLOTS];
    uint8_t *qg; /* [round_gens][2 (G - 1)][qg_block_bytes]: a node round's int4 blocks */
    uint64_t qg_block_bytes;
    float *ef;        /* [sum of numel]: error feedback, the node partial's quantization error */
    uint64_t *ef_off; /* [n_units] */
    uint64_t ef_floats;
    uint8_t *hop;         /* the boundary hop's quantized all-reduce (sd_allreduce's qbuf) */
    float *hop_ef;        /* [sum of the units' hop counts]: its error feedback */
    uint64_t *hop_ef_off; /* [n_units] */
    uint64_t hop_ef_floats;
    uint8_t *wx; /* [k + f_os][wx_part_bytes]: the weights' exchange after the optimizer as int8
                    blocks, the local ranks' os parts sent, then the parts received */
    uint64_t wx_part_bytes;
};

static uint64_t align_up(uint64_t v)
{
    return (v + QALIGN - 1) / QALIGN * QALIGN;
}

uint64_t sd_qw_shard_bytes(const struct sd_job *job, uint32_t u)
{
    uint64_t n = job->layout.units[u].numel / job->plan.f[SD_STATE_W];
    return sd_codec_bytes(SD_CODEC_INT8, n, job->plan.qblock);
}

uint64_t sd_qw_part_bytes(const struct sd_job *job, uint32_t u)
{
    uint64_t n = job->layout.units[u].numel / job->plan.f[SD_STATE_OS];
    return sd_codec_bytes(SD_CODEC_INT8, n, job->plan.qblock);
}

uint32_t sd_qg_hop_nodes(const struct sd_job *job)
{
    return job->plan.two_hop && job->nodes > 1 ? job->nodes / job->gnodes[SD_STATE_G] : 1;
}

uint64_t sd_qg_hop_count(const struct sd_job *job, uint32_t u)
{
    uint64_t numel = job->layout.units[u].numel;
    return job->gnodes[SD_STATE_G] > 1 ? job->k * (numel / job->plan.f[SD_STATE_G]) : numel;
}

int sd_qg_hop_codec(const struct sd_job *job, uint32_t u)
{
    uint32_t R = sd_qg_hop_nodes(job);
    if (R < 2)
        return 0;
    if (job->plan.qg &&
        sd_qg_hop_count(job, u) / R * sizeof(float) >= (uint64_t)job->reg->cfg->quant_min_bytes)
        return SD_CODEC_INT4;
    return sd_plan_gwire_codec(&job->plan);
}

uint64_t sd_qw_remote_bytes(const struct sd_job *job, uint32_t u)
{
    uint32_t Gw = job->gnodes[SD_STATE_W];
    return (uint64_t)(Gw - 1) * job->k * sd_qw_shard_bytes(job, u);
}

static struct quant_layout layout_of(const struct sd_job *job, const struct sd_config *cfg)
{
    struct quant_layout q = {0};
    const struct sd_layout *l = &job->layout;
    uint32_t Gw = job->gnodes[SD_STATE_W], G = job->gnodes[SD_STATE_G];
    if (job->plan.qw) {
        for (uint32_t u = 0; u < l->n_units; u++)
            q.qw_rank += align_up(sd_qw_shard_bytes(job, u));
        if (Gw > 1) {
            /* the largest unit's remote blocks, or a batch of small units: under
             * coalesce_bytes in their dtype (2 bytes or more an element), at most one block of
             * scales per shard more than n (1 + 4 / B) bytes for n elements */
            uint64_t most = 0;
            for (uint32_t u = 0; u < l->n_units; u++)
                most = SD_MAX(most, sd_qw_remote_bytes(job, u));
            uint64_t batch = (uint64_t)cfg->coalesce_bytes / 2;
            batch += batch * 4 / job->plan.qblock + 4ull * SD_BULK_MAX_PIECES * Gw;
            q.rx_slot = align_up(SD_MAX(most, batch));
        }
    }
    int gw = sd_plan_gwire_codec(&job->plan);
    if (job->plan.qg && G > 1) {
        q.qg_block =
            align_up(sd_codec_bytes(SD_CODEC_INT4, l->max_unit_numel / G, job->plan.qblock));
        if (job->plan.ef)
            q.ef_floats = l->total_numel;
    }
    if (gw != 0 && G > 1) /* the blocks in the wire dtype (with ,qg: the units it leaves exact) */
        q.qg_block = SD_MAX(q.qg_block, align_up(sd_codec_bytes(gw, l->max_unit_numel / G, 1)));
    uint32_t R = sd_qg_hop_nodes(job);
    if ((job->plan.qg || gw != 0) && R > 1) {
        for (uint32_t u = 0; u < l->n_units; u++) {
            uint64_t count = sd_qg_hop_count(job, u);
            if (job->plan.qg)
                q.hop = SD_MAX(q.hop,
                               sd_allreduce_qbuf_bytes(count, R, SD_CODEC_INT4, job->plan.qblock));
            if (gw != 0)
                q.hop = SD_MAX(q.hop, sd_allreduce_qbuf_bytes(count, R, gw, 1));
            q.hop_ef_floats += job->plan.ef ? count : 0;
        }
    }
    if (job->plan.qw && sd_job_weights_remote(job))
        for (uint32_t u = 0; u < l->n_units; u++)
            q.wx_part = SD_MAX(q.wx_part, align_up(sd_qw_part_bytes(job, u)));
    q.off_qw = 0;
    q.off_rx = q.off_qw + q.qw_rank * job->k;
    q.off_qg = q.off_rx + q.rx_slot * SD_QUANT_RX_SLOTS;
    q.off_ef = q.off_qg + q.qg_block * 2 * (G - 1) * sd_job_push_gens(job);
    q.off_hop = align_up(q.off_ef + q.ef_floats * sizeof(float));
    q.off_hop_ef = align_up(q.off_hop + q.hop);
    q.off_wx = align_up(q.off_hop_ef + q.hop_ef_floats * sizeof(float));
    q.total = q.off_wx + q.wx_part * (job->k + job->plan.f[SD_STATE_OS]);
    return q;
}

uint64_t sd_quant_bytes(const struct sd_job *job, const struct sd_config *cfg)
{
    struct quant_layout q = layout_of(job, cfg);
    uint64_t book = job->plan.qw ? (uint64_t)job->layout.n_units * (job->k + 1) * 8 : 0;
    return q.total + book + (q.ef_floats ? job->layout.n_units * 8ull : 0) +
           (q.hop_ef_floats ? job->layout.n_units * 8ull : 0);
}

int sd_quant_alloc(struct sd_job *job, char *err, size_t errlen)
{
    if (job->mem.quant == NULL && (job->mem.quant = calloc(1, sizeof(*job->mem.quant))) == NULL) {
        snprintf(err, errlen, "out of memory for the quantized buffers of job '%s'", job->name);
        return SD_ENOMEM;
    }
    struct sd_quant_state *qs = job->mem.quant;
    struct quant_layout q = layout_of(job, job->reg->cfg);
    const struct sd_layout *l = &job->layout;
    qs->mem.fd = -1;
    if (q.total == 0)
        return SD_OK;
    char tag[96];
    snprintf(tag, sizeof(tag), "shardd-%s-quant", job->name);
    int st =
        job->reg->dev->alloc(sd_job_rank_device(job, 0), q.total, SD_MEM_PRIVATE, tag, &qs->mem);
    if (st != SD_OK) {
        snprintf(err, errlen, "allocating %s for job '%s' failed: %s", tag, job->name,
                 sd_status_str(st));
        return st;
    }
    uint8_t *base = qs->mem.ptr;
    if (job->plan.qw) {
        qs->qw = base + q.off_qw;
        qs->qw_rank_bytes = q.qw_rank;
        qs->qw_off = calloc(l->n_units, sizeof(*qs->qw_off));
        qs->qw_gen = malloc((size_t)l->n_units * job->k * sizeof(*qs->qw_gen));
        if (qs->qw_off == NULL || qs->qw_gen == NULL)
            goto nomem;
        uint64_t off = 0;
        for (uint32_t u = 0; u < l->n_units; u++) {
            qs->qw_off[u] = off;
            off += align_up(sd_qw_shard_bytes(job, u));
        }
        for (size_t i = 0; i < (size_t)l->n_units * job->k; i++)
            qs->qw_gen[i] = UINT64_MAX;
    }
    if (q.rx_slot) {
        qs->rx = base + q.off_rx;
        qs->rx_slot_bytes = q.rx_slot;
    }
    if (q.qg_block) {
        qs->qg = base + q.off_qg;
        qs->qg_block_bytes = q.qg_block;
    }
    if (q.ef_floats) {
        qs->ef = (float *)(void *)(base + q.off_ef);
        qs->ef_off = calloc(l->n_units, sizeof(*qs->ef_off));
        if (qs->ef_off == NULL)
            goto nomem;
        for (uint32_t u = 0; u < l->n_units; u++)
            qs->ef_off[u] = l->units[u].pool_off; /* the units' elements, in order */
        qs->ef_floats = q.ef_floats;              /* zeroed on the loop: sd_quant_start */
    }
    if (q.hop) {
        qs->hop = base + q.off_hop;
        if (q.hop_ef_floats) {
            qs->hop_ef = (float *)(void *)(base + q.off_hop_ef);
            qs->hop_ef_off = calloc(l->n_units, sizeof(*qs->hop_ef_off));
            if (qs->hop_ef_off == NULL)
                goto nomem;
            for (uint32_t u = 1; u < l->n_units; u++)
                qs->hop_ef_off[u] = qs->hop_ef_off[u - 1] + sd_qg_hop_count(job, u - 1);
            qs->hop_ef_floats = q.hop_ef_floats; /* zeroed on the loop: sd_quant_start */
        }
    }
    if (q.wx_part) {
        qs->wx = base + q.off_wx;
        qs->wx_part_bytes = q.wx_part;
    }
    return SD_OK;
nomem:
    snprintf(err, errlen, "out of memory for the job's quantization bookkeeping");
    return SD_ENOMEM;
}

void sd_quant_start(struct sd_job *job)
{
    const struct sd_quant_state *qs = job->mem.quant;
    if (qs == NULL)
        return;
    if (qs->ef != NULL)
        job->reg->dev->zero(job->mem.queue, qs->ef, qs->ef_floats * sizeof(float));
    if (qs->hop_ef != NULL)
        job->reg->dev->zero(job->mem.queue, qs->hop_ef, qs->hop_ef_floats * sizeof(float));
}

void sd_quant_free(struct sd_job *job)
{
    struct sd_quant_state *qs = job->mem.quant;
    if (qs == NULL)
        return;
    if (qs->mem.ptr != NULL)
        job->reg->dev->free(&qs->mem);
    free(qs->qw_off);
    free(qs->qw_gen);
    free(qs->ef_off);
    free(qs->hop_ef_off);
    *qs = (struct sd_quant_state){.mem = {.fd = -1}};
}

uint8_t *sd_qw_shard(struct sd_job *job, uint32_t local, uint32_t u, bool *fresh_p)
{
    struct sd_quant_state *qs = job->mem.quant;
    uint8_t *enc = qs->qw + local * qs->qw_rank_bytes + qs->qw_off[u];
    uint64_t *gen = &qs->qw_gen[(size_t)u * job->k + local];
    if (*gen != job->weights_gen) {
        const struct sd_unit_layout *ul = &job->layout.units[u];
        job->reg->dev->quantize(job->mem.queue, enc, SD_CODEC_INT8, sd_job_w_shard(job, local, u),
                                ul->dtype, ul->numel / job->plan.f[SD_STATE_W], job->plan.qblock);
        *gen = job->weights_gen;
        job->stats.quant_encodes++;
        if (fresh_p != NULL)
            *fresh_p = true;
    }
    return enc;
}

bool sd_qw_rx_available(const struct sd_job *job)
{
    const struct sd_quant_state *qs = job->mem.quant;
    return qs == NULL || qs->rx == NULL || qs->rx_busy != (1u << SD_QUANT_RX_SLOTS) - 1;
}

int32_t sd_qw_rx_take(struct sd_job *job)
{
    for (int32_t i = 0; i < SD_QUANT_RX_SLOTS; i++)
        if (!(job->mem.quant->rx_busy & (1u << i))) {
            job->mem.quant->rx_busy |= 1u << i;
            return i;
        }
    return -1;
}

void sd_qw_rx_put(struct sd_job *job, int32_t i)
{
    if (i >= 0)
        job->mem.quant->rx_busy &= ~(1u << i);
}

void sd_qw_rx_put_after(struct sd_job *job, int32_t i, uint64_t ticket)
{
    job->mem.quant->rx_pending |= 1u << i;
    job->mem.quant->rx_ticket[i] = ticket;
}

bool sd_qw_rx_waiting(const struct sd_job *job)
{
    return job->mem.quant != NULL && job->mem.quant->rx_pending != 0;
}

bool sd_qw_rx_poll(struct sd_job *job)
{
    struct sd_quant_state *qs = job->mem.quant;
    bool freed = false;
    for (int32_t i = 0; i < SD_QUANT_RX_SLOTS && qs->rx_pending != 0; i++) {
        if (!(qs->rx_pending & (1u << i)))
            continue;
        int st = job->state == SD_JOB_FAILED
                     ? SD_OK
                     : job->reg->dev->query(job->mem.queue, qs->rx_ticket[i]);
        if (st == SD_EAGAIN)
            continue;
        qs->rx_pending &= ~(1u << i);
        qs->rx_busy &= ~(1u << i);
        freed = true;
        if (st != SD_OK)
            sd_job_backend_failed(job, st);
    }
    return freed;
}

uint8_t *sd_qw_rx(struct sd_job *job, int32_t i)
{
    return job->mem.quant->rx + (uint64_t)i * job->mem.quant->rx_slot_bytes;
}

bool sd_qw_rx_fits(const struct sd_job *job, uint64_t q)
{
    return q <= job->mem.quant->rx_slot_bytes;
}

int sd_qg_codec(const struct sd_job *job, uint32_t u)
{
    uint32_t G = job->gnodes[SD_STATE_G];
    if (G < 2)
        return 0;
    if (job->plan.qg &&
        job->layout.units[u].numel / G * sizeof(float) >= (uint64_t)job->reg->cfg->quant_min_bytes)
        return SD_CODEC_INT4;
    return sd_plan_gwire_codec(&job->plan);
}

uint8_t *sd_qg_send(struct sd_job *job, uint32_t r, uint32_t o)
{
    uint32_t G = job->gnodes[SD_STATE_G];
    return job->mem.quant->qg + ((uint64_t)r * 2 * (G - 1) + o) * job->mem.quant->qg_block_bytes;
}

uint8_t *sd_qg_recv(struct sd_job *job, uint32_t r, uint32_t o)
{
    uint32_t G = job->gnodes[SD_STATE_G];
    return job->mem.quant->qg +
           ((uint64_t)r * 2 * (G - 1) + (G - 1) + o) * job->mem.quant->qg_block_bytes;
}

float *sd_qg_ef(struct sd_job *job, uint32_t u, uint32_t i)
{
    uint64_t block = job->layout.units[u].numel / job->gnodes[SD_STATE_G];
    return job->mem.quant->ef + job->mem.quant->ef_off[u] + (uint64_t)i * block;
}

uint8_t *sd_qg_hop_buf(struct sd_job *job)
{
    return job->mem.quant->hop;
}

float *sd_qg_hop_ef(struct sd_job *job, uint32_t u)
{
    struct sd_quant_state *qs = job->mem.quant;
    return qs->hop_ef != NULL ? qs->hop_ef + qs->hop_ef_off[u] : NULL;
}

uint8_t *sd_qw_wx(struct sd_job *job, uint32_t i)
{
    return job->mem.quant->wx + (uint64_t)i * job->mem.quant->wx_part_bytes;
}

void sd_quant_destroy(struct sd_job *job)
{
    sd_quant_free(job);
    free(job->mem.quant);
    job->mem.quant = NULL;
}

bool sd_qw_rx_enabled(const struct sd_job *job)
{
    return job->mem.quant != NULL && job->mem.quant->rx != NULL;
}

const struct sd_mem *sd_quant_mem(const struct sd_job *job)
{
    return job->mem.quant != NULL && job->mem.quant->mem.ptr != NULL ? &job->mem.quant->mem : NULL;
}

const struct sd_job_module sd_quant_module = {
    .name = "quant", .destroy = sd_quant_destroy, .release = sd_quant_free};

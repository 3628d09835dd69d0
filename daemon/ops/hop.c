/* The boundary hop (hop.h; DESIGN.md section 3, step 5's 2-hop sync). One unit at a time: this
 * node's block of the unit's gradient packed into the hop buffer (the replicas inside the node
 * summed in rank order), all-reduced across the replication group, unpacked into every local
 * holder's g shard. The order is fixed (descending unit ids) so that every node posts the same
 * all-reduce next, whichever of its units became final first.
 *
 * Early hops: where the g group lies inside the node, no push round crosses nodes, so round 0's
 * node buffer and all-reduce temporary are free during the backward; a unit whose every local
 * push of the step was marked the last (SD_PUSH_LAST) goes at once, while the backward of the
 * units below it runs. The sums are the same as at the step's SYNC (the same inputs, the same
 * order), only earlier. */
#include "hop.h"
#include "job_module.h"
#include "net.h"
#include "push.h"
#include "quant.h"
#include "step.h"
#include "step_int.h"
#include "sd/codec.h"
#include "sd/log.h"

#include <stdlib.h>

/* the unit at position pos of the hop order */
static uint32_t hop_unit(const struct sd_job *job, uint32_t pos)
{
    return job->layout.n_units - 1 - pos;
}

uint32_t sd_hop_nodes(struct sd_job *job)
{
    return job->plan.two_hop ? sd_job_replication_nodes(job, job->xfer.members) : 1;
}

/* round 0's node buffer where no round uses it (a g group inside the node), else scratch */
static float *hop_buf(struct sd_job *job)
{
    float *b = sd_push_idle_round_buf(job);
    return b != NULL ? b : job->mem.scratch;
}

/* The block's slots: this node's g shards as the hop's block holds them (k shards of the g
 * group that spans nodes, or the f_g distinct shards of a group inside the node), each at
 * slot * len; local rank j's slot, and whether it is the first local holder of it (the others'
 * replicas are added to the first's). */
static uint32_t hop_slots(const struct sd_job *job)
{
    return job->gnodes[SD_STATE_G] > 1 ? job->k : job->plan.f[SD_STATE_G];
}

static uint32_t hop_slot(const struct sd_job *job, uint32_t j, bool *first_p)
{
    uint32_t f = job->plan.f[SD_STATE_G];
    if (first_p != NULL)
        *first_p = job->gnodes[SD_STATE_G] > 1 || j < f;
    return (uint32_t)(sd_job_g_block_off(job, j, 1));
}

bool sd_hop_owned(const struct sd_job *job)
{
    return job->step != NULL && job->step->hop_perm != NULL;
}

int sd_hop_alloc(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    st->hop_scatter = false;
    if (job->nodes < 2 || !sd_plan_hop_owned(&job->plan, job->nodes, job->k))
        return SD_OK;
    uint32_t members[SD_MAX_NODES];
    uint32_t R = sd_job_replication_nodes(job, members);
    uint32_t S = hop_slots(job), P = job->plan.f[SD_STATE_OS] / job->plan.f[SD_STATE_G];
    uint32_t *owner = calloc((size_t)S * P, sizeof(*owner));
    uint32_t *count = calloc(R, sizeof(*count));
    st->hop_perm = calloc((size_t)S * P, sizeof(*st->hop_perm));
    if (owner == NULL || count == NULL || st->hop_perm == NULL) {
        free(owner);
        free(count);
        free(st->hop_perm);
        st->hop_perm = NULL;
        return SD_ENOMEM;
    }
    /* piece q of slot s is os shard g P + q (g the slot's g shard), held by one rank (f_os =
     * world) on one of the R nodes: the owner, by its place in the replication group */
    bool ok = true;
    for (uint32_t s = 0; s < S; s++) {
        uint32_t g = job->gnodes[SD_STATE_G] > 1
                         ? sd_plan_shard(&job->plan, SD_STATE_G, job->first_rank + s)
                         : s;
        for (uint32_t q = 0; q < P; q++) {
            uint32_t rank = sd_plan_shard_pos(&job->plan, SD_STATE_OS, g * P + q);
            uint32_t pos = 0;
            while (pos < R && members[pos] != rank / job->k)
                pos++;
            ok = ok && pos < R;
            owner[(size_t)s * P + q] = pos < R ? pos : 0;
            count[pos < R ? pos : 0]++;
        }
    }
    uint32_t seg = S * P / R;
    for (uint32_t p = 0; p < R; p++)
        ok = ok && count[p] == seg;
    /* each owner's pieces in block order, at the segment the reduce-scatter leaves there */
    for (uint32_t p = 0; p < R; p++)
        count[p] = 0;
    for (size_t b = 0; ok && b < (size_t)S * P; b++) {
        uint32_t p = owner[b];
        st->hop_perm[b] = ((p + 1) % R) * seg + count[p]++;
    }
    free(owner);
    free(count);
    if (!ok) { /* not a layout sd_plan_hop_owned promised: the all-reduce of the block as it is */
        SD_WARN("step",
                "job %s: the boundary hop's owners do not split its block evenly: it "
                "all-reduces",
                job->name);
        free(st->hop_perm);
        st->hop_perm = NULL;
        return SD_OK;
    }
    st->hop_pieces = P;
    st->hop_scatter = sd_plan_hop_scatters(&job->plan, job->nodes, job->k);
    return SD_OK;
}

void sd_hop_free(struct sd_job *job)
{
    if (job->step == NULL)
        return;
    free(job->step->hop_perm);
    job->step->hop_perm = NULL;
}

/* Copy (or add) n pieces of pl floats between a g shard's slot and the packed block: piece q of
 * the slot at hop_perm's place, in runs of consecutive places. */
static void hop_move(struct sd_job *job, uint32_t slot, float *g, float *buf, uint64_t pl, int how)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    uint32_t P = job->step->hop_pieces;
    const uint32_t *perm = job->step->hop_perm + (size_t)slot * P;
    for (uint32_t q = 0, n; q < P; q += n) {
        for (n = 1; q + n < P && perm[q + n] == perm[q] + n; n++)
            ;
        float *shard = g + (uint64_t)q * pl, *packed = buf + (uint64_t)perm[q] * pl;
        if (how == 0) /* the first holder's pieces in */
            dev->copy(job->mem.queue, packed, shard, n * pl * sizeof(float));
        else if (how == 1) /* a replica's added */
            dev->reduce_add(job->mem.queue, packed, shard, SD_DTYPE_FP32, n * pl);
        else /* the sums back */
            dev->copy(job->mem.queue, shard, packed, n * pl * sizeof(float));
    }
}

/* this node's copy of unit u's gradient block, into buf (summing local replicas) */
static uint64_t hop_pack(struct sd_job *job, uint32_t u, float *buf)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint32_t f = job->plan.f[SD_STATE_G];
    uint64_t len = ul->numel / f;
    for (uint32_t j = 0; j < job->k; j++) /* each rank's g shard into the node's buffer */
        sd_job_count_copy(job, SD_OP_STEP, j, 0, len * sizeof(float));
    if (sd_hop_owned(job)) { /* each owner's pieces together */
        uint64_t pl = ul->numel / job->plan.f[SD_STATE_OS];
        for (uint32_t j = 0; j < job->k; j++) {
            bool first;
            uint32_t slot = hop_slot(job, j, &first);
            hop_move(job, slot, sd_job_g_shard(job, j, ul), buf, pl, first ? 0 : 1);
        }
        return (uint64_t)hop_slots(job) * len;
    }
    if (job->gnodes[SD_STATE_G] > 1) {
        for (uint32_t j = 0; j < job->k; j++)
            dev->copy(job->mem.queue, buf + (uint64_t)j * len, sd_job_g_shard(job, j, ul),
                      len * sizeof(float));
        return (uint64_t)job->k * len;
    }
    /* replicas of a shard inside the node summed in rank order, each shard at its place in the
     * unit (rank j < f is the first to hold its shard) */
    for (uint32_t j = 0; j < job->k; j++) {
        const float *g = sd_job_g_shard(job, j, ul);
        float *dst = buf + sd_job_g_block_off(job, j, len);
        if (j < f)
            dev->copy(job->mem.queue, dst, g, len * sizeof(float));
        else
            dev->reduce_add(job->mem.queue, dst, g, SD_DTYPE_FP32, len);
    }
    return ul->numel;
}

/* the sums back into each local g shard: the whole shard, or where the hop reduce-scattered,
 * the rank's os part (the one piece of the segment this node summed that it needs) */
static void hop_unpack(struct sd_job *job, uint32_t u, float *buf)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    uint64_t len = ul->numel / job->plan.f[SD_STATE_G];
    const struct sd_step_state *st = job->step;
    uint64_t pl = ul->numel / job->plan.f[SD_STATE_OS];
    for (uint32_t j = 0; j < job->k; j++) {
        uint32_t slot = hop_slot(job, j, NULL);
        if (st->hop_scatter) {
            uint32_t q =
                sd_plan_shard(&job->plan, SD_STATE_OS, job->first_rank + j) % st->hop_pieces;
            job->reg->dev->copy(job->mem.queue, sd_job_os_grad(job, j, u),
                                buf +
                                    (uint64_t)st->hop_perm[(size_t)slot * st->hop_pieces + q] * pl,
                                pl * sizeof(float));
            sd_job_count_copy(job, SD_OP_STEP, 0, j, pl * sizeof(float));
            continue;
        }
        if (sd_hop_owned(job))
            hop_move(job, slot, sd_job_g_shard(job, j, ul), buf, pl, 2);
        else
            job->reg->dev->copy(job->mem.queue, sd_job_g_shard(job, j, ul),
                                buf + sd_job_g_block_off(job, j, len), len * sizeof(float));
        sd_job_count_copy(job, SD_OP_STEP, 0, j, len * sizeof(float));
    }
}

static void hop_next(struct sd_job *job);

static void hop_ar_done(struct sd_allreduce *ar, int status, uint32_t suspect)
{
    struct sd_job *job = ar->p.arg;
    struct sd_step_state *st = job->step;
    job->stats.bytes[SD_OP_STEP][SD_LINK_INTER_SENT] += ar->bytes_sent;
    job->stats.bytes[SD_OP_STEP][SD_LINK_INTER_RECV] += ar->bytes_recv;
    if (ar->p.qbits != 0) { /* it sends and receives the same raw volume */
        job->stats.saved[SD_OP_STEP][SD_LINK_INTER_SENT] +=
            (int64_t)(ar->qraw / 2) - (int64_t)ar->bytes_sent;
        job->stats.saved[SD_OP_STEP][SD_LINK_INTER_RECV] +=
            (int64_t)(ar->qraw / 2) - (int64_t)ar->bytes_recv;
        job->stats.quant_encodes++;
    }
    st->pending = 0;
    if (status != SD_OK) {
        sd_step__fail(job, status, suspect);
        return;
    }
    hop_unpack(job, hop_unit(job, st->hop_done), hop_buf(job));
    st->hop_done++;
    if (st->phase == SD_STEP_SYNC)
        sd_step_progress(job);
    else
        hop_next(job); /* early: the next unit, if its last round is reduced */
}

/* start the all-reduce of the next unit in the hop order (st->pending while it runs) */
static void hop_start(struct sd_job *job, uint32_t R)
{
    struct sd_step_state *st = job->step;
    uint32_t u = hop_unit(job, st->hop_done);
    float *buf = hop_buf(job);
    uint64_t count = hop_pack(job, u, buf);
    st->pending = 1;
    st->early_hops += st->phase != SD_STEP_SYNC;
    int codec = sd_qg_hop_codec(job, u);
    bool q = codec != 0;
    job->stats.quant_fallbacks += job->plan.qg && codec != SD_CODEC_INT4;
    int rc = sd_job_net_allreduce(
        job,
        &(struct sd_job_allreduce){.ar = &st->ar,
                                   .R = R,
                                   .unit = u,
                                   .round = job->steps,
                                   .step_sync = true,
                                   .buf = buf,
                                   .count = count,
                                   .scatter = st->hop_scatter,
                                   .tmp = sd_push_ar_tmp(job),
                                   .tmp_count = sd_push_ar_tmp_count(job),
                                   .codec = codec,
                                   .qbuf = q ? sd_qg_hop_buf(job) : NULL,
                                   .qerr = codec == SD_CODEC_INT4 ? sd_qg_hop_ef(job, u) : NULL,
                                   .cb = hop_ar_done,
                                   .arg = job});
    if (rc != SD_OK) {
        st->pending = 0;
        sd_step__fail(job, rc, job->xfer.members[0]);
    }
}

/* early: the next unit goes if it is final (SD_JOB_EV_UNIT_FINAL) */
static void hop_next(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    if (job->state != SD_JOB_READY || st->pending > 0 || st->hop_done >= job->layout.n_units)
        return;
    if (!st->hop_final[hop_unit(job, st->hop_done)])
        return; /* its last round is still to come: from there, or at the step */
    hop_start(job, sd_hop_nodes(job));
}

void sd_hop_unit_final(struct sd_job *job, uint32_t u)
{
    struct sd_step_state *st = job->step;
    st->hop_final[u] = true;
    /* early only where round 0's node buffer is free, and the step is not running already (it
     * goes on from its SYNC phase) */
    if (st->phase == SD_STEP_IDLE && sd_push_idle_round_buf(job) != NULL && sd_hop_nodes(job) > 1)
        hop_next(job);
}

bool sd_hop_sync(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    uint32_t R = sd_hop_nodes(job);
    if (R <= 1 || st->hop_done >= job->layout.n_units)
        return true;
    if (st->pending == 0)
        hop_start(job, R);
    return false;
}

void sd_hop_reset(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    st->hop_done = 0;
    for (uint32_t u = 0; st->hop_final != NULL && u < job->layout.n_units; u++)
        st->hop_final[u] = false;
}

uint64_t sd_hop_early_count(const struct sd_job *job)
{
    return job->step != NULL ? job->step->early_hops : 0;
}

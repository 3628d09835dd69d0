/* The secondary partition (ZeRO++'s hpZ; plan option ,sec=S, DESIGN.md section 3b). After the
 * first gather of a unit in a weights generation, S ranks of the node keep 1/S of it each; the
 * unit's later gathers of the same generation (the backward fetch after the forward one was
 * evicted, the next micro-step's) copy those S pieces instead of gathering within the w group,
 * so they cross no node boundary, and no package boundary the S ranks do not span. Every copy
 * carries the weights generation it was made from and is used only while it equals the job's:
 * any write of the weights (the optimizer step, a load) advances the generation, which
 * invalidates every secondary copy at once, with no invalidation walk that could be missed.
 * With ,qsec the pieces are kept as int8 blocks (sd/codec.h): quantized when kept, decoded into
 * the slot when loaded. */
#include "job_module.h"
#include "job.h"
#include "secondary.h"
#include "sd/codec.h"
#include "sd/log.h"
#include "sd/status.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The node's secondary copies (secondary.h): only this file reads or writes them. */
struct sd_sec_state {
    struct sd_mem *mem; /* [k]: holders of the groups in use, the rest empty */
    uint32_t groups;    /* groups in use */
    uint64_t *gen;      /* [n_units * groups]: weights generation held, UINT64_MAX: none */
    uint64_t loads;     /* gathers served from it */
    uint64_t stores;    /* refills after a gather of a new generation */
};

static uint32_t group_of(const struct sd_job *job, const struct sd_unit_state *us)
{
    return us->lslot / job->plan.sec;
}

static uint64_t *gen_of(const struct sd_job *job, const struct sd_unit_state *us)
{
    return &job->sec->gen[(size_t)us->unit * job->sec->groups + group_of(job, us)];
}

/* holder h's piece of unit ul (in the unit's dtype, or int8 blocks with ,qsec), and the bytes
 * of its slot part */
static uint8_t *piece(struct sd_job *job, uint32_t h, const struct sd_unit_layout *ul)
{
    return (uint8_t *)job->sec->mem[h].ptr + ul->sec_boff;
}

static uint64_t piece_bytes(const struct sd_job *job, const struct sd_unit_layout *ul)
{
    return ul->numel / job->plan.sec * sd_dtype_size(ul->dtype);
}

uint64_t sd_sec_holder_bytes(const struct sd_job *job)
{
    return job->layout.sec_bytes;
}

uint32_t sd_sec_holders(const struct sd_job *job)
{
    if (!sd_plan_sec_active(&job->plan))
        return 0;
    return job->slots_per_unit == 1 ? job->plan.sec : job->k;
}

bool sd_sec_ready(const struct sd_job *job, const struct sd_unit_state *us)
{
    return job->sec != NULL && job->sec->groups > 0 && *gen_of(job, us) == job->weights_gen;
}

void sd_sec_load(struct sd_job *job, struct sd_unit_state *us)
{
    const struct sd_unit_layout *ul = &job->layout.units[us->unit];
    uint64_t len = piece_bytes(job, ul);
    uint8_t *slot = (uint8_t *)job->mem.pool.ptr + us->pool_off;
    uint32_t S = job->plan.sec, first = group_of(job, us) * S;
    uint64_t n = ul->numel / S, enc = sd_codec_bytes(SD_CODEC_INT8, n, job->plan.qblock);
    for (uint32_t j = 0; j < S; j++) {
        if (job->plan.qsec) {
            job->reg->dev->dequantize(job->mem.queue, slot + j * len, ul->dtype,
                                      piece(job, first + j, ul), SD_CODEC_INT8, n, job->plan.qblock,
                                      false);
            sd_job_count_coded(job, SD_OP_FETCH, first + j, us->lslot, len, enc);
            continue;
        }
        job->reg->dev->copy(job->mem.queue, slot + j * len, piece(job, first + j, ul), len);
        sd_job_count_copy(job, SD_OP_FETCH, first + j, us->lslot, len);
    }
    job->sec->loads++;
}

bool sd_sec_keep(struct sd_job *job, struct sd_unit_state *us)
{
    if (job->sec == NULL || job->sec->groups == 0 || *gen_of(job, us) == job->weights_gen)
        return false;
    const struct sd_unit_layout *ul = &job->layout.units[us->unit];
    uint64_t len = piece_bytes(job, ul);
    const uint8_t *slot = (const uint8_t *)job->mem.pool.ptr + us->pool_off;
    uint32_t S = job->plan.sec, first = group_of(job, us) * S;
    uint64_t n = ul->numel / S, enc = sd_codec_bytes(SD_CODEC_INT8, n, job->plan.qblock);
    for (uint32_t j = 0; j < S; j++) {
        if (job->plan.qsec) {
            job->reg->dev->quantize(job->mem.queue, piece(job, first + j, ul), SD_CODEC_INT8,
                                    slot + j * len, ul->dtype, n, job->plan.qblock);
            sd_job_count_coded(job, SD_OP_FETCH, us->lslot, first + j, len, enc);
            job->stats.quant_encodes++;
            continue;
        }
        job->reg->dev->copy(job->mem.queue, piece(job, first + j, ul), slot + j * len, len);
        sd_job_count_copy(job, SD_OP_FETCH, us->lslot, first + j, len);
    }
    *gen_of(job, us) = job->weights_gen;
    job->sec->stores++;
    SD_DEBUG("fetch", "job '%s': secondary copy of unit %u (group %u) refilled, generation %llu",
             job->name, us->unit, group_of(job, us), (unsigned long long)job->weights_gen);
    return true;
}

/* ---- its memory */

int sd_sec_setup(struct sd_job *job)
{
    uint32_t holders = sd_sec_holders(job), k = job->k;
    if (job->sec == NULL && (job->sec = calloc(1, sizeof(*job->sec))) == NULL)
        return SD_ENOMEM;
    if (holders == 0)
        return SD_OK;
    struct sd_sec_state *sc = job->sec;
    sc->groups = holders / job->plan.sec;
    size_t n_gen = (size_t)job->layout.n_units * sc->groups;
    sc->mem = calloc(k, sizeof(*sc->mem));
    sc->gen = malloc(n_gen * sizeof(*sc->gen));
    if (sc->mem == NULL || sc->gen == NULL)
        return SD_ENOMEM;
    for (uint32_t i = 0; i < k; i++)
        sc->mem[i].fd = -1;
    for (size_t i = 0; i < n_gen; i++)
        sc->gen[i] = UINT64_MAX; /* holds nothing yet */
    return SD_OK;
}

int sd_sec_alloc(struct sd_job *job, char *tag, size_t taglen)
{
    for (uint32_t r = 0; r < sd_sec_holders(job); r++) {
        snprintf(tag, taglen, "shardd-%s-r%u-sec", job->name, job->first_rank + r);
        int status = job->reg->dev->alloc(sd_job_rank_device(job, r), sd_sec_holder_bytes(job),
                                          SD_MEM_PRIVATE, tag, &job->sec->mem[r]);
        if (status != SD_OK)
            return status;
    }
    return SD_OK;
}

uint32_t sd_sec_hand_over(struct sd_job *job, struct sd_mem *out)
{
    if (job->sec == NULL || job->sec->mem == NULL || !job->reg->dev->host_memory)
        return 0;
    if (out == NULL)
        return job->k;
    for (uint32_t i = 0; i < job->k; i++) {
        out[i] = job->sec->mem[i];
        job->sec->mem[i] = (struct sd_mem){.fd = -1};
    }
    return job->k;
}

void sd_sec_free(struct sd_job *job)
{
    struct sd_sec_state *sc = job->sec;
    if (sc == NULL)
        return;
    for (uint32_t i = 0; sc->mem != NULL && i < job->k; i++)
        job->reg->dev->free(&sc->mem[i]);
    free(sc->mem);
    free(sc->gen);
    sc->mem = NULL;
    sc->gen = NULL;
    sc->groups = 0;
}

void sd_sec_destroy(struct sd_job *job)
{
    sd_sec_free(job);
    free(job->sec);
    job->sec = NULL;
}

void sd_sec_counts(const struct sd_job *job, uint64_t *loads_p, uint64_t *stores_p)
{
    *loads_p = job->sec != NULL ? job->sec->loads : 0;
    *stores_p = job->sec != NULL ? job->sec->stores : 0;
}

const struct sd_job_module sd_sec_module = {
    .name = "secondary", .destroy = sd_sec_destroy, .alloc = sd_sec_setup, .release = sd_sec_free};

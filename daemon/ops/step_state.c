/* The step's state (step_int.h): allocated with the job and its memory, and the step's
 * arguments (shard_step_ex): each rank's hyperparameters and tensors with a gradient, checked
 * and compared, and global rank 0's broadcast, carried in the norm parts. */
#include "hop.h"
#include "optimizer.h"
#include "step.h"
#include "step_int.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the state */

int sd_step_create(struct sd_job *job)
{
    uint32_t k = job->k;
    struct sd_step_state *st = calloc(1, sizeof(*st));
    job->step = st;
    if (st == NULL)
        return SD_ENOMEM;
    return sd_barrier_init(&st->bar, k);
}

int sd_step_alloc(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    uint32_t k = job->k, n_groups = sd_model_groups(&job->model);
    const struct sd_layout *l = &job->layout;
    st->sumsq_parts = calloc((size_t)l->n_units * k, sizeof(*st->sumsq_parts));
    st->used_words = (l->n_tensors + 63) / 64;
    st->bcast_at = sizeof(struct sd_norm_part) +
                   (job->model.skip_unused ? st->used_words * sizeof(uint64_t) : 0);
    st->norm_stride = st->bcast_at + (job->model.bcast_bytes + 7) / 8 * 8;
    st->norm_buf = calloc(job->nodes, st->norm_stride);
    st->arg_flags = calloc(k, sizeof(*st->arg_flags));
    st->rank_scale = calloc(k, sizeof(*st->rank_scale));
    st->hp_next = calloc(n_groups, sizeof(*st->hp_next));
    st->used = calloc(st->used_words, sizeof(*st->used));
    st->hop_final = calloc(l->n_units, sizeof(*st->hop_final));
    if (!st->sumsq_parts || !st->norm_buf || !st->arg_flags || !st->hp_next || !st->used ||
        !st->hop_final || !st->rank_scale)
        return SD_ENOMEM;
    return sd_hop_alloc(job);
}

void sd_step_free(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    if (st == NULL)
        return;
    free(st->sumsq_parts);
    free(st->norm_buf);
    free(st->arg_flags);
    free(st->rank_scale);
    st->rank_scale = NULL;
    free(st->hp_next);
    free(st->used);
    free(st->hop_final);
    st->hop_final = NULL;
    sd_hop_free(job);
    st->sumsq_parts = NULL;
    st->norm_buf = NULL;
    st->arg_flags = NULL;
    st->hp_next = NULL;
    st->used = NULL;
}

void sd_step_destroy(struct sd_job *job)
{
    struct sd_step_state *st = job->step;
    if (st == NULL)
        return;
    sd_step_free(job);
    sd_barrier_fini(&st->bar);
    free(st);
    job->step = NULL;
}

void *sd_step_net_buf(const struct sd_job *job, size_t *bytes_p)
{
    *bytes_p = job->nodes * job->step->norm_stride;
    return job->step->norm_buf;
}

/* ---- the step's arguments (shard_step_ex) */

static uint32_t hparams_hash(const struct sd_hparams *h, uint32_t n)
{
    uint32_t x = (uint32_t)sd_hash_bytes(SD_FNV_SEED, h, (size_t)n * sizeof(*h));
    return x == SD_HP_REFUSED ? 0 : x;
}

static void args_refuse(struct sd_job *job, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void args_refuse(struct sd_job *job, int status, const char *fmt, ...)
{
    if (job->step->arg_status != SD_OK)
        return; /* the first reason */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(job->step->arg_msg, sizeof(job->step->arg_msg), fmt, ap);
    va_end(ap);
    job->step->arg_status = status;
}

/* Local rank r's step arguments: its hyperparameters (checked, then compared with hp, the first
 * rank's, or taken as them when hp_set is false) and its tensors with a gradient, ORed into used
 * (NULL without skip_unused). The arguments are in memory the client writes: what is checked is
 * copied first. */
static void args_of_rank(struct sd_job *job, uint32_t r, bool *hp_set, uint64_t *used)
{
    uint32_t n_groups = sd_model_groups(&job->model), T = job->layout.n_tensors;
    uint32_t flags = job->step->arg_flags[r], rank = job->first_rank + r;
    const uint8_t *area = sd_job_control(job, r, job->mem.step_args_off);
    struct sd_step_args hdr;
    memcpy(&hdr, area, sizeof(hdr));
    /* (a loss scale rides in the ring entry, not in the area) */
    if ((flags & ~SD_STEP_ARG_SCALED) != 0 && (hdr.n_groups != n_groups || hdr.n_tensors != T)) {
        args_refuse(job, SD_EINVAL,
                    "rank %u's step arguments are for %u groups and %u tensors; the job has %u "
                    "and %u",
                    rank, hdr.n_groups, hdr.n_tensors, n_groups, T);
        return;
    }
    const struct sd_hparams *src = (const struct sd_hparams *)(const void *)(area + sizeof(hdr));
    if (flags & SD_STEP_ARG_HPARAMS) {
        for (uint32_t g = 0; g < n_groups; g++) {
            struct sd_hparams h;
            memcpy(&h, &src[g], sizeof(h));
            char err[128];
            if (sd_hparams_validate(job->model.optim.kind, &h, g, err, sizeof(err)) != SD_OK) {
                args_refuse(job, SD_EINVAL, "rank %u: %s", rank, err);
                return;
            }
            if (!*hp_set) {
                job->step->hp_next[g] = h;
            } else if (memcmp(&h, &job->step->hp_next[g], sizeof(h)) != 0) {
                args_refuse(job, SD_EMISMATCH,
                            "rank %u's hyperparameters of group %u (lr %g, weight_decay %g) differ "
                            "from rank %u's (lr %g, weight_decay %g): every rank must give the "
                            "same",
                            rank, g, (double)h.lr, (double)h.weight_decay, job->first_rank,
                            (double)job->step->hp_next[g].lr,
                            (double)job->step->hp_next[g].weight_decay);
                return;
            }
        }
    } else if (*hp_set && memcmp(job->step->hp_next, sd_optim_hparams(job),
                                 n_groups * sizeof(*job->step->hp_next)) != 0) {
        args_refuse(job, SD_EMISMATCH,
                    "rank %u gave no hyperparameters (the last step's), rank %u new ones: every "
                    "rank must give the same",
                    rank, job->first_rank);
        return;
    }
    double scale = job->step->rank_scale[rank - job->first_rank];
    if (scale != job->step->rank_scale[0]) {
        args_refuse(job, SD_EMISMATCH,
                    "rank %u's loss scale (%g) differs from rank %u's (%g; 1: none): every rank "
                    "must give the same",
                    rank, scale, job->first_rank, job->step->rank_scale[0]);
        return;
    }
    if ((flags ^ job->step->arg_flags[0]) & SD_STEP_ARG_BCAST) {
        args_refuse(job, SD_EMISMATCH,
                    "rank %u %s buffers to broadcast and rank %u %s: every rank must give them, "
                    "or none",
                    rank, (flags & SD_STEP_ARG_BCAST) ? "gave" : "gave no", job->first_rank,
                    (flags & SD_STEP_ARG_BCAST) ? "did not" : "did");
        return;
    }
    *hp_set = true;
    if (used == NULL)
        return;
    if (!(flags & SD_STEP_ARG_HAS_GRAD)) { /* every tensor */
        memset(used, 0xff, job->step->used_words * sizeof(*used));
        return;
    }
    const uint8_t *has = area + sizeof(hdr) + (size_t)n_groups * sizeof(struct sd_hparams);
    for (uint32_t t = 0; t < T; t++)
        if (has[t] != 0)
            used[t / 64] |= 1ull << (t % 64);
}

/* local rank r's broadcast area in its control page */
static uint8_t *bcast_area(struct sd_job *job, uint32_t r)
{
    return sd_job_control(
        job, r,
        job->mem.step_args_off +
            sd_step_args_bcast_off(sd_model_groups(&job->model), job->layout.n_tensors));
}

void sd_step__args_collect(struct sd_job *job)
{
    uint32_t n_groups = sd_model_groups(&job->model);
    struct sd_norm_part *me = sd_step__part(job, job->node);
    uint64_t *used = job->model.skip_unused ? sd_step__used_at(job, job->node) : NULL;
    job->step->arg_status = SD_OK;
    job->step->arg_msg[0] = '\0';
    memcpy(job->step->hp_next, sd_optim_hparams(job), n_groups * sizeof(*job->step->hp_next));
    if (used != NULL)
        memset(used, 0, job->step->used_words * sizeof(*used));
    bool hp_set = false;
    for (uint32_t r = 0; r < job->k && job->step->arg_status == SD_OK; r++)
        args_of_rank(job, r, &hp_set, used);
    bool bcast = (job->step->arg_flags[0] & SD_STEP_ARG_BCAST) != 0;
    uint64_t sbits;
    memcpy(&sbits, &job->step->rank_scale[0], sizeof(sbits));
    /* whether the ranks broadcast, and their loss scale, are compared across nodes with the
     * hyperparameters */
    me->hparams = job->step->arg_status != SD_OK
                      ? SD_HP_REFUSED
                      : hparams_hash(job->step->hp_next, n_groups) ^ (bcast ? 0x5bd1e995u : 0) ^
                            (uint32_t)(sbits ^ sbits >> 32) * 0x9e3779b1u;
    if (bcast && job->first_rank == 0) /* global rank 0's bytes go out in node 0's part */
        memcpy((uint8_t *)me + job->step->bcast_at, bcast_area(job, 0), job->model.bcast_bytes);
}

void sd_step__bcast_deliver(struct sd_job *job)
{
    if (!(job->step->arg_flags[0] & SD_STEP_ARG_BCAST))
        return;
    const uint8_t *src = (const uint8_t *)sd_step__part(job, 0) + job->step->bcast_at;
    for (uint32_t r = 0; r < job->k; r++)
        if (job->first_rank + r != 0)
            memcpy(bcast_area(job, r), src, job->model.bcast_bytes);
    job->stats.bcast_bytes += job->model.bcast_bytes;
}

bool sd_step__args_agree(struct sd_job *job, int *status_p, char *msg, size_t len)
{
    uint32_t mine = sd_step__part(job, job->node)->hparams;
    unsigned long long step = (unsigned long long)job->steps + 1;
    *status_p = SD_EMISMATCH;
    if (job->step->arg_status != SD_OK) {
        *status_p = job->step->arg_status;
        snprintf(msg, len, "step %llu refused: %s", step, job->step->arg_msg);
        return false;
    }
    uint32_t m = 0;
    while (m < job->nodes && sd_step__part(job, m)->hparams == mine)
        m++;
    if (m == job->nodes)
        return true;
    if (sd_step__part(job, m)->hparams == SD_HP_REFUSED)
        snprintf(msg, len,
                 "step %llu refused: node %u refused its ranks' step arguments (ranks that gave "
                 "other hyperparameters than the rest, or invalid ones; its log says which)",
                 step, m);
    else
        snprintf(msg, len,
                 "step %llu refused: the ranks of node %u gave other hyperparameters than those "
                 "of node %u: every rank must give the same",
                 step, m, job->node);
    return false;
}

const uint64_t *sd_step__used(struct sd_job *job)
{
    if (!job->model.skip_unused)
        return NULL;
    memset(job->step->used, 0, job->step->used_words * sizeof(*job->step->used));
    for (uint32_t m = 0; m < job->nodes; m++) {
        const uint64_t *u = sd_step__used_at(job, m);
        for (uint32_t i = 0; i < job->step->used_words; i++)
            job->step->used[i] |= u[i];
    }
    return job->step->used;
}

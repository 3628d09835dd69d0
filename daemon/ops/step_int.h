/* step.c and step_state.c: the step's state. Nothing else of the daemon sees it: the other
 * modules call step.h, and the step hears of their completions through sd_step_notify. */
#ifndef SD_STEP_INT_H
#define SD_STEP_INT_H

#include "schedule.h"
#include "barrier.h"
#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum sd_step_phase {
    SD_STEP_IDLE,
    SD_STEP_SYNC,
    SD_STEP_SUMS, /* the sums of squares the device took, read once its queue reached them */
    SD_STEP_NORM,
    SD_STEP_APPLY,
    SD_STEP_TRAINER, /* a trainer optimizer's hand-off: the ranks' updates awaited */
    SD_STEP_WEIGHTS,
    SD_STEP_NEWGEN, /* the new weights, declared once the device wrote them */
    SD_STEP_REFRESH
};

/* The barrier of the local ranks, then the phases across nodes. */
struct sd_step_state {
    struct sd_barrier bar; /* the local ranks' step calls */
    enum sd_step_phase phase;
    /* the phase waits for the job's queue to reach q_ticket (the kernels the phase before
     * enqueued): the loop polls it (sd_step_queue_poll), never blocking on the device */
    bool q_wait;
    uint64_t q_ticket;
    uint32_t unit, pending; /* the unit a phase is at; its transfers in flight */
    bool encoded;           /* WEIGHTS with ,qw: the unit's parts are encoded (enqueued) */
    uint64_t start_ns, handoff_ns;
    int status; /* the first failed transfer of the phase, and its peer */
    uint32_t suspect;
    struct sd_allreduce ar;
    /* [nodes] norm parts of norm_stride bytes: struct sd_norm_part, then with skip_unused the
     * node's tensors that had a gradient (a bit each, norm_used), then at bcast_at the model's
     * bcast_bytes (node 0's: global rank 0's broadcast; the others' unused) */
    uint8_t *norm_buf;
    size_t norm_stride, bcast_at;
    uint32_t *arg_flags; /* [k]: which step arguments each rank wrote (SD_STEP_ARG_*) */
    /* [k]: each rank's loss scale (SD_STEP_ARG_SCALED), else 1; the step's is rank 0's once
     * sd_step__args_collect found them equal */
    double *rank_scale;
    struct sd_hparams *hp_next; /* [n_groups]: this step's hyperparameters (the local ranks') */
    int arg_status;             /* SD_OK, or why the local ranks' arguments were refused */
    char arg_msg[160];
    uint64_t *used; /* [used_words]: tensors some rank gave a gradient in this step */
    uint32_t used_words;
    double *sumsq_parts; /* [n_units * k]: the device's sums of squares, added up in order */
    /* the boundary hop (hop.c): units whose all-reduce ended this step (in the hop order), which
     * units are final (SD_JOB_EV_UNIT_FINAL); hops that went before the step's SYNC, in all */
    uint32_t hop_done;
    bool *hop_final;
    uint64_t early_hops;
    /* where the hop's block is owned (sd_plan_hop_owned): [slots * pieces] each piece's place
     * in the packed block, in pieces of numel / f_os (hop.c); NULL otherwise. hop_scatter: it
     * reduce-scatters (sd_plan_hop_scatters) */
    uint32_t *hop_perm;
    uint32_t hop_pieces; /* pieces of a g shard: f_os / f_g */
    bool hop_scatter;
};

/* node m's part of the norm exchange, and the tensors that had a gradient there */
static inline struct sd_norm_part *sd_step__part(struct sd_job *job, uint32_t m)
{
    return (struct sd_norm_part *)(void *)(job->step->norm_buf +
                                           (size_t)m * job->step->norm_stride);
}
static inline uint64_t *sd_step__used_at(struct sd_job *job, uint32_t m)
{
    return (uint64_t *)(void *)((uint8_t *)sd_step__part(job, m) + sizeof(struct sd_norm_part));
}

/* step.c: the step fails with a transfer's status, naming the peer suspected (hop.c's too) */
void sd_step__fail(struct sd_job *job, int status, uint32_t suspect);

/* ---- step_state.c: the step's arguments (shard_step_ex) */
/* The local ranks' step arguments, once every one called step: this node's hyperparameters of
 * the step (hp_next) and their hash, and its tensors with a gradient, into its norm part. */
void sd_step__args_collect(struct sd_job *job);
/* Every rank but global rank 0 gets its bytes (node 0's part, exchanged with the norm). */
void sd_step__bcast_deliver(struct sd_job *job);
/* Did every node's ranks give the same, valid hyperparameters? Else false with the status and
 * text the step is refused with on every node. */
bool sd_step__args_agree(struct sd_job *job, int *status_p, char *msg, size_t len);
/* the tensors some rank of any node gave a gradient in this step, or NULL: every tensor */
const uint64_t *sd_step__used(struct sd_job *job);

#endif

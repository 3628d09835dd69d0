/* What every operation module does for the job's common paths. The job's core (job.c) and its
 * life (job_life.c) walk the modules in a fixed order to create their states with the job and
 * give them back with it, to allocate their bookkeeping with the job's memory and release it, to
 * stop them and complete the calls they parked when the job fails or pauses, to check their
 * deadlines, to ask what is in flight, and to hand them the completions other modules raise
 * (sd_job_event), so no walk reads another module's state, no module pokes another, and the
 * job's core, below the modules, includes none of their headers. */
#ifndef SD_JOB_MODULE_H
#define SD_JOB_MODULE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_job;

/* Completions a module raises for whichever module waits for them (the step's phases do). */
enum sd_job_event {
    SD_JOB_EV_PUSHED,     /* push rounds retired (push.c) */
    SD_JOB_EV_ANSWERED,   /* fetches answered once the device wrote their slots (fetch.c) */
    SD_JOB_EV_TRANSFERS,  /* a gather's transfers completed, freeing their resources (fetch.c) */
    SD_JOB_EV_W_SENT,     /* a send of this node's weights to a peer completed (fetch.c) */
    SD_JOB_EV_OS_FREE,    /* a checkpoint's worker left the os shards (checkpoint.c) */
    SD_JOB_EV_EXCHANGED,  /* a transfer of the weights' exchange ended, status, peer (weights.c) */
    SD_JOB_EV_STEP_OVER,  /* the step's calls were answered (step.c): a pause waiting for the
                           * step's end (a rank died in it) happens now */
    SD_JOB_EV_LET_GO,     /* a module that kept the job's state let it go (resume.c): a job
                           * whose ranks all left retires (job_life.c) */
    SD_JOB_EV_OPENED,     /* the checkpoint the job loads was opened, status and text
                           * (ckpt_load.c): its registration goes on or is refused (job_life.c,
                           * which may free the job: nothing touches it after this event) */
    SD_JOB_EV_UNIT_FINAL, /* unit's gradient of this step is final on this node: every local
                           * push of its last rounds was marked the last (push.c, SD_PUSH_LAST);
                           * its boundary hop may go (hop.c) */
};

/* An event, with the status and the peer (job node) of a transfer's end where it has them. */
struct sd_job_ev {
    enum sd_job_event kind;
    int status;       /* SD_OK when it has none */
    uint32_t peer;    /* UINT32_MAX when it has none */
    const char *text; /* why, with an error status; NULL when it has none */
    uint32_t unit;    /* the unit it is about, UINT32_MAX when none */
};

struct sd_job_module {
    const char *name;
    /* Its state, at registration once the plan and layout are known: SD_OK, or an error (the
     * registration fails). destroy gives it back with the job, also after a failed or missing
     * create. NULL: none. */
    int (*create)(struct sd_job *job);
    void (*destroy)(struct sd_job *job);
    /* Its bookkeeping with the job's memory (job_mem.c): SD_OK or SD_ENOMEM. release gives it
     * back when the memory goes, keeping what shardctl reads. NULL: none. */
    int (*alloc)(struct sd_job *job);
    void (*release)(struct sd_job *job);
    /* Complete every call this module parked with status and text (already "job 'x' failed:
     * ..."). with_fetches: ranks waiting for an in-flight gather too (not when the gather's own
     * completion will answer them). NULL: it parks nothing. */
    void (*fail_parked)(struct sd_job *job, int status, const char *text, bool with_fetches);
    /* A call of this module waiting past op_timeout (ns) fails the job naming what it waits
     * for: true then (the walk stops), else false. NULL: it has no deadlines. */
    bool (*sweep)(struct sd_job *job, uint64_t now, uint64_t op_timeout);
    /* The job failed (its state FAILED now; was before): stop what goes on, note what the
     * failure means for this module. NULL: nothing to stop. */
    void (*failing)(struct sd_job *job, int was);
    /* Is an operation of this module in flight (across nodes: what a failure message and the
     * transfers' deadline name)? Then true, what it is in what (len bytes, "push of unit 3
     * (micro-step 5; last completed 4)") and since when in *since_ns (0: no deadline of its own:
     * loading waits for no node in particular). NULL: it has none. */
    bool (*activity)(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns);
    /* Another module raised ev: go on if this one waited for it (then true). NULL: it waits for
     * none. */
    bool (*event)(struct sd_job *job, const struct sd_job_ev *ev);
    /* Does a worker of this module use the job's shards off the loop now (a checkpoint's, saving
     * or loading)? The shards' other users (the optimizer, a resumed job taking them over, the
     * ready barrier's deadline) wait for its SD_JOB_EV_OS_FREE. NULL: it has none. */
    bool (*shards_busy)(const struct sd_job *job);
    /* Does this module give the job its values instead of rank 0's initial ones (a checkpoint it
     * loads, a paused job's state it takes over)? What it does, for messages ("loading a
     * checkpoint"), else NULL. NULL: it never does. */
    const char *(*gives_values)(const struct sd_job *job);
    /* Does this module still read the job's state once its trainers are gone (a recovery writing
     * a checkpoint from it)? Why, for messages, else NULL: the state must not go meanwhile.
     * NULL: it never does. */
    const char *(*needs_state)(const struct sd_job *job);
    /* Does this module wait for the job's device queue to pass a ticket it recorded (the loop
     * polls for it, never blocking on the device)? queue_poll goes on with what the queue
     * passed: true if something moved. NULL: it never waits for the queue. */
    bool (*queue_waiting)(const struct sd_job *job);
    bool (*queue_poll)(struct sd_job *job);
};

/* each module's, defined in its own file */
extern const struct sd_job_module sd_optim_module;    /* optimizer.c: its bookkeeping */
extern const struct sd_job_module sd_sched_module;    /* schedule.c: the schedule */
extern const struct sd_job_module sd_sec_module;      /* secondary.c: the secondary copies */
extern const struct sd_job_module sd_quant_module;    /* quant.c: the quantized buffers */
extern const struct sd_job_module sd_push_module;     /* push.c: push rounds */
extern const struct sd_job_module sd_fetch_module;    /* fetch.c: ranks waiting for a gather */
extern const struct sd_job_module sd_loading_module;  /* loading.c: init and the ready barrier */
extern const struct sd_job_module sd_values_module;   /* values.c: writes and reads, running */
extern const struct sd_job_module sd_step_module;     /* step.c: the step barrier */
extern const struct sd_job_module sd_dispatch_module; /* dispatch.c: stalled ring entries */
extern const struct sd_job_module sd_ckpt_module;     /* checkpoint.c: saves and loads */
extern const struct sd_job_module sd_resume_module;   /* resume.c: a pause at the step's end */
extern const struct sd_job_module sd_life_module;     /* job_life.c: retiring, opening */
extern const struct sd_job_module sd_net_module;      /* job_net.c: transfers across nodes */

/* Hand ev to the modules (job.c): true if one waited for it. */
bool sd_job_event(struct sd_job *job, enum sd_job_event ev);
/* The same for a transfer that ended with status, with peer (job node). */
bool sd_job_event_ended(struct sd_job *job, enum sd_job_event ev, int status, uint32_t peer);
/* The same about a unit. */
bool sd_job_event_unit(struct sd_job *job, enum sd_job_event ev, uint32_t unit);
/* The same with status and text (an error's why). */
bool sd_job_event_text(struct sd_job *job, enum sd_job_event ev, int status, const char *text);
/* The operation in flight (the modules' activity, in the order step, push, fetch, loading):
 * false when none is. */
bool sd_job_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns);
/* Does a module's worker use the job's shards now (job.c)? */
bool sd_job_shards_busy(const struct sd_job *job);
/* Why a module still reads the job's state (job.c), or NULL: it may go. */
const char *sd_job_state_needed(const struct sd_job *job);
/* Where the job's values come from when not from rank 0 (job.c): the module's words, or NULL. */
const char *sd_job_values_from(const struct sd_job *job);
/* The ranks (global numbers) whose present[local] is false, "3, 5" (job.c). */
void sd_job_missing_ranks(const struct sd_job *job, const bool *present, char *out, size_t len);

#endif

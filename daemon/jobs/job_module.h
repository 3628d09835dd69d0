/* What every operation module does for the job's common paths. job.c walks the modules in a
 * fixed order to create their states with the job and give them back with it, to allocate their
 * bookkeeping with the job's memory and release it, to complete the calls they parked when the
 * job fails or pauses, to check their deadlines, and to hand them the completions other modules
 * raise (sd_job_event), so no walk reads another module's state and no module pokes another. */
#ifndef SD_JOB_MODULE_H
#define SD_JOB_MODULE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_job;

/* Completions a module raises for whichever module waits for them (the step's phases do). */
enum sd_job_event {
    SD_JOB_EV_PUSHED,    /* push rounds retired (push.c) */
    SD_JOB_EV_ANSWERED,  /* fetches answered once the device wrote their slots (fetch.c) */
    SD_JOB_EV_TRANSFERS, /* a gather's transfers completed, freeing their resources (fetch.c) */
    SD_JOB_EV_W_SENT,    /* a send of this node's weights to a peer completed (fetch.c) */
    SD_JOB_EV_OS_FREE,   /* a checkpoint's worker left the os shards (checkpoint.c) */
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
    /* Another module raised ev: go on if this one waited for it (then true). NULL: it waits for
     * none. */
    bool (*event)(struct sd_job *job, enum sd_job_event ev);
};

/* each module's, defined in its own file */
extern const struct sd_job_module sd_optim_module;    /* optimizer.c: its bookkeeping */
extern const struct sd_job_module sd_sched_module;    /* schedule.c: the schedule */
extern const struct sd_job_module sd_sec_module;      /* secondary.c: the secondary copies */
extern const struct sd_job_module sd_quant_module;    /* quant.c: the quantized buffers */
extern const struct sd_job_module sd_push_module;     /* push.c: push rounds */
extern const struct sd_job_module sd_fetch_module;    /* fetch.c: ranks waiting for a gather */
extern const struct sd_job_module sd_loading_module;  /* loading.c: init and the ready barrier */
extern const struct sd_job_module sd_step_module;     /* step.c: the step barrier */
extern const struct sd_job_module sd_dispatch_module; /* dispatch.c: stalled ring entries */
extern const struct sd_job_module sd_ckpt_module;     /* checkpoint.c: saves and loads */

/* Every module's bookkeeping with the job's memory (job.c, for job_mem.c): SD_OK or the first
 * error; release gives back every module's. */
int sd_job_modules_alloc(struct sd_job *job);
void sd_job_modules_release(struct sd_job *job);
/* Hand ev to the modules (job.c): true if one waited for it. */
bool sd_job_event(struct sd_job *job, enum sd_job_event ev);
/* The ranks (global numbers) whose present[local] is false, "3, 5" (job.c). */
void sd_job_missing_ranks(const struct sd_job *job, const bool *present, char *out, size_t len);

#endif

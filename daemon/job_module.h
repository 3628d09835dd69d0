/* What every operation module does for the job's common paths. job.c walks the modules in a
 * fixed order (sd_job_modules) to complete the calls they parked when the job fails or pauses,
 * and to check their deadlines, so neither walk reads another module's state. */
#ifndef SD_JOB_MODULE_H
#define SD_JOB_MODULE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_job;

struct sd_job_module {
    const char *name;
    /* Complete every call this module parked with status and text (already "job 'x' failed:
     * ..."). with_fetches: ranks waiting for an in-flight gather too (not when the gather's own
     * completion will answer them). NULL: it parks nothing. */
    void (*fail_parked)(struct sd_job *job, int status, const char *text, bool with_fetches);
    /* A call of this module waiting past op_timeout (ns) fails the job naming what it waits
     * for: true then (the walk stops), else false. NULL: it has no deadlines. */
    bool (*sweep)(struct sd_job *job, uint64_t now, uint64_t op_timeout);
};

/* each module's, defined in its own file */
extern const struct sd_job_module sd_push_module;     /* push.c: push rounds */
extern const struct sd_job_module sd_fetch_module;    /* fetch.c: ranks waiting for a gather */
extern const struct sd_job_module sd_loading_module;  /* loading.c: init and the ready barrier */
extern const struct sd_job_module sd_step_module;     /* step.c: the step barrier */
extern const struct sd_job_module sd_dispatch_module; /* dispatch.c: stalled ring entries */
extern const struct sd_job_module sd_ckpt_module;     /* checkpoint.c: saves and loads */

/* The ranks (global numbers) whose present[local] is false, "3, 5" (job.c). */
void sd_job_missing_ranks(const struct sd_job *job, const bool *present, char *out, size_t len);

#endif

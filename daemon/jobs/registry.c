/* The job registry: the daemon's jobs in their lists, looked up by transport tag, and the
 * memory budget. What happens to the jobs as a whole (the sweep, the cluster's events,
 * shutdown) is jobs.c's. */
#include "job.h"
#include "registry.h"
#include "sd/util.h"
#include <string.h>
#include <unistd.h>

void sd_registry_init(struct sd_registry *reg, const struct sd_config *cfg,
                      const struct sd_gpu_ops *dev)
{
    memset(reg, 0, sizeof(*reg));
    reg->cfg = cfg;
    reg->dev = dev;
    reg->budget = cfg->memory_budget;
    if (reg->budget == 0) { /* default: half of physical memory */
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        reg->budget = pages > 0 && psz > 0 ? (uint64_t)pages * (uint64_t)psz / 2 : (1ULL << 32);
    }
}

struct sd_job *sd_registry_find_tag(struct sd_registry *reg, uint32_t tag)
{
    struct sd_job *lists[2] = {reg->jobs, reg->zombies};
    for (int i = 0; i < 2; i++)
        for (struct sd_job *j = lists[i]; j; j = j->next)
            if (j->nodes > 1 && j->xfer.tag == tag && j->xfer.tag != 0)
                return j;
    return NULL;
}

/* ---- the list of jobs */

void sd_registry_link(struct sd_registry *reg, struct sd_job *job)
{
    job->next = reg->jobs;
    reg->jobs = job;
    reg->n_jobs++;
}

void sd_registry_unlink(struct sd_registry *reg, struct sd_job *job)
{
    for (struct sd_job **pp = &reg->jobs; *pp; pp = &(*pp)->next)
        if (*pp == job) {
            *pp = job->next;
            reg->n_jobs--;
            return;
        }
}

void sd_registry_add_retiring(struct sd_registry *reg, struct sd_job *job)
{
    job->next = reg->zombies;
    reg->zombies = job;
}

struct sd_job *sd_registry_add_finished(struct sd_registry *reg, struct sd_job *job)
{
    job->next = reg->finished;
    reg->finished = job;
    job->stats.ended_ns = sd_now_ns();
    if (++reg->n_finished <= SD_FINISHED_JOBS_KEPT)
        return NULL;
    struct sd_job **pp = &reg->finished;
    while ((*pp)->next != NULL)
        pp = &(*pp)->next;
    struct sd_job *oldest = *pp;
    *pp = NULL;
    reg->n_finished--;
    return oldest;
}

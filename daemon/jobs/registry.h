/* The job registry: the jobs this daemon serves (active, retiring while transfers drain, and
 * recently ended ones kept for shardctl), the memory budget, and lookups by transport tag. What
 * happens to the jobs as a whole is jobs.h's. */
#ifndef SD_REGISTRY_H
#define SD_REGISTRY_H

#include "sd/config.h"
#include "sd/gpu.h"

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

struct sd_job;
struct sd_file_pool;
struct sd_net;
struct sd_cluster;
struct sd_cluster_events;
struct sd_sched_driver;
struct sd_session;
struct sd_sqe;
struct sd_transport;
struct Shard__Register;

#define SD_FINISHED_JOBS_KEPT 16
/* at shutdown, file tasks (checkpoints) are waited for this long before the daemon exits
 * without them */
#define SD_FILE_STOP_WAIT_MS 5000

struct sd_registry {
    struct sd_job *jobs; /* active */
    uint32_t n_jobs;
    struct sd_job *zombies;  /* ended, waiting for their transfers to drain before freeing */
    struct sd_job *finished; /* the most recent ended jobs, newest first, memory freed */
    uint32_t n_finished;
    uint64_t budget, used;
    uint64_t next_job_id;
    const struct sd_config *cfg;
    const struct sd_gpu_ops *dev;
    struct sd_net *net;
    /* the control plane, as the network service has it (sd_net_cluster): NULL on a single node
     * or before it started */
    struct sd_cluster *cluster;
    uv_loop_t *loop;                /* for allocating off the loop; NULL: allocate in place */
    struct sd_recovery *recovery;   /* node 0: the checkpoint being written from replicas */
    struct sd_file_pool *files;     /* the jobs' file work (checkpoints), as their owners */
    uint32_t stuck_jobs;            /* at shutdown: jobs left to file tasks that did not end */
    uint64_t recoveries;            /* started (their save numbers) */
    struct sd_waiting_reg *waiting; /* registrations waiting for a job of their name to go */
    uint64_t waiting_round;         /* (register.c) */
    /* the GPU (the backend's device index) local rank i of every job uses: rank_dev[i mod
     * n_rank_dev] (config devices; main.c fills it once the backend is open) */
    int rank_dev[SD_CONFIG_MAX_DEVICES];
    uint32_t n_rank_dev;
    /* the operations the schedule drives (schedule.h: fetch's and the step's, bound by main.c) */
    const struct sd_sched_driver *sched_driver;
    /* open the fabric and the control plane (main.c): an independent daemon's, when a job first
     * spans nodes; SD_OK, or err says why not */
    int (*open_fabric)(struct sd_registry *reg, char *err, size_t errlen);
    uint32_t fabric_closes; /* an independent daemon's fabric closed with no job (main.c) */
};

/* the device local rank `local` of a job uses */
static inline int sd_registry_rank_device(const struct sd_registry *reg, uint32_t local)
{
    return reg->n_rank_dev > 0 ? reg->rank_dev[local % reg->n_rank_dev] : 0;
}

void sd_registry_init(struct sd_registry *reg, const struct sd_config *cfg,
                      const struct sd_gpu_ops *dev);
/* Active or retiring job spanning nodes by its transport tag. */
struct sd_job *sd_registry_find_tag(struct sd_registry *reg, uint32_t tag);
/* A job was added (it is already linked) or unlinked. */
void sd_registry_link(struct sd_registry *reg, struct sd_job *job);
void sd_registry_unlink(struct sd_registry *reg, struct sd_job *job);
/* An ended job whose transfers still run: kept until they drain, then buried. */
void sd_registry_add_retiring(struct sd_registry *reg, struct sd_job *job);
/* An ended job, memory freed: kept for shardctl. Returns the oldest beyond
 * SD_FINISHED_JOBS_KEPT, unlinked, for the caller to free, else NULL. */
struct sd_job *sd_registry_add_finished(struct sd_registry *reg, struct sd_job *job);

#endif

/* The file pool: threads of their own that do the jobs' file work (checkpoints), each task with
 * the filesystem identity of the job's owner (sd/fsid.h), never the daemon's.
 *
 * A task's work that splits into items (a save's chunks, a load's shards) is shared with idle
 * workers (sd_file_pool_parallel): the pool is the only place the daemon's file work runs.
 *
 * Kept apart from libuv's thread pool, which allocates and frees job memory for registrations:
 * a task stuck in a filesystem (a hung NFS mount) holds one of these threads, never one that a
 * registration needs. A uid has at most half of the threads (at least one) at a time, so one
 * user's stuck tasks leave threads to the others. The loop never waits for a task: its owner
 * sets a deadline of its own, and the task's end comes to the loop by an async handle. */
#ifndef SD_FILE_POOL_H
#define SD_FILE_POOL_H

#include "sd/fsid.h"

#include <jansson.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

struct sd_file_pool;

struct sd_file_task {
    /* the caller's */
    struct sd_fsid id;                  /* whose rights fn runs with */
    void (*fn)(struct sd_file_task *t); /* on a pool thread, under id */
    /* on the loop once fn returned (status SD_OK), or instead of it: SD_EPERM (the daemon
     * cannot take id), SD_ECANCELED (the pool stops) */
    void (*after)(struct sd_file_task *t, int status);
    void *arg;
    /* the pool's */
    struct sd_file_task *next;
    uint64_t queued_ns;
    _Atomic uint64_t started_ns; /* 0 until a thread took it */
    int status;
};

/* threads: how many (1..64) */
int sd_file_pool_start(struct sd_file_pool **pool_p, uv_loop_t *loop, uint32_t threads);
/* Queue t (its fn, after, id and arg set); after comes on the loop, always. */
void sd_file_pool_submit(struct sd_file_pool *pool, struct sd_file_task *t);
/* Stop: queued tasks get after(SD_ECANCELED), finished ones their after, and the tasks still
 * running are waited for up to wait_ms. Returns how many are still running (stuck in a
 * filesystem): their threads are left to the process's exit, their after never comes, and the
 * pool's memory stays with them. */
uint32_t sd_file_pool_stop(struct sd_file_pool *pool, uint64_t wait_ms);
/* fn(arg, thread, i) for every i in [0, n), from a task running on pool (its fn): the task's
 * thread takes part (thread 0), and idle workers help, up to `threads` in all (thread in
 * [0, threads): per-thread state), each under the task's identity and counted in its uid's
 * share. Returns once every item ran. Off the pool (or pool NULL): on the calling thread. */
void sd_file_pool_parallel(struct sd_file_pool *pool, uint32_t threads, uint64_t n,
                           void (*fn)(void *arg, uint32_t thread, uint64_t i), void *arg);
/* shardctl status: threads, running, queued, the longest-running task's age */
json_t *sd_file_pool_json(struct sd_file_pool *pool);

#endif

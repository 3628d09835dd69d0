/* checkpoint.c, ckpt_commit.c and ckpt_load.c: a job's checkpoint state, shared between
 * saving, committing and loading. */
#ifndef SD_CHECKPOINT_INT_H
#define SD_CHECKPOINT_INT_H

#include "barrier.h"
#include "checkpoint.h"
#include "file_pool.h"
#include "job.h"
#include "job_module.h"
#include "sd/ckpt.h"
#include "sd/fsid.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* The job's file work: one task at a time on the file pool, with the owner's identity. The
 * operation waiting for it gives it up at its deadline (abandoned: the operation fails then,
 * the worker's end only lets the job's memory go); the memory stays while busy. */
struct sd_ckpt_work {
    struct sd_file_task task;
    void (*fn)(struct sd_job *);
    void (*after)(struct sd_job *);
    const char *what; /* "writing its part of a save": the deadline's message */
    uint64_t deadline_ns;
    bool busy;             /* a worker runs fn: the job's memory stays */
    atomic_bool abandoned; /* its operation gave it up at its deadline */
    int status;            /* fn's outcome, and why */
    char err[1024];
};

/* A checkpoint being loaded at registration. */
struct sd_ckpt_loading {
    bool load;   /* the job starts from src */
    bool opened; /* src's manifest is read and checked (a worker's task at registration) */
    char dir[SD_CKPT_PATH_MAX];
    uint64_t max_manifest; /* bytes of MANIFEST this model's checkpoint has at most */
    struct sd_ckpt src;
    float *buf; /* device memory: per unit, the node's masters, then its ranks' moments */
    _Atomic uint64_t bytes; /* read (a worker adds, shardctl jobs reads meanwhile) */
    uint64_t start_ns, ns;  /* loading the checkpoint: since, and how long it took */
};

/* Node 0: the nodes' reports of save seq, and the manifest it commits. */
struct sd_ckpt_commit {
    uint32_t reports;
    bool *reporting;        /* [nodes]: the nodes whose part it waits for */
    uint32_t *rep_file;     /* [nodes]: the manifest's file of each node's part */
    uint64_t *rep_seq;      /* [nodes]: the save each node reported, 0: none */
    Shard__JobSaved **reps; /* [nodes]: their reports (node 0's own is items) */
    char (*tmps)[128];      /* [nodes]: their temporary directories, for the commit's worker */
    struct sd_ckpt man;     /* the manifest being committed */
};

struct sd_ckpt_job {
    struct sd_fsid id; /* the job's owner: every file of its checkpoints is touched as it */
    struct sd_ckpt_work work;
    struct sd_ckpt_loading ld;
    struct sd_ckpt_commit cm;
    struct sd_barrier bar; /* saving: the local ranks' save calls */
    uint64_t first_ns;     /* the save's first call; 0 once it is answered */
    char dir[SD_CKPT_PATH_MAX], final[64];
    char tmp[128];      /* this node's part: its temporary directory in dir (the worker names it) */
    uint64_t seq, step; /* saves started; the step of this one */
    bool recovery;      /* the write is a recovery's (recover.h): shardctl waits, no rank */
    uint64_t save_seq;  /* a recovery's write: seq of the saves, back once it is done */
    bool saving;        /* the ranks' save started and is not answered yet */
    char save_dir[SD_CKPT_PATH_MAX]; /* the save barrier's directory (dir: the write's) */
    bool *writer;                    /* [k]: the local ranks whose os shards this node writes */
    uint64_t *snap_steps;            /* [n_tensors]: at the write, the tensors' steps */
    struct sd_hparams *snap_hp;      /* [groups]: and the hyperparameters in force */
    struct sd_ckpt_extent *items;    /* this node's part: its data file's extents, */
    const void **item_src;           /* and the job memory each is written from */
    float *stage; /* a device backend's: the extents copied to host memory for the writers */
    uint64_t n_items;
    /* an operation waiting for the job's device queue to pass q_ticket (the copies into stage
     * or out of ld.buf, or kernels still writing what a worker is to read or fill): the loop's
     * poll calls q_then with the queue's status once it did (sd_ckpt__after_queue) */
    void (*q_then)(struct sd_job *job, int status);
    uint64_t q_ticket;
    atomic_bool direct; /* this node's last data file went out with O_DIRECT (the worker
                         * says, shardctl jobs reads meanwhile) */
    uint64_t saves, bytes_saved, save_ns;
};

/* ---- the job's file work (checkpoint.c) */
/* fn on a file-pool thread with the owner's identity (in place without a pool), then after on
 * the loop; at deadline_ns (0: none) the sweep fails the operation as what ("writing its part
 * of the save") and after runs then with SD_ETIMEDOUT in work.status */
void sd_ckpt__run_worker(struct sd_job *job, void (*fn)(struct sd_job *),
                         void (*after)(struct sd_job *), const char *what, uint64_t deadline_ns);
/* The file pool's threads for one worker's items (checkpoint_threads of them at most: the
 * worker's own and idle ones helping), from the worker: fn(arg, thread, i) for i in [0, n). */
void sd_ckpt__parallel(struct sd_job *job, uint64_t n, sd_ckpt_par_fn *fn, void *arg);
/* then(job, status) once the job's device queue passed everything queued on it so far (status:
 * SD_OK, or the backend's failure): at once where the device is already there (the host
 * backends), else from the loop's poll, never blocking the loop on the device. One at a time. */
void sd_ckpt__after_queue(struct sd_job *job, void (*then)(struct sd_job *job, int status));
/* is the operation still waiting for the worker (busy and not given up)? */
bool sd_ckpt__working(const struct sd_job *job);
/* the worker's operation was given up: stop early, and remove what it made */
bool sd_ckpt__abandoned(const struct sd_job *job);
/* the worker's outcome: SD_OK, or status and a message (printf) */
void sd_ckpt__fail(struct sd_job *job, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* a deadline of op_timeout_ms plus bytes at 16 MiB/s, from now */
uint64_t sd_ckpt__deadline(const struct sd_job *job, uint64_t bytes);
/* A message for errno st on what the job's owner asked: the errno's text and, where it helps,
 * what to do (a read-only filesystem, a directory the owner may not write) */
const char *sd_ckpt__hint(int st);
/* SHARDD_TEST_FILE_STALL=NODE:MS:WHAT (save, recover, commit, load, open): that node's file task of
 * that kind starts MS late (a stalled filesystem, for tests; built with SHARD_TEST_HOOKS only) */
#ifdef SD_TEST_HOOKS
void sd_ckpt__test_stall(const struct sd_job *job, const char *what);
#else
static inline void sd_ckpt__test_stall(const struct sd_job *job, const char *what)
{
    (void)job;
    (void)what;
}
#endif

/* ---- node 0's commit (ckpt_commit.c) */
int sd_ckpt__commit_init(struct sd_job *job);
void sd_ckpt__commit_free(struct sd_job *job);
/* Remove the temporary directories names[n] of the job in dir, on a task of their own (nothing
 * waits for it; only names of the job's, ".tmp-<job>-...", are taken) */
void sd_ckpt__discard(struct sd_job *job, const char *dir, const char *const *names, uint32_t n);
/* this node's part of save seq is written (node 0): collect */
void sd_ckpt__own_part(struct sd_job *job);
/* ---- checkpoint.c, for the commit */
/* answer the ranks waiting in the save */
void sd_ckpt__save_answer(struct sd_job *job, int status, const char *msg);
/* a recovery's write on this node is over */
void sd_ckpt__recovery_end(struct sd_job *job);
/* the prefix of the job's temporary directories: ".tmp-<job>-" */
void sd_ckpt__tmp_prefix(const struct sd_job *job, char *buf, size_t len);

#endif

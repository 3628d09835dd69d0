/* checkpoint.c and ckpt_load.c: a job's checkpoint state, shared between saving and loading. */
#ifndef SD_CHECKPOINT_INT_H
#define SD_CHECKPOINT_INT_H

#include "checkpoint.h"
#include "sd/ckpt.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct sd_ckpt_job {
    /* loading */
    bool load; /* the job starts from src */
    char load_dir[SD_CKPT_PATH_MAX];
    struct sd_ckpt src;
    float *load_buf; /* per unit: the node's masters, then its ranks' moments (unit_block) */
    /* saving: the local barrier */
    uint32_t arrived;
    bool *waiting;  /* [k] */
    uint64_t *tags; /* [k] */
    uint64_t first_ns;
    char dir[SD_CKPT_PATH_MAX], tmp[128], final[64];
    uint64_t seq, step; /* saves started; the step of this one */
    bool recovery;      /* the write is a recovery's (recover.h): shardctl waits, no rank */
    uint64_t save_seq;  /* a recovery's write: seq of the saves, back once it is done */
    bool saving;        /* the ranks' save started and is not answered yet */
    char save_dir[SD_CKPT_PATH_MAX]; /* the save barrier's directory (dir: the write's) */
    bool *writer;                    /* [k]: the local ranks whose os shards this node writes */
    bool *reporting;                 /* [nodes] node 0: the nodes whose part it waits for */
    uint32_t *rep_file;              /* [nodes]: the manifest's file of each node's part */
    uint64_t *snap_steps;            /* [n_tensors]: at the write, the tensors' steps */
    struct sd_hparams *snap_hp;      /* [groups]: and the hyperparameters in force */
    struct sd_ckpt_extent *items;    /* this node's part: its data file's extents, */
    const void **item_src;           /* and the job memory each is written from */
    uint64_t n_items;
    /* a worker reads or writes the job's memory: its memory stays until it is done */
    bool busy;
    atomic_bool direct; /* this node's last data file went out with O_DIRECT (the worker
                         * says, shardctl jobs reads meanwhile) */
    atomic_bool running;
    int status;
    char err[1024];
    /* node 0: the nodes' reports of save seq */
    uint32_t reports;
    uint64_t *rep_seq;      /* [nodes]: the save each node reported, 0: none */
    Shard__JobSaved **reps; /* [nodes]: their reports (node 0's own is items) */
    struct sd_ckpt man;     /* the manifest being committed */
    uint64_t saves, bytes_saved, save_ns;
    _Atomic uint64_t loaded_bytes;   /* a load's worker adds, shardctl jobs reads meanwhile */
    uint64_t load_start_ns, load_ns; /* loading the checkpoint: since, and how long it took */
};

/* fn on a worker thread (in place without a loop), then after on the loop; the job's memory
 * stays while it runs (sd_ckpt_busy) */
void sd_ckpt__run_worker(struct sd_job *job, void (*fn)(struct sd_job *),
                         void (*after)(struct sd_job *));

#endif

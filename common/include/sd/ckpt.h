/* Checkpoints (DESIGN.md section 3b): the on-disk format, its reader and the commit.
 *
 * A checkpoint is a directory: data files of raw little-endian fp32 extents and a MANIFEST
 * (JSON) written last. An extent is one state ("master", then the optimizer's moments) of
 * elements [begin, end) of one tensor, in global coordinates, so any world and plan can load it.
 * Each extent carries the crc32c of its bytes. docs/checkpoints.md's "Checkpoint format" is the
 * specification; this file is one implementation of it. */
#ifndef SD_CKPT_H
#define SD_CKPT_H

#include "sd/model.h"
#include "sd/safe_fs.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define SD_CKPT_FORMAT_NAME "shardd-checkpoint"
#define SD_CKPT_VERSION     1
/* an extent holds at most this many elements (4 MiB of fp32): a load reads whole extents (their
 * crc is over all of them), so this bounds what it reads beyond what its shards need */
#define SD_CKPT_EXTENT_ELEMS (1u << 20)
#define SD_CKPT_PATH_MAX     4096
/* a MANIFEST has at most this many bytes whatever the model (sd_ckpt_open_owned takes less) */
#define SD_CKPT_MANIFEST_MAX (256ull << 20)
#define SD_CKPT_MAX_STATES   3

/* CRC-32C (Castagnoli), as iSCSI and ext4 use it: crc 0 to start, chain by passing it back. */
uint32_t sd_crc32c(uint32_t crc, const void *data, size_t len);
/* sd_crc32c of A followed by B, from crc1 = sd_crc32c(0, A), crc2 = sd_crc32c(0, B) and B's
 * length (crcs of pieces computed apart, as the checkpoint writer's threads do) */
uint32_t sd_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

/* state s of an optimizer of kind: "master", then "exp_avg", "exp_avg_sq" (adamw) or
 * "momentum_buffer" (sgd), as torch.optim names them; NULL past the last */
const char *sd_ckpt_state_name(int optim_kind, uint32_t s);
/* the states a checkpoint holds per parameter for an optimizer of kind */
uint32_t sd_ckpt_states(int optim_kind);

struct sd_ckpt_extent {
    uint32_t state, tensor, file;
    uint64_t begin, end; /* elements of the tensor */
    uint64_t file_off;   /* bytes into the file */
    uint32_t crc;
};

struct sd_ckpt_tensor {
    char name[SD_MAX_NAME];
    uint32_t ndim;
    uint64_t dims[SD_MAX_DIMS];
    int dtype;
    uint32_t unit, group;
    uint64_t numel, steps; /* steps: optimizer updates the tensor has had */
};

struct sd_ckpt {
    char path[SD_CKPT_PATH_MAX]; /* the checkpoint's directory (sd_ckpt_open resolves LATEST) */
    int dir_fd;                  /* that directory, its files are opened below it (dir_open) */
    bool dir_open;
    uid_t owner; /* whose files a reader takes (SD_FS_ANY_OWNER: anyone's) */
    char job[64], plan[64];
    uint64_t step;
    uint32_t world, ranks_per_node, nodes;
    int optim_kind;
    float max_grad_norm;
    uint32_t n_states;
    uint32_t n_tensors;
    struct sd_ckpt_tensor *tensors;
    uint32_t n_groups;
    struct sd_hparams *groups;
    uint32_t n_files;
    char (*files)[64];
    uint64_t n_extents;
    struct sd_ckpt_extent *extents; /* in the manifest's order */
    uint64_t *by_key;               /* extents sorted by (state, tensor, begin) */
    uint64_t bytes;                 /* of all extents */
};

/* Open the checkpoint at dir: dir itself when it holds a MANIFEST, else the one dir/LATEST
 * names. Parses and checks the manifest: every field, and that each state of each tensor is
 * covered by extents exactly once. Returns SD_OK, SD_ENOENT or SD_EINVAL (err says which file
 * and what). Every file is taken as sd/safe_fs.h says (no symlink below dir, O_NONBLOCK, a
 * regular file), of any owner, with this thread's rights. */
int sd_ckpt_open(const char *dir, struct sd_ckpt *ck, char *err, size_t errlen);
/* The same for a daemon reading a job's checkpoint: LATEST, MANIFEST and the data files must
 * belong to owner (SD_FS_ANY_OWNER: anyone), and the MANIFEST may have max_manifest bytes at
 * most (0: SD_CKPT_MANIFEST_MAX). */
int sd_ckpt_open_owned(const char *dir, uid_t owner, uint64_t max_manifest, struct sd_ckpt *ck,
                       char *err, size_t errlen);
void sd_ckpt_close(struct sd_ckpt *ck);
/* Does model (registered) match the checkpoint's? The tensors' names and shapes, the
 * optimizer's kind and the parameter groups must be equal; the weights' dtypes and units may
 * differ (they are derived from the fp32 master). err names the first difference. */
int sd_ckpt_check_model(const struct sd_ckpt *ck, const struct sd_model *model, char *err,
                        size_t errlen);
/* Read every extent and check its crc; bad_p (may be NULL) counts the ones that failed, and err
 * names the first (file, extent). */
int sd_ckpt_verify(const struct sd_ckpt *ck, uint64_t *bad_p, char *err, size_t errlen);

/* Reads ranges of a checkpoint's states, whole extents at a time, each verified. */
struct sd_ckpt_reader {
    const struct sd_ckpt *ck;
    bool direct;     /* open the files with O_DIRECT where the filesystem has it (set after init) */
    int *fds;        /* [n_files], -1 until opened (below ck->dir_fd, as sd_fs_open_input) */
    uint8_t *raw;    /* aligned: one extent and the blocks around it */
    float *data;     /* the extent in raw */
    uint64_t cached; /* that extent, UINT64_MAX: none */
    uint64_t bytes_read;
};
int sd_ckpt_reader_init(struct sd_ckpt_reader *rd, const struct sd_ckpt *ck, char *err,
                        size_t errlen);
void sd_ckpt_reader_free(struct sd_ckpt_reader *rd);
/* Elements [begin, end) of state of tensor into dst. */
int sd_ckpt_read(struct sd_ckpt_reader *rd, uint32_t state, uint32_t tensor, uint64_t begin,
                 uint64_t end, float *dst, char *err, size_t errlen);

/* ---- moving the data files' bytes: several threads, O_DIRECT writes where the filesystem has
 * them (checkpoint_threads, checkpoint_direct in the daemon's config) */
#define SD_CKPT_IO_CHUNK    (4u << 20) /* a thread writes this much at a time, at aligned offsets */
#define SD_CKPT_IO_ALIGN    4096u      /* of O_DIRECT's buffers, offsets and lengths */
#define SD_CKPT_MAX_THREADS 64u
/* fn(arg, thread, i) for every i in [0, n), on at most `threads` threads, thread in
 * [0, threads): each call may use per-thread state */
typedef void sd_ckpt_par_fn(void *arg, uint32_t thread, uint64_t i);
/* Who runs a call's items: the daemon's file pool (sd_file_pool_parallel), so its file work
 * has one set of threads; NULL in an sd_ckpt_io: sd_ckpt_parallel. */
struct sd_ckpt_runner {
    void (*run)(void *ctx, uint32_t threads, uint64_t n, sd_ckpt_par_fn *fn, void *arg);
    void *ctx;
};
struct sd_ckpt_io {
    uint32_t threads;                    /* 1 to SD_CKPT_MAX_THREADS */
    bool direct;                         /* write with O_DIRECT where the filesystem takes it */
    const struct sd_ckpt_runner *runner; /* NULL: sd_ckpt_parallel */
};
/* The items on `threads` threads: this one and the rest started for the call (the tools'
 * runner; the daemon's is its file pool). */
void sd_ckpt_parallel(uint32_t threads, uint64_t n, sd_ckpt_par_fn *fn, void *arg);
/* One data file's n extents into fd (open for writing, empty), extent i's bytes from src[i],
 * setting each extent's crc. The extents are packed in file order: xs[0] at 0, each at the end
 * of the one before (else SD_EINVAL). Chunks of SD_CKPT_IO_CHUNK bytes are gathered into aligned
 * buffers and written by io->threads threads, with O_DIRECT when io->direct and the filesystem
 * takes it (*direct_p, may be NULL, says whether it did); no fsync. A negative errno on error. */
int sd_ckpt_write_extents(int fd, struct sd_ckpt_extent *xs, const void *const *src, uint64_t n,
                          const struct sd_ckpt_io *io, bool *direct_p);

/* ---- writing (below directory fds: sd/safe_fs.h; dir, parent: their paths, for messages) */
/* Write len bytes at p to fd, adding them to *crc_p. */
int sd_ckpt_write_all(int fd, const void *p, size_t len, uint32_t *crc_p);
/* The manifest of ck into a new dir_fd/MANIFEST (O_EXCL), fsynced. A field the JSON cannot hold
 * (a name that is not UTF-8) fails it with SD_EINVAL naming the field. */
int sd_ckpt_write_manifest(int dir_fd, const char *dir, const struct sd_ckpt *ck, char *err,
                           size_t errlen);
/* Commit: fsync tmp_name, put it in place as final_name, fsync parent, then point LATEST at it
 * (a new file under a random name, fsynced, renamed over LATEST, parent fsynced again). A
 * checkpoint already named final_name is swapped out (RENAME_EXCHANGE, or renamed aside) and
 * removed only once LATEST is committed; on any failure it is put back and the new one is back
 * under tmp_name for the caller to remove. */
int sd_ckpt_commit(int parent_fd, const char *parent, const char *tmp_name, const char *final_name,
                   char *err, size_t errlen);
/* Remove parent_fd/name and the files in it (a partial checkpoint), as sd_fs_remove does. */
int sd_ckpt_remove(int parent_fd, const char *name);
/* the directory name of the checkpoint of step: "step-00000010" */
void sd_ckpt_step_name(char *buf, size_t len, uint64_t step);

#endif

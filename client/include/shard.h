/* libshard: the client library of shardd.
 *
 * A trainer process attaches to the shardd of its node, registers its model (every rank of a job
 * registers the same description), then per micro-step fetches each unit's gathered weights
 * (zero-copy, read-only), releases them, and pushes the unit's gradient; at the accumulation
 * boundary it calls shard_step, which runs the optimizer on the sharded states.
 *
 * Every call returns 0 or a negative status (SHARD_E*); none aborts the process. After an error,
 * shard_last_error() says what was wrong. A shard_ctx_t is not thread-safe: use one per thread.
 * Gradients are averaged over the world, as DDP does: each rank pushes the gradient of the mean
 * loss of its own micro-batch; the optimizer sees (sum over ranks and micro-steps) / world. */
#ifndef SHARD_H
#define SHARD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHARD_API __attribute__((visibility("default")))

#define SHARD_VERSION_MAJOR 0
#define SHARD_VERSION_MINOR                                                                        \
    10 /* 6: shard_fetchx, shard_releasex, shard_pushx; 7: shard_write, shard_read; 8: trainer     \
         optimizers (shard_read_own, shard_write_own, shard_step_update_done); 9:                  \
         shard_step_scaled; 10: shard_scaler_t, shard_step_amp */

/* Status codes (values are negated errno codes, project codes below -1000). */
enum {
    SHARD_OK = 0,
    SHARD_EPERM = -1,
    SHARD_ENOENT = -2,
    SHARD_EIO = -5,
    SHARD_EAGAIN = -11,
    SHARD_ENOMEM = -12,
    SHARD_EBUSY = -16,
    SHARD_EEXIST = -17,
    SHARD_EINVAL = -22,
    SHARD_ENOSPC = -28,
    SHARD_ERANGE = -34,
    SHARD_ENOSYS = -38,
    SHARD_EPROTO = -71,
    SHARD_EMSGSIZE = -90,
    SHARD_ECONNRESET = -104,
    SHARD_ENOTCONN = -107,
    SHARD_ETIMEDOUT = -110,
    SHARD_ECANCELED = -125,
    SHARD_ESTATE = -1001,
    SHARD_EMISMATCH = -1002,
    SHARD_EJOBFAILED = -1003,
    SHARD_EVERSION = -1004,
    SHARD_ENOUNIT = -1005,
    SHARD_ENOJOB = -1006,
    SHARD_ENOTHELD = -1007,
    SHARD_ECONFIG = -1008,
    SHARD_EPEER = -1009,
    SHARD_ENONFINITE = -1010, /* shard_step: a gradient was NaN or infinite; the step was skipped
                                 (gradients discarded, weights unchanged) and the job goes on */
    SHARD_EPAUSED = -1011,    /* a rank of a job with resume_timeout_ms died: the job paused at
                                 the step the message names; register again (every rank) to
                                 resume from it (shard_start_step) */
    SHARD_ENOREPLICA = -1012, /* shard_checkpoint_job: a lost node held the only copy of some
                                 state (the answer's JSON lists the missing extents) */
};

typedef enum { SHARD_FP32 = 0, SHARD_BF16 = 1, SHARD_FP16 = 2 } shard_dtype_t;

typedef struct shard_ctx shard_ctx_t;
typedef uint64_t shard_req_t;

typedef struct {
    const char *name; /* unique within the model */
    uint32_t ndim;
    const uint64_t *dims;
    shard_dtype_t dtype;
    uint32_t unit;  /* units numbered 0, 1, ... in tensor order; one dtype per unit */
    uint32_t group; /* parameter group: an index into shard_model_t.groups (0 without groups) */
} shard_tensor_t;

typedef struct {
    const char *name; /* "adamw", "sgd", "adam" (torch.optim.Adam: L2 weight decay),
                         "sgd-nesterov" (SGD with Nesterov momentum, which must be > 0), or
                         "trainer0".."trainer4": the trainer runs it (shard_read_own) */
    float lr;
    float beta1, beta2, eps; /* adamw */
    float weight_decay;
    float momentum;      /* sgd */
    float max_grad_norm; /* 0: no clipping */
} shard_optimizer_t;

/* One parameter group's hyperparameters (a torch.optim param group). Registered with the model,
 * and changed by any step (shard_step_ex: a learning-rate schedule); the optimizer's fp32 state
 * is not touched by a change. */
typedef struct {
    float lr;
    float beta1, beta2, eps; /* adamw */
    float weight_decay;
    float momentum; /* sgd */
} shard_hparams_t;

/* shard_model_t.flags */
enum {
    /* skip, as torch's optimizers skip a parameter whose .grad is None, a tensor that no rank gave
     * a gradient in a step: its weights, moments and step count stay. Each rank says which
     * tensors it gave one (shard_step_args_t.has_grad); a frozen parameter is one never given. */
    SHARD_SKIP_UNUSED = 1u << 0,
};

/* shard_model_t.job_secret: its bounds in bytes */
enum { SHARD_JOB_SECRET_MIN = 16, SHARD_JOB_SECRET_MAX = 4096 };

typedef struct {
    const char *job; /* job name, shared by all ranks */
    uint32_t rank, world;
    const char *plan; /* "ddp", "zero3", "mics:P" */
    const shard_tensor_t *tensors;
    uint32_t n_tensors;
    shard_optimizer_t optimizer;
    /* rank 0: initial values, one fp32 array per tensor (NULL entries or NULL: zeros);
       ignored on other ranks */
    const float *const *init;
    /* gather pool size for this job in bytes; 0: the daemon's max_live_bytes (by default room
       for every unit at once). Smaller pools evict released units least recently used first. */
    uint64_t max_live_bytes;
    /* parameter groups: NULL, or n_groups hyperparameter sets that replace the optimizer's
     * (shard_tensor_t.group indexes them); the kind and max_grad_norm stay the optimizer's */
    const shard_hparams_t *groups;
    uint32_t n_groups;
    uint32_t flags; /* SHARD_SKIP_UNUSED */
    /* bytes rank 0 broadcasts to every rank with each step (shard_step_args_t.bcast; at most
     * 64 MiB): shard.torch's module buffers, as DDP's broadcast_buffers. 0: none */
    uint64_t bcast_bytes;
    /* a checkpoint to start from in place of init (NULL or "": none): a checkpoint's directory,
     * or a directory of them (the one its LATEST names), written by shard_save under any world
     * and plan. Every rank gives the same. The fp32 master weights, the optimizer's moments and
     * step counts and the groups' hyperparameters are the checkpoint's; shard_start_step says
     * its step, shard_group_hparams its hyperparameters. */
    const char *load;
    /* how long the job stays paused when one of its ranks dies (0: the daemon's
     * resume_timeout_ms, which is 0 unless configured: a dead rank ends the job). While the job
     * is paused the other ranks' calls fail with SHARD_EPAUSED, naming the rank and the step;
     * every rank that registers again (same job name and model, load NULL) within the timeout
     * joins it and continues from that step: shard_start_step, as after a load. A step half
     * done when the rank died is discarded. Every rank gives the same. */
    uint64_t resume_timeout_ms;
    /* ranks per node of this job, the same on every rank: the ranks r with the same
     * r / ranks_per_node (the job's node r / ranks_per_node) attach to the daemon of one node,
     * any of the cluster's, wherever the launcher placed them (0: the daemon's ranks_per_node;
     * a launcher's LOCAL_WORLD_SIZE, say, for a job with fewer ranks per node than the cluster
     * is configured for, or jobs of different sizes side by side) */
    uint32_t ranks_per_node;
    /* the job's secret, the same on every rank (NULL or job_secret_len 0: none): 16-4096 bytes
     * made once per job (32 random bytes) that the launcher hands every rank as it hands them
     * the model, the same across restarts (a resumed job's ranks give the one it ran with, or
     * its nodes refuse them): shard.torch and mlp_train read the file $SHARD_JOB_SECRET_FILE
     * names (mlp_train --job-secret-file, shard.torch.wrap(job_secret=)). The daemons see only a
     * token derived from it and the job's name (HMAC-SHA256), and form the job across nodes of the
     * nodes whose ranks gave the same: a member of the cluster that is not one of the job's nodes
     * cannot report itself into the job's registration (without a secret it can, and the
     * registration is refused as two nodes claiming the same ranks). */
    const void *job_secret;
    size_t job_secret_len;
    /* where the job's ranks find its leader, the daemon of rank 0's node, when their daemons
     * are independent (nodes 1, no cluster list): "host" or "host:port" (port default
     * SHARD_LEADER_PORT). NULL: $SHARD_LEADER, else torchrun's $MASTER_ADDR, else the first
     * host of Slurm's $SLURM_STEP_NODELIST (srun places rank 0 there), each with
     * $SHARD_LEADER_PORT when set; none of them: a job on one node only. The host is resolved
     * here (IPv4). Every rank gives the same. */
    const char *leader;
} shard_model_t;

/* the port an independent daemon that leads a job listens on by default (its peer_port 0) */
#define SHARD_LEADER_PORT 7701

/* What shard_step_ex takes. Every rank of the job must give the same hyperparameters. */
typedef struct {
    /* every group's hyperparameters from this step on, n_groups (as registered) of them; NULL:
     * those of the last step */
    const shard_hparams_t *groups;
    uint32_t n_groups;
    /* with SHARD_SKIP_UNUSED: n_tensors bytes, nonzero for each tensor this rank gave a gradient
     * since the last step (any micro-step); NULL: every tensor */
    const uint8_t *has_grad;
    uint32_t n_tensors;
    /* with a model's bcast_bytes: bcast_bytes bytes, given by every rank or by none. Rank 0's
     * are sent; on every other rank the step (returning 0, or SHARD_ENONFINITE) overwrites them
     * with rank 0's. NULL: nothing broadcast in this step */
    void *bcast;
    uint64_t bcast_bytes;
} shard_step_args_t;

typedef struct {
    uint64_t numel; /* padded elements of the unit's flat buffer */
    uint64_t bytes; /* numel * dtype size: what fetch returns and push_grad takes */
    shard_dtype_t dtype;
    uint32_t first_tensor, n_tensors;
} shard_unit_info_t;

typedef struct {
    uint32_t unit;
    uint64_t offset; /* elements from the start of the unit's flat buffer */
    uint64_t numel;
} shard_tensor_info_t;

/* Connect to shardd. socket_path NULL: $SHARD_SOCKET, else /run/shardd/shardd.sock.
 * On failure *ctx_p is NULL and shard_last_error(NULL) says why. */
SHARD_API int shard_attach(const char *socket_path, shard_ctx_t **ctx_p);
/* Register the model; returns once every rank of the job registered and rank 0's initial values
 * are loaded (or with an error after the daemon's register_timeout_ms). */
SHARD_API int shard_register(shard_ctx_t *ctx, const shard_model_t *model);
SHARD_API uint32_t shard_num_units(const shard_ctx_t *ctx);
SHARD_API int shard_unit_info(const shard_ctx_t *ctx, uint32_t unit, shard_unit_info_t *info_p);
SHARD_API int shard_tensor_info(const shard_ctx_t *ctx, uint32_t tensor,
                                shard_tensor_info_t *info_p);

/* What the pointers that shard_fetch, shard_wait and shard_grad_buffer give are, after
 * shard_register: "host" (host memory this process reads and writes), or "cuda" (device
 * addresses on the GPU of this thread's current CUDA context: the daemon's device memory,
 * imported; read them with kernels or cuMemcpy). NULL before registration. */
SHARD_API const char *shard_memory(const shard_ctx_t *ctx);
/* The UUID of the daemon's device that holds that memory, after shard_register: "GPU-" and
 * 8-4-4-4-12 hex digits as nvidia-smi -L prints it (torch.cuda.get_device_properties(i).uuid
 * prints the same digits), whatever CUDA_VISIBLE_DEVICES numbers the devices on either side;
 * "" for memory without a device (host, the emulations). A trainer on another GPU cannot read
 * it at full speed, if at all: compare before training. NULL before registration. */
SHARD_API const char *shard_device_uuid(const shard_ctx_t *ctx);
/* How many times this process's libshard waited for a device so far (every context's): each
 * shard_copy and shard_push_grad into device memory waits for its copy. A trainer whose
 * gradients are written on its stream and pushed with shard_push_staged_on_stream, and whose
 * fetches are read by its kernels, makes none: what a test of "no host synchronization per
 * unit" counts. */
SHARD_API unsigned long long shard_device_syncs(void);
/* dst = src, bytes long, where either may be memory of the kind shard_memory names or the
 * caller's host memory (cuMemcpy under "cuda"; memcpy under "host"): how a trainer's host code
 * reads a fetched unit or fills a gradient buffer it cannot touch directly. A write into the
 * gather pool is refused. */
SHARD_API int shard_copy(shard_ctx_t *ctx, void *dst, const void *src, size_t bytes);

/* Gather a unit; *data_p points at the unit's flat buffer (read-only shared memory, or device
 * memory: shard_memory) until shard_release. */
SHARD_API int shard_fetch(shard_ctx_t *ctx, uint32_t unit, const void **data_p);
SHARD_API int shard_fetch_async(shard_ctx_t *ctx, uint32_t unit, shard_req_t *req_p);
/* Wait for an async fetch; data_p may be NULL for requests without data. */
SHARD_API int shard_wait(shard_ctx_t *ctx, shard_req_t req, const void **data_p);
/* The unit's buffer is not read again by this rank. A unit this rank holds (fetched, answered,
 * not released: libshard counts them as shardd does) returns once the release is posted on the
 * ring, without waiting for shardd's answer; shardd takes the ring in order, so a later fetch
 * finds it released. A failure shardd answers for it (the job failed meanwhile) is returned by
 * the first call after the answer came ("... an earlier release of unit U failed: ..."), once.
 * A unit this rank does not hold is answered at once (SHARD_ENOTHELD). */
SHARD_API int shard_release(shard_ctx_t *ctx, uint32_t unit);
/* shard_fetch and shard_release outside the step's schedule: for reads that only some ranks make
 * (saving the weights on rank 0, an evaluation), which the schedule, recorded from and replayed
 * for the calls every rank of a partition group makes alike, must not see. Slower (no
 * prefetch); release what shard_fetch_aside gave with shard_release_aside. */
SHARD_API int shard_fetch_aside(shard_ctx_t *ctx, uint32_t unit, const void **data_p);
SHARD_API int shard_release_aside(shard_ctx_t *ctx, uint32_t unit);
/* shard_release (shard_release_aside) of a unit that kernels queued on `stream` (a CUstream or
 * cudaStream_t of "cuda" memory) may still read: libshard enqueues on the stream, after them,
 * the write of the fence page's release_seq (byte 192 of the page, counted from 1;
 * cuStreamWriteValue32), and releases at once, with no host synchronization. The daemon keeps
 * the unit's slot for this rank until the page counts the release: the gather pool's places are
 * shared by units whose lifetimes do not overlap on the host, and no gather overwrites a slot a
 * kernel still reads. shardctl stats counts them (fenced_releases). stream NULL: as
 * shard_release; memory without streams ("host", "emu-gpu") takes only NULL (SHARD_EINVAL). */
SHARD_API int shard_release_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream);
SHARD_API int shard_release_aside_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream);
/* The release of shard_release_on_stream with the signal left to the caller: before or after
 * this call, something writes shard_fence().next_release (as read before the call) into
 * release_seq once nothing reads the unit's slot any more (a HIP stream's
 * hipStreamWriteValue32, another thread). A gather that needs the slot's place waits for it, and
 * fails the job after the daemon's op_timeout_ms without it, naming the fence page. */
SHARD_API int shard_release_signalled(shard_ctx_t *ctx, uint32_t unit);
/* Push this micro-step's gradient of a unit: bytes must equal shard_unit_info().bytes, laid out
 * like the fetched buffer, in the unit's dtype. Returns once the gradient is copied; the
 * reduction completes asynchronously and its error, if any, is returned by shard_step. */
SHARD_API int shard_push_grad(shard_ctx_t *ctx, uint32_t unit, const void *grad, size_t bytes);
/* The zero-copy push: *buf_p receives the staging buffer (shared memory, shard_unit_info().bytes
 * long) that the next gradient of the unit is to be written into, in place of the buffer that
 * shard_push_grad copies from; then shard_push_staged hands it over. The buffer is the caller's
 * until then (asking for the same unit again returns it again); it is not zeroed and holds what
 * an earlier push left, so write every element. One buffer is held at a time: asking for another
 * unit's fails with SHARD_EBUSY, and so does shard_step while one is held. Waits, as
 * shard_push_grad does, while every staging slot is still being reduced. */
/* On a device's memory (shard_memory is not "host") *buf_p is a device address. The daemon
 * reads the slot once the gradient is signalled on the fence page (shard_fence): shard_push_staged
 * signals it at the call, so the work that writes the buffer must be complete by then;
 * shard_push_staged_on_stream instead has the stream that writes it signal it, after that work,
 * and returns at once (no host synchronization). */
SHARD_API int shard_grad_buffer(shard_ctx_t *ctx, uint32_t unit, void **buf_p);
SHARD_API int shard_push_staged(shard_ctx_t *ctx, uint32_t unit);
/* shard_push_staged, signalled by `stream`: a stream of the job's device (a CUstream or
 * cudaStream_t for "cuda" memory) on which the buffer's gradient was written. libshard enqueues
 * on it the fence page's write (cuStreamWriteValue32 of shard_fence().next_grad into grad_seq,
 * the page registered with the device on first use) and pushes; the daemon takes the gradient
 * when the stream gets there, polling the page (within a millisecond). stream NULL: as
 * shard_push_staged. Memory without streams ("host", "emu-gpu") takes only NULL (SHARD_EINVAL). */
SHARD_API int shard_push_staged_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream);
/* The device's default stream where the calls above take a stream: CUDA's legacy NULL stream
 * (this is CU_STREAM_LEGACY; CU_STREAM_PER_THREAD works too), HIP's null stream. A NULL stream
 * means no stream (signalled at the call): pass this for work on the default stream (torch's
 * default stream's handle is 0). */
#define SHARD_STREAM_DEFAULT ((void *)1)
/* The push of shard_push_staged_on_stream with the signal left to the caller: before or after
 * this call, something writes shard_fence().next_grad (as read before the call) into grad_seq
 * once the buffer holds the gradient: a HIP stream (hipStreamWriteValue32), another thread.
 * A gradient not signalled within the daemon's op_timeout_ms fails the job, naming the fence
 * page. */
SHARD_API int shard_push_staged_signalled(shard_ctx_t *ctx, uint32_t unit);
/* One call per operation, its variants chosen by a parameter struct (as UCX's
 * ucp_request_param_t): the functions above are these with fixed parameters, and stay.
 * op_attr_mask names the fields that are set (a field whose bit is clear is not read, so that
 * later versions can add fields at the end); flags combine SHARD_OP_FLAG_*. What a variant
 * above does, these do alike: shard_fetchx with ASIDE is shard_fetch_aside, with ASYNC (and
 * req_p) shard_fetch_async; shard_releasex with ASIDE, a STREAM or SIGNALLED is
 * shard_release_aside, _on_stream, _signalled, or a combination of them; shard_pushx with GRAD
 * (grad, bytes) is shard_push_grad, with STAGED shard_push_staged (STREAM: _on_stream;
 * SIGNALLED: _signalled). A flag or field the operation does not take, an unknown bit, or a
 * contradiction (ASYNC with ASIDE, STREAM with SIGNALLED, GRAD with STAGED) fails with
 * SHARD_EINVAL naming it. param NULL: the plain call. */
enum {
    SHARD_OP_ATTR_FLAGS = 1u << 0,  /* flags */
    SHARD_OP_ATTR_STREAM = 1u << 1, /* stream (release, push: signalled by it) */
    SHARD_OP_ATTR_GRAD = 1u << 2,   /* grad and bytes (push: copied from there) */
    SHARD_OP_ATTR_REQUEST = 1u << 3 /* req_p (fetch with SHARD_OP_FLAG_ASYNC) */
};
enum {
    SHARD_OP_FLAG_ASIDE = 1u << 0,     /* fetch, release: outside the schedule */
    SHARD_OP_FLAG_ASYNC = 1u << 1,     /* fetch: post it, *req_p for shard_wait */
    SHARD_OP_FLAG_SIGNALLED = 1u << 2, /* release, push (staged): the caller signals the page */
    SHARD_OP_FLAG_STAGED = 1u << 3     /* push: the gradient buffer held (shard_grad_buffer) */
};
typedef struct {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *stream;
    const void *grad;
    size_t bytes;
    shard_req_t *req_p;
} shard_op_param_t;
/* *data_p (may be NULL with ASYNC) as shard_fetch's */
SHARD_API int shard_fetchx(shard_ctx_t *ctx, uint32_t unit, const shard_op_param_t *param,
                           const void **data_p);
SHARD_API int shard_releasex(shard_ctx_t *ctx, uint32_t unit, const shard_op_param_t *param);
SHARD_API int shard_pushx(shard_ctx_t *ctx, uint32_t unit, const shard_op_param_t *param);
/* The rank's fence page: one page of shared memory (an fd the registration's reply passed, no
 * IPC namespace shared) with three monotonic 32-bit counters that order the trainer's work and the
 * daemon's without a host round trip; they wrap, and compare as (int32_t)(a - b) >= 0.
 *   grad_seq    gradients the trainer signalled: libshard writes next_grad into it before each
 *               push (shard_push_grad, shard_push_staged), and the daemon refuses a push whose
 *               gradient was not signalled. A trainer whose gradient comes from a device stream
 *               has the stream write it after the producing kernel (shard_push_staged_on_stream,
 *               or cuStreamWriteValue32 on the page registered with cuMemHostRegister and then
 *               shard_push_staged_signalled): the daemon waits for that push's signal.
 *   gather_seq  fetches the daemon answered for this rank, written before each answer: a device
 *               stream that reads a fetched slot waits for it (cuStreamWaitValue32, GEQ) at the
 *               value gathers has once the fetch was waited for.
 *   release_seq releases whose slot a stream still read when they were made, written by that
 *               stream after the reads (shard_release_on_stream, shard_release_signalled): the
 *               daemon gathers nothing into the slot's place before the page counts them.
 * The page lives as long as the job and outlives this process (a resumed job's counters go on).
 * Valid after shard_register until shard_detach. */
typedef struct {
    void *page;                 /* SHARD_FENCE_BYTES, mapped shared, read-write */
    uint32_t *grad_seq;         /* in page */
    const uint32_t *gather_seq; /* in page */
    uint32_t next_grad;         /* what the next push signals */
    uint32_t gathers;           /* fetch answers this rank has waited for, as gather_seq counts */
    uint32_t *release_seq;      /* in page: releases signalled (shard_release_on_stream) */
    uint32_t next_release;      /* what the next signalled release signals */
} shard_fence_t;
#define SHARD_FENCE_BYTES 4096
SHARD_API int shard_fence(const shard_ctx_t *ctx, shard_fence_t *fence_p);
/* The pushes from now until this rank's next step are its last of the step (last != 0; 0 takes
 * it back): DDP's leaving no_sync, FSDP2's set_requires_gradient_sync(True) on the last
 * micro-step. Where the plan syncs gradients across nodes at the boundary (the 2-hop sync, a g
 * group inside the node), the daemon then sends each unit's gradient to the other nodes as soon
 * as every local rank pushed it so, overlapping the rest of the backward, instead of after the
 * last one; the numbers are the same. A push of a unit after its marked one in the same step
 * fails the job (SHARD_ESTATE). Reset by each step. */
SHARD_API int shard_last_micro_step(shard_ctx_t *ctx, int last);
/* Optimizer step at the accumulation boundary; all ranks call it. *grad_norm_p (may be NULL)
 * receives the global L2 norm of the averaged gradient before clipping. */
SHARD_API int shard_step(shard_ctx_t *ctx, double *grad_norm_p);
/* shard_step with this step's hyperparameters and the tensors this rank gave a gradient (args
 * NULL: as shard_step). Bad arguments fail here, before the step is entered (SHARD_EINVAL); ranks
 * that disagree fail the step on every rank (SHARD_EMISMATCH): it is skipped as a non-finite one
 * is, and the job goes on. */
SHARD_API int shard_step_ex(shard_ctx_t *ctx, const shard_step_args_t *args, double *grad_norm_p);
/* shard_step_ex of gradients this rank multiplied by loss_scale (a loss scaled before its
 * backward, as torch.amp.GradScaler does): the daemon divides the sums by it before the norm,
 * the clipping and the optimizer (*grad_norm_p is the unscaled norm), so a power of two gives the
 * bits of the same gradients unscaled. A non-finite gradient skips the step on every rank
 * (SHARD_ENONFINITE, the optimizer's state untouched: lower the scale and go on). Every rank
 * gives the same loss_scale (SHARD_EMISMATCH otherwise); finite and positive (SHARD_EINVAL). */
SHARD_API int shard_step_scaled(shard_ctx_t *ctx, const shard_step_args_t *args, double loss_scale,
                                double *grad_norm_p);

/* Dynamic loss scaling with torch.amp.GradScaler's rule (fp16 training: the loss is multiplied by
 * `scale` before its backward, so that small gradients do not underflow to zero). Every rank keeps
 * one and updates it with each step's outcome, which the daemon decides for all ranks alike (from
 * the exchanged norm parts), so the ranks' scales stay equal; the daemon checks they do. */
typedef struct shard_scaler {
    double scale;             /* the next step's loss scale (a float32 value, as torch's) */
    double growth_factor;     /* times this after growth_interval steps in a row taken */
    double backoff_factor;    /* times this after a step skipped for a non-finite gradient */
    uint32_t growth_interval; /* steps in a row taken before the scale grows */
    uint32_t growth_tracker;  /* steps in a row taken since the last change */
    uint64_t skipped;         /* steps skipped so far */
} shard_scaler_t;

/* torch.amp.GradScaler's defaults: scale 2^16, growth 2 every 2000 steps taken, backoff 0.5 */
SHARD_API void shard_scaler_init(shard_scaler_t *s);
/* The scaler after a step: found_inf non-zero (skipped) multiplies the scale by backoff_factor
 * and restarts the count; else the count grows, and at growth_interval the scale is multiplied
 * by growth_factor (kept where that would be infinite in float32) and the count restarts; the
 * scale is rounded to float32 as torch's _amp_update_scale_ keeps it. */
SHARD_API void shard_scaler_update(shard_scaler_t *s, int found_inf);
/* shard_step_scaled with s->scale, then shard_scaler_update with its outcome: 0 (the step taken)
 * or SHARD_ENONFINITE (skipped on every rank, the optimizer's state untouched, the scale lowered:
 * go on with the next step); any other error leaves the scaler as it was. */
SHARD_API int shard_step_amp(shard_ctx_t *ctx, const shard_step_args_t *args, shard_scaler_t *s,
                             double *grad_norm_p);
/* The hyperparameters of group as of the last step (or the registration) */
SHARD_API int shard_group_hparams(const shard_ctx_t *ctx, uint32_t group, shard_hparams_t *h_p);
/* Save a checkpoint of the job into dir/step-NNNNNNNN (the steps taken so far), then point
 * dir/LATEST at it; dir is created if missing. Every rank calls it between the same two steps
 * (after shard_step, before the next push) with the same dir; it returns once the checkpoint is
 * durable (data and manifest fsynced, renamed into place, LATEST replaced), with *step_p (may be
 * NULL) the step saved. The directory must be one every node of the job sees (a shared file
 * system across nodes). A failed save leaves the last checkpoint as it was; the job goes on. */
SHARD_API int shard_save(shard_ctx_t *ctx, const char *dir, uint64_t *step_p);
/* Values written into a running job (torch's load_state_dict on a wrapped model or its
 * optimizer): every rank writes the same values between the same two steps, each into its own
 * shards, then calls shard_write_done. shard_write: tensor's count fp32 values (its elements, in
 * host memory) as what: SHARD_WRITE_WEIGHTS (the fp32 master weights, and the weights in their
 * dtype from them) or optimizer state what (1 .. : AdamW's and Adam's exp_avg, exp_avg_sq; SGD's
 * momentum_buffer); the optimizer's other state, the moments, is left as it is. shard_write_steps:
 * the tensor's step count (AdamW's bias correction). shard_write_done returns once every rank
 * of the node called it: the next fetches, on every node, read the written weights. Refused
 * (SHARD_ESTATE) during a step or while the rank holds a fetched unit. */
#define SHARD_WRITE_WEIGHTS 0u
SHARD_API int shard_write(shard_ctx_t *ctx, uint32_t tensor, uint32_t what, const float *values,
                          size_t count);
SHARD_API int shard_write_steps(shard_ctx_t *ctx, uint32_t tensor, uint64_t steps);
SHARD_API int shard_write_done(shard_ctx_t *ctx);
/* A unit's fp32 master weights (what SHARD_WRITE_WEIGHTS) or optimizer state what, gathered
 * from the job's nodes into out (count = the unit's elements, host memory): any rank alone,
 * between its steps (the others may be in the next forward: the step waits for this rank).
 * shard_read_steps: a tensor's step count. */
SHARD_API int shard_read(shard_ctx_t *ctx, uint32_t unit, uint32_t what, float *out, size_t count);
SHARD_API int shard_read_steps(shard_ctx_t *ctx, uint32_t tensor, uint64_t *steps_p);
/* Any other optimizer, run by the trainer on its rank's own shard (optimizer name "trainer<N>":
 * the daemon keeps the fp32 masters, N per-element fp32 states, N <= 4, and each tensor's step
 * count, and checkpoints them; shard.torch runs any torch.optim optimizer so). shard_step
 * returns at the hand-off: the gradients are reduced, clipped into the factor
 * shard_step_grad_scale returns (1 / world times the clipping factor), and each tensor's step
 * count already counts this step where some rank gave it a gradient. Then, for each unit, the
 * rank reads its own shard with shard_read_own (what SHARD_OWN_GRAD: the gradient sums, which
 * the optimizer multiplies by the factor; 0: the masters; 1..N the states; *first_p: the
 * shard's first element in the unit, *count_p its elements, at most max), writes the updated
 * masters and states back with shard_write_own (count: the shard's elements), and calls
 * shard_step_update_done, which returns once the step's new weights are there (the norm in
 * *grad_norm_p). Outside the hand-off shard_write_own and the gradient's read are refused
 * (SHARD_ESTATE); a rank that does not call shard_step_update_done within op_timeout_ms fails
 * the job naming it. */
#define SHARD_OWN_GRAD 254u
SHARD_API double shard_step_grad_scale(const shard_ctx_t *ctx);
SHARD_API int shard_read_own(shard_ctx_t *ctx, uint32_t unit, uint32_t what, float *out, size_t max,
                             uint64_t *first_p, uint64_t *count_p);
SHARD_API int shard_write_own(shard_ctx_t *ctx, uint32_t unit, uint32_t what, const float *values,
                              size_t count);
SHARD_API int shard_step_update_done(shard_ctx_t *ctx, double *grad_norm_p);
/* The steps the job had taken when this rank registered: the checkpoint's step when it loaded
 * one (shard_model_t.load), the paused job's when it resumed one (shard_resumed), else 0. */
SHARD_API uint64_t shard_start_step(const shard_ctx_t *ctx);
/* 1 if the registration resumed a paused job (shard_model_t.resume_timeout_ms), else 0. */
SHARD_API int shard_resumed(const shard_ctx_t *ctx);
/* CRC-32C (Castagnoli) of len bytes, chained from crc (0 to start): a checkpoint extent's
 * "crc32c" (docs/checkpoints.md, Checkpoint format), for readers of checkpoints such as
 * shard.checkpoint. */
SHARD_API uint32_t shard_crc32c(uint32_t crc, const void *data, size_t len);
SHARD_API int shard_detach(shard_ctx_t *ctx);

/* One admin command ("status", "jobs", "groups", "topology", "stats", "schedule"; job NULL or
 * "" for all jobs) to the daemon at socket_path (NULL: as shard_attach); *json_p receives the
 * daemon's JSON document (free it with shard_free), also when the status says the command
 * failed. On failure shard_last_error(NULL) says why. */
SHARD_API int shard_admin(const char *socket_path, const char *command, const char *job,
                          char **json_p);
/* Write a checkpoint of job (running, paused, or failed and kept: resume_timeout_ms) into dir
 * (absolute, on the daemons' file systems) from the daemons still up: the daemon at socket_path
 * must be node 0's, the coordinator. Each state is written from one live replica. Waits until
 * the checkpoint is committed (dir/LATEST names it) or refused: SHARD_ENOREPLICA when a lost
 * node held the only copy of some state, *json_p then listing the missing extents. *json_p
 * (free with shard_free) is the daemon's answer: the checkpoint's path, step, bytes, writers. */
SHARD_API int shard_checkpoint_job(const char *socket_path, const char *job, const char *dir,
                                   char **json_p);
SHARD_API void shard_free(void *p);

SHARD_API const char *shard_strerror(int status);
/* The message of the last failed call on ctx ("" if none); with ctx NULL, the message of this
 * thread's last failed shard_attach. */
SHARD_API const char *shard_last_error(const shard_ctx_t *ctx);

#ifdef __cplusplus
}
#endif
#endif

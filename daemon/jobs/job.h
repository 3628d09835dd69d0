/* A job on this node: what was registered (model, plan, layout), its state machine, and its
 * parts, each owned by one file. job.c, its core, and this header are below every operation;
 * the job's life is job_life.h's, its memory job_mem.h's. Opaque here, a pointer each: push rounds
 * (push.c), the step (step.c), the optimizer (optimizer.c), loading (loading.c), resuming
 * (resume.c), checkpoints (checkpoint.c), the schedule (schedule.c), the secondary copies
 * (secondary.c), the quantized buffers (quant.c). Still defined here: memory (job_mem.c), the unit
 * cache (unit_cache.c), transfers across nodes (job_net.c, fetch.c) and the statistics (stats.c).
 * job.c fails jobs; job_life.c registers and retires them. job.h includes registry.h: a job's
 * daemon (job->reg) is part of it. */
#ifndef SD_JOB_H
#define SD_JOB_H

#include "coll/coll.h"
#include "registry.h"
#include "stats.h"
#include "unit_cache.h"
#include "sd/gpu.h"
#include "sd/hmac.h"
#include "sd/model.h"
#include "shard.pb-c.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct sd_session;
struct sd_fsid;
struct sd_net;
struct sd_sec_state;     /* secondary.c's */
struct sd_job_sched;     /* schedule.c's */
struct sd_push_state;    /* push.c's */
struct sd_step_state;    /* step.c's */
struct sd_optim_state;   /* optimizer.c's */
struct sd_loading_state; /* loading.c's */
struct sd_resume_state;  /* resume.c's */
struct sd_values_state;  /* values.c's */
struct sd_ckpt_job;

/* ranks one node serves in a job, at most: a gather's waiting ranks are a 64-bit set */
#define SD_MAX_LOCAL_RANKS 64

/* ---- jobs */
/* CLOSING: a rank detached cleanly; like FAILED, no collective can complete any more */
/* FINISHED: every rank left after a clean end; kept (memory freed) for shardctl */
enum sd_job_state {
    SD_JOB_REGISTERING,
    SD_JOB_LOADING,
    SD_JOB_READY,
    SD_JOB_FAILED,
    SD_JOB_CLOSING,
    SD_JOB_FINISHED
};
const char *sd_job_state_name(enum sd_job_state s);
const char *sd_job_name(const struct sd_job *job);
/* a call of this job failed (its statistics) */
void sd_job_count_error(struct sd_job *job);

/* Gathers the frozen schedule issues together, waiting to leave as one transfer per peer:
 * consecutive unit ids [lo, hi] of one copy, each smaller than coalesce_bytes. */
struct sd_gather_batch {
    struct sd_unit_state *units[SD_BULK_MAX_PIECES];
    uint32_t n, lo, hi, lslot;
    uint64_t bytes;
    uint64_t qbytes; /* with ,qw: the encoded bytes the batch receives */
};

/* The quantized collectives' buffers (quant.c, plan options ,qw ,qg ,ef), one allocation in the
 * backend's memory, laid out at registration. */

/* A job's memory, all allocated at registration (job_mem.c). */
struct sd_job_mem {
    struct sd_mem *arena; /* [k * SD_STATE_COUNT] */
    /* The gathered weights, on the device of local rank 0 (where gathers write them); with ranks
     * on several GPUs, a copy on each other one (pool_copy), refreshed after every write of a
     * slot (sd_job_pool_publish) before its readers are answered: a rank reads its GPU's. */
    struct sd_mem pool;
    struct sd_mem *pool_copy; /* [n_pool_copies] */
    uint32_t n_pool_copies;
    struct sd_mem *staging; /* [k]: each rank's staging slots, in the backend's memory */
    /* [k]: each rank's control page, host memory: its fence page (sd/fence.h), then its step
     * arguments and a save's directory */
    struct sd_mem *fence;
    uint32_t *fence_count; /* [2k]: per rank, pushes taken and fetches answered */
    uint64_t staging_slot_bytes;
    uint32_t staging_slots;
    uint64_t step_args_off, step_args_bytes; /* each rank's step arguments, in its control page */
    uint64_t save_path_off; /* then the directory of a save (SD_CKPT_PATH_MAX bytes) */
    uint64_t bytes_total;
    uint64_t alloc_start_ns, alloc_ns; /* allocating the job's memory: since, and how long */
    struct sd_mem scratch_mem;         /* in the backend's memory: a unit in fp32 */
    float *scratch;                    /* scratch_mem's */
    uint64_t *w_off; /* per unit: byte offset of the unit's w shard in a rank's w arena */
    uint64_t w_arena_bytes;
    uint64_t max_live_bytes;      /* from the registration; 0: the daemon's */
    struct sd_gpu_queue *queue;   /* the device work of the job's operations, in order */
    struct sd_quant_state *quant; /* the quantized collectives' buffers: quant.c's */
    bool allocating;              /* a worker thread backs its buffers (job_alloc_work) */
    bool doomed; /* dropped while allocating or while a file task ran: freed (not kept for
                  * shardctl) once the worker is done */
};

/* Push rounds (push.c): [unit][group][generation][member] for the g-partition groups on this
 * node; round n of a (unit, group) collects in generation n % round_gens. Across nodes, up to
 * round_gens node rounds are on the wire at once. */

/* Where a job's state comes from and goes: resuming (resume.c), the job's checkpoints
 * (checkpoint.c's own state) and loading the initial values (rank 0's, a checkpoint's, or a
 * paused job's) with the ready barrier (loading.c's own). */
struct sd_load_state {
    struct sd_resume_state *resume; /* resuming (resume.c) */
    struct sd_ckpt_job *ckpt;       /* checkpoints: the one loaded, saves (checkpoint.c) */
    struct sd_loading_state *init;  /* the initial values and the ready barrier (loading.c) */
    struct sd_values_state *values; /* values written into and read out of it (values.c) */
};

/* The secondary partition (secondary.c, plan option ,sec=S): S ranks of a node hold one copy
 * of every unit's weights, 1/S each, refilled from the first gather of each weights generation,
 * so the unit's later gathers of that generation copy from them instead of gathering within the
 * w group. Group g is local ranks [g S, g S + S) and serves the copies of its ranks (all of the
 * node's with the hierarchical gather: only group 0 is allocated then). */

/* A job's transfers across nodes (job_net.c, fetch.c); unused on one node. */
#define SD_JOB_LEADER_MAX 64 /* "ip:port" of an independent daemon's job leader */

struct sd_job_xfer {
    struct sd_net *net;
    uint32_t tag; /* job id in transport tags, agreed through the coordinator */
    struct sd_bulk_pool bulks;
    void **mr_handles;
    void **mr_descs;
    const void **mr_base;
    size_t *mr_len;
    uint32_t n_mrs;
    uint64_t *wait_tags; /* [n_slots * k] */
    /* 1 + the weights generation before the last written one (loading.c; 0: none): peers'
     * requests of it, in flight when this node's ranks wrote, are served with the written
     * weights (their requesters drop those copies, not of their generation) */
    uint64_t pre_write_gen1;
    struct sd_req_msg *read_req; /* a rank's read's pull requests (values.c), registered */
    bool os_registered;          /* the os arenas too (sd_job_net_reg_os, on a peer's read) */
    /* releases a trainer's stream signals later (sd/fence.h, release_seq), per copy and rank
     * ([n_slots * k]): holds kept until the rank's page counts the last of them (fetch.c) */
    uint32_t *rel_pending, *rel_need;
    uint32_t rel_total;
    bool rel_blocked; /* a gather waits for a place such a hold keeps: the loop polls the pages */
    /* units whose waiters are answered once the device wrote their slots: FIFO (fetch.c) */
    struct sd_unit_state **answer_q; /* [n_slots] */
    uint32_t aq_head, aq_len;
    uint32_t gathers_inflight;
    uint32_t w_sends_inflight;
    struct sd_gather_batch batch;
    struct sd_req_msg *req_queue; /* requests waiting for a newer generation or readiness */
    uint32_t req_queued, req_cap;
    bool enc_wait; /* ,qw: requests wait for the encodings up to enc_ticket (fetch.c) */
    uint64_t enc_ticket;
    uint32_t *members; /* scratch list of member nodes */
    bool paths_wait;   /* confirmed, waiting for its nodes' data paths (probes) before loading */
    /* [nodes]: the cluster node (the transport's peer) of each job node, known once the
     * coordinator confirmed the job (SD_NODE_UNKNOWN before, but this node's own) */
    uint32_t *node_ids;
    /* an ended job listed after its independent daemon closed the fabric: node_ids hold the
     * daemons' ids (what shardctl shows of them), the cluster's numbers having gone with it */
    bool node_ids_are_daemon_ids;
    struct sd_transport *tp; /* the job's view of the transport: peers are job nodes
                              * (job_tp.c) */
    /* the job's token (Register.job_token: its ranks' secret, hashed with its name), which its
     * report to the coordinator carries; token_len 0: a job without a secret */
    uint8_t token[SD_JOB_TOKEN_BYTES];
    uint32_t token_len;
    /* an independent daemon's: where the job's leader takes its peers ("ip:port"; its ranks'
     * Register.leader, "" on the leader itself) */
    char leader[SD_JOB_LEADER_MAX];
};

struct sd_job {
    struct sd_job *next;
    struct sd_registry *reg;
    char name[64];
    uint64_t id;
    uid_t uid;
    enum sd_job_state state;
    int fail_status;
    char fail_msg[384];
    struct sd_model model;
    uint64_t digest;
    struct sd_plan plan;
    struct sd_topo topo;
    struct sd_layout layout;
    uint32_t world, k, first_rank;
    /* The job's nodes are numbered by its ranks: node n serves ranks n * k .. n * k + k - 1,
     * whichever cluster nodes they run on (xfer.node_ids). node is this one. Everything about
     * the job's shape works in job nodes; only the transport (sd_job_tp) and the control plane
     * see cluster nodes. */
    uint32_t node, nodes;
    uint32_t gnodes[SD_STATE_COUNT]; /* nodes per partition group of each state (f / k when
                                        f > k, else 1) */
    uint32_t slots_per_unit;         /* 1, or k without the hierarchical gather across nodes */
    uint32_t n_slots;
    struct sd_session **ranks; /* [k], by local index */
    uint32_t n_registered, n_left;
    uint64_t created_ns, register_deadline_ns;
    bool retire_pending; /* all ranks left; memory goes once the network is idle */
    bool was_ready;      /* reached READY: after a clean detach, ready still answers */
    uint64_t steps, weights_gen;
    struct sd_optim_state *opt; /* optimizer.c's */
    struct sd_job_stats stats;
    struct sd_job_mem mem;
    struct sd_sec_state *sec; /* secondary.c's */
    struct sd_unit_cache cache;
    struct sd_push_state *push; /* push.c's */
    struct sd_step_state *step; /* step.c's */
    struct sd_load_state load;
    struct sd_job_xfer xfer;
    struct sd_job_sched *sched; /* schedule.c's */
};

/* ---- identity and failure (job.c) */
/* Is token (len bytes) the job's (Register.job_token)? Compared in constant time. */
bool sd_job_token_is(const struct sd_job *job, const void *token, size_t len);
/* A job name: 1..63 of A-Z a-z 0-9 . _ - : , + = @, not starting with '.' or '-' (it names
 * shared-memory files and log lines, and may name checkpoint directories: no '/', no space, no
 * control character, no quote). */
bool sd_job_name_valid(const char *name);
/* The ranks per node a registration gives its job: its own, else the daemon's ranks_per_node,
 * else (one daemon, none configured) the whole world. */
uint32_t sd_job_ranks_per_node(const struct sd_config *cfg, const Shard__Register *msg);
/* Fail the job: every parked operation completes with status and the message; the job's other
 * nodes are told. */
void sd_job_fail(struct sd_job *job, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The same with the text as it is; tell_peers: the job's other nodes are told (with the steps
 * taken, so that a pause, status SD_EPAUSED, happens at the same step everywhere: resume.h). */
void sd_job_fail_text(struct sd_job *job, int status, const char *text, bool tell_peers);
/* The same for a failure another node reported: nobody else is told; its_dump: that node's
 * flight recorder dump as its message named it ("": none), named after this node's own. */
void sd_job_fail_from_peer(struct sd_job *job, int status, const char *text, const char *its_dump);
/* How a failure's message names the node's flight recorder dump: text SD_TRACE_TAIL path ... */
#define SD_TRACE_TAIL " (flight recorder: "
/* Complete every module's parked calls with status and msg (the job failed, paused or closes);
 * with_fetches: ranks waiting for an in-flight gather too. */
void sd_job_fail_parked(struct sd_job *job, int status, const char *msg, bool with_fetches);
/* Tell the job's other nodes it failed (or paused) here: the nodes the coordinator confirmed,
 * or before that, those that reported it. */
void sd_job_abort_peers(struct sd_job *job, int status, const char *msg);
/* Does a module wait for the job's device queue to pass a ticket (job_module.h, queue_waiting)?
 * Then the loop polls them: true if something moved. */
bool sd_job_queue_waiting(const struct sd_job *job);
bool sd_job_queue_poll(struct sd_job *job);

/* A ticket after everything enqueued on the job's queue so far (kernels write what is read next:
 * by the CPU, the network or a client; the loop never waits for the device), and whether the
 * device reached it: SD_OK, SD_EAGAIN (not yet; or `behind` earlier tickets the caller still
 * waits for, whose order it keeps), or the backend's error (then sd_job_backend_failed). The
 * host backends reach it at once. */
int sd_job_queue_mark(struct sd_job *job, bool behind, uint64_t *ticket_p);
/* Fail the job for the backend's error status. */
void sd_job_backend_failed(struct sd_job *job, int status);

/* ---- shape facts every operation may ask (job.c): from the plan, the job's nodes and the
 * daemon's config, the same from creation to the end */
/* Do pushes reduce across nodes in node rounds (push.c): more than one node, and the gradients'
 * partition groups span nodes or there is no 2-hop? */
bool sd_job_node_rounds(const struct sd_job *job);
/* generations of push rounds at once (push_rounds across nodes; 1 inside a node: a round is
 * reduced once complete) */
uint32_t sd_job_push_gens(const struct sd_job *job);
/* Does the weights' all-gather after the optimizer cross nodes (f_w < f_os, f_os > k)? */
bool sd_job_weights_remote(const struct sd_job *job);

/* ---- the gathered weights on the job's GPUs (job.c) */
/* The slot at pool offset off, bytes long, was written (a gather, a refresh): copied into the
 * pool's copies on the job's other GPUs, on the job's queue (its readers are answered after a
 * mark behind it). Nothing where the job's ranks share one device. */
void sd_job_pool_publish(struct sd_job *job, uint64_t off, uint64_t bytes);
/* The device local rank `local`'s buffers live on (config devices, through the registry). */
static inline int sd_job_rank_device(const struct sd_job *job, uint32_t local)
{
    return sd_registry_rank_device(job->reg, local);
}
/* The gathered weights local rank `local` maps: the pool, or its copy on the rank's GPU. */
const struct sd_mem *sd_job_rank_pool(const struct sd_job *job, uint32_t local);
/* Rank `local`'s control page at offset off (host memory). */
static inline uint8_t *sd_job_control(struct sd_job *job, uint32_t local, uint64_t off)
{
    return (uint8_t *)job->mem.fence[local].ptr + off;
}

/* local rank local's arena of one state (SD_STATE_W, ...): the allocation */
static inline struct sd_mem *sd_job_arena(struct sd_job *job, uint32_t local, int state)
{
    return &job->mem.arena[local * SD_STATE_COUNT + state];
}

/* Cache colouring of the arenas. The optimizer streams five arrays at once (w, g, master, m, v);
 * laid out page-aligned with power-of-two sizes, as the arenas come out of the allocator, they all
 * start at the same offset in a page, so every access of one element hits one cache set and
 * loads alias earlier stores to the other arrays (4K aliasing): AdamW on 64M parameters took
 * 1.24 s instead of 0.07 s. Each state's data therefore starts SD_ARENA_COLOUR bytes (an odd
 * number of cache lines, not a divisor of a page) further into its allocation than the previous
 * state's, and the optimizer's master, m and v arrays are SD_ARENA_COLOUR bytes more than a
 * whole number of pages apart. */
#define SD_ARENA_COLOUR 2112u
#define SD_ARENA_PAGE   4096u

/* where state's data begins in its allocation */
static inline uint64_t sd_arena_colour(int state)
{
    return (uint64_t)state * SD_ARENA_COLOUR;
}

/* floats from one optimizer array (master, m, v) of an os arena to the next */
static inline uint64_t sd_arena_os_stride(uint64_t os_numel)
{
    uint64_t bytes = (os_numel * sizeof(float) + SD_ARENA_PAGE - 1) / SD_ARENA_PAGE * SD_ARENA_PAGE;
    return (bytes + SD_ARENA_COLOUR) / sizeof(float);
}

/* local rank local's data of one state */
static inline void *sd_job_state(struct sd_job *job, uint32_t local, int state)
{
    return (uint8_t *)sd_job_arena(job, local, state)->ptr + sd_arena_colour(state);
}

/* staging slot slot of local rank local: where its pushed gradient waits for the round */
static inline uint8_t *sd_job_staging_slot(struct sd_job *job, uint32_t local, uint32_t slot)
{
    return (uint8_t *)job->mem.staging[local].ptr + (uint64_t)slot * job->mem.staging_slot_bytes;
}

/* bytes of one rank's weight shard of unit u */
static inline uint64_t sd_job_w_shard_bytes(const struct sd_job *job, uint32_t u)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    return ul->numel / job->plan.f[SD_STATE_W] * sd_dtype_size(ul->dtype);
}

/* local rank local's weight shard of unit u (in the unit's dtype) */
static inline uint8_t *sd_job_w_shard(struct sd_job *job, uint32_t local, uint32_t u)
{
    return (uint8_t *)sd_job_state(job, local, SD_STATE_W) + job->mem.w_off[u];
}

/* local rank local's optimizer state s (0 the fp32 masters, then the moments) of unit ul: its
 * os shard */
static inline float *sd_job_os_state(struct sd_job *job, uint32_t local, uint32_t s,
                                     const struct sd_unit_layout *ul)
{
    return (float *)sd_job_state(job, local, SD_STATE_OS) +
           s * sd_arena_os_stride(job->layout.arena_numel[SD_STATE_OS]) +
           ul->arena_off[SD_STATE_OS];
}

/* the part of local rank local's fp32 gradient shard of unit u that its optimizer-state shard
 * covers (the nesting of model.h: os in g in w) */
static inline float *sd_job_os_grad(struct sd_job *job, uint32_t local, uint32_t u)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    return (float *)sd_job_state(job, local, SD_STATE_G) + ul->arena_off[SD_STATE_G] +
           sd_plan_nested_off(&job->plan, SD_STATE_OS, SD_STATE_G, job->first_rank + local,
                              ul->numel);
}

/* the same part of its weight shard of unit u, in the unit's dtype */
static inline uint8_t *sd_job_os_weights(struct sd_job *job, uint32_t local, uint32_t u)
{
    const struct sd_unit_layout *ul = &job->layout.units[u];
    return sd_job_w_shard(job, local, u) + sd_plan_nested_off(&job->plan, SD_STATE_OS, SD_STATE_W,
                                                              job->first_rank + local, ul->numel) *
                                               sd_dtype_size(ul->dtype);
}

/* local rank local's fp32 gradient shard of unit ul */
static inline float *sd_job_g_shard(struct sd_job *job, uint32_t local,
                                    const struct sd_unit_layout *ul)
{
    return (float *)sd_job_state(job, local, SD_STATE_G) + ul->arena_off[SD_STATE_G];
}

/* Count bytes copied inside the node from local rank src's memory to local rank dst's, under
 * op, by the link between them (stats.h): one package, or two of the node. */
/* The same for a copy of encoded bytes standing for raw bytes unquantized (stats.h's saved). */
static inline void sd_job_count_coded(struct sd_job *job, int op, uint32_t src, uint32_t dst,
                                      uint64_t raw, uint64_t encoded)
{
    uint32_t P = sd_topo_package(&job->topo);
    int c = src / P == dst / P ? SD_LINK_PACKAGE : SD_LINK_NODE;
    job->stats.bytes[op][c] += encoded;
    job->stats.saved[op][c] += (int64_t)raw - (int64_t)encoded;
}

static inline void sd_job_count_copy(struct sd_job *job, int op, uint32_t src, uint32_t dst,
                                     uint64_t bytes)
{
    sd_job_count_coded(job, op, src, dst, bytes, bytes);
}

/* the copy of a unit a local rank uses: the node's one, or its own without the hierarchy */
static inline struct sd_unit_state *sd_job_slot(struct sd_job *job, uint32_t unit, uint32_t local)
{
    return sd_unit_cache_slot(&job->cache, unit, local);
}

/* the control plane (NULL on a single node) and the file workers of the job's node: the one way
 * to each from a job (job.c) */
struct sd_cluster *sd_job_cluster(const struct sd_job *job);
#define SD_NODE_UNKNOWN UINT32_MAX
/* the cluster node of job node n (SD_NODE_UNKNOWN before the confirmation) */
static inline uint32_t sd_job_node_id(const struct sd_job *job, uint32_t n)
{
    return n < job->nodes ? job->xfer.node_ids[n] : SD_NODE_UNKNOWN;
}
/* Job node n as a failure message names it: "node 2 (cluster node 7)", or "node 2" where its
 * cluster node is not known; into buf (len bytes), which it returns. */
const char *sd_job_peer_name(const struct sd_job *job, uint32_t n, char *buf, size_t len);
/* job node n is up (its cluster node alive), as far as this node knows */
bool sd_job_node_alive(const struct sd_job *job, uint32_t n);
/* the job node that cluster node id is (SD_NODE_UNKNOWN: none of the job's) */
uint32_t sd_job_node_of(const struct sd_job *job, uint32_t id);
struct sd_file_pool *sd_job_files(const struct sd_job *job);

#endif

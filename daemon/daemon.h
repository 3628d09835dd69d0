/* shardd internals: connections and the server (server.c), client sessions and their rings
 * (session.c), jobs and their registry (job.c), the data-plane operations of a job (job_ops.c),
 * the gather pool allocator (slot_pool.c), the admin JSON (admin.c). */
#ifndef SD_DAEMON_H
#define SD_DAEMON_H

#include "sd/config.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/ring.h"
#include "sd/schedule.h"
#include "coll/coll.h"
#include "shard.pb-c.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

struct sd_server;
struct sd_session;
struct sd_job;

/* ---- gather pool: offsets inside one pre-allocated region, first fit, no malloc after init */
struct sd_extent {
    uint64_t off, len;
};
struct sd_slot_pool {
    uint64_t capacity;
    uint32_t n_used, max_used;
    struct sd_extent *used; /* sorted by offset */
};
int sd_slot_pool_init(struct sd_slot_pool *p, uint64_t capacity, uint32_t max_extents);
void sd_slot_pool_fini(struct sd_slot_pool *p);
/* Returns 0 and the offset, or SD_ENOSPC. align must be a power of two. */
int sd_slot_pool_alloc(struct sd_slot_pool *p, uint64_t len, uint64_t align, uint64_t *off_p);
void sd_slot_pool_free(struct sd_slot_pool *p, uint64_t off);
/* Mark [off, off + len) used (rebuilding the list from places decided elsewhere). */
int sd_slot_pool_take(struct sd_slot_pool *p, uint64_t off, uint64_t len);
uint64_t sd_slot_pool_used_bytes(const struct sd_slot_pool *p);

/* ---- statistics */
#define SD_LAT_SAMPLES 2048
struct sd_latency {
    uint64_t count;
    uint32_t samples_ns[SD_LAT_SAMPLES]; /* the most recent ones, ring order */
};
void sd_latency_add(struct sd_latency *l, uint64_t ns);
/* q in [0, 1]; sorts a copy on the stack, for the admin path only */
double sd_latency_quantile_us(const struct sd_latency *l, double q);

enum sd_link_class {
    SD_LINK_INTRA = 0,
    SD_LINK_INTER_SENT = 1,
    SD_LINK_INTER_RECV = 2,
    SD_LINK_COUNT
};
struct sd_job_stats {
    uint64_t ops[SD_OP_COUNT];
    uint64_t errors;
    uint64_t bytes[SD_OP_COUNT][SD_LINK_COUNT]; /* by the operation that moved them */
    uint64_t gathers, cache_hits, evictions;
    uint64_t coalesced_gathers, coalesced_units; /* transfers that moved several units, and those */
    uint64_t allocs_after_register;
    uint64_t pool_bytes;
    uint32_t push_rounds_peak; /* gradient reductions across nodes on the wire at once, at most */
    struct sd_latency lat[SD_OP_COUNT];
};

/* ---- connection: one accepted socket, maybe with a session */
struct sd_conn {
    struct sd_conn *next;
    struct sd_server *srv;
    uint64_t id;
    int fd;
    uv_poll_t poll;
    uint8_t *rx;
    size_t rx_len, rx_cap;
    pid_t pid;
    uid_t uid;
    gid_t gid;
    struct sd_session *session;
    bool closing;
};

int sd_conn_send(struct sd_conn *c, const Shard__DaemonMsg *msg, const int *fds, unsigned nfds);
int sd_conn_send_error(struct sd_conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void sd_conn_close(struct sd_conn *c, const char *why);

/* ---- session: an attached client with its ring */
struct sd_session {
    struct sd_session *next;
    struct sd_server *srv;
    struct sd_conn *conn;
    uint64_t id;
    struct sd_mem ring;
    struct sd_ring_hdr *hdr;
    int sq_efd, cq_efd;
    uv_poll_t sq_poll;
    /* job membership */
    struct sd_job *job;
    uint32_t rank, local;
    bool registered; /* the job accepted our registration and sent the layout */
    uint32_t *holds; /* per unit: fetches not yet released */
    uint64_t staging_busy;
    bool has_stalled;
    struct sd_sqe stalled;
    uint64_t stalled_ns;
    bool broken; /* protocol violation on the ring: stop reading it */
};

int sd_session_create(struct sd_conn *c, const Shard__Attach *msg);
/* Leave the job (if any) and free the session; reason appears in the job's error. */
void sd_session_destroy(struct sd_session *s, const char *reason);
/* Drain the ring; returns true if any entry was consumed or a stalled one went through. */
bool sd_session_progress(struct sd_session *s);
void sd_session_complete(struct sd_session *s, uint64_t tag, int op, int status, uint64_t v0,
                         uint64_t v1, const char *msg);
void sd_session_fail(struct sd_session *s, const struct sd_sqe *e, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

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

#define SD_FINISHED_JOBS_KEPT 16

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
    uv_loop_t *loop; /* for allocating off the loop; NULL: allocate in place */
};

struct sd_push_entry {
    struct sd_session *s;
    uint64_t tag;
    uint64_t arrive_ns;
    uint32_t slot;
};

struct sd_push_round {
    uint32_t arrived;
    uint64_t first_ns;
    uint64_t seq; /* which round of its (unit, group) it collects: the micro-step */
};

/* A pull request for a unit's weights block (SD_TAG_REQ), 32 bytes on the wire. */
#define SD_REQ_MAGIC 0x51455253u
struct sd_req_msg {
    uint32_t magic;
    uint16_t job_tag;
    uint16_t src;
    uint32_t unit;
    uint32_t lslot;
    uint64_t gen;
    uint32_t n_units; /* a coalesced request: units [unit, unit + n_units); 0 or 1: one */
    uint32_t reserved;
};
_Static_assert(sizeof(struct sd_req_msg) == 32, "request layout is ABI");

/* The network side of the registry: the transport, the control plane, the standing receives
 * for pull requests. NULL on a single node. */
#define SD_NET_REQ_SLOTS 64
struct sd_net_req {
    struct sd_xfer x;
    struct sd_req_msg msg;
    struct sd_registry *reg;
};
/* pull requests for a job this node has not confirmed yet (the coordinator's confirmation can
 * arrive after a faster node already asks): kept briefly, retried on confirmation */
#define SD_NET_EARLY_REQS 256
struct sd_net {
    bool posted;
    struct sd_req_msg early[SD_NET_EARLY_REQS];
    uint64_t early_ns[SD_NET_EARLY_REQS];
    uint32_t n_early;
    struct sd_transport *tp;
    struct sd_cluster *cl;
    uint32_t self, n;
    struct sd_net_req reqs[SD_NET_REQ_SLOTS];
    void *reqs_desc, *reqs_mr; /* reqs registered (providers with FI_MR_LOCAL) */
};

/* A gathered copy of a unit: one per unit, or one per unit and local rank when the hierarchical
 * gather is off. Across nodes a gather is in flight until every remote block arrived. */
struct sd_unit_state {
    uint64_t pool_off; /* bytes; valid while resident */
    uint64_t gen;      /* weights generation that was gathered */
    uint64_t lru_tick;
    uint64_t start_ns;
    uint32_t refs;
    uint32_t unit, lslot;
    uint32_t plan_iv;   /* the frozen schedule's gather whose place it occupies, or NONE */
    uint32_t remaining; /* remote blocks still to arrive */
    uint64_t waiters;   /* local ranks whose fetch waits for this gather */
    bool resident, inflight;
    int status;
    uint32_t suspect;
    struct sd_bulk **rb;   /* [group nodes - 1] */
    struct sd_xfer *req_x; /* [group nodes - 1] */
    struct sd_req_msg req;
    struct sd_job *job;
    struct sd_unit_state *batch_next; /* the next unit of a coalesced gather this one leads */
};

/* Gathers the frozen schedule issues together, waiting to leave as one transfer per peer:
 * consecutive unit ids [lo, hi] of one copy, each smaller than coalesce_bytes. */
struct sd_gather_batch {
    struct sd_unit_state *units[SD_BULK_MAX_PIECES];
    uint32_t n, lo, hi, lslot;
    uint64_t bytes;
};

/* A push round that crosses nodes: node partial, reduce-scatter in the partition group, and
 * without the 2-hop sync an all-reduce across the replication group, every micro-step. Up to
 * push_rounds of them are on the wire at once, each with its own buffers; they are applied to the
 * g shards in the order they started, so the sums do not depend on which finishes first. */
struct sd_node_round {
    struct sd_job *job;
    bool net_done; /* its transfers (and all-reduce) finished */
    uint32_t unit;
    uint64_t seq, start_ns;
    uint32_t pending;
    int status;
    uint32_t suspect;
    size_t chunk;
    float *part; /* the node partial: buf, or the one rank's fp32 staging slot */
    float *buf;  /* [max unit] the node partial when it must be summed (NULL if never) */
    float *rs_recv, *rs_out, *ar_tmp; /* [G - 1 blocks], [block], [ar_tmp_count] */
    uint32_t chunk_arrivals[SD_TAG_MAX_CHUNKS];
    struct sd_allreduce ar;
};

/* a local round whose pushes all arrived, waiting for a node round */
struct sd_round_ref {
    uint32_t unit;
    uint64_t seq;
};

/* The schedule of a job on this node (schedule.c): recorded during the first step, checked
 * between ranks and nodes at the step boundary, then frozen and replayed with prefetch into
 * pool places planned offline. A call off the schedule falls back to on-demand fetching for the
 * rest of the step and a new schedule is recorded. */
enum sd_sched_state { SD_SCHED_RECORDING, SD_SCHED_FROZEN, SD_SCHED_OFF };
const char *sd_sched_state_name(enum sd_sched_state s);
struct sd_job_sched {
    enum sd_sched_state state;
    uint32_t cap;      /* calls recorded per rank and step at most */
    uint32_t *rec;     /* [k * cap] this step's calls per local rank */
    uint32_t *rec_len; /* [k] */
    bool overflow;     /* a rank made more calls than cap: not frozen */
    bool freeze_next;  /* the recording checked out: frozen when the step completes */
    bool deviated;     /* this step left the schedule: on demand until the step ends */
    uint64_t digest;   /* of this node's recording (0: not recording), exchanged between nodes */
    uint32_t n;        /* frozen calls per step */
    uint32_t *ops;     /* [cap] */
    struct sd_sched_plan plan;
    uint32_t *scratch;    /* the planner's */
    uint64_t *slot_bytes; /* [n_units] */
    uint64_t stride;      /* bytes between a unit's per-rank copies (no hierarchical gather) */
    struct sd_sched_params params; /* as planned (prefetch depth may be lowered to fit) */
    uint32_t *cursor;              /* [k] next position of each local rank */
    uint32_t lead;                 /* the furthest position a local rank reached this step */
    uint32_t *pf_next; /* [k] next gather to issue, per copy (one copy with the hierarchy) */
    bool in_prefetch;  /* a gather that completes at once must not re-enter */
    uint32_t want_iv;  /* the gather a fetch being served uses, else NONE */
    uint64_t want_off;
    uint64_t frozen_at_step;
    uint64_t freezes, invalidations, deviations, prefetches, prefetch_hits, waits, conflicts;
    uint64_t cpu_ns[2], fetches[2]; /* fetch handling: [0] not frozen, [1] frozen */
    uint64_t issue_ns[2];           /* of cpu_ns: starting gathers (the same work either way) */
    uint64_t issue_ns_in_call;      /* gather starts while a fetch call is timed */
    bool in_call;                   /* scheduled_op is timing a call */
    uint64_t allocs_frozen;         /* allocations made while serving calls on the schedule */
};

/* what each node contributes at a step: its part of the gradient norm, and the digest and
 * length of the schedule it recorded in this step (0 when not recording) */
struct sd_norm_part {
    double sumsq;
    uint64_t digest, n;
};

enum sd_step_phase { SD_STEP_IDLE, SD_STEP_SYNC, SD_STEP_NORM, SD_STEP_APPLY, SD_STEP_REFRESH };

struct sd_job {
    struct sd_job *next;
    struct sd_registry *reg;
    char name[64];
    uint64_t id;
    uid_t uid;
    enum sd_job_state state;
    int fail_status;
    char fail_msg[256];
    struct sd_model model;
    uint64_t digest;
    struct sd_plan plan;
    struct sd_topo topo;
    struct sd_layout layout;
    uint64_t *w_off; /* per unit: byte offset of the unit's w shard in a rank's w arena */
    uint64_t w_arena_bytes;
    uint32_t world, k, node, first_rank;
    struct sd_session **ranks; /* [k], by local index */
    uint32_t n_registered, n_left;
    uint64_t created_ns, register_deadline_ns;
    uint64_t max_live_bytes; /* from the registration; 0: the daemon's */
    /* memory, all allocated at registration */
    struct sd_mem *arena; /* [k * SD_STATE_COUNT] */
    struct sd_mem pool;
    struct sd_mem *staging; /* [k] */
    uint64_t staging_slot_bytes;
    uint32_t staging_slots;
    uint64_t bytes_total;
    uint64_t alloc_start_ns, alloc_ns; /* allocating the job's memory: since, and how long */
    float *scratch;
    struct sd_slot_pool spool;
    struct sd_unit_state *units;
    uint64_t tick;
    /* push rounds: [unit][group][generation][member] for the g-partition groups on this node;
     * round n of a (unit, group) collects in generation n % round_gens */
    uint32_t g_groups, g_members, round_gens;
    struct sd_push_round *rounds;
    struct sd_push_entry *round_entries;
    uint64_t *rounds_done; /* [unit][group] rounds completed: the oldest one collecting */
    /* barriers */
    uint32_t step_arrived;
    uint64_t step_first_ns;
    uint64_t *step_tags, *step_arrive_ns;
    bool *step_waiting;
    bool *ready_waiting;
    uint64_t *ready_tags;
    uint64_t steps, weights_gen;
    double last_grad_norm;
    struct sd_job_stats stats;
    /* ---- across nodes (job_net.c); nodes == 1 leaves all of this unused */
    uint32_t nodes;          /* the job spans nodes [0, nodes) */
    uint32_t tag;            /* job id in transport tags, agreed through the coordinator */
    uint32_t group_nodes;    /* nodes per partition group (f / k when f > k, else 1) */
    uint32_t slots_per_unit; /* 1, or k without the hierarchical gather across nodes */
    uint32_t n_slots;
    bool node_rounds;    /* pushes reduce across nodes (or all-reduce without 2-hop) */
    bool retire_pending; /* all ranks left; memory goes once the network is idle */
    bool allocating;     /* a worker thread backs its buffers (job_alloc_work) */
    bool doomed;         /* dropped while allocating: freed once the worker is done */
    bool was_ready;      /* reached READY: after a clean detach, ready still answers */
    struct sd_net *net;
    struct sd_bulk_pool bulks;
    void **mr_handles;
    void **mr_descs;
    const void **mr_base;
    size_t *mr_len;
    uint32_t n_mrs;
    uint64_t *wait_tags; /* [n_slots * k] */
    uint32_t gathers_inflight;
    uint32_t w_sends_inflight;
    struct sd_gather_batch batch;
    struct sd_req_msg *req_queue; /* requests waiting for a newer generation or readiness */
    uint32_t req_queued, req_cap;
    struct sd_node_round *nr; /* [round_gens] ring of node rounds, oldest at nr_head */
    uint32_t nr_head, nr_len;
    struct sd_round_ref *round_queue; /* local rounds complete, waiting for a node round: FIFO */
    uint32_t rq_head, rq_len, rq_cap;
    float *nr_mem; /* the node rounds' buffers, one registration */
    size_t ar_tmp_count;
    uint32_t *members; /* scratch list of member nodes */
    /* step */
    enum sd_step_phase step_phase;
    uint32_t step_unit, step_pending;
    uint64_t step_start_ns;
    int step_status;
    uint32_t step_suspect;
    struct sd_allreduce step_ar;
    struct sd_norm_part *norm_parts; /* [nodes] */
    struct sd_bulk **norm_b;
    double local_sumsq;
    /* init */
    uint32_t init_next_unit;
    bool init_done, remote_ready;
    struct sd_bulk *init_rb;
    struct sd_session *init_waiter;
    uint64_t init_tag;
    uint32_t init_sends;
    struct sd_job_sched sched;
};

void sd_registry_init(struct sd_registry *reg, const struct sd_config *cfg,
                      const struct sd_gpu_ops *dev);
/* Handle a Register message; replies now (error) or once every rank arrived. */
void sd_job_register(struct sd_registry *reg, struct sd_session *s, const Shard__Register *msg);
/* A session leaves its job: detach or disconnect. */
void sd_job_leave(struct sd_job *job, struct sd_session *s, const char *reason);
/* Fail the job: every parked operation completes with status and the message. */
void sd_job_fail(struct sd_job *job, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Check deadlines of registrations and parked operations. */
void sd_registry_sweep(struct sd_registry *reg, uint64_t now_ns);
void sd_registry_destroy_all(struct sd_registry *reg);
/* Active job by name. */
struct sd_job *sd_registry_find(struct sd_registry *reg, const char *name);
/* Active job by name, else the most recent ended one. */
struct sd_job *sd_registry_find_any(struct sd_registry *reg, const char *name);

/* cluster events (cluster.c calls these) */
void sd_job_confirmed(struct sd_registry *reg, const char *name, uint32_t tag);
void sd_job_refused(struct sd_registry *reg, const char *name, int status, const char *msg);
void sd_job_aborted(struct sd_registry *reg, const char *name, int status, const char *msg);
void sd_job_remote_ready(struct sd_registry *reg, const char *name);
void sd_registry_node_down(struct sd_registry *reg, uint32_t node, const char *reason);
/* every node's ranks left the job: free it */
void sd_job_ended(struct sd_registry *reg, const char *name);
bool sd_registry_tag_in_use(struct sd_registry *reg, uint32_t tag);
uint32_t sd_registry_job_nodes(struct sd_registry *reg, const char *name);
struct sd_job *sd_registry_find_tag(struct sd_registry *reg, uint32_t tag);

/* job_net.c: the parts of a job that cross nodes */
int sd_net_start(struct sd_registry *reg, struct sd_transport *tp, struct sd_cluster *cl);
/* standing receives for pull requests, once the cluster formed (idempotent) */
int sd_net_post_requests(struct sd_registry *reg);
void sd_net_stop(struct sd_registry *reg);
/* true while transfers beyond the standing request receives are in flight */
bool sd_net_busy(const struct sd_registry *reg);
/* a job was confirmed: serve the requests that came for it too early */
void sd_net_job_confirmed(struct sd_registry *reg, struct sd_job *job);
/* bytes of network buffers a job needs on this node */
uint64_t sd_job_net_bytes(const struct sd_job *job, const struct sd_config *cfg);
int sd_job_net_setup(struct sd_job *job, char *err, size_t errlen);
void sd_job_net_teardown(struct sd_job *job);
bool sd_job_net_idle(const struct sd_job *job);
void sd_job_net_cancel(struct sd_job *job);
/* fetch of a unit whose partition group spans nodes: false to stall the ring */
bool sd_job_net_fetch(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      struct sd_unit_state *us);
/* a push round of all local ranks completed: reduce across nodes */
void sd_job_net_round_ready(struct sd_job *job, uint32_t unit, uint64_t seq);
void sd_job_net_step(struct sd_job *job);
void sd_job_net_init_sent(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                          const float *values);
void sd_job_net_loading(struct sd_job *job);
void sd_job_net_ready(struct sd_job *job);
void sd_job_net_sweep(struct sd_job *job, uint64_t now);
/* describe the operation in flight, for failure messages */
void sd_job_net_describe(const struct sd_job *job, char *out, size_t len);
/* The nodes the job's unfinished transfers are with, "0, 2" ("" when none). */
void sd_job_net_pending_peers(const struct sd_job *job, char *out, size_t len);

/* job_ops.c helpers shared with job_net.c */
void sd_job_local_gather(struct sd_job *job, struct sd_unit_state *us, uint32_t rank);
void sd_job_finish_round(struct sd_job *job, uint32_t unit, uint32_t group);
void sd_job_step_apply(struct sd_job *job, double sumsq);
void sd_job_step_done(struct sd_job *job);
void sd_job_complete_fetch(struct sd_job *job, struct sd_unit_state *us);
void sd_job_set_ready(struct sd_job *job);
void sd_job_load_unit(struct sd_job *job, uint32_t unit, const float *src);
int sd_job_pool_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p);
/* Drop a cached copy nobody holds from the pool (counted as an eviction). */
void sd_job_evict(struct sd_job *job, struct sd_unit_state *us);
bool sd_job_others_hold(const struct sd_job *job, const struct sd_session *s);

/* local rank local's arena of one state (SD_STATE_W, ...): the allocation */
static inline struct sd_mem *sd_job_arena(struct sd_job *job, uint32_t local, int state)
{
    return &job->arena[local * SD_STATE_COUNT + state];
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
    return (uint8_t *)job->staging[local].ptr + (uint64_t)slot * job->staging_slot_bytes;
}

/* Push rounds are kept [unit][group][generation]: round n of (unit u, g-partition group g)
 * collects in generation n % round_gens. gi indexes job->rounds; its members' entries start at
 * gi * g_members in job->round_entries. */
static inline size_t sd_job_round_index(const struct sd_job *job, uint32_t u, uint32_t g,
                                        uint64_t n)
{
    return ((size_t)u * job->g_groups + g) * job->round_gens + (size_t)(n % job->round_gens);
}

static inline struct sd_push_entry *sd_job_round_ents(struct sd_job *job, size_t gi)
{
    return &job->round_entries[gi * job->g_members];
}

/* the unit and the group of round slot gi */
static inline uint32_t sd_job_round_unit(const struct sd_job *job, size_t gi)
{
    return (uint32_t)(gi / job->round_gens / job->g_groups);
}

static inline uint32_t sd_job_round_group(const struct sd_job *job, size_t gi)
{
    return (uint32_t)(gi / job->round_gens % job->g_groups);
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
    return (uint8_t *)sd_job_state(job, local, SD_STATE_W) + job->w_off[u];
}

/* local rank local's fp32 gradient shard of unit ul */
static inline float *sd_job_g_shard(struct sd_job *job, uint32_t local,
                                    const struct sd_unit_layout *ul)
{
    return (float *)sd_job_state(job, local, SD_STATE_G) + ul->arena_off[SD_STATE_G];
}

/* the copy of a unit a local rank uses: the node's one, or its own without the hierarchy */
static inline struct sd_unit_state *sd_job_slot(struct sd_job *job, uint32_t unit, uint32_t local)
{
    return &job->units[(size_t)unit * job->slots_per_unit + (job->slots_per_unit > 1 ? local : 0)];
}

/* schedule.c */
int sd_sched_alloc(struct sd_job *job);
void sd_sched_free(struct sd_job *job);
/* before a fetch, release or push is served: the position it matches (SD_SCHED_NONE if none) */
uint32_t sd_sched_before(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
/* after it was served (consumed) or stalled: records it, or advances the rank on the schedule
 * and issues the prefetches that allows; true if the call was served on the frozen schedule */
bool sd_sched_after(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint32_t pos,
                    bool consumed);
/* every local rank called step: check the recording (false after failing the job) */
bool sd_sched_step_check(struct sd_job *job);
/* the schedules nodes [first, first + count) of this node's partition group recorded in this
 * step (parts indexed by node; digest 0: not recording): false after failing the job */
struct sd_norm_part;
bool sd_sched_check_nodes(struct sd_job *job, uint32_t first, uint32_t count,
                          const struct sd_norm_part *parts);
/* the step completed: freeze, re-record or rewind, and prefetch the first gathers */
void sd_sched_step_done(struct sd_job *job);
/* issue the gathers the plan wants by now (retried after every call and gather) */
void sd_sched_prefetch(struct sd_job *job);
/* the pool place of a fetch being served: SD_OK, SD_EAGAIN (a slower rank still uses the
 * place: wait), or SD_ENOENT (not planned: allocate on demand) */
int sd_sched_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p);
/* allocation calls made by this thread (counted where the allocator can be wrapped) */
uint64_t sd_alloc_calls(void);
extern const bool sd_alloc_counted;
uint64_t sd_thread_cpu_ns(void);

/* The CPU time of starting gathers (copying this node's shards into the pool, posting the
 * transfers), counted only while scheduled_op times a fetch call: elsewhere nothing reads it. */
static inline uint64_t sd_job_issue_clock(const struct sd_job *job)
{
    return job->sched.in_call ? sd_thread_cpu_ns() : 0;
}

static inline void sd_job_issue_count(struct sd_job *job, uint64_t t0)
{
    if (job->sched.in_call)
        job->sched.issue_ns_in_call += sd_thread_cpu_ns() - t0;
}

/* job_net.c: start the gather of a slot whose pool place is set (prefetch); SD_EAGAIN when
 * no transfer resources are free now */
int sd_job_net_prefetch(struct sd_job *job, struct sd_unit_state *us);
/* would a gather of unit (copy lslot) join the open batch? */
bool sd_job_net_would_join(const struct sd_job *job, uint32_t unit, uint32_t lslot);
/* send the gathers sd_job_net_prefetch coalesced (a no-op when none wait) */
void sd_job_net_prefetch_flush(struct sd_job *job);

/* job_ops.c: returns true if consumed, false if the entry must wait (stall the ring) */
bool sd_job_op(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e);
void sd_job_release_holds(struct sd_job *job, struct sd_session *s);
/* Complete parked operations with an error: push rounds, step and ready barriers, stalled
 * entries, and (with_fetches) ranks waiting for an in-flight gather. */
void sd_job_fail_parked(struct sd_job *job, int status, const char *msg, bool with_fetches);

/* ---- server */
struct sd_server {
    uv_loop_t *loop;
    const struct sd_config *cfg;
    struct sd_registry *reg;
    char sock_path[SD_PATH_MAX + 32];
    int lfd;
    uv_poll_t lpoll;
    struct sd_conn *conns;
    uint32_t n_conns;
    struct sd_session *sessions;
    uint32_t n_sessions;
    uv_idle_t idle;
    bool spinning;
    uint64_t last_activity_ns;
    uv_timer_t sweep;
    uint64_t start_ns;
    uint64_t next_id;
    bool stopping;
    struct sd_transport *tp; /* multi-node: progressed with the rings */
    uv_poll_t tpoll;
    bool tpolling;
    uv_timer_t net_timer; /* re-polls the fabric every ms while transfers wait for data */
    uint64_t last_net_ns; /* the last time a transfer completed */
    uint64_t polls;       /* passes of the polling loop since start (shardctl status) */
};

int sd_server_start(struct sd_server *srv, uv_loop_t *loop, const struct sd_config *cfg,
                    struct sd_registry *reg);
void sd_server_stop(struct sd_server *srv);
/* Run every session's ring until nothing moves; then spin or sleep. */
void sd_server_progress(struct sd_server *srv);
void sd_server_kick(struct sd_server *srv);
/* Progress this transport with the rings, and wake on its wait fd. */
void sd_server_attach_transport(struct sd_server *srv, struct sd_transport *tp);
void sd_server_detach_transport(struct sd_server *srv);

/* admin.c: JSON reply to an admin command; *json_p is malloc'd */
int sd_admin_handle(struct sd_server *srv, const Shard__AdminRequest *req, char **json_p);

#endif

/* Model description, plan, topology and group math, layout: pure functions, no I/O.
 *
 * Vocabulary follows DESIGN.md section 1. A rank r lives on node r / k at local index r % k, in
 * package (r % k) / package_size. For a state X with shard factor f, the partition group of r is
 * the f consecutive ranks [r - r % f, r - r % f + f); the replication group of r is the
 * world / f ranks {r % f + j * f}, which hold the same shard of X.
 *
 * Nested shards. With f_w | f_g | f_os, write r = d0 + f_w d1 + f_g d2 + f_os d3 (d0 < f_w,
 * d1 < f_g / f_w, d2 < f_os / f_g). Rank r holds
 *     w shard   d0
 *     g shard   d0 (f_g / f_w) + d1
 *     os shard  (d0 (f_g / f_w) + d1) (f_os / f_g) + d2
 * so each of its g shard's f_os / f_g parts is some rank's os shard and its os shard lies in its
 * g shard, which lies in its w shard: a rank keeps only the gradients and optimizer states of
 * parameters it holds (ZeRO-topo). With equal factors every shard index is r % f, as in MiCS. */
#ifndef SD_MODEL_H
#define SD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SD_MAX_NAME    96
#define SD_MAX_DIMS    8
#define SD_MAX_TENSORS 65536
#define SD_MAX_UNITS   16384
#define SD_MAX_WORLD   65536
/* parameters of one model, at most: every byte count derived from it fits 64 bits */
#define SD_MAX_MODEL_NUMEL (1ULL << 48)
/* tensor starts and shard boundaries are aligned to this many elements (64 B of bf16) */
#define SD_ALIGN_ELEMS 32

enum sd_dtype { SD_DTYPE_FP32 = 0, SD_DTYPE_BF16 = 1, SD_DTYPE_FP16 = 2, SD_DTYPE_COUNT };
enum sd_state { SD_STATE_W = 0, SD_STATE_G = 1, SD_STATE_OS = 2, SD_STATE_COUNT };
/* the optimizers the daemon runs, as torch.optim computes them: AdamW (decoupled weight decay),
 * SGD (momentum, dampening 0), Adam (weight decay added to the gradient) and SGD with Nesterov
 * momentum; Adam's states are AdamW's, Nesterov's SGD's (sd_optim_layout) */
enum sd_optim_kind {
    SD_OPTIM_ADAMW = 0,
    SD_OPTIM_SGD = 1,
    SD_OPTIM_ADAM = 2,
    SD_OPTIM_SGD_NESTEROV = 3,
    /* any other optimizer, run by the trainer on its rank's own shard at each step's hand-off
     * (DESIGN.md section 3): the daemon keeps its fp32 masters and N per-element fp32 states
     * (SD_OPTIM_TRAINER + N, "trainer<N>", N <= SD_OPTIM_TRAINER_MAX_STATES) and the step
     * count, hands the reduced gradient shard over and takes the updated shard back */
    SD_OPTIM_TRAINER = 4,
    SD_OPTIM_KINDS = SD_OPTIM_TRAINER + 5
};
#define SD_OPTIM_TRAINER_MAX_STATES 4

size_t sd_dtype_size(int dtype);
const char *sd_dtype_name(int dtype);
int sd_dtype_parse(const char *name); /* -1 if unknown */
const char *sd_state_name(int state);

struct sd_topo {
    uint32_t nodes;
    uint32_t ranks_per_node; /* k */
    uint32_t package_size;   /* ranks that share a package (2 GCDs of an MI250X); 0 means 1 */
};

static inline uint32_t sd_topo_package(const struct sd_topo *t)
{
    return t->package_size ? t->package_size : 1;
}

static inline uint32_t sd_topo_world(const struct sd_topo *t)
{
    return t->nodes * t->ranks_per_node;
}
static inline uint32_t sd_topo_node_of(const struct sd_topo *t, uint32_t rank)
{
    return rank / t->ranks_per_node;
}

/* A group: member j is first + j * stride, j < count. */
struct sd_group {
    uint32_t first, count, stride;
};

static inline uint32_t sd_group_member(const struct sd_group *g, uint32_t j)
{
    return g->first + j * g->stride;
}
struct sd_group sd_group_partition(uint32_t f, uint32_t rank);
struct sd_group sd_group_replication(uint32_t world, uint32_t f, uint32_t rank);
/* Number of distinct nodes a group touches. */
uint32_t sd_group_nodes(const struct sd_topo *t, const struct sd_group *g);

struct sd_plan {
    char name[64];              /* as given: "ddp", "zero3", "mics:2", "topo:2/4/8,qw" */
    uint32_t f[SD_STATE_COUNT]; /* shard factor per state: f_w | f_g | f_os | world */
    uint32_t sec;               /* ,sec=S: secondary partition over S ranks of a node; 0: none (see
                                   sd_plan_sec_active) */
    bool hierarchical;          /* gather remote shards once per node (MiCS) */
    bool two_hop;               /* sync gradients across groups only at the step (MiCS) */
    /* quantized collectives (sd/codec.h), all in blocks of qblock elements: */
    bool qw;   /* ,qw: weight gathers move int8 blocks (ZeRO++ qwZ) */
    bool qg;   /* ,qg: reduce-scatters across nodes move int4 blocks (ZeRO++ qgZ) */
    bool qsec; /* ,qsec: the secondary partition is kept as int8 blocks */
    bool ef;   /* ,ef: error feedback for qg (the quantization error goes into the next one) */
    uint32_t qblock; /* ,qblock=B; SD_PLAN_QBLOCK unless given */
    bool hop_ar;     /* ,hop-ar: the boundary hop all-reduces where it could reduce-scatter */
    /* ,gwire=bf16|fp16|fp32: the dtype of gradients that cross nodes unquantized (the push
     * rounds' blocks and the boundary hop; ,qg's int4 blocks stay int4), each sent rounded
     * once and summed in fp32 at its owner (sd/codec.h's float codecs); SD_DTYPE_FP32: exact */
    int gwire;
};

/* The codec of the gradients that cross nodes unquantized: 0 (fp32, exact), SD_CODEC_BF16 or
 * SD_CODEC_FP16 (sd/codec.h) */
int sd_plan_gwire_codec(const struct sd_plan *plan);

/* the default block of the quantized options: ZeRO++'s group size for weights */
#define SD_PLAN_QBLOCK 2048

/* Does the plan quantize anything? */
static inline bool sd_plan_quantized(const struct sd_plan *plan)
{
    return plan->qw || plan->qg || plan->qsec;
}

/* Parse a plan for a topology: topo:W/G/OS (each a number, k or n) or a preset (ddp = 1/1/1,
 * zero1 = 1/1/n, zero2 = 1/n/n, zero3 = n/n/n, mics:P = P/P/P, topo-fp = min(2,k)/k/n, topo =
 * topo-fp,qw,qg,qsec as ZeRO-topo ran it, zeropp = zero3,qw,qg,sec=k as ZeRO++ did), then
 * options ,no-hier ,no-2hop ,hop-ar ,sec=S ,qw ,qg ,qsec ,ef ,qblock=B ,gwire=D (,qsec without
 * sec=S keeps a secondary over the package; ,ef needs ,qg). Refused (SD_EINVAL, err names the
 * factor and the rule) unless every factor divides the next and the world, and each aligns with a
 * topology level: it divides the package, or is a multiple of the package that divides the node, or
 * a multiple of the node. */
int sd_plan_parse(const char *spec, const struct sd_topo *topo, struct sd_plan *plan_p, char *err,
                  size_t errlen);

/* Does the secondary partition change anything? It lets a unit's later fetches of one weights
 * generation gather within S ranks of a node instead of the f_w ranks of the w group, so it
 * does when f_w > S: a w group that spans nodes (ZeRO++'s hpZ), or, inside a node, one that
 * spans more packages than S ranks do. With f_w <= S it is accepted and holds nothing. */
static inline bool sd_plan_sec_active(const struct sd_plan *plan)
{
    return plan->sec != 0 && plan->f[0] > plan->sec;
}

/* The boundary hop's owners: with the 2-hop sync across R = nodes / G_g > 1 nodes that hold
 * replicas of a node's g block, not int4 (no ,qg), and f_os = world, every element of the block has
 * its optimizer state on exactly one of the R nodes, 1/R of the block on each (the os shards nest
 * in the g shards, and a node's replicas differ in the piece they own). The hop then packs the
 * block with each owner's pieces together and needs the sums only there: */
bool sd_plan_hop_owned(const struct sd_plan *plan, uint32_t nodes, uint32_t k);
/* so, unless ,hop-ar, it reduce-scatters them to the owners, (R - 1) / R of the block per node
 * instead of the all-reduce's 2 (R - 1) / R. */
bool sd_plan_hop_scatters(const struct sd_plan *plan, uint32_t nodes, uint32_t k);

/* The shard of state that rank holds, in [0, f[state]) (the nesting above). */
uint32_t sd_plan_shard(const struct sd_plan *plan, int state, uint32_t rank);
/* Its inverse: where in a partition group of state (0 .. f[state] - 1) the holder of shard is. */
uint32_t sd_plan_shard_pos(const struct sd_plan *plan, int state, uint32_t shard);
/* Where rank's shard of state inner begins inside its shard of state outer (f[outer] <=
 * f[inner]), in elements of a unit of numel. */
uint64_t sd_plan_nested_off(const struct sd_plan *plan, int inner, int outer, uint32_t rank,
                            uint64_t numel);

/* the optimizer: its kind, clipping, and the hyperparameters of parameter group 0 */
struct sd_optim {
    int kind;
    float lr, beta1, beta2, eps, weight_decay, momentum;
    float max_grad_norm; /* 0: no clipping */
};

/* the hyperparameters of one parameter group (torch.optim's param_groups): set at registration,
 * changed by any step (a learning-rate schedule) */
struct sd_hparams {
    float lr, beta1, beta2, eps, weight_decay, momentum;
};

#define SD_MAX_GROUPS 4096

struct sd_tensor_desc {
    char name[SD_MAX_NAME];
    uint32_t ndim;
    uint64_t dims[SD_MAX_DIMS];
    int dtype;
    uint32_t unit;
    uint32_t group; /* parameter group, < sd_model_groups() */
};

struct sd_model {
    uint32_t n_tensors;
    struct sd_tensor_desc *tensors;
    struct sd_optim optim;
    /* parameter groups: n_groups 0 is one group, the optimizer's hyperparameters; else groups
     * [0, n_groups) (malloc'd; the optimizer's hyperparameters are group 0's) */
    uint32_t n_groups;
    struct sd_hparams *groups;
    /* skip, as torch's optimizers do, a tensor that no rank gave a gradient in a step (its
     * moments and step count stay): each step carries the ranks' tensors that had one */
    bool skip_unused;
    /* bytes global rank 0 broadcasts to every rank with each step (shard.torch: the module
     * buffers, as DDP's broadcast_buffers); 0: none */
    uint64_t bcast_bytes;
    char plan[64];
};

static inline uint32_t sd_model_groups(const struct sd_model *m)
{
    return m->n_groups ? m->n_groups : 1;
}
/* group g's hyperparameters as registered */
struct sd_hparams sd_model_group(const struct sd_model *m, uint32_t g);
/* A step's arguments (shard_step_ex), written by the rank into its staging memfd at
 * RegisterReply.step_args_off: this header, then n_groups struct sd_hparams, then n_tensors bytes
 * (nonzero: this rank gave the tensor a gradient since the last step), padded to 8 bytes, then
 * the model's bcast_bytes (padded to 8): global rank 0 writes there what it broadcasts, and the
 * daemon writes it there for every other rank before the step completes. The step's ring entry
 * says in arg0 which parts were written (SD_STEP_ARG_*); parts not written mean the
 * hyperparameters of the last step, every tensor, and nothing broadcast. The daemon copies the
 * arguments before it checks them. */
struct sd_step_args {
    uint32_t n_groups, n_tensors;
};
#define SD_STEP_ARG_HPARAMS  1u
#define SD_STEP_ARG_HAS_GRAD 2u
#define SD_STEP_ARG_BCAST    4u /* every rank sets it alike: rank 0's broadcast area goes out */
/* a trainer optimizer's update is written (SD_STATE_OWN): the step goes on to the weights */
#define SD_STEP_ARG_UPDATED 8u
/* the ranks' gradients of this step were multiplied by a loss scale, which the step's ring
 * entry carries in arg1 (a double's bits; finite, positive): the daemon divides the sums by it
 * before the norm, the clipping and the optimizer. Every rank of the job gives the same one. */
#define SD_STEP_ARG_SCALED 16u
#define SD_MAX_BCAST_BYTES (64ull << 20)
_Static_assert(sizeof(struct sd_hparams) == 24, "step arguments layout is ABI");

/* where the broadcast area starts in the step arguments */
static inline uint64_t sd_step_args_bcast_off(uint32_t n_groups, uint32_t n_tensors)
{
    return sizeof(struct sd_step_args) + (uint64_t)n_groups * sizeof(struct sd_hparams) +
           ((uint64_t)n_tensors + 7) / 8 * 8;
}

static inline uint64_t sd_step_args_bytes(uint32_t n_groups, uint32_t n_tensors,
                                          uint64_t bcast_bytes)
{
    return sd_step_args_bcast_off(n_groups, n_tensors) + (bcast_bytes + 7) / 8 * 8;
}

/* hyperparameters h for an optimizer of kind: finite and in sane ranges; err names group g and
 * the field */
int sd_hparams_validate(int kind, const struct sd_hparams *h, uint32_t g, char *err, size_t errlen);

uint64_t sd_tensor_numel(const struct sd_tensor_desc *t);
/* Digest over every field that must agree across ranks. */
uint64_t sd_model_digest(const struct sd_model *m);
/* Check a model for internal consistency; message in err. */
int sd_model_validate(const struct sd_model *m, char *err, size_t errlen);
/* Check the optimizer's hyperparameters: finite and in sane ranges; err names the field. */
int sd_optim_validate(const struct sd_optim *o, char *err, size_t errlen);
/* Describe the first difference between two models ("tensor 3 'fc.w': dims[1] 64 vs 32"). */
void sd_model_diff(const struct sd_model *a, const struct sd_model *b, char *out, size_t outlen);

struct sd_tensor_layout {
    uint64_t offset; /* elements from the start of its unit */
    uint64_t numel;
};

struct sd_unit_layout {
    uint64_t numel; /* padded: splits into f aligned shards for every state */
    uint64_t used;  /* end of the last tensor (numel minus padding) */
    int dtype;
    uint32_t first_tensor, n_tensors;
    uint64_t arena_off[SD_STATE_COUNT]; /* element offset of this unit's shard in a rank's arena */
    uint64_t sec_off;  /* element offset of its secondary piece (numel / sec) in a holder's */
    uint64_t sec_boff; /* its byte offset there (int8 blocks with ,qsec) */
    uint64_t pool_off; /* element offset when every unit is resident (full size) */
};

struct sd_layout {
    uint32_t n_units, n_tensors;
    struct sd_unit_layout *units;
    struct sd_tensor_layout *tensors;
    uint32_t f[SD_STATE_COUNT];
    uint64_t arena_numel[SD_STATE_COUNT]; /* elements per rank per state */
    uint64_t sec_numel;   /* elements per holder of the secondary partition (0 if not active) */
    uint64_t sec_bytes;   /* the same in the units' dtypes, or encoded with ,qsec */
    uint64_t total_numel; /* sum of padded units */
    uint64_t max_unit_numel;
    uint64_t max_unit_bytes; /* in the unit's dtype */
    uint64_t total_bytes;    /* sum of padded units in their dtypes */
};

/* Compute the flat layout. Returns 0, SD_EINVAL (with err) or SD_ENOMEM. */
int sd_layout_build(const struct sd_model *m, const struct sd_plan *plan,
                    struct sd_layout *layout_p, char *err, size_t errlen);
void sd_layout_free(struct sd_layout *layout);

static inline uint64_t sd_unit_bytes(const struct sd_unit_layout *u)
{
    return u->numel * sd_dtype_size(u->dtype);
}
/* Shard of `unit` that `rank` holds of state: elements [begin, end) of the unit. */
static inline void sd_layout_shard(const struct sd_unit_layout *u, const struct sd_plan *plan,
                                   int state, uint32_t rank, uint64_t *begin_p, uint64_t *end_p)
{
    uint64_t len = u->numel / plan->f[state];
    *begin_p = (uint64_t)sd_plan_shard(plan, state, rank) * len;
    *end_p = *begin_p + len;
}

/* Optimizer state floats per parameter: fp32 master + moments. */
uint32_t sd_optim_state_floats(int kind);
/* "adamw", "sgd", "adam", "sgd-nesterov", "trainer0".."trainer4" (libshard's and the
 * checkpoints' names); "?" for an unknown kind */
const char *sd_optim_name(int kind);
int sd_optim_parse(const char *name); /* -1 if unknown */
/* the kind whose states kind keeps: SD_OPTIM_ADAMW (master, exp_avg, exp_avg_sq), SD_OPTIM_SGD
 * (master, momentum_buffer), or a trainer kind itself (master, state1..stateN) */
int sd_optim_layout(int kind);
/* the optimizer runs in the trainer (SD_OPTIM_TRAINER + N) */
bool sd_optim_in_trainer(int kind);

#endif

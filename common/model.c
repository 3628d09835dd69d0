#include "sd/model.h"
#include "sd/codec.h"
#include "sd/status.h"
#include "sd/util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t sd_dtype_size(int dtype)
{
    return dtype == SD_DTYPE_FP32 ? 4 : 2;
}

static const char *const dtype_names[SD_DTYPE_COUNT] = {"fp32", "bf16", "fp16"};

const char *sd_dtype_name(int dtype)
{
    return dtype >= 0 && dtype < SD_DTYPE_COUNT ? dtype_names[dtype] : "?";
}

int sd_dtype_parse(const char *name)
{
    for (int i = 0; i < SD_DTYPE_COUNT; i++)
        if (strcmp(name, dtype_names[i]) == 0)
            return i;
    return -1;
}

const char *sd_state_name(int state)
{
    static const char *const names[SD_STATE_COUNT] = {"w", "g", "os"};
    return state >= 0 && state < SD_STATE_COUNT ? names[state] : "?";
}

struct sd_group sd_group_partition(uint32_t f, uint32_t rank)
{
    struct sd_group g = {.first = rank - rank % f, .count = f, .stride = 1};
    return g;
}

struct sd_group sd_group_replication(uint32_t world, uint32_t f, uint32_t rank)
{
    struct sd_group g = {.first = rank % f, .count = world / f, .stride = f};
    return g;
}

uint32_t sd_group_nodes(const struct sd_topo *t, const struct sd_group *g)
{
    uint32_t n = 0, last = UINT32_MAX;
    for (uint32_t j = 0; j < g->count; j++) {
        uint32_t node = sd_topo_node_of(t, sd_group_member(g, j));
        if (node != last) { /* members are ascending, so nodes are too */
            n++;
            last = node;
        }
    }
    return n;
}

#define SD_PLAN_OPTIONS "no-hier, no-2hop, hop-ar, sec=S, qw, qg, qsec, ef, qblock=B, gwire=D"

/* one factor of topo:W/G/OS: a positive number, k (ranks per node) or n (world) */
static bool parse_factor(const char *tok, uint32_t k, uint32_t world, uint32_t *f_p)
{
    if (strcmp(tok, "k") == 0) {
        *f_p = k;
        return true;
    }
    if (strcmp(tok, "n") == 0) {
        *f_p = world;
        return true;
    }
    char *end;
    unsigned long v = strtoul(tok, &end, 10);
    if (tok[0] < '0' || tok[0] > '9' || *end != '\0' || v == 0 || v > SD_MAX_WORLD)
        return false;
    *f_p = (uint32_t)v;
    return true;
}

/* the factors of a base plan (no options) */
static int plan_factors(const char *spec, const char *base, uint32_t k, uint32_t world,
                        uint32_t f[SD_STATE_COUNT], char *err, size_t errlen)
{
    static const struct {
        const char *name;
        char w, g, os; /* '1', 'k' or 'n' */
    } presets[] = {{"ddp", '1', '1', '1'},    {"zero1", '1', '1', 'n'},  {"zero2", '1', 'n', 'n'},
                   {"zero3", 'n', 'n', 'n'},  {"zeropp", 'n', 'n', 'n'}, {"topo", '2', 'k', 'n'},
                   {"topo-fp", '2', 'k', 'n'}};
    for (size_t i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
        if (strcmp(base, presets[i].name) != 0)
            continue;
        const char c[SD_STATE_COUNT] = {presets[i].w, presets[i].g, presets[i].os};
        for (int s = 0; s < SD_STATE_COUNT; s++)
            f[s] = c[s] == '1' ? 1 : c[s] == 'k' ? k : c[s] == 'n' ? world : SD_MIN(2u, k);
        return SD_OK;
    }
    if (strncmp(base, "mics:", 5) == 0) {
        uint32_t p;
        if (!parse_factor(base + 5, k, world, &p)) {
            snprintf(err, errlen, "plan '%s': expected mics:P with P a positive integer", spec);
            return SD_EINVAL;
        }
        f[SD_STATE_W] = f[SD_STATE_G] = f[SD_STATE_OS] = p;
        return SD_OK;
    }
    if (strncmp(base, "topo:", 5) == 0) {
        char buf[64];
        snprintf(buf, sizeof(buf), "%s", base + 5);
        char *save = NULL, *tok = strtok_r(buf, "/", &save);
        int n = 0;
        for (; tok != NULL && n < SD_STATE_COUNT; tok = strtok_r(NULL, "/", &save), n++)
            if (!parse_factor(tok, k, world, &f[n]))
                break;
        if (n != SD_STATE_COUNT || tok != NULL) {
            snprintf(err, errlen,
                     "plan '%s': expected topo:W/G/OS, each a positive integer, k (ranks per "
                     "node) or n (world)",
                     spec);
            return SD_EINVAL;
        }
        return SD_OK;
    }
    snprintf(err, errlen,
             "unknown plan '%s' (supported: topo:W/G/OS, topo, topo-fp, ddp, zero1, zero2, zero3, "
             "zeropp, mics:P, each with options " SD_PLAN_OPTIONS ")",
             spec);
    return SD_EINVAL;
}

int sd_plan_parse(const char *spec, const struct sd_topo *topo, struct sd_plan *plan_p, char *err,
                  size_t errlen)
{
    uint32_t world = sd_topo_world(topo), k = topo->ranks_per_node, P = sd_topo_package(topo);
    struct sd_plan plan = {.hierarchical = true, .two_hop = true};

    if (spec == NULL || strlen(spec) >= sizeof(plan.name)) {
        snprintf(err, errlen, "plan is missing or longer than %zu characters",
                 sizeof(plan.name) - 1);
        return SD_EINVAL;
    }
    if (k == 0 || k % P != 0) {
        snprintf(err, errlen, "plan '%s': package_size %u does not divide the ranks per node (%u)",
                 spec, P, k);
        return SD_EINVAL;
    }
    /* options after the base plan: ",no-hier" (gather per rank across nodes), ",no-2hop"
     * (all-reduce gradients across groups every micro-step), ",sec=S", the quantized ones */
    char base[sizeof(plan.name)];
    snprintf(base, sizeof(base), "%s", spec);
    char *opt = strchr(base, ',');
    bool qblock_given = false;
    if (opt != NULL) {
        *opt++ = '\0';
        size_t olen = strlen(opt);
        if (olen == 0 || opt[0] == ',' || opt[olen - 1] == ',' || strstr(opt, ",,") != NULL) {
            snprintf(err, errlen,
                     "plan '%s': an empty option (a ',' with nothing after it); options "
                     "are " SD_PLAN_OPTIONS,
                     spec);
            return SD_EINVAL;
        }
        for (char *save = NULL, *tok = strtok_r(opt, ",", &save); tok;
             tok = strtok_r(NULL, ",", &save)) {
            if (strcmp(tok, "no-hier") == 0) {
                plan.hierarchical = false;
            } else if (strcmp(tok, "no-2hop") == 0) {
                plan.two_hop = false;
            } else if (strcmp(tok, "hop-ar") == 0) {
                plan.hop_ar = true;
            } else if (strcmp(tok, "qw") == 0) {
                plan.qw = true;
            } else if (strcmp(tok, "qg") == 0) {
                plan.qg = true;
            } else if (strcmp(tok, "qsec") == 0) {
                plan.qsec = true;
            } else if (strcmp(tok, "ef") == 0) {
                plan.ef = true;
            } else if (strncmp(tok, "sec=", 4) == 0) {
                if (!parse_factor(tok + 4, k, world, &plan.sec) || k % plan.sec != 0) {
                    snprintf(err, errlen,
                             "plan '%s': %s: S must be a positive integer that divides the ranks "
                             "per node (%u)",
                             spec, tok, k);
                    return SD_EINVAL;
                }
            } else if (strncmp(tok, "gwire=", 6) == 0) {
                const char *d = tok + 6;
                if (strcmp(d, "bf16") == 0)
                    plan.gwire = SD_DTYPE_BF16;
                else if (strcmp(d, "fp16") == 0)
                    plan.gwire = SD_DTYPE_FP16;
                else if (strcmp(d, "fp32") == 0)
                    plan.gwire = SD_DTYPE_FP32;
                else {
                    snprintf(err, errlen,
                             "plan '%s': %s: the gradients' wire dtype is bf16, fp16 or fp32", spec,
                             tok);
                    return SD_EINVAL;
                }
            } else if (strncmp(tok, "qblock=", 7) == 0) {
                char *end;
                unsigned long b = strtoul(tok + 7, &end, 10);
                if (tok[7] < '0' || tok[7] > '9' || *end != '\0' || b < SD_CODEC_MIN_BLOCK ||
                    b > SD_CODEC_MAX_BLOCK) {
                    snprintf(err, errlen,
                             "plan '%s': %s: the block must be an integer in [%u, %u] elements",
                             spec, tok, SD_CODEC_MIN_BLOCK, SD_CODEC_MAX_BLOCK);
                    return SD_EINVAL;
                }
                plan.qblock = (uint32_t)b;
                qblock_given = true;
            } else {
                snprintf(err, errlen, "plan '%s': unknown option '%s' (" SD_PLAN_OPTIONS ")", spec,
                         tok);
                return SD_EINVAL;
            }
        }
    }
    /* the presets that carry options */
    if (strcmp(base, "zeropp") == 0) {
        plan.qw = plan.qg = true;
        if (plan.sec == 0)
            plan.sec = k;
    } else if (strcmp(base, "topo") == 0) {
        plan.qw = plan.qg = plan.qsec = true;
    }
    if (plan.qsec && plan.sec == 0)
        plan.sec = P;
    if (plan.ef && !plan.qg) {
        snprintf(err, errlen,
                 "plan '%s': ef (error feedback) corrects the int4 gradient reduction: it needs qg",
                 spec);
        return SD_EINVAL;
    }
    if (qblock_given && !sd_plan_quantized(&plan)) {
        snprintf(err, errlen, "plan '%s': qblock sets the block of qw, qg or qsec: none is on",
                 spec);
        return SD_EINVAL;
    }
    if (plan.qblock == 0)
        plan.qblock = SD_PLAN_QBLOCK;
    int st = plan_factors(spec, base, k, world, plan.f, err, errlen);
    if (st != SD_OK)
        return st;
    static const char *const fname[SD_STATE_COUNT] = {"f_w", "f_g", "f_os"};
    for (int s = 0; s < SD_STATE_COUNT; s++) {
        uint32_t f = plan.f[s], next = s + 1 < SD_STATE_COUNT ? plan.f[s + 1] : world;
        const char *next_name = s + 1 < SD_STATE_COUNT ? fname[s + 1] : "the world size";
        if (next % f != 0) {
            snprintf(err, errlen,
                     "plan '%s': %s = %u does not divide %s (%u): the factors must nest, "
                     "f_w | f_g | f_os | world",
                     spec, fname[s], f, next_name, next);
            return SD_EINVAL;
        }
        /* a partition group is part of a package, whole packages of one node, or whole nodes */
        bool in_package = P % f == 0, in_node = f % P == 0 && k % f == 0, nodes = f % k == 0;
        if (!in_package && !in_node && !nodes) {
            snprintf(err, errlen,
                     "plan '%s': %s = %u does not align with the topology: it must divide the "
                     "package (%u ranks), or be a multiple of it that divides the node (%u "
                     "ranks), or be a multiple of the node",
                     spec, fname[s], f, P, k);
            return SD_EINVAL;
        }
    }
    snprintf(plan.name, sizeof(plan.name), "%s", spec);
    *plan_p = plan;
    return SD_OK;
}

uint32_t sd_plan_shard(const struct sd_plan *plan, int state, uint32_t rank)
{
    uint32_t W = plan->f[SD_STATE_W], G = plan->f[SD_STATE_G], OS = plan->f[SD_STATE_OS];
    uint32_t d0 = rank % W, d1 = rank % G / W, d2 = rank % OS / G;
    uint32_t g = d0 * (G / W) + d1;
    return state == SD_STATE_W ? d0 : state == SD_STATE_G ? g : g * (OS / G) + d2;
}

uint32_t sd_plan_shard_pos(const struct sd_plan *plan, int state, uint32_t shard)
{
    uint32_t W = plan->f[SD_STATE_W], G = plan->f[SD_STATE_G], OS = plan->f[SD_STATE_OS];
    if (state == SD_STATE_W)
        return shard;
    /* shard = g (OS / G) + d2 with g = d0 (G / W) + d1; the position is d0 + W d1 + G d2 */
    uint32_t g = state == SD_STATE_OS ? shard / (OS / G) : shard;
    uint32_t d2 = state == SD_STATE_OS ? shard % (OS / G) : 0;
    return g / (G / W) + W * (g % (G / W)) + G * d2;
}

bool sd_plan_hop_owned(const struct sd_plan *plan, uint32_t nodes, uint32_t k)
{
    uint32_t G = plan->f[SD_STATE_G], Gn = G > k ? G / k : 1;
    return plan->two_hop && !plan->qg && nodes / Gn > 1 && plan->f[SD_STATE_OS] == nodes * k;
}

int sd_plan_gwire_codec(const struct sd_plan *plan)
{
    return plan->gwire == SD_DTYPE_BF16   ? SD_CODEC_BF16
           : plan->gwire == SD_DTYPE_FP16 ? SD_CODEC_FP16
                                          : 0;
}

bool sd_plan_hop_scatters(const struct sd_plan *plan, uint32_t nodes, uint32_t k)
{
    return sd_plan_hop_owned(plan, nodes, k) && !plan->hop_ar;
}

uint64_t sd_plan_nested_off(const struct sd_plan *plan, int inner, int outer, uint32_t rank,
                            uint64_t numel)
{
    uint32_t per = plan->f[inner] / plan->f[outer]; /* inner shards in one outer shard */
    return (uint64_t)(sd_plan_shard(plan, inner, rank) % per) * (numel / plan->f[inner]);
}

uint32_t sd_optim_state_floats(int kind)
{
    if (sd_optim_in_trainer(kind))
        return 1 + (uint32_t)(kind - SD_OPTIM_TRAINER);     /* master + the trainer's states */
    return sd_optim_layout(kind) == SD_OPTIM_ADAMW ? 3 : 2; /* master + m + v, or + momentum */
}

bool sd_optim_in_trainer(int kind)
{
    return kind >= SD_OPTIM_TRAINER && kind < SD_OPTIM_KINDS;
}

static const char *const optim_names[SD_OPTIM_KINDS] = {"adamw",        "sgd",      "adam",
                                                        "sgd-nesterov", "trainer0", "trainer1",
                                                        "trainer2",     "trainer3", "trainer4"};

const char *sd_optim_name(int kind)
{
    return kind >= 0 && kind < SD_OPTIM_KINDS ? optim_names[kind] : "?";
}

int sd_optim_parse(const char *name)
{
    for (int k = 0; name != NULL && k < SD_OPTIM_KINDS; k++)
        if (strcmp(name, optim_names[k]) == 0)
            return k;
    return -1;
}

int sd_optim_layout(int kind)
{
    if (sd_optim_in_trainer(kind))
        return kind;
    return kind == SD_OPTIM_ADAMW || kind == SD_OPTIM_ADAM ? SD_OPTIM_ADAMW : SD_OPTIM_SGD;
}

uint64_t sd_tensor_numel(const struct sd_tensor_desc *t)
{
    uint64_t n = 1;
    for (uint32_t d = 0; d < t->ndim; d++)
        n *= t->dims[d];
    return n;
}

static uint64_t hash_float(uint64_t h, float f)
{
    return sd_hash_bytes(h, &f, sizeof(f));
}

uint64_t sd_model_digest(const struct sd_model *m)
{
    uint64_t h = sd_hash_u64(SD_FNV_SEED, m->n_tensors);
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        const struct sd_tensor_desc *t = &m->tensors[i];
        h = sd_hash_str(h, t->name);
        h = sd_hash_u64(h, t->ndim);
        for (uint32_t d = 0; d < t->ndim && d < SD_MAX_DIMS; d++)
            h = sd_hash_u64(h, t->dims[d]);
        h = sd_hash_u64(h, (uint64_t)t->dtype);
        h = sd_hash_u64(h, t->unit);
        h = sd_hash_u64(h, t->group);
    }
    h = sd_hash_u64(h, sd_model_groups(m)); /* as used: n_groups 0 and 1 alike */
    for (uint32_t g = 0; g < sd_model_groups(m); g++) {
        struct sd_hparams hp = sd_model_group(m, g);
        h = sd_hash_bytes(h, &hp, sizeof(hp));
    }
    h = sd_hash_u64(h, m->skip_unused);
    h = sd_hash_u64(h, m->bcast_bytes);
    const struct sd_optim *o = &m->optim;
    h = sd_hash_u64(h, (uint64_t)o->kind);
    h = hash_float(h, o->lr);
    h = hash_float(h, o->beta1);
    h = hash_float(h, o->beta2);
    h = hash_float(h, o->eps);
    h = hash_float(h, o->weight_decay);
    h = hash_float(h, o->momentum);
    h = hash_float(h, o->max_grad_norm);
    return sd_hash_str(h, m->plan);
}

static int cmp_name(const void *a, const void *b, void *arg)
{
    const struct sd_model *m = arg;
    uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
    int c = strcmp(m->tensors[i].name, m->tensors[j].name);
    return c != 0 ? c : (i > j) - (i < j);
}

/* Two tensors of one name: sorted, O(n log n) (comparing every pair held the daemon's loop
 * 19 s for 64K tensors). */
static int check_names_unique(const struct sd_model *m, char *err, size_t errlen)
{
    uint32_t *idx = malloc((size_t)m->n_tensors * sizeof(*idx));
    if (idx == NULL) {
        snprintf(err, errlen, "out of memory checking %u tensor names", m->n_tensors);
        return SD_ENOMEM;
    }
    for (uint32_t i = 0; i < m->n_tensors; i++)
        idx[i] = i;
    qsort_r(idx, m->n_tensors, sizeof(*idx), cmp_name, (void *)m);
    int st = SD_OK;
    for (uint32_t i = 1; i < m->n_tensors && st == SD_OK; i++)
        if (strcmp(m->tensors[idx[i - 1]].name, m->tensors[idx[i]].name) == 0) {
            snprintf(err, errlen, "tensors %u and %u share the name '%s'", idx[i - 1], idx[i],
                     m->tensors[idx[i]].name);
            st = SD_EINVAL;
        }
    free(idx);
    return st;
}

int sd_model_validate(const struct sd_model *m, char *err, size_t errlen)
{
    if (m->n_tensors == 0 || m->n_tensors > SD_MAX_TENSORS) {
        snprintf(err, errlen, "model has %u tensors; expected 1..%u", m->n_tensors, SD_MAX_TENSORS);
        return SD_EINVAL;
    }
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        const struct sd_tensor_desc *t = &m->tensors[i];
        if (memchr(t->name, '\0', sizeof(t->name)) == NULL || t->name[0] == '\0') {
            snprintf(err, errlen, "tensor %u: name is empty or longer than %d bytes", i,
                     SD_MAX_NAME - 1);
            return SD_EINVAL;
        }
        /* a checkpoint's manifest (JSON) holds the names: UTF-8 without control characters */
        size_t nlen = strlen(t->name);
        bool printable = true;
        for (size_t c = 0; c < nlen; c++)
            printable &= (uint8_t)t->name[c] >= 0x20 && t->name[c] != 0x7f;
        if (!sd_utf8_valid(t->name, nlen) || !printable) {
            snprintf(err, errlen,
                     "tensor %u: its name is not UTF-8 text (a byte sequence that is not UTF-8, "
                     "or a control character)",
                     i);
            return SD_EINVAL;
        }
        if (t->ndim > SD_MAX_DIMS) {
            snprintf(err, errlen, "tensor %u '%s': %u dimensions, at most %d", i, t->name, t->ndim,
                     SD_MAX_DIMS);
            return SD_EINVAL;
        }
        uint64_t n = 1;
        for (uint32_t d = 0; d < t->ndim; d++) {
            if (t->dims[d] == 0 || t->dims[d] > (1ULL << 40) / n) {
                snprintf(err, errlen, "tensor %u '%s': dimension %u is %llu (zero or too large)", i,
                         t->name, d, (unsigned long long)t->dims[d]);
                return SD_EINVAL;
            }
            n *= t->dims[d];
        }
        if (t->dtype < 0 || t->dtype >= SD_DTYPE_COUNT) {
            snprintf(err, errlen, "tensor %u '%s': unknown dtype %d", i, t->name, t->dtype);
            return SD_EINVAL;
        }
        if (t->unit >= SD_MAX_UNITS) {
            snprintf(err, errlen, "tensor %u '%s': unit %u, at most %d units", i, t->name, t->unit,
                     SD_MAX_UNITS);
            return SD_EINVAL;
        }
        if (i > 0 && t->unit != m->tensors[i - 1].unit && t->unit != m->tensors[i - 1].unit + 1) {
            snprintf(err, errlen,
                     "tensor %u '%s': unit %u after unit %u; units must be numbered 0, 1, 2, ... "
                     "in tensor order with each unit's tensors consecutive",
                     i, t->name, t->unit, m->tensors[i - 1].unit);
            return SD_EINVAL;
        }
        if (i == 0 && t->unit != 0) {
            snprintf(err, errlen, "tensor 0 '%s': the first unit must be 0, not %u", t->name,
                     t->unit);
            return SD_EINVAL;
        }
        if (t->group >= sd_model_groups(m)) {
            snprintf(err, errlen, "tensor %u '%s': parameter group %u, but the model has %u", i,
                     t->name, t->group, sd_model_groups(m));
            return SD_EINVAL;
        }
        if (i > 0 && t->unit == m->tensors[i - 1].unit && t->dtype != m->tensors[i - 1].dtype) {
            snprintf(err, errlen, "tensor %u '%s': dtype %s differs from %s of its unit %u", i,
                     t->name, sd_dtype_name(t->dtype), sd_dtype_name(m->tensors[i - 1].dtype),
                     t->unit);
            return SD_EINVAL;
        }
    }
    uint64_t total = 0; /* each tensor is below 2^40 elements: the sum cannot wrap */
    for (uint32_t i = 0; i < m->n_tensors; i++)
        total += sd_tensor_numel(&m->tensors[i]);
    if (total > SD_MAX_MODEL_NUMEL) {
        snprintf(err, errlen,
                 "model has %llu parameters; at most 2^48 (the daemon's sizes are computed in "
                 "64 bits)",
                 (unsigned long long)total);
        return SD_EINVAL;
    }
    int st = check_names_unique(m, err, errlen);
    if (st != SD_OK)
        return st;
    const struct sd_optim *o = &m->optim;
    if (o->kind < 0 || o->kind >= SD_OPTIM_KINDS) {
        snprintf(err, errlen, "unknown optimizer kind %d", o->kind);
        return SD_EINVAL;
    }
    if (m->n_groups > SD_MAX_GROUPS || (m->n_groups > 0 && m->groups == NULL)) {
        snprintf(err, errlen, "model has %u parameter groups; at most %d", m->n_groups,
                 SD_MAX_GROUPS);
        return SD_EINVAL;
    }
    for (uint32_t g = 0; g < m->n_groups; g++) {
        st = sd_hparams_validate(o->kind, &m->groups[g], g, err, errlen);
        if (st != SD_OK)
            return st;
    }
    if (m->bcast_bytes > SD_MAX_BCAST_BYTES) {
        snprintf(err, errlen, "%llu bytes to broadcast with each step; at most %llu",
                 (unsigned long long)m->bcast_bytes, (unsigned long long)SD_MAX_BCAST_BYTES);
        return SD_EINVAL;
    }
    return sd_optim_validate(o, err, errlen);
}

static struct sd_hparams optim_hparams(const struct sd_optim *o)
{
    return (struct sd_hparams){.lr = o->lr,
                               .beta1 = o->beta1,
                               .beta2 = o->beta2,
                               .eps = o->eps,
                               .weight_decay = o->weight_decay,
                               .momentum = o->momentum};
}

struct sd_hparams sd_model_group(const struct sd_model *m, uint32_t g)
{
    if (m->n_groups > 0)
        return m->groups[g < m->n_groups ? g : 0];
    return optim_hparams(&m->optim);
}

/* finite, and in the ranges torch's optimizers accept (an infinite lr or weight decay is a NaN
 * loss a few steps later, not an error a user can trace back); lr and weight decay only >= 0, as
 * torch checks them: a large lr is the user's choice (word_language_model's SGD uses 20) */
struct range {
    const char *name;
    float v, lo, hi;
    bool hi_open;
};

static int check_ranges(const struct range *f, size_t n, const char *what, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++) {
        float v = f[i].v;
        bool ok = isfinite(v) && v >= f[i].lo && (f[i].hi_open ? v < f[i].hi : v <= f[i].hi);
        if (!ok && isinf(f[i].hi)) {
            snprintf(err, errlen, "%s: %s is %g; it must be finite and at least %g", what,
                     f[i].name, v, f[i].lo);
            return SD_EINVAL;
        }
        if (!ok) {
            snprintf(err, errlen, "%s: %s is %g; it must be finite and in [%g, %g%s", what,
                     f[i].name, v, f[i].lo, f[i].hi, f[i].hi_open ? ")" : "]");
            return SD_EINVAL;
        }
    }
    return SD_OK;
}

static int check_hparams(const struct sd_hparams *h, const char *what, char *err, size_t errlen)
{
    const struct range f[] = {{"lr", h->lr, 0.0f, INFINITY, false},
                              {"beta1", h->beta1, 0.0f, 1.0f, true},
                              {"beta2", h->beta2, 0.0f, 1.0f, true},
                              {"eps", h->eps, 0.0f, 1.0f, false},
                              {"weight_decay", h->weight_decay, 0.0f, INFINITY, false},
                              {"momentum", h->momentum, 0.0f, 1.0f, true}};
    return check_ranges(f, sizeof(f) / sizeof(f[0]), what, err, errlen);
}

/* what's hyperparameters for an optimizer of kind: every field in range (SGD ignores the betas,
 * which default sanely), and Nesterov's momentum above 0, as torch requires */
static int check_kind_hparams(int kind, const struct sd_hparams *h, const char *what, char *err,
                              size_t errlen)
{
    int st = check_hparams(h, what, err, errlen);
    if (st == SD_OK && kind == SD_OPTIM_SGD_NESTEROV && !(h->momentum > 0.0f)) {
        snprintf(err, errlen, "%s: momentum is %g; Nesterov momentum needs it above 0 (as torch)",
                 what, (double)h->momentum);
        return SD_EINVAL;
    }
    return st;
}

int sd_hparams_validate(int kind, const struct sd_hparams *h, uint32_t g, char *err, size_t errlen)
{
    char what[48];
    snprintf(what, sizeof(what), "optimizer group %u", g);
    return check_kind_hparams(kind, h, what, err, errlen);
}

int sd_optim_validate(const struct sd_optim *o, char *err, size_t errlen)
{
    struct sd_hparams h = optim_hparams(o);
    int st = check_kind_hparams(o->kind, &h, "optimizer", err, errlen);
    if (st != SD_OK)
        return st;
    const struct range clip = {"max_grad_norm", o->max_grad_norm, 0.0f, 1e30f, false};
    return check_ranges(&clip, 1, "optimizer", err, errlen);
}

void sd_model_diff(const struct sd_model *a, const struct sd_model *b, char *out, size_t outlen)
{
    if (strcmp(a->plan, b->plan) != 0) {
        snprintf(out, outlen, "plan '%s' vs '%s'", a->plan, b->plan);
        return;
    }
    if (a->n_tensors != b->n_tensors) {
        snprintf(out, outlen, "%u tensors vs %u", a->n_tensors, b->n_tensors);
        return;
    }
    for (uint32_t i = 0; i < a->n_tensors; i++) {
        const struct sd_tensor_desc *x = &a->tensors[i], *y = &b->tensors[i];
        if (strcmp(x->name, y->name) != 0) {
            snprintf(out, outlen, "tensor %u: name '%s' vs '%s'", i, x->name, y->name);
            return;
        }
        if (x->ndim != y->ndim) {
            snprintf(out, outlen, "tensor %u '%s': %u dims vs %u", i, x->name, x->ndim, y->ndim);
            return;
        }
        for (uint32_t d = 0; d < x->ndim && d < SD_MAX_DIMS; d++)
            if (x->dims[d] != y->dims[d]) {
                snprintf(out, outlen, "tensor %u '%s': dims[%u] %llu vs %llu", i, x->name, d,
                         (unsigned long long)x->dims[d], (unsigned long long)y->dims[d]);
                return;
            }
        if (x->dtype != y->dtype) {
            snprintf(out, outlen, "tensor %u '%s': dtype %s vs %s", i, x->name,
                     sd_dtype_name(x->dtype), sd_dtype_name(y->dtype));
            return;
        }
        if (x->unit != y->unit) {
            snprintf(out, outlen, "tensor %u '%s': unit %u vs %u", i, x->name, x->unit, y->unit);
            return;
        }
        if (x->group != y->group) {
            snprintf(out, outlen, "tensor %u '%s': parameter group %u vs %u", i, x->name, x->group,
                     y->group);
            return;
        }
    }
    if (sd_model_groups(a) != sd_model_groups(b)) {
        snprintf(out, outlen, "%u parameter groups vs %u", sd_model_groups(a), sd_model_groups(b));
        return;
    }
    for (uint32_t g = 0; g < sd_model_groups(a); g++) {
        struct sd_hparams x = sd_model_group(a, g), y = sd_model_group(b, g);
        if (memcmp(&x, &y, sizeof(x)) != 0) {
            snprintf(out, outlen,
                     "parameter group %u: hyperparameters differ (lr %g vs %g, weight_decay %g "
                     "vs %g)",
                     g, x.lr, y.lr, x.weight_decay, y.weight_decay);
            return;
        }
    }
    if (a->skip_unused != b->skip_unused) {
        snprintf(out, outlen, "skip_unused %d vs %d", a->skip_unused, b->skip_unused);
        return;
    }
    if (a->bcast_bytes != b->bcast_bytes) {
        snprintf(out, outlen, "broadcast bytes per step %llu vs %llu (the module buffers differ)",
                 (unsigned long long)a->bcast_bytes, (unsigned long long)b->bcast_bytes);
        return;
    }
    if (memcmp(&a->optim, &b->optim, sizeof(a->optim)) != 0) {
        snprintf(out, outlen, "optimizer settings differ (lr %g vs %g, kind %d vs %d)", a->optim.lr,
                 b->optim.lr, a->optim.kind, b->optim.kind);
        return;
    }
    snprintf(out, outlen, "no difference");
}

int sd_layout_build(const struct sd_model *m, const struct sd_plan *plan,
                    struct sd_layout *layout_p, char *err, size_t errlen)
{
    struct sd_layout l = {0};
    int status = sd_model_validate(m, err, errlen);
    if (status != SD_OK)
        return status;

    uint64_t fl = 1;
    for (int s = 0; s < SD_STATE_COUNT; s++) {
        if (plan->f[s] == 0) {
            snprintf(err, errlen, "plan '%s': shard factor of %s is 0", plan->name,
                     sd_state_name(s));
            return SD_EINVAL;
        }
        fl = sd_lcm(fl, plan->f[s]);
        l.f[s] = plan->f[s];
    }
    bool sec = sd_plan_sec_active(plan);
    if (sec) /* a unit's secondary pieces are whole aligned elements too */
        fl = sd_lcm(fl, plan->sec);
    l.n_tensors = m->n_tensors;
    l.n_units = m->tensors[m->n_tensors - 1].unit + 1;
    l.units = calloc(l.n_units, sizeof(*l.units));
    l.tensors = calloc(l.n_tensors, sizeof(*l.tensors));
    if (l.units == NULL || l.tensors == NULL) {
        status = SD_ENOMEM;
        goto err_free;
    }

    uint64_t pool_off = 0;
    for (uint32_t i = 0; i < m->n_tensors;) {
        uint32_t u = m->tensors[i].unit;
        struct sd_unit_layout *ul = &l.units[u];
        ul->first_tensor = i;
        ul->dtype = m->tensors[i].dtype;
        uint64_t off = 0;
        for (; i < m->n_tensors && m->tensors[i].unit == u; i++) {
            off = sd_round_up(off, SD_ALIGN_ELEMS);
            l.tensors[i].offset = off;
            l.tensors[i].numel = sd_tensor_numel(&m->tensors[i]);
            off += l.tensors[i].numel;
            ul->n_tensors++;
        }
        ul->used = off;
        ul->numel = sd_round_up(off, fl * SD_ALIGN_ELEMS);
        ul->pool_off = pool_off;
        pool_off += ul->numel;
        for (int s = 0; s < SD_STATE_COUNT; s++) {
            ul->arena_off[s] = l.arena_numel[s];
            l.arena_numel[s] += ul->numel / plan->f[s];
        }
        if (sec) { /* with qsec each piece is int8 blocks */
            uint64_t n = ul->numel / plan->sec;
            ul->sec_off = l.sec_numel;
            ul->sec_boff = l.sec_bytes;
            l.sec_numel += n;
            l.sec_bytes += plan->qsec ? sd_codec_bytes(SD_CODEC_INT8, n, plan->qblock)
                                      : n * sd_dtype_size(ul->dtype);
        }
        l.total_numel += ul->numel;
        l.total_bytes += sd_unit_bytes(ul);
        l.max_unit_numel = SD_MAX(l.max_unit_numel, ul->numel);
        l.max_unit_bytes = SD_MAX(l.max_unit_bytes, sd_unit_bytes(ul));
    }
    *layout_p = l;
    return SD_OK;

err_free:
    free(l.units);
    free(l.tensors);
    return status;
}

void sd_layout_free(struct sd_layout *layout)
{
    free(layout->units);
    free(layout->tensors);
    memset(layout, 0, sizeof(*layout));
}

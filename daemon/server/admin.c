/* Admin commands for shardctl: status, jobs, groups, topology, stats. Answers are JSON; shardctl
 * renders tables from the same documents. */
#include "optimizer.h"
#include "cluster/cluster.h"
#include "checkpoint.h"
#include "job_mem.h"
#include "net.h"
#include "secondary.h"
#include "file_pool.h"
#include "hop.h"
#include "job_trace.h"
#include "resume.h"
#include "schedule.h"
#include "server.h"
#include "session.h"
#include "sd/status.h"
#include "sd/util.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static json_t *config_json(const struct sd_config *cfg)
{
    json_t *o = json_object();
    char buf[SD_PATH_MAX + 32];
    for (unsigned i = 0; i < sd_config_table_len; i++) {
        const struct sd_config_entry *e = &sd_config_table[i];
        sd_config_format(cfg, e, buf, sizeof(buf));
        if (e->type == SD_CFG_STRING)
            json_object_set_new(o, e->name, json_string(buf));
        else
            json_object_set_new(o, e->name, json_integer((json_int_t)strtoll(buf, NULL, 10)));
    }
    return o;
}

static json_t *group_json(const struct sd_group *g)
{
    json_t *a = json_array();
    for (uint32_t j = 0; j < g->count; j++)
        json_array_append_new(a, json_integer(sd_group_member(g, j)));
    return a;
}

/* The optimizer, and each parameter group's hyperparameters of the last step (a schedule moves
 * them) with its tensors' count. */
static json_t *optimizer_json(const struct sd_job *job)
{
    const struct sd_model *m = &job->model;
    uint32_t n = sd_model_groups(m);
    uint32_t *tensors = calloc(n, sizeof(*tensors)); /* one pass: 64K tensors, 4096 groups */
    for (uint32_t t = 0; tensors != NULL && t < m->n_tensors; t++)
        tensors[m->tensors[t].group]++;
    json_t *groups = json_array();
    for (uint32_t g = 0; g < n; g++) {
        const struct sd_hparams *hp = sd_optim_hparams(job);
        struct sd_hparams h = hp != NULL ? hp[g] : sd_model_group(m, g);
        json_t *o = json_pack("{s:i, s:f, s:f}", "tensors", tensors ? (int)tensors[g] : -1, "lr",
                              (double)h.lr, "weight_decay", (double)h.weight_decay);
        if (sd_optim_layout(m->optim.kind) == SD_OPTIM_ADAMW) {
            json_object_set_new(o, "betas", json_pack("[f, f]", (double)h.beta1, (double)h.beta2));
            json_object_set_new(o, "eps", json_real(h.eps));
        } else {
            json_object_set_new(o, "momentum", json_real(h.momentum));
        }
        json_array_append_new(groups, o);
    }
    free(tensors);
    return json_pack("{s:s, s:f, s:b, s:I, s:o}", "name", sd_optim_name(m->optim.kind),
                     "max_grad_norm", (double)m->optim.max_grad_norm, "skip_unused", m->skip_unused,
                     "broadcast_bytes", (json_int_t)m->bcast_bytes, "groups", groups);
}

/* the state shardctl shows: a paused job's (a failed one kept for a resume) is "paused" */
static const char *shown_state(const struct sd_job *job)
{
    return sd_resume_paused(job) ? "paused" : sd_job_state_name(job->state);
}

static json_t *job_summary(const struct sd_job *job)
{
    json_t *ranks = json_array();
    for (uint32_t r = 0; r < job->k; r++) {
        const struct sd_session *s = job->ranks[r];
        json_t *o = json_object();
        json_object_set_new(o, "rank", json_integer(job->first_rank + r));
        json_object_set_new(o, "pid", s ? json_integer(s->conn->pid) : json_null());
        json_object_set_new(o, "attached", json_boolean(s != NULL));
        /* the GPU its buffers and its copy of the gathered weights live on (config devices) */
        json_object_set_new(o, "device", json_integer(sd_registry_rank_device(job->reg, r)));
        json_array_append_new(ranks, o);
    }
    bool ended = job->state == SD_JOB_CLOSING || job->state == SD_JOB_FINISHED;
    json_t *doc = json_pack(
        "{s:s, s:I, s:s, s:b, s:i, s:i, s:i, s:s, s:i, s:I, s:I, s:I, s:I, s:f, "
        "s:s, s:o}",
        "name", job->name, "id", (json_int_t)job->id, "state", shown_state(job), "allocating",
        (int)job->mem.allocating, "uid", (int)job->uid, "world", (int)job->world, "ranks_per_node",
        (int)job->k, "plan", job->plan.name, "units", (int)job->layout.n_units, "parameters",
        (json_int_t)job->layout.total_numel, "parameter_bytes", (json_int_t)job->layout.total_bytes,
        "memory_bytes", (json_int_t)job->mem.bytes_total, "steps", (json_int_t)job->steps,
        "last_grad_norm", sd_optim_grad_norm(job), "error", ended ? "" : job->fail_msg, "ranks",
        ranks);
    json_object_set_new(doc, "nodes", json_integer(job->nodes)); /* 0 .. nodes - 1 */
    /* the job's node this daemon serves, and the cluster node of each (-1: not confirmed yet) */
    json_object_set_new(doc, "node", json_integer(job->node));
    json_t *ids = json_array();
    bool kept = job->xfer.node_ids_are_daemon_ids; /* (the cluster's numbers are gone) */
    for (uint32_t n = 0; n < job->nodes; n++)
        json_array_append_new(ids, json_integer(kept || job->xfer.node_ids[n] == SD_NODE_UNKNOWN
                                                    ? -1
                                                    : (json_int_t)job->xfer.node_ids[n]));
    json_object_set_new(doc, "node_ids", ids);
    /* an independent daemon numbers the daemons it met its own way: each node's daemon id, the
     * same on every node of the job (shardctl topology: "id") */
    const struct sd_cluster *cl = sd_job_cluster(job);
    if (sd_cluster_independent(cl) || (job->reg->cfg->nodes == 1 && job->nodes > 1)) {
        /* (an independent daemon's fabric may have closed since the job met: kept ids) */
        json_t *daemons = json_array();
        for (uint32_t n = 0; n < job->nodes; n++) {
            char id[16] = "";
            if (kept && job->xfer.node_ids[n] != 0)
                snprintf(id, sizeof(id), "%08x", job->xfer.node_ids[n]);
            else if (!kept && job->xfer.node_ids[n] != SD_NODE_UNKNOWN)
                snprintf(id, sizeof(id), "%08x", sd_cluster_daemon_id(cl, job->xfer.node_ids[n]));
            json_array_append_new(daemons, json_string(id));
        }
        json_object_set_new(doc, "node_daemons", daemons);
    }
    /* its ranks gave a job secret (shard_model_t.job_secret): its nodes are those that did */
    json_object_set_new(doc, "secret", json_boolean(job->xfer.token_len > 0));
    /* how a job that ended cleanly ended (its ranks detached): not an error */
    json_object_set_new(doc, "ended", json_string(ended ? job->fail_msg : ""));
    json_object_set_new(doc, "optimizer", optimizer_json(job));
    json_object_set_new(doc, "checkpoint", sd_ckpt_json(job));
    json_object_set_new(doc, "resume", sd_resume_json(job));
    return doc;
}

/* The quantized options, as groups and stats show them. */
static json_t *quant_options_json(const struct sd_job *job)
{
    return json_pack("{s:b, s:b, s:b, s:b, s:i, s:I, s:s}", "qw", job->plan.qw, "qg", job->plan.qg,
                     "qsec", job->plan.qsec, "ef", job->plan.ef, "block", (int)job->plan.qblock,
                     "min_bytes", (json_int_t)job->reg->cfg->quant_min_bytes, "gwire",
                     sd_dtype_name(job->plan.gwire));
}

/* ... and in groups, what each moves: the encoded size per element. */
static json_t *quant_json(const struct sd_job *job)
{
    json_t *o = quant_options_json(job);
    json_object_set_new(o, "qw_formula",
                        json_string("every weight gather moves each w shard of n elements as "
                                    "int8 blocks: n + 4 ceil(n / block) bytes"));
    json_object_set_new(o, "qg_formula",
                        json_string("a reduce-scatter across nodes moves each node's block of n "
                                    "elements as int4: ceil(n / 2) + 4 ceil(n / block) bytes; "
                                    "blocks under quant_min_bytes (fp32) go exact"));
    json_object_set_new(o, "gwire_formula",
                        json_string("with gwire bf16 or fp16, the gradient blocks that cross "
                                    "nodes otherwise in fp32 (push rounds, the boundary hop) move "
                                    "2 bytes an element, summed in fp32 at their owner"));
    json_object_set_new(o, "qsec_formula",
                        json_string("each secondary piece of n elements is kept as n + 4 ceil(n "
                                    "/ block) bytes"));
    return o;
}

/* The secondary partition: its ranks, who holds it, what it holds per rank. */
static json_t *sec_json(const struct sd_job *job)
{
    uint32_t S = job->plan.sec, holders = sd_sec_holders(job);
    const char *why = S == 0 ? "no ,sec option"
                      : holders == 0
                          ? "inactive: f_w <= S, the w group is no larger than the secondary "
                            "group, so there is nothing to save"
                          : "a unit's later gathers of one weights generation copy from S ranks "
                            "of the node instead of gathering within the w group";
    return json_pack("{s:i, s:b, s:i, s:I, s:s, s:s}", "ranks", (int)S, "active", holders > 0,
                     "holders_per_node", (int)holders, "bytes_per_holder",
                     (json_int_t)(holders ? sd_sec_holder_bytes(job) : 0), "formula",
                     "S_w / S (the weights in their dtype)", "effect", why);
}

/* Each rank's bytes of every buffer, as registration computed and the budget enforced them,
 * next to ZeRO-topo's formulas (Psi parameters). The gather pool and staging are the node's,
 * divided among its ranks here. */
static json_t *memory_json(const struct sd_job *job)
{
    uint64_t arena[SD_STATE_COUNT];
    sd_job_mem_arena_bytes(job, arena);
    json_t *o = json_object();
    static const char *const formula[SD_STATE_COUNT] = {
        "2 Psi / f_w (bf16; 4 Psi / f_w in fp32)", "4 Psi / f_g",
        "12 Psi / f_os with AdamW, 8 Psi / f_os with SGD"};
    for (int st = 0; st < SD_STATE_COUNT; st++)
        json_object_set_new(
            o, sd_state_name(st),
            json_pack("{s:I, s:s}", "bytes", (json_int_t)arena[st], "formula", formula[st]));
    json_object_set_new(o, "secondary",
                        json_pack("{s:I, s:s}", "bytes",
                                  (json_int_t)(sd_sec_holders(job) ? sd_sec_holder_bytes(job) : 0),
                                  "formula",
                                  "2 Psi / S on each holder (bf16), 0 without an active ,sec=S"));
    json_object_set_new(o, "gather_pool",
                        json_pack("{s:I, s:s}", "bytes",
                                  (json_int_t)(job->stats.pool_bytes / job->k), "formula",
                                  "the node's pool / k (max_live_bytes, or every unit)"));
    json_object_set_new(
        o, "staging",
        json_pack("{s:I, s:s}", "bytes",
                  (json_int_t)((uint64_t)job->mem.staging_slots * job->mem.staging_slot_bytes),
                  "formula", "staging_slots x the largest unit in fp32"));
    json_object_set_new(o, "node_total", json_integer((json_int_t)job->stats.memory_bytes));
    return o;
}

static json_t *job_groups(const struct sd_job *job)
{
    json_t *states = json_object();
    for (int st = 0; st < SD_STATE_COUNT; st++) {
        uint32_t f = job->plan.f[st];
        json_t *part = json_array(), *repl = json_array();
        for (uint32_t first = 0; first < job->world; first += f) {
            struct sd_group g = sd_group_partition(f, first);
            json_array_append_new(part, group_json(&g));
        }
        for (uint32_t i = 0; i < f; i++) {
            struct sd_group g = sd_group_replication(job->world, f, i);
            json_array_append_new(repl, group_json(&g));
        }
        /* each rank's shard: elements [shard numel / f, (shard + 1) numel / f) of every unit,
         * and its bytes of the state (w in the units' dtypes, g fp32, os fp32 master and
         * moments) */
        uint64_t bytes = st == SD_STATE_W   ? job->mem.w_arena_bytes
                         : st == SD_STATE_G ? job->layout.arena_numel[st] * sizeof(float)
                                            : job->layout.arena_numel[st] * sizeof(float) *
                                                  sd_optim_state_floats(job->model.optim.kind);
        json_t *ranks = json_array();
        uint32_t P = sd_topo_package(&job->topo);
        for (uint32_t r = 0; r < job->world; r++)
            json_array_append_new(ranks,
                                  json_pack("{s:i, s:i, s:i, s:i}", "rank", (int)r, "node",
                                            (int)(r / job->k), "package", (int)(r % job->k / P),
                                            "shard", (int)sd_plan_shard(&job->plan, st, r)));
        json_object_set_new(states, sd_state_name(st),
                            json_pack("{s:i, s:i, s:I, s:o, s:o, s:o}", "shard_factor", (int)f,
                                      "nodes_per_group", (int)job->gnodes[st], "bytes_per_rank",
                                      (json_int_t)bytes, "partition", part, "replication", repl,
                                      "ranks", ranks));
    }
    json_t *doc =
        json_pack("{s:s, s:s, s:i, s:i, s:i, s:b, s:b, s:s, s:o}", "job", job->name, "plan",
                  job->plan.name, "world", (int)job->world, "ranks_per_node", (int)job->k,
                  "package_size", (int)sd_topo_package(&job->topo), "hierarchical",
                  job->plan.hierarchical, "two_hop", job->plan.two_hop, "shard_rule",
                  "a rank holds elements [shard*numel/f, (shard+1)*numel/f) of every "
                  "unit; its os shard lies in its g shard, which lies in its w shard",
                  "states", states);
    json_object_set_new(doc, "secondary", sec_json(job));
    json_object_set_new(doc, "memory_per_rank", memory_json(job));
    json_object_set_new(doc, "quantization", quant_json(job));
    json_t *units = json_array(); /* what every formula above is a sum over */
    for (uint32_t u = 0; u < job->layout.n_units; u++)
        json_array_append_new(units, json_pack("{s:I, s:s}", "numel",
                                               (json_int_t)job->layout.units[u].numel, "dtype",
                                               sd_dtype_name(job->layout.units[u].dtype)));
    json_object_set_new(doc, "units", units);
    return doc;
}

static json_t *job_stats(const struct sd_job *job)
{
    json_t *ops = json_object();
    for (int op = SD_OP_FETCH; op < SD_OP_COUNT; op++) {
        const struct sd_latency *l = &job->stats.lat[op];
        json_t *bytes = json_object(), *unq = json_object();
        for (int c = 0; c < SD_LINK_COUNT; c++) {
            json_object_set_new(bytes, sd_link_names[c],
                                json_integer((json_int_t)job->stats.bytes[op][c]));
            json_object_set_new(unq, sd_link_names[c],
                                json_integer((json_int_t)job->stats.bytes[op][c] +
                                             (json_int_t)job->stats.saved[op][c]));
        }
        json_object_set_new(
            ops, sd_op_name(op),
            json_pack("{s:I, s:o, s:o, s:f, s:f, s:f}", "count", (json_int_t)job->stats.ops[op],
                      "bytes", bytes, "bytes_unquantized", unq, "p50_us",
                      sd_latency_quantile_us(l, 0.5), "p99_us", sd_latency_quantile_us(l, 0.99),
                      "max_us", sd_latency_quantile_us(l, 1.0)));
    }
    json_t *totals = json_object(), *totals_unq = json_object();
    for (int c = 0; c < SD_LINK_COUNT; c++) {
        uint64_t sum = 0;
        int64_t saved = 0;
        for (int op = 0; op < SD_OP_COUNT; op++) {
            sum += job->stats.bytes[op][c];
            saved += job->stats.saved[op][c];
        }
        json_object_set_new(totals, sd_link_names[c], json_integer((json_int_t)sum));
        json_object_set_new(totals_unq, sd_link_names[c],
                            json_integer((json_int_t)sum + (json_int_t)saved));
    }
    json_t *o = json_pack("{s:s, s:I, s:o, s:o, s:I, s:I, s:I, s:I, s:I, s:I}", "job", job->name,
                          "steps", (json_int_t)job->steps, "ops", ops, "bytes", totals, "errors",
                          (json_int_t)job->stats.errors, "gathers", (json_int_t)job->stats.gathers,
                          "cache_hits", (json_int_t)job->stats.cache_hits, "evictions",
                          (json_int_t)job->cache.evictions, "allocations_since_register",
                          (json_int_t)job->stats.allocs_after_register, "pool_bytes",
                          (json_int_t)job->stats.pool_bytes);
    json_object_set_new(o, "units", json_integer((json_int_t)job->layout.n_units));
    json_object_set_new(o, "steps_nonfinite", json_integer((json_int_t)job->stats.steps_nonfinite));
    json_object_set_new(o, "steps_nonfinite_scaled",
                        json_integer((json_int_t)job->stats.steps_nonfinite_scaled));
    json_object_set_new(o, "loss_scale", json_real(job->stats.loss_scale));
    json_object_set_new(o, "steps_refused", json_integer((json_int_t)job->stats.steps_refused));
    /* units sent across nodes during the backward (shard_last_micro_step), not at the step */
    json_object_set_new(o, "boundary_hops_early",
                        json_integer((json_int_t)sd_hop_early_count(job)));
    json_object_set_new(o, "tensors_skipped", json_integer((json_int_t)job->stats.tensors_skipped));
    json_object_set_new(o, "bcast_bytes", json_integer((json_int_t)job->stats.bcast_bytes));
    json_object_set_new(o, "memory_bytes_at_register",
                        json_integer((json_int_t)job->stats.memory_bytes));
    json_object_set_new(o, "allocations_counted", json_boolean(sd_alloc_counted));
    sd_sched_stats_json(job, o);
    json_object_set_new(o, "push_rounds_peak",
                        json_integer((json_int_t)job->stats.push_rounds_peak));
    json_object_set_new(o, "signal_waits", json_integer((json_int_t)job->stats.signal_waits));
    json_object_set_new(o, "signal_wait_ms", json_real((double)job->stats.signal_wait_ns / 1e6));
    json_object_set_new(o, "fenced_releases", json_integer((json_int_t)job->stats.fenced_releases));
    uint64_t sec_loads, sec_stores;
    sd_sec_counts(job, &sec_loads, &sec_stores);
    json_object_set_new(o, "secondary",
                        json_pack("{s:i, s:b, s:I, s:I}", "ranks", (int)job->plan.sec, "active",
                                  sd_sec_holders(job) > 0, "loads", (json_int_t)sec_loads, "stores",
                                  (json_int_t)sec_stores));
    /* the bytes above are what moved (encoded where quantized); bytes_unquantized what the
     * same operations would have moved without quantization */
    json_object_set_new(o, "bytes_unquantized", totals_unq);
    json_t *quant = quant_options_json(job);
    json_object_set_new(quant, "encodes", json_integer((json_int_t)job->stats.quant_encodes));
    json_object_set_new(quant, "fallbacks", json_integer((json_int_t)job->stats.quant_fallbacks));
    json_object_set_new(o, "quantization", quant);
    json_object_set_new(o, "coalesced_gathers",
                        json_integer((json_int_t)job->stats.coalesced_gathers));
    json_object_set_new(o, "coalesced_units", json_integer((json_int_t)job->stats.coalesced_units));
    return o;
}

/* The frozen schedule: its calls, the prefetch distance, every gather's place in the pool
 * (schedule.c's), with what the job knows of its pool. */
static json_t *job_schedule(const struct sd_job *job)
{
    /* per node: one copy of each unit, or one per local rank without the hierarchy */
    uint64_t sum = job->layout.total_bytes * job->slots_per_unit;
    uint64_t largest = job->layout.max_unit_bytes * job->slots_per_unit;
    json_t *o = json_pack("{s:s, s:I}", "job", job->name, "steps", (json_int_t)job->steps);
    sd_sched_json(job, o);
    json_object_set_new(o, "pool_bytes", json_integer((json_int_t)job->stats.pool_bytes));
    json_object_set_new(o, "units_sum_bytes", json_integer((json_int_t)sum));
    json_object_set_new(o, "largest_unit_bytes", json_integer((json_int_t)largest));
    json_object_set_new(o, "job_state", json_string(shown_state(job)));
    json_object_set_new(o, "coalesce_bytes",
                        json_integer((json_int_t)job->reg->cfg->coalesce_bytes));
    json_object_set_new(o, "coalesced_gathers",
                        json_integer((json_int_t)job->stats.coalesced_gathers));
    json_object_set_new(o, "coalesced_units", json_integer((json_int_t)job->stats.coalesced_units));
    return o;
}

/* drop --job J (root): the state a paused or kept job holds goes now */
static int admin_drop(struct sd_registry *reg, const char *name, uid_t uid, char **json_p)
{
    char err[512] = "";
    int st = SD_OK;
    struct sd_job *job = NULL;
    for (struct sd_job *j = reg->jobs; name != NULL && j; j = j->next)
        if (strcmp(j->name, name) == 0 && sd_resume_holds_state(j))
            job = j;
    if (uid != 0) {
        st = SD_EPERM;
        snprintf(err, sizeof(err),
                 "drop is root's: the state of a job goes with its trainers, "
                 "or at its resume timeout");
    } else if (name == NULL || name[0] == '\0') {
        st = SD_EINVAL;
        snprintf(err, sizeof(err), "drop needs --job NAME");
    } else if (job == NULL) {
        st = SD_ENOJOB;
        snprintf(err, sizeof(err), "no paused or kept job '%.64s' on this node", name);
    } else {
        uint64_t bytes = job->mem.bytes_total;
        uid_t owner = job->uid;
        st = sd_resume_drop(job, err, sizeof(err)); /* may free the job */
        if (st == SD_OK) {
            json_t *o = json_pack("{s:s, s:i, s:I}", "dropped", name, "uid", (int)owner, "bytes",
                                  (json_int_t)bytes);
            *json_p = json_dumps(o, JSON_COMPACT);
            json_decref(o);
            return SD_OK;
        }
    }
    json_t *o = json_pack("{s:s}", "error", err);
    *json_p = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return st;
}

/* the devices the backend drives: name, memory, fd sharing, RDMA, peer access (none for host) */
static json_t *devices_json(const struct sd_gpu_ops *dev)
{
    json_t *arr = json_array();
    struct sd_gpu_device d[SD_GPU_MAX_DEVICES];
    int n = dev->devices != NULL ? dev->devices(d, SD_GPU_MAX_DEVICES) : 0;
    for (int i = 0; i < n && i < SD_GPU_MAX_DEVICES; i++) {
        json_t *peers = json_array();
        for (int j = 0; j < SD_GPU_MAX_DEVICES; j++)
            if (d[i].peers & (1ULL << j))
                json_array_append_new(peers, json_integer(j));
        json_array_append_new(arr, json_pack("{s:i, s:s, s:s, s:b, s:I, s:b, s:b, s:o}", "index",
                                             d[i].index, "name", d[i].name, "uuid", d[i].uuid,
                                             "driven", d[i].driven, "memory_bytes",
                                             (json_int_t)d[i].memory_bytes, "fd_handles",
                                             d[i].fd_handles, "rdma", d[i].rdma, "peers", peers));
        json_t *o = json_array_get(arr, json_array_size(arr) - 1);
        json_object_set_new(o, "used_bytes", json_integer((json_int_t)d[i].used_bytes));
        json_object_set_new(o, "peak_bytes", json_integer((json_int_t)d[i].peak_bytes));
    }
    return arr;
}

int sd_admin_handle(struct sd_server *srv, const Shard__AdminRequest *req, uid_t uid, char **json_p)
{
    const char *cmd = req->command ? req->command : "";
    const char *filter = req->job && req->job[0] ? req->job : NULL;
    struct sd_registry *reg = srv->reg;
    json_t *out = NULL;
    if (strcmp(cmd, "drop") == 0)
        return admin_drop(reg, filter, uid, json_p);
    /* root sees every job and client; anyone else only their own */
    bool all = uid == 0;
    /* a name shows every job of that name this caller sees that is active or retiring (a
     * paused job and the registration resuming it: both), else those recently ended */
    struct sd_job *lists[3] = {reg->jobs, reg->zombies, reg->finished};
    int lists_shown = 3, visible = 0;
    for (int li = 0; li < 3 && filter != NULL; li++) {
        if (li == 2 && visible > 0) {
            lists_shown = 2;
            break;
        }
        for (struct sd_job *j = lists[li]; j; j = j->next)
            visible += strcmp(j->name, filter) == 0 && (all || j->uid == uid);
    }
    if (filter != NULL && visible == 0) {
        out = json_pack("{s:s}", "error", "no such job");
        *json_p = json_dumps(out, JSON_COMPACT);
        json_decref(out);
        return SD_ENOJOB;
    }
    json_t *jobs = json_array();
    /* active, retiring (every rank left, transfers still hold its memory), recently ended */
    for (int li = 0; li < lists_shown; li++)
        for (struct sd_job *j = lists[li]; j; j = j->next) {
            if ((filter != NULL && strcmp(j->name, filter) != 0) || (!all && j->uid != uid))
                continue;
            json_t *o;
            if (strcmp(cmd, "groups") == 0)
                o = job_groups(j);
            else if (strcmp(cmd, "stats") == 0)
                o = job_stats(j);
            else if (strcmp(cmd, "schedule") == 0)
                o = job_schedule(j);
            else if (strcmp(cmd, "trace") == 0) /* the flight recorder (job_trace.h) */
                o = sd_job_trace_json(j, NULL);
            else
                o = job_summary(j);
            json_object_set_new(o, "retiring", json_boolean(li == 1));
            if (li == 1) {
                char peers[128];
                sd_job_net_pending_peers(j, peers, sizeof(peers));
                json_object_set_new(o, "transfers_pending_with_nodes", json_string(peers));
            }
            json_array_append_new(jobs, o);
        }
    const struct sd_config *cfg = srv->cfg;
    if (strcmp(cmd, "status") == 0) {
        json_t *clients = json_array();
        for (struct sd_session *s = srv->sessions; s; s = s->next)
            if (all || s->conn->uid == uid)
                json_array_append_new(
                    clients,
                    json_pack("{s:I, s:i, s:i, s:s?, s:i}", "session", (json_int_t)s->id, "pid",
                              (int)s->conn->pid, "uid", (int)s->conn->uid, "job",
                              s->job ? s->job->name : NULL, "rank", s->job ? (int)s->rank : -1));
        out = json_pack(
            "{s:s, s:i, s:f, s:s, s:i, s:i, s:I, s:I, s:o, s:o, s:o}", "version", SHARD_VERSION,
            "pid", (int)getpid(), "uptime_s", (double)(sd_now_ns() - srv->start_ns) / 1e9, "socket",
            srv->sock_path, "node", (int)sd_cluster_shown_node(sd_net_cluster(reg->net)), "nodes",
            (int)sd_cluster_shown_nodes(sd_net_cluster(reg->net)), "memory_budget_bytes",
            (json_int_t)reg->budget, "memory_used_bytes", (json_int_t)reg->used, "config",
            config_json(cfg), "clients", clients, "jobs", jobs);
        /* what this caller sees: its own jobs and clients, or (root) everyone's */
        json_object_set_new(out, "visibility", json_string(all ? "all" : "own uid"));
        /* the memory paused and kept jobs hold, per uid (paused_bytes_per_uid bounds each) */
        json_t *kept = json_object();
        for (struct sd_job *j = reg->jobs; j; j = j->next) {
            char key[16];
            snprintf(key, sizeof(key), "%d", (int)j->uid);
            if ((all || j->uid == uid) && json_object_get(kept, key) == NULL &&
                sd_resume_kept_bytes(reg, j->uid) > 0)
                json_object_set_new(kept, key,
                                    json_integer((json_int_t)sd_resume_kept_bytes(reg, j->uid)));
        }
        json_object_set_new(out, "paused_bytes_by_uid", kept);
        json_object_set_new(out, "file_workers", sd_file_pool_json(reg->files));
        if (srv->tp != NULL) {
            const struct sd_transport *tp = srv->tp;
            json_t *t = json_pack(
                "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "provider", cfg->provider,
                "rendezvous_bytes", (json_int_t)tp->rdv_bytes, "clear_to_sends_sent",
                (json_int_t)tp->cts_sent, "clear_to_sends_received", (json_int_t)tp->cts_received,
                "sends_parked", (json_int_t)tp->sends_parked, "sends_cleared_on_arrival",
                (json_int_t)tp->sends_cleared, "clear_to_sends_deferred",
                (json_int_t)tp->cts_deferred, "posts_queued", (json_int_t)tp->posts_queued);
            json_t *lanes = json_array();
            for (uint32_t l = 0; l < tp->data_lanes; l++)
                json_array_append_new(lanes, json_integer((json_int_t)tp->lane_sends[l]));
            json_object_set_new(t, "data_lane_sends", lanes);
            /* messages from fabric addresses outside the cluster, dropped unread */
            json_object_set_new(t, "foreign_dropped",
                                json_integer((json_int_t)tp->foreign_dropped));
            /* device memory staged through pinned host buffers (0 on host-memory backends) */
            json_object_set_new(t, "staging_bytes", json_integer((json_int_t)tp->staged_bytes));
            json_object_set_new(t, "staging_buffer_bytes",
                                json_integer((json_int_t)tp->staging_buffer_bytes));
            /* the provider reaches the device's memory itself (FI_HMEM): nothing is staged */
            json_object_set_new(t, "hmem", json_boolean(tp->hmem));
            json_object_set_new(out, "transport", t);
        }
        /* how busy the event loop polls: a daemon with nothing to do should not count up */
        json_object_set_new(out, "poll_passes", json_integer((json_int_t)srv->polls));
        /* connections refused at accept (max_clients, fd limit, allowed_gid) and dropped for
         * their input or unread replies */
        json_object_set_new(out, "connections_refused", json_integer((json_int_t)srv->refused));
        json_object_set_new(out, "connections_dropped", json_integer((json_int_t)srv->dropped));
        /* where GET /metrics answers (the port resolved), "" when metrics_listen is empty */
        json_object_set_new(out, "metrics_listen",
                            json_string(srv->metrics_at != NULL ? srv->metrics_at : ""));
    } else if (strcmp(cmd, "jobs") == 0 || strcmp(cmd, "groups") == 0 ||
               strcmp(cmd, "stats") == 0 || strcmp(cmd, "schedule") == 0 ||
               strcmp(cmd, "trace") == 0) {
        out = json_pack("{s:o}", "jobs", jobs);
        struct sd_cluster *cl = sd_net_cluster(reg->net);
        if (strcmp(cmd, "stats") == 0 && cl != NULL) /* its control links, and their floods */
            json_object_set_new(out, "peers", sd_cluster_stats_json(cl, all));
    } else if (strcmp(cmd, "topology") == 0) {
        json_t *nodes;
        struct sd_cluster *cl = sd_net_cluster(reg->net);
        if (cl != NULL) {
            nodes = sd_cluster_json(cl, all);
        } else {
            nodes = json_array();
            json_array_append_new(nodes, json_pack("{s:i, s:b, s:b, s:s}", "node", 0, "self", 1,
                                                   "link", 0, "state", "self"));
        }
        out = json_pack("{s:i, s:i, s:I, s:I, s:s, s:s, s:b, s:s, s:o, s:o}", "node",
                        (int)sd_cluster_shown_node(cl), "nodes", (int)sd_cluster_shown_nodes(cl),
                        "ranks_per_node", (json_int_t)cfg->ranks_per_node, "package_size",
                        (json_int_t)cfg->package_size, "backend", cfg->backend, "provider",
                        srv->tp != NULL ? cfg->provider : "", "cluster_ready", sd_cluster_ready(cl),
                        "socket", srv->sock_path, "topology", nodes, "jobs", jobs);
        json_object_set_new(out, "heartbeats", sd_cluster_heartbeat_json(cl));
        /* a daemon without a cluster list (nodes 1): topology lists the daemons it met */
        json_object_set_new(out, "independent", json_boolean(cfg->nodes == 1));
        /* how often an independent daemon closed its fabric with no job left */
        json_object_set_new(out, "fabric_closes", json_integer(reg->fabric_closes));
        /* the ids and addresses of the daemons it met: root's to see */
        json_object_set_new(out, "ids_shown", json_boolean(all));
        json_object_set_new(out, "devices", devices_json(reg->dev));
        /* local rank i of every job is on GPU rank_devices[i mod its length] */
        json_t *cycle = json_array();
        for (uint32_t i = 0; i < reg->n_rank_dev; i++)
            json_array_append_new(cycle, json_integer(reg->rank_dev[i]));
        json_object_set_new(out, "rank_devices", cycle);
    } else {
        json_decref(jobs);
        out = json_pack(
            "{s:s}", "error",
            "unknown command (status, jobs, groups, topology, stats, schedule, trace, drop)");
        *json_p = json_dumps(out, JSON_COMPACT);
        json_decref(out);
        return SD_EINVAL;
    }
    *json_p = json_dumps(out, JSON_COMPACT);
    json_decref(out);
    return *json_p ? SD_OK : SD_ENOMEM;
}

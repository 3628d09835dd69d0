/* shardctl plan: the cost model (sd/cost.h) for a model that does not exist yet, one plan at a
 * time or (--pick) every per-state plan of a world ranked by its predicted step time. */
#include "shardctl.h"
#include "sd/cost.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int shardctl_plan_arg(struct plan_args *a, const char *key, const char *val)
{
    char *end = NULL;
    if (strcmp(key, "--params") == 0)
        a->params = strtoull(val, &end, 10);
    else if (strcmp(key, "--world") == 0)
        a->world = strtol(val, &end, 10);
    else if (strcmp(key, "--ranks-per-node") == 0)
        a->k = strtol(val, &end, 10);
    else if (strcmp(key, "--package-size") == 0)
        a->package = strtol(val, &end, 10);
    else if (strcmp(key, "--accum") == 0)
        a->accum = strtol(val, &end, 10);
    else if (strcmp(key, "--gbit-per-node") == 0)
        a->gbit = strtod(val, &end);
    else if (strcmp(key, "--compute-s") == 0)
        a->compute_s = strtod(val, &end);
    else if (strcmp(key, "--max-rank-bytes") == 0)
        a->max_rank_bytes = strtoull(val, &end, 10);
    else if (strcmp(key, "--f-os") == 0)
        a->f_os = strtol(val, &end, 10);
    else if (strcmp(key, "--plan") == 0)
        a->plan = val;
    else if (strcmp(key, "--dtype") == 0)
        a->dtype = val;
    else if (strcmp(key, "--optimizer") == 0)
        a->optimizer = val;
    else
        return -1;
    if (end != NULL && (*end != '\0' || end == val || val[0] == '-')) {
        fprintf(stderr, "shardctl plan: %s '%s' is not a number (>= 0)\n", key, val);
        return -2;
    }
    if ((strcmp(key, "--gbit-per-node") == 0 || strcmp(key, "--compute-s") == 0) &&
        !(isfinite(strtod(val, NULL)))) {
        fprintf(stderr, "shardctl plan: %s '%s' must be finite\n", key, val);
        return -2;
    }
    return 0;
}

/* The world's sizes, the model and the plan a's options describe, parsed: 0, or 1/2 (said). */
static int plan_model(const struct plan_args *a, const char *plan_s, bool quiet,
                      struct sd_topo *topo, struct sd_plan *plan, struct sd_cost_in *in)
{
    if (a->params == 0 || a->world <= 0 || a->k <= 0 || a->package <= 0 || a->accum <= 0 ||
        a->world % a->k != 0) {
        fprintf(stderr, "shardctl plan: needs --params N (> 0), --world W, --ranks-per-node K "
                        "(K divides W) and --plan PLAN (or --pick)\n");
        return 2;
    }
    bool bf16 = strcmp(a->dtype, "bf16") == 0, sgd = strcmp(a->optimizer, "sgd") == 0;
    if ((!bf16 && strcmp(a->dtype, "fp32") != 0) || (!sgd && strcmp(a->optimizer, "adamw") != 0)) {
        fprintf(stderr, "shardctl plan: --dtype is bf16 or fp32, --optimizer adamw or sgd\n");
        return 2;
    }
    *topo = (struct sd_topo){.nodes = (uint32_t)(a->world / a->k),
                             .ranks_per_node = (uint32_t)a->k,
                             .package_size = (uint32_t)a->package};
    char err[512];
    if (sd_plan_parse(plan_s, topo, plan, err, sizeof(err)) != SD_OK) {
        if (!quiet)
            fprintf(stderr, "shardctl plan: %s\n", err);
        return 1;
    }
    /* padded as the daemon pads: each shard a whole number of aligned elements */
    uint64_t grain = (sd_plan_sec_active(plan) ? sd_lcm(plan->f[SD_STATE_OS], plan->sec)
                                               : plan->f[SD_STATE_OS]) *
                     SD_ALIGN_ELEMS;
    *in = (struct sd_cost_in){.numel = (a->params + grain - 1) / grain * grain,
                              .w_bytes = bf16 ? 2 : 4,
                              .nodes = topo->nodes,
                              .k = topo->ranks_per_node,
                              .accum = (uint32_t)a->accum,
                              .optim_floats = sgd ? 2 : 3,
                              .cached_in_step = !a->regather,
                              .inter_Bps = a->gbit * 1e9 / 8,
                              .package = (uint32_t)a->package,
                              .compute_s = a->compute_s,
                              .last_marked = a->last_marked};
    return 0;
}

static int plan_one(const struct plan_args *a, bool as_json)
{
    bool bf16 = strcmp(a->dtype, "bf16") == 0, sgd = strcmp(a->optimizer, "sgd") == 0;
    struct sd_topo topo;
    struct sd_plan plan;
    struct sd_cost_in in;
    if (a->plan == NULL) {
        fprintf(stderr, "shardctl plan: needs --plan PLAN, or --pick to rank every per-state "
                        "plan\n");
        return 2;
    }
    int pst = plan_model(a, a->plan, false, &topo, &plan, &in);
    if (pst != 0)
        return pst;
    uint64_t numel = in.numel;
    struct sd_cost_out o;
    sd_cost_step(&in, &plan, &o);
    static const char *const formula[SD_STATE_COUNT][2] = {{"2 Psi / f_w", "4 Psi / f_w"},
                                                           {"4 Psi / f_g", "4 Psi / f_g"},
                                                           {"12 Psi / f_os", "8 Psi / f_os"}};
    uint64_t states = o.rank_bytes[0] + o.rank_bytes[1] + o.rank_bytes[2];
    if (as_json) {
        json_t *mem = json_object();
        for (int st = 0; st < SD_STATE_COUNT; st++)
            json_object_set_new(mem, sd_state_name(st),
                                json_pack("{s:i, s:I, s:s}", "shard_factor", (int)plan.f[st],
                                          "bytes", (json_int_t)o.rank_bytes[st], "formula",
                                          formula[st][st == SD_STATE_OS ? sgd : !bf16]));
        json_object_set_new(mem, "secondary",
                            json_pack("{s:i, s:b, s:I, s:s}", "ranks", (int)plan.sec, "active",
                                      sd_plan_sec_active(&plan), "bytes", (json_int_t)o.sec_bytes,
                                      "formula", bf16 ? "2 Psi / S" : "4 Psi / S"));
        json_t *intra = json_object();
        static const char *const ops[3] = {"fetch", "push", "step"};
        for (int op = 0; op < 3; op++)
            json_object_set_new(intra, ops[op],
                                json_pack("{s:f, s:f}", "intra_package",
                                          o.intra_op[op][SD_COST_PACKAGE], "intra_node",
                                          o.intra_op[op][SD_COST_NODE]));
        json_object_set_new(intra, "total",
                            json_pack("{s:f, s:f}", "intra_package", o.intra[SD_COST_PACKAGE],
                                      "intra_node", o.intra[SD_COST_NODE]));
        json_t *doc = json_pack(
            "{s:s, s:I, s:I, s:i, s:i, s:i, s:i, s:o, s:I, s:{s:f, s:f, s:f, s:f, s:f, s:f}, s:f}",
            "plan", a->plan, "params", (json_int_t)a->params, "padded_params", (json_int_t)numel,
            "nodes", (int)topo.nodes, "ranks_per_node", (int)topo.ranks_per_node, "package_size",
            (int)sd_topo_package(&topo), "accum", (int)a->accum, "rank_bytes", mem,
            "rank_state_bytes", (json_int_t)states, "inter_node_bytes_per_step", "fetch",
            o.fetch_bytes, "push", o.push_bytes, "step_hop", o.hop_bytes, "step_weights",
            o.weights_bytes, "step", o.step_bytes, "total", o.total_bytes, "comm_s", o.comm_s);
        json_object_set_new(doc, "intra_node_bytes_per_step", intra);
        json_object_set_new(doc, "overlap_s", json_real(o.overlap_s));
        json_object_set_new(doc, "exposed_s", json_real(o.exposed_s));
        json_object_set_new(doc, "step_s", json_real(o.step_s));
        json_object_set_new(doc, "inter_node_bytes_per_step_unquantized",
                            json_real(o.unquantized_bytes));
        json_object_set_new(doc, "quantization",
                            json_pack("{s:b, s:b, s:b, s:b, s:i, s:i, s:s}", "qw", plan.qw, "qg",
                                      plan.qg, "qsec", plan.qsec, "ef", plan.ef, "block",
                                      (int)plan.qblock, "secondary_ranks", (int)plan.sec, "gwire",
                                      sd_dtype_name(plan.gwire)));
        char *out = json_dumps(doc, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        puts(out);
        free(out);
        json_decref(doc);
        return 0;
    }
    char b[6][32];
    printf("plan %s: f_w %u, f_g %u, f_os %u on %u nodes x %u ranks (packages of %u), %llu "
           "parameters (%llu padded), %s weights, %s, accum %ld\n",
           a->plan, plan.f[0], plan.f[1], plan.f[2], topo.nodes, topo.ranks_per_node,
           sd_topo_package(&topo), a->params, (unsigned long long)numel, a->dtype, a->optimizer,
           a->accum);
    printf("  per rank:\n");
    for (int st = 0; st < SD_STATE_COUNT; st++)
        printf("    %-3s %10s   %s\n", sd_state_name(st),
               sd_fmt_bytes(b[0], sizeof(b[0]), o.rank_bytes[st]),
               formula[st][st == SD_STATE_OS ? sgd : !bf16]);
    if (o.sec_bytes)
        printf("    %-3s %10s   %s on each of %u holders per node\n", "sec",
               sd_fmt_bytes(b[0], sizeof(b[0]), o.sec_bytes), bf16 ? "2 Psi / S" : "4 Psi / S",
               plan.sec);
    else if (plan.sec)
        printf("    sec %10s   (inactive: f_w <= S, nothing to save)\n", "0 B");
    printf("    %-3s %10s   (w, g, os; plus the gather pool and staging, sized from the units)\n",
           "all", sd_fmt_bytes(b[0], sizeof(b[0]), states));
    printf("  inter-node bytes each node sends per step:\n"
           "    fetch %s, push %s, step %s (hop %s, weights' all-gather %s), total %s\n",
           sd_fmt_bytes(b[0], sizeof(b[0]), (uint64_t)o.fetch_bytes),
           sd_fmt_bytes(b[1], sizeof(b[1]), (uint64_t)o.push_bytes),
           sd_fmt_bytes(b[2], sizeof(b[2]), (uint64_t)o.step_bytes),
           sd_fmt_bytes(b[3], sizeof(b[3]), (uint64_t)o.hop_bytes),
           sd_fmt_bytes(b[4], sizeof(b[4]), (uint64_t)o.weights_bytes),
           sd_fmt_bytes(b[5], sizeof(b[5]), (uint64_t)o.total_bytes));
    if (sd_plan_quantized(&plan))
        printf("    quantized:%s%s%s%s in blocks of %u (unquantized the total would be %s)\n",
               plan.qw ? " weights int8 (qw)" : "", plan.qg ? " reduce-scatters int4 (qg)" : "",
               plan.qsec ? " secondary int8 (qsec)" : "", plan.ef ? " with error feedback" : "",
               plan.qblock, sd_fmt_bytes(b[0], sizeof(b[0]), (uint64_t)o.unquantized_bytes));
    if (plan.gwire != SD_DTYPE_FP32)
        printf("    gradients across nodes in %s (gwire), summed in fp32 at their owners (in "
               "fp32 the total would be %s)\n",
               sd_dtype_name(plan.gwire),
               sd_fmt_bytes(b[0], sizeof(b[0]), (uint64_t)o.unquantized_bytes));
    if (a->gbit > 0)
        printf("    %.3f s at %g Gbit/s per node: %.3f s beside the forward and backward, %.3f s "
               "after the last backward;\n    predicted step %.3f s (%s)\n",
               o.comm_s, a->gbit, o.overlap_s, o.exposed_s, o.step_s,
               a->compute_s > 0 ? "with --compute-s" : "the communication alone: no --compute-s");
    printf("  copies inside each node per step: intra-package %s, between packages %s\n",
           sd_fmt_bytes(b[0], sizeof(b[0]), (uint64_t)o.intra[SD_COST_PACKAGE]),
           sd_fmt_bytes(b[1], sizeof(b[1]), (uint64_t)o.intra[SD_COST_NODE]));
    printf("  (%s; the formulas: shardctl --help)\n",
           a->regather ? "each fetch gathers its unit again"
                       : "a gathered unit kept from forward to backward");
    return 0;
}

/* ---- plan --pick: every per-state plan topo:W/G/OS of the world, ranked */

struct candidate {
    struct sd_plan plan; /* plan.name: topo:W/G/OS */
    struct sd_cost_out o;
    uint64_t state_bytes; /* a rank's w, g, os and secondary */
    double intra;         /* copies inside a node per step */
};

/* faster first; among equal predictions, less memory, then fewer copies inside the node */
static int by_prediction(const void *x, const void *y)
{
    const struct candidate *a = x, *b = y;
    double tol = 1e-9 * (a->o.step_s > b->o.step_s ? a->o.step_s : b->o.step_s);
    if (fabs(a->o.step_s - b->o.step_s) > tol)
        return a->o.step_s < b->o.step_s ? -1 : 1;
    if (a->state_bytes != b->state_bytes)
        return a->state_bytes < b->state_bytes ? -1 : 1;
    if (a->intra != b->intra)
        return a->intra < b->intra ? -1 : 1;
    return strcmp(a->plan.name, b->plan.name);
}

/* is the named plan `name` p under another name (the same factors and sync)? */
static bool same_plan(const struct plan_args *a, const char *name, const struct sd_plan *p)
{
    struct sd_topo topo;
    struct sd_plan q;
    struct sd_cost_in in;
    return plan_model(a, name, true, &topo, &q, &in) == 0 && memcmp(q.f, p->f, sizeof(q.f)) == 0 &&
           q.two_hop == p->two_hop && q.hierarchical == p->hierarchical;
}

/* the named plan with the same factors and sync as p (zero3, mics:P, ...), or "" */
static const char *named_as(const struct plan_args *a, const struct sd_plan *p)
{
    static const char *const names[] = {"ddp", "zero1", "zero2", "zero3"};
    static char mics[32];
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (same_plan(a, names[i], p))
            return names[i];
    for (long P = 1; P <= a->world; P++) {
        snprintf(mics, sizeof(mics), "mics:%ld", P);
        if (a->world % P == 0 && same_plan(a, mics, p))
            return mics;
    }
    return "";
}

static int plan_pick(const struct plan_args *a, bool as_json)
{
    if (a->gbit <= 0) {
        fprintf(stderr, "shardctl plan --pick: needs --gbit-per-node B (> 0): the ranking is by "
                        "time\n");
        return 2;
    }
    struct sd_topo topo;
    struct sd_plan plan;
    struct sd_cost_in in;
    int st = plan_model(a, "zero3", false, &topo, &plan, &in);
    if (st != 0)
        return st;
    if (a->f_os != 0 && a->world % a->f_os != 0) {
        fprintf(stderr, "shardctl plan --pick: --f-os %ld does not divide the world (%ld)\n",
                a->f_os, a->world);
        return 2;
    }
    size_t cap = 64, n = 0;
    struct candidate *c = calloc(cap, sizeof(*c));
    if (c == NULL)
        return 1;
    for (long w = 1; w <= a->world; w++)
        for (long g = w; g <= a->world; g++)
            for (long os = g; os <= a->world; os++) {
                if (a->world % os || os % g || g % w || (a->f_os && os != a->f_os))
                    continue;
                char s[72];
                snprintf(s, sizeof(s), "topo:%ld/%ld/%ld", w, g, os);
                if (plan_model(a, s, true, &topo, &plan, &in) != 0)
                    continue; /* a combination the plans refuse */
                struct sd_cost_out o;
                sd_cost_step(&in, &plan, &o);
                uint64_t bytes = o.rank_bytes[0] + o.rank_bytes[1] + o.rank_bytes[2] + o.sec_bytes;
                if (a->max_rank_bytes && bytes > a->max_rank_bytes)
                    continue;
                if (n == cap) {
                    struct candidate *more = realloc(c, 2 * cap * sizeof(*c));
                    if (more == NULL) {
                        free(c);
                        return 1;
                    }
                    c = more;
                    cap *= 2;
                }
                c[n++] = (struct candidate){
                    .plan = plan, .o = o, .state_bytes = bytes, .intra = o.intra[0] + o.intra[1]};
            }
    if (n == 0) {
        fprintf(stderr,
                "shardctl plan --pick: no per-state plan of world %ld fits %llu bytes "
                "a rank%s\n",
                a->world, (unsigned long long)a->max_rank_bytes,
                a->f_os ? " with that --f-os" : "");
        free(c);
        return 1;
    }
    qsort(c, n, sizeof(*c), by_prediction);
    char same[32];
    snprintf(same, sizeof(same), "%s", named_as(a, &c[0].plan));
    if (as_json) {
        json_t *list = json_array();
        for (size_t i = 0; i < n; i++)
            json_array_append_new(list, json_pack("{s:s, s:f, s:f, s:f, s:f, s:I, s:f}", "plan",
                                                  c[i].plan.name, "step_s", c[i].o.step_s, "comm_s",
                                                  c[i].o.comm_s, "overlap_s", c[i].o.overlap_s,
                                                  "exposed_s", c[i].o.exposed_s, "rank_state_bytes",
                                                  (json_int_t)c[i].state_bytes,
                                                  "intra_node_bytes_per_step", c[i].intra));
        json_t *doc =
            json_pack("{s:s, s:s, s:f, s:b, s:o}", "pick", c[0].plan.name, "same_as", same,
                      "compute_s", a->compute_s, "last_marked", a->last_marked, "candidates", list);
        char *out = json_dumps(doc, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        puts(out);
        free(out);
        json_decref(doc);
        free(c);
        return 0;
    }
    printf("per-state plans of %llu parameters on %ld nodes x %ld ranks, accum %ld, %s weights, "
           "%s, %g Gbit/s per node, %s%s, by predicted step time:\n",
           a->params, a->world / a->k, a->k, a->accum, a->dtype, a->optimizer, a->gbit,
           a->compute_s > 0 ? "with the measured compute" : "communication alone (no --compute-s)",
           a->last_marked ? ", the last backward marked" : "");
    printf("  %-16s %9s %9s %9s %9s %12s %12s\n", "PLAN", "STEP-S", "COMM-S", "BESIDE-S", "AFTER-S",
           "RANK-STATES", "INTRA-NODE");
    for (size_t i = 0; i < n; i++) {
        char b[2][32];
        printf("  %-16s %9.3f %9.3f %9.3f %9.3f %12s %12s\n", c[i].plan.name, c[i].o.step_s,
               c[i].o.comm_s, c[i].o.overlap_s, c[i].o.exposed_s,
               sd_fmt_bytes(b[0], sizeof(b[0]), c[i].state_bytes),
               sd_fmt_bytes(b[1], sizeof(b[1]), (uint64_t)c[i].intra));
    }
    printf("the pick: %s%s%s%s\n", c[0].plan.name, same[0] ? " (the factors of " : "", same,
           same[0] ? ")" : "");
    printf("  (BESIDE: the gathers and reduce-scatters that run beside the forward and backward; "
           "AFTER:\n   the boundary hop and the weights' all-gather the step waits for; equal "
           "predictions\n   ranked by a rank's memory, then the copies inside the node)\n");
    free(c);
    return 0;
}

int shardctl_plan(const struct plan_args *a, bool as_json)
{
    return a->pick ? plan_pick(a, as_json) : plan_one(a, as_json);
}

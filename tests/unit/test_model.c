/* Plan, group and layout math against hand-computed tables. */
#include "harness.h"
#include "sd/model.h"
#include "sd/status.h"

#include <string.h>

static void test_plans(void)
{
    struct sd_topo one = {.nodes = 1, .ranks_per_node = 4}, two = {.nodes = 2, .ranks_per_node = 2};
    struct sd_plan p;
    char err[256];
    const struct {
        const char *spec;
        const struct sd_topo *topo;
        int status;
        uint32_t f;
    } cases[] = {
        {"ddp", &one, SD_OK, 1},
        {"zero3", &one, SD_OK, 4},
        {"mics:2", &one, SD_OK, 2},
        {"mics:4", &one, SD_OK, 4},
        {"mics:1", &one, SD_OK, 1},
        {"mics:3", &one, SD_EINVAL, 0},
        {"mics:8", &one, SD_EINVAL, 0},
        {"mics:0", &one, SD_EINVAL, 0},
        {"mics:", &one, SD_EINVAL, 0},
        {"mics:2x", &one, SD_EINVAL, 0},
        {"zero", &one, SD_EINVAL, 0},
        {"zero3", &two, SD_OK, 4},
        {"mics:4", &two, SD_OK, 4},
        {"mics:2", &two, SD_OK, 2},
        {"mics:3", &two, SD_EINVAL, 0},
        {"mics:4,no-hier", &two, SD_OK, 4},
        {"zero3,no-2hop,no-hier", &two, SD_OK, 4},
        {"mics:4,fast", &two, SD_EINVAL, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        err[0] = '\0';
        int st = sd_plan_parse(cases[i].spec, cases[i].topo, &p, err, sizeof(err));
        TH_CHECK(st == cases[i].status, "plan %s: status %d", cases[i].spec, st);
        if (st == SD_OK)
            TH_CHECK(p.f[SD_STATE_W] == cases[i].f && p.f[SD_STATE_G] == cases[i].f &&
                         p.f[SD_STATE_OS] == cases[i].f &&
                         p.two_hop == (strstr(cases[i].spec, "no-2hop") == NULL) &&
                         p.hierarchical == (strstr(cases[i].spec, "no-hier") == NULL),
                     "plan %s: f %u", cases[i].spec, p.f[0]);
        else
            TH_CHECK(strstr(err, cases[i].spec) != NULL, "error does not name the plan: %s", err);
    }
}

static void test_groups(void)
{
    struct sd_group g = sd_group_partition(4, 2);
    TH_CHECK(g.first == 0 && g.count == 4 && g.stride == 1, "zero3 partition of rank 2");
    g = sd_group_replication(4, 4, 2);
    TH_CHECK(g.first == 2 && g.count == 1, "zero3 replication of rank 2 is {2}");
    g = sd_group_partition(2, 3);
    TH_CHECK(g.first == 2 && g.count == 2 && sd_group_member(&g, 1) == 3, "mics:2 partition of 3");
    g = sd_group_replication(4, 2, 3);
    TH_CHECK(g.first == 1 && g.count == 2 && sd_group_member(&g, 1) == 3,
             "mics:2 replication of 3 is {1, 3}");
    g = sd_group_partition(1, 3);
    TH_CHECK(g.first == 3 && g.count == 1, "ddp partition of 3 is {3} (a group of 1)");
    g = sd_group_replication(4, 1, 3);
    TH_CHECK(g.first == 0 && g.count == 4 && g.stride == 1, "ddp replication is everyone");
    g = sd_group_replication(8, 2, 5); /* 8 ranks, f 2: shard 1 lives on 1, 3, 5, 7 */
    TH_CHECK(g.first == 1 && g.count == 4 && g.stride == 2 && sd_group_member(&g, 3) == 7,
             "replication {1,3,5,7}");
    struct sd_topo t = {.nodes = 4, .ranks_per_node = 2};
    g = sd_group_partition(4, 5);
    TH_CHECK(sd_group_nodes(&t, &g) == 2, "mics:4 on 2-rank nodes spans 2 nodes");
    g = sd_group_replication(8, 4, 1);
    TH_CHECK(sd_group_nodes(&t, &g) == 2, "replication {1, 5} spans nodes 0 and 2");
    g = sd_group_partition(2, 6);
    TH_CHECK(sd_group_nodes(&t, &g) == 1, "mics:2 stays inside a node");
}

static struct sd_tensor_desc tensors[] = {
    {.name = "w", .ndim = 2, .dims = {10, 3}, .dtype = SD_DTYPE_FP32, .unit = 0},
    {.name = "b", .ndim = 1, .dims = {10}, .dtype = SD_DTYPE_FP32, .unit = 0},
    {.name = "x", .ndim = 1, .dims = {7}, .dtype = SD_DTYPE_BF16, .unit = 1},
};

static struct sd_model model(void)
{
    struct sd_model m = {.n_tensors = 3, .tensors = tensors};
    m.optim =
        (struct sd_optim){.kind = SD_OPTIM_ADAMW, .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f};
    strcpy(m.plan, "zero3");
    return m;
}

static void test_layout(void)
{
    struct sd_model m = model();
    struct sd_topo topo = {.nodes = 1, .ranks_per_node = 4};
    char err[256];
    static const struct {
        const char *plan;
        uint64_t u0, u1, arena; /* padded unit sizes, elements per rank per state */
    } table[] = {
        /* unit 0: w at 0 (30), b at 32 (10): used 42; unit 1: x (7) */
        {"ddp", 64, 32, 96},     /* pad to 32 */
        {"mics:2", 64, 64, 64},  /* pad to 2 * 32 */
        {"zero3", 128, 128, 64}, /* pad to 4 * 32 */
    };
    for (size_t i = 0; i < 3; i++) {
        struct sd_plan p;
        struct sd_layout l;
        TH_CHECK(sd_plan_parse(table[i].plan, &topo, &p, err, sizeof(err)) == 0, "plan");
        TH_CHECK(sd_layout_build(&m, &p, &l, err, sizeof(err)) == 0, "layout: %s", err);
        TH_CHECK(l.n_units == 2 && l.units[0].numel == table[i].u0 &&
                     l.units[1].numel == table[i].u1,
                 "%s: unit sizes %llu %llu", table[i].plan, (unsigned long long)l.units[0].numel,
                 (unsigned long long)l.units[1].numel);
        TH_CHECK(l.tensors[0].offset == 0 && l.tensors[1].offset == 32 && l.tensors[2].offset == 0,
                 "tensor offsets aligned to 32 elements");
        TH_CHECK(l.units[0].used == 42 && l.units[1].used == 7, "used");
        TH_CHECK(l.arena_numel[SD_STATE_W] == table[i].arena &&
                     l.arena_numel[SD_STATE_OS] == table[i].arena,
                 "%s: arena %llu", table[i].plan, (unsigned long long)l.arena_numel[0]);
        TH_CHECK(l.units[1].arena_off[SD_STATE_G] == table[i].u0 / p.f[SD_STATE_G], "arena off");
        TH_CHECK(l.units[1].pool_off == table[i].u0, "pool off");
        TH_CHECK(l.total_bytes == table[i].u0 * 4 + table[i].u1 * 2, "bytes by dtype");
        TH_CHECK(l.max_unit_bytes == table[i].u0 * 4, "max unit bytes");
        uint64_t b, e;
        sd_layout_shard(&l.units[0], &p, SD_STATE_W, 3, &b, &e);
        uint64_t len = table[i].u0 / p.f[0];
        TH_CHECK(b == (3 % p.f[0]) * len && e == b + len && b % SD_ALIGN_ELEMS == 0,
                 "%s: shard of rank 3 [%llu, %llu)", table[i].plan, (unsigned long long)b,
                 (unsigned long long)e);
        sd_layout_free(&l);
    }
}

/* Every preset is a spelling of topo:W/G/OS, and a plan that breaks a rule is refused with a
 * message naming the factor and the rule. */
static void test_topo_plans(void)
{
    struct sd_topo t24 = {.nodes = 2, .ranks_per_node = 4},
                   t42p = {.nodes = 4, .ranks_per_node = 4, .package_size = 2};
    struct sd_plan p;
    char err[256];
    const struct {
        const char *spec;
        const struct sd_topo *topo;
        uint32_t w, g, os; /* 0: refused */
        const char *says;  /* in the refusal */
    } cases[] = {
        {"ddp", &t24, 1, 1, 1, NULL},
        {"zero1", &t24, 1, 1, 8, NULL},
        {"zero2", &t24, 1, 8, 8, NULL},
        {"zero3", &t24, 8, 8, 8, NULL},
        {"mics:4", &t24, 4, 4, 4, NULL},
        {"topo", &t24, 2, 4, 8, NULL},
        {"topo:2/4/8", &t24, 2, 4, 8, NULL},
        {"topo:2/k/n", &t24, 2, 4, 8, NULL},
        {"topo:1/2/8,no-hier,no-2hop", &t24, 1, 2, 8, NULL},
        {"topo:2/2/8,sec=2", &t24, 2, 2, 8, NULL},
        {"topo:4/2/8", &t24, 0, 0, 0, "f_w = 4 does not divide f_g"},
        {"topo:2/4/6", &t24, 0, 0, 0, "f_g = 4 does not divide f_os"},
        {"topo:1/1/16", &t24, 0, 0, 0, "f_os = 16 does not divide the world size"},
        {"topo:1/3/6", &(struct sd_topo){.nodes = 3, .ranks_per_node = 2}, 0, 0, 0,
         "f_g = 3 does not align"},
        {"topo:1/2", &t24, 0, 0, 0, "expected topo:W/G/OS"},
        {"topo:1/2/8/8", &t24, 0, 0, 0, "expected topo:W/G/OS"},
        {"topo:0/2/8", &t24, 0, 0, 0, "expected topo:W/G/OS"},
        {"topo:2/4/8,sec=3", &t24, 0, 0, 0, "sec=3"},
        {"topo:2/4/8,sec=x", &t24, 0, 0, 0, "sec=x"},
        /* packages of 2 on 4-rank nodes: a factor is part of a package, whole packages of the
         * node, or whole nodes */
        {"topo:2/4/16", &t42p, 2, 4, 16, NULL},
        {"topo:1/4/8", &t42p, 1, 4, 8, NULL},
        {"topo", &t42p, 2, 4, 16, NULL},
        {"topo:3/3/6", &(struct sd_topo){.nodes = 1, .ranks_per_node = 6, .package_size = 2}, 0, 0,
         0, "f_w = 3 does not align"},
        {"topo:2/6/12", &(struct sd_topo){.nodes = 2, .ranks_per_node = 12, .package_size = 4}, 0,
         0, 0, "f_g = 6 does not align"},
        {"zero3", &(struct sd_topo){.nodes = 1, .ranks_per_node = 6, .package_size = 4}, 0, 0, 0,
         "package_size 4 does not divide"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        err[0] = '\0';
        int st = sd_plan_parse(cases[i].spec, cases[i].topo, &p, err, sizeof(err));
        if (cases[i].w != 0) {
            TH_CHECK(st == SD_OK, "plan %s refused: %s", cases[i].spec, err);
            if (st == SD_OK)
                TH_CHECK(p.f[SD_STATE_W] == cases[i].w && p.f[SD_STATE_G] == cases[i].g &&
                             p.f[SD_STATE_OS] == cases[i].os,
                         "plan %s: %u/%u/%u", cases[i].spec, p.f[0], p.f[1], p.f[2]);
        } else {
            TH_CHECK(st == SD_EINVAL && strstr(err, cases[i].spec) != NULL &&
                         strstr(err, cases[i].says) != NULL,
                     "plan %s: status %d, message '%s' (expected '%s')", cases[i].spec, st, err,
                     cases[i].says);
        }
    }
    TH_CHECK(sd_plan_parse("topo:2/2/8,sec=2", &t24, &p, err, sizeof(err)) == SD_OK && p.sec == 2,
             "sec=2 parsed");
}

/* The nesting of model.h for every valid plan over a table of worlds, node sizes and package
 * sizes: each rank's os shard lies in its g shard, which lies in its w shard; each partition
 * group holds every shard of its state once; the replication group of a state holds one
 * shard. Checked against the elements themselves, not the formula. */
static void test_nesting(void)
{
    static const uint32_t shapes[][3] = {/* nodes, k, package */
                                         {1, 4, 1}, {2, 4, 1}, {4, 2, 1}, {2, 4, 2},
                                         {4, 4, 2}, {3, 4, 2}, {2, 8, 4}, {8, 1, 1}};
    uint64_t plans = 0;
    for (size_t t = 0; t < sizeof(shapes) / sizeof(shapes[0]); t++) {
        struct sd_topo topo = {
            .nodes = shapes[t][0], .ranks_per_node = shapes[t][1], .package_size = shapes[t][2]};
        uint32_t n = sd_topo_world(&topo);
        for (uint32_t W = 1; W <= n; W++)
            for (uint32_t G = W; G <= n; G++)
                for (uint32_t OS = G; OS <= n; OS++) {
                    char spec[32], err[256];
                    struct sd_plan p;
                    snprintf(spec, sizeof(spec), "topo:%u/%u/%u", W, G, OS);
                    if (sd_plan_parse(spec, &topo, &p, err, sizeof(err)) != SD_OK)
                        continue;
                    plans++;
                    struct sd_unit_layout ul = {.numel = (uint64_t)OS * SD_ALIGN_ELEMS};
                    bool ok = true;
                    for (uint32_t r = 0; r < n && ok; r++) {
                        uint64_t wb, we, gb, ge, ob, oe;
                        sd_layout_shard(&ul, &p, SD_STATE_W, r, &wb, &we);
                        sd_layout_shard(&ul, &p, SD_STATE_G, r, &gb, &ge);
                        sd_layout_shard(&ul, &p, SD_STATE_OS, r, &ob, &oe);
                        ok =
                            wb <= gb && ge <= we && gb <= ob && oe <= ge &&
                            ob - wb ==
                                sd_plan_nested_off(&p, SD_STATE_OS, SD_STATE_W, r, ul.numel) &&
                            ob - gb == sd_plan_nested_off(&p, SD_STATE_OS, SD_STATE_G, r, ul.numel);
                        TH_CHECK(ok,
                                 "%s on %ux%u (package %u): rank %u holds w [%llu,%llu) g "
                                 "[%llu,%llu) os [%llu,%llu)",
                                 spec, topo.nodes, topo.ranks_per_node, topo.package_size, r,
                                 (unsigned long long)wb, (unsigned long long)we,
                                 (unsigned long long)gb, (unsigned long long)ge,
                                 (unsigned long long)ob, (unsigned long long)oe);
                    }
                    for (int st = 0; st < SD_STATE_COUNT && ok; st++) {
                        uint32_t f = p.f[st];
                        /* a partition group: f consecutive ranks, every shard once */
                        for (uint32_t first = 0; first < n && ok; first += f) {
                            uint64_t seen = 0;
                            for (uint32_t j = 0; j < f; j++)
                                seen |= 1ULL << sd_plan_shard(&p, st, first + j);
                            ok = seen == (f == 64 ? ~0ULL : (1ULL << f) - 1);
                        }
                        /* the inverse: the position in its group of each shard's holder */
                        for (uint32_t j = 0; j < f && ok; j++)
                            ok = sd_plan_shard_pos(&p, st, sd_plan_shard(&p, st, j)) == j;
                        /* a replication group: one shard */
                        for (uint32_t r = 0; r < n && ok; r++) {
                            struct sd_group g = sd_group_replication(n, f, r);
                            for (uint32_t j = 0; j < g.count && ok; j++)
                                ok = sd_plan_shard(&p, st, sd_group_member(&g, j)) ==
                                     sd_plan_shard(&p, st, r);
                        }
                        TH_CHECK(ok, "%s on %ux%u: the groups of %s (and the holders' positions)",
                                 spec, topo.nodes, topo.ranks_per_node, sd_state_name(st));
                    }
                }
    }
    TH_CHECK(plans > 100, "%llu valid plans checked", (unsigned long long)plans);
    printf("nesting holds for %llu valid plans over %zu topologies\n", (unsigned long long)plans,
           sizeof(shapes) / sizeof(shapes[0]));
}

static void test_validation_and_digest(void)
{
    char err[256], diff[256];
    struct sd_model a = model(), b = model();
    TH_CHECK(sd_model_validate(&a, err, sizeof(err)) == 0, "valid model: %s", err);
    TH_CHECK(sd_model_digest(&a) == sd_model_digest(&b), "same model, same digest");
    struct sd_tensor_desc t2[3];
    memcpy(t2, tensors, sizeof(t2));
    t2[2].dims[0] = 8;
    b.tensors = t2;
    TH_CHECK(sd_model_digest(&a) != sd_model_digest(&b), "dims change the digest");
    sd_model_diff(&a, &b, diff, sizeof(diff));
    TH_CHECK(strcmp(diff, "tensor 2 'x': dims[0] 7 vs 8") == 0, "diff: %s", diff);
    b = model();
    b.optim.lr = 2e-3f;
    TH_CHECK(sd_model_digest(&a) != sd_model_digest(&b), "lr changes the digest");
    strcpy(b.plan, "ddp");
    sd_model_diff(&a, &b, diff, sizeof(diff));
    TH_CHECK(strstr(diff, "plan") != NULL, "diff names the plan: %s", diff);

    memcpy(t2, tensors, sizeof(t2));
    t2[2].unit = 2;
    b = model();
    b.tensors = t2;
    TH_CHECK(sd_model_validate(&b, err, sizeof(err)) == SD_EINVAL && strstr(err, "unit 2"),
             "unit gap: %s", err);
    memcpy(t2, tensors, sizeof(t2));
    t2[1].dtype = SD_DTYPE_BF16;
    TH_CHECK(sd_model_validate(&b, err, sizeof(err)) == SD_EINVAL && strstr(err, "dtype"),
             "mixed dtypes in a unit: %s", err);
    memcpy(t2, tensors, sizeof(t2));
    strcpy(t2[2].name, "w");
    TH_CHECK(sd_model_validate(&b, err, sizeof(err)) == SD_EINVAL && strstr(err, "share"),
             "duplicate names: %s", err);
    memcpy(t2, tensors, sizeof(t2));
    t2[0].dims[1] = 0;
    TH_CHECK(sd_model_validate(&b, err, sizeof(err)) == SD_EINVAL && strstr(err, "dimension 1"),
             "zero dim: %s", err);
    b = model();
    b.optim.beta1 = 1.0f;
    TH_CHECK(sd_model_validate(&b, err, sizeof(err)) == SD_EINVAL, "beta1 = 1 refused");
}

/* The quantized options and the presets that carry them. */
static void test_quant_plans(void)
{
    struct sd_topo t42 = {.nodes = 4, .ranks_per_node = 2, .package_size = 1};
    struct sd_plan p;
    char err[256];
    const struct {
        const char *spec;
        bool qw, qg, qsec, ef;
        uint32_t sec, block, fw;
        const char *says; /* NULL: accepted */
    } cases[] = {
        {"zero3,qw", true, false, false, false, 0, 2048, 8, NULL},
        {"zero3,qg,ef", false, true, false, true, 0, 2048, 8, NULL},
        {"zeropp", true, true, false, false, 2, 2048, 8, NULL},       /* sec = k */
        {"zeropp,sec=1", true, true, false, false, 1, 2048, 8, NULL}, /* given S wins */
        {"zeropp,ef,qblock=256", true, true, false, true, 2, 256, 8, NULL},
        {"topo", true, true, true, false, 1, 2048, 2, NULL}, /* sec = package */
        {"topo-fp", false, false, false, false, 0, 2048, 2, NULL},
        {"topo:2/2/8,qw,qg,qsec", true, true, true, false, 1, 2048, 2, NULL},
        {"mics:2,qsec,sec=2", false, false, true, false, 2, 2048, 2, NULL},
        {"zero3,ef", false, false, false, false, 0, 0, 0, "needs qg"},
        {"zero3,qblock=64", false, false, false, false, 0, 0, 0, "none is on"},
        {"zero3,qw,qblock=1", false, false, false, false, 0, 0, 0, "qblock=1"},
        {"zero3,qw,qblock=65537", false, false, false, false, 0, 0, 0, "qblock=65537"},
        {"zero3,qw,qblock=x", false, false, false, false, 0, 0, 0, "qblock=x"},
        {"zero3,q8", false, false, false, false, 0, 0, 0, "unknown option 'q8'"},
        {"zeropp:2", false, false, false, false, 0, 0, 0, "unknown plan"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        err[0] = '\0';
        int st = sd_plan_parse(cases[i].spec, &t42, &p, err, sizeof(err));
        if (cases[i].says != NULL) {
            TH_CHECK(st == SD_EINVAL && strstr(err, cases[i].says) != NULL,
                     "plan %s: status %d, message '%s' (expected '%s')", cases[i].spec, st, err,
                     cases[i].says);
            continue;
        }
        TH_CHECK(st == SD_OK && p.qw == cases[i].qw && p.qg == cases[i].qg &&
                     p.qsec == cases[i].qsec && p.ef == cases[i].ef && p.sec == cases[i].sec &&
                     p.qblock == cases[i].block && p.f[SD_STATE_W] == cases[i].fw,
                 "plan %s: status %d (%s), qw %d qg %d qsec %d ef %d sec %u block %u f_w %u",
                 cases[i].spec, st, err, p.qw, p.qg, p.qsec, p.ef, p.sec, p.qblock,
                 p.f[SD_STATE_W]);
    }
    /* with ,qsec a secondary piece of n elements is n + 4 ceil(n / B) bytes */
    struct sd_tensor_desc t = {.name = "w", .ndim = 1, .dims = {8000}, .dtype = SD_DTYPE_BF16};
    struct sd_model m = {.n_tensors = 1, .tensors = &t};
    struct sd_layout l;
    TH_CHECK(sd_plan_parse("zero3,qsec,sec=2,qblock=1000", &t42, &p, err, sizeof(err)) == SD_OK,
             "zero3,qsec: %s", err);
    if (sd_layout_build(&m, &p, &l, err, sizeof(err)) == SD_OK) {
        uint64_t n = l.units[0].numel / 2;
        TH_CHECK(l.sec_bytes == n + 4 * ((n + 999) / 1000),
                 "qsec piece of %llu elements: %llu bytes", (unsigned long long)n,
                 (unsigned long long)l.sec_bytes);
        sd_layout_free(&l);
    } else {
        TH_CHECK(false, "layout of an 8000-element model");
    }
}

int main(void)
{
    test_plans();
    test_quant_plans();
    test_groups();
    test_layout();
    test_topo_plans();
    test_nesting();
    test_validation_and_digest();
    return th_summary("test_model");
}

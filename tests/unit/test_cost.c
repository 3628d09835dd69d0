/* The cost model against bytes worked out by hand; which plans' boundary hop reduce-scatters,
 * against the ownership worked out rank by rank. */
#include "harness.h"
#include "sd/codec.h"
#include "sd/cost.h"
#include "sd/status.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static double total(const char *plan_s, uint32_t accum, bool cached)
{
    struct sd_topo t = {.nodes = 4, .ranks_per_node = 2};
    struct sd_plan p;
    char err[128];
    sd_plan_parse(plan_s, &t, &p, err, sizeof(err));
    struct sd_cost_in in = {.numel = 250000,
                            .w_bytes = 4,
                            .nodes = 4,
                            .k = 2,
                            .accum = accum,
                            .cached_in_step = cached,
                            .inter_Bps = 1e6};
    struct sd_cost_out o;
    sd_cost_step(&in, &p, &o);
    TH_CHECK(fabs(o.comm_s - o.total_bytes / 1e6) < 1e-9, "time = bytes / bandwidth");
    return o.total_bytes;
}

/* Written from the rank formulas alone (sd_plan_shard): nodes holding the same g shards at the
 * same local ranks form a replication group; the block is owned when the group has 2 or more
 * nodes and each piece of numel / f_os of each g shard the node holds (os shard g P + q) is held
 * by a rank of exactly one node of the group, each node owning as many pieces. */
static bool owned_by_hand(const struct sd_plan *p, uint32_t N, uint32_t k)
{
    uint32_t G = p->f[SD_STATE_G], OS = p->f[SD_STATE_OS], P = OS / G;
    for (uint32_t m = 0; m < N; m++) {
        uint32_t group[64], R = 0, count[64] = {0};
        for (uint32_t x = 0; x < N; x++) {
            bool same = true;
            for (uint32_t j = 0; j < k; j++)
                same = same && sd_plan_shard(p, SD_STATE_G, x * k + j) ==
                                   sd_plan_shard(p, SD_STATE_G, m * k + j);
            if (same)
                group[R++] = x;
        }
        if (R < 2)
            return false;
        for (uint32_t j = 0; j < k; j++) {
            uint32_t g = sd_plan_shard(p, SD_STATE_G, m * k + j);
            for (uint32_t q = 0; q < P; q++) {
                uint32_t owners = 0, at = 0;
                for (uint32_t i = 0; i < R; i++) {
                    bool holds = false;
                    for (uint32_t r = group[i] * k; r < (group[i] + 1) * k; r++)
                        holds = holds || sd_plan_shard(p, SD_STATE_OS, r) == g * P + q;
                    owners += holds;
                    at = holds ? i : at;
                }
                if (owners != 1)
                    return false;
                count[at]++;
            }
        }
        for (uint32_t i = 1; i < R; i++)
            if (count[i] != count[0])
                return false;
    }
    return true;
}

/* sd_plan_hop_owned (f_os = world, R > 1) against owned_by_hand for every plan of several
 * topologies; the number of plans it owns */
static int check_hop_owned(void)
{
    static const uint32_t topos[][2] = {{2, 2}, {2, 4}, {4, 2}, {4, 4},
                                        {8, 2}, {3, 2}, {2, 8}, {4, 1}};
    int owned = 0;
    for (size_t t = 0; t < sizeof(topos) / sizeof(topos[0]); t++) {
        uint32_t N = topos[t][0], k = topos[t][1], n = N * k;
        struct sd_topo topo = {.nodes = N, .ranks_per_node = k};
        for (uint32_t W = 1; W <= n; W++)
            for (uint32_t G = W; G <= n; G++)
                for (uint32_t OS = G; OS <= n; OS++) {
                    char spec[64], err[160];
                    struct sd_plan p;
                    snprintf(spec, sizeof(spec), "topo:%u/%u/%u", W, G, OS);
                    if (sd_plan_parse(spec, &topo, &p, err, sizeof(err)) != 0)
                        continue;
                    bool want = owned_by_hand(&p, N, k);
                    owned += want;
                    TH_CHECK(sd_plan_hop_owned(&p, N, k) == want, "%ux%u %s: owned %d, by hand %d",
                             N, k, spec, sd_plan_hop_owned(&p, N, k), want);
                    p.qg = true; /* quantized: the hop all-reduces its int4 blocks */
                    TH_CHECK(!sd_plan_hop_owned(&p, N, k), "%s,qg owned", spec);
                }
    }
    return owned;
}

int main(void)
{
    int owned = check_hop_owned();
    TH_CHECK(owned >= 10, "only %d plans have an owned hop", owned);
    /* S = 1e6 bytes, N = 4, k = 2. norm: 8 * 3 = 24 bytes per step */
    /* zero3 (p 8, G 4): gather 3/4 S, reduce-scatter 3/4 S per micro-step, no all-reduce */
    TH_CHECK(total("zero3", 4, true) == 0.75e6 + 4 * 0.75e6 + 24, "zero3 cached accum 4");
    TH_CHECK(total("zero3", 4, false) == 8 * 0.75e6 + 4 * 0.75e6 + 24, "zero3 re-gathering");
    /* mics:2 (inside a node): only the 2-hop all-reduce across all 4 nodes, 2 * 3/4 S */
    TH_CHECK(total("mics:2", 4, true) == 1.5e6 + 24, "mics:2");
    /* without 2-hop that all-reduce happens every micro-step */
    TH_CHECK(total("mics:2,no-2hop", 4, true) == 4 * 1.5e6 + 24, "mics:2 no-2hop");
    /* mics:4 (G 2, R 2): gather 1/2 S, reduce-scatter 1/2 S per micro-step, all-reduce of the
     * 1/2 S block across 2 nodes: 2 * 1/2 * 1/2 S */
    TH_CHECK(total("mics:4", 4, true) == 0.5e6 + 4 * 0.5e6 + 0.5e6 + 24, "mics:4");
    TH_CHECK(total("mics:4,no-hier", 4, true) == 2 * 0.5e6 + 4 * 0.5e6 + 0.5e6 + 24,
             "mics:4 without the hierarchical gather: k times the gather");
    /* ddp: all-reduce of S across 4 nodes once per step */
    TH_CHECK(total("ddp", 1, true) == 1.5e6 + 24, "ddp");
    /* topo:2/2/8 (f_w = f_g = k: nothing per micro-step): f_os = world, so the hop
     * reduce-scatters S across 4 nodes, 3/4 S (all-reduced with ,hop-ar: 1.5 S); the weights'
     * all-gather sends the node's 2 parts of S/8 to the 3 other nodes */
    TH_CHECK(total("topo:2/2/8", 4, true) == 0.75e6 + 2 * 0.125e6 * 3 + 24, "topo:2/2/8");
    TH_CHECK(total("topo:2/2/8,hop-ar", 4, true) == 1.5e6 + 2 * 0.125e6 * 3 + 24,
             "topo:2/2/8,hop-ar");
    /* quantized, blocks of 2048: int8 is 1 + 4/2048 bytes an element, int4 1/2 + 4/2048. The
     * hop moves int4 (1.5 numel of them), the weights' all-gather int8 (6 parts of numel/8) */
    double i8 = 1.0 + 4.0 / 2048, i4 = 0.5 + 4.0 / 2048;
    TH_CHECK(fabs(total("topo:2/2/8,qw,qg", 4, true) -
                  (1.5 * 250000 * i4 + 6 * 250000 / 8.0 * i8 + 24)) < 1e-6,
             "topo:2/2/8,qw,qg: %.3f", total("topo:2/2/8,qw,qg", 4, true));
    /* zeropp = zero3,qw,qg,sec=2: one gather of 3/4 numel int8 (the secondary serves the rest),
     * 4 reduce-scatters of 3/4 numel int4 */
    TH_CHECK(fabs(total("zeropp", 4, false) - (0.75 * 250000 * i8 + 4 * 0.75 * 250000 * i4 + 24)) <
                 1e-6,
             "zeropp: %.3f", total("zeropp", 4, false));
    /* zero2 (f_w = 1, g and os over all): reduce-scatter 3/4 S per micro-step, no hop (R 1),
     * the weights' all-gather as above */
    TH_CHECK(total("zero2", 4, true) == 4 * 0.75e6 + 0.75e6 + 24, "zero2");
    /* zero1: the hop reduce-scatters all of S, 3/4 S (1.5 S all-reduced), then the same
     * all-gather */
    TH_CHECK(total("zero1", 4, true) == 0.75e6 + 0.75e6 + 24, "zero1");
    TH_CHECK(total("zero1,hop-ar", 4, true) == 1.5e6 + 0.75e6 + 24, "zero1,hop-ar");
    /* topo:4/4/8 on 2-rank nodes: w groups of 2 nodes gather 1/2 S, g groups reduce-scatter
     * 1/2 S; the hop across R = 2 nodes reduce-scatters 1/2 of the 1/2 S block (all-reduced,
     * 2 (1/2)); each part of S/8 goes to G_os / G_w - 1 = 1 node */
    TH_CHECK(total("topo:4/4/8", 1, true) == 0.5e6 + 0.5e6 + 0.25e6 + 2 * 0.125e6 + 24,
             "topo:4/4/8");
    TH_CHECK(total("topo:4/4/8,hop-ar", 1, true) == 0.5e6 + 0.5e6 + 0.5e6 + 2 * 0.125e6 + 24,
             "topo:4/4/8,hop-ar");
    /* ,gwire=bf16 (or fp16): the gradients that cross nodes in 2 bytes: zero3's reduce-scatters
     * 4 x 3/8 S, mics:4's too and its hop of the 1/2 S block across 2 nodes at half, topo:2/2/8's
     * reduce-scattered hop 3/8 S; the weights' gathers and all-gather stay (fp32 weights) */
    TH_CHECK(total("zero3,gwire=bf16", 4, true) == 0.75e6 + 4 * 0.375e6 + 24, "zero3,gwire=bf16");
    TH_CHECK(total("mics:4,gwire=fp16", 4, true) == 0.5e6 + 4 * 0.25e6 + 0.25e6 + 24,
             "mics:4,gwire=fp16");
    TH_CHECK(total("topo:2/2/8,gwire=bf16", 4, true) == 0.375e6 + 2 * 0.125e6 * 3 + 24,
             "topo:2/2/8,gwire=bf16");
    TH_CHECK(total("topo:2/2/8,gwire=fp32", 4, true) == total("topo:2/2/8", 4, true),
             "gwire=fp32 is the default");
    /* with ,qg the int4 blocks stay int4 (the model ignores the fallbacks gwire would carry) */
    TH_CHECK(total("zeropp,gwire=bf16", 4, false) == total("zeropp", 4, false), "zeropp,gwire");
    {
        struct sd_topo tt = {.nodes = 4, .ranks_per_node = 2};
        struct sd_plan pp;
        char e2[160];
        TH_CHECK(sd_plan_parse("zero3,gwire=int8", &tt, &pp, e2, sizeof(e2)) == SD_EINVAL &&
                     strstr(e2, "bf16, fp16 or fp32") != NULL,
                 "gwire=int8 refused naming the choices: %s", e2);
        TH_CHECK(sd_plan_parse("mics:2,gwire=fp16", &tt, &pp, e2, sizeof(e2)) == SD_OK &&
                     pp.gwire == SD_DTYPE_FP16 && sd_plan_gwire_codec(&pp) == SD_CODEC_FP16 &&
                     sd_plan_hop_scatters(&pp, 4, 2) == false,
                 "mics:2,gwire=fp16 parses");
        TH_CHECK(sd_plan_parse("zero1,gwire=bf16", &tt, &pp, e2, sizeof(e2)) == SD_OK &&
                     sd_plan_hop_scatters(&pp, 4, 2),
                 "zero1,gwire=bf16: the hop still reduce-scatters (in bf16)");
    }
    /* memory per rank: w S/f_w, g 4 numel/f_g, AdamW 12 numel/f_os */
    struct sd_topo t = {.nodes = 4, .ranks_per_node = 2};
    struct sd_plan p;
    char err[128];
    TH_CHECK(sd_plan_parse("topo:2/2/8", &t, &p, err, sizeof(err)) == 0, "parse");
    struct sd_cost_in in = {.numel = 800, .w_bytes = 2, .nodes = 4, .k = 2, .accum = 1};
    struct sd_cost_out o;
    sd_cost_step(&in, &p, &o);
    TH_CHECK(o.rank_bytes[SD_STATE_W] == 800 && o.rank_bytes[SD_STATE_G] == 1600 &&
                 o.rank_bytes[SD_STATE_OS] == 1200,
             "rank bytes %llu %llu %llu", (unsigned long long)o.rank_bytes[0],
             (unsigned long long)o.rank_bytes[1], (unsigned long long)o.rank_bytes[2]);

    /* the secondary partition: zero3,sec=2 re-gathering (a small pool), accum 4: only the
     * first gather of the step crosses nodes, 3/4 S instead of 8 x 3/4 S */
    TH_CHECK(total("zero3,sec=2", 4, false) == 0.75e6 + 4 * 0.75e6 + 24, "zero3,sec=2");
    /* f_w = 2 = S: nothing to save, nothing held */
    TH_CHECK(total("topo:2/2/8,sec=2", 4, false) == total("topo:2/2/8", 4, false),
             "topo:2/2/8,sec=2 is topo:2/2/8");
    TH_CHECK(sd_plan_parse("zero3,sec=2", &t, &p, err, sizeof(err)) == 0, "parse");
    in.w_bytes = 4;
    sd_cost_step(&in, &p, &o);
    TH_CHECK(o.sec_bytes == 1600, "zero3,sec=2 holds 800 / 2 fp32 weights per holder: %llu",
             (unsigned long long)o.sec_bytes);
    TH_CHECK(sd_plan_parse("topo:2/2/8,sec=2", &t, &p, err, sizeof(err)) == 0, "parse");
    sd_cost_step(&in, &p, &o);
    TH_CHECK(o.sec_bytes == 0, "inactive secondary holds nothing");

    /* copies inside a node, by hand (S = 4 numel bytes, one node of 4 ranks in 2 packages) */
    struct sd_topo one = {.nodes = 1, .ranks_per_node = 4, .package_size = 2};
    struct sd_cost_in in1 = {.numel = 1000,
                             .w_bytes = 4,
                             .nodes = 1,
                             .k = 4,
                             .accum = 1,
                             .cached_in_step = true,
                             .package = 2};
    double S = 4000;
    /* mics:4: fetch copies ranks 0..3 into rank 0's copy, S/4 each: 0,1 in its package; push:
     * each holder gets S/4 from each of the 4 members, 2 of them in its package; no replicas,
     * no weights' parts to copy */
    TH_CHECK(sd_plan_parse("mics:4", &one, &p, err, sizeof(err)) == 0, "parse");
    sd_cost_step(&in1, &p, &o);
    TH_CHECK(o.intra[SD_COST_PACKAGE] == 2.5 * S && o.intra[SD_COST_NODE] == 2.5 * S,
             "mics:4 intra %g %g", o.intra[0], o.intra[1]);
    /* zero1: fetch S from rank 0 to itself; push: each rank's S to itself (4 S); step: the
     * replicas 1, 2, 3 of the one g shard summed into rank 0 and copied back (2 S each, rank 1
     * in rank 0's package); the weights: each rank gets the 3 parts of S/4 the others own, 4
     * of the 12 within a package */
    TH_CHECK(sd_plan_parse("zero1", &one, &p, err, sizeof(err)) == 0, "parse");
    sd_cost_step(&in1, &p, &o);
    TH_CHECK(o.intra[SD_COST_PACKAGE] == 8 * S && o.intra[SD_COST_NODE] == 6 * S,
             "zero1 intra %g %g", o.intra[0], o.intra[1]);

    /* when the bytes move (S = 1e6 bytes, 1e6 B/s, N = 4, k = 2, accum 4): zero3's gathers and
     * reduce-scatters (3/4 S + 4 x 3/4 S) go beside the forward and backward, its norm after;
     * topo:2/2/8's hop (0.75 S) and weights' all-gather (0.75 S) after the last backward, or only
     * the all-gather when the last backward is marked (its g group is inside the node) */
    struct sd_cost_in tin = {.numel = 250000,
                             .w_bytes = 4,
                             .nodes = 4,
                             .k = 2,
                             .accum = 4,
                             .cached_in_step = true,
                             .inter_Bps = 1e6};
    TH_CHECK(sd_plan_parse("zero3", &t, &p, err, sizeof(err)) == 0, "parse");
    sd_cost_step(&tin, &p, &o);
    TH_CHECK(fabs(o.overlap_s - 3.75) < 1e-9 && fabs(o.exposed_s - 24e-6) < 1e-12 &&
                 fabs(o.step_s - o.comm_s) < 1e-12,
             "zero3: %.6f s beside, %.6f s after, step %.6f", o.overlap_s, o.exposed_s, o.step_s);
    tin.compute_s = 10.0; /* the compute hides what goes beside it */
    sd_cost_step(&tin, &p, &o);
    TH_CHECK(fabs(o.step_s - (10.0 + 24e-6)) < 1e-9, "zero3 under 10 s of compute: %.6f", o.step_s);
    tin.compute_s = 1.0; /* and not what is longer than it */
    sd_cost_step(&tin, &p, &o);
    TH_CHECK(fabs(o.step_s - (3.75 + 24e-6)) < 1e-9, "zero3 over 1 s of compute: %.6f", o.step_s);
    TH_CHECK(sd_plan_parse("topo:2/2/8", &t, &p, err, sizeof(err)) == 0, "parse");
    sd_cost_step(&tin, &p, &o);
    TH_CHECK(o.overlap_s == 0.0 && fabs(o.exposed_s - (1.5 + 24e-6)) < 1e-9 &&
                 fabs(o.step_s - (1.0 + 1.5 + 24e-6)) < 1e-9,
             "topo:2/2/8: %.6f s beside, %.6f s after, step %.6f", o.overlap_s, o.exposed_s,
             o.step_s);
    tin.last_marked = true;
    sd_cost_step(&tin, &p, &o);
    TH_CHECK(fabs(o.overlap_s - 0.75) < 1e-9 && fabs(o.exposed_s - (0.75 + 24e-6)) < 1e-9 &&
                 fabs(o.step_s - (1.0 + 0.75 + 24e-6)) < 1e-9,
             "topo:2/2/8, last marked: the hop beside the backward: %.6f, %.6f, step %.6f",
             o.overlap_s, o.exposed_s, o.step_s);
    /* mics:4's g groups span 2 nodes: its hop cannot go early, marked or not */
    TH_CHECK(sd_plan_parse("mics:4", &t, &p, err, sizeof(err)) == 0, "parse");
    sd_cost_step(&tin, &p, &o);
    TH_CHECK(fabs(o.exposed_s - (o.hop_bytes + 24) / 1e6) < 1e-12 && o.hop_bytes > 0,
             "mics:4's hop stays after the backward: %.6f", o.exposed_s);
    TH_CHECK(fabs(o.overlap_s + o.exposed_s - o.comm_s) < 1e-12, "beside + after = comm_s");
    return th_summary("test_cost");
}

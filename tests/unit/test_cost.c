/* The cost model against bytes worked out by hand. */
#include "harness.h"
#include "sd/cost.h"

#include <math.h>

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

int main(void)
{
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
    /* topo:2/2/8 (f_w = f_g = k: nothing per micro-step): the hop all-reduces S across 4 nodes,
     * 1.5 S; the weights' all-gather sends the node's 2 parts of S/8 to the 3 other nodes */
    TH_CHECK(total("topo:2/2/8", 4, true) == 1.5e6 + 2 * 0.125e6 * 3 + 24, "topo:2/2/8");
    /* zero2 (f_w = 1, g and os over all): reduce-scatter 3/4 S per micro-step, no hop (R 1),
     * the weights' all-gather as above */
    TH_CHECK(total("zero2", 4, true) == 4 * 0.75e6 + 0.75e6 + 24, "zero2");
    /* zero1: the hop all-reduces all of S, 1.5 S, then the same all-gather */
    TH_CHECK(total("zero1", 4, true) == 1.5e6 + 0.75e6 + 24, "zero1");
    /* topo:4/4/8 on 2-rank nodes: w groups of 2 nodes gather 1/2 S, g groups reduce-scatter
     * 1/2 S; the hop across R = 2 nodes moves 2 (1/2) of the 1/2 S block; each part of S/8 goes
     * to G_os / G_w - 1 = 1 node */
    TH_CHECK(total("topo:4/4/8", 1, true) == 0.5e6 + 0.5e6 + 0.5e6 + 2 * 0.125e6 + 24,
             "topo:4/4/8");
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
    return th_summary("test_cost");
}

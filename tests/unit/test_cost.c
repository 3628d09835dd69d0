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
    return th_summary("test_cost");
}

#include "sd/cost.h"

void sd_cost_step(const struct sd_cost_in *in, const struct sd_plan *plan,
                  struct sd_cost_out *out_p)
{
    double S_w = (double)in->numel * in->w_bytes, S_g = (double)in->numel * 4.0;
    uint32_t p = plan->f[SD_STATE_W], k = in->k, N = in->nodes;
    uint32_t G = p > k ? p / k : 1; /* nodes per partition group */
    uint32_t R = G > 1 ? N / G : N; /* nodes per replication group */
    double block_g = S_g / G;       /* a node's share of the gradient */
    double gathers = in->cached_in_step ? 1.0 : 2.0 * in->accum;
    struct sd_cost_out o = {0};
    /* each gather: the node sends its block to the group's other nodes, once per node
     * (hierarchical) or once per requesting rank */
    o.fetch_bytes = gathers * (G - 1) * (S_w / G) * (plan->hierarchical ? 1.0 : k);
    /* every micro-step: reduce-scatter inside the partition group */
    double ar = R > 1 ? 2.0 * (R - 1) / R * block_g : 0.0;
    o.push_bytes = in->accum * ((G - 1) * block_g + (plan->two_hop ? 0.0 : ar));
    /* at the step: the 2-hop all-reduce across the replication group, and the norm */
    o.step_bytes = (plan->two_hop ? ar : 0.0) + 8.0 * (N - 1);
    o.total_bytes = o.fetch_bytes + o.push_bytes + o.step_bytes;
    o.comm_s = in->inter_Bps > 0 ? o.total_bytes / in->inter_Bps : 0.0;
    *out_p = o;
}

#include "sd/cost.h"

static double nodes_of(uint32_t f, uint32_t k)
{
    return f > k ? (double)(f / k) : 1.0;
}

void sd_cost_step(const struct sd_cost_in *in, const struct sd_plan *plan,
                  struct sd_cost_out *out_p)
{
    double S_w = (double)in->numel * in->w_bytes, S_g = (double)in->numel * 4.0;
    uint32_t k = in->k, N = in->nodes;
    uint32_t W = plan->f[SD_STATE_W], G = plan->f[SD_STATE_G], OS = plan->f[SD_STATE_OS];
    double Gw = nodes_of(W, k), Gg = nodes_of(G, k), Gos = nodes_of(OS, k);
    double R = N / Gg;   /* nodes holding the replicas of a node's g block */
    double B = S_g / Gg; /* a node's g block */
    double gathers = in->cached_in_step ? 1.0 : 2.0 * in->accum;
    struct sd_cost_out o = {0};
    o.fetch_bytes = gathers * (Gw - 1) * (S_w / Gw) * (plan->hierarchical ? 1.0 : k);
    double ar = R > 1 ? 2.0 * (R - 1) / R * B : 0.0;
    o.push_bytes = in->accum * ((Gg - 1) * B + (plan->two_hop ? 0.0 : ar));
    o.hop_bytes = plan->two_hop ? ar : 0.0;
    if (OS > k && W < OS)
        o.weights_bytes = k * (S_w / OS) * (W <= k ? Gos - 1 : Gos / Gw - 1);
    o.step_bytes = o.hop_bytes + o.weights_bytes + 8.0 * (N - 1);
    o.total_bytes = o.fetch_bytes + o.push_bytes + o.step_bytes;
    o.comm_s = in->inter_Bps > 0 ? o.total_bytes / in->inter_Bps : 0.0;
    uint32_t floats = in->optim_floats ? in->optim_floats : 3;
    o.rank_bytes[SD_STATE_W] = in->numel / W * in->w_bytes;
    o.rank_bytes[SD_STATE_G] = in->numel / G * 4;
    o.rank_bytes[SD_STATE_OS] = in->numel / OS * 4 * floats;
    *out_p = o;
}

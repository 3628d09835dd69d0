#include "sd/cost.h"

#include <stdint.h>

static double nodes_of(uint32_t f, uint32_t k)
{
    return f > k ? (double)(f / k) : 1.0;
}

/* a copy of bytes from local rank a's memory to local rank b's, under op (0 fetch, 1 push,
 * 2 step) */
static void copy(struct sd_cost_out *o, uint32_t P, int op, uint32_t a, uint32_t b, double bytes)
{
    o->intra_op[op][a / P == b / P ? SD_COST_PACKAGE : SD_COST_NODE] += bytes;
}

/* the weights' parts other ranks own, copied into each w shard of node 0 (sd_weights_local) */
static void weights_local(const struct sd_cost_in *in, const struct sd_plan *plan, uint32_t P,
                          double part, struct sd_cost_out *o)
{
    uint32_t k = in->k, W = plan->f[SD_STATE_W], OS = plan->f[SD_STATE_OS], per = OS / W;
    if (per == 1)
        return;
    for (uint32_t r = 0; r < k; r++) {
        uint32_t iw = r % W;
        for (uint32_t e = 0; e < per; e++) {
            uint32_t p = iw * per + e, owner = UINT32_MAX;
            for (uint32_t i = 0; i < OS && owner == UINT32_MAX; i++) /* os shard p's owner */
                if (sd_plan_shard(plan, SD_STATE_OS, r - r % OS + i) == p)
                    owner = r - r % OS + i;
            if (owner == r)
                continue;
            if (owner < k) {
                copy(o, P, 2, owner, r, part);
                continue;
            }
            uint32_t first = iw; /* received into the first local holder of w shard iw */
            if (W > k && iw >= k)
                continue;
            if (first != r)
                copy(o, P, 2, first, r, part);
        }
    }
}

/* numel elements as int8 or int4 blocks, ignoring the short last block of each shard */
static double int8_bytes(uint64_t numel, const struct sd_plan *plan)
{
    return (double)numel * (1.0 + 4.0 / (plan->qblock ? plan->qblock : SD_PLAN_QBLOCK));
}

static double int4_bytes(uint64_t numel, const struct sd_plan *plan)
{
    return (double)numel * (0.5 + 4.0 / (plan->qblock ? plan->qblock : SD_PLAN_QBLOCK));
}

static void intra_node_copies(const struct sd_cost_in *in, const struct sd_plan *plan,
                              double gathers, struct sd_cost_out *o)
{
    uint32_t k = in->k, P = in->package ? in->package : 1, N = in->nodes;
    uint32_t W = plan->f[SD_STATE_W], G = plan->f[SD_STATE_G], OS = plan->f[SD_STATE_OS];
    double S_w = (double)in->numel * in->w_bytes, S_g = (double)in->numel * 4.0;
    bool sec = sd_plan_sec_active(plan);
    double S_wq = plan->qw ? int8_bytes(in->numel, plan) : S_w;
    double S_sec = plan->qsec ? int8_bytes(in->numel, plan) : S_w;
    /* fetch: the w group's members on this node into local rank 0's copy */
    uint32_t members = W >= k ? k : W;
    double primary = sec ? 1.0 : gathers;
    for (uint32_t m = 0; m < members; m++)
        copy(o, P, 0, m, 0, primary * S_wq / W);
    if (sec) {
        for (uint32_t j = 0; j < plan->sec; j++) {
            copy(o, P, 0, 0, j, S_sec / plan->sec);
            copy(o, P, 0, j, 0, (gathers - 1.0) * S_sec / plan->sec);
        }
    }
    /* push, every micro-step */
    if (N > 1 && (G > k || !plan->two_hop)) {
        for (uint32_t j = 0; j < k; j++) {
            copy(o, P, 1, j, 0, in->accum * S_w);
            copy(o, P, 1, 0, j, in->accum * S_g / G);
        }
    } else {
        uint32_t f = G < k ? G : k;
        for (uint32_t h = 0; h < k; h++) /* each holder gets its shard from its group */
            for (uint32_t m = h - h % f; m < h - h % f + f; m++)
                copy(o, P, 1, m, h, in->accum * S_w / f);
    }
    /* step */
    uint32_t R = G > k ? N / (G / k) : N;
    if (N > 1 && plan->two_hop && R > 1) {
        /* back: the whole shard, or only the rank's os part where the hop reduce-scatters */
        double back = sd_plan_hop_scatters(plan, N, k) ? S_g / OS : S_g / G;
        for (uint32_t j = 0; j < k; j++) {
            copy(o, P, 2, j, 0, S_g / G);
            copy(o, P, 2, 0, j, back);
        }
    } else if (N == 1) {
        for (uint32_t i = 0; i < G; i++)
            for (uint32_t j = 1; j < k / G; j++)
                copy(o, P, 2, j * G + i, i, 2.0 * S_g / G);
    }
    weights_local(in, plan, P, S_w / OS, o);
    for (int op = 0; op < 3; op++)
        for (int c = 0; c < 2; c++)
            o->intra[c] += o->intra_op[op][c];
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
    bool sec = sd_plan_sec_active(plan);
    struct sd_cost_out o = {0};
    /* what moves: int8 weights with ,qw, int4 gradient blocks with ,qg, else the gradients in
     * their wire dtype (,gwire=bf16 or fp16: half of fp32's bytes) */
    double S_wq = plan->qw ? int8_bytes(in->numel, plan) : S_w;
    double Bq = plan->qg ? int4_bytes(in->numel, plan) / Gg : plan->gwire ? B / 2.0 : B;
    double fetch_n = (sec ? 1.0 : gathers) * (Gw - 1) * (plan->hierarchical ? 1.0 : k);
    double ar = R > 1 ? 2.0 * (R - 1) / R * B : 0.0;
    double push_ar = plan->two_hop ? 0.0 : ar;
    /* the boundary hop's all-reduce moves int4 blocks with ,qg, the weights' exchange after the
     * optimizer int8 blocks with ,qw; the hop is a reduce-scatter (half) where f_os = world */
    double hop_raw = plan->two_hop ? ar : 0.0, weights_raw = 0.0, weights_parts = 0.0;
    if (sd_plan_hop_scatters(plan, N, k))
        hop_raw = ar / 2.0;
    if (OS > k && W < OS)
        weights_parts = k * (W <= k ? Gos - 1 : Gos / Gw - 1);
    weights_raw = weights_parts * (S_w / OS);
    o.fetch_bytes = fetch_n * (S_wq / Gw);
    o.push_bytes = in->accum * ((Gg - 1) * Bq + push_ar);
    o.hop_bytes = R > 1 ? hop_raw * Bq / B : hop_raw;
    o.weights_bytes = plan->qw ? weights_parts * S_wq / OS : weights_raw;
    o.step_bytes = o.hop_bytes + o.weights_bytes + 8.0 * (N - 1);
    o.total_bytes = o.fetch_bytes + o.push_bytes + o.step_bytes;
    o.unquantized_bytes = fetch_n * (S_w / Gw) + in->accum * ((Gg - 1) * B + push_ar) + hop_raw +
                          weights_raw + 8.0 * (N - 1);
    o.comm_s = in->inter_Bps > 0 ? o.total_bytes / in->inter_Bps : 0.0;
    /* the early hop: a g group inside the node, the last backward marked (hop.c) */
    bool early = in->last_marked && plan->two_hop && Gg == 1.0 && R > 1;
    double beside = o.fetch_bytes + o.push_bytes + (early ? o.hop_bytes : 0.0);
    if (in->inter_Bps > 0) {
        o.overlap_s = beside / in->inter_Bps;
        o.exposed_s = (o.total_bytes - beside) / in->inter_Bps;
    }
    o.step_s = (in->compute_s > o.overlap_s ? in->compute_s : o.overlap_s) + o.exposed_s;
    uint32_t floats = in->optim_floats ? in->optim_floats : 3;
    o.rank_bytes[SD_STATE_W] = in->numel / W * in->w_bytes;
    o.rank_bytes[SD_STATE_G] = in->numel / G * 4;
    o.rank_bytes[SD_STATE_OS] = in->numel / OS * 4 * floats;
    o.sec_bytes = !sec         ? 0
                  : plan->qsec ? (uint64_t)int8_bytes(in->numel / plan->sec, plan)
                               : in->numel / plan->sec * in->w_bytes;
    intra_node_copies(in, plan, gathers, &o);
    *out_p = o;
}

/* The cost model of a plan: inter-node bytes each node sends per optimizer step, the
 * communication time at a given per-node bandwidth, and each rank's bytes of every state. Pure;
 * benchmarks print it next to what they measure and shardctl plan prints it for a model that
 * does not exist yet.
 *
 * With N nodes of k ranks, S_w = numel w_bytes, S_g = 4 numel, G_X = f_X / k nodes per partition
 * group of state X (1 when f_X <= k) and R = N / G_g nodes holding the replicas of a node's g
 * shards, each node sends per step:
 *   fetch    gathers (G_w - 1) / G_w S_w (times k without the hierarchical gather); gathers is 1
 *            when a unit stays from forward to backward, else 2 accum
 *   push     accum (G_g - 1) / G_g S_g, the reduce-scatter inside the g group every micro-step
 *            (plus the all-reduce below every micro-step without 2-hop)
 *   step     the boundary hop, an all-reduce of the node's g block B = S_g / G_g across R nodes:
 *            2 (R - 1) / R B; then each optimizer owner reads its os part. The weights'
 *            all-gather when f_w < f_os and f_os > k: the node's k os parts (S_w / f_os each) to
 *            each node of the os group that holds their w shard, G_os - 1 of them when
 *            f_w <= k, else G_os / G_w - 1. And 8 (N - 1) bytes of norm.
 * Per rank: w S_w / f_w, g S_g / f_g, os (4 optim_floats numel) / f_os (fp32 master and
 * moments), the tables of ZeRO-topo (weights 2 Psi / f_w in bf16, gradients 4 Psi / f_g, Adam
 * 12 Psi / f_os). */
#ifndef SD_COST_H
#define SD_COST_H

#include "sd/model.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_cost_in {
    uint64_t numel;        /* parameters (padded) */
    uint32_t w_bytes;      /* bytes per working weight: 4 (fp32) or 2 (bf16) */
    uint32_t nodes, k;     /* N nodes of k ranks */
    uint32_t accum;        /* micro-steps per step */
    uint32_t optim_floats; /* fp32 words of optimizer state per parameter: 3 AdamW, 2 SGD; 0: 3 */
    bool cached_in_step;   /* a gathered unit stays until the step (else gathered twice per
                              micro-step) */
    double inter_Bps;      /* bytes per second each node can send to the others */
};

struct sd_cost_out {
    /* sent per node per step */
    double fetch_bytes, push_bytes, step_bytes, total_bytes;
    double hop_bytes, weights_bytes; /* the parts of step_bytes */
    double comm_s;
    uint64_t rank_bytes[SD_STATE_COUNT]; /* each rank's bytes of w, g and os */
};

void sd_cost_step(const struct sd_cost_in *in, const struct sd_plan *plan,
                  struct sd_cost_out *out_p);

#endif

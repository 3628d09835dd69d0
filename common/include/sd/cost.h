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
 *            2 (R - 1) / R B, then each optimizer owner reads its os part; where f_os = world
 *            (exact, not ,hop-ar: sd_plan_hop_scatters) a reduce-scatter that brings each node
 *            the sums of the elements it owns, (R - 1) / R B. The weights'
 *            all-gather when f_w < f_os and f_os > k: the node's k os parts (S_w / f_os each) to
 *            each node of the os group that holds their w shard, G_os - 1 of them when
 *            f_w <= k, else G_os / G_w - 1. And 8 (N - 1) bytes of norm.
 * With an active secondary partition (,sec=S with f_w > S) only the first gather of a step
 * crosses nodes; the others copy from the S holders.
 * Quantized options (blocks of B elements, sd/codec.h): with ,qw every S_w above that a gather
 * moves (across nodes and inside) is numel (1 + 4 / B) bytes; with ,qg the reduce-scatter's
 * blocks are numel (1/2 + 4 / B) / G_g (the model ignores each shard's short last block and the
 * units under quant_min_bytes that go exact); with ,qsec the secondary copies are
 * numel (1 + 4 / B) / S; ,qg also sends the boundary hop as int4 blocks (2 (R - 1) / R of
 * numel (1/2 + 4 / B) / G_g) and ,qw the weights' all-gather after the optimizer as int8 blocks
 * (numel (1 + 4 / B) / f_os a part). With ,gwire=bf16 or fp16 the gradients that cross nodes
 * otherwise unquantized (the push's blocks and the hop; without ,qg all of them) move 2 bytes an
 * element instead of 4: half of those terms.
 *
 * Inside the node, intra[SD_COST_PACKAGE] and intra[SD_COST_NODE] count the copies the daemon
 * makes per step on a node, each by the link between the two ranks whose memory it joins (one
 * package, a rank's own memory included, or two packages of the node), with the node's
 * buffers (the hierarchical gather's copy, the node partial, the hop's buffer) at local rank 0:
 *   fetch   each gather copies the node's members of the w group (k ranks when f_w >= k, else
 *           the f_w ranks of local rank 0's group) into the copy, S_w / f_w each; with the
 *           secondary partition the first gather also copies the unit out to the S holders
 *           and the others copy S_w / S from each holder instead
 *   push    every micro-step: across nodes (f_g > k or no 2-hop) each rank's gradient into the
 *           node partial (S_w each) and the node's result back into each g shard (S_g / f_g);
 *           inside the node each g group's members' gradients (S_w / f_g each) into each holder
 *   step    the hop (R > 1) packs each rank's g shard into the node's buffer and back (only
 *           its os part, S_g / f_os, where the hop reduce-scatters); on one
 *           node the replicas of each g shard are summed into the first and copied back; the
 *           weights' parts other ranks own copied into each w shard (S_w / f_os each).
 * Counted for the hierarchical gather.
 *
 * Per rank: w S_w / f_w, g S_g / f_g, os (4 optim_floats numel) / f_os (fp32 master and
 * moments), the tables of ZeRO-topo (weights 2 Psi / f_w in bf16, gradients 4 Psi / f_g, Adam
 * 12 Psi / f_os), and S_w / S on each holder of an active secondary partition.
 *
 * When the bytes move, and so what the step waits for: the fetch's gathers and the push's
 * reduce-scatters run beside the forward and backward (prefetched, pushed as each unit's
 * gradient is ready): overlap_s = (fetch + push) / bandwidth. The step's bytes (the boundary hop,
 * the weights' all-gather after the optimizer, the norm) go after the last backward, and the
 * step answers once they are done: exposed_s = step / bandwidth; except the hop where the g group
 * lies inside the node and the script says which backward is the step's last (last_marked:
 * shard_last_micro_step, FSDP2's set_requires_gradient_sync): each unit's hop then goes as soon
 * as its node pushed it, beside the backward below it, and counts as overlapped (all of it: the
 * last unit's, which still follows the backward, is one unit among many). The predicted step is
 * max(compute_s, overlap_s) + exposed_s, compute_s being a rank's forward and backward of the
 * whole step (measured; 0 when not known: the prediction is then the communication alone). On a
 * machine whose daemons share the cores with the ranks (the host backend), the copies inside the
 * node (intra) take CPU time from the ranks as well; the model counts their bytes and leaves the
 * time to a measurement. */
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
    uint32_t package;      /* ranks per package; 0: 1 */
    double compute_s;      /* a rank's forward and backward of one step, all its micro-steps
                              (measured); 0: not known */
    bool last_marked;      /* the script says which backward is the step's last */
};

enum { SD_COST_PACKAGE = 0, SD_COST_NODE = 1 };

struct sd_cost_out {
    /* sent per node per step */
    double fetch_bytes, push_bytes, step_bytes, total_bytes;
    double unquantized_bytes;        /* total_bytes without the plan's quantized options */
    double hop_bytes, weights_bytes; /* the parts of step_bytes */
    double comm_s;
    /* comm_s split by when it moves (above), and the predicted step time */
    double overlap_s, exposed_s, step_s;
    uint64_t rank_bytes[SD_STATE_COUNT]; /* each rank's bytes of w, g and os */
    uint64_t sec_bytes;                  /* each secondary holder's bytes (0: none active) */
    /* copied inside node 0 per step, by link class, per operation (SD_OP_FETCH, _PUSH, _STEP
     * index 0, 1, 2) and in all */
    double intra_op[3][2], intra[2];
};

void sd_cost_step(const struct sd_cost_in *in, const struct sd_plan *plan,
                  struct sd_cost_out *out_p);

#endif

/* The MiCS cost model: inter-node bytes each node sends per optimizer step for a plan, and the
 * communication time at a given per-node bandwidth. Pure; benchmarks print it next to what they
 * measure. */
#ifndef SD_COST_H
#define SD_COST_H

#include "sd/model.h"

#include <stdbool.h>
#include <stdint.h>

struct sd_cost_in {
    uint64_t numel;      /* parameters (padded) */
    uint32_t w_bytes;    /* bytes per working weight: 4 (fp32) or 2 (bf16) */
    uint32_t nodes, k;   /* N nodes of k ranks */
    uint32_t accum;      /* micro-steps per step */
    bool cached_in_step; /* a gathered unit stays until the step (else gathered twice per
                            micro-step) */
    double inter_Bps;    /* bytes per second each node can send to the others */
};

struct sd_cost_out {
    double fetch_bytes, push_bytes, step_bytes, total_bytes; /* sent per node per step */
    double comm_s;
};

void sd_cost_step(const struct sd_cost_in *in, const struct sd_plan *plan,
                  struct sd_cost_out *out_p);

#endif

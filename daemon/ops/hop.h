/* The boundary hop (hop.c): with the 2-hop sync, each unit's gradient block of this node
 * all-reduced across the nodes of its replication group once per step (reduce-scattered to the
 * nodes that own its optimizer state where f_os = world: sd_plan_hop_scatters), one unit at a time
 * in descending unit order (the order backward pushes them), the same on every node. The step runs
 * it in its SYNC phase for the units still left; where the local ranks marked their last push of
 * the step (SD_PUSH_LAST) and the g group lies inside the node, a unit goes as soon as its last
 * push round is reduced, overlapping the rest of the backward. Part of the step (step_int.h holds
 * its counters). */
#ifndef SD_DAEMON_HOP_H
#define SD_DAEMON_HOP_H

#include "job.h"

#include <stdbool.h>
#include <stdint.h>

/* the nodes this node's g blocks are all-reduced with (job->xfer.members), 1 without 2-hop */
uint32_t sd_hop_nodes(struct sd_job *job);
/* At the step's allocation: where the block is owned (sd_plan_hop_owned), the order its pieces
 * are packed in, each owner's together (the segment a reduce-scatter leaves there); SD_ENOMEM */
int sd_hop_alloc(struct sd_job *job);
void sd_hop_free(struct sd_job *job);
/* Is the block owned? Then only each local rank's os part of its g shard is sure to hold the
 * step's sums after the hop (all of it with ,hop-ar), and the norm is taken over those parts. */
bool sd_hop_owned(const struct sd_job *job);
/* unit u's gradient of this step is final here (SD_JOB_EV_UNIT_FINAL: push.c saw every local
 * push of its last rounds marked the last): it goes now if it is next and the way is free */
void sd_hop_unit_final(struct sd_job *job, uint32_t u);
/* the step's SYNC: start the next unit's hop, true once every unit's went (one in flight at a
 * time; its end calls the step's progress again) */
bool sd_hop_sync(struct sd_job *job);
/* the step ended (or the job's memory goes): nothing of this step's hop is left */
void sd_hop_reset(struct sd_job *job);
/* units whose hop went before their step's SYNC, since registration (shardctl stats) */
uint64_t sd_hop_early_count(const struct sd_job *job);

#endif

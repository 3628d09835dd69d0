/* A push round across nodes (push.c's node rounds): its state and the pieces of its work that
 * need nothing else of the push module's (push_round.c): the node partial summed from the local
 * ranks' staging slots, the chunks of this node's block summed as they arrive, and the int4
 * blocks decoded. push.c starts, posts, retires and owns the rounds. */
#ifndef SD_PUSH_ROUND_H
#define SD_PUSH_ROUND_H

#include "coll/coll.h"
#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_push_entry {
    struct sd_session *s;
    uint64_t tag;
    uint64_t arrive_ns;
    uint32_t slot;
    bool last; /* SD_PUSH_LAST: the rank's last push of the unit in this step */
};

/* A push round that crosses nodes: node partial, reduce-scatter in the partition group, and
 * without the 2-hop sync an all-reduce across the replication group, every micro-step. Up to
 * push_rounds of them are on the wire at once, each with its own buffers; they are applied to the
 * g shards in the order they started, so the sums do not depend on which finishes first. */
struct sd_node_round {
    struct sd_job *job;
    uint32_t index; /* in the ring of node rounds (its ,qg buffers are quant.c's of this index) */
    bool net_done;  /* its transfers (and all-reduce) finished */
    int codec;      /* 0: fp32 blocks; else how they travel (sd_qg_codec: ,qg's int4, ,gwire's bf16
                     * or fp16), encoded into quant.c's buffers of this round */
    bool retiring;  /* its result is on the job's queue into the g shards: its buffers and its
                     * pushes wait for the queue to pass retire_ticket (the loop's poll) */
    uint64_t retire_ticket;
    uint32_t unit;
    uint64_t seq, start_ns;
    uint32_t pending;
    int status;
    uint32_t suspect;
    size_t chunk;
    float *part; /* the node partial: buf, or the one rank's fp32 staging slot */
    float *buf;  /* [max unit] the node partial when it must be summed (NULL if never) */
    float *rs_recv, *rs_out, *ar_tmp; /* [G - 1 blocks], [block], [ar_tmp_count] */
    uint32_t chunk_arrivals[SD_TAG_MAX_CHUNKS];
    uint32_t next;    /* blocks 0 .. next - 1 are on the wire (or this node's own) */
    uint64_t *ticket; /* [G] per block: the queue's ticket once its partial is written (0: none) */
    struct sd_allreduce ar;
};

/* elements [lo, hi) of the node partial in block order, into rd->buf (the local ranks'
 * gradients in ent's staging slots, summed in rank order) */
void sd_round_partial(struct sd_job *job, struct sd_node_round *rd, const struct sd_push_entry *ent,
                      const struct sd_unit_layout *ul, uint64_t lo, uint64_t hi);
/* a bulk's chunk callback: a chunk of this node's block arrived from some node (all did: sum) */
void sd_round_chunk(struct sd_bulk *b, uint32_t piece, size_t off, size_t len);
/* ,qg: this node's block of the sum from its own partial and the decoded others' */
void sd_round_decode(struct sd_node_round *rd);

#endif

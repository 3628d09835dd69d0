/* push.c and push_net.c: the push module's state. Nothing else of the daemon sees it: the other
 * modules call push.h. */
#ifndef SD_PUSH_INT_H
#define SD_PUSH_INT_H

#include "sd/gpu.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_push_round;
struct sd_push_entry;
struct sd_node_round;
struct sd_round_wait;

/* a local round whose pushes all arrived, waiting for a node round */
struct sd_round_ref {
    uint32_t unit;
    uint64_t seq;
};

/* The push module's state (push.h): push.c and push_net.c read and write it. */
struct sd_push_state {
    uint32_t g_groups, g_members, round_gens;
    struct sd_push_round *rounds;
    struct sd_push_entry *round_entries;
    uint64_t *rounds_done; /* [unit][group] rounds completed: the oldest one collecting */
    uint8_t *final;   /* [unit][group]: the group's round of the step's marked last pushes went */
    bool node_rounds; /* pushes reduce across nodes (or all-reduce without 2-hop) */
    bool g_ident;     /* the node blocks of a reduce-scatter across nodes are the k ranks' g shards
                         in unit order (f_w = 1, or the group inside the node) */
    struct sd_node_round *nr; /* [round_gens] ring of node rounds, oldest at nr_head */
    uint32_t nr_head, nr_len;
    struct sd_round_ref *round_queue; /* local rounds complete, waiting for a node round: FIFO */
    uint32_t rq_head, rq_len, rq_cap;
    struct sd_mem nr_mem; /* the node rounds' buffers in the backend's memory, one registration */
    size_t ar_tmp_count;
    /* local rounds reduced on the device, completed once its queue reached their ticket (the
     * clients reuse their staging slots then): FIFO, at most one per round slot */
    struct sd_round_wait *waits;
    uint32_t w_head, w_len, w_cap;
};

#endif

/* A job's flight recorder on one node: a ring of its last operations (its ranks' calls, and its
 * transfers with other nodes), each with its state and times, so that when a job hangs or
 * fails the dump says which rank and which operation it was waiting for (shardctl trace). Pure
 * code: the daemon feeds it (server/session.c, net/job_tp.c) and writes it out (daemon/server/
 * trace_dump.c); shardctl trace --merge reads the dumps of every node. */
#ifndef SD_TRACE_H
#define SD_TRACE_H

#include <stdbool.h>
#include <stdint.h>

enum sd_trace_kind { SD_TRACE_CALL = 1, SD_TRACE_SEND = 2, SD_TRACE_RECV = 3 };
enum sd_trace_state {
    SD_TRACE_QUEUED = 1, /* a call taken from the rank's ring, not completed */
    SD_TRACE_POSTED = 2, /* a transfer handed to the fabric, some of its chunks not completed */
    SD_TRACE_DONE = 3,
    SD_TRACE_FAILED = 4
};
#define SD_TRACE_OPS 16 /* calls are counted per op code below this */

struct sd_trace_rec {
    uint64_t id;  /* from 1; 0: an empty slot */
    uint64_t key; /* calls: the client's request tag; transfers: the tag without its chunk */
    uint64_t seq; /* calls: this rank's n-th call of op (from 1); transfers: the tag's seq */
    uint64_t bytes;
    uint64_t start_ns, end_ns; /* sd_now_ns(); end 0 while open */
    int32_t status;
    uint32_t unit;
    uint32_t who;     /* calls: the global rank; transfers: the peer (job node) */
    uint32_t pending; /* transfers: chunks posted and not completed */
    uint16_t op;      /* calls: SD_OP_*; transfers: the tag's kind (coll/tag.h) */
    uint8_t kind, state;
};

struct sd_trace {
    struct sd_trace_rec *recs; /* [cap], NULL: off */
    uint32_t cap;
    uint64_t next_id;
    uint32_t ranks, first_rank;
    uint64_t *calls; /* [ranks][SD_TRACE_OPS]: calls taken per local rank and op, ever */
};

/* cap 0: off (every call below does nothing). Returns 0, or -ENOMEM. */
int sd_trace_init(struct sd_trace *t, uint32_t cap, uint32_t first_rank, uint32_t ranks);
void sd_trace_fini(struct sd_trace *t);

/* A rank's call was taken (rank: global). */
void sd_trace_call(struct sd_trace *t, uint32_t rank, uint32_t op, uint32_t unit, uint64_t bytes,
                   uint64_t tag, uint64_t now);
/* The call of rank with the client's request tag completed (found among the open calls). */
void sd_trace_call_done(struct sd_trace *t, uint32_t rank, uint64_t tag, int status, uint64_t now);
/* A chunk of a transfer is posted: it joins the open record of the same direction, peer and
 * key among the latest, or starts one. Returns the record's id for sd_trace_xfer_done (0 when
 * off). */
uint64_t sd_trace_xfer(struct sd_trace *t, bool send, uint32_t peer, uint64_t key, uint32_t kind,
                       uint32_t unit, uint32_t seq, uint64_t bytes, uint64_t now);
void sd_trace_xfer_done(struct sd_trace *t, uint64_t id, int status, uint64_t now);

/* The record of id while the ring still holds it, else NULL. */
const struct sd_trace_rec *sd_trace_get(const struct sd_trace *t, uint64_t id);
/* The oldest id the ring still holds (next_id when empty). */
uint64_t sd_trace_first(const struct sd_trace *t);

const char *sd_trace_state_name(int state); /* "scheduled", "started", "completed", "failed" */

#endif

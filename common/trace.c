/* The flight recorder's ring (sd/trace.h). */
#include "sd/trace.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define XFER_LOOKBACK 16 /* records searched for the open transfer a chunk joins */

int sd_trace_init(struct sd_trace *t, uint32_t cap, uint32_t first_rank, uint32_t ranks)
{
    memset(t, 0, sizeof(*t));
    t->next_id = 1;
    if (cap == 0)
        return 0;
    t->recs = calloc(cap, sizeof(*t->recs));
    t->calls = calloc((size_t)ranks * SD_TRACE_OPS, sizeof(*t->calls));
    if (t->recs == NULL || t->calls == NULL) {
        sd_trace_fini(t);
        return -ENOMEM;
    }
    t->cap = cap;
    t->first_rank = first_rank;
    t->ranks = ranks;
    return 0;
}

void sd_trace_fini(struct sd_trace *t)
{
    free(t->recs);
    free(t->calls);
    t->recs = NULL;
    t->calls = NULL;
    t->cap = 0;
}

static struct sd_trace_rec *slot(const struct sd_trace *t, uint64_t id)
{
    return &t->recs[id % t->cap];
}

static struct sd_trace_rec *push(struct sd_trace *t)
{
    uint64_t id = t->next_id++;
    struct sd_trace_rec *r = slot(t, id);
    memset(r, 0, sizeof(*r));
    r->id = id;
    return r;
}

const struct sd_trace_rec *sd_trace_get(const struct sd_trace *t, uint64_t id)
{
    if (t->recs == NULL || id == 0 || id >= t->next_id)
        return NULL;
    const struct sd_trace_rec *r = slot(t, id);
    return r->id == id ? r : NULL;
}

uint64_t sd_trace_first(const struct sd_trace *t)
{
    return t->next_id > t->cap ? t->next_id - t->cap : 1;
}

void sd_trace_call(struct sd_trace *t, uint32_t rank, uint32_t op, uint32_t unit, uint64_t bytes,
                   uint64_t tag, uint64_t now)
{
    if (t->recs == NULL || rank < t->first_rank || rank - t->first_rank >= t->ranks ||
        op >= SD_TRACE_OPS)
        return;
    struct sd_trace_rec *r = push(t);
    r->kind = SD_TRACE_CALL;
    r->state = SD_TRACE_QUEUED;
    r->op = (uint16_t)op;
    r->who = rank;
    r->unit = unit;
    r->bytes = bytes;
    r->key = tag;
    r->seq = ++t->calls[(size_t)(rank - t->first_rank) * SD_TRACE_OPS + op];
    r->start_ns = now;
}

void sd_trace_call_done(struct sd_trace *t, uint32_t rank, uint64_t tag, int status, uint64_t now)
{
    if (t->recs == NULL)
        return;
    /* the newest open call of the rank with that tag: a completion is usually for a recent
     * call, so the search is short */
    for (uint64_t id = t->next_id - 1; id >= sd_trace_first(t) && id > 0; id--) {
        struct sd_trace_rec *r = slot(t, id);
        if (r->kind == SD_TRACE_CALL && r->who == rank && r->key == tag &&
            r->state == SD_TRACE_QUEUED) {
            r->state = status == 0 ? SD_TRACE_DONE : SD_TRACE_FAILED;
            r->status = status;
            r->end_ns = now;
            return;
        }
    }
}

uint64_t sd_trace_xfer(struct sd_trace *t, bool send, uint32_t peer, uint64_t key, uint32_t kind,
                       uint32_t unit, uint32_t seq, uint64_t bytes, uint64_t now)
{
    if (t->recs == NULL)
        return 0;
    uint8_t k = send ? SD_TRACE_SEND : SD_TRACE_RECV;
    uint64_t first = sd_trace_first(t);
    for (uint64_t id = t->next_id - 1, n = 0; id >= first && id > 0 && n < XFER_LOOKBACK;
         id--, n++) {
        struct sd_trace_rec *r = slot(t, id);
        if (r->kind == k && r->who == peer && r->key == key && r->pending > 0) {
            r->pending++;
            r->bytes += bytes;
            return id;
        }
    }
    struct sd_trace_rec *r = push(t);
    r->kind = k;
    r->state = SD_TRACE_POSTED;
    r->op = (uint16_t)kind;
    r->who = peer;
    r->key = key;
    r->unit = unit;
    r->seq = seq;
    r->bytes = bytes;
    r->pending = 1;
    r->start_ns = now;
    return r->id;
}

void sd_trace_xfer_done(struct sd_trace *t, uint64_t id, int status, uint64_t now)
{
    struct sd_trace_rec *r = (struct sd_trace_rec *)sd_trace_get(t, id);
    if (r == NULL || r->pending == 0)
        return;
    r->pending--;
    if (status != 0 && r->state != SD_TRACE_FAILED) {
        r->state = SD_TRACE_FAILED;
        r->status = status;
        r->end_ns = now;
    }
    if (r->pending == 0 && r->state == SD_TRACE_POSTED) {
        r->state = SD_TRACE_DONE;
        r->end_ns = now;
    }
}

const char *sd_trace_state_name(int state)
{
    switch (state) {
    case SD_TRACE_QUEUED:
        return "scheduled";
    case SD_TRACE_POSTED:
        return "started";
    case SD_TRACE_DONE:
        return "completed";
    case SD_TRACE_FAILED:
        return "failed";
    default:
        return "?";
    }
}

/* Transport tags: the only place that packs and unpacks one.
 *
 * A tag is 64 bits of named fields: kind 4 | job 12 | unit 14 | seq 16 | src 10 | chunk 8, most
 * significant first. Identity fields (kind, job, unit, src, chunk and the parts of seq that name
 * a copy or a ring step) are checked against their width: a value that does not fit is refused
 * with SD_ERANGE, never truncated, so two different operations can never share a tag. Counters
 * that only tell an operation from its neighbours in time (a weights generation, a micro-step,
 * a step) are stored modulo their field, on purpose and by name: sd_tag_wrap.
 *
 * The seq field has a layout per kind:
 *   REQ, WDATA  generation mod 2^10 | copy slot 6 (the slot reaches k - 1 <= 63 without the
 *               hierarchical gather)
 *   AR          round mod 2^7 | step 1 (1: the step's gradient sync, 0: a micro-step's round) |
 *               ring step 8 (set by the all-reduce per transfer)
 *   GRAD        micro-step mod 2^16
 *   SCALAR      step mod 2^16
 *   WSTEP       step mod 2^16
 *   INIT, RDV   0
 *   PROBE       0 (job 0; unit 1 on the control rail, 0 on data lane `chunk`)
 *
 * A leaf header: the transport reads kind, src and chunk to route, the collective engine and the
 * operations build tags, and nothing here depends on either. */
#ifndef SD_COLL_TAG_H
#define SD_COLL_TAG_H

#include "sd/status.h"

#include <stdbool.h>
#include <stdint.h>

enum sd_tag_field {
    SD_TAGF_KIND,
    SD_TAGF_JOB,
    SD_TAGF_UNIT,
    SD_TAGF_SEQ,
    SD_TAGF_SRC,
    SD_TAGF_CHUNK,
    SD_TAGF_COUNT
};

#define SD_TAG_KIND_BITS  4
#define SD_TAG_JOB_BITS   12
#define SD_TAG_UNIT_BITS  14
#define SD_TAG_SEQ_BITS   16
#define SD_TAG_SRC_BITS   10
#define SD_TAG_CHUNK_BITS 8
_Static_assert(SD_TAG_KIND_BITS + SD_TAG_JOB_BITS + SD_TAG_UNIT_BITS + SD_TAG_SEQ_BITS +
                       SD_TAG_SRC_BITS + SD_TAG_CHUNK_BITS ==
                   64,
               "the tag's fields fill 64 bits");

#define SD_TAG_MAX_CHUNKS (1u << SD_TAG_CHUNK_BITS)
#define SD_MAX_NODES      (1u << SD_TAG_SRC_BITS)

/* seq's parts */
#define SD_TAG_LSLOT_BITS     6 /* REQ, WDATA: the copy slot */
#define SD_TAG_GEN_BITS       (SD_TAG_SEQ_BITS - SD_TAG_LSLOT_BITS)
#define SD_TAG_RING_STEP_BITS 8 /* AR: the ring all-reduce's step */
#define SD_TAG_ROUND_BITS     (SD_TAG_SEQ_BITS - SD_TAG_RING_STEP_BITS - 1)

enum sd_tag_kind {
    SD_TAG_REQ = 1,    /* pull request for a unit's weights */
    SD_TAG_WDATA = 2,  /* weights block */
    SD_TAG_GRAD = 3,   /* reduce-scatter partial */
    SD_TAG_AR = 4,     /* all-reduce chunk */
    SD_TAG_SCALAR = 5, /* small all-reduce */
    SD_TAG_INIT = 6,   /* initial values broadcast */
    SD_TAG_RDV = 7,    /* the transport's clear-to-send (rendezvous_bytes), on its own endpoint */
    SD_TAG_WSTEP = 8,  /* the weights' all-gather after the optimizer (f_w < f_os) */
    SD_TAG_PROBE = 9,  /* the cluster's probe of a peer's data path (unit 1: the control rail,
                        * 0: a data lane, chunk: which) */
    SD_TAG_SDATA = 10, /* a node's optimizer-state shards of a unit, read by a rank (SD_OP_READ;
                        * seq: the reading node's read) */
};

struct sd_tag_fields {
    uint32_t kind, job, unit, seq, src, chunk;
};

static inline uint32_t sd_tag_shift(enum sd_tag_field f)
{
    static const uint8_t shift[SD_TAGF_COUNT] = {
        [SD_TAGF_KIND] = 60, [SD_TAGF_JOB] = 48, [SD_TAGF_UNIT] = 34,
        [SD_TAGF_SEQ] = 18,  [SD_TAGF_SRC] = 8,  [SD_TAGF_CHUNK] = 0};
    return shift[f];
}

static inline uint32_t sd_tag_bits(enum sd_tag_field f)
{
    static const uint8_t bits[SD_TAGF_COUNT] = {
        [SD_TAGF_KIND] = SD_TAG_KIND_BITS, [SD_TAGF_JOB] = SD_TAG_JOB_BITS,
        [SD_TAGF_UNIT] = SD_TAG_UNIT_BITS, [SD_TAGF_SEQ] = SD_TAG_SEQ_BITS,
        [SD_TAGF_SRC] = SD_TAG_SRC_BITS,   [SD_TAGF_CHUNK] = SD_TAG_CHUNK_BITS};
    return bits[f];
}

/* the bits of field f within a tag (as an ignore mask, say) */
static inline uint64_t sd_tag_mask(enum sd_tag_field f)
{
    return ((1ULL << sd_tag_bits(f)) - 1) << sd_tag_shift(f);
}

static inline uint32_t sd_tag_get(uint64_t tag, enum sd_tag_field f)
{
    return (uint32_t)((tag & sd_tag_mask(f)) >> sd_tag_shift(f));
}

/* Set field f of *tag_p to v; SD_ERANGE (and *tag_p unchanged) when v does not fit. */
static inline int sd_tag_set(uint64_t *tag_p, enum sd_tag_field f, uint64_t v)
{
    if (v >> sd_tag_bits(f) != 0)
        return SD_ERANGE;
    *tag_p = (*tag_p & ~sd_tag_mask(f)) | v << sd_tag_shift(f);
    return SD_OK;
}

/* A counter kept modulo a field of `bits` bits: the one way a value is cut to fit. */
static inline uint32_t sd_tag_wrap(uint64_t counter, uint32_t bits)
{
    return (uint32_t)(counter & ((1ULL << bits) - 1));
}

/* All fields at once; SD_ERANGE when any does not fit (*tag_p is then not written). */
static inline int sd_tag_pack(const struct sd_tag_fields *f, uint64_t *tag_p)
{
    const uint32_t v[SD_TAGF_COUNT] = {f->kind, f->job, f->unit, f->seq, f->src, f->chunk};
    uint64_t tag = 0;
    for (int i = 0; i < SD_TAGF_COUNT; i++)
        if (sd_tag_set(&tag, (enum sd_tag_field)i, v[i]) != SD_OK)
            return SD_ERANGE;
    *tag_p = tag;
    return SD_OK;
}

static inline struct sd_tag_fields sd_tag_unpack(uint64_t tag)
{
    return (struct sd_tag_fields){.kind = sd_tag_get(tag, SD_TAGF_KIND),
                                  .job = sd_tag_get(tag, SD_TAGF_JOB),
                                  .unit = sd_tag_get(tag, SD_TAGF_UNIT),
                                  .seq = sd_tag_get(tag, SD_TAGF_SEQ),
                                  .src = sd_tag_get(tag, SD_TAGF_SRC),
                                  .chunk = sd_tag_get(tag, SD_TAGF_CHUNK)};
}

/* seq of a weights pull (REQ, WDATA): SD_ERANGE when the copy slot does not fit */
static inline int sd_tag_weights_seq(uint64_t gen, uint32_t lslot, uint32_t *seq_p)
{
    if (lslot >> SD_TAG_LSLOT_BITS != 0)
        return SD_ERANGE;
    *seq_p = sd_tag_wrap(gen, SD_TAG_GEN_BITS) << SD_TAG_LSLOT_BITS | lslot;
    return SD_OK;
}

/* seq of an all-reduce (AR) with ring step 0: round is the micro-step or the step counter */
static inline uint32_t sd_tag_allreduce_seq(uint64_t round, bool step_sync)
{
    return (sd_tag_wrap(round, SD_TAG_ROUND_BITS) << 1 | (step_sync ? 1u : 0u))
           << SD_TAG_RING_STEP_BITS;
}

/* the ring step t into an all-reduce tag's seq; SD_ERANGE when t does not fit */
static inline int sd_tag_set_ring_step(uint64_t *tag_p, uint32_t t)
{
    if (t >> SD_TAG_RING_STEP_BITS != 0)
        return SD_ERANGE;
    uint32_t seq = sd_tag_get(*tag_p, SD_TAGF_SEQ);
    seq = (seq & ~((1u << SD_TAG_RING_STEP_BITS) - 1)) | t;
    return sd_tag_set(tag_p, SD_TAGF_SEQ, seq);
}

/* The tag of an operation from its fields; SD_ERANGE when one does not fit. */
static inline int sd_tag_make(uint32_t kind, uint32_t job, uint32_t unit, uint32_t seq,
                              uint32_t src, uint64_t *tag_p)
{
    struct sd_tag_fields f = {.kind = kind, .job = job, .unit = unit, .seq = seq, .src = src};
    return sd_tag_pack(&f, tag_p);
}

/* A receive of any message of one kind: the tag, and the ignore mask that goes with it. */
static inline uint64_t sd_tag_of_kind(enum sd_tag_kind kind)
{
    return (uint64_t)kind << sd_tag_shift(SD_TAGF_KIND);
}

static inline uint64_t sd_tag_any_but_kind(void)
{
    return ~sd_tag_mask(SD_TAGF_KIND);
}

static inline uint32_t sd_tag_src(uint64_t tag)
{
    return sd_tag_get(tag, SD_TAGF_SRC);
}

static inline uint32_t sd_tag_kind(uint64_t tag)
{
    return sd_tag_get(tag, SD_TAGF_KIND);
}

static inline uint32_t sd_tag_chunk(uint64_t tag)
{
    return sd_tag_get(tag, SD_TAGF_CHUNK);
}

/* Small latency-bound messages (pull requests, the step's norm exchange) travel on a control
 * rail of their own: on a stream transport a request queued behind megabytes of bulk data to the
 * same peer would wait for all of it, and two nodes pulling from each other would take turns
 * instead of using both directions at once. Both ends route by the tag alone. */
static inline bool sd_tag_is_ctrl(uint64_t tag)
{
    uint32_t kind = sd_tag_kind(tag);
    return kind == SD_TAG_REQ || kind == SD_TAG_SCALAR ||
           (kind == SD_TAG_PROBE && sd_tag_get(tag, SD_TAGF_UNIT) == 1);
}

#endif

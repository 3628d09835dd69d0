/* The pull request a node sends for a unit's weights block (SD_TAG_REQ): a fixed 32-byte wire
 * format, checked field by field by the node that serves it. */
#ifndef SD_PULL_H
#define SD_PULL_H

#include <stdint.h>

/* A pull request for a unit's weights block (SD_TAG_REQ), 32 bytes on the wire. */
#define SD_REQ_MAGIC 0x51455253u
struct sd_req_msg {
    uint32_t magic;
    uint16_t job_tag;
    uint16_t src;
    uint32_t unit;
    uint32_t lslot;
    uint64_t gen;
    uint32_t n_units; /* a coalesced request: units [unit, unit + n_units); 0 or 1: one */
    /* 0: the weights; 1 + s: the node's shards of the unit's optimizer state s (SD_OP_READ; s
     * 0 the masters), lslot the reading node's read number */
    uint32_t state;
};
_Static_assert(sizeof(struct sd_req_msg) == 32, "request layout is ABI");

#endif

/* Offline placement of lifetime intervals in one pool (the gather pool of a frozen schedule,
 * DESIGN.md section 7): every interval gets a fixed offset such that two intervals that are
 * live at the same time never share a byte, and the pool's peak is known before it is used.
 * Pure; issue 4's schedule freezing feeds it. */
#ifndef SD_INTERVAL_H
#define SD_INTERVAL_H

#include <stdint.h>

struct sd_ival {
    uint32_t start, end; /* live during [start, end) in schedule positions; start < end */
    uint64_t size;       /* bytes */
    uint64_t off;        /* out: offset in the pool */
};

/* Place every interval (offsets aligned to align, a power of two); returns the peak, the
 * smallest pool that holds the placement. Returns 0 and places nothing when n is 0. Greedy best
 * fit in order of decreasing size: each interval takes the lowest gap that fits among the
 * intervals it overlaps in time. */
uint64_t sd_ival_plan(struct sd_ival *iv, uint32_t n, uint64_t align);
/* The lower bound of any placement: the largest sum of sizes live at one time (aligned). */
uint64_t sd_ival_max_load(const struct sd_ival *iv, uint32_t n, uint64_t align);

#endif

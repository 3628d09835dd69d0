/* barrier.c: the calls of a job's local ranks that wait for one another (step, ready, save) as
 * one request type: per rank, the tag its completion carries and since when it waits. Pure
 * bookkeeping (tests/unit/test_barrier.c): the caller completes what it takes out. */
#ifndef SD_BARRIER_H
#define SD_BARRIER_H

#include <stdbool.h>
#include <stdint.h>

/* a client call that waits */
struct sd_req {
    uint64_t tag;      /* its completion carries it */
    uint64_t since_ns; /* it waits since */
    bool parked;
};

struct sd_barrier {
    struct sd_req *req; /* [n], by local rank */
    uint32_t n, arrived;
    uint64_t first_ns; /* the first arrival since the barrier was last empty; kept once empty */
};

/* n ranks (SD_OK or SD_ENOMEM); fini gives it back (also after a failed init) */
int sd_barrier_init(struct sd_barrier *b, uint32_t n);
void sd_barrier_fini(struct sd_barrier *b);
/* Rank r's call arrives with tag at now: false when r already waits (the call is refused, the
 * waiting one keeps its place), or r is not a rank of the barrier. */
bool sd_barrier_arrive(struct sd_barrier *b, uint32_t r, uint64_t tag, uint64_t now);
bool sd_barrier_waits(const struct sd_barrier *b, uint32_t r);
/* every rank arrived */
bool sd_barrier_full(const struct sd_barrier *b);
/* Take rank r's call out (to complete it): true with it in *out when r waited. */
bool sd_barrier_take(struct sd_barrier *b, uint32_t r, struct sd_req *out);
/* Some ranks, not all, arrived more than timeout ago: true with present[r] (n entries) saying
 * which did. */
bool sd_barrier_overdue(const struct sd_barrier *b, uint64_t now, uint64_t timeout, bool *present);

#endif

/* fetch.c: fetch, release, drop; gathers across nodes; serving peers' pull requests. */
#ifndef SD_FETCH_H
#define SD_FETCH_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;
struct sd_unit_state;
struct sd_req_msg;

/* false to stall the ring (the gather cannot start or its place is busy) */
bool sd_fetch(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t start);
void sd_fetch_release(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start);
void sd_fetch_drop(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                   uint64_t start);
/* a session leaves: its holds go */
void sd_fetch_release_holds(struct sd_job *job, struct sd_session *s);
/* A gather inside the node, done when this returns: a refresh of a held copy, or a prefetch. */
void sd_fetch_local_gather(struct sd_job *job, struct sd_unit_state *us);
/* A gather finished (or failed): answer every rank waiting for it. */
void sd_fetch_complete(struct sd_job *job, struct sd_unit_state *us);
/* Fetches whose answers wait for the device to write their slots (waiting), and the loop's look
 * at them: answers those it wrote, in order; true if any. */
bool sd_fetch_queue_waiting(const struct sd_job *job);
bool sd_fetch_queue_poll(struct sd_job *job);
/* Releases a trainer's stream signals later (sd/fence.h, release_seq): the holds whose signal
 * the ranks' pages count now are let go (true if any); a gather that waits for a place they
 * keep says so (blocked), and the loop polls the pages until they are let go. */
bool sd_fetch_fenced_poll(struct sd_job *job);
void sd_fetch_fenced_blocked(struct sd_job *job);
/* Room in the pool: the frozen schedule's place, else the cache's (evicting); SD_EAGAIN: a
 * slower rank still uses the planned place. */
int sd_fetch_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p);
/* Start the gather of a slot whose pool place is set (the schedule's prefetch): inside the node
 * it is done when this returns; SD_EAGAIN when no transfer resources are free now. */
int sd_fetch_prefetch(struct sd_job *job, struct sd_unit_state *us);
/* would a gather of unit (copy lslot) join the open batch? */
bool sd_fetch_would_join(const struct sd_job *job, uint32_t unit, uint32_t lslot);
/* send the gathers sd_fetch_prefetch coalesced (a no-op when none wait) */
void sd_fetch_prefetch_flush(struct sd_job *job);
/* Start pulling the remote blocks of slot us (pool place set): SD_EAGAIN when no transfer
 * resources are free now. */
int sd_fetch_gather_start(struct sd_job *job, struct sd_unit_state *us);
/* serve the pull requests that waited for a newer generation or readiness */
void sd_fetch_serve_queue(struct sd_job *job);
/* a peer's pull request for this job (net_service.c found it by its tag): checked against the
 * job, served now or queued */
void sd_fetch_on_request(struct sd_job *job, const struct sd_req_msg *m);

#endif

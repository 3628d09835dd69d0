/* A session: an attached client, its shared-memory ring and eventfds, and its membership of a
 * job. */
#ifndef SD_SESSION_H
#define SD_SESSION_H

#include "sd/gpu.h"
#include "sd/ring.h"
#include "shard.pb-c.h"

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

struct sd_conn;
struct sd_server;
struct sd_job;

struct sd_session {
    struct sd_session *next;
    struct sd_server *srv;
    struct sd_conn *conn;
    uint64_t id;
    struct sd_mem ring;
    struct sd_ring_hdr *hdr;
    int sq_efd, cq_efd;
    uv_poll_t sq_poll;
    /* job membership */
    struct sd_job *job;
    uint32_t rank, local;
    bool registered; /* the job accepted our registration and sent the layout */
    uint32_t *holds; /* per unit: fetches not yet released */
    uint64_t staging_busy;
    bool has_stalled;
    /* what the stalled call waits for comes without an event (a device stream's write of the
     * fence page): the loop polls for it (progress.c) */
    bool stall_polls;
    struct sd_sqe stalled;
    uint64_t stalled_ns;
    bool broken; /* protocol violation on the ring: stop reading it */
};

int sd_session_create(struct sd_conn *c, const Shard__Attach *msg);
/* Leave the job (if any) and free the session; reason appears in the job's error. */
void sd_session_destroy(struct sd_session *s, const char *reason);
/* Drain the ring; returns true if any entry was consumed or a stalled one went through. */
bool sd_session_progress(struct sd_session *s);
void sd_session_complete(struct sd_session *s, uint64_t tag, int op, int status, uint64_t v0,
                         uint64_t v1, const char *msg);
void sd_session_fail(struct sd_session *s, const struct sd_sqe *e, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif

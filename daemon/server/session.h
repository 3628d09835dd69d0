/* A session: an attached client, its shared-memory ring and eventfds, and its membership of a
 * job; what operations answer on its ring (session.c). attach.h sets it up and drains it. */
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
    pid_t pid; /* the client's (its connection's SO_PEERCRED) */
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
    /* it broke (text says how): the attachment tells the client and hangs up (attach.c) */
    void (*on_break)(struct sd_session *s, const char *text);
};

/* room for a completion's message */
#define SD_OP_MSG_LEN SD_CQE_MSG_LEN

void sd_session_complete(struct sd_session *s, uint64_t tag, int op, int status, uint64_t v0,
                         uint64_t v1, const char *msg);
void sd_session_fail(struct sd_session *s, const struct sd_sqe *e, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* complete an operation that succeeded, counted in the job's statistics */
void sd_op_done(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t v0,
                uint64_t v1, uint64_t start_ns);

#endif

/* A session: an attached client, its shared-memory ring and eventfds, and its membership of a
 * job; what operations answer on its ring (session.c). attach.h sets it up and drains it. */
#ifndef SD_SESSION_H
#define SD_SESSION_H

#include "sd/fsid.h"
#include "sd/gpu.h"
#include "sd/ring.h"
#include "shard.pb-c.h"

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

struct sd_conn;
struct sd_server;
struct sd_job;
struct sd_session;

/* What the session's attachment does for it on the client's socket (attach.c): the job layer
 * sees a client through its session, never its connection. */
struct sd_session_link {
    /* a message to the client, with fds (sent as dups: the caller keeps its own) */
    int (*send)(struct sd_session *s, const Shard__DaemonMsg *msg, const int *fds, unsigned nfds);
    /* an Error message with status and text, logged */
    int (*send_error)(struct sd_session *s, int status, const char *text);
    /* the client hung up and the loop has not read its end yet (a killed trainer whose restart
     * registers at once) */
    bool (*hung_up)(const struct sd_session *s);
    /* it broke its ring (text says how): tell it and hang up */
    void (*broke)(struct sd_session *s, const char *text);
};

struct sd_session {
    struct sd_session *next;
    struct sd_server *srv;
    struct sd_conn *conn;
    uint64_t id;
    pid_t pid;           /* the client's (its connection's SO_PEERCRED) */
    struct sd_fsid cred; /* its uid, gid and groups: the rights of its file work */
    const struct sd_session_link *link;
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

/* room for a completion's message */
#define SD_OP_MSG_LEN SD_CQE_MSG_LEN

void sd_session_complete(struct sd_session *s, uint64_t tag, int op, int status, uint64_t v0,
                         uint64_t v1, const char *msg);
void sd_session_fail(struct sd_session *s, const struct sd_sqe *e, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A message on the client's socket (its link's), with fds; an error reply (the client's call
 * raises it) with status and the text, logged. SD_OK or the send's error. */
int sd_session_send(struct sd_session *s, const Shard__DaemonMsg *msg, const int *fds,
                    unsigned nfds);
int sd_session_send_error(struct sd_session *s, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A client that corrupts its ring loses the session: the text goes to it on its socket and it
 * is hung up (its link's broke); nothing more is read from its ring. */
void sd_session_break(struct sd_session *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* the client hung up, unread yet */
bool sd_session_hung_up(const struct sd_session *s);
/* complete an operation that succeeded, counted in the job's statistics */
void sd_op_done(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t v0,
                uint64_t v1, uint64_t start_ns);

#endif

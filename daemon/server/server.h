/* The server: the client socket (SO_PEERCRED, framing, fd passing), its connections, the
 * progress loop that drives every session's ring and the transport, and the admin socket's
 * JSON (admin.c). */
#ifndef SD_SERVER_H
#define SD_SERVER_H

#include "sd/config.h"
#include "sd/fsid.h"
#include "shard.pb-c.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

struct sd_server;
struct sd_session;
struct sd_registry;
struct sd_transport;

/* a reply waiting to leave: the frame and the fds that travel with its first byte (dups, closed
 * once sent) */
struct sd_txbuf {
    struct sd_txbuf *next;
    size_t len, off;
    int fds[4];
    unsigned nfds;
    uint8_t data[];
};

/* ---- connection: one accepted socket, maybe with a session. Nothing on it blocks the loop:
 * replies queue (conn_queue_bytes at most) and leave as the socket takes them; a message left
 * incomplete longer than frame_timeout_ms, or whose bytes would pass control_memory_bytes, drops
 * the connection with a reason. */
struct sd_conn {
    struct sd_conn *next;
    struct sd_server *srv;
    uint64_t id;
    int fd;
    uv_poll_t poll;
    uint8_t *rx;
    size_t rx_len, rx_cap;
    uint64_t rx_since_ns; /* when the incomplete message in rx began (0: none) */
    uint64_t rx_last_ns;  /* when its last bytes came: a connection that stopped sending hoards */
    struct sd_txbuf *tx_head, *tx_tail;
    size_t tx_bytes;
    bool tx_polling; /* waiting for the socket to take more */
    pid_t pid;
    uid_t uid;
    gid_t gid;
    struct sd_fsid cred; /* uid, gid and groups (SO_PEERGROUPS): the rights of its file work */
    struct sd_session *session;
    bool closing;
    const char *doomed; /* to be closed by the loop, for this reason (a send cannot close it:
                           its caller may still use the session) */
};

/* An admin command answered later (shardctl checkpoint --job): to connection conn_id, if it is
 * still open. */
void sd_server_admin_answer(struct sd_server *srv, uint64_t conn_id, int status, const char *json);
int sd_conn_send(struct sd_conn *c, const Shard__DaemonMsg *msg, const int *fds, unsigned nfds);
int sd_conn_send_error(struct sd_conn *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void sd_conn_close(struct sd_conn *c, const char *why);

/* ---- server */
struct sd_server {
    uv_loop_t *loop;
    const struct sd_config *cfg;
    struct sd_registry *reg;
    char sock_path[SD_PATH_MAX + 32];
    int lfd;
    uv_poll_t lpoll;
    struct sd_conn *conns;
    uint32_t n_conns;
    struct sd_session *sessions;
    uint32_t n_sessions;
    uv_idle_t idle;
    bool spinning;
    uint64_t last_activity_ns;
    uv_timer_t sweep;
    bool sweep_idle; /* the sweep runs at its idle period (server.c) */
    uint64_t start_ns;
    uint64_t next_id;
    bool stopping;
    struct sd_transport *tp; /* multi-node: progressed with the rings */
    /* the fabric's wait fd and its re-poll while tp is attached (progress.c): on the heap, as
     * a detached transport's handles close after the loop's turn, and an independent daemon
     * may attach the next one before that */
    struct sd_tp_watch *tw;
    /* re-polls the rings every ms while a call waits for what no event announces: a push
     * whose gradient a device stream signals on the fence page (session.h, stall_polls) */
    uv_timer_t poll_timer;
    /* a job's step waits for its device's queue (sd_jobs_poll_queues): keep polling */
    bool queue_waiting;
    uint64_t last_net_ns;   /* the last time a transfer completed */
    uint64_t polls;         /* passes of the polling loop since start (shardctl status) */
    uint64_t ctl_bytes;     /* receive buffers and queued replies of every connection */
    int reserve_fd;         /* given up to accept and refuse a client when out of fds */
    uint64_t refused;       /* connections refused (max_clients, fds, allowed_gid) */
    uint64_t dropped;       /* connections dropped for their input or unread replies */
    const char *metrics_at; /* where the metrics endpoint listens (shardctl status), or "" */
};

int sd_server_start(struct sd_server *srv, uv_loop_t *loop, const struct sd_config *cfg,
                    struct sd_registry *reg);
void sd_server_stop(struct sd_server *srv);
/* Run every session's ring until nothing moves; then spin or sleep. */
void sd_server_progress(struct sd_server *srv);
void sd_server_kick(struct sd_server *srv);
/* Progress this transport with the rings, and wake on its wait fd (SD_ENOMEM: not attached).
 * Detach stops that; its handles close at the end of the loop's turn. */
int sd_server_attach_transport(struct sd_server *srv, struct sd_transport *tp);
void sd_server_detach_transport(struct sd_server *srv);

/* admin.c: JSON reply to an admin command from a caller of uid (root sees every job and
 * client, anyone else only their own); *json_p is malloc'd */
int sd_admin_handle(struct sd_server *srv, const Shard__AdminRequest *req, uid_t uid,
                    char **json_p);

/* metrics_text.c: the Prometheus exposition of srv (a struct sd_server *) into out, a struct
 * sd_text (metrics.h's sd_metrics_fn) */
struct sd_text;
void sd_metrics_exposition(void *srv, struct sd_text *out);

#endif

/* The client socket: accept, SO_PEERCRED, frame parsing and dispatch; and the progress engine
 * that drains every session's ring, spinning for poll_spin_us after activity before it sleeps
 * on the sessions' eventfds. */
#include "recover.h"
#include "job.h"
#include "register.h"
#include "jobs.h"
#include "server.h"
#include "attach.h"
#include "session.h"
#include "transport/transport.h"
#include "sd/frame.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sched.h>
#include <unistd.h>

static void conn_io_cb(uv_poll_t *h, int status, int events);

static void conn_poll(struct sd_conn *c)
{
    int ev = UV_READABLE | UV_DISCONNECT | (c->tx_head != NULL ? UV_WRITABLE : 0);
    c->tx_polling = c->tx_head != NULL;
    uv_poll_start(&c->poll, ev, conn_io_cb);
}

static void txbuf_free(struct sd_conn *c, struct sd_txbuf *b)
{
    for (unsigned i = 0; i < b->nfds; i++)
        close(b->fds[i]);
    c->srv->ctl_bytes -= b->len;
    c->tx_bytes -= b->len;
    free(b);
}

/* Mark c to be closed by the loop (conn_io_cb or the sweep). */
static void conn_doom(struct sd_conn *c, const char *why)
{
    if (c->doomed == NULL)
        c->doomed = why;
    uv_poll_start(&c->poll, UV_READABLE | UV_WRITABLE | UV_DISCONNECT, conn_io_cb);
}

/* Send what the socket takes now; false when the connection failed (then doomed). */
static bool conn_flush(struct sd_conn *c)
{
    while (c->tx_head != NULL) {
        struct sd_txbuf *b = c->tx_head;
        int st = sd_frame_send_some(c->fd, b->data, b->len, &b->off, b->off == 0 ? b->fds : NULL,
                                    b->off == 0 ? b->nfds : 0);
        if (st == SD_EAGAIN)
            break;
        if (st != SD_OK) {
            SD_WARN("server", "conn %llu (pid %d): send failed: %s", (unsigned long long)c->id,
                    (int)c->pid, sd_status_str(st));
            conn_doom(c, "send failed");
            return false;
        }
        c->tx_head = b->next;
        if (c->tx_head == NULL)
            c->tx_tail = NULL;
        txbuf_free(c, b);
    }
    if ((c->tx_head != NULL) != c->tx_polling && c->doomed == NULL)
        conn_poll(c);
    return true;
}

static bool rx_make_room(struct sd_server *srv, struct sd_conn *c, uint64_t need);

int sd_conn_send(struct sd_conn *c, const Shard__DaemonMsg *msg, const int *fds, unsigned nfds)
{
    if (c->closing || c->doomed != NULL)
        return SD_ECONNRESET;
    size_t len = protobuf_c_message_get_packed_size(&msg->base);
    const struct sd_config *cfg = c->srv->cfg;
    if (nfds > SD_ARRAY_SIZE(((struct sd_txbuf *)0)->fds) || len > UINT32_MAX)
        return SD_EINVAL;
    /* a reply (a registration's refusal, status) is not refused for connections that hoard the
     * control memory with incomplete messages: they go first */
    if (!rx_make_room(c->srv, c, len + SD_FRAME_HDR) || c->closing || c->doomed != NULL)
        return SD_ECONNRESET;
    if (c->tx_bytes + len + SD_FRAME_HDR > cfg->conn_queue_bytes ||
        c->srv->ctl_bytes + len + SD_FRAME_HDR > cfg->control_memory_bytes) {
        SD_WARN("server",
                "conn %llu (pid %d uid %d): %zu bytes of replies it has not read; closing it "
                "(conn_queue_bytes %llu, control memory in use %llu of %llu)",
                (unsigned long long)c->id, (int)c->pid, (int)c->uid, c->tx_bytes,
                (unsigned long long)cfg->conn_queue_bytes, (unsigned long long)c->srv->ctl_bytes,
                (unsigned long long)cfg->control_memory_bytes);
        c->srv->dropped++;
        conn_doom(c, "does not read its replies");
        return SD_ECONNRESET;
    }
    struct sd_txbuf *b = malloc(sizeof(*b) + len + SD_FRAME_HDR);
    if (b == NULL)
        return SD_ENOMEM;
    *b = (struct sd_txbuf){.len = len + SD_FRAME_HDR};
    sd_frame_header(b->data, len);
    protobuf_c_message_pack(&msg->base, b->data + SD_FRAME_HDR);
    for (unsigned i = 0; i < nfds; i++) { /* the caller keeps its own */
        int fd = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
        if (fd < 0) {
            int st = -errno;
            for (unsigned j = 0; j < b->nfds; j++)
                close(b->fds[j]);
            free(b);
            return st;
        }
        b->fds[b->nfds++] = fd;
    }
    c->tx_bytes += b->len;
    c->srv->ctl_bytes += b->len;
    if (c->tx_tail != NULL)
        c->tx_tail->next = b;
    else
        c->tx_head = b;
    c->tx_tail = b;
    return conn_flush(c) ? SD_OK : SD_ECONNRESET;
}

/* msg, an Error with status and the text fmt formats into text (err is its storage) */
static void error_msg(Shard__DaemonMsg *msg, Shard__Error *err, int status, char *text, size_t len,
                      const char *fmt, va_list ap)
{
    vsnprintf(text, len, fmt, ap);
    *err = (Shard__Error)SHARD__ERROR__INIT;
    err->status = status;
    err->message = text;
    *msg = (Shard__DaemonMsg)SHARD__DAEMON_MSG__INIT;
    msg->msg_case = SHARD__DAEMON_MSG__MSG_ERROR;
    msg->error = err;
}

int sd_conn_send_error(struct sd_conn *c, int status, const char *fmt, ...)
{
    char text[1024];
    Shard__Error err;
    Shard__DaemonMsg msg;
    va_list ap;
    va_start(ap, fmt);
    error_msg(&msg, &err, status, text, sizeof(text), fmt, ap);
    va_end(ap);
    /* (a client's errors are its own to read; a client that makes them by the thousand does
     * not fill the log: 50 lines an interval, then a count) */
    SD_LOG_SPARSE_N(SD_LOG_INFO, "server", 50, "conn %llu (pid %d): %s: %s",
                    (unsigned long long)c->id, (int)c->pid, sd_status_name(status), text);
    return sd_conn_send(c, &msg, NULL, 0);
}

/* Receive buffers are mappings of their own, grown with mremap and unmapped when done: a
 * malloc'd 16 MiB buffer freed goes back to the allocator's heap, not to the system, and 30
 * clients' abandoned messages left the daemon 200 MB larger. */
static uint8_t *rx_resize(uint8_t *old, size_t old_cap, size_t cap)
{
    void *p = old == NULL
                  ? mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                  : mremap(old, old_cap, cap, MREMAP_MAYMOVE);
    return p == MAP_FAILED ? NULL : p;
}

static void rx_free(uint8_t *rx, size_t cap)
{
    if (rx != NULL)
        munmap(rx, cap);
}

static void conn_free_cb(uv_handle_t *h)
{
    struct sd_conn *c = h->data;
    while (c->tx_head != NULL) {
        struct sd_txbuf *b = c->tx_head;
        c->tx_head = b->next;
        txbuf_free(c, b);
    }
    close(c->fd);
    free(c);
}

void sd_conn_close(struct sd_conn *c, const char *why)
{
    if (c->closing)
        return;
    struct sd_server *srv = c->srv;
    c->closing = true;
    /* its receive buffer goes now: the control memory it held is free for the next one */
    srv->ctl_bytes -= c->rx_cap;
    rx_free(c->rx, c->rx_cap);
    c->rx = NULL;
    c->rx_cap = c->rx_len = 0;
    SD_DEBUG("server", "conn %llu (pid %d) closed: %s", (unsigned long long)c->id, (int)c->pid,
             why);
    if (c->session != NULL) {
        sd_session_destroy(c->session, why);
        c->session = NULL;
    }
    for (struct sd_conn **pp = &srv->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    srv->n_conns--;
    uv_poll_stop(&c->poll);
    uv_close((uv_handle_t *)&c->poll, conn_free_cb);
}

static void admin_reply(struct sd_conn *c, int status, const char *json)
{
    Shard__AdminReply rep = SHARD__ADMIN_REPLY__INIT;
    rep.status = status;
    rep.json = (char *)(json ? json : "");
    Shard__DaemonMsg msg = SHARD__DAEMON_MSG__INIT;
    msg.msg_case = SHARD__DAEMON_MSG__MSG_ADMIN;
    msg.admin = &rep;
    sd_conn_send(c, &msg, NULL, 0);
}

void sd_server_admin_answer(struct sd_server *srv, uint64_t conn_id, int status, const char *json)
{
    for (struct sd_conn *c = srv->conns; c; c = c->next)
        if (c->id == conn_id && !c->closing) {
            admin_reply(c, status, json);
            return;
        }
}

static void admin_answer_cb(void *ctx, uint64_t conn_id, int status, const char *json)
{
    sd_server_admin_answer(ctx, conn_id, status, json);
}

static void handle_admin(struct sd_conn *c, const Shard__AdminRequest *req)
{
    char *json = NULL;
    int status;
    if (req->command != NULL && strcmp(req->command, "checkpoint") == 0) {
        struct sd_admin_later later = {.fn = admin_answer_cb, .ctx = c->srv, .conn_id = c->id};
        status = sd_recover_admin(c->srv->reg, &later, c->uid, req->job, req->dir, &json);
        if (status == SD_OK && json == NULL)
            return; /* answered once written (sd_server_admin_answer) */
    } else {
        status = sd_admin_handle(c->srv, req, c->uid, &json);
    }
    admin_reply(c, status, json);
    free(json);
}

/* Returns false when the connection was closed. */
static bool handle_message(struct sd_conn *c, const uint8_t *buf, size_t len)
{
    Shard__ClientMsg *m = shard__client_msg__unpack(NULL, len, buf);
    if (m == NULL) {
        sd_conn_send_error(c, SD_EPROTO,
                           "could not decode a %zu-byte message as shard.ClientMsg (protocol v%d); "
                           "is this a shardd client?",
                           len, SD_PROTOCOL_VERSION);
        sd_conn_close(c, "undecodable message");
        return false;
    }
    bool open = true;
    switch (m->msg_case) {
    case SHARD__CLIENT_MSG__MSG_ATTACH:
        if (c->session != NULL) {
            sd_conn_send_error(c, SD_EPROTO,
                               "attach: this connection is already attached "
                               "(session %llu)",
                               (unsigned long long)c->session->id);
            break;
        }
        if (m->attach->protocol_version != SD_PROTOCOL_VERSION) {
            sd_conn_send_error(c, SD_EVERSION,
                               "attach: client speaks protocol v%u, this shardd " SHARD_VERSION
                               " speaks v%d; use a libshard of the same release",
                               m->attach->protocol_version, SD_PROTOCOL_VERSION);
            break;
        }
        if (c->srv->n_sessions >= (uint32_t)c->srv->cfg->max_clients) {
            sd_conn_send_error(c, SD_EBUSY, "attach: %u clients attached, max_clients is %lld",
                               c->srv->n_sessions, (long long)c->srv->cfg->max_clients);
            break;
        }
        sd_session_create(c, m->attach);
        break;
    case SHARD__CLIENT_MSG__MSG_REGISTER:
        if (c->session == NULL) {
            sd_conn_send_error(c, SD_ESTATE,
                               "register: attach first (no session on this "
                               "connection)");
            break;
        }
        if (c->session->job != NULL) {
            sd_conn_send_error(c, SD_ESTATE,
                               "register: this session already belongs to job '%s' "
                               "as rank %u; attach again for another job",
                               sd_job_name(c->session->job), c->session->rank);
            break;
        }
        if (sd_job_register_waits(c->srv->reg, c->session)) {
            sd_conn_send_error(c, SD_ESTATE,
                               "register: this session's registration waits for a job of its "
                               "name to go; attach again for another job");
            break;
        }
        sd_job_register(c->srv->reg, c->session, m->register_);
        break;
    case SHARD__CLIENT_MSG__MSG_DETACH:
        if (c->session != NULL) {
            sd_session_destroy(c->session, "detached");
            c->session = NULL;
        }
        break;
    case SHARD__CLIENT_MSG__MSG_ADMIN:
        handle_admin(c, m->admin);
        break;
    default:
        sd_conn_send_error(c, SD_EPROTO, "message with no known body (case %d)", m->msg_case);
        sd_conn_close(c, "empty message");
        open = false;
        break;
    }
    shard__client_msg__free_unpacked(m, NULL);
    return open && !c->closing;
}

/* A connection stopped sending this long ago holds its memory without progress: when the
 * control memory is full, the first to go. */
#define RX_STALLED_NS (200 * 1000000ULL)

/* When the control memory is full, whose incomplete message goes (c: the one asking). Only a
 * connection holding more than an equal share of it (the budget over the connections with an
 * incomplete message, c included; *share_p) can go, so that a client within its share is never
 * dropped for another's room, however slowly it sends (a large registration from a starved
 * process paused 200 ms beside 30 senders of 16 MiB and was dropped). Of those, the one that
 * stopped sending the longest ago goes first (*stalled_p: hoarders parked on a partial
 * message), else the one holding the most. NULL when nobody holds more than a share: c then
 * waits its turn. */
static struct sd_conn *rx_victim(struct sd_server *srv, struct sd_conn *c, bool *stalled_p,
                                 uint64_t *share_p)
{
    uint64_t now = sd_now_ns();
    uint32_t n = 0; /* the connections sharing the memory: c too, which asks for its part */
    for (struct sd_conn *o = srv->conns; o; o = o->next)
        n += !o->closing && (o->rx_len > 0 || o == c);
    uint64_t share = srv->cfg->control_memory_bytes / SD_MAX(n, 1u);
    struct sd_conn *stalled = NULL, *over = NULL;
    for (struct sd_conn *o = srv->conns; o; o = o->next) {
        if (o->closing || o->rx_len == 0 || o->rx_cap <= share)
            continue;
        uint64_t idle = now - SD_MAX(o->rx_last_ns, o->rx_since_ns);
        if (o != c && idle >= RX_STALLED_NS &&
            (stalled == NULL || o->rx_last_ns < stalled->rx_last_ns))
            stalled = o;
        if (over == NULL || o->rx_cap > over->rx_cap)
            over = o;
    }
    *stalled_p = stalled != NULL;
    *share_p = share;
    return stalled != NULL ? stalled : over;
}

/* close c for the control memory: its receive buffer goes first, so that the error that tells
 * it why fits. later: the loop closes it (conn_doom), not this call: a victim dropped to make
 * room for another connection's send, whose caller may be walking the ranks of a job that the
 * victim's session, were it closed now, would leave or end under it */
static void rx_drop(struct sd_conn *c, bool later, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void rx_drop(struct sd_conn *c, bool later, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    SD_LOG_SPARSE_N(SD_LOG_WARN, "server", 50, "conn %llu (pid %d uid %d): %s; closing it",
                    (unsigned long long)c->id, (int)c->pid, (int)c->uid, text);
    c->srv->dropped++;
    c->srv->ctl_bytes -= c->rx_cap;
    rx_free(c->rx, c->rx_cap);
    c->rx = NULL;
    c->rx_cap = c->rx_len = 0;
    sd_conn_send_error(c, SD_ENOMEM, "%s", text);
    if (later)
        conn_doom(c, "control memory limit");
    else
        sd_conn_close(c, "control memory limit");
}

/* need more bytes of control memory for c: the hoarders go (rx_victim) until they fit or only c
 * holds more than a share; true if c is still open (whether or not they fit) */
static bool rx_make_room(struct sd_server *srv, struct sd_conn *c, uint64_t need)
{
    uint64_t limit = srv->cfg->control_memory_bytes;
    while (srv->ctl_bytes + need > limit) {
        bool stalled;
        uint64_t share;
        struct sd_conn *v = rx_victim(srv, c, &stalled, &share);
        if (v == NULL || v == c)
            break;
        if (stalled)
            rx_drop(v, true,
                    "the daemon's control memory (control_memory_bytes %llu) is full and your "
                    "incomplete message (%zu bytes so far) made no progress for %llu ms",
                    (unsigned long long)limit, v->rx_len,
                    (unsigned long long)(sd_now_ns() - SD_MAX(v->rx_last_ns, v->rx_since_ns)) /
                        1000000);
        else
            rx_drop(v, true,
                    "the daemon's control memory (control_memory_bytes %llu) is full and your "
                    "incomplete message holds %zu bytes, more than an equal share (%llu) of it",
                    (unsigned long long)limit, v->rx_cap, (unsigned long long)share);
    }
    return !c->closing;
}

/* Room for 4 KiB more in c's receive buffer, within max_message_bytes and the daemon's
 * control memory; false when the connection was closed. */
static bool rx_reserve(struct sd_conn *c)
{
    struct sd_server *srv = c->srv;
    uint64_t limit = srv->cfg->control_memory_bytes;
    size_t max = srv->cfg->max_message_bytes + SD_FRAME_HDR;
    if (c->rx_cap - c->rx_len >= 4096 || c->rx_cap >= max)
        return true;
    size_t cap = SD_MIN(SD_MAX(c->rx_cap * 2, 16384), max);
    if (!rx_make_room(srv, c, cap - c->rx_cap))
        return false;
    if (srv->ctl_bytes + (cap - c->rx_cap) > limit) {
        rx_drop(c, false,
                "the daemon's control memory (control_memory_bytes %llu) is in use by incomplete "
                "messages of connections sending as steadily (%llu bytes); send again later",
                (unsigned long long)limit, (unsigned long long)srv->ctl_bytes);
        return false;
    }
    uint8_t *rx = rx_resize(c->rx, c->rx_cap, cap);
    if (rx == NULL) {
        sd_conn_close(c, "out of memory");
        return false;
    }
    srv->ctl_bytes += cap - c->rx_cap;
    c->rx = rx;
    c->rx_cap = cap;
    return true;
}

/* After the complete messages left rx: a large buffer nobody needs goes back. */
static void rx_trim(struct sd_conn *c)
{
    if (c->rx_len == 0 && c->rx_cap > 65536) {
        c->srv->ctl_bytes -= c->rx_cap;
        rx_free(c->rx, c->rx_cap);
        c->rx = NULL;
        c->rx_cap = 0;
    }
    if (c->rx_len == 0)
        c->rx_since_ns = 0;
    else if (c->rx_since_ns == 0)
        c->rx_since_ns = sd_now_ns();
}

static void conn_read(struct sd_conn *c)
{
    for (;;) {
        if (!rx_reserve(c))
            return;
        ssize_t n = read(c->fd, c->rx + c->rx_len, c->rx_cap - c->rx_len);
        if (n == 0) {
            sd_conn_close(c, "disconnected");
            return;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            sd_conn_close(c, strerror(errno));
            return;
        }
        c->rx_len += (size_t)n;
        c->rx_last_ns = sd_now_ns();
        size_t off = 0;
        while (c->rx_len - off >= SD_FRAME_HDR) {
            size_t flen = sd_frame_len(c->rx + off);
            if (flen > c->srv->cfg->max_message_bytes) {
                sd_conn_send_error(c, SD_EMSGSIZE,
                                   "message of %zu bytes exceeds max_message_bytes (%llu)", flen,
                                   (unsigned long long)c->srv->cfg->max_message_bytes);
                sd_conn_close(c, "oversized message");
                return;
            }
            if (c->rx_len - off < SD_FRAME_HDR + flen)
                break;
            if (!handle_message(c, c->rx + off + SD_FRAME_HDR, flen))
                return;
            off += SD_FRAME_HDR + flen;
            if (c->doomed != NULL) {
                sd_conn_close(c, c->doomed);
                return;
            }
        }
        memmove(c->rx, c->rx + off, c->rx_len - off);
        c->rx_len -= off;
        if (off > 0)
            c->rx_since_ns = 0; /* a message completed: the next one's clock starts now */
        rx_trim(c);
    }
    rx_trim(c);
}

static void conn_io_cb(uv_poll_t *h, int status, int events)
{
    struct sd_conn *c = h->data;
    if (status < 0 || c->doomed != NULL) {
        sd_conn_close(c, c->doomed ? c->doomed : uv_strerror(status));
        return;
    }
    if ((events & UV_WRITABLE) && !conn_flush(c)) {
        sd_conn_close(c, c->doomed);
        return;
    }
    if (events & (UV_READABLE | UV_DISCONNECT))
        conn_read(c);
}

/* Connections whose incomplete message is older than frame_timeout_ms are dropped. */
static void sweep_conns(struct sd_server *srv, uint64_t now)
{
    uint64_t limit = (uint64_t)srv->cfg->frame_timeout_ms * 1000000ULL;
    for (struct sd_conn *c = srv->conns, *next; c; c = next) {
        next = c->next;
        if (c->doomed != NULL) {
            sd_conn_close(c, c->doomed);
            continue;
        }
        if (c->rx_since_ns == 0 || now - c->rx_since_ns <= limit)
            continue;
        SD_WARN("server",
                "conn %llu (pid %d uid %d): %zu bytes of a message left incomplete for %lld ms "
                "(frame_timeout_ms); closing it",
                (unsigned long long)c->id, (int)c->pid, (int)c->uid, c->rx_len,
                (long long)((now - c->rx_since_ns) / 1000000));
        srv->dropped++;
        sd_conn_send_error(c, SD_ETIMEDOUT,
                           "a message of yours stayed incomplete for more than %lld ms "
                           "(frame_timeout_ms)",
                           (long long)srv->cfg->frame_timeout_ms);
        sd_conn_close(c, "incomplete message timed out");
    }
}

/* Tell a client why it is refused, without waiting for it, and close. */
static void refuse(struct sd_server *srv, int fd, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void refuse(struct sd_server *srv, int fd, int status, const char *fmt, ...)
{
    char text[256];
    Shard__Error err;
    Shard__DaemonMsg msg;
    va_list ap;
    va_start(ap, fmt);
    error_msg(&msg, &err, status, text, sizeof(text), fmt, ap);
    va_end(ap);
    (void)sd_frame_send(fd, &msg.base, NULL, 0, 0); /* what the socket takes now, no wait */
    /* closing with the client's first message unread would reset the connection, and the
     * client would read the reset instead of the reason: end our side, take what it sent */
    shutdown(fd, SHUT_WR);
    char sink[4096];
    while (read(fd, sink, sizeof(sink)) > 0)
        ;
    close(fd);
    srv->refused++;
    SD_WARN_SPARSE("server", "refused a connection: %s", text);
}

/* Is a peer of uid/gid (pid for its supplementary groups) allowed in? */
static bool peer_allowed(const struct sd_config *cfg, pid_t pid, uid_t uid, gid_t gid)
{
    if (cfg->allowed_gid < 0 || uid == 0 || gid == (gid_t)cfg->allowed_gid)
        return true;
    char path[64], line[1024];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "re");
    bool in = false;
    while (f != NULL && !in && fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, "Groups:", 7) != 0)
            continue;
        char *p = line + 7, *end;
        for (long g = strtol(p, &end, 10); end != p; p = end, g = strtol(p, &end, 10))
            if (g == cfg->allowed_gid)
                in = true;
        break;
    }
    if (f != NULL)
        fclose(f);
    return in;
}

static void sweep_wake(struct sd_server *srv);

static void accept_cb(uv_poll_t *h, int status, int events)
{
    struct sd_server *srv = h->data;
    (void)events;
    if (status < 0)
        return;
    sweep_wake(srv);
    for (;;) {
        int fd = accept4(srv->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE) && srv->reserve_fd >= 0) {
            /* out of fds: the connection would stay in the backlog and wake the loop forever;
             * give up the reserve fd to take it and tell it why */
            close(srv->reserve_fd);
            srv->reserve_fd = -1;
            fd = accept4(srv->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd >= 0)
                refuse(srv, fd, SD_EBUSY,
                       "shardd is out of file descriptors (%u connections); try again later",
                       srv->n_conns);
            srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
            if (fd < 0) /* accept checks for a free fd before the backlog: none was waiting */
                return;
            continue;
        }
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                SD_WARN_SPARSE("server", "accept: %s", strerror(errno));
            return;
        }
        if (srv->n_conns >= (uint32_t)srv->cfg->max_clients + 8) {
            refuse(srv, fd, SD_EBUSY,
                   "shardd has %u connections open (max_clients %lld); try again later",
                   srv->n_conns, (long long)srv->cfg->max_clients);
            continue;
        }
        struct ucred cred;
        socklen_t clen = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
            SD_WARN("server", "SO_PEERCRED: %s", strerror(errno));
            close(fd);
            continue;
        }
        if (!peer_allowed(srv->cfg, cred.pid, cred.uid, cred.gid)) {
            refuse(srv, fd, SD_EPERM,
                   "uid %d (pid %d) is not in group %lld, which allowed_gid lets use this "
                   "shardd",
                   (int)cred.uid, (int)cred.pid, (long long)srv->cfg->allowed_gid);
            continue;
        }
        struct sd_conn *c = calloc(1, sizeof(*c));
        if (c == NULL) {
            close(fd);
            continue;
        }
        c->srv = srv;
        c->id = ++srv->next_id;
        c->fd = fd;
        c->pid = cred.pid;
        c->uid = cred.uid;
        c->gid = cred.gid;
        c->cred = (struct sd_fsid){.uid = cred.uid, .gid = cred.gid};
        socklen_t glen = sizeof(c->cred.groups);
        /* its groups too (Linux 4.13); a process in more than SD_FSID_MAX_GROUPS groups gets
         * none but its own gid for its files: fewer rights, never more */
        if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, c->cred.groups, &glen) == 0)
            c->cred.n_groups =
                (uint32_t)SD_MIN((size_t)glen / sizeof(gid_t), (size_t)SD_FSID_MAX_GROUPS);
        uv_poll_init(srv->loop, &c->poll, fd);
        c->poll.data = c;
        conn_poll(c);
        c->next = srv->conns;
        srv->conns = c;
        srv->n_conns++;
        SD_DEBUG("server", "conn %llu from pid %d uid %d", (unsigned long long)c->id, (int)c->pid,
                 (int)c->uid);
    }
}

/* the deadlines' sweep: every op_timeout_ms / 10 (10..100 ms) while there is anything to time,
 * once a second when no client is connected and no job is here (an idle daemon barely wakes);
 * a connection brings the short period back (accept_cb) */
#define SWEEP_IDLE_MS 1000

static uint64_t sweep_period_ms(const struct sd_server *srv)
{
    return (uint64_t)SD_MAX(10, SD_MIN(100, srv->cfg->op_timeout_ms / 10));
}

static void sweep_cb(uv_timer_t *h)
{
    struct sd_server *srv = h->data;
    uint64_t now = sd_now_ns();
    sweep_conns(srv, now);
    sd_jobs_sweep(srv->reg, now);
    sd_server_progress(srv);
    bool idle = srv->conns == NULL && srv->reg->jobs == NULL && srv->reg->zombies == NULL;
    if (idle != srv->sweep_idle) {
        srv->sweep_idle = idle;
        uint64_t period = idle ? SWEEP_IDLE_MS : sweep_period_ms(srv);
        uv_timer_start(&srv->sweep, sweep_cb, period, period);
    }
}

static void sweep_wake(struct sd_server *srv)
{
    if (!srv->sweep_idle)
        return;
    srv->sweep_idle = false;
    uint64_t period = sweep_period_ms(srv);
    uv_timer_start(&srv->sweep, sweep_cb, period, period);
}

/* Create the runtime directory 0700. One that exists already (made by systemd's
 * RuntimeDirectory=, say, 0750 for a trainer group) keeps its mode unless others could write
 * into it. */
static int make_runtime_dir(const char *dir)
{
    bool created = mkdir(dir, 0700) == 0;
    if (!created && errno != EEXIST) {
        SD_ERROR("server", "cannot create runtime_dir %s: %s", dir, strerror(errno));
        return -errno;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        SD_ERROR("server", "runtime_dir %s is not a directory", dir);
        return SD_EINVAL;
    }
    if (st.st_uid != geteuid()) {
        SD_ERROR("server", "runtime_dir %s belongs to uid %d, not to us (uid %d)", dir,
                 (int)st.st_uid, (int)geteuid());
        return SD_EPERM;
    }
    if ((created || (st.st_mode & 0022)) && (st.st_mode & 07777) != 0700 && chmod(dir, 0700) != 0) {
        SD_ERROR("server", "chmod 0700 %s (it was %04o, writable by others): %s", dir,
                 (unsigned)(st.st_mode & 07777), strerror(errno));
        return -errno;
    }
    return SD_OK;
}

int sd_server_start(struct sd_server *srv, uv_loop_t *loop, const struct sd_config *cfg,
                    struct sd_registry *reg)
{
    int status;
    memset(srv, 0, sizeof(*srv));
    srv->loop = loop;
    srv->cfg = cfg;
    srv->reg = reg;
    srv->start_ns = sd_now_ns();
    srv->lfd = -1;
    srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC); /* see accept_cb */

    status = make_runtime_dir(cfg->runtime_dir);
    if (status != SD_OK)
        return status;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int n = snprintf(srv->sock_path, sizeof(srv->sock_path), "%s/shardd.sock", cfg->runtime_dir);
    if (n < 0 || (size_t)n >= sizeof(addr.sun_path)) {
        SD_ERROR("server", "socket path %s/shardd.sock is longer than %zu bytes", cfg->runtime_dir,
                 sizeof(addr.sun_path) - 1);
        return SD_EINVAL;
    }
    memcpy(addr.sun_path, srv->sock_path, (size_t)n + 1);

    srv->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (srv->lfd < 0)
        return -errno;
    /* a socket file left behind: refuse if a daemon still answers on it, else replace it */
    if (access(srv->sock_path, F_OK) == 0) {
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (probe >= 0 && connect(probe, (struct sockaddr *)&addr, sizeof(addr)) == 0) {
            close(probe);
            SD_ERROR("server", "another shardd is serving %s; stop it or use another runtime_dir",
                     srv->sock_path);
            status = SD_EBUSY;
            goto err_close;
        }
        if (probe >= 0)
            close(probe);
        unlink(srv->sock_path);
    }
    mode_t old = umask(0117);
    int r = bind(srv->lfd, (struct sockaddr *)&addr, sizeof(addr));
    umask(old);
    if (r != 0 || chmod(srv->sock_path, 0660) != 0 || listen(srv->lfd, 128) != 0) {
        status = -errno;
        SD_ERROR("server", "cannot listen on %s: %s", srv->sock_path, strerror(errno));
        goto err_close;
    }
    if (cfg->allowed_gid >= 0) { /* the group may reach the socket: dir 0710, socket 0660 */
        gid_t g = (gid_t)cfg->allowed_gid;
        if (chown(cfg->runtime_dir, (uid_t)-1, g) != 0 || chmod(cfg->runtime_dir, 0710) != 0 ||
            chown(srv->sock_path, (uid_t)-1, g) != 0) {
            status = -errno;
            SD_ERROR("server", "cannot give group %lld access to %s: %s",
                     (long long)cfg->allowed_gid, srv->sock_path, strerror(errno));
            goto err_close;
        }
    }
    uv_poll_init(loop, &srv->lpoll, srv->lfd);
    srv->lpoll.data = srv;
    uv_poll_start(&srv->lpoll, UV_READABLE, accept_cb);
    uv_idle_init(loop, &srv->idle);
    srv->idle.data = srv;
    uv_timer_init(loop, &srv->poll_timer);
    srv->poll_timer.data = srv;
    uv_timer_init(loop, &srv->sweep);
    srv->sweep.data = srv;
    uint64_t period = sweep_period_ms(srv);
    uv_timer_start(&srv->sweep, sweep_cb, period, period);
    SD_INFO("server", "listening on %s", srv->sock_path);
    return SD_OK;

err_close:
    close(srv->lfd);
    srv->lfd = -1;
    return status;
}

void sd_server_stop(struct sd_server *srv)
{
    srv->stopping = true;
    while (srv->conns != NULL)
        sd_conn_close(srv->conns, "daemon shutting down");
    sd_jobs_destroy_all(srv->reg);
    if (srv->lfd >= 0) {
        uv_poll_stop(&srv->lpoll);
        uv_close((uv_handle_t *)&srv->lpoll, NULL);
        close(srv->lfd);
        srv->lfd = -1;
        unlink(srv->sock_path);
    }
    uv_idle_stop(&srv->idle);
    uv_close((uv_handle_t *)&srv->idle, NULL);
    uv_timer_stop(&srv->poll_timer);
    uv_close((uv_handle_t *)&srv->poll_timer, NULL);
    uv_timer_stop(&srv->sweep);
    uv_close((uv_handle_t *)&srv->sweep, NULL);
    if (srv->reserve_fd >= 0)
        close(srv->reserve_fd);
    srv->reserve_fd = -1;
}

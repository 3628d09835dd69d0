/* The client socket: accept, SO_PEERCRED, frame parsing and dispatch; and the progress engine
 * that drains every session's ring, spinning for poll_spin_us after activity before it sleeps
 * on the sessions' eventfds. */
#include "registry.h"
#include "server.h"
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sched.h>
#include <unistd.h>

#define SEND_TIMEOUT_MS 2000

int sd_conn_send(struct sd_conn *c, const Shard__DaemonMsg *msg, const int *fds, unsigned nfds)
{
    if (c->closing)
        return SD_ECONNRESET;
    int status = sd_frame_send(c->fd, &msg->base, fds, nfds, SEND_TIMEOUT_MS);
    if (status != SD_OK)
        SD_WARN("server", "conn %llu (pid %d): send failed: %s", (unsigned long long)c->id,
                (int)c->pid, sd_status_str(status));
    return status;
}

int sd_conn_send_error(struct sd_conn *c, int status, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    Shard__Error err = SHARD__ERROR__INIT;
    err.status = status;
    err.message = text;
    Shard__DaemonMsg msg = SHARD__DAEMON_MSG__INIT;
    msg.msg_case = SHARD__DAEMON_MSG__MSG_ERROR;
    msg.error = &err;
    SD_INFO("server", "conn %llu (pid %d): %s: %s", (unsigned long long)c->id, (int)c->pid,
            sd_status_name(status), text);
    return sd_conn_send(c, &msg, NULL, 0);
}

static void conn_free_cb(uv_handle_t *h)
{
    struct sd_conn *c = h->data;
    close(c->fd);
    free(c->rx);
    free(c);
}

void sd_conn_close(struct sd_conn *c, const char *why)
{
    if (c->closing)
        return;
    struct sd_server *srv = c->srv;
    c->closing = true;
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

static void handle_admin(struct sd_conn *c, const Shard__AdminRequest *req)
{
    char *json = NULL;
    int status = sd_admin_handle(c->srv, req, &json);
    Shard__AdminReply rep = SHARD__ADMIN_REPLY__INIT;
    rep.status = status;
    rep.json = json ? json : "";
    Shard__DaemonMsg msg = SHARD__DAEMON_MSG__INIT;
    msg.msg_case = SHARD__DAEMON_MSG__MSG_ADMIN;
    msg.admin = &rep;
    sd_conn_send(c, &msg, NULL, 0);
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

static void conn_read_cb(uv_poll_t *h, int status, int events)
{
    struct sd_conn *c = h->data;
    size_t max = c->srv->cfg->max_message_bytes + SD_FRAME_HDR;
    (void)events;
    if (status < 0) {
        sd_conn_close(c, uv_strerror(status));
        return;
    }
    for (;;) {
        if (c->rx_cap - c->rx_len < 4096 && c->rx_cap < max) {
            size_t cap = SD_MIN(SD_MAX(c->rx_cap * 2, 16384), max);
            uint8_t *rx = realloc(c->rx, cap);
            if (rx == NULL) {
                sd_conn_close(c, "out of memory");
                return;
            }
            c->rx = rx;
            c->rx_cap = cap;
        }
        ssize_t n = read(c->fd, c->rx + c->rx_len, c->rx_cap - c->rx_len);
        if (n == 0) {
            sd_conn_close(c, "disconnected");
            return;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            sd_conn_close(c, strerror(errno));
            return;
        }
        c->rx_len += (size_t)n;
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
        }
        memmove(c->rx, c->rx + off, c->rx_len - off);
        c->rx_len -= off;
    }
}

static void accept_cb(uv_poll_t *h, int status, int events)
{
    struct sd_server *srv = h->data;
    (void)events;
    if (status < 0)
        return;
    for (;;) {
        int fd = accept4(srv->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                SD_WARN_SPARSE("server", "accept: %s", strerror(errno));
            return;
        }
        if (srv->n_conns >= (uint32_t)srv->cfg->max_clients + 8) {
            SD_WARN_SPARSE("server", "refusing connection: %u open (max_clients %lld)",
                           srv->n_conns, (long long)srv->cfg->max_clients);
            close(fd);
            continue;
        }
        struct ucred cred;
        socklen_t clen = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
            SD_WARN("server", "SO_PEERCRED: %s", strerror(errno));
            close(fd);
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
        uv_poll_init(srv->loop, &c->poll, fd);
        c->poll.data = c;
        uv_poll_start(&c->poll, UV_READABLE | UV_DISCONNECT, conn_read_cb);
        c->next = srv->conns;
        srv->conns = c;
        srv->n_conns++;
        SD_DEBUG("server", "conn %llu from pid %d uid %d", (unsigned long long)c->id, (int)c->pid,
                 (int)c->uid);
    }
}

/* ---- progress: drain rings; spin while busy, then sleep on eventfds */

enum { DID_NET = 1, DID_RING = 2 };

/* one pass over the fabric and the rings: what moved (DID_NET, DID_RING) */
static int progress_once(struct sd_server *srv)
{
    int did = 0;
    if (srv->tp != NULL && srv->tp->ops->progress(srv->tp) > 0) {
        did |= DID_NET;
        srv->last_net_ns = sd_now_ns();
    }
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        if (sd_session_progress(s))
            did |= DID_RING;
    return did;
}

static void set_sleeping(struct sd_server *srv, uint32_t v)
{
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        atomic_store(&s->hdr->daemon_sleeping, v);
}

/* true if no ring holds a request the daemon could take now. Requests queued behind a stalled
 * one (a push whose unit's previous round still runs, a fetch waiting for pool space or
 * transfer resources) wait for what unblocks it: a completion, another client's request or a
 * timer, each of which wakes the loop. Counting them kept the daemon busy-polling for as long
 * as a client had more requests queued than it could start, which starved the other daemons
 * and the kernel's TCP on a shared host. */
static bool all_empty(struct sd_server *srv)
{
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        if (!s->broken && !s->has_stalled && !sd_ring_sq_empty(s->hdr))
            return false;
    return true;
}

static void wake(struct sd_server *srv);

static void net_timer_cb(uv_timer_t *h)
{
    struct sd_server *srv = h->data;
    uint64_t before = srv->last_net_ns;
    sd_server_progress(srv);
    if (srv->last_net_ns != before)
        wake(srv); /* data moves again: poll closely */
    if (!sd_net_busy(srv->reg))
        uv_timer_stop(&srv->net_timer);
}

static void idle_cb(uv_idle_t *h)
{
    struct sd_server *srv = h->data;
    uint64_t now = sd_now_ns();
    srv->polls++;
    int did = progress_once(srv);
    if (did) {
        for (int more = progress_once(srv); more; more = progress_once(srv))
            did |= more;
        if (did & DID_RING) /* poll_spin_us counts from the trainers' last request */
            srv->last_activity_ns = now;
        return;
    }
    if (now - srv->last_activity_ns < (uint64_t)srv->cfg->poll_spin_us * 1000)
        return;
    /* transfers in flight need progress calls (manual-progress providers such as ofi_rxm
     * advance a transfer one step per call): busy-poll with net_spin (cores to spare), poll
     * yielding the core for net_poll_us after the last completion, then sleep on the completion
     * queue's wait fd with a 1 ms re-poll. Spinning daemons that share cores with trainers and
     * other daemons (an emulated cluster) slow the transfers down: the default sleeps at once. */
    if (srv->tp != NULL) {
        bool busy = sd_net_busy(srv->reg);
        if (busy && srv->cfg->net_spin)
            return;
        if (busy && now - srv->last_net_ns < (uint64_t)srv->cfg->net_poll_us * 1000) {
            sched_yield();
            return;
        }
        if (!srv->tp->ops->can_sleep(srv->tp)) {
            sched_yield();
            return;
        }
        /* a transfer waits for data that is not there yet: sleep on the wait fd, and look
         * again every millisecond (providers with manual progress need the calls) */
        if (busy && !uv_is_active((uv_handle_t *)&srv->net_timer))
            uv_timer_start(&srv->net_timer, net_timer_cb, 1, 1);
    }
    /* go to sleep: announce it, then look once more (pairs with the client's fence) */
    set_sleeping(srv, 1);
    atomic_thread_fence(memory_order_seq_cst);
    if (!all_empty(srv)) {
        set_sleeping(srv, 0);
        return;
    }
    uv_idle_stop(&srv->idle);
    srv->spinning = false;
}

void sd_server_progress(struct sd_server *srv)
{
    while (progress_once(srv))
        ;
}

/* Progress now, then keep polling from the idle handle until a pass finds nothing to do. The
 * fabric's wake-ups come here directly: spinning for poll_spin_us after each of them would
 * busy-poll through a whole transfer (data arrives continuously), taking the CPU that other
 * daemons and the kernel's TCP need on a shared host. */
static void wake(struct sd_server *srv)
{
    set_sleeping(srv, 0);
    sd_server_progress(srv);
    if (!srv->spinning && !srv->stopping) {
        srv->spinning = true;
        uv_idle_start(&srv->idle, idle_cb);
    }
}

/* A client's request: poll its ring for poll_spin_us more, for the next one. */
void sd_server_kick(struct sd_server *srv)
{
    srv->last_activity_ns = sd_now_ns();
    wake(srv);
}

static void tp_wake_cb(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    wake(h->data);
}

void sd_server_attach_transport(struct sd_server *srv, struct sd_transport *tp)
{
    srv->tp = tp;
    uv_timer_init(srv->loop, &srv->net_timer);
    srv->net_timer.data = srv;
    int fd = tp->ops->wait_fd(tp);
    if (fd >= 0 && uv_poll_init(srv->loop, &srv->tpoll, fd) == 0) {
        srv->tpoll.data = srv;
        uv_poll_start(&srv->tpoll, UV_READABLE, tp_wake_cb);
        srv->tpolling = true;
    }
    sd_server_kick(srv);
}

void sd_server_detach_transport(struct sd_server *srv)
{
    if (srv->tpolling) {
        uv_poll_stop(&srv->tpoll);
        uv_close((uv_handle_t *)&srv->tpoll, NULL);
        srv->tpolling = false;
    }
    if (srv->tp != NULL) {
        uv_timer_stop(&srv->net_timer);
        uv_close((uv_handle_t *)&srv->net_timer, NULL);
    }

    srv->tp = NULL;
}

static void sweep_cb(uv_timer_t *h)
{
    struct sd_server *srv = h->data;
    sd_registry_sweep(srv->reg, sd_now_ns());
    sd_server_progress(srv);
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
    uv_poll_init(loop, &srv->lpoll, srv->lfd);
    srv->lpoll.data = srv;
    uv_poll_start(&srv->lpoll, UV_READABLE, accept_cb);
    uv_idle_init(loop, &srv->idle);
    srv->idle.data = srv;
    uv_timer_init(loop, &srv->sweep);
    srv->sweep.data = srv;
    uint64_t period = (uint64_t)SD_MAX(10, SD_MIN(100, cfg->op_timeout_ms / 10));
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
    sd_registry_destroy_all(srv->reg);
    if (srv->lfd >= 0) {
        uv_poll_stop(&srv->lpoll);
        uv_close((uv_handle_t *)&srv->lpoll, NULL);
        close(srv->lfd);
        srv->lfd = -1;
        unlink(srv->sock_path);
    }
    uv_idle_stop(&srv->idle);
    uv_close((uv_handle_t *)&srv->idle, NULL);
    uv_timer_stop(&srv->sweep);
    uv_close((uv_handle_t *)&srv->sweep, NULL);
}

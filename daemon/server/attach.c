/* A client's attachment: its session's shared-memory ring and two eventfds, set up and torn
 * down, and the ring drained into the job's operations. The daemon copies each submission out
 * of shared memory before it validates it. */
#include "attach.h"
#include "cluster/cluster.h"
#include "dispatch.h"
#include "job_life.h"
#include "register.h"
#include "net_service.h"
#include "server.h"
#include "session.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

static void sq_wake_cb(uv_poll_t *h, int status, int events)
{
    struct sd_session *s = h->data;
    uint64_t v;
    (void)status;
    (void)events;
    while (read(s->sq_efd, &v, sizeof(v)) > 0)
        ;
    sd_server_kick(s->srv);
}

/* ---- the session's link to its client (session.h): its connection */

static int link_send(struct sd_session *s, const Shard__DaemonMsg *msg, const int *fds,
                     unsigned nfds)
{
    return sd_conn_send(s->conn, msg, fds, nfds);
}

static int link_send_error(struct sd_session *s, int status, const char *text)
{
    return sd_conn_send_error(s->conn, status, "%s", text);
}

static bool link_hung_up(const struct sd_session *s)
{
    struct pollfd p = {.fd = s->conn->fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP)) != 0;
}

/* The session broke its ring (session.c): tell the client on its socket and hang up; the read
 * callback sees EOF and closes the session. */
static void link_broke(struct sd_session *s, const char *text)
{
    link_send_error(s, SD_EPROTO, text);
    shutdown(s->conn->fd, SHUT_RDWR);
}

static const struct sd_session_link conn_link = {
    .send = link_send, .send_error = link_send_error, .hung_up = link_hung_up, .broke = link_broke};

int sd_session_create(struct sd_conn *c, const Shard__Attach *msg)
{
    struct sd_server *srv = c->srv;
    int status;
    struct sd_session *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return sd_conn_send_error(c, SD_ENOMEM, "attach: out of memory");
    s->srv = srv;
    s->conn = c;
    s->pid = c->pid;
    s->cred = c->cred;
    s->id = ++srv->next_id;
    s->sq_efd = s->cq_efd = -1;
    s->link = &conn_link;
    char tag[64];
    snprintf(tag, sizeof(tag), "shardd-ring-%llu", (unsigned long long)s->id);
    status = sd_gpu_host_ops.alloc(0, SD_RING_BYTES, SD_MEM_SHARED, tag, &s->ring);
    if (status != SD_OK)
        goto err_free;
    s->hdr = s->ring.ptr;
    sd_ring_init(s->hdr);
    s->sq_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    s->cq_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->sq_efd < 0 || s->cq_efd < 0) {
        status = -errno;
        goto err_free_ring;
    }

    Shard__AttachReply rep = SHARD__ATTACH_REPLY__INIT;
    rep.session_id = s->id;
    rep.ring_entries = SD_RING_ENTRIES;
    rep.ring_bytes = SD_RING_BYTES;
    rep.node = sd_cluster_shown_node(sd_net_cluster(srv->reg->net));
    rep.nodes = sd_cluster_shown_nodes(sd_net_cluster(srv->reg->net));
    rep.daemon_version = SHARD_VERSION;
    rep.op_timeout_ms = (uint32_t)srv->cfg->op_timeout_ms;
    Shard__DaemonMsg out = SHARD__DAEMON_MSG__INIT;
    out.msg_case = SHARD__DAEMON_MSG__MSG_ATTACH;
    out.attach = &rep;
    int fds[3] = {s->ring.fd, s->sq_efd, s->cq_efd};
    status = sd_conn_send(c, &out, fds, 3);
    if (status != SD_OK)
        goto err_free_ring;

    uv_poll_init(srv->loop, &s->sq_poll, s->sq_efd);
    s->sq_poll.data = s;
    uv_poll_start(&s->sq_poll, UV_READABLE, sq_wake_cb);
    s->next = srv->sessions;
    srv->sessions = s;
    srv->n_sessions++;
    c->session = s;
    SD_INFO("session", "session %llu attached: pid %d uid %d (%s)", (unsigned long long)s->id,
            (int)c->pid, (int)c->uid, msg->client_name ? msg->client_name : "");
    sd_server_kick(srv);
    return SD_OK;

err_free_ring:
    if (s->sq_efd >= 0)
        close(s->sq_efd);
    if (s->cq_efd >= 0)
        close(s->cq_efd);
    sd_gpu_host_ops.free(&s->ring);
err_free:
    free(s);
    return sd_conn_send_error(c, status, "attach: cannot set up the shared ring: %s",
                              sd_status_str(status));
}

static void session_free_cb(uv_handle_t *h)
{
    struct sd_session *s = h->data;
    close(s->sq_efd);
    close(s->cq_efd);
    sd_gpu_host_ops.free(&s->ring);
    free(s->holds);
    free(s);
}

void sd_session_destroy(struct sd_session *s, const char *reason)
{
    struct sd_server *srv = s->srv;
    if (s->job != NULL)
        sd_job_leave(s->job, s, reason);
    sd_job_register_forget(srv->reg, s);
    for (struct sd_session **pp = &srv->sessions; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    srv->n_sessions--;
    SD_INFO("session", "session %llu (pid %d) ended: %s", (unsigned long long)s->id,
            (int)s->conn->pid, reason);
    if (s->conn != NULL && s->conn->session == s)
        s->conn->session = NULL;
    uv_poll_stop(&s->sq_poll);
    uv_close((uv_handle_t *)&s->sq_poll, session_free_cb);
}

/* Returns true if consumed. */
static bool dispatch(struct sd_session *s, const struct sd_sqe *e)
{
    if (e->op == SD_OP_NOP) {
        sd_session_complete(s, e->tag, SD_OP_NOP, SD_OK, 0, 0, NULL);
        return true;
    }
    if (e->op >= SD_OP_COUNT) {
        sd_session_fail(s, e, SD_EINVAL, "unknown operation code %u", e->op);
        return true;
    }
    if (s->job == NULL || !s->registered) {
        sd_session_fail(s, e, SD_ESTATE, "%s: register a model first (this session has no job)",
                        sd_op_name((int)e->op));
        return true;
    }
    return sd_job_op(s->job, s, e);
}

bool sd_session_progress(struct sd_session *s)
{
    bool any = false;
    if (s->broken)
        return false;
    if (s->has_stalled) {
        s->stall_polls = false;
        if (!dispatch(s, &s->stalled))
            return false;
        s->has_stalled = false;
        any = true;
    }
    struct sd_sqe e;
    int r;
    while (!s->broken && (r = sd_ring_sq_pop(s->hdr, &e)) != 0) {
        if (r < 0) {
            sd_session_break(s, "submission ring indices are corrupt (head %llu, tail %llu)",
                             (unsigned long long)atomic_load(&s->hdr->sq_head),
                             (unsigned long long)atomic_load(&s->hdr->sq_tail));
            break;
        }
        any = true;
        s->stall_polls = false;
        if (!dispatch(s, &e)) {
            s->stalled = e;
            s->has_stalled = true;
            s->stalled_ns = sd_now_ns();
            break;
        }
    }
    return any;
}

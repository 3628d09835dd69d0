/* The control plane between the daemons of a cluster (DESIGN.md section 6): TCP links driven by
 * the libuv loop, node 0 the coordinator. Rendezvous (hello with node, version, config digest and
 * fabric address; the address table once every node is present), heartbeats, node failures, and
 * the framing of peer messages, which go to the coordinator (coordinator.c) or to the registry
 * (the events of cluster.h). An open cluster (nodes 0) is ready at the coordinator from the
 * start; a member's hello asks for a number, which the coordinator gives (the lowest one a node
 * that left freed, else a new one) with the grown table (PeerTable.you). */
#include "cluster/cluster_int.h"

#include <arpa/inet.h>

static void retry_cb(uv_timer_t *t);

/* The heartbeat thread's peer for node: the address of l's other end, port, and the session
 * key of l's handshake. */
void sd_cluster__hb_peer(struct sd_cluster *cl, uint32_t node, struct link *l, uint32_t port)
{
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    if (uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&ss, &len) == 0)
        sd_heartbeat_set_peer(cl->hb, node, (struct sockaddr *)&ss, (uint16_t)port, l->hb_key,
                              cl->indep ? cl->meet.as[node] : UINT32_MAX);
}

static uint32_t count_alive(const struct sd_cluster *cl)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < cl->n; i++)
        n += cl->alive[i] || i == cl->self;
    return n;
}

/* the coordinator's view of which nodes are down, as a table carries it */
static const protobuf_c_boolean *cl_down_list(struct sd_cluster *cl)
{
    for (uint32_t i = 0; i < cl->n; i++)
        cl->down_scratch[i] = i != cl->self && !cl->alive[i];
    return cl->down_scratch;
}

/* ---- node liveness */

static void node_down(struct sd_cluster *cl, uint32_t node, const char *reason)
{
    if (node >= cl->n || !cl->alive[node] || cl->stopping)
        return;
    cl->alive[node] = false;
    SD_WARN("cluster", "node %u is down: %s", node, reason);
    if (cl->self == 0)
        sd_cluster__coord_node_down(cl, node);
    else
        sd_cluster__member_gone(cl, node);
    if (cl->self == 0) { /* tell the others */
        Shard__NodeDown nd = SHARD__NODE_DOWN__INIT;
        nd.node = node;
        nd.reason = (char *)reason;
        Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
        m.msg_case = SHARD__PEER_MSG__MSG_NODE_DOWN;
        m.node_down = &nd;
        for (uint32_t i = 1; i < cl->n; i++)
            if (i != node && cl->alive[i])
                sd_cluster__link_send(cl->by_node[i], &m);
    }
    sd_probe_down(cl, node);
    cl->ev.node_down(cl->ev.ctx, node, reason);
    if (cl->ready)
        cl->tp->ops->peer_down(cl->tp, node);
    struct link *direct = cl->self != 0 ? cl->by_node[node] : NULL;
    if (direct != NULL && direct->peer) { /* its end learns it from the closed link */
        direct->retired = true;
        sd_cluster__link_close(direct, "the node is down");
    }
}

/* ---- coordinator: rendezvous */

/* The address table (again, after a node rejoined): every node is up but those in down[]
 * (NULL: none), which the transport forgets at once. */
int sd_cluster__install_table(struct sd_cluster *cl, const protobuf_c_boolean *down)
{
    const void **p = calloc(cl->n, sizeof(*p));
    for (uint32_t i = 0; i < cl->n; i++)
        p[i] = cl->addrs[i];
    int st = cl->tp->ops->set_peers(cl->tp, p, cl->addr_len, cl->n);
    free(p);
    if (st != SD_OK)
        return st;
    bool again = cl->ready;
    cl->ready = true;
    cl->rejoining = false;
    for (uint32_t i = 0; i < cl->n; i++) {
        cl->alive[i] = cl->present[i] = down == NULL || !down[i] || i == cl->self;
        if (!cl->alive[i])
            cl->tp->ops->peer_down(cl->tp, i);
    }
    sd_probe_table(cl); /* "up" once the data path answers */
    st = cl->ev.formed(cl->ev.ctx);
    if (st != SD_OK)
        return st;
    if (again)
        SD_INFO("cluster", "address table installed again: the cluster has %u nodes up",
                count_alive(cl));
    else if (!cl->indep)
        SD_INFO("cluster", "cluster of %u nodes formed in %.2f s", cl->n,
                (double)(sd_now_ns() - cl->start_ns) / 1e9);
    return SD_OK;
}

void sd_cluster__refuse(struct link *l, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    SD_ERROR_SPARSE("cluster", "refusing a daemon: %s", text);
    sd_cluster__refuse_text(l, text);
}

void sd_cluster__refuse_text(struct link *l, const char *text)
{
    Shard__PeerRefuse r = SHARD__PEER_REFUSE__INIT;
    r.reason = (char *)text;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_REFUSE;
    m.refuse = &r;
    sd_cluster__link_send(l, &m);
    sd_cluster__link_close(l, "refused");
}

void sd_cluster__on_hello(struct link *l, const Shard__PeerHello *h)
{
    struct sd_cluster *cl = l->cl;
    if (!sd_cluster__hello_authentic(l, h))
        return;
    uint32_t node = h->node;
    if (h->peer) {
        sd_cluster__refuse(
            l,
            "a direct link from node %u to the coordinator: a member reaches it on its "
            "own link",
            node);
        return;
    }
    if (cl->open && node != SD_NO_NODE) {
        sd_cluster__refuse(
            l,
            "a daemon that calls itself node %u joins an open cluster (nodes 0), whose "
            "coordinator numbers its members: start it with nodes 0 and no node",
            node);
        return;
    }
    if (cl->open) {
        /* a member that rejoins keeps its number (its running jobs name it) unless another
         * holds it; else a node that left gives its number to the next to come (one this
         * coordinator saw: a number it never saw may be a member's that has not rejoined
         * yet), else a new one */
        node = SD_MAX(cl->n, cl->track.reserved);
        uint32_t was = h->was;
        if (was != 0 && was < cl->cap)
            cl->track.reserved = SD_MAX(cl->track.reserved, SD_MIN(h->known, cl->cap));
        bool same = was < cl->n && h->fabric_addr.len == cl->addr_len[was] &&
                    memcmp(h->fabric_addr.data, cl->addrs[was], cl->addr_len[was]) == 0;
        if (was != 0 && was < cl->cap && (was >= cl->n || cl->by_node[was] == NULL || same)) {
            node = was;
        } else {
            for (uint32_t i = 1; i < cl->n; i++)
                if (!cl->alive[i] && cl->present[i] && cl->by_node[i] == NULL) {
                    node = i;
                    break;
                }
        }
        if (node >= cl->cap) {
            sd_cluster__refuse(l, "the open cluster has its %u nodes up", cl->cap);
            return;
        }
    } else if (node == 0 || node >= cl->n) {
        sd_cluster__refuse(l, "node %u is out of range: this cluster has nodes 0..%u", node,
                           cl->n - 1);
        return;
    }
    Shard__PeerHello hn = *h;
    hn.node = node;
    h = &hn;
    if (h->protocol_version != SD_PROTOCOL_VERSION || strcmp(h->version, SHARD_VERSION) != 0) {
        sd_cluster__refuse(
            l, "node %u runs shardd %s (protocol v%u); the coordinator runs %s (v%d)", h->node,
            h->version, h->protocol_version, SHARD_VERSION, SD_PROTOCOL_VERSION);
        return;
    }
    if (h->config_digest != cl->digest) {
        sd_cluster__refuse(
            l,
            "node %u has a different cluster configuration: it has [%s], the coordinator "
            "has [%s]",
            h->node, h->config_summary, cl->summary);
        return;
    }
    struct link *old = cl->by_node[h->node];
    if (cl->present[h->node] && cl->alive[h->node] && old != NULL && old != l) {
        if (!cl->ready) {
            sd_cluster__refuse(l, "node %u is already in the cluster", h->node);
            return;
        }
        /* a node that lost its link (a freeze, a partition) and came back: the old link is
         * dead whatever TCP says; its jobs fail with it, and the node rejoins */
        SD_WARN("cluster",
                "node %u connected again while its previous link was open: dropping "
                "that link",
                h->node);
        sd_cluster__link_close(old, "the node connected again");
    }
    if (h->fabric_addr.len > sizeof(cl->addrs[0])) {
        sd_cluster__refuse(l, "node %u: fabric address of %zu bytes is too long", h->node,
                           h->fabric_addr.len);
        return;
    }
    if (cl->open && h->node >= cl->n)
        cl->n = h->node + 1; /* a new node: the table grows (past numbers not back yet) */
    l->node = (int)h->node;
    char host[SD_PEER_ADDR]; /* its job peers reach it where the coordinator does */
    sd_cluster__link_host(l, host, sizeof(host));
    if (h->peer_port != 0 && h->peer_port <= 65535 && strcmp(host, "?") != 0)
        snprintf(cl->peers.addrs[h->node], SD_PEER_ADDR, "%.40s:%u", host, h->peer_port);
    else
        cl->peers.addrs[h->node][0] = '\0';
    cl->by_node[h->node] = l;
    if (h->fabric_addr.len > 0)
        memcpy(cl->addrs[h->node], h->fabric_addr.data, h->fabric_addr.len);
    cl->addr_len[h->node] = h->fabric_addr.len;
    bool rejoin = cl->present[h->node];
    cl->present[h->node] = true;
    cl->hb_port[h->node] = h->hb_port;
    sd_cluster__hb_peer(cl, h->node, l, h->hb_port);
    SD_INFO("cluster", "node %u joined%s", h->node, rejoin ? " again" : "");
    if (cl->ready) {
        /* a restarted or unfrozen node: give everyone the table again, it serves new jobs */
        cl->alive[h->node] = true;
        if (sd_cluster__install_table(cl, cl_down_list(cl)) == SD_OK)
            sd_cluster__broadcast_table(cl);
        return;
    }
    for (uint32_t i = 0; i < cl->n; i++)
        if (!cl->present[i])
            return;
    if (sd_cluster__install_table(cl, NULL) == SD_OK)
        sd_cluster__broadcast_table(cl);
}

/* ---- receiving */

/* The coordinator passes a member's message for another member on (a job's messages only:
 * what a member may say about the cluster it says to the coordinator itself). */
static void relay(struct link *l, const Shard__PeerRelay *r)
{
    struct sd_cluster *cl = l->cl;
    const char *job = r->msg != NULL ? sd_cluster__relayed_job(r->msg) : NULL;
    if (job == NULL || r->to >= cl->n) {
        SD_WARN_SPARSE("cluster", "node %d asked to relay %s to node %u: dropped", l->node,
                       r->msg == NULL ? "nothing" : "a message that is not a job's", r->to);
        return;
    }
    if (!sd_cluster__coord_relays(cl, l->node, job, r->to))
        return;
    if (r->to == cl->self)
        sd_cluster__on_message(l, r->msg);
    else
        sd_cluster__send_to(cl, r->to, r->msg);
}

void sd_cluster__on_message(struct link *l, const Shard__PeerMsg *m)
{
    struct sd_cluster *cl = l->cl;
    l->last_seen_ns = sd_now_ns();
    if (!l->authed) {
        sd_cluster__on_unauthed(l, m);
        return;
    }
    if (cl->indep && l->peer && !sd_meet__receive(l, (Shard__PeerMsg *)m))
        return;
    if (l->peer && !sd_cluster__peer_heard(l, m))
        return;
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_HELLO: /* once per link, before it was heard */
        sd_cluster__link_close(l, "a second hello");
        break;
    case SHARD__PEER_MSG__MSG_TABLE:
        if (cl->self != 0 && sd_cluster__table_fits(cl, m->table))
            sd_cluster__member_table(cl, l, m->table);
        break;
    case SHARD__PEER_MSG__MSG_REFUSE:
        SD_ERROR("cluster", "the coordinator refused this daemon: %s", m->refuse->reason);
        cl->fatal = true;
        uv_stop(cl->loop);
        break;
    case SHARD__PEER_MSG__MSG_HEARTBEAT:
        break;
    case SHARD__PEER_MSG__MSG_JOB_REPORT: /* the coordinator's, or without it a member's */
        if (cl->self == 0 || l->peer)
            sd_cluster__coord_report_from(cl, l->node, m->job_report);
        break;
    case SHARD__PEER_MSG__MSG_JOB_CONFIRM:
        cl->ev.job_confirmed(cl->ev.ctx, m->job_confirm->job, m->job_confirm->tag,
                             m->job_confirm->nodes, (uint32_t)m->job_confirm->n_nodes);
        sd_cluster__peer_links(cl, sd_now_ns()); /* its peers' direct links, before it runs */
        break;
    case SHARD__PEER_MSG__MSG_JOB_REFUSE:
        cl->ev.job_refused(cl->ev.ctx, m->job_refuse->job, m->job_refuse->status,
                           m->job_refuse->message);
        break;
    case SHARD__PEER_MSG__MSG_JOB_ABORT: {
        const Shard__JobAbort *a = m->job_abort;
        /* the coordinator, or without it the member that decides a registration's */
        bool decides = cl->self == 0 || (l->peer && a->tag == 0);
        if (decides && !sd_cluster__coord_abort_heard(cl, l->node, a))
            break;
        if (decides) /* relay to the job's others (and forget a registration's reports) */
            sd_cluster__coord_abort(cl, m);
        cl->ev.job_aborted(cl->ev.ctx, a->job, a->tag, a->status, a->step, a->message);
        break;
    }
    case SHARD__PEER_MSG__MSG_JOB_READY:
        cl->ev.job_remote_ready(cl->ev.ctx, m->job_ready->job);
        break;
    case SHARD__PEER_MSG__MSG_JOB_LEFT: {
        static uint64_t left_logged;
        const Shard__JobLeft *jl = m->job_left;
        if (cl->self == 0 && sd_cluster__coord_hears(cl, jl->job, l->node, "'left'", &left_logged))
            sd_cluster__coord_left(cl, jl->job, (uint32_t)l->node, jl->nodes,
                                   (uint32_t)jl->n_nodes);
        else if (cl->self != 0 && jl->node == (uint32_t)l->node) /* a peer, or node 0 */
            sd_cluster__member_left(cl, jl->job, jl->node, jl->nodes, (uint32_t)jl->n_nodes);
        break;
    }
    case SHARD__PEER_MSG__MSG_JOB_END:
        sd_cluster__member_ended(cl, m->job_end->job);
        cl->ev.job_ended(cl->ev.ctx, m->job_end->job);
        break;
    case SHARD__PEER_MSG__MSG_JOB_SAVED:
        cl->ev.job_saved(cl->ev.ctx, m->job_saved);
        break;
    case SHARD__PEER_MSG__MSG_JOB_SAVE_DONE:
        cl->ev.job_save_done(cl->ev.ctx, m->job_save_done->job, m->job_save_done->seq,
                             m->job_save_done->status, m->job_save_done->message);
        break;
    case SHARD__PEER_MSG__MSG_JOB_RECOVER:
        cl->ev.job_recover(cl->ev.ctx, m->job_recover);
        break;
    case SHARD__PEER_MSG__MSG_RELAY:
        if (cl->self == 0)
            relay(l, m->relay);
        break;
    case SHARD__PEER_MSG__MSG_NODE_DOWN:
        node_down(cl, m->node_down->node, m->node_down->reason);
        break;
    case SHARD__PEER_MSG__MSG_BYE:
        l->retired = true;
        sd_cluster__link_close(l, "the peer closed it: no job of theirs needs it");
        break;
    default:
        break;
    }
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    struct link *l = h->data;
    (void)suggested;
    if (l->rx_cap - l->rx_len < 65536) {
        size_t cap = SD_MAX(l->rx_cap * 2, 131072);
        uint8_t *rx = realloc(l->rx, cap);
        if (rx == NULL) {
            *buf = uv_buf_init(NULL, 0);
            return;
        }
        l->rx = rx;
        l->rx_cap = cap;
    }
    *buf = uv_buf_init((char *)l->rx + l->rx_len, (unsigned)(l->rx_cap - l->rx_len));
}

static void read_cb(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    struct link *l = s->data;
    (void)buf;
    if (n < 0) {
        sd_cluster__link_close(l, n == UV_EOF ? "connection closed" : uv_strerror((int)n));
        return;
    }
    l->rx_len += (size_t)n;
    size_t off = 0;
    while (l->rx_len - off >= SD_FRAME_HDR) {
        size_t len = sd_frame_len(l->rx + off);
        if (len > (l->authed ? MAX_PEER_MSG : MAX_HELLO_MSG)) {
            sd_cluster__link_close(l, "oversized peer message");
            return;
        }
        if (l->rx_len - off < SD_FRAME_HDR + len)
            break;
        Shard__PeerMsg *m = shard__peer_msg__unpack(NULL, len, l->rx + off + SD_FRAME_HDR);
        off += SD_FRAME_HDR + len;
        if (m == NULL) {
            sd_cluster__link_close(l, "undecodable peer message");
            return;
        }
        sd_cluster__on_message(l, m);
        shard__peer_msg__free_unpacked(m, NULL);
        if (l->closing)
            return;
    }
    memmove(l->rx, l->rx + off, l->rx_len - off);
    l->rx_len -= off;
    if (l->rx_cap > (512u << 10) && l->rx_len < (64u << 10)) { /* (after a large message) */
        uint8_t *rx = realloc(l->rx, 131072);
        if (rx != NULL) {
            l->rx = rx;
            l->rx_cap = 131072;
        }
    }
}

void sd_cluster__read_start(struct link *l)
{
    uv_read_start((uv_stream_t *)&l->tcp, alloc_cb, read_cb);
}

static void link_free_cb(uv_handle_t *h)
{
    struct link *l = h->data;
    sd_meet__link_free(l);
    free(l->rx);
    free(l);
}

void sd_cluster__link_close(struct link *l, const char *why)
{
    if (l->closing)
        return;
    struct sd_cluster *cl = l->cl;
    l->closing = true;
    for (struct link **pp = &cl->links; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    int node = l->node;
    bool mine = node >= 0 && (uint32_t)node < cl->cap && cl->by_node[node] == l;
    if (mine) {
        cl->by_node[node] = NULL;
        if (l->peer) /* no job needs its heartbeats any more, or it is lost */
            sd_heartbeat_set_peer(cl->hb, (uint32_t)node, NULL, 0, NULL, UINT32_MAX);
    } else if (cl->self != 0 && !l->peer && cl->by_node[0] == l) {
        cl->by_node[0] = NULL;
    }
    if (l->peer && !l->incoming && node >= 0 && (uint32_t)node < cl->cap && !l->authed) {
        cl->peers.dialing[node] = false;
        if (!cl->stopping)
            sd_cluster__dial_failed(cl, (uint32_t)node, why);
        /* (what waited for it will not go; an independent daemon's waits for the leader to
         * listen, and goes at a later dial, within its deadline) */
        if (!cl->stopping && !cl->indep)
            sd_cluster__outbox_drop(cl, (uint32_t)node, why);
    }
    uv_close((uv_handle_t *)&l->tcp, link_free_cb);
    if (cl->stopping)
        return;
    if (l->peer) {
        if (mine && !l->retired && cl->ready)
            sd_cluster__peer_lost(cl, (uint32_t)node, why);
        return;
    }
    if (node >= 0 && cl->ready) {
        char reason[160];
        snprintf(reason, sizeof(reason), "%s", why);
        node_down(cl, (uint32_t)node, reason);
        if (cl->self != 0 && node == 0) {
            /* a member without the coordinator: the jobs with ranks on node 0 failed (above);
             * those between members go on over their direct links. Reconnect, and rejoin
             * with a new address table (keeping this node's number, which they name) */
            if (!cl->rejoining)
                SD_WARN("cluster",
                        "lost the coordinator (%s): reconnecting to %s every %d ms to "
                        "rejoin; jobs between members go on",
                        why, cl->cfg->coordinator, SD_REJOIN_RETRY_MS);
            else
                SD_WARN_SPARSE("cluster",
                               "rejoin: the coordinator at %s closed the connection (%s); "
                               "again in %d ms",
                               cl->cfg->coordinator, why, SD_REJOIN_RETRY_MS);
            cl->rejoining = true;
            /* again after a reconnect that connected and then broke before the table (a
             * coordinator still exiting accepts, then resets): nothing else retries then */
            if (!cl->fatal)
                uv_timer_start(&cl->retry, retry_cb, SD_REJOIN_RETRY_MS, 0);
        }
    } else if (cl->self != 0 && !cl->ready && !cl->fatal) {
        SD_WARN("cluster", "lost the coordinator before the cluster formed: %s", why);
    }
}

struct link *sd_cluster__link_new(struct sd_cluster *cl)
{
    struct link *l = calloc(1, sizeof(*l));
    l->cl = cl;
    l->node = -1;
    l->last_seen_ns = l->created_ns = sd_now_ns();
    uv_tcp_init(cl->loop, &l->tcp);
    l->tcp.data = l;
    l->next = cl->links;
    cl->links = l;
    return l;
}

void sd_cluster__on_connection(uv_stream_t *server, int status)
{
    struct sd_cluster *cl = server->data;
    if (status < 0)
        return;
    struct link *l = sd_cluster__link_new(cl);
    l->incoming = true;
    if (uv_accept(server, (uv_stream_t *)&l->tcp) != 0) {
        sd_cluster__link_close(l, "accept failed");
        return;
    }
    sd_cluster__link_host(l, l->host, sizeof(l->host));
    if (!sd_cluster__admit(cl, l))
        return;
    uv_tcp_nodelay(&l->tcp, 1);
    uv_read_start((uv_stream_t *)&l->tcp, alloc_cb, read_cb);
    sd_cluster__challenge(l);
}

/* ---- member: connect to the coordinator, retrying until the rendezvous deadline */

static void try_connect(struct sd_cluster *cl);

static void retry_cb(uv_timer_t *t)
{
    try_connect(t->data);
}

static void connect_cb(uv_connect_t *req, int status)
{
    struct link *l = req->data;
    struct sd_cluster *cl = l->cl;
    if (cl->connecting == l)
        cl->connecting = NULL;
    if (status < 0) {
        if (cl->rejoining && status != UV_ECANCELED)
            SD_WARN_SPARSE("cluster",
                           "rejoin: connecting to the coordinator at %s: %s; again in "
                           "%d ms",
                           cl->cfg->coordinator, uv_strerror(status), SD_REJOIN_RETRY_MS);
        sd_cluster__link_close(l, uv_strerror(status));
        /* a connect given up after the reconnect period (UV_ECANCELED) is tried again at once:
         * one attempt in flight per period, whatever TCP's backoff */
        uint64_t delay = !cl->rejoining ? 200 : status == UV_ECANCELED ? 0 : SD_REJOIN_RETRY_MS;
        if (!cl->stopping && !cl->fatal)
            uv_timer_start(&cl->retry, retry_cb, delay, 0);
        return;
    }
    uv_tcp_nodelay(&l->tcp, 1);
    cl->by_node[0] = l;
    l->node = 0;
    uv_read_start((uv_stream_t *)&l->tcp, alloc_cb, read_cb); /* its challenge comes first */
}

static void try_connect(struct sd_cluster *cl)
{
    struct sockaddr_storage ss;
    if ((cl->ready && !cl->rejoining) || cl->stopping ||
        sd_cluster__parse_hostport(cl->cfg->coordinator, &ss) != SD_OK)
        return;
    struct link *l = sd_cluster__link_new(cl);
    cl->connect_req.data = l;
    cl->connecting = l;
    cl->connect_started_ns = sd_now_ns();
    if (uv_tcp_connect(&cl->connect_req, &l->tcp, (struct sockaddr *)&ss, connect_cb) != 0) {
        cl->connecting = NULL;
        sd_cluster__link_close(l, "connect failed");
        uv_timer_start(&cl->retry, retry_cb, cl->rejoining ? SD_REJOIN_RETRY_MS : 200, 0);
    }
}

/* ---- heartbeats and deadlines */

static void timer_cb(uv_timer_t *t)
{
    struct sd_cluster *cl = t->data;
    uint64_t now = sd_now_ns();
    if (!cl->ready) {
        if (now - cl->start_ns > (uint64_t)cl->cfg->rendezvous_timeout_ms * 1000000ULL) {
            char missing[256] = "";
            size_t off = 0;
            for (uint32_t i = 0; i < cl->n && off < sizeof(missing); i++)
                if (!cl->present[i])
                    off += (size_t)snprintf(missing + off, sizeof(missing) - off, "%s%u",
                                            off ? ", " : "", i);
            if (cl->self == 0)
                SD_ERROR("cluster",
                         "rendezvous: nodes %s did not join within %lld ms "
                         "(rendezvous_timeout_ms)",
                         missing, (long long)cl->cfg->rendezvous_timeout_ms);
            else
                SD_ERROR("cluster",
                         "rendezvous: no address table from the coordinator at %s "
                         "within %lld ms (rendezvous_timeout_ms)",
                         cl->cfg->coordinator, (long long)cl->cfg->rendezvous_timeout_ms);
            cl->fatal = true;
            uv_stop(cl->loop);
        }
        return;
    }
    Shard__PeerHeartbeat hb = SHARD__PEER_HEARTBEAT__INIT;
    hb.seq = ++cl->hb_seq;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_HEARTBEAT;
    m.heartbeat = &hb;
    uint64_t timeout = (uint64_t)cl->cfg->heartbeat_timeout_ms * 1000000ULL;
    sd_heartbeat_tick(cl->hb);
    /* a reconnect whose SYN went into a partition is retried at TCP's backoff (3 s, 7 s, ...):
     * give it up after the reconnect period and start a fresh one */
    if (cl->rejoining && cl->connecting != NULL &&
        now - cl->connect_started_ns > (uint64_t)SD_REJOIN_RETRY_MS * 1000000ULL) {
        struct link *c = cl->connecting;
        cl->connecting = NULL;
        sd_cluster__link_close(c, "connect timed out"); /* its connect_cb schedules the next try */
    }
    for (struct link *l = cl->links, *next; l; l = next) {
        next = l->next;
        if (l->stalled) {
            sd_cluster__link_close(l, "the other end does not read what it is sent");
            continue;
        }
        if (!l->authed && now - l->created_ns > (uint64_t)SD_AUTH_MS * 1000000ULL) {
            char addr[64];
            cl->counts.refused += l->incoming;
            SD_WARN_SPARSE("cluster",
                           "a connection with %s did not prove the %s within %d ms: closed",
                           sd_cluster__link_addr(l, addr, sizeof(addr)),
                           cl->indep ? "token of a job" : "cluster's secret", SD_AUTH_MS);
            int node = l->node;
            sd_cluster__link_close(l, "its handshake did not finish in time");
            if (cl->self != 0 && node == 0 && !cl->ready)
                uv_timer_start(&cl->retry, retry_cb, 200, 0);
            continue;
        }
        if (l->node < 0 || !l->authed)
            continue;
        sd_cluster__link_send(l, &m);
        /* the later of the link's last message and the heartbeat thread's last datagram: a
         * loop that was held up did not read the link, but its thread heard the peer */
        uint64_t seen = SD_MAX(l->last_seen_ns, sd_heartbeat_last_seen(cl->hb, (uint32_t)l->node));
        /* the thread may have heard the peer after `now` was read: then it is fresh */
        if (seen < now && now - seen > timeout) {
            char reason[128];
            snprintf(reason, sizeof(reason), "no heartbeat for %llu ms",
                     (unsigned long long)((now - seen) / 1000000));
            int node = l->node;
            sd_cluster__link_close(l, reason);
            if (cl->self != 0 && node == 0)
                node_down(cl, 0, reason);
        }
    }
    sd_probe_tick(cl, now);
    if (cl->indep)
        sd_meet__tick(cl, now);
    sd_cluster__coord_sweep(cl, now); /* (a member's: registrations it decides) */
    if (cl->self != 0)
        sd_cluster__peer_links(cl, now);
}

/* ---- API */

int sd_cluster_start(struct sd_cluster **cl_p, uv_loop_t *loop, const struct sd_config *cfg,
                     struct sd_transport *tp, const struct sd_cluster_events *ev)
{
    struct sd_cluster *cl = calloc(1, sizeof(*cl));
    if (cl == NULL)
        return SD_ENOMEM;
    cl->loop = loop;
    cl->cfg = cfg;
    cl->tp = tp;
    cl->ev = *ev;
    /* an open cluster (nodes 0) grows as daemons join; its coordinator is node 0, and numbers
     * the others as they come */
    cl->open = cfg->nodes == 0;
    cl->indep = cfg->nodes == 1; /* (its table fills as jobs name their daemons) */
    cl->cap = cl->open || cl->indep ? SD_MAX_NODES : (uint32_t)cfg->nodes;
    cl->self = cl->indep ? 1 : cfg->node >= 0 ? (uint32_t)cfg->node : SD_NO_NODE;
    cl->n = !cl->open ? cl->cap : cl->self == 0 ? 1 : 0;
    cl->start_ns = sd_now_ns();
    uint8_t seed[SD_AUTH_NONCE]; /* a member deciding registrations without the coordinator
                                  * starts its tags where another such member is unlikely to */
    if (cl->self != 0 && sd_auth_nonce(seed) == SD_OK)
        cl->track.next_tag = (uint16_t)((seed[0] | seed[1] << 8) % ((1u << SD_TAG_JOB_BITS) - 1));
    struct sd_config same = *cfg; /* (an independent daemon's jobs say their ranks per node) */
    if (cl->indep)
        same.ranks_per_node = 0;
    cl->digest = sd_config_digest(&same, cl->summary, sizeof(cl->summary));
    char err[600];
    /* an independent daemon's links prove their jobs' tokens: it has no cluster secret */
    if (!cl->indep && sd_auth_load(cfg, &cl->auth, err, sizeof(err)) != SD_OK) {
        SD_ERROR("cluster", "%s", err);
        *cl_p = cl;
        return SD_ECONFIG;
    }
    cl->addrs = calloc(cl->cap, sizeof(*cl->addrs));
    cl->addr_len = calloc(cl->cap, sizeof(*cl->addr_len));
    cl->present = calloc(cl->cap, sizeof(bool));
    cl->alive = calloc(cl->cap, sizeof(bool));
    cl->down_scratch = calloc(cl->cap, sizeof(*cl->down_scratch));
    cl->hb_port = calloc(cl->cap, sizeof(*cl->hb_port));
    cl->by_node = calloc(cl->cap, sizeof(*cl->by_node));
    cl->peers.addrs = calloc(cl->cap, sizeof(*cl->peers.addrs));
    cl->peers.dialing = calloc(cl->cap, sizeof(*cl->peers.dialing));
    cl->peers.idle_ns = calloc(cl->cap, sizeof(*cl->peers.idle_ns));
    cl->peers.need = calloc(cl->cap, sizeof(*cl->peers.need));
    cl->peers.dial_fails = calloc(cl->cap, sizeof(*cl->peers.dial_fails));
    cl->peers.dial_why = calloc(cl->cap, sizeof(*cl->peers.dial_why));
    if (!cl->addrs || !cl->addr_len || !cl->present || !cl->alive || !cl->down_scratch ||
        !cl->hb_port || !cl->by_node || !cl->peers.addrs || !cl->peers.dialing ||
        !cl->peers.idle_ns || !cl->peers.need || !cl->peers.dial_fails || !cl->peers.dial_why) {
        *cl_p = cl;
        return SD_ENOMEM;
    }
    size_t len = sizeof(cl->me.addr);
    int st = tp->ops->getname(tp, cl->me.addr, &len);
    if (st != SD_OK) {
        *cl_p = cl; /* the caller stops and frees it */
        return st;
    }
    cl->me.addr_len = len;
    if (cl->self != SD_NO_NODE) {
        memcpy(cl->addrs[cl->self], cl->me.addr, len);
        cl->addr_len[cl->self] = len;
        cl->present[cl->self] = true;
    }
    if (cl->indep && (st = sd_meet__init(cl)) != SD_OK) {
        *cl_p = cl;
        return st;
    }
    if ((st = sd_probe_init(cl)) != SD_OK) {
        *cl_p = cl;
        return st;
    }
    /* heartbeats on a thread of their own; it stops vouching for a loop silent 4 timeouts */
    uint16_t hb_port = 0;
    /* bound to this node's address: node 0's is the coordinator's host, the others' the one
     * they reach it from (fabric_addr) */
    char host[128] = "";
    const char *colon = strrchr(cfg->coordinator, ':');
    if (cl->self == 0 && colon != NULL && (size_t)(colon - cfg->coordinator) < sizeof(host))
        snprintf(host, sizeof(host), "%.*s", (int)(colon - cfg->coordinator), cfg->coordinator);
    else
        snprintf(host, sizeof(host), "%s", cfg->fabric_addr);
    st = sd_heartbeat_start(
        &cl->hb,
        &(struct sd_heartbeat_param){.self = cl->self,
                                     .n = cl->cap,
                                     .digest = cl->digest,
                                     .interval_ms = (uint64_t)cfg->heartbeat_interval_ms,
                                     .stall_ms = 4 * (uint64_t)cfg->heartbeat_timeout_ms,
                                     .bind_addr = host,
                                     .port = (uint16_t)cfg->heartbeat_port},
        &hb_port);
    if (st != SD_OK)
        SD_WARN("cluster", "no heartbeat thread (%s): the control links' heartbeats alone count",
                sd_status_str(st));
    cl->me.hb_port = hb_port;
    if (cl->self != SD_NO_NODE)
        cl->hb_port[cl->self] = hb_port;
    uv_timer_init(loop, &cl->timer);
    cl->timer.data = cl;
    uv_timer_init(loop, &cl->retry);
    cl->retry.data = cl;
    uint64_t period = (uint64_t)cfg->heartbeat_interval_ms;
    uv_timer_start(&cl->timer, timer_cb, period, period);

    if (cl->indep) { /* ready at once, alone: it listens once a job spans nodes */
        *cl_p = cl;
        return sd_meet__start(cl);
    }
    if (cl->self == 0) {
        struct sockaddr_storage ss;
        if (sd_cluster__parse_hostport(cfg->coordinator, &ss) != SD_OK) {
            SD_ERROR("cluster", "coordinator '%s' is not host:port", cfg->coordinator);
            *cl_p = cl;
            return SD_ECONFIG;
        }
        uv_tcp_init(loop, &cl->listener);
        cl->listener.data = cl;
        int r = uv_tcp_bind(&cl->listener, (struct sockaddr *)&ss, 0);
        if (r == 0)
            r = uv_listen((uv_stream_t *)&cl->listener, SD_LISTEN_BACKLOG,
                          sd_cluster__on_connection);
        if (r != 0) {
            SD_ERROR("cluster", "cannot listen on %s: %s", cfg->coordinator, uv_strerror(r));
            *cl_p = cl;
            return SD_EIO;
        }
        if (cl->open) { /* ready at once: the others join it */
            SD_INFO("cluster", "coordinator of an open cluster listening on %s", cfg->coordinator);
            st = sd_cluster__install_table(cl, NULL);
            if (st != SD_OK) {
                *cl_p = cl;
                return st;
            }
        } else {
            SD_INFO("cluster", "coordinator listening on %s for %u nodes", cfg->coordinator, cl->n);
        }
    } else {
        int r = sd_cluster__listen_peers(cl, host, (uint32_t)cfg->peer_port);
        if (r != 0)
            SD_WARN("cluster",
                    "cannot listen for job peers on %s:%lld (%s): jobs between members reach "
                    "each other through the coordinator only",
                    host, (long long)cfg->peer_port, uv_strerror(r));
        try_connect(cl);
    }
    *cl_p = cl;
    return SD_OK;
}

static void noop_close(uv_handle_t *h)
{
    (void)h;
}

void sd_cluster_stop(struct sd_cluster *cl)
{
    if (cl == NULL)
        return;
    cl->stopping = true;
    while (cl->links != NULL)
        sd_cluster__link_close(cl->links, "daemon stopping");
    if (cl->listener.loop != NULL)
        uv_close((uv_handle_t *)&cl->listener, noop_close);
    if (cl->timer.loop != NULL) { /* the timers were initialized */
        uv_timer_stop(&cl->timer);
        uv_timer_stop(&cl->retry);
        uv_close((uv_handle_t *)&cl->timer, noop_close);
        uv_close((uv_handle_t *)&cl->retry, noop_close);
    }
    sd_cluster__coord_free(cl);
    sd_cluster__outbox_drop(cl, SD_NO_NODE, "stopping");
    sd_probe_stop(cl);
    sd_heartbeat_stop(cl->hb);
    cl->hb = NULL;
    /* the handles are closed; the memory goes once the loop ran their close callbacks */
}

void sd_cluster_free(struct sd_cluster *cl)
{
    if (cl == NULL)
        return;
    free(cl->addrs);
    free(cl->addr_len);
    free(cl->present);
    free(cl->alive);
    free(cl->down_scratch);
    free(cl->hb_port);
    free(cl->by_node);
    free(cl->peers.addrs);
    free(cl->peers.dialing);
    free(cl->peers.idle_ns);
    free(cl->peers.need);
    free(cl->peers.dial_fails);
    free(cl->peers.dial_why);
    sd_meet__free(cl);
    sd_probe_free(cl);
    free(cl);
}

/* A member's direct links to its job peers (DESIGN.md section 6): while a job spans two members
 * they keep a control link of their own (opened by whichever needs it first; of two, the one the
 * lower node opened stays), authenticated as any link is, with heartbeats on it and on the
 * heartbeat thread, and closed by the end that opened it once no job there has needed it for
 * SD_PEER_IDLE_MS. Its loss fails the jobs that span both, on both ends, and nothing else (the
 * coordinator's word on which nodes are up stands). A job's messages between members (abort,
 * ready, saves, recovery) go through the coordinator while it is up, in order with its
 * decisions, and on the direct link without it; each member tracks when its jobs' nodes left.
 * So a job between members outlives the coordinator, and a member that rejoins keeps the peers
 * its direct links vouch for whatever the (restarted) coordinator's table says yet. */
#include "cluster/cluster_int.h"

#include <arpa/inet.h>

/* open a direct link to node, unless one is open or being opened */
static void dial(struct sd_cluster *cl, uint32_t node);

/* A member's direct link to a job peer broke (closed, or silent past heartbeat_timeout_ms):
 * the jobs that span both fail (or pause) here, and the peer's fabric connections close, as the
 * other end does; whether the node is down is the coordinator's to say (it may be up, and serve
 * later jobs). */
void sd_cluster__peer_lost(struct sd_cluster *cl, uint32_t node, const char *reason)
{
    SD_WARN("cluster", "the direct link to node %u (a job peer) is lost: %s", node, reason);
    if (cl->indep) { /* its only evidence: down until a link proves it again */
        cl->alive[node] = false;
        sd_probe_down(cl, node);
    }
    cl->ev.node_down(cl->ev.ctx, node, reason);
    sd_cluster__member_gone(cl, node); /* (it will not say it left the jobs that failed) */
    if (cl->ready && cl->tp->ops->peer_reset != NULL)
        (void)cl->tp->ops->peer_reset(cl->tp, node);
}

/* A member's direct link to job peer node is up (proved): its own evidence that node is. */
bool sd_cluster__job_peer_up(const struct sd_cluster *cl, uint32_t node)
{
    const struct link *l = node < cl->n && node != 0 ? cl->by_node[node] : NULL;
    return l != NULL && l->peer && l->authed && !l->closing;
}

bool sd_cluster__coordinator_up(const struct sd_cluster *cl)
{
    return cl->self == 0 || (cl->by_node[0] != NULL && cl->by_node[0]->authed &&
                             !cl->by_node[0]->peer && !cl->by_node[0]->closing);
}

void sd_cluster__peer_send(struct sd_cluster *cl, uint32_t node, const Shard__PeerMsg *m)
{
    if (node == 0 || node == cl->self || node >= cl->n)
        return;
    if (sd_cluster__job_peer_up(cl, node)) {
        sd_cluster__link_send(cl->by_node[node], m);
        return;
    }
    struct outmsg *o = calloc(1, sizeof(*o));
    if (o == NULL || cl->peers.addrs[node][0] == '\0' ||
        (o->frame = cl->indep ? sd_meet__frame(cl, m, &o->len) : sd_cluster__frame(m, &o->len)) ==
            NULL) {
        SD_WARN_SPARSE("cluster", "a message for node %u dropped: no direct link to it (%s)", node,
                       o == NULL ? "no memory" : "it announced no port for job peers");
        free(o);
        return;
    }
    o->node = node;
    o->since_ns = sd_now_ns();
    const char *job = sd_meet__job_of(m);
    snprintf(o->job, sizeof(o->job), "%s", job != NULL ? job : "");
    uint32_t queued = 0;
    struct outmsg **tail = &cl->peers.outbox;
    for (; *tail != NULL; tail = &(*tail)->next)
        queued += (*tail)->node == node;
    if (queued >= OUTBOX_MAX) { /* (a peer that never answers: its oldest goes) */
        for (struct outmsg **pp = &cl->peers.outbox; *pp; pp = &(*pp)->next)
            if ((*pp)->node == node) {
                struct outmsg *old = *pp;
                SD_WARN_SPARSE("cluster",
                               "%u messages wait for a link to node %u: the oldest (job "
                               "'%.64s') dropped",
                               queued, node, old->job);
                *pp = old->next;
                if (tail == &old->next)
                    tail = pp;
                free(old->frame);
                free(old);
                break;
            }
    }
    *tail = o;
    dial(cl, node);
}

/* node's direct link is up: what waited for it goes, in order */
static void outbox_flush(struct sd_cluster *cl, uint32_t node)
{
    for (struct outmsg **pp = &cl->peers.outbox; *pp;) {
        struct outmsg *o = *pp;
        if (o->node != node) {
            pp = &o->next;
            continue;
        }
        *pp = o->next;
        if (cl->indep) /* (its job proved on the link first) */
            sd_meet__flush(cl->by_node[node], o->job, o->frame, o->len);
        else
            sd_cluster__link_write(cl->by_node[node], o->frame, o->len);
        free(o);
    }
}

void sd_cluster__outbox_drop(struct sd_cluster *cl, uint32_t node, const char *why)
{
    uint32_t n = 0;
    for (struct outmsg **pp = &cl->peers.outbox; *pp;) {
        struct outmsg *o = *pp;
        if (node != SD_NO_NODE && o->node != node) {
            pp = &o->next;
            continue;
        }
        *pp = o->next;
        free(o->frame);
        free(o);
        n++;
    }
    if (n > 0 && node != SD_NO_NODE)
        SD_WARN_SPARSE("cluster", "%u message(s) for node %u dropped: %s", n, node, why);
}

/* FNV-1a */
static uint32_t name_hash(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

uint32_t sd_cluster__job_coordinator(const struct sd_cluster *cl, const char *job)
{
    if (cl->indep) /* the job's leader, its ranks said */
        return sd_meet__leader(cl, job);
    uint32_t count = 0;
    for (uint32_t i = 1; i < cl->n; i++)
        count += cl->alive[i] || i == cl->self;
    if (count == 0)
        return SD_NO_NODE;
    uint32_t k = name_hash(job) % count;
    for (uint32_t i = 1; i < cl->n; i++)
        if ((cl->alive[i] || i == cl->self) && k-- == 0)
            return i;
    return SD_NO_NODE;
}

/* A member: does the coordinator's table fit (a fixed cluster's has its nodes; an open one's
 * may have grown, and says which node this one is)? This node takes its number then. A table
 * that lacks a job peer this node has a direct link to (a coordinator that restarted, which
 * that peer has not rejoined yet) keeps it. */
bool sd_cluster__table_fits(struct sd_cluster *cl, const Shard__PeerTable *t)
{
    if (!cl->open)
        return t->n_fabric_addrs == cl->n;
    uint32_t n = (uint32_t)t->n_fabric_addrs;
    if (n < 2 || n > cl->cap || t->you == 0 || t->you >= n || t->n_hb_ports < n) {
        SD_WARN_SPARSE("cluster", "an address table of %u nodes naming this one node %u: ignored",
                       n, t->you);
        return false;
    }
    if (t->you != cl->self) {
        if (cl->self != SD_NO_NODE)
            SD_WARN("cluster", "the coordinator numbers this daemon node %u now (it was %u)",
                    t->you, cl->self);
        else
            SD_INFO("cluster", "the coordinator numbered this daemon node %u", t->you);
        cl->self = t->you;
        cl->tp->self = t->you;
        sd_heartbeat_set_self(cl->hb, t->you);
        memcpy(cl->addrs[cl->self], cl->me.addr, cl->me.addr_len);
        cl->addr_len[cl->self] = cl->me.addr_len;
        cl->hb_port[cl->self] = cl->me.hb_port;
    }
    uint32_t keep = n;
    for (uint32_t i = n; i < cl->n; i++) /* (a coordinator that restarted has fewer) */
        if (sd_cluster__job_peer_up(cl, i))
            keep = i + 1;
        else
            cl->present[i] = cl->alive[i] = false;
    cl->n = keep;
    return true;
}

/* A member installs the coordinator's table t: its addresses, down flags and peer listeners,
 * but a job peer whose direct link is up keeps its address and stays up whatever t says. After
 * a rejoin the fabric connections to every other node close (they may be a previous
 * incarnation's, or the other end may have dropped them when it was told this node was down). */
void sd_cluster__member_table(struct sd_cluster *cl, struct link *l, const Shard__PeerTable *t)
{
    bool rejoined = cl->rejoining;
    for (uint32_t i = 0; i < cl->n; i++) {
        bool listed = i < t->n_fabric_addrs;
        bool down = !listed || (t->n_down == t->n_fabric_addrs && t->down[i]);
        if (sd_cluster__job_peer_up(cl, i) && (down || t->fabric_addrs[i].len == 0)) {
            cl->down_scratch[i] = false;
            continue;
        }
        cl->down_scratch[i] = down;
        size_t len = listed ? SD_MIN(t->fabric_addrs[i].len, sizeof(cl->addrs[0])) : 0;
        if (len > 0) /* (a number nobody holds has no address) */
            memcpy(cl->addrs[i], t->fabric_addrs[i].data, len);
        cl->addr_len[i] = len;
        const char *pa = i < t->n_peer_addrs && t->peer_addrs[i] ? t->peer_addrs[i] : "";
        snprintf(cl->peers.addrs[i], SD_PEER_ADDR, "%s", strlen(pa) < SD_PEER_ADDR ? pa : "");
        if (i != cl->self && i < t->n_hb_ports)
            cl->hb_port[i] = t->hb_ports[i];
    }
    l->node = 0;
    sd_cluster__hb_peer(cl, 0, l, cl->hb_port[0]); /* a member's peer for good: the coordinator */
    if (sd_cluster__install_table(cl, cl->down_scratch) != SD_OK) {
        cl->fatal = true;
        return;
    }
    for (uint32_t i = 0; rejoined && cl->tp->ops->peer_reset != NULL && i < cl->n; i++)
        if (i != cl->self && cl->alive[i] && !sd_cluster__job_peer_up(cl, i))
            (void)cl->tp->ops->peer_reset(cl->tp, i);
}

/* What a job peer may say on its direct link: heartbeats, the messages of the jobs that span it
 * here (from itself), and a registration's report, abort or decision to or from the member that
 * decides it without the coordinator (sd_cluster__job_coordinator); what only the coordinator
 * says (tables, a node's failure, the end of a job) it may not. Else logged and dropped. */
bool sd_cluster__peer_heard(struct link *l, const Shard__PeerMsg *m)
{
    struct sd_cluster *cl = l->cl;
    uint32_t from = (uint32_t)l->node;
    const char *job = sd_cluster__relayed_job(m); /* a job message of a job spanning both */
    const char *named = NULL;                     /* a registration's (for the log) */
    uint32_t tag = 0;
    bool ok = false;
    /* who decides registrations without the coordinator: only while this node has none */
    uint32_t jc = SD_NO_NODE;
    const char *reg = m->msg_case == SHARD__PEER_MSG__MSG_JOB_REPORT    ? m->job_report->job
                      : m->msg_case == SHARD__PEER_MSG__MSG_JOB_CONFIRM ? m->job_confirm->job
                      : m->msg_case == SHARD__PEER_MSG__MSG_JOB_REFUSE  ? m->job_refuse->job
                      : m->msg_case == SHARD__PEER_MSG__MSG_JOB_ABORT   ? m->job_abort->job
                                                                        : NULL;
    if (reg != NULL && !sd_cluster__coordinator_up(cl))
        jc = sd_cluster__job_coordinator(cl, reg);
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_HEARTBEAT:
    case SHARD__PEER_MSG__MSG_BYE:
        ok = true;
        break;
    case SHARD__PEER_MSG__MSG_JOB_LEFT:
        job = m->job_left->node == from ? m->job_left->job : NULL;
        break;
    case SHARD__PEER_MSG__MSG_JOB_ABORT: /* (of a registration: to the member deciding it) */
        job = m->job_abort->origin == from ? m->job_abort->job : NULL;
        tag = m->job_abort->tag;
        ok = job != NULL && tag == 0 && jc == cl->self;
        break;
    case SHARD__PEER_MSG__MSG_JOB_REPORT: /* without the coordinator, to the member deciding */
        ok = m->job_report->node == from && jc == cl->self;
        named = m->job_report->job;
        break;
    case SHARD__PEER_MSG__MSG_JOB_CONFIRM: /* from the member that decided */
        ok = jc == from;
        named = m->job_confirm->job;
        break;
    case SHARD__PEER_MSG__MSG_JOB_REFUSE:
        ok = jc == from;
        named = m->job_refuse->job;
        break;
    default:
        break;
    }
    ok = ok || (job != NULL && cl->ev.job_spans(cl->ev.ctx, job, tag, from));
    if (!ok && m->msg_case == SHARD__PEER_MSG__MSG_JOB_LEFT && job != NULL)
        return false; /* (a job the coordinator's JobEnd ended here first: nothing to say) */
    static uint64_t logged_ms[32]; /* once in 5 s per kind of message */
    uint64_t *last = &logged_ms[(unsigned)m->msg_case % 32];
    if (!ok && SD_LOG_WARN <= sd_log_level && sd_log_ratelimit(last, 5000))
        sd_log_write(SD_LOG_WARN, "cluster",
                     "node %d's direct link carried a message (kind %d) that is not its to send "
                     "here (no job of %s spans both, or only the coordinator says it): dropped",
                     l->node, (int)m->msg_case,
                     job != NULL     ? job
                     : named != NULL ? named
                                     : "it");
    return ok;
}

/* ---- member: direct links to the job peers */

/* which end opened l, ranked alike at both ends: its node, or an independent daemon's id
 * (each numbers the other its own way) */
static int64_t opener(const struct link *l, const struct sd_cluster *cl)
{
    if (cl->indep)
        return l->incoming ? cl->meet.uid_of[l->node] : cl->meet.uid;
    return l->incoming ? l->node : (int)cl->self;
}

void sd_cluster__adopt_peer(struct link *l, uint32_t node)
{
    struct sd_cluster *cl = l->cl;
    struct link *old = cl->by_node[node];
    l->node = (int)node;
    l->peer = true;
    if (old != NULL && old != l) {
        /* two links between the same members (both dialed at once, or one reconnected): the
         * one the lower node opened stays, both ends deciding alike; of two it opened, the new */
        int64_t lower = cl->indep ? SD_MIN(cl->meet.uid_of[node], cl->meet.uid)
                                  : (int64_t)SD_MIN(node, cl->self);
        struct link *loser = opener(l, cl) != opener(old, cl) && opener(old, cl) == lower ? l : old;
        if (loser == l) {
            cl->peers.dialing[node] = false; /* (l may be this end's dial) */
            sd_cluster__link_bye(l, "replaced by another link", "another link to the node stays");
            return;
        }
        cl->by_node[node] = NULL; /* (closing old does not fail its jobs) */
        sd_cluster__link_bye(old, "replaced by another link", "replaced by another link");
    }
    cl->by_node[node] = l;
    cl->peers.dialing[node] = false;
    cl->peers.idle_ns[node] = 0;
    cl->peers.dial_fails[node] = 0;
    cl->peers.dial_why[node][0] = '\0';
    sd_cluster__hb_peer(cl, node, l, cl->hb_port[node]);
    outbox_flush(cl, node);
    SD_INFO("cluster", "direct link with node %u (a job peer) up", node);
}

void sd_cluster__on_peer_hello(struct link *l, const Shard__PeerHello *h)
{
    struct sd_cluster *cl = l->cl;
    if (!sd_cluster__hello_authentic(l, h))
        return;
    uint32_t node = h->node;
    if (!h->peer) {
        sd_cluster__refuse(l,
                           "this daemon is node %u, a member: a daemon joins the cluster at the "
                           "coordinator (%s)",
                           cl->self, cl->cfg->coordinator);
        return;
    }
    if (!cl->ready || node == 0 || node >= cl->n || node == cl->self || !cl->present[node]) {
        sd_cluster__refuse(
            l,
            "a direct link from node %u, which is not a member this node knows (it has "
            "%u nodes)",
            node, cl->n);
        return;
    }
    /* from the address the coordinator knows that node by (its link to it) */
    char from[SD_PEER_ADDR];
    sd_cluster__link_host(l, from, sizeof(from));
    size_t host = strcspn(cl->peers.addrs[node], ":");
    if (host > 0 && (strlen(from) != host || strncmp(from, cl->peers.addrs[node], host) != 0)) {
        sd_cluster__refuse(l, "a direct link as node %u from %s, which is not node %u's address",
                           node, from, node);
        return;
    }
    if (h->protocol_version != SD_PROTOCOL_VERSION || h->config_digest != cl->digest ||
        h->fabric_addr.len != cl->addr_len[node] ||
        memcmp(h->fabric_addr.data, cl->addrs[node], cl->addr_len[node]) != 0) {
        sd_cluster__refuse(
            l,
            "a direct link from node %u whose version, configuration or fabric address "
            "differs from the coordinator's table",
            node);
        return;
    }
    sd_cluster__adopt_peer(l, node);
}

void sd_cluster__link_bye(struct link *l, const char *reason, const char *why)
{
    Shard__PeerBye b = SHARD__PEER_BYE__INIT;
    b.reason = (char *)reason;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_BYE;
    m.bye = &b;
    l->retired = true;
    sd_cluster__link_send(l, &m);
    sd_cluster__link_close(l, why);
}

void sd_cluster__dial_failed(struct sd_cluster *cl, uint32_t node, const char *why)
{
    if (node >= cl->cap)
        return;
    cl->peers.dial_fails[node]++;
    snprintf(cl->peers.dial_why[node], sizeof(cl->peers.dial_why[0]), "%s", why);
}

static void peer_connect_cb(uv_connect_t *req, int status)
{
    struct link *l = req->data;
    if (status < 0) {
        SD_WARN_SPARSE("cluster", "a direct link to node %d (a job peer) at %s: %s", l->node,
                       l->cl->peers.addrs[l->node], uv_strerror(status));
        l->retired = true;
        sd_cluster__link_close(l, uv_strerror(status));
        return;
    }
    uv_tcp_nodelay(&l->tcp, 1);
    sd_cluster__read_start(l); /* its challenge comes first */
}

static void dial(struct sd_cluster *cl, uint32_t node)
{
    if (cl->peers.dialing[node] || cl->by_node[node] != NULL) /* (one link at a time) */
        return;
    struct sockaddr_storage ss;
    if (sd_cluster__parse_hostport(cl->peers.addrs[node], &ss) != SD_OK)
        return;
    /* an independent daemon's link proves a job's token: the first message's, or a job's
     * that spans the node */
    const char *job = NULL;
    uint8_t token[SD_JOB_TOKEN_BYTES];
    for (const struct outmsg *o = cl->peers.outbox; cl->indep && o && job == NULL; o = o->next)
        if (o->node == node && o->job[0] != '\0' && cl->ev.job_token(cl->ev.ctx, o->job, token))
            job = o->job; /* (one of a job still here: a gone job's would be refused) */
    if (cl->indep && job == NULL)
        job = cl->ev.job_spanning(cl->ev.ctx, node);
    if (cl->indep && job == NULL)
        return;
    struct link *l = sd_cluster__link_new(cl);
    if (job != NULL)
        snprintf(l->job, sizeof(l->job), "%s", job);
    l->peer = true;
    l->node = (int)node;
    l->conn.data = l;
    cl->peers.dialing[node] = true;
    if (uv_tcp_connect(&l->conn, &l->tcp, (struct sockaddr *)&ss, peer_connect_cb) != 0) {
        l->retired = true;
        sd_cluster__link_close(l, "connect failed");
    }
}

/* An independent daemon: what waits for a daemon not listening yet (a leader whose ranks have
 * not registered) is dialed for again, until the registration's deadline. */
static void meet_outbox(struct sd_cluster *cl, uint64_t now)
{
    uint64_t deadline = 2 * (uint64_t)cl->cfg->register_timeout_ms * 1000000ULL;
    uint8_t token[SD_JOB_TOKEN_BYTES];
    /* (messages for a daemon whose link is up: those a renumbered dial handed to its slot) */
    for (struct outmsg *o = cl->peers.outbox; o;) {
        if (sd_cluster__job_peer_up(cl, o->node)) {
            outbox_flush(cl, o->node);
            o = cl->peers.outbox;
            continue;
        }
        o = o->next;
    }
    for (struct outmsg **pp = &cl->peers.outbox; *pp;) {
        struct outmsg *o = *pp;
        /* a message about a job no longer here (its registration failed or it ended) goes:
         * nothing redials for it, and it does not hold up the next job's */
        bool gone = o->job[0] != '\0' && !cl->ev.job_token(cl->ev.ctx, o->job, token);
        if (now - o->since_ns > deadline || gone) {
            if (gone)
                SD_INFO("cluster",
                        "a message about job '%s' for node %u (%s) dropped: the job "
                        "is not here any more",
                        o->job, o->node, cl->peers.addrs[o->node]);
            else
                SD_WARN("cluster",
                        "a message about job '%s' for node %u (%s) dropped: no link "
                        "to it",
                        o->job, o->node, cl->peers.addrs[o->node]);
            *pp = o->next;
            free(o->frame);
            free(o);
            continue;
        }
        dial(cl, o->node);
        pp = &o->next;
    }
}

void sd_cluster__peer_links(struct sd_cluster *cl, uint64_t now)
{
    if (cl->self == 0 || cl->self == SD_NO_NODE || !cl->ready || cl->stopping)
        return;
    memset(cl->peers.need, 0, cl->n * sizeof(*cl->peers.need));
    cl->ev.nodes_in_use(cl->ev.ctx, cl->peers.need, cl->n);
    if (cl->indep)
        meet_outbox(cl, now);
    for (uint32_t i = 1; i < cl->n; i++) {
        if (i == cl->self)
            continue;
        struct link *l = cl->by_node[i];
        /* (an independent daemon's peer is up once a link proved it) */
        bool need = (cl->indep ? cl->addr_len[i] > 0 : cl->alive[i]) && cl->peers.need[i];
        if (need)
            dial(cl, i);
        if (l == NULL || !l->peer)
            continue;
        /* the end that opened it closes it (the other, if it still needs one, opens another:
         * a link is not closed under a job) */
        if (need || l->incoming) {
            cl->peers.idle_ns[i] = 0;
        } else if (cl->peers.idle_ns[i] == 0) {
            cl->peers.idle_ns[i] = now;
        } else if (now - cl->peers.idle_ns[i] > (uint64_t)SD_PEER_IDLE_MS * 1000000ULL) {
            SD_INFO("cluster", "direct link with node %u closed: no job needs it", i);
            sd_cluster__link_bye(l, "no job needs it", "no job needs it");
        }
    }
}

static void listener_closed(uv_handle_t *h)
{
    memset(h, 0, sizeof(uv_tcp_t)); /* (loop NULL: no listener) */
}

/* A member listens for its job peers' direct links on host (its fabric address: the one it
 * reaches the coordinator from) at peer_port; without it, its jobs' messages go through the
 * coordinator only (and do not outlive it). */
int sd_cluster__listen_peers(struct sd_cluster *cl, const char *host, uint32_t port)
{
    struct sockaddr_in sa;
    if (uv_ip4_addr(host[0] != '\0' ? host : "0.0.0.0", (int)port, &sa) != 0 &&
        uv_ip4_addr("0.0.0.0", (int)port, &sa) != 0)
        return UV_EINVAL;
    if (cl->listener.loop != NULL) /* (a bind that failed: its handle closes, a new one tries) */
        return UV_EBUSY;
    uv_tcp_init(cl->loop, &cl->listener);
    cl->listener.data = cl;
    int r = uv_tcp_bind(&cl->listener, (const struct sockaddr *)&sa, 0);
    if (r == 0)
        r = uv_listen((uv_stream_t *)&cl->listener, SD_LISTEN_BACKLOG, sd_cluster__on_connection);
    struct sockaddr_in bound;
    int len = sizeof(bound);
    if (r == 0)
        r = uv_tcp_getsockname(&cl->listener, (struct sockaddr *)&bound, &len);
    if (r != 0) {
        uv_close((uv_handle_t *)&cl->listener, listener_closed);
        return r;
    }
    cl->me.peer_port = ntohs(bound.sin_port);
    return 0;
}

/* every node of l left or is down: the job ends here */
static void member_left_check(struct sd_cluster *cl, struct coord_left *l)
{
    sd_cluster__left_mark_down(cl, l);
    if (l->left < l->nodes)
        return;
    char job[64];
    snprintf(job, sizeof(job), "%s", l->name);
    sd_cluster__left_drop(cl, l);
    sd_cluster__live_end(cl, job); /* (a job this member decided without the coordinator) */
    cl->ev.job_ended(cl->ev.ctx, job);
}

void sd_cluster__member_left(struct sd_cluster *cl, const char *name, uint32_t node,
                             const uint32_t *ids, uint32_t n)
{
    struct coord_left *l = sd_cluster__left_note(cl, name, node, ids, n);
    if (l != NULL)
        member_left_check(cl, l);
}

void sd_cluster__member_gone(struct sd_cluster *cl, uint32_t node)
{
    for (struct coord_left *l = cl->track.lefts, *next; l; l = next) {
        next = l->next;
        sd_cluster__left_mark(l, node);
        member_left_check(cl, l);
    }
}

void sd_cluster__member_ended(struct sd_cluster *cl, const char *name)
{
    sd_cluster__live_end(cl, name);
    for (struct coord_left *l = cl->track.lefts; l; l = l->next)
        if (strcmp(l->name, name) == 0) {
            sd_cluster__left_drop(cl, l);
            return;
        }
}

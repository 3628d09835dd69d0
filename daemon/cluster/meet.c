/* Independent daemons (DESIGN.md section 6, "daemons that meet per job"): a daemon started
 * without a cluster (nodes 1) knows only itself (a random id per start, its fabric address, its
 * heartbeat and peer ports) and meets the daemons of each job it serves when the job registers.
 * The job's leader is the daemon of rank 0's node: its ranks name it (Register.leader, from the
 * launcher's rendezvous) and every other node of the job dials it on its peer port, proving the
 * job's token (the HMAC key of the handshake, in place of a cluster's secret). The leader
 * decides the registration with the coordinator's own code (coordinator.c) and answers with
 * the job's node table: each node's id, fabric address, peer listener and heartbeat port, from
 * which every node opens its direct links to the others (peers.c) and fills its fabric's table.
 *
 * Each daemon numbers the daemons it meets its own way (slots of its table; it is slot 1, slot 0
 * is never used): on the wire, messages name daemons by their ids (translated here both ways),
 * and each end of a link tells the other the number it gives it, which the heartbeats, the
 * probes and the fabric's clear-to-sends name their sender by. A link is heard for a job only
 * once the other end proved that job's token: its handshake proves one; before its first
 * message about another, an end sends a JobProof. So a daemon that is not one of a job's
 * cannot join it, speak for it, or declare one of its nodes down: what it could do to the
 * job's data path is dropped by the fabric, which hears only the addresses in the table. */
#include "cluster/cluster_int.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <sys/random.h>
#include <unistd.h>

struct meet_leader {
    struct meet_leader *next;
    char name[64];
    uint32_t slot;
};

struct meet_proof {
    struct meet_proof *next;
    char job[64];
};

/* A proof of a job that is not registered here yet (its ranks here come a moment later than
 * the other node's): kept with the messages about the job that followed it, until the job's
 * token is here to check it, or the registration's deadline. */
#define MEET_WAIT_MSGS 64
struct meet_wait {
    struct meet_wait *next;
    char job[64];
    uint8_t mac[SD_SHA256_BYTES];
    uint64_t since_ns;
    uint32_t n;
    uint8_t *msg[MEET_WAIT_MSGS]; /* packed PeerMsgs, in order */
    size_t len[MEET_WAIT_MSGS];
};

/* a message's copy with daemons named by their ids (sd_meet__send) */
struct meet_wire {
    Shard__PeerMsg m;
    union {
        Shard__JobReport rep;
        Shard__JobConfirm conf;
        Shard__JobAbort abort;
        Shard__JobLeft left;
        Shard__JobRecover rec;
    } u;
    uint32_t ids[SD_MAX_NODES];
    ProtobufCBinaryData fab[SD_MAX_NODES];
    char *pa[SD_MAX_NODES];
    uint32_t hb[SD_MAX_NODES];
};

#define MEET_MAX_LEADERS 256

static void leader_note(struct sd_cluster *cl, const char *job, uint32_t slot);

int sd_meet__init(struct sd_cluster *cl)
{
    cl->meet.uid_of = calloc(cl->cap, sizeof(*cl->meet.uid_of));
    cl->meet.as = calloc(cl->cap, sizeof(*cl->meet.as));
    cl->meet.wire = calloc(1, sizeof(*cl->meet.wire));
    if (cl->meet.uid_of == NULL || cl->meet.as == NULL || cl->meet.wire == NULL)
        return SD_ENOMEM;
    while (cl->meet.uid == 0 || cl->meet.uid == SD_NO_NODE)
        if (getrandom(&cl->meet.uid, sizeof(cl->meet.uid), 0) != sizeof(cl->meet.uid))
            return SD_EIO;
    for (uint32_t i = 0; i < cl->cap; i++)
        cl->meet.as[i] = SD_NO_NODE; /* (told at each link's handshake) */
    cl->meet.slots = cl->cap;
#ifdef SD_TEST_HOOKS /* tests only: fewer slots, which the daemons met must reuse */
    const char *slots = getenv("SHARDD_TEST_MEET_SLOTS");
    if (slots != NULL && strtoul(slots, NULL, 10) >= 3)
        cl->meet.slots = (uint32_t)SD_MIN(strtoul(slots, NULL, 10), cl->cap);
#endif
    cl->tp->self_as = cl->meet.as;
    return SD_OK;
}

int sd_meet__start(struct sd_cluster *cl)
{
    for (uint32_t i = 0; i < cl->cap; i++) /* (every slot but its own empty) */
        cl->down_scratch[i] = i != cl->self;
    int st = sd_cluster__install_table(cl, cl->down_scratch);
    for (uint32_t i = 0; i < cl->cap; i++)
        cl->present[i] = i == cl->self;
    if (st == SD_OK)
        SD_INFO("cluster",
                "an independent daemon (id %08x): it meets the daemons of each job that spans "
                "nodes, through the job's leader",
                cl->meet.uid);
    return st;
}

void sd_meet__free(struct sd_cluster *cl)
{
    while (cl->meet.leaders != NULL) {
        struct meet_leader *l = cl->meet.leaders;
        cl->meet.leaders = l->next;
        free(l);
    }
    free(cl->meet.uid_of);
    free(cl->meet.as);
    free(cl->meet.wire);
}

static void wait_free(struct meet_wait *w)
{
    for (uint32_t i = 0; i < w->n; i++)
        free(w->msg[i]);
    free(w);
}

void sd_meet__link_free(struct link *l)
{
    while (l->waiting != NULL) {
        struct meet_wait *w = l->waiting;
        l->waiting = w->next;
        wait_free(w);
    }
    struct meet_proof *lists[2] = {l->proved, l->told};
    for (int i = 0; i < 2; i++)
        while (lists[i] != NULL) {
            struct meet_proof *p = lists[i];
            lists[i] = p->next;
            free(p);
        }
    l->proved = l->told = NULL;
}

/* ---- the table: slots by id and by address */

static uint32_t slot_by_uid(const struct sd_cluster *cl, uint32_t uid)
{
    if (uid == cl->meet.uid)
        return cl->self;
    for (uint32_t i = 2; uid != 0 && i < cl->cap; i++)
        if (cl->meet.uid_of[i] == uid)
            return i;
    return SD_NO_NODE;
}

/* A slot of a daemon that is down and that nothing here names any more (no job, no link, no
 * message waiting, no registration it leads), emptied for another: a daemon that restarts
 * comes back under a new id, so a long-lived daemon would otherwise run out of its 1022. */
static uint32_t slot_reclaim(struct sd_cluster *cl)
{
    memset(cl->peers.need, 0, cl->cap * sizeof(*cl->peers.need));
    cl->ev.nodes_in_use(cl->ev.ctx, cl->peers.need, cl->cap);
    for (const struct outmsg *o = cl->peers.outbox; o; o = o->next)
        cl->peers.need[o->node] = true;
    for (const struct meet_leader *l = cl->meet.leaders; l; l = l->next)
        if (l->slot < cl->cap)
            cl->peers.need[l->slot] = true;
    for (uint32_t i = 2; i < cl->meet.slots; i++) {
        /* (one that is up but has no link now is met again when a job names it) */
        if (cl->peers.need[i] || cl->by_node[i] != NULL || cl->peers.dialing[i])
            continue;
        SD_INFO("cluster", "node %u (daemon %08x at %s, %s, no job names it) is free again", i,
                cl->meet.uid_of[i], cl->peers.addrs[i], cl->alive[i] ? "unlinked" : "down");
        cl->alive[i] = false;
        cl->tp->ops->peer_down(cl->tp, i);
        sd_probe_down(cl, i);
        cl->meet.uid_of[i] = 0;
        cl->meet.as[i] = SD_NO_NODE;
        cl->addr_len[i] = 0;
        cl->hb_port[i] = 0;
        cl->present[i] = false;
        cl->peers.addrs[i][0] = '\0';
        return i;
    }
    return SD_NO_NODE;
}

/* a slot no daemon holds (none known, none being dialed) */
static uint32_t slot_new(struct sd_cluster *cl)
{
    for (uint32_t i = 2; i < cl->meet.slots; i++)
        if (cl->meet.uid_of[i] == 0 && cl->peers.addrs[i][0] == '\0' && cl->by_node[i] == NULL &&
            !cl->peers.dialing[i])
            return i;
    return slot_reclaim(cl);
}

/* Slot holds daemon uid (fabric address fab, fab_len bytes; heartbeat port hb; peer listener
 * pa, "" to keep what it has): its fabric address goes into the transport's table. */
static int slot_fill(struct sd_cluster *cl, uint32_t slot, uint32_t uid, const uint8_t *fab,
                     size_t fab_len, uint32_t hb, const char *pa)
{
    if (fab_len == 0 || fab_len > sizeof(cl->addrs[0]))
        return SD_EPROTO;
    cl->meet.uid_of[slot] = uid;
    cl->hb_port[slot] = hb;
    if (pa != NULL && pa[0] != '\0' && strlen(pa) < SD_PEER_ADDR)
        snprintf(cl->peers.addrs[slot], SD_PEER_ADDR, "%s", pa);
    bool same = cl->addr_len[slot] == fab_len && memcmp(cl->addrs[slot], fab, fab_len) == 0;
    if (same)
        return SD_OK;
    memcpy(cl->addrs[slot], fab, fab_len);
    cl->addr_len[slot] = fab_len;
    cl->present[slot] = true;
    return cl->tp->ops->set_peer(cl->tp, slot, fab, fab_len);
}

/* the slot of the daemon listening at addr ("ip:port"), made (its id not known yet) if none */
static uint32_t slot_by_addr(struct sd_cluster *cl, const char *addr)
{
    for (uint32_t i = 2; i < cl->cap; i++)
        if (strcmp(cl->peers.addrs[i], addr) == 0)
            return i;
    uint32_t s = slot_new(cl);
    if (s != SD_NO_NODE)
        snprintf(cl->peers.addrs[s], SD_PEER_ADDR, "%s", addr);
    return s;
}

/* ---- ids on the wire */

static uint32_t to_wire(const struct sd_cluster *cl, uint32_t node)
{
    if (node == cl->self)
        return cl->meet.uid;
    return node < cl->cap ? cl->meet.uid_of[node] : 0;
}

static uint32_t from_wire(const struct sd_cluster *cl, uint32_t uid)
{
    return slot_by_uid(cl, uid);
}

static uint32_t *ids_out(struct sd_cluster *cl, const uint32_t *ids, size_t n)
{
    uint32_t *out = cl->meet.wire->ids;
    for (size_t i = 0; i < n && i < SD_MAX_NODES; i++)
        out[i] = to_wire(cl, ids[i]);
    return out;
}

static void ids_in(const struct sd_cluster *cl, uint32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ids[i] = from_wire(cl, ids[i]);
}

/* a confirmation's node table: each node's addresses, for the nodes that meet it there */
static void confirm_out(struct sd_cluster *cl, Shard__JobConfirm *c)
{
    struct meet_wire *w = cl->meet.wire;
    size_t n = SD_MIN(c->n_nodes, (size_t)SD_MAX_NODES);
    for (size_t i = 0; i < n; i++) {
        uint32_t s = c->nodes[i];
        bool me = s == cl->self, known = s < cl->cap;
        w->fab[i].data = me ? cl->me.addr : known ? cl->addrs[s] : NULL;
        w->fab[i].len = me ? cl->me.addr_len : known ? cl->addr_len[s] : 0;
        w->pa[i] = me || !known ? "" : cl->peers.addrs[s]; /* (its nodes dialed the leader) */
        w->hb[i] = me ? cl->me.hb_port : known ? cl->hb_port[s] : 0;
    }
    c->nodes = ids_out(cl, c->nodes, n);
    c->n_nodes = c->n_fabric_addrs = c->n_peer_addrs = c->n_hb_ports = n;
    c->fabric_addrs = w->fab;
    c->peer_addrs = w->pa;
    c->hb_ports = w->hb;
}

/* m with the daemons it names by their ids (a copy in the cluster's scratch) */
static const Shard__PeerMsg *wire_out(struct sd_cluster *cl, const Shard__PeerMsg *m)
{
    struct meet_wire *w = cl->meet.wire;
    w->m = *m;
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_JOB_REPORT:
        w->u.rep = *m->job_report;
        w->u.rep.node = to_wire(cl, w->u.rep.node);
        w->m.job_report = &w->u.rep;
        break;
    case SHARD__PEER_MSG__MSG_JOB_CONFIRM:
        w->u.conf = *m->job_confirm;
        confirm_out(cl, &w->u.conf);
        w->m.job_confirm = &w->u.conf;
        break;
    case SHARD__PEER_MSG__MSG_JOB_ABORT:
        w->u.abort = *m->job_abort;
        w->u.abort.origin = to_wire(cl, w->u.abort.origin);
        w->u.abort.n_nodes = SD_MIN(w->u.abort.n_nodes, (size_t)SD_MAX_NODES);
        w->u.abort.nodes = ids_out(cl, w->u.abort.nodes, w->u.abort.n_nodes);
        w->m.job_abort = &w->u.abort;
        break;
    case SHARD__PEER_MSG__MSG_JOB_LEFT:
        w->u.left = *m->job_left;
        w->u.left.node = to_wire(cl, w->u.left.node);
        w->u.left.n_nodes = SD_MIN(w->u.left.n_nodes, (size_t)SD_MAX_NODES);
        w->u.left.nodes = ids_out(cl, w->u.left.nodes, w->u.left.n_nodes);
        w->m.job_left = &w->u.left;
        break;
    case SHARD__PEER_MSG__MSG_JOB_RECOVER:
        w->u.rec = *m->job_recover;
        w->u.rec.from = to_wire(cl, w->u.rec.from);
        w->m.job_recover = &w->u.rec;
        break;
    default:
        break;
    }
    return &w->m;
}

/* The daemons a confirmation names, met here: each one not known yet gets a slot and its
 * addresses. False (logged) if one cannot be. */
static bool confirm_in(struct sd_cluster *cl, Shard__JobConfirm *c)
{
    bool whole = c->n_fabric_addrs == c->n_nodes && c->n_peer_addrs == c->n_nodes &&
                 c->n_hb_ports == c->n_nodes && c->n_nodes <= SD_MAX_NODES;
    for (size_t i = 0; whole && i < c->n_nodes; i++) {
        uint32_t s = slot_by_uid(cl, c->nodes[i]);
        if (s == SD_NO_NODE) {
            s = c->nodes[i] != 0 && c->peer_addrs[i][0] != '\0' ? slot_new(cl) : SD_NO_NODE;
            if (s == SD_NO_NODE ||
                slot_fill(cl, s, c->nodes[i], c->fabric_addrs[i].data, c->fabric_addrs[i].len,
                          c->hb_ports[i], c->peer_addrs[i]) != SD_OK) {
                SD_WARN("cluster",
                        "job '%.64s': its leader's table names daemon %08x (job node %zu) "
                        "without an address this daemon can use",
                        c->job, c->nodes[i], i);
                return false;
            }
        }
        c->nodes[i] = s;
    }
    if (!whole)
        SD_WARN("cluster", "job '%.64s': its leader's table is malformed", c->job);
    return whole;
}

/* ---- proofs of a job's token on a link */

static bool proof_has(const struct meet_proof *p, const char *job)
{
    for (; p; p = p->next)
        if (strcmp(p->job, job) == 0)
            return true;
    return false;
}

static void proof_add(struct meet_proof **list, const char *job)
{
    struct meet_proof *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return;
    snprintf(p->job, sizeof(p->job), "%s", job);
    p->next = *list;
    *list = p;
}

/* HMAC keyed by the job's token over a label, both nonces, the job and which end speaks */
static void proof_mac(const uint8_t *token, const struct link *l, const char *job, bool by_dialer,
                      uint8_t out[SD_SHA256_BYTES])
{
    static const char label[] = "shardd job proof";
    uint8_t dir = by_dialer;
    struct sd_hmac h;
    sd_hmac_init(&h, token, SD_JOB_TOKEN_BYTES);
    sd_hmac_update(&h, label, sizeof(label));
    sd_hmac_update(&h, l->nonce_c, SD_AUTH_NONCE);
    sd_hmac_update(&h, l->nonce_m, SD_AUTH_NONCE);
    sd_hmac_update(&h, job, strlen(job) + 1);
    sd_hmac_update(&h, &dir, 1);
    sd_hmac_final(&h, out);
}

/* The job m is about (NULL: none, a link's own message). */
static const char *job_of(const Shard__PeerMsg *m)
{
    const char *job = sd_cluster__relayed_job(m);
    if (job != NULL)
        return job;
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_JOB_REPORT:
        return m->job_report->job;
    case SHARD__PEER_MSG__MSG_JOB_CONFIRM:
        return m->job_confirm->job;
    case SHARD__PEER_MSG__MSG_JOB_REFUSE:
        return m->job_refuse->job;
    case SHARD__PEER_MSG__MSG_JOB_ABORT:
        return m->job_abort->job;
    case SHARD__PEER_MSG__MSG_JOB_LEFT:
        return m->job_left->job;
    case SHARD__PEER_MSG__MSG_JOB_END:
        return m->job_end->job;
    default:
        return NULL;
    }
}

/* This end proves job's token on l, once per link, before its first message about it. False:
 * this daemon has no token for job (m is not sent). */
static bool prove(struct link *l, const char *job)
{
    struct sd_cluster *cl = l->cl;
    if (proof_has(l->told, job))
        return true;
    uint8_t token[SD_JOB_TOKEN_BYTES], mac[SD_SHA256_BYTES];
    if (!cl->ev.job_token(cl->ev.ctx, job, token)) {
        SD_WARN_SPARSE("cluster",
                       "a message about job '%.64s' for node %d not sent: no job of that name "
                       "with a token is here",
                       job, l->node);
        return false;
    }
    proof_mac(token, l, job, !l->incoming, mac);
    Shard__JobProof p = SHARD__JOB_PROOF__INIT;
    p.job = (char *)job;
    p.mac.data = mac;
    p.mac.len = sizeof(mac);
    Shard__PeerMsg pm = SHARD__PEER_MSG__INIT;
    pm.msg_case = SHARD__PEER_MSG__MSG_JOB_PROOF;
    pm.job_proof = &p;
    size_t len = 0;
    uint8_t *frame = sd_cluster__frame(&pm, &len);
    sd_cluster__link_write(l, frame, len);
    proof_add(&l->told, job);
    return true;
}

void sd_meet__send(struct link *l, const Shard__PeerMsg *m)
{
    const char *job = job_of(m);
    if (job != NULL && !prove(l, job))
        return;
    size_t len;
    uint8_t *frame = sd_cluster__frame(wire_out(l->cl, m), &len);
    sd_cluster__link_write(l, frame, len);
}

uint8_t *sd_meet__frame(struct sd_cluster *cl, const Shard__PeerMsg *m, size_t *len_p)
{
    return sd_cluster__frame(wire_out(cl, m), len_p);
}

void sd_meet__flush(struct link *l, const char *job, uint8_t *frame, size_t len)
{
    if (job[0] != '\0' && !prove(l, job)) {
        free(frame);
        return;
    }
    sd_cluster__link_write(l, frame, len);
}

static struct meet_wait *wait_find(struct link *l, const char *job)
{
    for (struct meet_wait *w = l->waiting; w; w = w->next)
        if (strcmp(w->job, job) == 0)
            return w;
    return NULL;
}

/* the other end's proof of job (mac): heard, or false (logged) */
static bool proof_check(struct link *l, const char *job, const uint8_t *mac)
{
    struct sd_cluster *cl = l->cl;
    uint8_t token[SD_JOB_TOKEN_BYTES], want[SD_SHA256_BYTES];
    bool ok = cl->ev.job_token(cl->ev.ctx, job, token);
    if (ok) {
        proof_mac(token, l, job, l->incoming, want);
        ok = sd_mem_equal(want, mac, SD_SHA256_BYTES);
    }
    if (ok)
        proof_add(&l->proved, job);
    else
        SD_WARN_SPARSE("cluster",
                       "node %d did not prove job '%.64s''s token (not one of its nodes): its "
                       "messages about it are not heard",
                       l->node, job);
    return ok;
}

/* A proof of a job not registered here yet: kept (one per job and link) for when it is. */
static void proof_wait(struct link *l, const Shard__JobProof *p)
{
    struct meet_wait *w = wait_find(l, p->job);
    if (w == NULL) {
        uint32_t n = 0;
        for (struct meet_wait *o = l->waiting; o; o = o->next)
            n++;
        if (n >= 16 || (w = calloc(1, sizeof(*w))) == NULL) {
            SD_WARN_SPARSE("cluster",
                           "node %d proved %u jobs that are not here: job '%.64s''s proof "
                           "dropped",
                           l->node, n, p->job);
            return;
        }
        snprintf(w->job, sizeof(w->job), "%s", p->job);
        w->next = l->waiting;
        l->waiting = w;
    }
    memcpy(w->mac, p->mac.data, SD_SHA256_BYTES);
    w->since_ns = sd_now_ns();
}

/* a message about w's job, kept until its proof is checked */
static void wait_keep(struct link *l, struct meet_wait *w, const Shard__PeerMsg *m)
{
    size_t len = protobuf_c_message_get_packed_size(&m->base);
    uint8_t *buf = w->n < MEET_WAIT_MSGS ? malloc(len) : NULL;
    if (buf == NULL) {
        SD_WARN_SPARSE("cluster", "node %d: a message about job '%.64s', not here yet, dropped",
                       l->node, w->job);
        return;
    }
    protobuf_c_message_pack(&m->base, buf);
    w->msg[w->n] = buf;
    w->len[w->n++] = len;
}

/* the proofs that waited on l for their jobs: checked once the job is here (and its messages
 * heard, in order), dropped after deadline_ns */
static void wait_check(struct link *l, uint64_t now, uint64_t deadline_ns)
{
    struct sd_cluster *cl = l->cl;
    uint8_t token[SD_JOB_TOKEN_BYTES];
    for (struct meet_wait **pp = &l->waiting; *pp;) {
        struct meet_wait *w = *pp;
        bool here = cl->ev.job_token(cl->ev.ctx, w->job, token);
        if (!here && now - w->since_ns <= deadline_ns) {
            pp = &w->next;
            continue;
        }
        *pp = w->next;
        if (!here)
            SD_WARN("cluster",
                    "node %d proved job '%.64s', which did not register here in time: its %u "
                    "message(s) dropped",
                    l->node, w->job, w->n);
        else if (proof_check(l, w->job, w->mac))
            for (uint32_t i = 0; i < w->n && !l->closing; i++) {
                Shard__PeerMsg *m = shard__peer_msg__unpack(NULL, w->len[i], w->msg[i]);
                if (m != NULL)
                    sd_cluster__on_message(l, m);
                shard__peer_msg__free_unpacked(m, NULL);
            }
        wait_free(w);
        if (l->closing)
            return;
        pp = &l->waiting; /* (the replay may have changed the list) */
    }
}

void sd_meet__tick(struct sd_cluster *cl, uint64_t now)
{
    uint64_t deadline = 2 * (uint64_t)cl->cfg->register_timeout_ms * 1000000ULL;
    for (struct link *l = cl->links, *next; l; l = next) {
        next = l->next;
        if (l->waiting != NULL)
            wait_check(l, now, deadline);
    }
}

bool sd_meet__receive(struct link *l, Shard__PeerMsg *m)
{
    struct sd_cluster *cl = l->cl;
    if (m->msg_case == SHARD__PEER_MSG__MSG_JOB_PROOF) {
        const Shard__JobProof *p = m->job_proof;
        uint8_t token[SD_JOB_TOKEN_BYTES];
        if (p->job[0] == '\0' || strlen(p->job) >= 64 || p->mac.len != SD_SHA256_BYTES)
            SD_WARN_SPARSE("cluster", "node %d sent a malformed proof: dropped", l->node);
        else if (!cl->ev.job_token(cl->ev.ctx, p->job, token)) /* (its ranks here come later) */
            proof_wait(l, p);
        else
            (void)proof_check(l, p->job, p->mac.data);
        return false;
    }
    const char *job = job_of(m);
    struct meet_wait *w = job != NULL && !proof_has(l->proved, job) ? wait_find(l, job) : NULL;
    if (w != NULL) {
        wait_keep(l, w, m);
        return false;
    }
    if (job != NULL && !proof_has(l->proved, job)) {
        SD_WARN_SPARSE("cluster",
                       "node %d sent a message about job '%.64s' (kind %d) without proving the "
                       "job's token on its link: dropped",
                       l->node, job, (int)m->msg_case);
        return false;
    }
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_JOB_REPORT:
        /* (a node may report before this one's ranks did: it named this daemon the leader,
         * and proved the job's token) */
        m->job_report->node = from_wire(cl, m->job_report->node);
        if (sd_meet__leader(cl, job) == SD_NO_NODE)
            leader_note(cl, job, cl->self);
        break;
    case SHARD__PEER_MSG__MSG_JOB_CONFIRM:
        if (!confirm_in(cl, m->job_confirm)) {
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "the job's leader (node %d) confirmed it with a table this daemon cannot "
                     "use",
                     l->node);
            cl->ev.job_refused(cl->ev.ctx, m->job_confirm->job, SD_EPROTO, msg);
            return false;
        }
        break;
    case SHARD__PEER_MSG__MSG_JOB_ABORT:
        m->job_abort->origin = from_wire(cl, m->job_abort->origin);
        ids_in(cl, m->job_abort->nodes, m->job_abort->n_nodes);
        break;
    case SHARD__PEER_MSG__MSG_JOB_LEFT:
        m->job_left->node = from_wire(cl, m->job_left->node);
        ids_in(cl, m->job_left->nodes, m->job_left->n_nodes);
        break;
    case SHARD__PEER_MSG__MSG_JOB_RECOVER:
        m->job_recover->from = from_wire(cl, m->job_recover->from);
        break;
    case SHARD__PEER_MSG__MSG_NODE_DOWN:
    case SHARD__PEER_MSG__MSG_TABLE:
    case SHARD__PEER_MSG__MSG_RELAY:
    case SHARD__PEER_MSG__MSG_JOB_END: /* (what only a coordinator says) */
        SD_WARN_SPARSE("cluster",
                       "node %d sent a coordinator's message (kind %d) to an independent "
                       "daemon: dropped",
                       l->node, (int)m->msg_case);
        return false;
    default:
        break;
    }
    return true;
}

/* ---- the handshake */

/* l's key: the token of the job it was opened for (false: none here) */
static bool link_key(struct link *l, const char *job, struct sd_auth *a)
{
    struct sd_cluster *cl = l->cl;
    if (job == NULL || job[0] == '\0' || strlen(job) >= sizeof(l->job) ||
        !cl->ev.job_token(cl->ev.ctx, job, a->key))
        return false;
    a->key_len = SD_JOB_TOKEN_BYTES;
    if (job != l->job)
        snprintf(l->job, sizeof(l->job), "%s", job);
    return true;
}

/* the welcome's MAC: both nonces and what it says of the answering daemon */
static void welcome_mac(const struct sd_auth *a, const struct link *l, const Shard__PeerWelcome *w,
                        uint8_t out[SD_SHA256_BYTES])
{
    static const char label[] = "shardd welcome";
    uint32_t f[4] = {w->node, w->hb_port, w->peer_port, w->you};
    struct sd_hmac h;
    sd_hmac_init(&h, a->key, a->key_len);
    sd_hmac_update(&h, label, sizeof(label));
    sd_hmac_update(&h, l->nonce_c, SD_AUTH_NONCE);
    sd_hmac_update(&h, l->nonce_m, SD_AUTH_NONCE);
    sd_hmac_update(&h, f, sizeof(f));
    sd_hmac_update(&h, w->fabric_addr.data, w->fabric_addr.len);
    sd_hmac_final(&h, out);
}

void sd_meet__hello_fields(struct link *l, Shard__PeerHello *h, struct sd_auth *a)
{
    struct sd_cluster *cl = l->cl;
    h->node = cl->meet.uid;
    h->job = l->job;
    h->you = (uint32_t)l->node;
    (void)link_key(l, l->job, a); /* (the dial checked it has one) */
}

/* An incoming link's hello: the job it names keys it; the daemon it comes from gets (or has) a
 * slot, reached from the address it connected from. */
void sd_meet__on_hello(struct link *l, const Shard__PeerHello *h)
{
    struct sd_cluster *cl = l->cl;
    struct sd_auth a;
    char from[SD_PEER_ADDR], pa[SD_PEER_ADDR + 16];
    sd_cluster__link_host(l, from, sizeof(from));
    if (!h->peer || !link_key(l, h->job, &a)) {
        cl->auth_refused++;
        sd_cluster__refuse(l,
                           "a link from %s for job '%.64s', which is not registered on this "
                           "daemon with a job secret (yet)",
                           from, h->job != NULL ? h->job : "");
        return;
    }
    if (!sd_cluster__hello_verify(l, h, &a))
        return;
    snprintf(pa, sizeof(pa), "%s:%u", from, h->peer_port);
    uint32_t s = slot_by_uid(cl, h->node);
    if (s == cl->self || h->node == 0 || h->node == SD_NO_NODE || h->you < 2 ||
        h->you >= SD_MAX_NODES) {
        sd_cluster__refuse(l, "a link from %s naming itself daemon %08x (numbered %u there)", from,
                           h->node, h->you);
        return;
    }
    if (s != SD_NO_NODE) { /* a daemon met before: from the same host, with the same address */
        size_t host = strcspn(cl->peers.addrs[s], ":");
        if (strlen(from) != host || strncmp(from, cl->peers.addrs[s], host) != 0 ||
            h->fabric_addr.len != cl->addr_len[s] ||
            memcmp(h->fabric_addr.data, cl->addrs[s], cl->addr_len[s]) != 0) {
            sd_cluster__refuse(l,
                               "a link as daemon %08x from %s, which this daemon knows at %s "
                               "with another fabric address",
                               h->node, from, cl->peers.addrs[s]);
            return;
        }
    } else if ((s = slot_new(cl)) == SD_NO_NODE ||
               slot_fill(cl, s, h->node, h->fabric_addr.data, h->fabric_addr.len, h->hb_port, pa) !=
                   SD_OK) {
        sd_cluster__refuse(l,
                           "this daemon cannot take another peer (its %u are all in use by jobs)",
                           cl->meet.slots - 2);
        return;
    }
    cl->hb_port[s] = h->hb_port;
    cl->meet.as[s] = h->you; /* (the number the dialer gives this daemon) */
    Shard__PeerWelcome w = SHARD__PEER_WELCOME__INIT;
    uint8_t mac[SD_SHA256_BYTES];
    w.node = cl->meet.uid;
    w.fabric_addr.data = cl->me.addr;
    w.fabric_addr.len = cl->me.addr_len;
    w.hb_port = cl->me.hb_port;
    w.peer_port = cl->me.peer_port;
    w.you = s;
    welcome_mac(&a, l, &w, mac);
    w.mac.data = mac;
    w.mac.len = sizeof(mac);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_WELCOME;
    m.welcome = &w;
    size_t len = 0;
    uint8_t *frame = sd_cluster__frame(&m, &len);
    sd_cluster__link_write(l, frame, len);
    proof_add(&l->proved, h->job);
    proof_add(&l->told, h->job);
    sd_meet__adopt(l, s);
}

/* The welcome on a link this daemon dialed: the answering daemon proved the job's token, and
 * says who it is and the number it gives this one. */
void sd_meet__on_welcome(struct link *l, const Shard__PeerWelcome *w)
{
    struct sd_cluster *cl = l->cl;
    struct sd_auth a;
    uint8_t want[SD_SHA256_BYTES];
    char addr[64];
    sd_cluster__link_addr(l, addr, sizeof(addr));
    bool ok = link_key(l, l->job, &a) && w->mac.len == SD_SHA256_BYTES;
    if (ok) {
        welcome_mac(&a, l, w, want);
        ok = sd_mem_equal(want, w->mac.data, SD_SHA256_BYTES);
    }
    uint32_t s = (uint32_t)l->node, other = ok ? slot_by_uid(cl, w->node) : SD_NO_NODE;
    const char *why = !ok                                     ? "does not prove the job's token"
                      : w->node == 0 || w->node == SD_NO_NODE ? "names no daemon id"
                      : other != SD_NO_NODE && other != s ? "is a daemon known at another address"
                      : w->you < 2 || w->you >= SD_MAX_NODES ? "numbers this daemon out of range"
                                                             : NULL;
    if (why == NULL && slot_fill(cl, s, w->node, w->fabric_addr.data, w->fabric_addr.len,
                                 w->hb_port, NULL) != SD_OK)
        why = "gave a fabric address this daemon cannot use";
    if (why != NULL) {
        SD_ERROR("cluster", "the daemon at %s (job '%.64s') %s: not heard", addr, l->job, why);
        l->retired = true;
        sd_cluster__link_close(l, why);
        return;
    }
    l->authed = true;
    sd_auth_hb_key(&a, l->nonce_c, l->nonce_m, l->hb_key);
    cl->meet.as[s] = w->you;
    proof_add(&l->proved, l->job);
    proof_add(&l->told, l->job);
    sd_meet__adopt(l, s);
}

/* l proved itself and is slot s's: its daemon is up (its data path is probed before a job
 * starts on it). */
void sd_meet__adopt(struct link *l, uint32_t s)
{
    struct sd_cluster *cl = l->cl;
    sd_cluster__adopt_peer(l, s);
    if (cl->by_node[s] != l)
        return; /* (another link to it stays) */
    if (!cl->alive[s]) {
        cl->alive[s] = cl->present[s] = true;
        sd_probe_table(cl);
    }
}

/* ---- a job's registration */

static void leader_note(struct sd_cluster *cl, const char *job, uint32_t slot)
{
    struct meet_leader **pp = &cl->meet.leaders, *l;
    uint32_t n = 0;
    for (; *pp; pp = &(*pp)->next, n++)
        if (strcmp((*pp)->name, job) == 0) {
            (*pp)->slot = slot;
            return;
        }
    if (n >= MEET_MAX_LEADERS) { /* the oldest goes (its job long decided) */
        for (pp = &cl->meet.leaders; (*pp)->next; pp = &(*pp)->next)
            ;
        free(*pp);
        *pp = NULL;
    }
    if ((l = calloc(1, sizeof(*l))) == NULL)
        return;
    snprintf(l->name, sizeof(l->name), "%s", job);
    l->slot = slot;
    l->next = cl->meet.leaders;
    cl->meet.leaders = l;
}

uint32_t sd_meet__leader(const struct sd_cluster *cl, const char *job)
{
    for (const struct meet_leader *l = cl->meet.leaders; l; l = l->next)
        if (strcmp(l->name, job) == 0)
            return l->slot;
    return SD_NO_NODE;
}

/* can a TCP socket bind host ("": any address) at port? */
static bool port_free(const char *host, uint32_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (host[0] == '\0' || inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        sa.sin_addr.s_addr = htonl(INADDR_ANY);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), on = 1;
    bool ok = fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == 0 &&
              bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

/* Listen for the daemons this one meets (once): a leader at peer_port (SD_MEET_PORT when 0),
 * where its jobs' ranks say it is; a daemon that is not a job's leader anywhere there is free. */
static int meet_listen(struct sd_cluster *cl, bool leader, char *err, size_t errlen)
{
    uint32_t want = cl->cfg->peer_port > 0 ? (uint32_t)cl->cfg->peer_port : SD_MEET_PORT;
    if (cl->me.peer_port == 0) {
        /* (a port taken fails at listen, after the handle was made: ask first) */
        uint32_t port = leader || port_free(cl->cfg->fabric_addr, want) ? want : 0;
        int r = sd_cluster__listen_peers(cl, cl->cfg->fabric_addr, port);
        if (r != 0) {
            snprintf(err, errlen, "cannot listen for the job's other daemons on port %u: %s", want,
                     uv_strerror(r));
            return SD_EIO;
        }
    }
    if (leader && cl->me.peer_port != want) {
        snprintf(err, errlen,
                 "this daemon is the job's leader but listens on port %u, not %u where its "
                 "ranks look for it (port %u was taken; set peer_port)",
                 cl->me.peer_port, want, want);
        return SD_EIO;
    }
    return SD_OK;
}

/* does leader ("ip:port") name this daemon's listener: its port, at its fabric address (or,
 * listening on every address, at one of the host's)? */
static bool is_me(const struct sd_cluster *cl, const char *leader)
{
    uint32_t port = cl->me.peer_port != 0    ? cl->me.peer_port
                    : cl->cfg->peer_port > 0 ? (uint32_t)cl->cfg->peer_port
                                             : SD_MEET_PORT;
    const char *colon = strrchr(leader, ':');
    const char *host = cl->cfg->fabric_addr;
    if (colon == NULL || strtoul(colon + 1, NULL, 10) != port)
        return false;
    char ip[64];
    snprintf(ip, sizeof(ip), "%.*s", (int)SD_MIN((size_t)(colon - leader), sizeof(ip) - 1), leader);
    if (host[0] != '\0' && strcmp(host, "0.0.0.0") != 0)
        return strcmp(host, ip) == 0;
    struct ifaddrs *ifs = NULL;
    bool mine = false;
    if (getifaddrs(&ifs) != 0)
        return false;
    for (const struct ifaddrs *i = ifs; i != NULL && !mine; i = i->ifa_next) {
        char a[INET_ADDRSTRLEN];
        if (i->ifa_addr != NULL && i->ifa_addr->sa_family == AF_INET &&
            inet_ntop(AF_INET, &((const struct sockaddr_in *)i->ifa_addr)->sin_addr, a,
                      sizeof(a)) != NULL)
            mine = strcmp(a, ip) == 0;
    }
    freeifaddrs(ifs);
    return mine;
}

void sd_meet__report(struct sd_cluster *cl, const Shard__JobReport *r, const char *leader)
{
    char err[300] = "";
    int st = SD_OK;
    uint32_t slot = SD_NO_NODE;
    if (r->job_token.len != SD_JOB_TOKEN_BYTES) {
        st = SD_EPERM;
        snprintf(err, sizeof(err),
                 "job '%s' spans nodes of daemons that form it per job: it needs a job secret "
                 "(SHARD_JOB_SECRET_FILE, mlp_train --job-secret-file, shard.torch.wrap's "
                 "job_secret), which proves its nodes to each other",
                 r->job);
    } else if (r->job_node != 0 && (leader == NULL || leader[0] == '\0')) {
        st = SD_EINVAL;
        snprintf(err, sizeof(err),
                 "job '%s' spans nodes, and its ranks named no leader (the daemon of rank 0's "
                 "node): set SHARD_LEADER=host[:port], or MASTER_ADDR (torchrun) or "
                 "SLURM_STEP_NODELIST (srun)",
                 r->job);
    }
    /* the daemon of the job's node 0 leads it, unless its ranks name another daemon (then
     * that one hears two nodes claim ranks 0..k-1, and says so to both) */
    bool named_me = leader != NULL && leader[0] != '\0' && is_me(cl, leader);
    bool lead = r->job_node == 0 && (leader == NULL || leader[0] == '\0' || named_me);
    if (st == SD_OK && r->job_node != 0 && named_me) {
        st = SD_EINVAL;
        snprintf(err, sizeof(err),
                 "job '%s': its ranks name this daemon (%s) the leader, but it serves the "
                 "job's node %u, not node 0 (rank 0's): name rank 0's node",
                 r->job, leader, r->job_node);
    }
    if (st == SD_OK)
        st = meet_listen(cl, lead, err, sizeof(err));
    if (st == SD_OK && !lead) {
        struct sockaddr_storage ss;
        slot = sd_cluster__parse_hostport(leader, &ss) == SD_OK ? slot_by_addr(cl, leader)
                                                                : SD_NO_NODE;
        if (slot == SD_NO_NODE) {
            st = SD_EINVAL;
            snprintf(err, sizeof(err),
                     "job '%s': its leader '%.64s' is not ip:port, or this daemon knows %u "
                     "daemons already",
                     r->job, leader, cl->meet.slots - 2);
        }
    }
    if (st != SD_OK) {
        SD_WARN("cluster", "%s", err);
        if (r->status == SD_OK)
            cl->ev.job_refused(cl->ev.ctx, r->job, st, err);
        return;
    }
    if (lead) {
        leader_note(cl, r->job, cl->self);
        sd_cluster__coord_report(cl, r);
    } else {
        leader_note(cl, r->job, slot);
        if (r->status == SD_OK)
            SD_INFO("cluster", "job '%s': meeting its leader at %s (node %u here)", r->job, leader,
                    slot);
        Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
        m.msg_case = SHARD__PEER_MSG__MSG_JOB_REPORT;
        m.job_report = (Shard__JobReport *)r;
        sd_cluster__peer_send(cl, slot, &m);
    }
    sd_meet__tick(cl, sd_now_ns()); /* (proofs of this job that came first) */
}

json_t *sd_meet__json(const struct sd_cluster *cl)
{
    json_t *nodes = json_array();
    char me[16];
    snprintf(me, sizeof(me), "%08x", cl->meet.uid);
    json_array_append_new(nodes, json_pack("{s:i, s:s, s:b, s:b, s:s}", "node", (int)cl->self, "id",
                                           me, "self", 1, "link", 0, "state", "self"));
    for (uint32_t i = 2; i < cl->cap; i++) {
        if (cl->meet.uid_of[i] == 0 && cl->peers.addrs[i][0] == '\0')
            continue;
        char id[16];
        snprintf(id, sizeof(id), "%08x", cl->meet.uid_of[i]);
        const struct link *l = cl->by_node[i];
        json_array_append_new(nodes, json_pack("{s:i, s:s, s:s, s:b, s:b, s:s}", "node", (int)i,
                                               "id", id, "peer_addr", cl->peers.addrs[i], "self", 0,
                                               "link", l != NULL && l->authed, "state",
                                               cl->meet.uid_of[i] == 0 ? "meeting"
                                               : !cl->alive[i]         ? "down"
                                               : sd_probe_ok(cl, i)    ? "up"
                                                                       : "probing"));
    }
    return nodes;
}

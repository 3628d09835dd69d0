/* Independent daemons' messages on their links (DESIGN.md section 6, cluster/meet.c): daemons
 * are named by their ids on the wire and by each end's own numbers (slots) here, translated both
 * ways; a link is heard for a job only once the other end proved that job's token (the
 * handshake proves one, a JobProof each further one, sent before the first message about it);
 * a proof of a job whose ranks have not registered here yet waits, with the messages after it,
 * until they have or the registration's deadline passed. */
#include "cluster/cluster_int.h"

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
    size_t bytes;
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
    ProtobufCBinaryData keys[SD_MAX_NODES];
    uint8_t token[SD_JOB_TOKEN_BYTES]; /* a report's, as the link proved it */
};

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

/* ---- ids on the wire */

static uint32_t to_wire(const struct sd_cluster *cl, uint32_t node)
{
    if (node == cl->self)
        return cl->meet.uid;
    return node < cl->cap ? cl->meet.uid_of[node] : 0;
}

static uint32_t from_wire(const struct sd_cluster *cl, uint32_t uid)
{
    return sd_meet__slot_by_uid(cl, uid);
}

static uint32_t *ids_out(struct sd_cluster *cl, const uint32_t *ids, size_t n)
{
    uint32_t *out = cl->meet.wire->ids;
    for (size_t i = 0; i < n && i < SD_MAX_NODES; i++)
        out[i] = to_wire(cl, ids[i]);
    return out;
}

/* a message's node list (*nodes, *n of them) as ids, in the scratch */
static void nodes_out(struct sd_cluster *cl, uint32_t **nodes, size_t *n)
{
    *n = SD_MIN(*n, (size_t)SD_MAX_NODES);
    *nodes = ids_out(cl, *nodes, *n);
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
        w->keys[i].data = me ? cl->meet.key.pub : known ? cl->meet.key_of[s] : NULL;
        w->keys[i].len = me || known ? SD_MEET_KEY : 0;
    }
    c->nodes = ids_out(cl, c->nodes, n);
    c->n_nodes = c->n_fabric_addrs = c->n_peer_addrs = c->n_hb_ports = c->n_daemon_keys = n;
    c->fabric_addrs = w->fab;
    c->peer_addrs = w->pa;
    c->hb_ports = w->hb;
    c->daemon_keys = w->keys;
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
        /* (the link proved the job's token: the token itself never travels) */
        w->u.rep.job_token.data = NULL;
        w->u.rep.job_token.len = 0;
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
        nodes_out(cl, &w->u.abort.nodes, &w->u.abort.n_nodes);
        w->m.job_abort = &w->u.abort;
        break;
    case SHARD__PEER_MSG__MSG_JOB_LEFT:
        w->u.left = *m->job_left;
        w->u.left.node = to_wire(cl, w->u.left.node);
        nodes_out(cl, &w->u.left.nodes, &w->u.left.n_nodes);
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

/* The daemons a confirmation names, met here: each one not known yet gets a slot, its key and
 * its addresses (hints: the daemon's own proof, when it links, is what they are taken from).
 * Each key must name its id, and a daemon met before keep the key it had. False (logged) if one
 * cannot be. */
static bool confirm_in(struct sd_cluster *cl, Shard__JobConfirm *c)
{
    static const uint8_t none[SD_MEET_KEY];
    bool whole = c->n_fabric_addrs == c->n_nodes && c->n_peer_addrs == c->n_nodes &&
                 c->n_hb_ports == c->n_nodes && c->n_daemon_keys == c->n_nodes &&
                 c->n_nodes <= SD_MAX_NODES;
    for (size_t i = 0; whole && i < c->n_nodes; i++) {
        const ProtobufCBinaryData *key = &c->daemon_keys[i];
        if (key->len != SD_MEET_KEY || sd_meet_key_id(key->data) != c->nodes[i]) {
            SD_WARN_SPARSE("cluster",
                           "job '%.64s': its leader's table names daemon %08x (job node %zu) with "
                           "a key that does not name it",
                           c->job, c->nodes[i], i);
            return false;
        }
        uint32_t s = sd_meet__slot_by_uid(cl, c->nodes[i]);
        if (s != SD_NO_NODE && s != cl->self &&
            memcmp(cl->meet.key_of[s], none, SD_MEET_KEY) != 0 &&
            memcmp(cl->meet.key_of[s], key->data, SD_MEET_KEY) != 0) {
            SD_WARN_SPARSE("cluster",
                           "job '%.64s': its leader's table names daemon %08x (job node %zu) with "
                           "another key than the daemon of that id met here",
                           c->job, c->nodes[i], i);
            return false;
        }
        if (s == cl->self && memcmp(key->data, cl->meet.key.pub, SD_MEET_KEY) != 0)
            return false;
        if (s != SD_NO_NODE && s != cl->self)
            memcpy(cl->meet.key_of[s], key->data, SD_MEET_KEY);
        if (s == SD_NO_NODE) {
            s = c->nodes[i] != 0 && c->peer_addrs[i][0] != '\0' ? sd_meet__slot_new(cl)
                                                                : SD_NO_NODE;
            if (s == SD_NO_NODE || sd_meet__slot_fill(cl, s, c->nodes[i], c->fabric_addrs[i].data,
                                                      c->fabric_addrs[i].len, c->hb_ports[i],
                                                      c->peer_addrs[i]) != SD_OK) {
                if (s != SD_NO_NODE)
                    sd_meet__slot_release(cl, s);
                SD_WARN_SPARSE("cluster",
                               "job '%.64s': its leader's table names daemon %08x (job node %zu) "
                               "without an address this daemon can use",
                               c->job, c->nodes[i], i);
                return false;
            }
            memcpy(cl->meet.key_of[s], key->data, SD_MEET_KEY);
        }
        c->nodes[i] = s;
    }
    if (!whole)
        SD_WARN_SPARSE("cluster", "job '%.64s': its leader's table is malformed", c->job);
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

const char *sd_meet__job_of(const Shard__PeerMsg *m)
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
    sd_cluster__link_send_raw(l, &pm);
    proof_add(&l->told, job);
    return true;
}

void sd_meet__send(struct link *l, const Shard__PeerMsg *m)
{
    const char *job = sd_meet__job_of(m);
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

/* the bytes of the messages waiting on l for their jobs' proofs */
size_t sd_meet__waiting_bytes(const struct link *l)
{
    size_t bytes = 0;
    for (const struct meet_wait *w = l->waiting; w; w = w->next)
        bytes += w->bytes;
    return bytes;
}

/* A message about w's job, kept until its proof is checked. What a link may keep so is bounded
 * (MEET_WAIT_MSGS a job, MEET_WAIT_BYTES in all): a real registration's messages are a report
 * or two of a few hundred bytes, so a link past either is closed (logged, counted); its other
 * end (a daemon that proved a job of its own, not this one) dials again if it is real. */
static void wait_keep(struct link *l, struct meet_wait *w, const Shard__PeerMsg *m)
{
    struct sd_cluster *cl = l->cl;
    size_t len = protobuf_c_message_get_packed_size(&m->base);
    size_t held = sd_meet__waiting_bytes(l);
    uint8_t *buf = NULL;
    if (w->n >= MEET_WAIT_MSGS || held + len > MEET_WAIT_BYTES || (buf = malloc(len)) == NULL) {
        cl->counts.closed_full++;
        SD_WARN_SPARSE("cluster",
                       "node %d (%s) sent %u message(s), %zu bytes, about jobs not registered "
                       "here yet (job '%.64s' among them): more than a link may leave waiting "
                       "(%d a job, %u bytes); link closed",
                       l->node, l->host, w->n + 1, held + len, w->job, MEET_WAIT_MSGS,
                       MEET_WAIT_BYTES);
        sd_cluster__link_close(l, "it left too much waiting for jobs not registered here");
        return;
    }
    protobuf_c_message_pack(&m->base, buf);
    w->msg[w->n] = buf;
    w->len[w->n++] = len;
    w->bytes += len;
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
            SD_WARN_SPARSE("cluster",
                           "node %d proved job '%.64s', which did not register here in time: its "
                           "%u message(s) dropped",
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
        if (l->waiting != NULL && !l->closing)
            wait_check(l, now, deadline);
    }
    sd_meet__forget(cl);
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
    const char *job = sd_meet__job_of(m);
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
        /* the token the link proved (its own registration's here): the reports of one job
         * carry it (a report's own token, if any, is not heard) */
        if (!cl->ev.job_token(cl->ev.ctx, job, cl->meet.wire->token))
            return false;
        if (m->job_report->job_token.len != SD_JOB_TOKEN_BYTES) {
            /* (the unpacked message owns its fields: protobuf-c's allocator, malloc, frees) */
            uint8_t *t = malloc(SD_JOB_TOKEN_BYTES);
            if (t == NULL)
                return false;
            free(m->job_report->job_token.data);
            m->job_report->job_token.data = t;
            m->job_report->job_token.len = SD_JOB_TOKEN_BYTES;
        }
        memcpy(m->job_report->job_token.data, cl->meet.wire->token, SD_JOB_TOKEN_BYTES);
        if (sd_meet__leader(cl, job) == SD_NO_NODE)
            sd_meet__leader_note(cl, job, cl->self);
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

struct meet_wire *sd_meet__wire_new(void)
{
    return calloc(1, sizeof(struct meet_wire));
}

void sd_meet__proved(struct link *l, const char *job)
{
    proof_add(&l->proved, job);
    proof_add(&l->told, job);
}

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
 * message about another, an end sends a JobProof (meet_wire.c: the messages on the links). So
 * a daemon that is not one of a job's cannot join it, speak for it, or declare one of its nodes
 * down: what it could do to the job's data path is dropped by the fabric, which hears only the
 * addresses in the table. */
#include "cluster/cluster_int.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <unistd.h>

struct meet_leader {
    struct meet_leader *next;
    char name[64];
    uint32_t slot;
};

#define MEET_MAX_LEADERS 256

int sd_meet__init(struct sd_cluster *cl)
{
    cl->meet.uid_of = calloc(cl->cap, sizeof(*cl->meet.uid_of));
    cl->meet.key_of = calloc(cl->cap, sizeof(*cl->meet.key_of));
    cl->meet.as = calloc(cl->cap, sizeof(*cl->meet.as));
    cl->meet.wire = sd_meet__wire_new();
    if (cl->meet.uid_of == NULL || cl->meet.key_of == NULL || cl->meet.as == NULL ||
        cl->meet.wire == NULL)
        return SD_ENOMEM;
    if (sd_meet_key_new(&cl->meet.key) != SD_OK) {
        SD_ERROR("cluster", "cannot make this daemon's key pair (Ed25519, libcrypto)");
        return SD_EIO;
    }
    cl->meet.uid = cl->meet.key.id;
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
    free(cl->meet.key_of);
    sd_meet_key_free(&cl->meet.key);
    free(cl->meet.as);
    free(cl->meet.wire);
}

/* ---- the table: slots by id and by address */

uint32_t sd_meet__slot_by_uid(const struct sd_cluster *cl, uint32_t uid)
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
        memset(cl->meet.key_of[i], 0, SD_MEET_KEY);
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
uint32_t sd_meet__slot_new(struct sd_cluster *cl)
{
    for (uint32_t i = 2; i < cl->meet.slots; i++)
        if (cl->meet.uid_of[i] == 0 && cl->peers.addrs[i][0] == '\0' && cl->by_node[i] == NULL &&
            !cl->peers.dialing[i])
            return i;
    return slot_reclaim(cl);
}

/* Slot holds daemon uid (fabric address fab, fab_len bytes; heartbeat port hb; peer listener
 * pa, "" to keep what it has): its fabric address goes into the transport's table. */
int sd_meet__slot_fill(struct sd_cluster *cl, uint32_t slot, uint32_t uid, const uint8_t *fab,
                       size_t fab_len, uint32_t hb, const char *pa)
{
    char why[160];
    if (fab_len == 0 || fab_len > sizeof(cl->addrs[0]))
        return SD_EPROTO;
    if (cl->tp->ops->check_addr != NULL &&
        cl->tp->ops->check_addr(cl->tp, fab, fab_len, why, sizeof(why)) != SD_OK) {
        SD_WARN_SPARSE("cluster", "daemon %08x's fabric address is refused: %s", uid, why);
        return SD_EPROTO;
    }
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

/* a slot that was taken for a daemon that then could not be filled: free again */
void sd_meet__slot_release(struct sd_cluster *cl, uint32_t slot)
{
    if (slot < 2 || slot >= cl->cap || cl->by_node[slot] != NULL || cl->peers.dialing[slot])
        return;
    if (cl->addr_len[slot] > 0)
        cl->tp->ops->peer_down(cl->tp, slot);
    cl->meet.uid_of[slot] = 0;
    memset(cl->meet.key_of[slot], 0, SD_MEET_KEY);
    cl->meet.as[slot] = SD_NO_NODE;
    cl->addr_len[slot] = 0;
    cl->hb_port[slot] = 0;
    cl->present[slot] = cl->alive[slot] = false;
    cl->peers.addrs[slot][0] = '\0';
}

/* the slot of the daemon listening at addr ("ip:port"), made (its id not known yet) if none */
static uint32_t slot_by_addr(struct sd_cluster *cl, const char *addr)
{
    for (uint32_t i = 2; i < cl->cap; i++)
        if (strcmp(cl->peers.addrs[i], addr) == 0)
            return i;
    uint32_t s = sd_meet__slot_new(cl);
    if (s != SD_NO_NODE)
        snprintf(cl->peers.addrs[s], SD_PEER_ADDR, "%s", addr);
    return s;
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

/* what a hello on l says of its daemon, which its signature covers */
static struct sd_meet_said hello_said(const struct link *l, const Shard__PeerHello *h)
{
    return (struct sd_meet_said){.role = 'h',
                                 .nc = l->nonce_c,
                                 .nm = l->nonce_m,
                                 .id = h->node,
                                 .job = h->job,
                                 .fab = h->fabric_addr.data,
                                 .fab_len = h->fabric_addr.len,
                                 .hb_port = h->hb_port,
                                 .peer_port = h->peer_port};
}

void sd_meet__hello_fields(struct link *l, Shard__PeerHello *h, struct sd_auth *a)
{
    struct sd_cluster *cl = l->cl;
    static uint8_t sig[SD_MEET_SIG]; /* (the hello is packed before the next one is made) */
    h->node = cl->meet.uid;
    h->job = l->job;
    h->you = (uint32_t)l->node;
    (void)link_key(l, l->job, a); /* (the dial checked it has one) */
    struct sd_meet_said said = hello_said(l, h);
    if (sd_meet_key_sign(&cl->meet.key, &said, sig)) {
        h->daemon_key.data = cl->meet.key.pub;
        h->daemon_key.len = SD_MEET_KEY;
        h->daemon_sig.data = sig;
        h->daemon_sig.len = SD_MEET_SIG;
    }
}

/* does slot s hold a key (a daemon met through a proof, or named with its key in a table)? */
static bool key_known(const struct sd_cluster *cl, uint32_t s)
{
    static const uint8_t none[SD_MEET_KEY];
    return memcmp(cl->meet.key_of[s], none, SD_MEET_KEY) != 0;
}

/* The daemon dialed as slot from proved (its welcome) to be the one this daemon numbers into
 * (met before, at another address, or named in a job's table): one slot, into, with the address
 * that was dialed; what named from (a job's leader, messages waiting) names into. */
static void slot_merge(struct sd_cluster *cl, struct link *l, uint32_t from, uint32_t into)
{
    if (into != from)
        memcpy(cl->peers.addrs[into], cl->peers.addrs[from], SD_PEER_ADDR);
    for (struct meet_leader *m = cl->meet.leaders; m; m = m->next)
        if (m->slot == from)
            m->slot = into;
    for (struct outmsg *o = cl->peers.outbox; o; o = o->next)
        if (o->node == from)
            o->node = into;
    cl->peers.dialing[from] = false;
    cl->peers.dial_fails[from] = 0;
    l->node = (int)into;
    sd_meet__slot_release(cl, from);
}

/* An incoming link's hello: the job it names keys it; the daemon it comes from gets (or has) a
 * slot, reached from the address it connected from. */
void sd_meet__on_hello(struct link *l, const Shard__PeerHello *h)
{
    struct sd_cluster *cl = l->cl;
    struct sd_auth a;
    char from[SD_PEER_ADDR], pa[SD_PEER_ADDR + 16], why[160];
    sd_cluster__link_host(l, from, sizeof(from));
    if (!h->peer || !link_key(l, h->job, &a)) {
        /* (a job's other nodes dial its leader until its ranks there registered; the other end
         * hears the one refusal of every unproved hello, after as long as a MAC takes: no
         * daemon says which jobs it serves) */
        uint8_t want[SD_SHA256_BYTES];
        a.key_len = SD_JOB_TOKEN_BYTES;
        memset(a.key, 0, SD_JOB_TOKEN_BYTES);
        if (h->nonce.len == SD_AUTH_NONCE)
            memcpy(l->nonce_m, h->nonce.data, SD_AUTH_NONCE);
        sd_auth_hello_mac(&a, l->nonce_c, l->nonce_m, h, want);
        (void)sd_mem_equal(want, h->mac.data, SD_MIN(h->mac.len, sizeof(want)));
        sd_cluster__refuse_unproved(l, h->job,
                                    !h->peer ? "a hello that is not a daemon's link"
                                             : "no job of that name with a secret is registered "
                                               "here (yet)");
        return;
    }
    if (!sd_cluster__hello_verify(l, h, &a))
        return;
    /* (the options the data path of a job between them depends on; each its own ranks per
     * node) */
    if (h->protocol_version != SD_PROTOCOL_VERSION || strcmp(h->version, SHARD_VERSION) != 0 ||
        h->config_digest != cl->digest) {
        sd_cluster__refuse(l,
                           "a job's daemons must agree: the daemon at %s runs shardd %s "
                           "(protocol v%u) with [%s]; this one runs %s (v%d) with [%s]",
                           from, h->version, h->protocol_version, h->config_summary, SHARD_VERSION,
                           SD_PROTOCOL_VERSION, cl->summary);
        return;
    }
    snprintf(pa, sizeof(pa), "%s:%u", from, h->peer_port);
    uint32_t s = sd_meet__slot_by_uid(cl, h->node);
    if (s == cl->self || h->node == 0 || h->node == SD_NO_NODE || h->you < 2 ||
        h->you >= SD_MAX_NODES) {
        sd_cluster__refuse(l, "a link from %s naming itself daemon %08x (numbered %u there)", from,
                           h->node, h->you);
        return;
    }
    /* the id is claimed by the daemon holding its key only: a signature over this connection's
     * nonces and what the hello says of its daemon; a daemon met before is the one with the
     * key it had (its addresses then taken from this proof: a job's table may have named it
     * at others) */
    struct sd_meet_said said = hello_said(l, h);
    bool fresh = s == SD_NO_NODE;
    if (!sd_meet_key_verify(h->daemon_key.data, h->daemon_key.len, h->daemon_sig.data,
                            h->daemon_sig.len, &said)) {
        sd_cluster__refuse(l,
                           "a link from %s as daemon %08x that does not prove that daemon's key "
                           "(a signature by the key its id names)",
                           from, h->node);
        return;
    }
    if (!fresh && key_known(cl, s) &&
        memcmp(cl->meet.key_of[s], h->daemon_key.data, SD_MEET_KEY) != 0) {
        sd_cluster__refuse(l,
                           "a link from %s as daemon %08x with another key than the daemon of "
                           "that id met here (two keys that name one id: made to)",
                           from, h->node);
        return;
    }
    if (cl->tp->ops->check_addr != NULL &&
        cl->tp->ops->check_addr(cl->tp, h->fabric_addr.data, h->fabric_addr.len, why,
                                sizeof(why)) != SD_OK) {
        sd_cluster__refuse(l,
                           "a link from %s as daemon %08x with a fabric address this "
                           "daemon cannot use: %s",
                           from, h->node, why);
        return;
    } else if (fresh && (s = sd_meet__slot_new(cl)) == SD_NO_NODE) {
        sd_cluster__refuse(l,
                           "this daemon cannot take another peer (its %u are all in use by jobs)",
                           cl->meet.slots - 2);
        return;
    } else if (sd_meet__slot_fill(cl, s, h->node, h->fabric_addr.data, h->fabric_addr.len,
                                  h->hb_port, pa) != SD_OK) {
        if (fresh)
            sd_meet__slot_release(cl, s);
        sd_cluster__refuse(l,
                           "a link from %s as daemon %08x: its fabric address did not go into "
                           "this daemon's table",
                           from, h->node);
        return;
    }
    memcpy(cl->meet.key_of[s], h->daemon_key.data, SD_MEET_KEY);
    cl->hb_port[s] = h->hb_port;
    cl->meet.as[s] = h->you; /* (the number the dialer gives this daemon) */
    Shard__PeerWelcome w = SHARD__PEER_WELCOME__INIT;
    uint8_t mac[SD_SHA256_BYTES], sig[SD_MEET_SIG];
    w.node = cl->meet.uid;
    w.fabric_addr.data = cl->me.addr;
    w.fabric_addr.len = cl->me.addr_len;
    w.hb_port = cl->me.hb_port;
    w.peer_port = cl->me.peer_port;
    w.you = s;
    said = (struct sd_meet_said){.role = 'w',
                                 .nc = l->nonce_c,
                                 .nm = l->nonce_m,
                                 .id = w.node,
                                 .job = h->job,
                                 .fab = w.fabric_addr.data,
                                 .fab_len = w.fabric_addr.len,
                                 .hb_port = w.hb_port,
                                 .peer_port = w.peer_port};
    if (sd_meet_key_sign(&cl->meet.key, &said, sig)) {
        w.daemon_key.data = cl->meet.key.pub;
        w.daemon_key.len = SD_MEET_KEY;
        w.daemon_sig.data = sig;
        w.daemon_sig.len = SD_MEET_SIG;
    }
    welcome_mac(&a, l, &w, mac);
    w.mac.data = mac;
    w.mac.len = sizeof(mac);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_WELCOME;
    m.welcome = &w;
    sd_cluster__link_send_raw(l, &m);
    sd_meet__proved(l, h->job);
    sd_meet__adopt(l, s);
}

void sd_cluster__refuse_unproved(struct link *l, const char *job, const char *why)
{
    struct sd_cluster *cl = l->cl;
    cl->counts.refused++;
    SD_WARN_SPARSE("cluster",
                   "refusing a connection from %s for job '%.64s': %s (%llu such refused so far)",
                   l->host, job != NULL ? job : "", why, (unsigned long long)cl->counts.refused);
    sd_cluster__refuse_text(l, SD_REFUSE_UNPROVED);
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
    struct sd_meet_said said = {.role = 'w',
                                .nc = l->nonce_c,
                                .nm = l->nonce_m,
                                .id = w->node,
                                .job = l->job,
                                .fab = w->fabric_addr.data,
                                .fab_len = w->fabric_addr.len,
                                .hb_port = w->hb_port,
                                .peer_port = w->peer_port};
    bool signed_ok = ok && sd_meet_key_verify(w->daemon_key.data, w->daemon_key.len,
                                              w->daemon_sig.data, w->daemon_sig.len, &said);
    uint32_t s = (uint32_t)l->node, other = ok ? sd_meet__slot_by_uid(cl, w->node) : SD_NO_NODE;
    bool known = other != SD_NO_NODE && other != cl->self && key_known(cl, other);
    const char *why =
        !ok                                     ? "does not prove the job's token"
        : w->node == 0 || w->node == SD_NO_NODE ? "names no daemon id"
        : !signed_ok                            ? "does not prove the key its id names"
        : other == cl->self                     ? "answers with this daemon's own id"
        : known && memcmp(cl->meet.key_of[other], w->daemon_key.data, SD_MEET_KEY) != 0
            ? "has another key than the daemon of that id met here"
        : w->you < 2 || w->you >= SD_MAX_NODES ? "numbers this daemon out of range"
                                               : NULL;
    bool renumber = why == NULL && other != SD_NO_NODE && other != s;
    if (renumber) { /* (met, or named in a table, elsewhere) */
        slot_merge(cl, l, s, other);
        s = other;
    }
    if (why == NULL && sd_meet__slot_fill(cl, s, w->node, w->fabric_addr.data, w->fabric_addr.len,
                                          w->hb_port, NULL) != SD_OK)
        why = "gave a fabric address this daemon cannot use";
    if (why == NULL && renumber) {
        /* the other end numbers this daemon by what the hello said (the slot dialed, gone):
         * this link goes without failing anything there (a bye), and the next dial, from the
         * daemon's slot, tells it the number that stays */
        memcpy(cl->meet.key_of[s], w->daemon_key.data, SD_MEET_KEY);
        SD_INFO("cluster",
                "the daemon at %s (job '%.64s') is daemon %08x, met here before as node %u: "
                "dialing it again as that node",
                addr, l->job, w->node, s);
        sd_cluster__link_bye(l, "renumbered: dialing again", "renumbered");
        cl->peers.dial_fails[s] = 0;
        return;
    }
    if (why == NULL)
        memcpy(cl->meet.key_of[s], w->daemon_key.data, SD_MEET_KEY);
    if (why != NULL) {
        SD_ERROR_SPARSE("cluster", "the daemon at %s (job '%.64s') %s: not heard", addr, l->job,
                        why);
        l->retired = true;
        sd_cluster__link_close(l, why);
        return;
    }
    l->authed = true;
    sd_auth_hb_key(&a, l->nonce_c, l->nonce_m, l->hb_key);
    cl->meet.as[s] = w->you;
    sd_meet__proved(l, l->job);
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

void sd_meet__leader_note(struct sd_cluster *cl, const char *job, uint32_t slot)
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

/* What a job that is gone from here (its registration failed, or it ended) left: its leader's
 * note, and the slot of a leader that was dialed for it and never answered (listed "meeting"),
 * which nothing else names. */
void sd_meet__forget(struct sd_cluster *cl)
{
    uint8_t token[SD_JOB_TOKEN_BYTES];
    for (struct meet_leader **pp = &cl->meet.leaders; *pp;) {
        struct meet_leader *l = *pp;
        if (cl->ev.job_token(cl->ev.ctx, l->name, token)) {
            pp = &l->next;
            continue;
        }
        *pp = l->next;
        free(l);
    }
    for (uint32_t i = 2; i < cl->meet.slots; i++) {
        if (cl->meet.uid_of[i] != 0 || cl->peers.addrs[i][0] == '\0' || cl->by_node[i] != NULL ||
            cl->peers.dialing[i])
            continue;
        bool named = false;
        for (const struct outmsg *o = cl->peers.outbox; o && !named; o = o->next)
            named = o->node == i;
        for (const struct meet_leader *l = cl->meet.leaders; l && !named; l = l->next)
            named = l->slot == i;
        if (!named)
            sd_meet__slot_release(cl, i);
    }
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

/* the port this daemon meets other daemons on: where it listens, else where it would as a
 * job's leader */
static uint32_t meet_port(const struct sd_cluster *cl)
{
    return cl->me.peer_port != 0    ? cl->me.peer_port
           : cl->cfg->peer_port > 0 ? (uint32_t)cl->cfg->peer_port
                                    : SD_MEET_PORT;
}

/* is ip one of this host's addresses: all of 127/8 (Debian names the host 127.0.1.1), or one of
 * its interfaces'? */
static bool host_has(const char *ip)
{
    if (strncmp(ip, "127.", 4) == 0)
        return true;
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

/* leader ("ip:port")'s ip into ip */
static void leader_ip(const char *leader, char *ip, size_t len)
{
    const char *colon = strrchr(leader, ':');
    size_t n = colon != NULL ? (size_t)(colon - leader) : strlen(leader);
    snprintf(ip, len, "%.*s", (int)SD_MIN(n, len - 1), leader);
}

/* does leader ("ip:port") name this daemon's listener: its port, at its fabric address (or,
 * listening on every address, at one of the host's)? */
static bool is_me(const struct sd_cluster *cl, const char *leader)
{
    const char *colon = strrchr(leader, ':');
    const char *host = cl->cfg->fabric_addr;
    if (colon == NULL || strtoul(colon + 1, NULL, 10) != meet_port(cl))
        return false;
    char ip[64];
    leader_ip(leader, ip, sizeof(ip));
    if (host[0] != '\0' && strcmp(host, "0.0.0.0") != 0)
        return strcmp(host, ip) == 0;
    return host_has(ip);
}

void sd_meet__report(struct sd_cluster *cl, const Shard__JobReport *r, const char *leader)
{
    char err[640] = "";
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
    char lip[64] = "";
    if (leader != NULL)
        leader_ip(leader, lip, sizeof(lip));
    if (st == SD_OK && r->job_node == 0 && lip[0] != '\0' && !named_me && host_has(lip)) {
        /* rank 0's node leads: a job whose node-0 ranks name another daemon never forms. On
         * another host, that daemon hears two nodes claim ranks 0..k-1 and says so to both; on
         * this host, where one daemon runs in production, it is said now, not at the
         * registration's deadline (torchrun on one machine: MASTER_ADDR=127.0.0.1, the default
         * port, where a local cluster's daemons do not listen). */
        const char *fab = cl->cfg->fabric_addr;
        if (fab[0] == '\0' || strcmp(fab, "0.0.0.0") == 0)
            fab = "<this host>";
        st = SD_EINVAL;
        snprintf(err, sizeof(err),
                 "job '%s': its ranks name %s the leader, but nothing of this job can listen "
                 "there: the leader is the daemon of rank 0's node, this one, at %s:%u; name "
                 "it (SHARD_LEADER=%s:%u), or name none on this node",
                 r->job, leader, fab, meet_port(cl), fab, meet_port(cl));
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
        sd_meet__leader_note(cl, r->job, cl->self);
        sd_cluster__coord_report(cl, r);
    } else {
        sd_meet__leader_note(cl, r->job, slot);
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

json_t *sd_meet__json(const struct sd_cluster *cl, bool all)
{
    json_t *nodes = json_array();
    char me[16];
    snprintf(me, sizeof(me), "%08x", cl->meet.uid);
    json_t *self = json_pack("{s:i, s:b, s:b, s:s}", "node", (int)cl->self, "self", 1, "link", 0,
                             "state", "self");
    if (all) /* (its own id too: a local user with it could claim it elsewhere) */
        json_object_set_new(self, "id", json_string(me));
    json_array_append_new(nodes, self);
    for (uint32_t i = 2; i < cl->cap; i++) {
        if (cl->meet.uid_of[i] == 0 && cl->peers.addrs[i][0] == '\0')
            continue;
        char id[16];
        snprintf(id, sizeof(id), "%08x", cl->meet.uid_of[i]);
        const struct link *l = cl->by_node[i];
        json_t *o = json_pack("{s:i, s:b, s:b, s:s}", "node", (int)i, "self", 0, "link",
                              l != NULL && l->authed, "state",
                              cl->meet.uid_of[i] == 0 ? "meeting"
                              : !cl->alive[i]         ? "down"
                              : sd_probe_ok(cl, i)    ? "up"
                                                      : "probing");
        if (all) { /* (which daemons it met, where: what a forged link would need; root's) */
            json_object_set_new(o, "id", json_string(id));
            json_object_set_new(o, "peer_addr", json_string(cl->peers.addrs[i]));
        }
        json_array_append_new(nodes, o);
    }
    return nodes;
}

const char *sd_cluster_leader_trouble(const struct sd_cluster *cl, const char *job, char *buf,
                                      size_t len)
{
    uint32_t s = cl != NULL && cl->indep ? sd_meet__leader(cl, job) : SD_NO_NODE;
    if (s == SD_NO_NODE || s == cl->self || s >= cl->cap)
        return NULL;
    if (cl->by_node[s] != NULL && cl->by_node[s]->authed)
        snprintf(buf, len, "this daemon's link to it is up: the leader has not decided");
    else if (cl->peers.dial_fails[s] > 0)
        snprintf(buf, len,
                 "this daemon dialed it %u time(s) without a link (the last: %s): the leader "
                 "is not reachable, or refuses this node (another job secret there, or its "
                 "ranks not registered)",
                 cl->peers.dial_fails[s], cl->peers.dial_why[s]);
    else
        return NULL;
    return buf;
}

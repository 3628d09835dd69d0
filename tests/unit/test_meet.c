/* Independent daemons meeting through a job's leader (daemon/cluster/meet.c, with the handshake
 * of handshake.c, the MACs of auth.c and the daemons' keys of meet_key.c) without sockets: two
 * daemons' cluster state built by hand, A the job's leader (its incoming link) and B the node that
 * dials it (its outgoing link); the messages each link sends are packed, and the test delivers
 * them (or forges others) to the other end, as the wire would; fakes of the links' I/O, the
 * direct links' bookkeeping and the probes. test_meet_trust and test_meet_flood attack real
 * daemons; this one checks each refusal of the leader and of the dialer by itself:
 *  - the meeting: A's challenge, B's hello (keyed by the job's token, signed by B's key), A's
 *    welcome (signed by A's key): each side numbers the other in a slot of its table with its
 *    id, key, fabric address, heartbeat and peer ports, the number the other gives it, adopts the
 *    link (alive) and counts the job proved on it;
 *  - A refuses, unheard and without a slot: a hello for a job it has no token of, one whose MAC
 *    is not the job's token's, one that is not a daemon's link, one of another shardd version
 *    or configuration (naming both), one naming A's own id or a number out of range, one whose
 *    signature does not prove the key (a flipped byte; another daemon's key claiming B's id),
 *    one with a fabric address A's transport cannot use, one when every slot is taken;
 *  - B closes the link, unheard: a welcome whose MAC is not the token's, one naming B's own id,
 *    one numbering B out of range, one whose signature does not prove its key;
 *  - a daemon met again (a second meeting for another job, the same keys) keeps its slot. */
#include "check.h"
#include "cluster/cluster_int.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define CAP 8

/* ---- the wire: the last message each end sent, packed */
struct wire {
    uint8_t buf[8192];
    size_t len;
    int sent;
};

static struct {
    int refused, closed, adopted, proved, probes;
    char refuse[600], close[300], proved_job[64];
    struct wire to_b, to_a; /* what A sent B, what B sent A */
    struct link *la, *lb;
} F;

static void pack(const struct link *l, const Shard__PeerMsg *m)
{
    struct wire *w = l == F.la ? &F.to_b : &F.to_a;
    w->len = shard__peer_msg__get_packed_size(m);
    if (w->len > sizeof(w->buf)) {
        TH_CHECK(false, "a message of %zu bytes", w->len);
        w->len = 0;
        return;
    }
    shard__peer_msg__pack(m, w->buf);
    w->sent++;
}

void sd_cluster__link_send(struct link *l, const Shard__PeerMsg *m)
{
    pack(l, m);
}

void sd_cluster__link_send_raw(struct link *l, const Shard__PeerMsg *m)
{
    pack(l, m);
}

void sd_cluster__refuse(struct link *l, const char *fmt, ...)
{
    (void)l;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(F.refuse, sizeof(F.refuse), fmt, ap);
    va_end(ap);
    F.refused++;
}

void sd_cluster__refuse_text(struct link *l, const char *text)
{
    (void)l;
    snprintf(F.refuse, sizeof(F.refuse), "%s", text);
    F.refused++;
}

void sd_cluster__link_close(struct link *l, const char *why)
{
    l->closing = true;
    snprintf(F.close, sizeof(F.close), "%s", why);
    F.closed++;
}

void sd_cluster__link_bye(struct link *l, const char *reason, const char *why)
{
    (void)reason;
    sd_cluster__link_close(l, why);
}

void sd_cluster__adopt_peer(struct link *l, uint32_t node)
{
    l->node = (int)node;
    l->cl->by_node[node] = l;
    F.adopted++;
}

void sd_meet__proved(struct link *l, const char *job)
{
    (void)l;
    F.proved++;
    snprintf(F.proved_job, sizeof(F.proved_job), "%s", job);
}

void sd_probe_table(struct sd_cluster *cl)
{
    (void)cl;
    F.probes++;
}

void sd_probe_down(struct sd_cluster *cl, uint32_t node)
{
    (void)cl;
    (void)node;
}

bool sd_probe_ok(const struct sd_cluster *cl, uint32_t node)
{
    (void)cl;
    (void)node;
    return true;
}

/* (a cluster's paths, never taken by an independent daemon's handshake) */
void sd_cluster__on_hello(struct link *l, const Shard__PeerHello *h)
{
    (void)l;
    (void)h;
    TH_CHECK(false, "a cluster's hello path taken");
}

void sd_cluster__on_peer_hello(struct link *l, const Shard__PeerHello *h)
{
    (void)l;
    (void)h;
    TH_CHECK(false, "a cluster member's hello path taken");
}

int sd_cluster__install_table(struct sd_cluster *cl, const protobuf_c_boolean *down)
{
    (void)cl;
    (void)down;
    return SD_OK;
}

void sd_cluster__coord_report(struct sd_cluster *cl, const Shard__JobReport *rep)
{
    (void)cl;
    (void)rep;
}

int sd_cluster__listen_peers(struct sd_cluster *cl, const char *host, uint32_t port)
{
    (void)cl;
    (void)host;
    (void)port;
    return SD_OK;
}

int sd_cluster__parse_hostport(const char *spec, struct sockaddr_storage *ss)
{
    (void)spec;
    (void)ss;
    return SD_EINVAL;
}

void sd_cluster__peer_send(struct sd_cluster *cl, uint32_t node, const Shard__PeerMsg *m)
{
    (void)cl;
    (void)node;
    (void)m;
}

void sd_meet__tick(struct sd_cluster *cl, uint64_t now)
{
    (void)cl;
    (void)now;
}

struct meet_wire *sd_meet__wire_new(void)
{
    return calloc(1, 64); /* (its scratch, unused by the handshake) */
}

/* ---- the transport: fabric addresses of 16 bytes, anything else refused */
static int check_addr(struct sd_transport *tp, const void *addr, size_t len, char *why,
                      size_t whylen)
{
    (void)tp;
    (void)addr;
    if (len == 16)
        return SD_OK;
    snprintf(why, whylen, "an address of %zu bytes, not 16", len);
    return SD_EINVAL;
}

static int set_peer(struct sd_transport *tp, uint32_t node, const void *addr, size_t len)
{
    (void)tp;
    (void)node;
    (void)addr;
    (void)len;
    return SD_OK;
}

static void peer_down(struct sd_transport *tp, uint32_t node)
{
    (void)tp;
    (void)node;
}

static const struct sd_transport_ops tp_ops = {
    .name = "fake", .check_addr = check_addr, .set_peer = set_peer, .peer_down = peer_down};

/* ---- the daemons */
static const uint8_t token_j[SD_JOB_TOKEN_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
static const uint8_t token_k[SD_JOB_TOKEN_BYTES] = {9, 9, 9};

struct daemon;
static bool knows_jobs(void *ctx);

/* the jobs j and k registered with their secrets (not on a daemon told to know none) */
static bool job_token(void *ctx, const char *job, uint8_t token[32])
{
    if (knows_jobs(ctx) && (strcmp(job, "j") == 0 || strcmp(job, "k") == 0)) {
        memcpy(token, job[0] == 'j' ? token_j : token_k, SD_JOB_TOKEN_BYTES);
        return true;
    }
    return false;
}

static void nodes_in_use(void *ctx, bool *need, uint32_t n)
{
    (void)ctx;
    (void)need;
    (void)n;
}

struct daemon {
    struct sd_cluster cl;
    struct sd_config cfg;
    struct sd_transport tp;
    struct link link;
    uint8_t addrs[CAP][256];
    size_t addr_len[CAP];
    bool present[CAP], alive[CAP], dialing[CAP], need[CAP];
    protobuf_c_boolean down[CAP];
    uint32_t hb_port[CAP], dial_fails[CAP];
    uint64_t idle_ns[CAP];
    struct link *by_node[CAP];
    char peer_addrs[CAP][SD_PEER_ADDR];
    char dial_why[CAP][256];
    bool no_jobs; /* no job with a secret registered here */
};

static bool knows_jobs(void *ctx)
{
    return !((struct daemon *)ctx)->no_jobs;
}

static void daemon_init(struct daemon *d, uint8_t fab, uint32_t hb, uint32_t peer)
{
    memset(d, 0, sizeof(*d));
    struct sd_cluster *cl = &d->cl;
    cl->cfg = &d->cfg;
    d->tp = (struct sd_transport){.ops = &tp_ops, .n_peers = CAP, .self = 1};
    cl->tp = &d->tp;
    cl->indep = true;
    cl->cap = cl->n = CAP;
    cl->self = 1;
    cl->digest = 0x1234;
    snprintf(cl->summary, sizeof(cl->summary), "provider tcp");
    cl->ev =
        (struct sd_cluster_events){.ctx = d, .job_token = job_token, .nodes_in_use = nodes_in_use};
    cl->addrs = d->addrs;
    cl->addr_len = d->addr_len;
    cl->present = d->present;
    cl->alive = d->alive;
    cl->down_scratch = d->down;
    cl->hb_port = d->hb_port;
    cl->by_node = d->by_node;
    cl->peers.addrs = d->peer_addrs;
    cl->peers.dialing = d->dialing;
    cl->peers.idle_ns = d->idle_ns;
    cl->peers.need = d->need;
    cl->peers.dial_fails = d->dial_fails;
    cl->peers.dial_why = d->dial_why;
    memset(cl->me.addr, fab, 16);
    cl->me.addr_len = 16;
    cl->me.hb_port = hb;
    cl->me.peer_port = peer;
    TH_CHECK(sd_meet__init(cl) == SD_OK && sd_meet__start(cl) == SD_OK, "a daemon's key and table");
    d->alive[1] = d->present[1] = true;
}

static void daemon_free(struct daemon *d)
{
    sd_meet__free(&d->cl);
}

static void link_init(struct daemon *d, bool incoming, int node, const char *job)
{
    struct link *l = &d->link;
    memset(l, 0, sizeof(*l));
    uv_tcp_init(uv_default_loop(), &l->tcp); /* (never connected: its peer's name is "?") */
    l->cl = &d->cl;
    l->incoming = incoming;
    l->peer = true;
    l->node = node;
    snprintf(l->job, sizeof(l->job), "%s", job);
}

static Shard__PeerMsg *delivered(struct wire *w)
{
    return shard__peer_msg__unpack(NULL, w->len, w->buf);
}

/* A (the leader, incoming) and B (dialing A as its slot 2 for job): the challenge and B's hello,
 * which the test delivers (or changes) next; the hello unpacked (free with
 * shard__peer_msg__free_unpacked) */
static Shard__PeerMsg *start(struct daemon *a, struct daemon *b, const char *job)
{
    memset(&F, 0, sizeof(F));
    link_init(a, true, -1, "");
    link_init(b, false, 2, job);
    F.la = &a->link;
    F.lb = &b->link;
    snprintf(b->cl.peers.addrs[2], SD_PEER_ADDR, "127.0.0.1:7701");
    sd_cluster__challenge(F.la);
    Shard__PeerMsg *ch = delivered(&F.to_b);
    TH_CHECK(ch != NULL && ch->msg_case == SHARD__PEER_MSG__MSG_CHALLENGE,
             "A's challenge on the wire");
    if (ch == NULL)
        return NULL;
    sd_cluster__on_unauthed(F.lb, ch);
    shard__peer_msg__free_unpacked(ch, NULL);
    Shard__PeerMsg *h = delivered(&F.to_a);
    TH_CHECK(h != NULL && h->msg_case == SHARD__PEER_MSG__MSG_HELLO && h->hello->peer &&
                 h->hello->node == b->cl.meet.uid && strcmp(h->hello->job, job) == 0,
             "B's hello names its id and the job");
    return h;
}

/* the hello's MAC again, by the job's token, after the test changed the hello */
static void remac(struct daemon *a, Shard__PeerHello *h, const uint8_t *token)
{
    struct sd_auth au = {.key_len = SD_JOB_TOKEN_BYTES};
    memcpy(au.key, token, SD_JOB_TOKEN_BYTES);
    sd_auth_hello_mac(&au, a->link.nonce_c, h->nonce.data, h, h->mac.data);
}

/* no slot of A's holds B, nothing adopted, nothing but the challenge sent (a hello whose MAC
 * proved the token leaves its link authenticated, and refused) */
static bool a_knows_nothing(struct daemon *a, struct daemon *b)
{
    uint32_t used = 0;
    for (uint32_t i = 2; i < CAP; i++)
        used += a->cl.meet.uid_of[i] != 0 && a->cl.meet.uid_of[i] != 77;
    return sd_meet__slot_by_uid(&a->cl, b->cl.meet.uid) == SD_NO_NODE && used == 0 &&
           F.adopted == 0 && F.to_b.sent == 1;
}

static void test_meeting(void)
{
    struct daemon a, b;
    daemon_init(&a, 0xaa, 9001, 7701);
    daemon_init(&b, 0xbb, 9002, 7702);
    Shard__PeerMsg *h = start(&a, &b, "j");
    if (h == NULL)
        return;
    sd_cluster__on_unauthed(F.la, h);
    shard__peer_msg__free_unpacked(h, NULL);
    uint32_t s = sd_meet__slot_by_uid(&a.cl, b.cl.meet.uid);
    TH_CHECK(F.refused == 0 && s != SD_NO_NODE && s >= 2 && F.adopted == 1 && a.link.authed &&
                 a.by_node[s] == F.la && a.alive[s] && F.proved == 1 &&
                 strcmp(F.proved_job, "j") == 0,
             "A: B's hello heard, B in slot %u, the link adopted, job j proved (%s)", s, F.refuse);
    TH_CHECK(s < CAP && a.hb_port[s] == 9002 && a.cl.meet.as[s] == 2 &&
                 memcmp(a.cl.meet.key_of[s], b.cl.meet.key.pub, SD_MEET_KEY) == 0 &&
                 strstr(a.peer_addrs[s], ":7702") != NULL && a.addr_len[s] == 16 &&
                 a.addrs[s][0] == 0xbb,
             "A: B's key, ports, fabric address and the number B gives A (2) in its slot");
    Shard__PeerMsg *w = delivered(&F.to_b);
    TH_CHECK(w != NULL && w->msg_case == SHARD__PEER_MSG__MSG_WELCOME, "A's welcome on the wire");
    if (w == NULL)
        return;
    TH_CHECK(w->welcome->node == a.cl.meet.uid && w->welcome->you == s &&
                 w->welcome->peer_port == 7701,
             "the welcome names A's id, A's number for B and A's peer port");
    F.adopted = F.proved = 0;
    sd_cluster__on_unauthed(F.lb, w);
    shard__peer_msg__free_unpacked(w, NULL);
    TH_CHECK(F.closed == 0 && b.link.authed && F.adopted == 1 && b.by_node[2] == F.lb &&
                 b.alive[2] && b.cl.meet.uid_of[2] == a.cl.meet.uid &&
                 memcmp(b.cl.meet.key_of[2], a.cl.meet.key.pub, SD_MEET_KEY) == 0 &&
                 b.cl.meet.as[2] == s && b.hb_port[2] == 9001 && F.proved == 1,
             "B: A's welcome heard, A in slot 2 with its id, key, ports and B's number (%s)",
             F.close);
    TH_CHECK(memcmp(a.link.hb_key, b.link.hb_key, sizeof(a.link.hb_key)) == 0,
             "both ends derived the same heartbeat key");

    /* met again for another job: the same slot */
    h = start(&a, &b, "k");
    if (h != NULL) {
        sd_cluster__on_unauthed(F.la, h);
        shard__peer_msg__free_unpacked(h, NULL);
    }
    TH_CHECK(F.refused == 0 && sd_meet__slot_by_uid(&a.cl, b.cl.meet.uid) == s &&
                 strcmp(F.proved_job, "k") == 0,
             "A: B met again for job k keeps slot %u (%s)", s, F.refuse);
    daemon_free(&a);
    daemon_free(&b);
}

/* how a case changes B's hello before A hears it */
enum hello_case {
    H_UNKNOWN_JOB,
    H_WRONG_TOKEN,
    H_NOT_PEER,
    H_VERSION,
    H_CONFIG,
    H_OWN_ID,
    H_YOU,
    H_SIG,
    H_STOLEN_ID,
    H_FABRIC,
    H_FULL,
    H_COUNT
};

static void test_hello_refused(void)
{
    static const char *what[H_COUNT] = {"no job of that name",
                                        "its HMAC does not match",
                                        "not a daemon's link",
                                        "runs shardd 0.0.0",
                                        "with [provider verbs]",
                                        "naming itself daemon",
                                        "naming itself daemon",
                                        "does not prove that daemon's key",
                                        "does not prove that daemon's key",
                                        "a fabric address this daemon cannot use",
                                        "cannot take another peer"};
    for (int c = 0; c < H_COUNT; c++) {
        struct daemon a, b, other;
        daemon_init(&a, 0xaa, 9001, 7701);
        daemon_init(&b, 0xbb, 9002, 7702);
        daemon_init(&other, 0xcc, 9003, 7703);
        a.no_jobs = c == H_UNKNOWN_JOB;
        Shard__PeerMsg *m = start(&a, &b, "j");
        if (m == NULL)
            continue;
        Shard__PeerHello *h = m->hello, kept = *h; /* (its own fields, freed with it) */
        uint8_t fab[20];
        memset(fab, 0xbb, sizeof(fab));
        char version[] = "0.0.0", summary[] = "provider verbs";
        uint8_t sig[SD_MEET_SIG];
        switch (c) {
        case H_UNKNOWN_JOB: /* (A has no job j) */
            break;
        case H_WRONG_TOKEN:
            remac(&a, h, token_k);
            break;
        case H_NOT_PEER:
            h->peer = false;
            remac(&a, h, token_j);
            break;
        case H_VERSION:
            h->version = version;
            remac(&a, h, token_j);
            break;
        case H_CONFIG:
            h->config_digest ^= 1;
            h->config_summary = summary;
            remac(&a, h, token_j);
            break;
        case H_OWN_ID:
            h->node = a.cl.meet.uid;
            remac(&a, h, token_j);
            break;
        case H_YOU:
            h->you = SD_MAX_NODES;
            remac(&a, h, token_j);
            break;
        case H_SIG:
            memcpy(sig, h->daemon_sig.data, SD_MEET_SIG);
            sig[5] ^= 0x40;
            h->daemon_sig.data = sig;
            remac(&a, h, token_j);
            break;
        case H_STOLEN_ID: { /* another daemon's key signs a hello claiming B's id */
            struct sd_meet_said said = {.role = 'h',
                                        .nc = a.link.nonce_c,
                                        .nm = h->nonce.data,
                                        .id = h->node,
                                        .job = h->job,
                                        .fab = h->fabric_addr.data,
                                        .fab_len = h->fabric_addr.len,
                                        .hb_port = h->hb_port,
                                        .peer_port = h->peer_port};
            TH_CHECK(sd_meet_key_sign(&other.cl.meet.key, &said, sig), "another key signs");
            h->daemon_key.data = other.cl.meet.key.pub;
            h->daemon_sig.data = sig;
            remac(&a, h, token_j);
            break;
        }
        case H_FABRIC:
            h->fabric_addr.data = fab;
            h->fabric_addr.len = 20;
            /* (B's signature covers the address: signed again, as a B with that address) */
            {
                struct sd_meet_said said = {.role = 'h',
                                            .nc = a.link.nonce_c,
                                            .nm = h->nonce.data,
                                            .id = h->node,
                                            .job = h->job,
                                            .fab = fab,
                                            .fab_len = 20,
                                            .hb_port = h->hb_port,
                                            .peer_port = h->peer_port};
                sd_meet_key_sign(&b.cl.meet.key, &said, sig);
                h->daemon_sig.data = sig;
            }
            remac(&a, h, token_j);
            break;
        case H_FULL: /* slot 2 the only one, taken by a daemon a job needs */
            a.cl.meet.slots = 3;
            a.cl.meet.uid_of[2] = 77;
            a.by_node[2] = &other.link;
            break;
        }
        uint64_t refused0 = a.cl.counts.refused;
        sd_cluster__on_unauthed(F.la, m);
        *h = kept;
        shard__peer_msg__free_unpacked(m, NULL);
        /* (refused as any connection that proves nothing: no daemon says which jobs it has) */
        bool unproved = c == H_UNKNOWN_JOB || c == H_WRONG_TOKEN || c == H_NOT_PEER;
        TH_CHECK(a_knows_nothing(&a, &b) && F.proved == 0 &&
                     (unproved ? a.cl.counts.refused == refused0 + 1
                               : F.refused == 1 && strstr(F.refuse, what[c]) != NULL),
                 "case %d: A refuses (%s), unheard, no slot: '%s'", c, what[c],
                 unproved ? "(counted as unproved)" : F.refuse);
        if (c == H_VERSION)
            TH_CHECK(strstr(F.refuse, SHARD_VERSION) != NULL, "its own version named too");
        daemon_free(&a);
        daemon_free(&b);
        daemon_free(&other);
    }
}

enum welcome_case { W_MAC, W_OWN_ID, W_YOU, W_SIG, W_COUNT };

static void test_welcome_refused(void)
{
    static const char *what[W_COUNT] = {
        "does not prove the job's token", "answers with this daemon's own id",
        "numbers this daemon out of range", "does not prove the key its id names"};
    for (int c = 0; c < W_COUNT; c++) {
        struct daemon a, b;
        daemon_init(&a, 0xaa, 9001, 7701);
        daemon_init(&b, 0xbb, 9002, 7702);
        Shard__PeerMsg *h = start(&a, &b, "j");
        if (h == NULL)
            continue;
        sd_cluster__on_unauthed(F.la, h);
        shard__peer_msg__free_unpacked(h, NULL);
        Shard__PeerMsg *m = delivered(&F.to_b);
        if (m == NULL || m->msg_case != SHARD__PEER_MSG__MSG_WELCOME) {
            TH_CHECK(false, "case %d: a welcome", c);
            continue;
        }
        Shard__PeerWelcome *w = m->welcome, kept = *w; /* (its own fields, freed with it) */
        uint8_t mac[SD_SHA256_BYTES];
        memcpy(mac, w->mac.data, sizeof(mac));
        switch (c) {
        case W_MAC:
            mac[0] ^= 1;
            break;
        case W_OWN_ID: { /* B dialed itself: the welcome is its own, signed with its key */
            w->node = b.cl.meet.uid;
            struct sd_meet_said said = {.role = 'w',
                                        .nc = b.link.nonce_c,
                                        .nm = b.link.nonce_m,
                                        .id = w->node,
                                        .job = "j",
                                        .fab = w->fabric_addr.data,
                                        .fab_len = w->fabric_addr.len,
                                        .hb_port = w->hb_port,
                                        .peer_port = w->peer_port};
            w->daemon_key.data = b.cl.meet.key.pub;
            TH_CHECK(sd_meet_key_sign(&b.cl.meet.key, &said, w->daemon_sig.data), "B signs");
            break;
        }
        case W_YOU:
            w->you = 1;
            break;
        case W_SIG:
            w->daemon_sig.data[3] ^= 0x10;
            break;
        }
        if (c != W_MAC) { /* (A, with the token, MACs what it sends) */
            static const char label[] = "shardd welcome";
            uint32_t f[4] = {w->node, w->hb_port, w->peer_port, w->you};
            struct sd_hmac hm;
            sd_hmac_init(&hm, token_j, SD_JOB_TOKEN_BYTES);
            sd_hmac_update(&hm, label, sizeof(label));
            sd_hmac_update(&hm, b.link.nonce_c, SD_AUTH_NONCE);
            sd_hmac_update(&hm, b.link.nonce_m, SD_AUTH_NONCE);
            sd_hmac_update(&hm, f, sizeof(f));
            sd_hmac_update(&hm, w->fabric_addr.data, w->fabric_addr.len);
            sd_hmac_final(&hm, mac);
        }
        w->mac.data = mac;
        F.adopted = F.proved = 0;
        sd_cluster__on_unauthed(F.lb, m);
        *w = kept;
        shard__peer_msg__free_unpacked(m, NULL);
        TH_CHECK(F.closed == 1 && b.link.closing && !b.link.authed && F.adopted == 0 &&
                     F.proved == 0 && strstr(F.close, what[c]) != NULL && b.cl.meet.uid_of[2] == 0,
                 "case %d: B closes the link unheard (%s): '%s'", c, what[c], F.close);
        daemon_free(&a);
        daemon_free(&b);
    }
}

int main(void)
{
    test_meeting();
    test_hello_refused();
    test_welcome_refused();
    return th_summary("test_meet");
}

/* The handshake of a control link (cluster/auth.h says what is proved): the accepting end's
 * challenge (the coordinator's, or a member's for a job peer's direct link), the connecting
 * end's hello, its check and the welcome, and what an unproved link may say. */
#include "cluster/cluster_int.h"

#include <arpa/inet.h>

/* "a.b.c.d:port" of l's other end, for log lines */
const char *sd_cluster__link_addr(struct link *l, char *buf, size_t len)
{
    struct sockaddr_storage ss;
    int sl = sizeof(ss);
    snprintf(buf, len, "?");
    if (uv_tcp_getpeername(&l->tcp, (struct sockaddr *)&ss, &sl) == 0 && ss.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
        char ip[INET_ADDRSTRLEN];
        uv_ip4_name(a, ip, sizeof(ip));
        snprintf(buf, len, "%s:%u", ip, ntohs(a->sin_port));
    }
    return buf;
}

const char *sd_cluster__link_host(struct link *l, char *buf, size_t len)
{
    sd_cluster__link_addr(l, buf, len);
    char *colon = strrchr(buf, ':');
    if (colon != NULL)
        *colon = '\0';
    return buf;
}

/* A hello on a link that has not proved the key a (the cluster's secret, or an independent
 * daemon's job token): heard only when its MAC is right. Nothing of this node's configuration
 * is said to one that is not. */
bool sd_cluster__hello_verify(struct link *l, const Shard__PeerHello *h, const struct sd_auth *a)
{
    struct sd_cluster *cl = l->cl;
    uint8_t want[SD_SHA256_BYTES];
    char addr[64];
    bool ok = h->nonce.len == SD_AUTH_NONCE && h->mac.len == SD_SHA256_BYTES;
    if (ok) {
        memcpy(l->nonce_m, h->nonce.data, SD_AUTH_NONCE);
        sd_auth_hello_mac(a, l->nonce_c, l->nonce_m, h, want);
        ok = sd_mem_equal(want, h->mac.data, SD_SHA256_BYTES);
    }
    if (!ok) {
        if (!cl->indep) {
            cl->counts.refused++;
            SD_ERROR_SPARSE("cluster",
                            "refusing a daemon at %s that calls itself node %u: its hello does "
                            "not prove the cluster's secret (a different cluster_secret_file, or "
                            "not a daemon of this cluster)",
                            sd_cluster__link_addr(l, addr, sizeof(addr)), h->node);
            sd_cluster__refuse_text(l, "authentication failed: the hello's HMAC does not match "
                                       "this cluster's secret (is cluster_secret_file the same "
                                       "file on every node?)");
        } else {
            sd_cluster__refuse_unproved(l, h->job, "its HMAC does not match the job's token");
        }
        return false;
    }
    l->authed = true;
    sd_auth_hb_key(a, l->nonce_c, l->nonce_m, l->hb_key);
    return true;
}

bool sd_cluster__hello_authentic(struct link *l, const Shard__PeerHello *h)
{
    struct sd_cluster *cl = l->cl;
    if (!sd_cluster__hello_verify(l, h, &cl->auth))
        return false;
    Shard__PeerWelcome w = SHARD__PEER_WELCOME__INIT;
    uint8_t mac[SD_SHA256_BYTES];
    sd_auth_welcome_mac(&cl->auth, l->nonce_c, l->nonce_m, mac);
    w.mac.data = mac;
    w.mac.len = sizeof(mac);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_WELCOME;
    m.welcome = &w;
    sd_cluster__link_send(l, &m);
    return true;
}

void sd_cluster__challenge(struct link *l)
{
    Shard__PeerChallenge ch = SHARD__PEER_CHALLENGE__INIT;
    if (sd_auth_nonce(l->nonce_c) != SD_OK) {
        sd_cluster__link_close(l, "no nonce");
        return;
    }
    ch.nonce.data = l->nonce_c;
    ch.nonce.len = SD_AUTH_NONCE;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_CHALLENGE;
    m.challenge = &ch;
    sd_cluster__link_send(l, &m);
}

/* Admission of an accepted connection, before it proved anything: a flood of connections
 * (thousands a second from one address) must not push a real peer's handshake out. So each
 * source address may hold MAX_UNAUTHED_PER_SOURCE unproved connections and all together
 * MAX_UNAUTHED; past either, the oldest of the source that holds the most goes (a flooder's
 * own, while a peer's single dial waits its turn behind nobody). A source may hold
 * MAX_PROVED_PER_SOURCE proved links (a daemon per host, each one or two): past that, the new
 * connection goes. Evictions are counted (shardctl stats: peers.evicted) and logged sparsely. */
bool sd_cluster__admit(struct sd_cluster *cl, struct link *nl)
{
    struct link *unproved[MAX_UNAUTHED + 1];
    uint32_t n = 0, proved = 0, from_new = 0;
    for (struct link *o = cl->links; o; o = o->next) {
        if (o == nl || o->closing || !o->incoming)
            continue;
        bool same = strcmp(o->host, nl->host) == 0;
        if (o->authed) {
            proved += same;
        } else if (n < MAX_UNAUTHED + 1) {
            unproved[n++] = o;
            from_new += same;
        }
    }
    if (proved >= MAX_PROVED_PER_SOURCE) {
        cl->counts.evicted++;
        SD_WARN_SPARSE("cluster",
                       "a connection from %s refused: that address holds %u proved links to "
                       "this daemon already (at most %d)",
                       nl->host, proved, MAX_PROVED_PER_SOURCE);
        sd_cluster__link_close(nl, "too many links from one address");
        return false;
    }
    if (from_new < MAX_UNAUTHED_PER_SOURCE && n < MAX_UNAUTHED)
        return true;
    /* the source holding the most unproved connections (the new one's, when it is at its
     * cap), and its oldest */
    struct link *victim = NULL;
    uint32_t most = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t c = 0;
        for (uint32_t j = 0; j < n; j++)
            c += strcmp(unproved[i]->host, unproved[j]->host) == 0;
        if (from_new >= MAX_UNAUTHED_PER_SOURCE && strcmp(unproved[i]->host, nl->host) != 0)
            continue;
        if (c > most || (c == most && unproved[i]->created_ns < victim->created_ns)) {
            most = c;
            victim = unproved[i];
        }
    }
    if (victim == NULL)
        return true;
    cl->counts.evicted++;
    SD_WARN_SPARSE("cluster",
                   "closed an unproved connection from %s to admit another: that address holds "
                   "%u of the %u connections that have proved nothing yet (a flood?); %llu "
                   "closed so far",
                   victim->host, most, n + 1, (unsigned long long)cl->counts.evicted);
    sd_cluster__link_close(victim, "evicted: too many unproved connections from its address");
    return true;
}

static void send_hello(struct sd_cluster *cl, struct link *l)
{
    uint8_t mac[SD_SHA256_BYTES];
    if (sd_auth_nonce(l->nonce_m) != SD_OK) {
        sd_cluster__link_close(l, "no nonce");
        return;
    }
    Shard__PeerHello h = SHARD__PEER_HELLO__INIT;
    /* an open cluster's coordinator numbers it (a rejoin asks for the number it had, which its
     * running jobs name); a job peer knows it by its number */
    h.node = cl->open && !l->peer ? SD_NO_NODE : cl->self;
    h.was = cl->open && !l->peer ? cl->self : SD_NO_NODE;
    h.known = cl->open && !l->peer && cl->self != SD_NO_NODE ? cl->n : 0;
    h.peer = l->peer;
    h.peer_port = cl->me.peer_port;
    h.protocol_version = SD_PROTOCOL_VERSION;
    h.config_digest = cl->digest;
    h.fabric_addr.data = cl->me.addr;
    h.fabric_addr.len = cl->me.addr_len;
    h.version = SHARD_VERSION;
    h.config_summary = cl->summary;
    h.hb_port = cl->me.hb_port;
    h.nonce.data = l->nonce_m;
    h.nonce.len = SD_AUTH_NONCE;
    struct sd_auth job_key;
    const struct sd_auth *a = &cl->auth;
    if (cl->indep) { /* its id, the job it dials for, whose token keys the MAC */
        sd_meet__hello_fields(l, &h, &job_key);
        a = &job_key;
    }
    sd_auth_hello_mac(a, l->nonce_c, l->nonce_m, &h, mac);
    h.mac.data = mac;
    h.mac.len = sizeof(mac);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_HELLO;
    m.hello = &h;
    sd_cluster__link_send(l, &m);
}

/* Before the other end proved the secret: the coordinator hears a hello, a member the
 * challenge, the welcome or a refusal; anything else closes the link. True if m was one. */
void sd_cluster__on_unauthed(struct link *l, const Shard__PeerMsg *m)
{
    struct sd_cluster *cl = l->cl;
    char addr[64];
    if (l->incoming) { /* the coordinator's links; a member's from its job peers */
        if (m->msg_case != SHARD__PEER_MSG__MSG_HELLO)
            sd_cluster__link_close(l, "a message before the hello");
        else if (cl->indep)
            sd_meet__on_hello(l, m->hello);
        else if (cl->self == 0)
            sd_cluster__on_hello(l, m->hello);
        else
            sd_cluster__on_peer_hello(l, m->hello);
        return;
    }
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_CHALLENGE:
        if (m->challenge->nonce.len != SD_AUTH_NONCE) {
            sd_cluster__link_close(l, "a challenge without a nonce");
            return;
        }
        memcpy(l->nonce_c, m->challenge->nonce.data, SD_AUTH_NONCE);
        send_hello(cl, l);
        return;
    case SHARD__PEER_MSG__MSG_WELCOME: {
        if (cl->indep) {
            sd_meet__on_welcome(l, m->welcome);
            return;
        }
        uint8_t want[SD_SHA256_BYTES];
        sd_auth_welcome_mac(&cl->auth, l->nonce_c, l->nonce_m, want);
        if (m->welcome->mac.len != SD_SHA256_BYTES ||
            !sd_mem_equal(want, m->welcome->mac.data, SD_SHA256_BYTES)) {
            SD_ERROR_SPARSE("cluster",
                            "the %s at %s does not prove the cluster's secret (a different "
                            "cluster_secret_file?): not heard",
                            l->peer ? "job peer" : "coordinator",
                            sd_cluster__link_addr(l, addr, sizeof(addr)));
            l->retired = l->peer;
            sd_cluster__link_close(l, "the other end did not prove the secret");
            return;
        }
        l->authed = true;
        sd_auth_hb_key(&cl->auth, l->nonce_c, l->nonce_m, l->hb_key);
        if (l->peer)
            sd_cluster__adopt_peer(l, (uint32_t)l->node);
        return;
    }
    case SHARD__PEER_MSG__MSG_REFUSE:
        if (l->peer) { /* a job peer's refusal: that link only */
            char why[200];
            snprintf(why, sizeof(why), "refused: %.180s", m->refuse->reason);
            SD_WARN_SPARSE("cluster", "node %d refused a direct link: %s", l->node,
                           m->refuse->reason);
            l->retired = true;
            sd_cluster__link_close(l, why);
            return;
        }
        /* not proved: a refusal from whoever answers at the coordinator's address ends the
         * start-up, where it names a misconfiguration, but not a cluster this node is in */
        SD_ERROR("cluster", "the daemon at %s refused this node: %s", cl->cfg->coordinator,
                 m->refuse->reason);
        if (!cl->ready) {
            cl->fatal = true;
            uv_stop(cl->loop);
        }
        sd_cluster__link_close(l, "refused");
        return;
    default:
        sd_cluster__link_close(l, "a message before the coordinator proved the secret");
        return;
    }
}

/* Meeting an independent daemon as a process that is not one (peer_hello.h). */
#include "peer_hello.h"
#include "check.h"
#include "peer.h"
#include "sd/frame.h"
#include "sd/hmac.h"
#include "sd/status.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void th_job_token(const char *secret, const char *job, struct sd_auth *a)
{
    static const char label[] = "shardd job token";
    struct sd_hmac m;
    sd_hmac_init(&m, secret, strlen(secret));
    sd_hmac_update(&m, label, sizeof(label));
    sd_hmac_update(&m, job, strlen(job));
    sd_hmac_final(&m, a->key);
    a->key_len = SD_SHA256_BYTES;
}

/* the daemons' configuration digest (the options of extra, ranks per node from each job), or
 * one of a daemon with another op_timeout_ms */
static uint64_t digest(const char *const *extra, bool same, char *summary, size_t len)
{
    struct sd_config cfg;
    th_peer_config(&cfg, NULL, extra);
    if (!same)
        cfg.op_timeout_ms = 1234;
    cfg.ranks_per_node = 0;
    return sd_config_digest(&cfg, summary, len);
}

size_t th_peer_fabric(const char *const *extra, uint8_t buf[TH_PEER_FABRIC])
{
    struct sd_config cfg;
    th_peer_config(&cfg, NULL, extra);
    size_t len = 0;
    struct sockaddr_in nowhere = {.sin_family = AF_INET, .sin_port = htons(1)};
    inet_pton(AF_INET, "127.0.0.1", &nowhere.sin_addr);
    for (int r = 0; r < 2 + 2 * (int)cfg.data_lanes; r++) {
        bool empty = r == 1 && cfg.rendezvous_bytes == 0;
        buf[len++] = empty ? 0 : 16;
        if (!empty) {
            memcpy(&buf[len], &nowhere, 16);
            len += 16;
        }
    }
    return len;
}

void th_hello(const struct th_hello *p, struct th_meet *mt)
{
    mt->answer = -1;
    mt->why[0] = '\0';
    mt->id = 0;
    mt->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (p->src != NULL) {
        struct sockaddr_in s = {.sin_family = AF_INET};
        inet_pton(AF_INET, p->src, &s.sin_addr);
        TH_CHECK(bind(mt->fd, (struct sockaddr *)&s, sizeof(s)) == 0, "bind to %s", p->src);
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(mt->fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        TH_CHECK(false, "connect to the daemon's peer port %d", p->port);
        return;
    }
    uint8_t nc[SD_AUTH_NONCE], nm[SD_AUTH_NONCE];
    Shard__PeerMsg *ch = th_peer_recv(mt->fd, 5000);
    bool got = ch != NULL && ch->msg_case == SHARD__PEER_MSG__MSG_CHALLENGE &&
               ch->challenge->nonce.len == SD_AUTH_NONCE;
    if (got)
        memcpy(nc, ch->challenge->nonce.data, SD_AUTH_NONCE);
    if (ch)
        shard__peer_msg__free_unpacked(ch, NULL);
    TH_CHECK(got, "the daemon's challenge");
    if (!got)
        return;
    sd_auth_nonce(nm);
    uint8_t fabric[TH_PEER_FABRIC], mac[SD_SHA256_BYTES];
    size_t flen = th_peer_fabric(p->extra, fabric);
    struct sd_meet_key own = {0};
    const struct sd_meet_key *pair = p->pair;
    if (pair == NULL) {
        TH_CHECK(sd_meet_key_new(&own) == SD_OK, "a key pair");
        pair = &own;
    }
    Shard__PeerHello h = SHARD__PEER_HELLO__INIT;
    h.node = mt->id = p->id != 0 ? p->id : pair->id;
    h.was = UINT32_MAX;
    h.peer = true;
    h.peer_port = 1;
    h.protocol_version = SD_PROTOCOL_VERSION;
    h.version = SHARD_VERSION;
    char summary[1024];
    h.config_digest = digest(p->extra, !p->other_config, summary, sizeof(summary));
    h.config_summary = summary;
    h.fabric_addr.data = p->fab != NULL ? (uint8_t *)p->fab : fabric;
    h.fabric_addr.len = p->fab != NULL ? p->fab_len : flen;
    h.nonce.data = nm;
    h.nonce.len = SD_AUTH_NONCE;
    h.job = (char *)p->job;
    h.you = 7;
    uint8_t sig[SD_MEET_SIG];
    struct sd_meet_said said = {.role = 'h',
                                .nc = nc,
                                .nm = nm,
                                .id = h.node,
                                .job = h.job,
                                .fab = h.fabric_addr.data,
                                .fab_len = h.fabric_addr.len,
                                .hb_port = h.hb_port,
                                .peer_port = h.peer_port};
    TH_CHECK(sd_meet_key_sign(pair, &said, sig), "a hello's signature");
    h.daemon_key.data = (uint8_t *)pair->pub;
    h.daemon_key.len = SD_MEET_KEY;
    h.daemon_sig.data = sig;
    h.daemon_sig.len = SD_MEET_SIG;
    sd_meet_key_free(&own);
    sd_auth_hello_mac(p->key, nc, nm, &h, mac);
    h.mac.data = mac;
    h.mac.len = sizeof(mac);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_HELLO;
    m.hello = &h;
    th_peer_send(mt->fd, &m);
    Shard__PeerMsg *w = th_peer_recv(mt->fd, 5000);
    if (w == NULL)
        return;
    mt->answer = (int)w->msg_case;
    if (w->msg_case == SHARD__PEER_MSG__MSG_REFUSE)
        snprintf(mt->why, sizeof(mt->why), "%s", w->refuse->reason);
    if (w->msg_case == SHARD__PEER_MSG__MSG_WELCOME) {
        mt->hb_port = w->welcome->hb_port;
        mt->welcome_id = w->welcome->node;
        if (w->welcome->daemon_key.len == SD_MEET_KEY)
            memcpy(mt->welcome_key, w->welcome->daemon_key.data, SD_MEET_KEY);
    }
    shard__peer_msg__free_unpacked(w, NULL);
}

/* Heartbeats that no work on the event loop can delay (DESIGN.md section 6, "no hang"). A thread
 * of its own sends a datagram to each peer every heartbeat interval and records when each peer's
 * last arrived; the loop's liveness check (links.c) takes the later of that and the control
 * link's last message. A loop held up by some long piece of work (a huge registration, a slow
 * disk) therefore neither stops this node's heartbeats, so its peers keep it, nor declares its
 * peers down when it runs again. A loop that stopped for good must not be vouched for forever:
 * the thread sends only while the loop ticked within stall_ms. A stopped process (SIGSTOP, a
 * freeze of the machine) stops the thread too, and its peers declare it down as before.
 *
 * Datagram: magic, node, sequence number and an HMAC-SHA256 (the first 16 bytes) over them,
 * keyed by the session key of the control link's handshake with that peer (cluster/auth.h): 32
 * bytes little-endian. One whose magic, node, source address or MAC is not a known peer's, or
 * whose sequence number is not above the last one heard from it (a replay), is dropped: a
 * process without the cluster's secret cannot keep a stopped node alive. The socket is bound
 * to the node's configured address. IPv4 only; with an IPv6 coordinator the control links'
 * heartbeats alone count (logged). */
#include "cluster/heartbeat.h"
#include "sd/hmac.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stddef.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#define HB_MAGIC 0x53444842u /* "SDHB" */

#define HB_MAC 16

struct hb_msg {
    uint32_t magic, node;
    uint64_t seq;
    uint8_t mac[HB_MAC];
};
_Static_assert(sizeof(struct hb_msg) == 32, "the heartbeat datagram is 32 bytes");

struct hb_peer {
    struct sockaddr_in addr; /* port 0: not a peer */
    uint8_t key[SD_SHA256_BYTES];
    uint64_t last_seq; /* the highest sequence number heard in this session */
    uint32_t as;       /* the node it knows this one by (UINT32_MAX: self) */
};

static void hb_mac(const uint8_t *key, const struct hb_msg *m, uint8_t out[HB_MAC])
{
    struct sd_hmac h;
    uint8_t full[SD_SHA256_BYTES];
    sd_hmac_init(&h, key, SD_SHA256_BYTES);
    sd_hmac_update(&h, m, offsetof(struct hb_msg, mac));
    sd_hmac_final(&h, full);
    memcpy(out, full, HB_MAC);
}

struct sd_heartbeat {
    int fd;
    int wake_fd;           /* an eventfd: the stop (so the thread sleeps until its next send) */
    _Atomic uint32_t self; /* (an open cluster numbers its members after they started) */
    uint32_t n;
    uint64_t digest;
    uint64_t interval_ns, stall_ns;
    pthread_t thread;
    atomic_bool stop;
    atomic_uint_fast64_t loop_tick_ns;
    _Atomic uint64_t *last_seen_ns; /* [n] */
    pthread_mutex_t lock;           /* peers */
    struct hb_peer *peers;          /* [n] */
    _Atomic uint64_t sent, received, dropped;
};

static void *hb_thread(void *arg)
{
    struct sd_heartbeat *hb = arg;
    uint64_t next = sd_now_ns(), seq = 0;
    while (!atomic_load(&hb->stop)) {
        uint64_t now = sd_now_ns();
        if (now >= next) {
            next = now + hb->interval_ns;
            /* vouch for the loop only while it runs */
            if (now - atomic_load(&hb->loop_tick_ns) < hb->stall_ns) {
                struct hb_msg m = {.magic = HB_MAGIC, .node = atomic_load(&hb->self), .seq = ++seq};
                pthread_mutex_lock(&hb->lock);
                for (uint32_t i = 0; i < hb->n; i++) {
                    if (hb->peers[i].addr.sin_port == 0)
                        continue;
                    m.node =
                        hb->peers[i].as != UINT32_MAX ? hb->peers[i].as : atomic_load(&hb->self);
                    hb_mac(hb->peers[i].key, &m, m.mac);
                    ssize_t w = sendto(hb->fd, &m, sizeof(m), MSG_DONTWAIT | MSG_NOSIGNAL,
                                       (const struct sockaddr *)&hb->peers[i].addr,
                                       sizeof(hb->peers[i].addr));
                    if (w == (ssize_t)sizeof(m))
                        hb->sent++;
                }
                pthread_mutex_unlock(&hb->lock);
            }
        }
        /* until the next send, a datagram, or the stop: an idle daemon wakes twice a second */
        struct pollfd p[2] = {{.fd = hb->fd, .events = POLLIN},
                              {.fd = hb->wake_fd, .events = POLLIN}};
        int ms = (int)((next - SD_MIN(next, sd_now_ns())) / 1000000) + 1;
        if (poll(p, 2, ms) <= 0 || !(p[0].revents & POLLIN))
            continue;
        for (;;) {
            struct hb_msg m;
            struct sockaddr_in from;
            socklen_t flen = sizeof(from);
            ssize_t r =
                recvfrom(hb->fd, &m, sizeof(m), MSG_DONTWAIT, (struct sockaddr *)&from, &flen);
            if (r < 0)
                break;
            bool ok = r == (ssize_t)sizeof(m) && m.magic == HB_MAGIC && m.node < hb->n &&
                      m.node != atomic_load(&hb->self);
            if (ok) {
                pthread_mutex_lock(&hb->lock);
                struct hb_peer *p2 = &hb->peers[m.node];
                uint8_t want[HB_MAC];
                ok = p2->addr.sin_port != 0 && p2->addr.sin_addr.s_addr == from.sin_addr.s_addr;
                if (ok)
                    hb_mac(p2->key, &m, want);
                ok = ok && sd_mem_equal(want, m.mac, HB_MAC) && m.seq > p2->last_seq;
                if (ok)
                    p2->last_seq = m.seq;
                pthread_mutex_unlock(&hb->lock);
            }
            if (!ok) {
                hb->dropped++;
                continue;
            }
            atomic_store(&hb->last_seen_ns[m.node], sd_now_ns());
            hb->received++;
        }
    }
    return NULL;
}

int sd_heartbeat_start(struct sd_heartbeat **hb_p, const struct sd_heartbeat_param *p,
                       uint16_t *port_p)
{
    uint32_t self = p->self, n = p->n;
    uint64_t digest = p->digest, interval_ms = p->interval_ms, stall_ms = p->stall_ms;
    const char *bind_addr = p->bind_addr;
    uint16_t port = p->port;
    struct sd_heartbeat *hb = calloc(1, sizeof(*hb));
    if (hb == NULL)
        return SD_ENOMEM;
    hb->fd = -1;
    hb->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    atomic_store(&hb->self, self);
    hb->n = n;
    hb->digest = digest;
    hb->interval_ns = interval_ms * 1000000ULL;
    hb->stall_ns = stall_ms * 1000000ULL;
    atomic_store(&hb->loop_tick_ns, sd_now_ns());
    hb->last_seen_ns = calloc(n, sizeof(*hb->last_seen_ns));
    hb->peers = calloc(n, sizeof(*hb->peers));
    int status = SD_ENOMEM;
    if (hb->last_seen_ns == NULL || hb->peers == NULL || hb->wake_fd < 0)
        goto err_free;
    pthread_mutex_init(&hb->lock, NULL);
    hb->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in any = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_ANY)};
    /* the node's own address: datagrams from elsewhere never reach the socket */
    if (bind_addr != NULL && bind_addr[0] != '\0' &&
        inet_pton(AF_INET, bind_addr, &any.sin_addr) != 1) {
        SD_WARN("cluster", "heartbeats: '%s' is not an IPv4 address; bound to every address",
                bind_addr);
        any.sin_addr.s_addr = htonl(INADDR_ANY);
    }
    socklen_t len = sizeof(any);
    if (hb->fd < 0 || bind(hb->fd, (struct sockaddr *)&any, sizeof(any)) != 0 ||
        getsockname(hb->fd, (struct sockaddr *)&any, &len) != 0) {
        status = -errno;
        SD_ERROR("cluster", "heartbeat socket (UDP port %u): %s", port, strerror(errno));
        goto err_free;
    }
    if (pthread_create(&hb->thread, NULL, hb_thread, hb) != 0) {
        status = SD_ENOMEM;
        goto err_free;
    }
    *port_p = ntohs(any.sin_port);
    *hb_p = hb;
    return SD_OK;

err_free:
    if (hb->fd >= 0)
        close(hb->fd);
    if (hb->wake_fd >= 0)
        close(hb->wake_fd);
    free(hb->last_seen_ns);
    free(hb->peers);
    free(hb);
    return status;
}

void sd_heartbeat_set_peer(struct sd_heartbeat *hb, uint32_t node, const struct sockaddr *addr,
                           uint16_t port, const uint8_t *key, uint32_t as)
{
    if (hb == NULL || node >= hb->n || node == atomic_load(&hb->self))
        return;
    struct sockaddr_in a = {0};
    if (key == NULL)
        port = 0; /* no session key: not a peer */
    if (addr != NULL && addr->sa_family == AF_INET && port != 0) {
        a = *(const struct sockaddr_in *)addr;
        a.sin_port = htons(port);
    } else if (addr != NULL && port != 0) {
        SD_WARN_SPARSE("cluster",
                       "node %u: heartbeats over UDP are IPv4 only; the control "
                       "link's heartbeats alone count for it",
                       node);
    }
    pthread_mutex_lock(&hb->lock);
    hb->peers[node].addr = a;
    hb->peers[node].last_seq = 0; /* a new session: its own key and numbers */
    hb->peers[node].as = as;
    if (key != NULL)
        memcpy(hb->peers[node].key, key, SD_SHA256_BYTES);
    pthread_mutex_unlock(&hb->lock);
    atomic_store(&hb->last_seen_ns[node], 0);
}

uint64_t sd_heartbeat_last_seen(const struct sd_heartbeat *hb, uint32_t node)
{
    return hb != NULL && node < hb->n ? atomic_load(&hb->last_seen_ns[node]) : 0;
}

void sd_heartbeat_tick(struct sd_heartbeat *hb)
{
    if (hb != NULL)
        atomic_store(&hb->loop_tick_ns, sd_now_ns());
}

void sd_heartbeat_counts(const struct sd_heartbeat *hb, uint64_t *sent_p, uint64_t *received_p,
                         uint64_t *dropped_p)
{
    *sent_p = hb ? hb->sent : 0;
    *received_p = hb ? hb->received : 0;
    *dropped_p = hb ? hb->dropped : 0;
}

void sd_heartbeat_stop(struct sd_heartbeat *hb)
{
    if (hb == NULL)
        return;
    atomic_store(&hb->stop, true);
    uint64_t one = 1;
    if (write(hb->wake_fd, &one, sizeof(one)) != sizeof(one))
        SD_WARN("cluster", "waking the heartbeat thread: %s", strerror(errno));
    pthread_join(hb->thread, NULL);
    close(hb->fd);
    close(hb->wake_fd);
    pthread_mutex_destroy(&hb->lock);
    free(hb->last_seen_ns);
    free(hb->peers);
    free(hb);
}

void sd_heartbeat_set_self(struct sd_heartbeat *hb, uint32_t self)
{
    if (hb == NULL)
        return;
    pthread_mutex_lock(&hb->lock);
    atomic_store(&hb->self, self);
    if (self < hb->n)
        memset(&hb->peers[self], 0, sizeof(hb->peers[self]));
    pthread_mutex_unlock(&hb->lock);
}

/* Heartbeats that no work on the event loop can delay (DESIGN.md section 6, "no hang"). A thread
 * of its own sends a datagram to each peer every heartbeat interval and records when each peer's
 * last arrived; the loop's liveness check (links.c) takes the later of that and the control
 * link's last message. A loop held up by some long piece of work (a huge registration, a slow
 * disk) therefore neither stops this node's heartbeats, so its peers keep it, nor declares its
 * peers down when it runs again. A loop that stopped for good must not be vouched for forever:
 * the thread sends only while the loop ticked within stall_ms. A stopped process (SIGSTOP, a
 * freeze of the machine) stops the thread too, and its peers declare it down as before.
 *
 * Datagram: magic, node, cluster config digest, sequence number, 24 bytes little-endian. One
 * whose magic, digest, node or source address is not a known peer's is dropped. IPv4 only; with
 * an IPv6 coordinator the control links' heartbeats alone count (logged). */
#include "cluster/heartbeat.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define HB_MAGIC 0x53444842u /* "SDHB" */

struct hb_msg {
    uint32_t magic, node;
    uint64_t digest, seq;
};
_Static_assert(sizeof(struct hb_msg) == 24, "the heartbeat datagram is 24 bytes");

struct sd_heartbeat {
    int fd;
    uint32_t self, n;
    uint64_t digest;
    uint64_t interval_ns, stall_ns;
    pthread_t thread;
    atomic_bool stop;
    atomic_uint_fast64_t loop_tick_ns;
    _Atomic uint64_t *last_seen_ns; /* [n] */
    pthread_mutex_t lock;           /* peers */
    struct sockaddr_in *peers;      /* [n]: port 0 = not a peer */
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
                struct hb_msg m = {
                    .magic = HB_MAGIC, .node = hb->self, .digest = hb->digest, .seq = ++seq};
                pthread_mutex_lock(&hb->lock);
                for (uint32_t i = 0; i < hb->n; i++) {
                    if (hb->peers[i].sin_port == 0)
                        continue;
                    ssize_t w =
                        sendto(hb->fd, &m, sizeof(m), MSG_DONTWAIT | MSG_NOSIGNAL,
                               (const struct sockaddr *)&hb->peers[i], sizeof(hb->peers[i]));
                    if (w == (ssize_t)sizeof(m))
                        hb->sent++;
                }
                pthread_mutex_unlock(&hb->lock);
            }
        }
        struct pollfd p = {.fd = hb->fd, .events = POLLIN};
        int ms = (int)((next - SD_MIN(next, sd_now_ns())) / 1000000) + 1;
        if (poll(&p, 1, SD_MIN(ms, 100)) <= 0)
            continue;
        for (;;) {
            struct hb_msg m;
            struct sockaddr_in from;
            socklen_t flen = sizeof(from);
            ssize_t r =
                recvfrom(hb->fd, &m, sizeof(m), MSG_DONTWAIT, (struct sockaddr *)&from, &flen);
            if (r < 0)
                break;
            bool ok = r == (ssize_t)sizeof(m) && m.magic == HB_MAGIC && m.digest == hb->digest &&
                      m.node < hb->n && m.node != hb->self;
            if (ok) {
                pthread_mutex_lock(&hb->lock);
                const struct sockaddr_in *p2 = &hb->peers[m.node];
                ok = p2->sin_port != 0 && p2->sin_addr.s_addr == from.sin_addr.s_addr;
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

int sd_heartbeat_start(struct sd_heartbeat **hb_p, uint32_t self, uint32_t n, uint64_t digest,
                       uint64_t interval_ms, uint64_t stall_ms, uint16_t port, uint16_t *port_p)
{
    struct sd_heartbeat *hb = calloc(1, sizeof(*hb));
    if (hb == NULL)
        return SD_ENOMEM;
    hb->fd = -1;
    hb->self = self;
    hb->n = n;
    hb->digest = digest;
    hb->interval_ns = interval_ms * 1000000ULL;
    hb->stall_ns = stall_ms * 1000000ULL;
    atomic_store(&hb->loop_tick_ns, sd_now_ns());
    hb->last_seen_ns = calloc(n, sizeof(*hb->last_seen_ns));
    hb->peers = calloc(n, sizeof(*hb->peers));
    int status = SD_ENOMEM;
    if (hb->last_seen_ns == NULL || hb->peers == NULL)
        goto err_free;
    pthread_mutex_init(&hb->lock, NULL);
    hb->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in any = {
        .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_ANY)};
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
    free(hb->last_seen_ns);
    free(hb->peers);
    free(hb);
    return status;
}

void sd_heartbeat_set_peer(struct sd_heartbeat *hb, uint32_t node, const struct sockaddr *addr,
                           uint16_t port)
{
    if (hb == NULL || node >= hb->n || node == hb->self)
        return;
    struct sockaddr_in a = {0};
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
    hb->peers[node] = a;
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
    pthread_join(hb->thread, NULL);
    close(hb->fd);
    pthread_mutex_destroy(&hb->lock);
    free(hb->last_seen_ns);
    free(hb->peers);
    free(hb);
}

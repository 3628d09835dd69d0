/* The heartbeat thread (heartbeat.c): datagrams to and from the peers on a thread of their own,
 * so that work on the event loop cannot delay them. */
#ifndef SD_HEARTBEAT_H
#define SD_HEARTBEAT_H

#include <stdint.h>
#include <sys/socket.h>

struct sd_heartbeat;

/* What the heartbeat thread serves: node self of n (the cluster's digest in every datagram),
 * a UDP socket on bind_addr (an IPv4 address; "" or NULL: every address) and port (0: any free
 * one), a datagram to every peer each interval_ms while the loop ticked (sd_heartbeat_tick)
 * within stall_ms. */
struct sd_heartbeat_param {
    uint32_t self, n;
    uint64_t digest;
    uint64_t interval_ms, stall_ms;
    const char *bind_addr;
    uint16_t port;
};
/* Start the thread; *port_p says which port it bound. */
int sd_heartbeat_start(struct sd_heartbeat **hb_p, const struct sd_heartbeat_param *p,
                       uint16_t *port_p);
/* node's address (its control link's peer address), heartbeat port and the session key of the
 * link's handshake (SD_SHA256_BYTES); port 0 or no key: not a peer. as: the node number node
 * knows this one by (an independent daemon's peers number it their own way; UINT32_MAX: self),
 * which the datagrams to it carry. */
void sd_heartbeat_set_peer(struct sd_heartbeat *hb, uint32_t node, const struct sockaddr *addr,
                           uint16_t port, const uint8_t *key, uint32_t as);
/* this node is self from now on (an open cluster's coordinator numbered it) */
void sd_heartbeat_set_self(struct sd_heartbeat *hb, uint32_t self);
/* when node's last datagram arrived (sd_now_ns), 0 if none */
uint64_t sd_heartbeat_last_seen(const struct sd_heartbeat *hb, uint32_t node);
/* the loop is running */
void sd_heartbeat_tick(struct sd_heartbeat *hb);
void sd_heartbeat_counts(const struct sd_heartbeat *hb, uint64_t *sent_p, uint64_t *received_p,
                         uint64_t *dropped_p);
void sd_heartbeat_stop(struct sd_heartbeat *hb);

#endif

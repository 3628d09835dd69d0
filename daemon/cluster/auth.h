/* Who may join the cluster (DESIGN.md section 6, "a peer proves it belongs before it is heard"):
 * every daemon holds the cluster's secret, a file only the daemon's user reads
 * (cluster_secret_file). A link is heard once its hello carries an HMAC-SHA256, keyed by the
 * secret, over a nonce the coordinator chose for this connection, the member's own nonce and the
 * hello's fields; the coordinator proves itself with an HMAC over both nonces (its welcome).
 * Heartbeat datagrams carry an HMAC keyed by a key of that handshake's own, and a sequence
 * number that must grow: a datagram from another session or a replayed one is dropped. */
#ifndef SD_CLUSTER_AUTH_H
#define SD_CLUSTER_AUTH_H

#include "sd/config.h"
#include "sd/hmac.h"
#include "shard.pb-c.h"

#include <stddef.h>
#include <stdint.h>

#define SD_AUTH_NONCE   32
#define SD_AUTH_KEY_MAX 4096

struct sd_auth {
    uint8_t key[SD_AUTH_KEY_MAX];
    size_t key_len;
};

/* The secret from cfg->cluster_secret_file: a regular file of 16..4096 bytes that the daemon's
 * user owns and nobody else may read. When it is missing and the coordinator is on this machine
 * (a loopback address) it is made: 32 random bytes, mode 0600 (several daemons starting at once
 * make it once). SD_OK, or err says what is wrong and what to do. */
int sd_auth_load(const struct sd_config *cfg, struct sd_auth *a, char *err, size_t errlen);
/* a fresh nonce */
int sd_auth_nonce(uint8_t out[SD_AUTH_NONCE]);
/* the hello's MAC over both nonces and its fields */
void sd_auth_hello_mac(const struct sd_auth *a, const uint8_t *nc, const uint8_t *nm,
                       const Shard__PeerHello *h, uint8_t out[SD_SHA256_BYTES]);
/* the coordinator's welcome, and the heartbeat key of the session */
void sd_auth_welcome_mac(const struct sd_auth *a, const uint8_t *nc, const uint8_t *nm,
                         uint8_t out[SD_SHA256_BYTES]);
void sd_auth_hb_key(const struct sd_auth *a, const uint8_t *nc, const uint8_t *nm,
                    uint8_t out[SD_SHA256_BYTES]);

#endif

/* An independent daemon's identity (meet_key.c): an Ed25519 key pair made at each start; the
 * daemon's id is the first 32 bits of its public key's SHA-256, and every hello and welcome signs
 * what it says of its daemon over its connection's nonces. Tests that play a daemon use it too. */
#ifndef SD_CLUSTER_MEET_KEY_H
#define SD_CLUSTER_MEET_KEY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SD_MEET_KEY   32 /* a public key's bytes */
#define SD_MEET_SIG   64 /* a signature's */
#define SD_MEET_NONCE 32 /* a connection's nonces' (SD_AUTH_NONCE) */

struct evp_pkey_st;
struct sd_meet_key {
    struct evp_pkey_st *pkey; /* the pair (libcrypto) */
    uint8_t pub[SD_MEET_KEY];
    uint32_t id; /* what pub names: never 0 nor 0xffffffff */
};

/* what a hello ('h') or a welcome ('w') says of its daemon, signed with its key */
struct sd_meet_said {
    char role;
    const uint8_t *nc, *nm; /* the connection's nonces: the acceptor's, the dialer's */
    uint32_t id;
    const char *job;
    const uint8_t *fab;
    size_t fab_len;
    uint32_t hb_port, peer_port;
};

/* a new key pair (SD_OK, or SD_EIO: libcrypto could not make one) */
int sd_meet_key_new(struct sd_meet_key *k);
void sd_meet_key_free(struct sd_meet_key *k);
/* the id a public key names */
uint32_t sd_meet_key_id(const uint8_t pub[SD_MEET_KEY]);
bool sd_meet_key_sign(const struct sd_meet_key *k, const struct sd_meet_said *s,
                      uint8_t sig[SD_MEET_SIG]);
/* is sig pub's over s, and does pub name s->id? */
bool sd_meet_key_verify(const uint8_t *pub, size_t pub_len, const uint8_t *sig, size_t sig_len,
                        const struct sd_meet_said *s);

#endif

/* Meeting an independent daemon as a process that is not one (tests of what a network process,
 * or the holder of one job's secret, can do to the daemons): the handshake of a control link,
 * forged to taste. Built into the tests that use it, with sd_cluster (the MACs). */
#ifndef TH_PEER_HELLO_H
#define TH_PEER_HELLO_H

#include "cluster/auth.h"
#include "cluster/meet_key.h"
#include "sd/config.h"
#include "shard.pb-c.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* the token the ranks of job hand their daemons (libshard's: an HMAC of the job's secret) */
void th_job_token(const char *secret, const char *job, struct sd_auth *a);

/* A hello on a connection to 127.0.0.1:port from the address src (NULL: any) for job, MAC'd
 * with key, signed with the key pair pair (NULL: a new one) as the daemon id (0: the one the
 * pair names; another is a claim the signature does not prove), claiming the fabric address fab
 * (fab_len bytes; NULL: the rails the daemons' configuration opens, each naming 127.0.0.1:1,
 * where nothing listens) and the daemons' configuration (the options extra, as they were given
 * them) or another. */
struct th_hello {
    int port;
    const char *src;
    const char *job;
    uint32_t id;
    const struct sd_auth *key;
    const struct sd_meet_key *pair;
    const uint8_t *fab;
    size_t fab_len;
    const char *const *extra;
    bool other_config; /* a daemon configured otherwise (op_timeout_ms 1234) */
};
/* what came of it: the connection (-1: none), the first answer's kind (-1: none), a refusal's
 * reason, a welcome's heartbeat port */
struct th_meet {
    int fd;
    uint32_t id; /* the id the hello claimed */
    int answer;
    char why[1100];
    uint32_t hb_port;
    uint32_t welcome_id;              /* a welcome's daemon id */
    uint8_t welcome_key[SD_MEET_KEY]; /* and its public key */
};
void th_hello(const struct th_hello *h, struct th_meet *mt);

/* a fabric address of the form the daemons' configuration (the options extra) publishes: its
 * rails (control, clear-to-send with rendezvous only, two per data lane), each naming
 * 127.0.0.1:1, where nothing listens; its length */
#define TH_PEER_FABRIC ((2 + 2 * SD_MAX_DATA_LANES) * 17)
size_t th_peer_fabric(const char *const *extra, uint8_t buf[TH_PEER_FABRIC]);

#endif

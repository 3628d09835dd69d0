/* SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104): how daemons prove to each other that they
 * hold the cluster's secret (cluster/links.c, cluster/heartbeat.c). */
#ifndef SD_HMAC_H
#define SD_HMAC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SD_SHA256_BYTES 32
/* a job's token: HMAC-SHA256 of its name keyed with its secret (shard_model_t.job_secret) */
#define SD_JOB_TOKEN_BYTES SD_SHA256_BYTES

struct sd_sha256 {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t block[64];
    size_t fill;
};

void sd_sha256_init(struct sd_sha256 *s);
void sd_sha256_update(struct sd_sha256 *s, const void *data, size_t len);
void sd_sha256_final(struct sd_sha256 *s, uint8_t out[SD_SHA256_BYTES]);

/* HMAC-SHA256 over the pieces data[i] of len[i] bytes, one after the other */
struct sd_hmac {
    struct sd_sha256 inner, outer;
};
void sd_hmac_init(struct sd_hmac *m, const void *key, size_t key_len);
void sd_hmac_update(struct sd_hmac *m, const void *data, size_t len);
void sd_hmac_final(struct sd_hmac *m, uint8_t out[SD_SHA256_BYTES]);

/* Equal, in a time that does not depend on where they differ. */
bool sd_mem_equal(const void *a, const void *b, size_t len);

#endif

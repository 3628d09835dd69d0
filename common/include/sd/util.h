/* Small helpers: monotonic time, hashing, integer math. */
#ifndef SD_UTIL_H
#define SD_UTIL_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#define SD_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define SD_MIN(a, b)     ((a) < (b) ? (a) : (b))
#define SD_MAX(a, b)     ((a) > (b) ? (a) : (b))
#define SD_CACHELINE     64

uint64_t sd_now_ns(void);

/* FNV-1a 64-bit; chain by passing the previous hash as seed (SD_FNV_SEED to start). */
#define SD_FNV_SEED 0xcbf29ce484222325ULL
uint64_t sd_hash_bytes(uint64_t seed, const void *data, size_t len);
uint64_t sd_hash_u64(uint64_t seed, uint64_t v);
uint64_t sd_hash_str(uint64_t seed, const char *s);

static inline uint64_t sd_round_up(uint64_t v, uint64_t m)
{
    return (v + m - 1) / m * m;
}
uint64_t sd_gcd(uint64_t a, uint64_t b);
uint64_t sd_lcm(uint64_t a, uint64_t b);

/* Format a byte count as "64.0 MiB" into buf. */
const char *sd_fmt_bytes(char *buf, size_t len, uint64_t bytes);
/* Are the len bytes at s well-formed UTF-8 (no overlong forms, surrogates or code points past
 * U+10FFFF, as JSON needs)? */
bool sd_utf8_valid(const char *s, size_t len);

#endif

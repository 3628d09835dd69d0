#include "sd/util.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

uint64_t sd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

uint64_t sd_hash_bytes(uint64_t seed, const void *data, size_t len)
{
    const unsigned char *p = data;
    uint64_t h = seed;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

uint64_t sd_hash_u64(uint64_t seed, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    return sd_hash_bytes(seed, b, sizeof(b));
}

uint64_t sd_hash_str(uint64_t seed, const char *s)
{
    /* hash the terminating NUL too, so ("ab","c") and ("a","bc") differ */
    return sd_hash_bytes(seed, s, strlen(s) + 1);
}

uint64_t sd_gcd(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

uint64_t sd_lcm(uint64_t a, uint64_t b)
{
    if (a == 0 || b == 0)
        return 0;
    return a / sd_gcd(a, b) * b;
}

const char *sd_fmt_bytes(char *buf, size_t len, uint64_t bytes)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < SD_ARRAY_SIZE(units)) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    else
        snprintf(buf, len, "%.1f %s", v, units[u]);
    return buf;
}

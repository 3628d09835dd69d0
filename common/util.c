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

bool sd_utf8_valid(const char *s, size_t len)
{
    const uint8_t *p = (const uint8_t *)s, *end = p + len;
    while (p < end) {
        uint8_t b = *p;
        uint32_t cp, min;
        int n;
        if (b < 0x80) {
            p++;
            continue;
        } else if ((b & 0xe0) == 0xc0) {
            n = 1, cp = b & 0x1f, min = 0x80;
        } else if ((b & 0xf0) == 0xe0) {
            n = 2, cp = b & 0x0f, min = 0x800;
        } else if ((b & 0xf8) == 0xf0) {
            n = 3, cp = b & 0x07, min = 0x10000;
        } else {
            return false; /* a continuation byte first, or 0xf8.. */
        }
        if (end - p <= n)
            return false;
        for (int i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        /* overlong forms, UTF-16 surrogates and past U+10FFFF are not UTF-8 */
        if (cp < min || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
            return false;
        p += n + 1;
    }
    return true;
}

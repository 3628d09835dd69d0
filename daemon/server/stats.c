/* Latency samples: the most recent SD_LAT_SAMPLES per operation; quantiles on demand. */
#include "stats.h"

#include <stdlib.h>
#include <string.h>

const uint64_t sd_lat_bounds_ns[SD_LAT_BOUNDS] = {
    1000ULL,         2500ULL,         5000ULL,          10000ULL,         25000ULL,
    50000ULL,        100000ULL,       250000ULL,        500000ULL,        1000000ULL,
    2500000ULL,      5000000ULL,      10000000ULL,      25000000ULL,      50000000ULL,
    100000000ULL,    250000000ULL,    500000000ULL,     1000000000ULL,    2500000000ULL,
    5000000000ULL,   10000000000ULL,  25000000000ULL,   50000000000ULL,   100000000000ULL,
    250000000000ULL, 500000000000ULL, 1000000000000ULL, 2500000000000ULL, 5000000000000ULL};

void sd_latency_add(struct sd_latency *l, uint64_t ns)
{
    l->samples_ns[l->count % SD_LAT_SAMPLES] = ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
    l->count++;
    l->sum_ns += ns;
    unsigned b = 0;
    while (b < SD_LAT_BOUNDS && ns > sd_lat_bounds_ns[b])
        b++;
    l->bins[b]++;
}

void sd_latency_window(int op, unsigned *first)
{
    switch (op) {
    case SD_OP_STEP:
    case SD_OP_INIT:
        *first = 9; /* 1 ms */
        break;
    case SD_OP_SAVE:
        *first = 12; /* 10 ms */
        break;
    default:
        *first = 3; /* 10 us */
        break;
    }
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

double sd_latency_quantile_us(const struct sd_latency *l, double q)
{
    uint32_t n = l->count < SD_LAT_SAMPLES ? (uint32_t)l->count : SD_LAT_SAMPLES;
    if (n == 0)
        return 0.0;
    uint32_t tmp[SD_LAT_SAMPLES];
    memcpy(tmp, l->samples_ns, n * sizeof(tmp[0]));
    qsort(tmp, n, sizeof(tmp[0]), cmp_u32);
    uint32_t idx = (uint32_t)(q * (double)(n - 1) + 0.5);
    return tmp[idx] / 1000.0;
}

const char *const sd_link_names[SD_LINK_COUNT] = {"intra_package", "intra_node", "inter_node_sent",
                                                  "inter_node_recv"};

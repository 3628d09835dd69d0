/* The gather pool's offset allocator: hand cases, then a property test on random sequences:
 * live extents never overlap, stay inside the pool, and an allocation fails only when no gap of
 * that size exists. */
#include "check.h"
#include "slot_pool.h"
#include "sd/status.h"

#include <stdlib.h>

static int gap_exists(const struct sd_slot_pool *p, uint64_t len, uint64_t align)
{
    uint64_t start = 0;
    for (uint32_t i = 0; i <= p->n_used; i++) {
        uint64_t cand = (start + align - 1) / align * align;
        uint64_t limit = i < p->n_used ? p->used[i].off : p->capacity;
        if (cand <= limit && limit - cand >= len)
            return 1;
        if (i < p->n_used)
            start = p->used[i].off + p->used[i].len;
    }
    return 0;
}

int main(void)
{
    struct sd_slot_pool p;
    uint64_t a, b, c, d;
    TH_CHECK(sd_slot_pool_init(&p, 1000, 8) == 0, "init");
    TH_CHECK(sd_slot_pool_alloc(&p, 100, 64, &a) == 0 && a == 0, "first at 0");
    TH_CHECK(sd_slot_pool_alloc(&p, 100, 64, &b) == 0 && b == 128, "aligned to 64: %llu",
             (unsigned long long)b);
    TH_CHECK(sd_slot_pool_alloc(&p, 700, 64, &c) == 0 && c == 256, "third at 256");
    TH_CHECK(sd_slot_pool_alloc(&p, 100, 64, &d) == SD_ENOSPC, "full: no 100 bytes at 960");
    sd_slot_pool_free(&p, b);
    TH_CHECK(sd_slot_pool_alloc(&p, 120, 64, &d) == 0 && d == 128, "reuses the freed hole");
    TH_CHECK(sd_slot_pool_used_bytes(&p) == 920, "used bytes");
    TH_CHECK(sd_slot_pool_alloc(&p, 2000, 64, &d) == SD_ENOSPC, "larger than the pool");
    sd_slot_pool_fini(&p);

    srand(1234);
    int overlaps = 0, wrong_fail = 0, outside = 0, allocs = 0;
    for (int trial = 0; trial < 2000; trial++) {
        uint64_t cap = 1024 + (uint64_t)(rand() % 65536);
        sd_slot_pool_init(&p, cap, 32);
        uint64_t live[32];
        int n = 0;
        for (int op = 0; op < 100; op++) {
            if (n > 0 && rand() % 3 == 0) {
                int k = rand() % n;
                sd_slot_pool_free(&p, live[k]);
                live[k] = live[--n];
                continue;
            }
            uint64_t len = 1 + (uint64_t)(rand() % (int)(cap / 4));
            int possible = p.n_used < p.max_used && gap_exists(&p, len, 64);
            uint64_t off;
            int st = sd_slot_pool_alloc(&p, len, 64, &off);
            if (st != 0) {
                wrong_fail += possible;
                continue;
            }
            allocs++;
            live[n++] = off;
            outside += off % 64 != 0 || off + len > cap;
        }
        for (uint32_t i = 0; i + 1 < p.n_used; i++)
            overlaps += p.used[i].off + p.used[i].len > p.used[i + 1].off;
        sd_slot_pool_fini(&p);
    }
    TH_CHECK(allocs > 50000, "property test made %d allocations", allocs);
    TH_CHECK(overlaps == 0, "%d overlapping live extents", overlaps);
    TH_CHECK(outside == 0, "%d extents misaligned or outside the pool", outside);
    TH_CHECK(wrong_fail == 0, "%d allocations failed although a gap existed", wrong_fail);
    return th_summary("test_slot_pool");
}

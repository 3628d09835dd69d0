/* The local ranks' waiting calls (daemon/jobs/barrier.c), alone: hand cases, then random sequences
 * of arrivals and takes against a second model kept in the test (a set of ranks and their tags):
 * the count, who waits, the tags given back, the first arrival and the overdue rule agree. */
#include "barrier.h"
#include "check.h"
#include "sd/status.h"

#include <stdlib.h>

int main(void)
{
    struct sd_barrier b;
    struct sd_req q;
    bool present[8];
    TH_CHECK(sd_barrier_init(&b, 3) == SD_OK && b.n == 3 && b.arrived == 0, "init 3 ranks");
    TH_CHECK(!sd_barrier_full(&b) && !sd_barrier_take(&b, 1, &q), "empty: nothing to take");
    TH_CHECK(sd_barrier_arrive(&b, 1, 11, 1000) && b.first_ns == 1000, "rank 1 arrives first");
    TH_CHECK(!sd_barrier_arrive(&b, 1, 12, 1100), "rank 1 again: refused");
    TH_CHECK(!sd_barrier_arrive(&b, 3, 13, 1100), "rank 3 of 3 ranks: refused");
    TH_CHECK(sd_barrier_waits(&b, 1) && !sd_barrier_waits(&b, 0) && !sd_barrier_waits(&b, 7),
             "who waits");
    TH_CHECK(!sd_barrier_overdue(&b, 1500, 500, present), "500 ns is not past 500");
    TH_CHECK(sd_barrier_overdue(&b, 1501, 500, present) && !present[0] && present[1] && !present[2],
             "overdue at 1501 with rank 1 present");
    TH_CHECK(sd_barrier_arrive(&b, 0, 10, 1200) && sd_barrier_arrive(&b, 2, 14, 1300) &&
                 sd_barrier_full(&b) && b.first_ns == 1000,
             "full; the first arrival stays");
    TH_CHECK(!sd_barrier_overdue(&b, 99999, 500, present), "a full barrier is not overdue");
    TH_CHECK(sd_barrier_take(&b, 1, &q) && q.tag == 11 && q.since_ns == 1000 && q.parked,
             "rank 1's call back: its first tag (the refused one left it alone)");
    TH_CHECK(!sd_barrier_take(&b, 1, &q) && b.arrived == 2, "taken once");
    TH_CHECK(sd_barrier_take(&b, 0, &q) && q.tag == 10 && sd_barrier_take(&b, 2, &q) &&
                 q.tag == 14 && b.arrived == 0,
             "the others");
    TH_CHECK(sd_barrier_arrive(&b, 2, 20, 5000) && b.first_ns == 5000,
             "an empty barrier's next first arrival");
    sd_barrier_fini(&b);
    TH_CHECK(b.req == NULL && b.n == 0, "fini");

    /* random sequences against the model */
    srand(4321);
    for (int trial = 0; trial < 200; trial++) {
        uint32_t n = 1 + (uint32_t)(rand() % 8);
        bool in[8] = {false};
        uint64_t tag[8] = {0}, since[8] = {0}, first = 0, now = 0;
        uint32_t count = 0;
        bool ok = sd_barrier_init(&b, n) == SD_OK;
        for (int op = 0; op < 400 && ok; op++) {
            uint32_t r = (uint32_t)(rand() % (n + 1)); /* n: out of range */
            now += 1 + (uint64_t)(rand() % 5);
            if (rand() % 2) {
                uint64_t t = (uint64_t)rand();
                bool took = sd_barrier_arrive(&b, r, t, now);
                bool expect = r < n && !in[r];
                ok = took == expect;
                if (expect) {
                    if (count++ == 0)
                        first = now;
                    in[r] = true;
                    tag[r] = t;
                    since[r] = now;
                }
            } else {
                bool took = sd_barrier_take(&b, r, &q);
                bool expect = r < n && in[r];
                ok = took == expect && (!took || (q.tag == tag[r] && q.since_ns == since[r]));
                if (expect) {
                    in[r] = false;
                    count--;
                }
            }
            ok = ok && b.arrived == count && sd_barrier_full(&b) == (count == n) &&
                 (count == 0 || b.first_ns == first);
            uint64_t timeout = (uint64_t)(rand() % 50);
            bool over = count > 0 && count < n && now - first > timeout;
            bool got = sd_barrier_overdue(&b, now, timeout, present);
            ok = ok && got == over;
            for (uint32_t i = 0; ok && got && i < n; i++)
                ok = present[i] == in[i];
            for (uint32_t i = 0; ok && i <= n; i++)
                ok = sd_barrier_waits(&b, i) == (i < n && in[i]);
        }
        TH_CHECK(ok, "trial %d (%u ranks): the barrier and the model differ", trial, n);
        sd_barrier_fini(&b);
    }
    return th_summary("test_barrier");
}

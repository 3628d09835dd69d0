/* The schedule planner (common/schedule.c): hand cases of a trainer's step (gathers, reuse,
 * persistence, prefetch issue positions), digests, bad entries; and a property test on
 * thousands of random schedules: every fetch's gather is live at the fetch and until the
 * release that ends the hold, a unit never has two live gathers (one copy per unit), gathers
 * live at the same time never share a byte, none lies past the planned peak, the peak is at
 * least the lower bound, issue positions never decrease. Layer schedules print the worst
 * peak / lower bound. */
#include "harness.h"
#include "sd/schedule.h"
#include "sd/status.h"

#include <stdlib.h>
#include <string.h>

#define MAXN 512
#define MAXU 64

static struct sd_ival iv[MAXN];
static uint32_t iv_unit[MAXN], occ[MAXN], scratch[3 * MAXU + MAXN];

static struct sd_sched_plan plan_of(void)
{
    return (struct sd_sched_plan){.iv = iv, .iv_unit = iv_unit, .occ = occ};
}

/* forward F/R per layer, backward F/R/P in reverse: one micro-step */
static uint32_t trainer(uint32_t *ops, uint32_t L, uint32_t micro)
{
    uint32_t n = 0;
    for (uint32_t m = 0; m < micro; m++) {
        for (uint32_t l = 0; l < L; l++) {
            ops[n++] = sd_sched_entry(SD_SCHED_FETCH, l);
            ops[n++] = sd_sched_entry(SD_SCHED_RELEASE, l);
        }
        for (uint32_t l = L; l-- > 0;) {
            ops[n++] = sd_sched_entry(SD_SCHED_FETCH, l);
            ops[n++] = sd_sched_entry(SD_SCHED_RELEASE, l);
            ops[n++] = sd_sched_entry(SD_SCHED_PUSH, l);
        }
    }
    return n;
}

/* the properties; returns the number of violations */
static int check(const uint32_t *ops, uint32_t n, const uint64_t *bytes, uint32_t U,
                 const struct sd_sched_plan *p, uint64_t align)
{
    int bad = 0;
    uint32_t holds[MAXU] = {0}, cur[MAXU];
    for (uint32_t u = 0; u < U; u++)
        cur[u] = SD_SCHED_NONE;
    for (uint32_t pos = 0; pos < n; pos++) {
        uint32_t u = sd_sched_unit_of(ops[pos]);
        enum sd_sched_op op = sd_sched_op_of(ops[pos]);
        if (op == SD_SCHED_FETCH) {
            uint32_t I = p->occ[pos];
            if (I >= p->n_iv || p->iv_unit[I] != u || p->iv[I].start > pos || p->iv[I].end <= pos)
                bad++; /* the fetch's gather is not live here */
            if (holds[u]++ == 0)
                cur[u] = I;
            else
                bad += I != cur[u]; /* a held unit stays where it is */
        } else {
            bad += op != SD_SCHED_RELEASE && op != SD_SCHED_PUSH;
            if (op == SD_SCHED_RELEASE && holds[u] > 0 && --holds[u] == 0)
                bad += cur[u] < p->n_iv && p->iv[cur[u]].end < pos + 1; /* freed while held */
        }
    }
    for (uint32_t u = 0; u < U; u++) /* held at the end: live to the end */
        bad += holds[u] > 0 && cur[u] < p->n_iv && p->iv[cur[u]].end != n;
    for (uint32_t i = 0; i < p->n_iv; i++) {
        const struct sd_ival *a = &p->iv[i];
        bad += a->start >= a->end || a->end > n || a->off % align != 0 ||
               a->off + a->size > p->peak || a->size != bytes[p->iv_unit[i]];
        if (i > 0 && p->iv[i - 1].start > a->start)
            bad++; /* issue order */
        for (uint32_t j = i + 1; j < p->n_iv; j++) {
            const struct sd_ival *b = &p->iv[j];
            bool time = a->start < b->end && b->start < a->end;
            bool space = a->off < b->off + b->size && b->off < a->off + a->size;
            bad += time && space;
            bad += time && p->iv_unit[i] == p->iv_unit[j]; /* one copy per unit */
        }
    }
    bad += p->peak < p->lower_bound;
    return bad;
}

int main(void)
{
    uint32_t ops[MAXN];
    uint64_t bytes[MAXU];
    struct sd_sched_plan p = plan_of();

    /* hand cases on 4 layers, one micro-step: F0 R0 F1 R1 F2 R2 F3 R3 | F3 R3 P3 F2 R2 P2 ... */
    uint32_t n = trainer(ops, 4, 1);
    TH_CHECK(n == 20, "trainer schedule has %u calls", n);
    for (int u = 0; u < 4; u++)
        bytes[u] = 1000;
    struct sd_sched_params on_demand = {.align = 64};
    TH_CHECK(sd_sched_plan_build(ops, n, bytes, 4, &on_demand, &p, scratch) == SD_OK, "plan");
    TH_CHECK(p.n_iv == 8, "on demand, no reuse: a gather per fetch (8), got %u", p.n_iv);
    TH_CHECK(p.iv[0].start == 0 && p.iv[0].end == 2 && p.iv[4].start == 8 && p.iv[4].end == 10,
             "lifetimes are fetch to release: [%u,%u) [%u,%u)", p.iv[0].start, p.iv[0].end,
             p.iv[4].start, p.iv[4].end);
    TH_CHECK(p.peak == 1024 && p.lower_bound == 1024, "one unit live at a time: peak %llu",
             (unsigned long long)p.peak);
    struct sd_sched_params reuse = {.reuse_distance = 2, .align = 64};
    sd_sched_plan_build(ops, n, bytes, 4, &reuse, &p, scratch);
    TH_CHECK(p.n_iv == 7 && p.occ[8] == p.occ[6],
             "reuse: unit 3's backward fetch right after its release keeps it (7 gathers, %u)",
             p.n_iv);
    struct sd_sched_params ahead = {.prefetch_depth = 2, .align = 64};
    sd_sched_plan_build(ops, n, bytes, 4, &ahead, &p, scratch);
    /* gathers 0 and 1 go at the start; gather 2 once the fetch of gather 0 (position 0) passed */
    TH_CHECK(p.iv[0].start == 0 && p.iv[1].start == 0 && p.iv[2].start == 1 && p.iv[3].start == 3,
             "prefetch depth 2: issue positions %u %u %u %u", p.iv[0].start, p.iv[1].start,
             p.iv[2].start, p.iv[3].start);
    TH_CHECK(check(ops, n, bytes, 4, &p, 64) == 0, "prefetch plan properties");
    struct sd_sched_params bytes_cap = {.prefetch_depth = 3, .prefetch_bytes = 2048, .align = 64};
    sd_sched_plan_build(ops, n, bytes, 4, &bytes_cap, &p, scratch);
    TH_CHECK(p.iv[2].start == 1, "prefetch_bytes 2048 holds two 1000-byte gathers: issue %u",
             p.iv[2].start);
    bytes[3] = 100;
    struct sd_sched_params persist = {.persist_bytes = 512, .align = 64};
    sd_sched_plan_build(ops, n, bytes, 4, &persist, &p, scratch);
    TH_CHECK(p.iv_unit[0] == 3 && p.iv[0].start == 0 && p.iv[0].end == n && p.n_iv == 7,
             "a unit under persist_bytes has one gather for the whole step");
    TH_CHECK(check(ops, n, bytes, 4, &p, 64) == 0, "persist plan properties");
    ops[3] = sd_sched_entry(SD_SCHED_FETCH, 9);
    TH_CHECK(sd_sched_plan_build(ops, n, bytes, 4, &persist, &p, scratch) == SD_EINVAL,
             "a unit beyond the model is refused");
    ops[3] = 0xf0000000u;
    TH_CHECK(sd_sched_plan_build(ops, n, bytes, 4, &persist, &p, scratch) == SD_EINVAL,
             "an unknown op is refused");
    n = trainer(ops, 4, 1);
    uint64_t d1 = sd_sched_digest(ops, n);
    uint32_t t = ops[4];
    ops[4] = ops[6];
    ops[6] = t;
    TH_CHECK(d1 != sd_sched_digest(ops, n) && d1 != sd_sched_digest(ops, n - 1),
             "digests tell a reordering and a shorter schedule apart");

    /* property test: random schedules, random parameters */
    srand(77);
    int trials = 4000, violations = 0;
    for (int tr = 0; tr < trials; tr++) {
        uint32_t U = 1 + (uint32_t)(rand() % 40);
        n = 1 + (uint32_t)(rand() % MAXN);
        for (uint32_t u = 0; u < U; u++)
            bytes[u] = 1 + (uint64_t)(rand() % 200000);
        uint32_t held[MAXU] = {0};
        for (uint32_t pos = 0; pos < n; pos++) {
            uint32_t u = (uint32_t)rand() % U;
            int r = rand() % 10;
            if (r < 4)
                ops[pos] = sd_sched_entry(SD_SCHED_FETCH, u), held[u]++;
            else if (r < 8 && held[u] > 0)
                ops[pos] = sd_sched_entry(SD_SCHED_RELEASE, u), held[u]--;
            else if (r < 9)
                ops[pos] = sd_sched_entry(SD_SCHED_RELEASE, u); /* unmatched: ignored */
            else
                ops[pos] = sd_sched_entry(SD_SCHED_PUSH, u);
        }
        struct sd_sched_params prm = {
            .prefetch_depth = (uint32_t)(rand() % 5),
            .prefetch_bytes = rand() % 2 ? 0 : (uint64_t)(rand() % 400000),
            .reuse_distance = rand() % 3 == 0 ? UINT32_MAX : (uint32_t)(rand() % 6),
            .persist_bytes = rand() % 3 == 0 ? (uint64_t)(rand() % 50000) : 0,
            .align = 64};
        int st = sd_sched_plan_build(ops, n, bytes, U, &prm, &p, scratch);
        int b = st != SD_OK ? 1 : check(ops, n, bytes, U, &p, 64);
        if (b && violations == 0)
            printf("trial %d: %d violations (n %u, U %u, depth %u, reuse %u)\n", tr, b, n, U,
                   prm.prefetch_depth, prm.reuse_distance);
        violations += b;
    }
    TH_CHECK(violations == 0, "%d violations in %d random schedules", violations, trials);
    printf("%d random schedules planned without a violation\n", trials - (violations > 0));

    /* trainer schedules: blocks of near-equal size between a larger first and last unit */
    double worst = 1.0;
    for (int tr = 0; tr < 300; tr++) {
        uint32_t L = 8 + (uint32_t)(rand() % 40), micro = 1 + (uint32_t)(rand() % 2);
        for (uint32_t l = 0; l < L; l++)
            bytes[l] = (l == 0 || l == L - 1 ? 4 : 1) * (uint64_t)(1000000 + rand() % 50000);
        n = trainer(ops, L, micro);
        if (n > MAXN)
            continue;
        struct sd_sched_params prm = {
            .prefetch_depth = 1 + (uint32_t)(rand() % 3), .reuse_distance = 2, .align = 64};
        sd_sched_plan_build(ops, n, bytes, L, &prm, &p, scratch);
        TH_CHECK(check(ops, n, bytes, L, &p, 64) == 0, "trainer schedule %d", tr);
        double r = (double)p.peak / (double)p.lower_bound;
        worst = r > worst ? r : worst;
    }
    TH_CHECK(worst <= 1.1, "trainer schedules: peak up to %.3f x the lower bound", worst);
    printf("trainer schedules: worst planned peak / lower bound %.3f\n", worst);
    return th_summary("test_schedule");
}

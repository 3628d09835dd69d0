/* The offline pool planner: hand cases; a property test on thousands of random schedules (no two
 * intervals live at the same time share a byte, every interval lies below the planned peak,
 * the peak is at least the lower bound); and layer schedules like a trainer's (forward 0..L-1,
 * backward L-1..0, a prefetch window; blocks of near-equal size between a large embedding and
 * output layer), with the peak against the lower bound printed and guarded at 1.15x. */
#include "harness.h"
#include "sd/interval.h"

#include <stdlib.h>

static int check_placement(const struct sd_ival *iv, uint32_t n, uint64_t peak, uint64_t align)
{
    int bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        bad += iv[i].off % align != 0 || iv[i].off + iv[i].size > peak;
        for (uint32_t j = i + 1; j < n; j++) {
            bool time = iv[i].start < iv[j].end && iv[j].start < iv[i].end;
            bool space = iv[i].off < iv[j].off + iv[j].size && iv[j].off < iv[i].off + iv[i].size;
            bad += time && space;
        }
    }
    return bad;
}

/* a trainer's step over L layers of the given sizes: fetch i in forward, release it; fetch in
 * backward in reverse; a gather starts `window` fetches before its use */
static uint32_t layer_schedule(struct sd_ival *iv, uint32_t L, const uint64_t *sizes,
                               uint32_t window)
{
    uint32_t n = 0, pos = 0;
    for (uint32_t pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < L; i++, pos++) {
            uint32_t layer = pass == 0 ? i : L - 1 - i;
            uint32_t start = pos >= window ? pos - window : 0;
            iv[n++] = (struct sd_ival){.start = start, .end = pos + 1, .size = sizes[layer]};
        }
    return n;
}

int main(void)
{
    /* hand cases: three overlapping take the sum; disjoint ones share offset 0 */
    struct sd_ival a[3] = {{0, 4, 100, 0}, {1, 3, 50, 0}, {2, 5, 25, 0}};
    uint64_t peak = sd_ival_plan(a, 3, 1);
    TH_CHECK(peak == 175 && check_placement(a, 3, peak, 1) == 0, "overlapping: peak %llu",
             (unsigned long long)peak);
    struct sd_ival b[3] = {{0, 1, 100, 0}, {1, 2, 100, 0}, {2, 3, 100, 0}};
    peak = sd_ival_plan(b, 3, 64);
    TH_CHECK(peak == 128 && b[0].off == 0 && b[1].off == 0 && b[2].off == 0,
             "disjoint intervals reuse offset 0: peak %llu", (unsigned long long)peak);
    TH_CHECK(sd_ival_plan(NULL, 0, 64) == 0, "empty");
    TH_CHECK(sd_ival_max_load(a, 3, 1) == 175, "lower bound");

    /* property test */
    srand(4242);
    static struct sd_ival iv[256];
    int violations = 0, below_bound = 0;
    double worst = 1.0, sum = 0;
    int trials = 3000;
    for (int t = 0; t < trials; t++) {
        uint32_t n = 1 + (uint32_t)(rand() % 200), span = 1 + (uint32_t)(rand() % 300);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t s = (uint32_t)(rand() % span), len = 1 + (uint32_t)(rand() % 40);
            iv[i] = (struct sd_ival){
                .start = s, .end = s + len, .size = 1 + (uint64_t)(rand() % 100000)};
        }
        uint64_t align = 64;
        peak = sd_ival_plan(iv, n, align);
        uint64_t bound = sd_ival_max_load(iv, n, align);
        violations += check_placement(iv, n, peak, align);
        below_bound += peak < bound;
        double r = (double)peak / (double)bound;
        worst = r > worst ? r : worst;
        sum += r;
    }
    TH_CHECK(violations == 0, "%d overlaps or intervals past the peak in %d random schedules",
             violations, trials);
    TH_CHECK(below_bound == 0, "a peak below the lower bound is impossible: %d", below_bound);
    printf("random schedules: peak / lower bound mean %.3f, worst %.3f over %d trials\n",
           sum / trials, worst, trials);

    /* trainer-like schedules */
    double layer_worst = 1.0, tiny_worst = 1.0;
    for (int t = 0; t < 500; t++) {
        uint32_t L = 2 + (uint32_t)(rand() % 60), window = 1 + (uint32_t)(rand() % 4);
        uint64_t sizes[64];
        /* a transformer: blocks within 5% of each other, the embedding and the output layer
         * (first and last unit) four times larger */
        for (uint32_t i = 0; i < L; i++)
            sizes[i] = (i == 0 || i == L - 1 ? 4 : 1) * (uint64_t)(1000000 + rand() % 50000);
        uint32_t n = layer_schedule(iv, L, sizes, window);
        peak = sd_ival_plan(iv, n, 64);
        uint64_t bound = sd_ival_max_load(iv, n, 64);
        TH_CHECK(check_placement(iv, n, peak, 64) == 0, "layer schedule %d overlaps", t);
        double r = (double)peak / (double)bound;
        double *worst_of = L >= 8 ? &layer_worst : &tiny_worst;
        *worst_of = r > *worst_of ? r : *worst_of;
    }
    /* the placements are heuristics (greedy orders, then randomized restarts): issue 4's target
     * of 1.1 guards schedules of 8 units or more; tiny ones (a 4x larger first and last unit
     * among two to six) cannot always reach the bound and are guarded at 1.15 */
    TH_CHECK(layer_worst <= 1.1 && tiny_worst <= 1.15,
             "layer schedules: peak up to %.3f / %.3f x the lower bound", layer_worst, tiny_worst);
    printf("layer schedules: worst peak / lower bound %.3f (>= 8 units), %.3f (< 8 units)\n",
           layer_worst, tiny_worst);
    return th_summary("test_interval");
}

/* The shared-memory ring: order, full and empty, corrupted indices; bf16/fp16 rounding. */
#include "harness.h"
#include "sd/dtype.h"
#include "sd/ring.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main(void)
{
    struct sd_ring_hdr *h = aligned_alloc(4096, SD_RING_BYTES);
    sd_ring_init(h);
    struct sd_sqe e = {0}, out;
    TH_CHECK(sd_ring_sq_pop(h, &out) == 0, "empty ring pops nothing");
    int pushed = 0;
    for (int i = 0; i < SD_RING_ENTRIES + 5; i++) {
        e.tag = (uint64_t)i;
        pushed += sd_ring_sq_push(h, &e) == 0;
    }
    TH_CHECK(pushed == SD_RING_ENTRIES, "ring holds %d entries, pushed %d", SD_RING_ENTRIES,
             pushed);
    int in_order = 1;
    for (int i = 0; i < SD_RING_ENTRIES; i++)
        in_order &= sd_ring_sq_pop(h, &out) == 1 && out.tag == (uint64_t)i;
    TH_CHECK(in_order, "entries come out in order");
    TH_CHECK(sd_ring_sq_empty(h), "empty again");
    /* wrap around many times */
    int ok = 1;
    for (uint64_t i = 0; i < 10000; i++) {
        e.tag = i;
        ok &= sd_ring_sq_push(h, &e) == 0 && sd_ring_sq_pop(h, &out) == 1 && out.tag == i;
    }
    TH_CHECK(ok, "wrap-around");
    atomic_store(&h->sq_head, atomic_load(&h->sq_tail) + SD_RING_ENTRIES + 7);
    TH_CHECK(sd_ring_sq_pop(h, &out) == -1, "a head beyond one ring is reported as corrupt");
    sd_ring_init(h);
    struct sd_cqe c = {.tag = 9, .status = -22};
    strcpy(c.msg, "bad");
    for (int i = 0; i < SD_RING_ENTRIES; i++)
        TH_CHECK(sd_ring_cq_push(h, &c) == 0, "cq push %d", i);
    TH_CHECK(sd_ring_cq_push(h, &c) == -1, "cq overflow detected");
    struct sd_cqe got;
    TH_CHECK(sd_ring_cq_pop(h, &got) == 1 && got.tag == 9 && got.status == -22 &&
                 strcmp(got.msg, "bad") == 0,
             "cq entry");
    free(h);

    /* bf16: round to nearest, ties to even; NaN stays NaN; overflow to inf */
    static const struct {
        uint32_t in;
        uint16_t out;
    } b16[] = {
        {0x3f800000, 0x3f80}, /* 1.0 */
        {0x3f808000, 0x3f80}, /* halfway, even below */
        {0x3f818000, 0x3f82}, /* halfway, even above */
        {0x3f808001, 0x3f81}, /* just above halfway */
        {0xbf800000, 0xbf80}, /* -1.0 */
        {0x7f800000, 0x7f80}, /* inf */
        {0x7f7fffff, 0x7f80}, /* largest float rounds to inf */
        {0x00000001, 0x0000}, /* denormal rounds to 0 */
    };
    for (size_t i = 0; i < sizeof(b16) / sizeof(b16[0]); i++) {
        uint16_t r = sd_f32_to_bf16(from_bits(b16[i].in));
        TH_CHECK(r == b16[i].out, "bf16(%08x) = %04x, expected %04x", b16[i].in, r, b16[i].out);
    }
    TH_CHECK(isnan(sd_bf16_to_f32(sd_f32_to_bf16(NAN))), "NaN survives bf16");
    TH_CHECK(bits(sd_bf16_to_f32(0x4049)) == 0x40490000, "bf16 -> f32 is a shift");
    TH_CHECK(sd_fp16_to_f32(sd_f32_to_fp16(1.0f / 3.0f)) == 0.333251953125f, "fp16 1/3");
    TH_CHECK(sd_f32_to_fp16(65520.0f) == 0x7c00, "fp16 overflow to inf");
    TH_CHECK(strcmp(sd_op_name(SD_OP_PUSH), "push") == 0 &&
                 strcmp(sd_op_name(99), "unknown-op") == 0,
             "op names");
    return th_summary("test_ring");
}

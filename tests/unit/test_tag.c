/* Transport tags (daemon/coll/tag.h): every field round-trips at its maximum and next to it, a
 * value one past a field's width is refused and leaves the tag as it was, and the seq layouts
 * keep apart what the old hand packing mixed up (copy slots above 15 collided with the next
 * weights generation). */
#include "coll/tag.h"
#include "check.h"

#include <stdlib.h>
#include <string.h>

static uint32_t field_of(const struct sd_tag_fields *f, int i)
{
    const uint32_t v[SD_TAGF_COUNT] = {f->kind, f->job, f->unit, f->seq, f->src, f->chunk};
    return v[i];
}

static void set_field(struct sd_tag_fields *f, int i, uint32_t v)
{
    uint32_t *p[SD_TAGF_COUNT] = {&f->kind, &f->job, &f->unit, &f->seq, &f->src, &f->chunk};
    *p[i] = v;
}

static void fields_round_trip(void)
{
    uint32_t bits_total = 0;
    uint64_t masks = 0;
    for (int i = 0; i < SD_TAGF_COUNT; i++) {
        bits_total += sd_tag_bits((enum sd_tag_field)i);
        TH_CHECK((masks & sd_tag_mask((enum sd_tag_field)i)) == 0, "field %d overlaps another", i);
        masks |= sd_tag_mask((enum sd_tag_field)i);
    }
    TH_CHECK(bits_total == 64 && masks == UINT64_MAX, "fields cover 64 bits: %u", bits_total);

    /* each field at 0, 1, its maximum and one below, with the others at their maxima or 0 */
    for (int i = 0; i < SD_TAGF_COUNT; i++) {
        uint32_t max = (uint32_t)((1ULL << sd_tag_bits((enum sd_tag_field)i)) - 1);
        uint32_t vals[4] = {0, 1, max - 1, max};
        for (int others = 0; others < 2; others++)
            for (int v = 0; v < 4; v++) {
                struct sd_tag_fields f;
                for (int j = 0; j < SD_TAGF_COUNT; j++)
                    set_field(&f, j,
                              others ? (uint32_t)((1ULL << sd_tag_bits((enum sd_tag_field)j)) - 1)
                                     : 0);
                set_field(&f, i, vals[v]);
                uint64_t tag = 0;
                TH_CHECK(sd_tag_pack(&f, &tag) == SD_OK, "field %d = %u packs", i, vals[v]);
                struct sd_tag_fields g = sd_tag_unpack(tag);
                TH_CHECK(memcmp(&f, &g, sizeof(f)) == 0, "field %d = %u round-trips", i, vals[v]);
                TH_CHECK(sd_tag_get(tag, (enum sd_tag_field)i) == vals[v], "get field %d", i);
            }
        /* one past the width: refused, nothing written */
        struct sd_tag_fields f = {0};
        set_field(&f, i, max + 1);
        uint64_t tag = 0x1234;
        TH_CHECK(sd_tag_pack(&f, &tag) == SD_ERANGE && tag == 0x1234,
                 "field %d = %u is refused, not truncated", i, field_of(&f, i));
        uint64_t t2 = 0;
        TH_CHECK(sd_tag_set(&t2, (enum sd_tag_field)i, (uint64_t)max + 1) == SD_ERANGE && t2 == 0,
                 "setting field %d past its width is refused", i);
        TH_CHECK(sd_tag_set(&t2, (enum sd_tag_field)i, max) == SD_OK &&
                     t2 == sd_tag_mask((enum sd_tag_field)i),
                 "field %d at its maximum fills its mask", i);
    }
}

static void weights_seq(void)
{
    /* every (generation mod 2^10, copy slot < 64) pair has a seq of its own */
    uint32_t n_gen = 1u << SD_TAG_GEN_BITS, n_slot = 1u << SD_TAG_LSLOT_BITS;
    uint8_t *seen = calloc(1u << SD_TAG_SEQ_BITS, 1);
    uint32_t dup = 0, refused = 0;
    for (uint32_t g = 0; g < n_gen; g++)
        for (uint32_t l = 0; l < n_slot; l++) {
            uint32_t seq = UINT32_MAX;
            refused += sd_tag_weights_seq(g, l, &seq) != SD_OK;
            dup += seq < (1u << SD_TAG_SEQ_BITS) ? seen[seq]++ != 0 : 1;
        }
    free(seen);
    TH_CHECK(refused == 0 && dup == 0, "weights seqs: %u refused, %u shared", refused, dup);
    /* the pair the old packing ((gen & 0xfff) << 4 | lslot) sent with one tag */
    uint32_t a, b;
    TH_CHECK(sd_tag_weights_seq(0, 16, &a) == SD_OK && sd_tag_weights_seq(1, 0, &b) == SD_OK &&
                 a != b,
             "generation 0 slot 16 and generation 1 slot 0 differ: %u, %u", a, b);
    TH_CHECK(sd_tag_weights_seq(5, 63, &a) == SD_OK, "slot 63 fits");
    a = 77;
    TH_CHECK(sd_tag_weights_seq(5, 64, &a) == SD_ERANGE && a == 77, "slot 64 is refused");
    /* the generation is a counter: it wraps at its field, by name */
    TH_CHECK(sd_tag_weights_seq(n_gen + 3, 7, &a) == SD_OK &&
                 sd_tag_weights_seq(3, 7, &b) == SD_OK && a == b,
             "generations wrap modulo 2^%u", SD_TAG_GEN_BITS);
}

static void allreduce_seq(void)
{
    uint32_t rounds = 1u << SD_TAG_ROUND_BITS;
    uint8_t *seen = calloc(1u << SD_TAG_SEQ_BITS, 1);
    uint32_t dup = 0, bad = 0;
    for (uint32_t r = 0; r < rounds; r++)
        for (int step = 0; step < 2; step++) {
            uint64_t base = 0;
            bad += sd_tag_make(SD_TAG_AR, 7, 3, sd_tag_allreduce_seq(r, step), 0, &base) != SD_OK;
            for (uint32_t t = 0; t < SD_TAG_MAX_CHUNKS; t++) {
                uint64_t tag = base;
                bad += sd_tag_set_ring_step(&tag, t) != SD_OK;
                uint32_t seq = sd_tag_get(tag, SD_TAGF_SEQ);
                dup += seen[seq]++ != 0;
                bad += sd_tag_get(tag, SD_TAGF_UNIT) != 3 || sd_tag_get(tag, SD_TAGF_JOB) != 7;
            }
        }
    free(seen);
    TH_CHECK(bad == 0 && dup == 0,
             "all-reduce seqs: rounds x step/micro-step x ring steps all distinct (%u bad, %u "
             "shared)",
             bad, dup);
    uint64_t tag = 0, before;
    TH_CHECK(sd_tag_make(SD_TAG_AR, 1, 1, sd_tag_allreduce_seq(9, true), 0, &tag) == SD_OK, "make");
    before = tag;
    TH_CHECK(sd_tag_set_ring_step(&tag, SD_TAG_MAX_CHUNKS) == SD_ERANGE && tag == before,
             "ring step 256 is refused");
}

static void routing(void)
{
    uint64_t tag = 0;
    TH_CHECK(sd_tag_make(SD_TAG_SCALAR, 4095, 0, 65535, 1023, &tag) == SD_OK &&
                 sd_tag_is_ctrl(tag) && sd_tag_kind(tag) == SD_TAG_SCALAR &&
                 sd_tag_src(tag) == 1023,
             "a norm exchange at the widest job, seq and source routes on the control rail");
    TH_CHECK(sd_tag_make(SD_TAG_WDATA, 1, 16383, 0, 0, &tag) == SD_OK && !sd_tag_is_ctrl(tag) &&
                 sd_tag_get(tag, SD_TAGF_UNIT) == 16383,
             "weights data at the last unit travel on a data rail");
    TH_CHECK(sd_tag_make(SD_TAG_WDATA, 1, 16384, 0, 0, &tag) == SD_ERANGE,
             "unit 16384 does not fit");
    TH_CHECK(sd_tag_make(SD_TAG_GRAD, 4096, 0, 0, 0, &tag) == SD_ERANGE,
             "job tag 4096 does not fit");
    TH_CHECK(sd_tag_make(SD_TAG_GRAD, 1, 0, 0, SD_MAX_NODES, &tag) == SD_ERANGE,
             "source node %u does not fit", SD_MAX_NODES);
    uint64_t any = sd_tag_of_kind(SD_TAG_REQ), ignore = sd_tag_any_but_kind();
    TH_CHECK(sd_tag_make(SD_TAG_REQ, 12, 34, 56, 78, &tag) == SD_OK &&
                 (tag & ~ignore) == (any & ~ignore) && (any & ignore) == 0,
             "a wildcard receive of one kind matches every tag of that kind");
    TH_CHECK(sd_tag_wrap(0x12345, 16) == 0x2345 && sd_tag_wrap(7, 3) == 7, "wrap");
}

int main(void)
{
    fields_round_trip();
    weights_seq();
    allreduce_seq();
    routing();
    return th_summary("test_tag");
}

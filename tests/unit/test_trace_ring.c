/* The flight recorder's ring (sd/trace.h) against a model kept here: calls opened per rank and
 * completed by their client tag (the newest open one), counted per rank and op whatever the ring
 * dropped; a transfer's chunks joined into one record (bytes summed) and completed with the last
 * chunk, a failed chunk failing it; records of another peer or key kept apart; the ring wrapping
 * (old ids gone, completions of gone records ignored); off (cap 0) doing nothing. */
#include "check.h"
#include "sd/trace.h"

#include <string.h>

int main(void)
{
    struct sd_trace t;
    TH_CHECK(sd_trace_init(&t, 8, 4, 2) == 0, "init");
    /* ranks 4 and 5: two fetches and a push each */
    sd_trace_call(&t, 4, 1, 0, 0, 100, 10);
    sd_trace_call(&t, 5, 1, 0, 0, 100, 11); /* the same client tag on another rank */
    sd_trace_call(&t, 4, 3, 2, 4096, 101, 12);
    sd_trace_call(&t, 9, 1, 0, 0, 100, 13); /* not one of this node's ranks: ignored */
    TH_CHECK(t.next_id == 4, "three records: %llu", (unsigned long long)t.next_id - 1);
    sd_trace_call_done(&t, 5, 100, 0, 20);
    const struct sd_trace_rec *r1 = sd_trace_get(&t, 1), *r2 = sd_trace_get(&t, 2),
                              *r3 = sd_trace_get(&t, 3);
    TH_CHECK(r1 && r1->state == SD_TRACE_QUEUED && r2 && r2->state == SD_TRACE_DONE &&
                 r2->end_ns == 20 && r2->who == 5 && r2->seq == 1,
             "rank 5's completion closed rank 5's call only");
    TH_CHECK(r3 && r3->op == 3 && r3->unit == 2 && r3->bytes == 4096 && r3->seq == 1,
             "the push's record");
    sd_trace_call_done(&t, 4, 101, -110, 30);
    TH_CHECK(r3->state == SD_TRACE_FAILED && r3->status == -110, "a failed call");
    /* a transfer of 3 chunks to node 1, one of 2 from node 1, interleaved */
    uint64_t a = sd_trace_xfer(&t, true, 1, 0xabc0, 3, 2, 7, 100, 40);
    uint64_t b = sd_trace_xfer(&t, false, 1, 0xabc0, 3, 2, 7, 50, 41);
    uint64_t a2 = sd_trace_xfer(&t, true, 1, 0xabc0, 3, 2, 7, 100, 42);
    uint64_t a3 = sd_trace_xfer(&t, true, 1, 0xabc0, 3, 2, 7, 60, 43);
    uint64_t b2 = sd_trace_xfer(&t, false, 1, 0xabc0, 3, 2, 7, 50, 44);
    uint64_t c = sd_trace_xfer(&t, true, 0, 0xabc0, 3, 2, 7, 10, 45); /* another peer */
    TH_CHECK(a == a2 && a == a3 && b == b2 && a != b && c != a,
             "chunks joined by direction, "
             "peer and key: %llu %llu %llu / %llu %llu / %llu",
             (unsigned long long)a, (unsigned long long)a2, (unsigned long long)a3,
             (unsigned long long)b, (unsigned long long)b2, (unsigned long long)c);
    const struct sd_trace_rec *ra = sd_trace_get(&t, a), *rb = sd_trace_get(&t, b);
    TH_CHECK(ra->bytes == 260 && ra->pending == 3 && ra->kind == SD_TRACE_SEND &&
                 rb->bytes == 100 && rb->kind == SD_TRACE_RECV,
             "bytes summed, chunks pending");
    sd_trace_xfer_done(&t, a, 0, 50);
    sd_trace_xfer_done(&t, a, 0, 51);
    TH_CHECK(ra->state == SD_TRACE_POSTED && ra->end_ns == 0, "open until its last chunk");
    sd_trace_xfer_done(&t, a, 0, 52);
    TH_CHECK(ra->state == SD_TRACE_DONE && ra->end_ns == 52 && ra->pending == 0, "done");
    sd_trace_xfer_done(&t, b, -104, 53);
    sd_trace_xfer_done(&t, b, 0, 54);
    TH_CHECK(rb->state == SD_TRACE_FAILED && rb->status == -104 && rb->end_ns == 53,
             "a failed chunk fails the transfer");
    /* a new transfer with the same key after the old one completed starts a record */
    uint64_t d = sd_trace_xfer(&t, true, 1, 0xabc0, 3, 2, 8, 1, 60);
    TH_CHECK(d != a, "a completed transfer is not joined");
    /* wrap: 8 slots; ids 1..8 so far (a: 4, b: 5, c: 6, d: 7) */
    for (int i = 0; i < 10; i++)
        sd_trace_call(&t, 4, 1, 0, 0, 200 + (uint64_t)i, 70 + (uint64_t)i);
    TH_CHECK(sd_trace_get(&t, 1) == NULL && sd_trace_get(&t, a) == NULL &&
                 sd_trace_first(&t) == t.next_id - 8,
             "the ring dropped the oldest");
    sd_trace_xfer_done(&t, d, 0, 90); /* gone: ignored */
    uint64_t fetches = t.calls[(4 - 4) * SD_TRACE_OPS + 1];
    TH_CHECK(fetches == 11, "rank 4's fetches counted whatever the ring kept: %llu",
             (unsigned long long)fetches);
    sd_trace_call_done(&t, 4, 209, 0, 95);
    const struct sd_trace_rec *last = sd_trace_get(&t, t.next_id - 1);
    TH_CHECK(last->state == SD_TRACE_DONE && last->seq == 11, "the newest call closed");
    TH_CHECK(strcmp(sd_trace_state_name(SD_TRACE_QUEUED), "scheduled") == 0 &&
                 strcmp(sd_trace_state_name(SD_TRACE_POSTED), "started") == 0 &&
                 strcmp(sd_trace_state_name(SD_TRACE_DONE), "completed") == 0,
             "PyTorch's state names");
    sd_trace_fini(&t);
    struct sd_trace off;
    TH_CHECK(sd_trace_init(&off, 0, 0, 4) == 0, "off");
    sd_trace_call(&off, 0, 1, 0, 0, 1, 1);
    sd_trace_call_done(&off, 0, 1, 0, 2);
    TH_CHECK(sd_trace_xfer(&off, true, 1, 1, 1, 1, 1, 1, 1) == 0 && off.next_id == 1 &&
                 sd_trace_get(&off, 1) == NULL,
             "off records nothing");
    sd_trace_fini(&off);
    return th_summary("test_trace_ring");
}

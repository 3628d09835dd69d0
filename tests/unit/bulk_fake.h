/* A fake of the bulk transfers (coll.h's sd_bulk_get, sd_bulk_put, sd_bulk_start) for the unit
 * tests of the modules that move data between nodes (test_loading, test_fetch): each start is
 * recorded, and the test completes it when it chooses (with the bytes it writes, or failed). */
#ifndef TH_BULK_FAKE_H
#define TH_BULK_FAKE_H

#include "coll/coll.h"
#include "pull.h"

#include <stdbool.h>

#define TH_MAX_BULKS 8

struct th_bulks {
    struct sd_bulk bulk[TH_MAX_BULKS];
    struct sd_bulk_param post[TH_MAX_BULKS]; /* its pieces and lens point at the copies below */
    void *pieces[TH_MAX_BULKS][SD_BULK_MAX_PIECES];
    size_t lens[TH_MAX_BULKS][SD_BULK_MAX_PIECES];
    bool used[TH_MAX_BULKS];
    int posted; /* starts so far */
};
extern struct th_bulks th_bulks;

/* The transport's sends (pull requests): the last one recorded; answered with status. */
struct th_sends {
    int n, status;
    uint32_t peer;
    struct sd_req_msg msg;
    struct sd_xfer *x;
};
extern struct th_sends th_sends;
extern const struct sd_transport_ops th_send_ops;

/* forget every transfer and send */
void th_bulks_reset(void);
/* the one transfer started and not completed (the index), or -1 (none, or more than one) */
int th_bulk_in_flight(void);
/* bytes of piece p of transfer i */
size_t th_bulk_piece_len(int i, uint32_t p);
/* complete transfer i with status: its bytes counted, then its callback */
void th_bulk_complete(int i, int status);

#endif

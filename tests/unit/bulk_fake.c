/* The fake bulk transfers (bulk_fake.h). */
#include "bulk_fake.h"
#include "transport/transport.h"
#include "sd/status.h"

#include <string.h>

struct th_bulks th_bulks;
struct th_sends th_sends;

void th_bulks_reset(void)
{
    memset(&th_bulks, 0, sizeof(th_bulks));
    memset(&th_sends, 0, sizeof(th_sends));
}

static int fake_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf,
                     size_t len, void *desc, struct sd_xfer *x)
{
    (void)tp;
    (void)tag;
    (void)desc;
    th_sends.n++;
    th_sends.peer = peer;
    th_sends.x = x;
    if (len == sizeof(th_sends.msg))
        memcpy(&th_sends.msg, buf, len);
    return th_sends.status;
}

const struct sd_transport_ops th_send_ops = {.name = "fake", .send = fake_send};

struct sd_bulk *sd_bulk_get(struct sd_bulk_pool *pool)
{
    (void)pool;
    for (int i = 0; i < TH_MAX_BULKS; i++)
        if (!th_bulks.used[i]) {
            th_bulks.used[i] = true;
            memset(&th_bulks.bulk[i], 0, sizeof(th_bulks.bulk[i]));
            return &th_bulks.bulk[i];
        }
    return NULL;
}

void sd_bulk_put(struct sd_bulk_pool *pool, struct sd_bulk *b)
{
    (void)pool;
    th_bulks.used[b - th_bulks.bulk] = false;
}

int sd_bulk_start(struct sd_bulk *b, const struct sd_bulk_param *p)
{
    int i = (int)(b - th_bulks.bulk);
    if (b == NULL || p->n_pieces == 0 || p->n_pieces > SD_BULK_MAX_PIECES)
        return SD_EINVAL;
    th_bulks.post[i] = *p;
    for (uint32_t q = 0; q < p->n_pieces; q++) { /* (the caller's arrays are its stack's) */
        th_bulks.pieces[i][q] = p->pieces[q];
        th_bulks.lens[i][q] = p->lens != NULL ? p->lens[q] : p->piece_len;
    }
    th_bulks.post[i].pieces = th_bulks.pieces[i];
    th_bulks.post[i].lens = th_bulks.lens[i];
    b->active = true;
    b->is_send = p->is_send;
    b->peer = p->peer;
    b->cb = p->cb;
    b->arg = p->arg;
    b->arg2 = p->arg2;
    th_bulks.posted++;
    return SD_OK;
}

int th_bulk_in_flight(void)
{
    int found = -1, n = 0;
    for (int i = 0; i < TH_MAX_BULKS; i++)
        if (th_bulks.used[i] && th_bulks.bulk[i].active) {
            found = i;
            n++;
        }
    return n == 1 ? found : -1;
}

size_t th_bulk_piece_len(int i, uint32_t p)
{
    return th_bulks.lens[i][p];
}

void th_bulk_complete(int i, int status)
{
    struct sd_bulk *b = &th_bulks.bulk[i];
    b->active = false;
    b->bytes = 0;
    for (uint32_t q = 0; q < th_bulks.post[i].n_pieces; q++)
        b->bytes += th_bulks.lens[i][q];
    b->cb(b, status);
}

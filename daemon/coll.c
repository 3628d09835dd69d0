#include "coll.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdlib.h>
#include <string.h>

/* ---- chunked bulk transfers */

static void bulk_xfer_cb(struct sd_xfer *x, int status)
{
    struct sd_bulk_xfer *bx = (struct sd_bulk_xfer *)x;
    struct sd_bulk *b = bx->b;
    b->done++;
    if (status != SD_OK) {
        b->failed++;
        if (b->status == SD_OK)
            b->status = status;
    } else {
        b->bytes += b->is_send ? bx->len : x->len;
        if (!b->is_send && b->chunk_cb != NULL)
            b->chunk_cb(b, bx->piece, bx->off, bx->len);
    }
    if (b->done == b->n) {
        b->active = false;
        b->cb(b, b->status);
    }
}

int sd_bulk_start(struct sd_bulk *b, struct sd_transport *tp, bool is_send, uint32_t peer,
                  uint64_t tag_base, void *const *pieces, uint32_t n_pieces, size_t piece_len,
                  size_t chunk_bytes, void *desc, sd_bulk_cb cb, sd_bulk_chunk_cb chunk_cb,
                  void *arg)
{
    if (n_pieces == 0 || n_pieces > SD_BULK_MAX_PIECES || b->active)
        return SD_EINVAL;
    uint32_t max_cpp = SD_TAG_MAX_CHUNKS / n_pieces;
    size_t chunk = SD_MAX(chunk_bytes, 64);
    if (piece_len > chunk * max_cpp)
        chunk = sd_round_up((piece_len + max_cpp - 1) / max_cpp, 64);
    uint32_t cpp = piece_len ? (uint32_t)((piece_len + chunk - 1) / chunk) : 1;
    b->tp = tp;
    b->peer = peer;
    b->is_send = is_send;
    b->n = n_pieces * cpp;
    b->done = b->failed = 0;
    b->status = SD_OK;
    b->bytes = 0;
    b->cb = cb;
    b->chunk_cb = chunk_cb;
    b->arg = arg;
    b->active = true;
    for (uint32_t p = 0; p < n_pieces; p++)
        for (uint32_t c = 0; c < cpp; c++) {
            uint32_t i = p * cpp + c;
            struct sd_bulk_xfer *bx = &b->xs[i];
            bx->b = b;
            bx->piece = p;
            bx->off = (size_t)c * chunk;
            bx->len = SD_MIN(chunk, piece_len - SD_MIN(piece_len, bx->off));
            bx->x.cb = bulk_xfer_cb;
            char *base = (char *)pieces[p] + bx->off;
            int st = is_send
                         ? tp->ops->send(tp, peer, tag_base | i, base, bx->len, desc, &bx->x)
                         : tp->ops->recv(tp, peer, tag_base | i, 0, base, bx->len, desc, &bx->x);
            if (st != SD_OK) {
                if (i == 0) {
                    b->active = false;
                    return st;
                }
                b->n = i; /* the posted ones complete and run cb with the error */
                b->status = st;
                return SD_OK;
            }
        }
    return SD_OK;
}

int sd_bulk_pool_init(struct sd_bulk_pool *p, uint32_t n)
{
    memset(p, 0, sizeof(*p));
    p->all = calloc(n ? n : 1, sizeof(*p->all));
    if (p->all == NULL)
        return SD_ENOMEM;
    p->n = n;
    for (uint32_t i = 0; i < n; i++) {
        p->all[i].next_free = p->free;
        p->free = &p->all[i];
    }
    return SD_OK;
}

void sd_bulk_pool_fini(struct sd_bulk_pool *p)
{
    free(p->all);
    memset(p, 0, sizeof(*p));
}

struct sd_bulk *sd_bulk_get(struct sd_bulk_pool *p)
{
    struct sd_bulk *b = p->free;
    if (b != NULL) {
        p->free = b->next_free;
        p->in_use++;
    }
    return b;
}

void sd_bulk_put(struct sd_bulk_pool *p, struct sd_bulk *b)
{
    b->next_free = p->free;
    p->free = b;
    p->in_use--;
}

uint32_t sd_bulk_exchange(struct sd_bulk_pool *pool, struct sd_transport *tp, uint32_t peer,
                          uint64_t rtag, void *rp, size_t rbytes, uint64_t stag, const void *sp,
                          size_t sbytes, size_t chunk_bytes, void *rdesc, void *sdesc,
                          sd_bulk_cb cb, sd_bulk_chunk_cb chunk_cb, void *arg, uint64_t arg2,
                          struct sd_bulk **rb_p, int *status_p, uint32_t *suspect_p)
{
    uint32_t posted = 0;
    struct sd_bulk *rb = sd_bulk_get(pool), *sb = sd_bulk_get(pool);
    int st = rb ? sd_bulk_start(rb, tp, false, peer, rtag, &rp, 1, rbytes, chunk_bytes, rdesc, cb,
                                chunk_cb, arg)
                : SD_EBUSY;
    if (st == SD_OK) {
        rb->arg2 = arg2;
        posted++;
    } else if (rb != NULL) {
        sd_bulk_put(pool, rb);
        rb = NULL;
    }
    void *spv = (void *)sp;
    int st2 = sb ? sd_bulk_start(sb, tp, true, peer, stag, &spv, 1, sbytes, chunk_bytes, sdesc, cb,
                                 NULL, arg)
                 : SD_EBUSY;
    if (st2 == SD_OK) {
        sb->arg2 = arg2;
        posted++;
    } else if (sb != NULL) {
        sd_bulk_put(pool, sb);
    }
    if ((st != SD_OK || st2 != SD_OK) && *status_p == SD_OK) {
        *status_p = st != SD_OK ? st : st2;
        *suspect_p = peer;
    }
    if (rb_p != NULL)
        *rb_p = rb;
    return posted;
}

/* ---- all-reduce */

size_t sd_allreduce_tmp_floats(size_t count, uint32_t n, size_t small_bytes)
{
    if (n <= 1)
        return 0;
    if (count * sizeof(float) <= small_bytes)
        return (size_t)(n - 1) * count;
    return count / n + 1;
}

static void ar_finish(struct sd_allreduce *ar)
{
    if (ar->sb)
        sd_bulk_put(ar->pool, ar->sb);
    if (ar->rb)
        sd_bulk_put(ar->pool, ar->rb);
    ar->sb = ar->rb = NULL;
    for (uint32_t i = 0; i + 1 < ar->n_members && i < SD_ARRAY_SIZE(ar->direct_rb); i++)
        if (ar->direct_rb[i]) {
            sd_bulk_put(ar->pool, ar->direct_rb[i]);
            ar->direct_rb[i] = NULL;
        }
    ar->cb(ar, ar->status, ar->suspect);
}

static void ar_note(struct sd_allreduce *ar, struct sd_bulk *b, int status)
{
    if (b->is_send)
        ar->bytes_sent += b->bytes;
    else
        ar->bytes_recv += b->bytes;
    if (status != SD_OK && ar->status == SD_OK) {
        ar->status = status;
        ar->suspect = b->peer;
    }
}

/* direct: everyone sends its buffer to everyone; sum in member order */
static void direct_done(struct sd_bulk *b, int status)
{
    struct sd_allreduce *ar = b->arg;
    ar_note(ar, b, status);
    if (b->is_send)
        sd_bulk_put(ar->pool, b);
    if (--ar->pending > 0)
        return;
    if (ar->status == SD_OK) {
        const float *src[SD_ARRAY_SIZE(ar->direct_rb) + 1];
        for (uint32_t m = 0, o = 0; m < ar->n_members; m++)
            src[m] = m == ar->pos ? ar->buf : ar->tmp + (size_t)(o++) * ar->count;
        for (size_t i = 0; i < ar->count; i++) {
            float s = src[0][i];
            for (uint32_t m = 1; m < ar->n_members; m++)
                s += src[m][i];
            ar->buf[i] = s;
        }
    }
    ar_finish(ar);
}

static int direct_start(struct sd_allreduce *ar)
{
    size_t bytes = ar->count * sizeof(float);
    uint32_t others = ar->n_members - 1;
    if (ar->pool->n - ar->pool->in_use < 2 * others)
        return SD_EBUSY;
    ar->pending = 0;
    for (uint32_t m = 0, o = 0; m < ar->n_members; m++) {
        if (m == ar->pos)
            continue;
        uint32_t peer = ar->members[m];
        uint64_t rtag = ar->tag_base | (uint64_t)(peer & 0x3ff) << 8;
        uint64_t stag = ar->tag_base | (uint64_t)(ar->members[ar->pos] & 0x3ff) << 8;
        ar->pending +=
            sd_bulk_exchange(ar->pool, ar->tp, peer, rtag, ar->tmp + (size_t)o * ar->count, bytes,
                             stag, ar->buf, bytes, ar->chunk_bytes, NULL, NULL, direct_done, NULL,
                             ar, 0, &ar->direct_rb[o], &ar->status, &ar->suspect);
        o++;
    }
    /* nothing in flight: the caller reports the error; else the callbacks finish the job */
    return ar->pending == 0 ? (ar->status ? ar->status : SD_EIO) : SD_OK;
}

/* ring: n-1 reduce-scatter steps, then n-1 all-gather steps */
static void ring_post(struct sd_allreduce *ar);

static void ring_chunk(struct sd_bulk *b, uint32_t piece, size_t off, size_t len)
{
    struct sd_allreduce *ar = b->arg;
    (void)piece;
    if (ar->step >= ar->n_members - 1)
        return; /* all-gather: received straight into place */
    size_t begin, end;
    uint32_t n = ar->n_members;
    sd_ring_segment(ar->count, n, (ar->pos + 2 * n - ar->step - 1) % n, &begin, &end);
    float *dst = ar->buf + begin + off / sizeof(float);
    const float *src = ar->tmp + off / sizeof(float);
    for (size_t i = 0; i < len / sizeof(float); i++)
        dst[i] += src[i];
}

static void ring_done(struct sd_bulk *b, int status)
{
    struct sd_allreduce *ar = b->arg;
    SD_DEBUG("coll", "ring step %u: %s to/from node %u done (%d)", ar->step,
             b->is_send ? "send" : "recv", b->peer, status);
    ar_note(ar, b, status);
    if (--ar->pending > 0)
        return;
    if (ar->status != SD_OK || ++ar->step == 2 * (ar->n_members - 1)) {
        ar_finish(ar);
        return;
    }
    ring_post(ar);
}

static void ring_post(struct sd_allreduce *ar)
{
    uint32_t n = ar->n_members, t = ar->step;
    SD_DEBUG("coll", "ring step %u of %u posted", t, 2 * (n - 1));
    uint32_t next = ar->members[(ar->pos + 1) % n], prev = ar->members[(ar->pos + n - 1) % n];
    uint32_t send_seg, recv_seg;
    if (t < n - 1) {
        send_seg = (ar->pos + n - t) % n;
        recv_seg = (ar->pos + 2 * n - t - 1) % n;
    } else {
        uint32_t u = t - (n - 1);
        send_seg = (ar->pos + 1 + n - u) % n;
        recv_seg = (ar->pos + n - u) % n;
    }
    size_t sb0, se0, rb0, re0;
    sd_ring_segment(ar->count, n, send_seg, &sb0, &se0);
    sd_ring_segment(ar->count, n, recv_seg, &rb0, &re0);
    void *sp = ar->buf + sb0;
    void *rp = t < n - 1 ? (void *)ar->tmp : (void *)(ar->buf + rb0);
    uint64_t tag = ar->tag_base | (uint64_t)(t & 0xff) << 18;
    ar->pending = 2;
    int st = sd_bulk_start(ar->rb, ar->tp, false, prev, tag | (uint64_t)(prev & 0x3ff) << 8, &rp, 1,
                           (re0 - rb0) * sizeof(float), ar->chunk_bytes, NULL, ring_done,
                           ring_chunk, ar);
    if (st != SD_OK) {
        ar->status = st;
        ar->suspect = prev;
        ar->pending = 0;
        ar_finish(ar);
        return;
    }
    st = sd_bulk_start(ar->sb, ar->tp, true, next,
                       tag | (uint64_t)(ar->members[ar->pos] & 0x3ff) << 8, &sp, 1,
                       (se0 - sb0) * sizeof(float), ar->chunk_bytes, NULL, ring_done, NULL, ar);
    if (st != SD_OK) {
        ar->status = st;
        ar->suspect = next;
        ar->pending--; /* the receive still completes (or is cancelled) and finishes */
    }
}

int sd_allreduce_start(struct sd_allreduce *ar, struct sd_transport *tp, struct sd_bulk_pool *pool,
                       const uint32_t *members, uint32_t n_members, uint32_t self, float *buf,
                       size_t count, float *tmp, size_t tmp_count, uint64_t tag_base,
                       size_t chunk_bytes, size_t small_bytes, sd_allreduce_cb cb, void *arg)
{
    memset(ar, 0, sizeof(*ar));
    ar->tp = tp;
    ar->pool = pool;
    ar->members = members;
    ar->n_members = n_members;
    ar->buf = buf;
    ar->count = count;
    ar->tmp = tmp;
    ar->tmp_count = tmp_count;
    ar->tag_base = tag_base;
    ar->chunk_bytes = chunk_bytes;
    ar->cb = cb;
    ar->arg = arg;
    ar->pos = UINT32_MAX;
    for (uint32_t i = 0; i < n_members; i++)
        if (members[i] == self)
            ar->pos = i;
    if (ar->pos == UINT32_MAX || n_members < 2 || n_members - 1 > SD_ARRAY_SIZE(ar->direct_rb) ||
        tmp_count < sd_allreduce_tmp_floats(count, n_members, small_bytes))
        return SD_EINVAL;
    ar->direct = count * sizeof(float) <= small_bytes;
    if (ar->direct)
        return direct_start(ar);
    ar->sb = sd_bulk_get(pool);
    ar->rb = sd_bulk_get(pool);
    if (ar->sb == NULL || ar->rb == NULL) {
        if (ar->sb)
            sd_bulk_put(pool, ar->sb);
        if (ar->rb)
            sd_bulk_put(pool, ar->rb);
        return SD_EBUSY;
    }
    ring_post(ar);
    return SD_OK;
}

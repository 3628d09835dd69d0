#include "coll/coll.h"
#include "sd/codec.h"
#include "sd/model.h"
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

size_t sd_bulk_chunk_bytes(size_t longest, uint32_t n_pieces, size_t chunk_bytes)
{
    /* chunks of every piece share the tag's chunk field: at most 256 / n_pieces per piece */
    uint32_t max_cpp = SD_TAG_MAX_CHUNKS / n_pieces;
    size_t chunk = SD_MAX(chunk_bytes, 64);
    if (longest > chunk * max_cpp)
        chunk = sd_round_up((longest + max_cpp - 1) / max_cpp, 64);
    return chunk;
}

/* chunks of a piece of len bytes (an empty piece still sends one empty message) */
static uint32_t piece_chunks(size_t len, size_t chunk)
{
    return len ? (uint32_t)((len + chunk - 1) / chunk) : 1;
}

int sd_bulk_start(struct sd_bulk *b, const struct sd_bulk_param *prm)
{
    if (b == NULL || b->active)
        return b == NULL ? SD_EBUSY : SD_EINVAL;
    uint32_t n_pieces = prm->n_pieces;
    if (n_pieces == 0 || n_pieces > SD_BULK_MAX_PIECES)
        return SD_EINVAL;
    size_t lens[SD_BULK_MAX_PIECES];
    for (uint32_t p = 0; p < n_pieces; p++)
        lens[p] = prm->lens ? prm->lens[p] : prm->piece_len;
    struct sd_transport *tp = prm->tp;
    bool is_send = prm->is_send;
    uint32_t peer = prm->peer;
    void *desc = prm->desc;
    size_t longest = 0;
    for (uint32_t p = 0; p < n_pieces; p++)
        longest = SD_MAX(longest, lens[p]);
    size_t chunk = sd_bulk_chunk_bytes(longest, n_pieces, prm->chunk_bytes);
    uint32_t n = 0;
    for (uint32_t p = 0; p < n_pieces; p++)
        n += piece_chunks(lens[p], chunk);
    if (n > SD_TAG_MAX_CHUNKS) /* pieces of no length each still take a chunk */
        return SD_ERANGE;
    b->tp = tp;
    b->peer = peer;
    b->is_send = is_send;
    b->n = n;
    b->done = b->failed = 0;
    b->status = SD_OK;
    b->bytes = 0;
    b->cb = prm->cb;
    b->chunk_cb = prm->chunk_cb;
    b->arg = prm->arg;
    b->arg2 = prm->arg2;
    b->active = true;
    for (uint32_t p = 0, i = 0; p < n_pieces; p++) {
        uint32_t cpp = piece_chunks(lens[p], chunk);
        for (uint32_t c = 0; c < cpp; c++, i++) {
            struct sd_bulk_xfer *bx = &b->xs[i];
            bx->b = b;
            bx->piece = p;
            bx->off = (size_t)c * chunk;
            bx->len = SD_MIN(chunk, lens[p] - SD_MIN(lens[p], bx->off));
            bx->x.cb = bulk_xfer_cb;
            char *base = (char *)prm->pieces[p] + bx->off;
            uint64_t tag = prm->tag;
            int st = sd_tag_set(&tag, SD_TAGF_CHUNK, i);
            if (st == SD_OK)
                st = is_send ? tp->ops->send(tp, peer, tag, base, bx->len, desc, &bx->x)
                             : tp->ops->recv(tp, peer, tag, 0, base, bx->len, desc, &bx->x);
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

uint32_t sd_bulk_exchange(const struct sd_exchange_param *p, struct sd_bulk **rb_p, int *status_p,
                          uint32_t *suspect_p)
{
    uint32_t posted = 0;
    struct sd_bulk *rb = sd_bulk_get(p->pool), *sb = sd_bulk_get(p->pool);
    void *rp = p->recv.buf, *sp = p->send.buf;
    struct sd_bulk_param bp = {.tp = p->tp,
                               .peer = p->peer,
                               .tag = p->recv.tag,
                               .pieces = &rp,
                               .n_pieces = 1,
                               .piece_len = p->recv.bytes,
                               .chunk_bytes = p->chunk_bytes,
                               .desc = p->recv.desc,
                               .cb = p->cb,
                               .chunk_cb = p->chunk_cb,
                               .arg = p->arg,
                               .arg2 = p->arg2};
    int st = sd_bulk_start(rb, &bp);
    if (st == SD_OK) {
        posted++;
    } else if (rb != NULL) {
        sd_bulk_put(p->pool, rb);
        rb = NULL;
    }
    bp.is_send = true;
    bp.tag = p->send.tag;
    bp.pieces = &sp;
    bp.piece_len = p->send.bytes;
    bp.desc = p->send.desc;
    bp.chunk_cb = NULL;
    int st2 = sd_bulk_start(sb, &bp);
    if (st2 == SD_OK) {
        posted++;
    } else if (sb != NULL) {
        sd_bulk_put(p->pool, sb);
    }
    if ((st != SD_OK || st2 != SD_OK) && *status_p == SD_OK) {
        *status_p = st != SD_OK ? st : st2;
        *suspect_p = p->peer;
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

static void ar_release(struct sd_allreduce *ar)
{
    if (ar->sb)
        ar->sb->active = false;
    if (ar->rb)
        ar->rb->active = false;
    if (ar->sb)
        sd_bulk_put(ar->p.group.pool, ar->sb);
    if (ar->rb)
        sd_bulk_put(ar->p.group.pool, ar->rb);
    ar->sb = ar->rb = NULL;
    for (uint32_t i = 0; i + 1 < ar->p.group.n_members && i < SD_ARRAY_SIZE(ar->direct_rb); i++) {
        if (ar->direct_rb[i]) {
            sd_bulk_put(ar->p.group.pool, ar->direct_rb[i]);
            ar->direct_rb[i] = NULL;
        }
        if (ar->qsb[i]) {
            sd_bulk_put(ar->p.group.pool, ar->qsb[i]);
            ar->qsb[i] = NULL;
        }
    }
}

/* a failure of this node's own (the backend's): the all-reduce fails, naming this node */
static void ar_fail_self(struct sd_allreduce *ar, int status)
{
    if (status != SD_OK && ar->status == SD_OK) {
        ar->status = status;
        ar->suspect = ar->p.group.self;
    }
}

/* what waits for the device besides a ring receive slot (sd_allreduce.w_what) */
enum {
    AR_W_BEGIN = SD_TAG_MAX_CHUNKS, /* the caller's kernels on buf and acc: the exact one starts */
    AR_W_QSTART,                    /* the encodings of the others' segments: phase 0 leaves */
    AR_W_QLEAVE,                    /* our segment's sum encoded: phase 1 leaves */
    AR_W_SUMS,                      /* the sums the caller reads: finished */
};

/* `what` goes on once the queue passed the kernels enqueued so far: SD_OK to go on now (the
 * device is there and nothing waits before it), SD_EAGAIN when sd_allreduce_poll will (kept
 * in queue order), or the backend's failure. */
static int ar_after_queue(struct sd_allreduce *ar, uint32_t what)
{
    uint64_t ticket;
    int st = ar->p.dev->record(ar->p.queue, &ticket);
    if (st != SD_OK)
        return st;
    if (ar->w_n == 0 && (st = ar->p.dev->query(ar->p.queue, ticket)) != SD_EAGAIN)
        return st;
    if (ar->w_n == SD_ARRAY_SIZE(ar->w_ticket))
        return SD_ENOSPC; /* more than one per receive slot: a bug, not the device */
    uint32_t i = (ar->w_head + ar->w_n++) % SD_ARRAY_SIZE(ar->w_ticket);
    ar->w_ticket[i] = ticket;
    ar->w_what[i] = (uint16_t)what;
    return SD_EAGAIN;
}

static void ar_finish(struct sd_allreduce *ar)
{
    ar->running = false;
    ar->w_n = 0;
    ar_release(ar);
    ar->p.cb(ar, ar->status, ar->suspect);
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

/* direct: everyone sends its buffer to everyone (a scatter one: to each member the segment it
 * sums); sum in member order */
static void direct_segment(const struct sd_allreduce *ar, uint32_t pos, size_t *b_p, size_t *len_p)
{
    size_t e = ar->p.count;
    *b_p = 0;
    if (ar->p.scatter)
        sd_scatter_segment(ar->p.count, ar->p.group.n_members, pos, b_p, &e);
    *len_p = e - *b_p;
}

/* the part of buf this member sums */
static void direct_own(const struct sd_allreduce *ar, size_t *b_p, size_t *len_p)
{
    direct_segment(ar, ar->pos, b_p, len_p);
}

static void direct_done(struct sd_bulk *b, int status)
{
    struct sd_allreduce *ar = b->arg;
    ar_note(ar, b, status);
    if (b->is_send)
        sd_bulk_put(ar->p.group.pool, b);
    if (--ar->pending > 0)
        return;
    if (ar->status == SD_OK) {
        /* the sum in member order, ((m0 + m1) + m2) + ..., into member 0's buffer: this node's
         * own, or the first received one; then into acc or back into buf */
        size_t own_b, len;
        direct_own(ar, &own_b, &len);
        float *own = ar->p.buf + own_b, *src[SD_ARRAY_SIZE(ar->direct_rb) + 1] = {NULL};
        for (uint32_t m = 0, o = 0; m < ar->p.group.n_members; m++)
            src[m] = m == ar->pos ? own : ar->p.tmp + (size_t)(o++) * len;
        const struct sd_gpu_ops *dev = ar->p.dev;
        for (uint32_t m = 1; m < ar->p.group.n_members; m++)
            dev->reduce_add(ar->p.queue, src[0], src[m], SD_DTYPE_FP32, len);
        if (ar->p.acc != NULL)
            dev->reduce_add(ar->p.queue, ar->p.acc, src[0], SD_DTYPE_FP32, len);
        else if (src[0] != own)
            dev->copy(ar->p.queue, own, src[0], len * sizeof(float));
        int st = ar_after_queue(ar, AR_W_SUMS); /* the caller reads the sum */
        if (st == SD_EAGAIN)
            return;
        ar_fail_self(ar, st);
    }
    ar_finish(ar);
}

static int direct_start(struct sd_allreduce *ar)
{
    size_t own_b, own_len;
    direct_own(ar, &own_b, &own_len);
    uint32_t others = ar->p.group.n_members - 1;
    if (ar->p.group.pool->n - ar->p.group.pool->in_use < 2 * others)
        return SD_EBUSY;
    ar->pending = 0;
    for (uint32_t m = 0, o = 0; m < ar->p.group.n_members; m++) {
        if (m == ar->pos)
            continue;
        uint32_t peer = ar->p.group.members[m];
        size_t their_b, their_len;
        direct_segment(ar, m, &their_b, &their_len);
        struct sd_exchange_param x = {.pool = ar->p.group.pool,
                                      .tp = ar->p.group.tp,
                                      .peer = peer,
                                      .recv = {.tag = ar->p.tag_base,
                                               .buf = ar->p.tmp + (size_t)o * own_len,
                                               .bytes = own_len * sizeof(float),
                                               .desc = ar->p.tmp_desc},
                                      .send = {.tag = ar->p.tag_base,
                                               .buf = ar->p.buf + their_b,
                                               .bytes = their_len * sizeof(float),
                                               .desc = ar->p.buf_desc},
                                      .chunk_bytes = ar->p.chunk_bytes,
                                      .cb = direct_done,
                                      .arg = ar};
        if (sd_tag_set(&x.recv.tag, SD_TAGF_SRC, peer) != SD_OK ||
            sd_tag_set(&x.send.tag, SD_TAGF_SRC, ar->p.group.self) != SD_OK)
            return SD_ERANGE; /* nothing posted yet: members are checked before */
        ar->pending += sd_bulk_exchange(&x, &ar->direct_rb[o], &ar->status, &ar->suspect);
        o++;
    }
    /* nothing in flight: the caller reports the error; else the callbacks finish the job */
    return ar->pending == 0 ? (ar->status ? ar->status : SD_EIO) : SD_OK;
}

/* ring: n-1 reduce-scatter steps, then n-1 all-gather steps (none for a scatter one), pipelined
 * by chunk: what a node sends at step t+1 is the segment it received (and added into) at step
 * t, so chunk c of step t+1 leaves once chunk c of step t arrived. Reduce-scatter receives land
 * in tmp at the chunk's offset, the next one of chunk c posted once the last was added. The
 * all-gather receives in place, or into acc (the last reduce-scatter step adds into it). */
static uint32_t ring_seg(const struct sd_allreduce *ar, uint32_t t, bool send)
{
    uint32_t n = ar->p.group.n_members;
    if (t < n - 1)
        return send ? (ar->pos + n - t) % n : (ar->pos + 2 * n - t - 1) % n;
    uint32_t u = t - (n - 1);
    return send ? (ar->pos + 1 + n - u) % n : (ar->pos + n - u) % n;
}

/* chunk c of segment s: [*b, *b + *len) in floats; false if the segment has no chunk c */
static bool ring_chunk_range(const struct sd_allreduce *ar, uint32_t s, uint32_t c, size_t *b,
                             size_t *len)
{
    size_t begin, end;
    sd_ring_segment(ar->p.count, ar->p.group.n_members, s, &begin, &end);
    size_t off = (size_t)c * ar->chunk_floats;
    if (begin + off >= end)
        return false;
    *b = begin + off;
    *len = SD_MIN(ar->chunk_floats, end - begin - off);
    return true;
}

static void ring_xfer_cb(struct sd_xfer *x, int status);
static void ring_post_recvs(struct sd_allreduce *ar);

static int ring_post_one(struct sd_allreduce *ar, bool send, uint32_t t, uint32_t c, size_t b,
                         size_t len)
{
    uint32_t slot = t * ar->nch + c;
    struct sd_bulk *bk = send ? ar->sb : ar->rb;
    struct sd_bulk_xfer *bx = &bk->xs[slot];
    uint32_t n = ar->p.group.n_members;
    uint32_t peer =
        send ? ar->p.group.members[(ar->pos + 1) % n] : ar->p.group.members[(ar->pos + n - 1) % n];
    uint32_t src = send ? ar->p.group.members[ar->pos] : peer;
    uint64_t tag = ar->p.tag_base;
    int st = sd_tag_set_ring_step(&tag, t);
    if (st == SD_OK)
        st = sd_tag_set(&tag, SD_TAGF_SRC, src);
    if (st == SD_OK)
        st = sd_tag_set(&tag, SD_TAGF_CHUNK, c);
    if (st != SD_OK) {
        if (ar->status == SD_OK) {
            ar->status = st;
            ar->suspect = peer;
        }
        return st;
    }
    bx->b = bk;
    bx->piece = t;
    bx->off = c;
    bx->len = len * sizeof(float);
    bx->x.cb = ring_xfer_cb;
    float *p = ar->p.tmp + (size_t)c * ar->chunk_floats;
    void *desc = ar->p.tmp_desc;
    if (t >= n - 1 && ar->p.acc != NULL) { /* the all-gather of acc */
        p = ar->p.acc + b;
        desc = ar->p.acc_desc;
    } else if (send || t >= n - 1) {
        p = ar->p.buf + b;
        desc = ar->p.buf_desc;
    }
    st = send ? ar->p.group.tp->ops->send(ar->p.group.tp, peer, tag, p, bx->len, desc, &bx->x)
              : ar->p.group.tp->ops->recv(ar->p.group.tp, peer, tag, 0, p, bx->len, desc, &bx->x);
    if (st != SD_OK) {
        if (ar->status == SD_OK) {
            ar->status = st;
            ar->suspect = peer;
        }
        return st;
    }
    (send ? ar->sstate : ar->rstate)[slot] = 1;
    ar->pending++;
    return SD_OK;
}

/* post every receive whose tmp chunk is free, in step order per chunk index */
static void ring_post_recvs(struct sd_allreduce *ar)
{
    for (uint32_t c = 0; c < ar->nch && ar->status == SD_OK; c++)
        while (ar->rnext[c] < ar->steps) {
            uint32_t t = ar->rnext[c];
            size_t b, len;
            if (!ring_chunk_range(ar, ring_seg(ar, t, false), c, &b, &len)) {
                ar->rnext[c]++; /* step t has no chunk c */
                continue;
            }
            bool busy = false; /* an earlier receive into tmp chunk c not yet added */
            for (uint32_t e = 0; e < t && !busy; e++)
                busy = ar->rstate[e * ar->nch + c] == 1 || ar->rstate[e * ar->nch + c] == 3;
            if (busy || ring_post_one(ar, false, t, c, b, len) != SD_OK)
                break;
            ar->rnext[c]++;
        }
}

/* chunk c received at step t is summed where it is summed: it leaves at step t + 1, and its
 * tmp chunk takes the next receive */
static void ring_forward(struct sd_allreduce *ar, uint32_t t, uint32_t c)
{
    size_t b = 0, len = 0;
    ring_chunk_range(ar, ring_seg(ar, t, false), c, &b, &len);
    if (t + 1 < ar->steps && ar->status == SD_OK)
        ring_post_one(ar, true, t + 1, c, b, len);
    ring_post_recvs(ar);
}

/* every transfer done and (a scatter one's last) sums passed by the queue, or failed */
static bool ring_over(const struct sd_allreduce *ar)
{
    return ar->pending == 0 && ((ar->left == 0 && ar->w_n == 0) || ar->status != SD_OK);
}

static void ring_xfer_cb(struct sd_xfer *x, int status)
{
    struct sd_bulk_xfer *bx = (struct sd_bulk_xfer *)x;
    struct sd_allreduce *ar = bx->b->arg;
    bool send = bx->b == ar->sb;
    uint32_t t = bx->piece, c = (uint32_t)bx->off, n = ar->p.group.n_members;
    (send ? ar->sstate : ar->rstate)[t * ar->nch + c] = 2;
    ar->pending--;
    if (status != SD_OK) {
        if (ar->status == SD_OK) {
            ar->status = status;
            ar->suspect = x->peer;
        }
    } else if (send) {
        ar->bytes_sent += bx->len;
        ar->left--;
    } else {
        ar->bytes_recv += x->len;
        ar->left--;
        size_t b = 0, len = 0;
        ring_chunk_range(ar, ring_seg(ar, t, false), c, &b, &len);
        const float *src = ar->p.tmp + (size_t)c * ar->chunk_floats;
        if (t < n - 1) /* reduce-scatter: add what arrived */
            ar->p.dev->reduce_add(ar->p.queue, ar->p.buf + b, src, SD_DTYPE_FP32, len);
        if (t + 1 == n - 1 && ar->p.acc != NULL) /* the segment's sum is done: into acc */
            ar->p.dev->reduce_add(ar->p.queue, ar->p.acc + b, ar->p.buf + b, SD_DTYPE_FP32, len);
        /* the sum leaves next, and the next step's chunk lands where this one was read: once
         * the queue passed the sums (state 3 until then) */
        int st = t < n - 1 ? ar_after_queue(ar, t * ar->nch + c) : SD_OK;
        if (st == SD_EAGAIN) {
            ar->rstate[t * ar->nch + c] = 3;
        } else {
            ar_fail_self(ar, st);
            ring_forward(ar, t, c);
        }
    }
    if (ring_over(ar))
        ar_finish(ar);
}

static int ring_start(struct sd_allreduce *ar)
{
    uint32_t n = ar->p.group.n_members;
    ar->steps = (ar->p.scatter ? 1 : 2) * (n - 1);
    size_t seg_max = (ar->p.count + n - 1) / n;
    /* every (step, chunk) needs its own transfer slot in the two bulks */
    uint32_t nch_cap = SD_MAX(1u, SD_TAG_MAX_CHUNKS / ar->steps);
    size_t cf = SD_MAX(ar->p.chunk_bytes / sizeof(float), 16);
    if ((seg_max + cf - 1) / cf > nch_cap)
        cf = (seg_max + nch_cap - 1) / nch_cap;
    ar->chunk_floats = SD_MAX(cf, 1);
    ar->nch = (uint32_t)SD_MAX(1, (seg_max + ar->chunk_floats - 1) / ar->chunk_floats);
    if (ar->steps > SD_TAG_MAX_CHUNKS || ar->steps * ar->nch > SD_TAG_MAX_CHUNKS)
        return SD_EINVAL;
    /* marked active so that cancelling a job's receives (and its failure message) sees them */
    ar->sb->arg = ar->rb->arg = ar;
    ar->sb->active = ar->rb->active = true;
    ar->sb->is_send = true;
    ar->rb->is_send = false;
    ar->sb->peer = ar->p.group.members[(ar->pos + 1) % n];
    ar->rb->peer = ar->p.group.members[(ar->pos + n - 1) % n];
    ar->sb->n = ar->rb->n = ar->steps * ar->nch;
    for (uint32_t i = 0; i < ar->steps * ar->nch; i++)
        ar->sb->xs[i].x.kind = ar->rb->xs[i].x.kind = 0;
    ar->left = 0;
    for (uint32_t t = 0; t < ar->steps; t++)
        for (uint32_t c = 0; c < ar->nch; c++) {
            size_t b, len;
            ar->left += ring_chunk_range(ar, ring_seg(ar, t, true), c, &b, &len);
            ar->left += ring_chunk_range(ar, ring_seg(ar, t, false), c, &b, &len);
        }
    if (ar->left == 0) { /* nothing to move (count 0) */
        ar_finish(ar);
        return SD_OK;
    }
    ring_post_recvs(ar);
    for (uint32_t c = 0; c < ar->nch && ar->status == SD_OK; c++) {
        size_t b, len;
        if (ring_chunk_range(ar, ring_seg(ar, 0, true), c, &b, &len))
            ring_post_one(ar, true, 0, c, b, len);
    }
    if (ar->status != SD_OK && ar->pending == 0) {
        int st = ar->status;
        ar_release(ar);
        return st; /* nothing in flight: the caller reports it */
    }
    return SD_OK;
}

/* ---- quantized all-reduce (coll.h) */

void sd_qsegment(size_t count, uint32_t n, uint32_t qblock, uint32_t s, size_t *begin_p,
                 size_t *end_p)
{
    uint64_t nb = sd_codec_blocks(count, qblock);
    *begin_p = SD_MIN((size_t)(nb * s / n) * qblock, count);
    *end_p = SD_MIN((size_t)(nb * (s + 1) / n) * qblock, count);
}

static size_t qslot_bytes(size_t count, uint32_t n, int qbits, uint32_t qblock)
{
    uint64_t most = 0;
    for (uint32_t s = 0; s < n; s++) {
        size_t b, e;
        sd_qsegment(count, n, qblock, s, &b, &e);
        most = SD_MAX(most, sd_codec_bytes(qbits, e - b, qblock));
    }
    return sd_round_up(most, 64);
}

size_t sd_allreduce_qbuf_bytes(size_t count, uint32_t n, int qbits, uint32_t qblock)
{
    return n < 2 ? 0 : 2 * (size_t)n * qslot_bytes(count, n, qbits, qblock);
}

/* qbuf: n send slots (slot m: the encoding of member m's segment; our own: of our sum), then n
 * receive slots (slot m: what member m sent) */
static uint8_t *qslot(const struct sd_allreduce *ar, bool recv, uint32_t m)
{
    return ar->p.qbuf + ((recv ? ar->p.group.n_members : 0) + m) * ar->qstride;
}

/* member m's segment (with scatter sd_scatter_segment's): its first element in *b_p, length */
static size_t qrange(const struct sd_allreduce *ar, uint32_t m, size_t *b_p)
{
    uint32_t n = ar->p.group.n_members;
    size_t e;
    sd_qsegment(ar->p.count, n, ar->p.qblock, ar->p.scatter ? (m + 1) % n : m, b_p, &e);
    return e - *b_p;
}

static size_t qlen(const struct sd_allreduce *ar, uint32_t m)
{
    size_t b;
    return qrange(ar, m, &b);
}

static void qar_done(struct sd_bulk *b, int status);

static void qar_post(struct sd_allreduce *ar, struct sd_bulk *b, bool is_send, uint32_t m,
                     uint32_t slot, size_t elems)
{
    uint32_t peer = ar->p.group.members[m];
    uint64_t tag = ar->p.tag_base;
    int st = sd_tag_set(&tag, SD_TAGF_SRC, is_send ? ar->p.group.self : peer);
    if (st == SD_OK)
        st = sd_tag_set_ring_step(&tag, ar->qphase);
    void *piece = qslot(ar, !is_send, slot);
    if (st == SD_OK)
        st = sd_bulk_start(b, &(struct sd_bulk_param){
                                  .tp = ar->p.group.tp,
                                  .is_send = is_send,
                                  .peer = peer,
                                  .tag = tag,
                                  .pieces = &piece,
                                  .n_pieces = 1,
                                  .piece_len = sd_codec_bytes(ar->p.qbits, elems, ar->p.qblock),
                                  .chunk_bytes = ar->p.chunk_bytes,
                                  .desc = ar->p.qbuf_desc,
                                  .cb = qar_done,
                                  .arg = ar});
    if (st == SD_OK) {
        ar->pending++;
        ar->qraw += elems * sizeof(float);
    } else if (ar->status == SD_OK) {
        ar->status = st;
        ar->suspect = peer;
    }
}

/* phase 0: member m's segment to m, ours from m; phase 1: our sum to m, m's from m */
static void qar_exchange(struct sd_allreduce *ar)
{
    ar->pending = 0;
    for (uint32_t m = 0, o = 0; m < ar->p.group.n_members; m++) {
        if (m == ar->pos)
            continue;
        bool first = ar->qphase == 0;
        qar_post(ar, ar->direct_rb[o], false, m, m, qlen(ar, first ? ar->pos : m));
        qar_post(ar, ar->qsb[o], true, m, first ? m : ar->pos, qlen(ar, first ? m : ar->pos));
        o++;
    }
}

/* phase 1: our encoded sum to every member: true while its transfers run (a post that failed
 * is in ar->status: the last completion finishes) */
static bool qar_second(struct sd_allreduce *ar)
{
    if (ar->status != SD_OK)
        return false;
    ar->qphase = 1;
    qar_exchange(ar);
    return ar->pending > 0;
}

static void qar_done(struct sd_bulk *b, int status)
{
    struct sd_allreduce *ar = b->arg;
    const struct sd_gpu_ops *dev = ar->p.dev;
    ar_note(ar, b, status);
    if (--ar->pending > 0)
        return;
    uint32_t n = ar->p.group.n_members, bits = (uint32_t)ar->p.qbits, B = ar->p.qblock;
    if (ar->status == SD_OK && ar->qphase == 0) {
        /* our segment: our exact values plus the others' decoded, in member order; encoded
         * once, and decoded back so that we hold what the others will (with scatter the fp32
         * sum stays, the caller reads it) */
        size_t at, len = qrange(ar, ar->pos, &at);
        float *mine = ar->p.buf + at;
        for (uint32_t m = 0; m < n; m++)
            if (m != ar->pos)
                sd_gpu_decode(dev, ar->p.queue, mine, qslot(ar, true, m), (int)bits, len, B, true);
        if (!ar->p.scatter) {
            sd_gpu_encode(dev, ar->p.queue, qslot(ar, false, ar->pos), (int)bits, mine, len, B);
            sd_gpu_decode(dev, ar->p.queue, mine, qslot(ar, false, ar->pos), (int)bits, len, B,
                          false);
            int st = ar_after_queue(ar, AR_W_QLEAVE); /* the encoding leaves */
            if (st == SD_EAGAIN)
                return;
            ar_fail_self(ar, st);
            if (!qar_second(ar))
                ar_finish(ar);
            return;
        }
    } else if (ar->status == SD_OK) {
        for (uint32_t m = 0; m < n; m++) {
            size_t bm, lm = qrange(ar, m, &bm);
            if (m != ar->pos)
                sd_gpu_decode(dev, ar->p.queue, ar->p.buf + bm, qslot(ar, true, m), (int)bits, lm,
                              B, false);
        }
    }
    if (ar->status == SD_OK) {
        int st = ar_after_queue(ar, AR_W_SUMS); /* the caller reads the sum */
        if (st == SD_EAGAIN)
            return;
        ar_fail_self(ar, st);
    }
    ar_finish(ar);
}

static int qar_start(struct sd_allreduce *ar)
{
    uint32_t n = ar->p.group.n_members;
    ar->qstride = qslot_bytes(ar->p.count, n, ar->p.qbits, ar->p.qblock);
    for (uint32_t o = 0; o + 1 < n; o++) {
        ar->direct_rb[o] = sd_bulk_get(ar->p.group.pool);
        ar->qsb[o] = sd_bulk_get(ar->p.group.pool);
        if (ar->direct_rb[o] == NULL || ar->qsb[o] == NULL) {
            ar_release(ar);
            return SD_EBUSY;
        }
    }
    /* every other member's segment encoded once, with its error kept for the next time */
    for (uint32_t m = 0; m < n; m++) {
        if (m == ar->pos)
            continue;
        size_t b, len = qrange(ar, m, &b);
        if (ar->p.qerr != NULL)
            ar->p.dev->quantize_ef(ar->p.queue, qslot(ar, false, m), ar->p.qbits, ar->p.buf + b,
                                   ar->p.qerr + b, len, ar->p.qblock);
        else
            sd_gpu_encode(ar->p.dev, ar->p.queue, qslot(ar, false, m), ar->p.qbits, ar->p.buf + b,
                          len, ar->p.qblock);
    }
    int st = ar_after_queue(ar, AR_W_QSTART); /* the encodings leave */
    if (st == SD_EAGAIN)
        return SD_OK;
    if (st != SD_OK) {
        ar_release(ar);
        return st;
    }
    qar_exchange(ar);
    if (ar->pending == 0) {
        st = ar->status ? ar->status : SD_EIO;
        ar_release(ar);
        return st;
    }
    return SD_OK;
}

/* the exact one, buf and acc as the caller's kernels left them: direct or the ring; an error with
 * nothing in flight */
static int exact_begin(struct sd_allreduce *ar)
{
    const struct sd_coll_group *g = &ar->p.group;
    ar->direct = ar->p.count * sizeof(float) <= ar->p.small_bytes;
    if (ar->direct)
        return direct_start(ar);
    ar->sb = sd_bulk_get(g->pool);
    ar->rb = sd_bulk_get(g->pool);
    if (ar->sb == NULL || ar->rb == NULL) {
        if (ar->sb)
            sd_bulk_put(g->pool, ar->sb);
        if (ar->rb)
            sd_bulk_put(g->pool, ar->rb);
        ar->sb = ar->rb = NULL;
        return SD_EBUSY;
    }
    return ring_start(ar);
}

/* what waited for the queue goes on; false once the all-reduce finished (cb ran) */
static bool ar_go_on(struct sd_allreduce *ar, uint32_t what)
{
    int st;
    switch (what) {
    case AR_W_BEGIN:
        if ((st = exact_begin(ar)) != SD_OK) { /* nothing in flight */
            ar_fail_self(ar, st);
            ar_finish(ar);
        }
        break;
    case AR_W_QSTART:
        if (ar->status == SD_OK)
            qar_exchange(ar);
        if (ar->pending == 0) {
            ar_fail_self(ar, SD_EIO);
            ar_finish(ar);
        }
        break;
    case AR_W_QLEAVE:
        if (!qar_second(ar))
            ar_finish(ar);
        break;
    case AR_W_SUMS:
        ar_finish(ar);
        break;
    default: /* ring receive slot what, summed */
        ar->rstate[what] = 2;
        ring_forward(ar, what / ar->nch, what % ar->nch);
        if (ring_over(ar))
            ar_finish(ar);
        break;
    }
    return ar->running;
}

bool sd_allreduce_poll(struct sd_allreduce *ar)
{
    bool moved = false;
    while (ar->running && ar->w_n > 0) {
        uint32_t h = ar->w_head;
        int st = ar->p.dev->query(ar->p.queue, ar->w_ticket[h]);
        if (st == SD_EAGAIN)
            break;
        ar->w_head = (h + 1) % SD_ARRAY_SIZE(ar->w_ticket);
        ar->w_n--;
        moved = true;
        ar_fail_self(ar, st);
        if (!ar_go_on(ar, ar->w_what[h]))
            break; /* finished: cb may have started it again */
    }
    return moved;
}

bool sd_allreduce_waiting(const struct sd_allreduce *ar)
{
    return ar->running && ar->w_n > 0;
}

void sd_allreduce_abort(struct sd_allreduce *ar, int status)
{
    if (!ar->running)
        return;
    ar_fail_self(ar, status);
    ar->w_n = 0;
    if (ar->pending == 0)
        ar_finish(ar);
}

int sd_allreduce_start(struct sd_allreduce *ar, const struct sd_allreduce_param *p)
{
    memset(ar, 0, sizeof(*ar));
    ar->p = *p;
    ar->pos = UINT32_MAX;
    const struct sd_coll_group *g = &p->group;
    for (uint32_t i = 0; i < g->n_members; i++)
        if (g->members[i] == g->self)
            ar->pos = i;
    if (ar->pos == UINT32_MAX || g->n_members < 2 ||
        g->n_members - 1 > SD_ARRAY_SIZE(ar->direct_rb) || p->dev == NULL ||
        p->dtype != SD_DTYPE_FP32)
        return SD_EINVAL;
    bool int_codec = p->qbits == SD_CODEC_INT4 || p->qbits == SD_CODEC_INT8;
    if (p->qbits != 0
            ? !(int_codec ? p->qblock >= SD_CODEC_MIN_BLOCK && p->qblock <= SD_CODEC_MAX_BLOCK
                          : sd_codec_is_float(p->qbits) && p->qblock == 1 && p->qerr == NULL) ||
                  p->qbuf == NULL || p->acc != NULL
            : (p->scatter && p->acc != NULL) ||
                  p->tmp_count < sd_allreduce_tmp_floats(p->count, g->n_members, p->small_bytes))
        return SD_EINVAL;
    for (uint32_t i = 0; i < g->n_members; i++)
        if (g->members[i] >= SD_MAX_NODES)
            return SD_ERANGE;
    ar->running = true;
    /* the quantized one encodes buf first, on the same queue: its first wait is after that */
    int st = p->qbits != 0 ? qar_start(ar) : ar_after_queue(ar, AR_W_BEGIN);
    if (st == SD_OK && p->qbits == 0)
        st = exact_begin(ar);
    if (st == SD_EAGAIN)
        st = SD_OK; /* sd_allreduce_poll begins it */
    if (st != SD_OK)
        ar->running = false; /* nothing in flight: the caller reports it */
    return st;
}

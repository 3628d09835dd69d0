/* Staging of device memory through pinned host buffers (transport.h, sd_transport_stage): a
 * decorator over any transport's send, receive, cancel and progress, for memory the provider
 * cannot read or write itself (a GPU's, where the provider has no FI_HMEM, as tcp never has).
 *
 * A send of device memory waits for a bounce buffer, copies the bytes into it on the device's
 * queue, and is posted from it once the copy is done (polled in progress, never waited for); a
 * receive into device memory is posted into a bounce buffer and copied out once it completes.
 * Every transfer the engine posts is one chunk of its pipeline, and it keeps several in flight,
 * so the copy of one chunk overlaps the wire time of the others. Bounce buffers are kept by
 * size class and reused; sends hold at most the cap given to sd_transport_stage at once
 * (beyond it they wait for one to come back), receives always get theirs, so a send never waits
 * on a receive that waits on a send. The transfer keeps its identity: the same sd_xfer is posted,
 * its callback is the stage's while the stage holds it, and the caller's is called once, as without
 * staging. */
#include "transport/transport.h"
#include "sd/log.h"
#include "sd/status.h"

#include <stdlib.h>
#include <string.h>

#define STAGE_CLASSES   48
#define STAGE_MIN_CLASS 16 /* 64 KiB */

struct sd_bounce {
    struct sd_bounce *next; /* on its class's free list */
    struct sd_bounce *all;  /* every buffer the stage made, free or held (freed at close) */
    void *p;
    uint32_t cls;
    void *desc, *mr;
};

/* where a staged transfer is: waiting for a bounce buffer, copying out of device memory, held
 * by the transport, copying into device memory */
enum { OP_WAIT = 1, OP_COPY_OUT, OP_POSTED, OP_COPY_IN };

struct sd_stage {
    struct sd_transport_ops ops; /* the staged table tp->ops points at */
    const struct sd_transport_ops *inner;
    struct sd_stage_hooks h;
    struct sd_bounce *free_b[STAGE_CLASSES];
    struct sd_bounce *all; /* every buffer, whatever holds it: a transfer still posted at close
                            * (a job that failed under it) gives its own back never */
    uint32_t n_class[STAGE_CLASSES]; /* buffers of each class, free or held */
    uint32_t min_cls;                /* the class reserved (sd_transport_stage_reserve) */
    uint64_t send_held, send_cap;
    struct sd_xfer *wait_head, *wait_tail; /* FIFO: a send that waits holds the ones behind */
    struct sd_xfer *copying;
};

/* the class of a buffer for len bytes: at least the reserved one (every chunk of a pipeline,
 * its short last one too, takes a reserved buffer) */
static uint32_t class_of(const struct sd_stage *st, size_t len)
{
    uint32_t c = st->min_cls;
    while (c < STAGE_CLASSES - 1 && ((size_t)1 << c) < len)
        c++;
    return c;
}

/* a new buffer of class c, on its free list */
static int bounce_new(struct sd_transport *tp, uint32_t c)
{
    struct sd_stage *st = tp->stage;
    size_t size = (size_t)1 << c;
    struct sd_bounce *b = calloc(1, sizeof(*b));
    if (b == NULL || st->h.pinned_alloc(st->h.ctx, size, &b->p) != SD_OK) {
        free(b);
        return SD_ENOMEM;
    }
    if (st->inner->mr_reg(tp, b->p, size, &b->desc, &b->mr) != SD_OK) {
        st->h.pinned_free(st->h.ctx, b->p);
        free(b);
        return SD_EIO;
    }
    b->cls = c;
    b->next = st->free_b[c];
    st->free_b[c] = b;
    b->all = st->all;
    st->all = b;
    st->n_class[c]++;
    tp->staging_buffer_bytes += size;
    return SD_OK;
}

/* x's buffer: sends within the cap (or alone), receives always (a new one if none is free) */
static struct sd_bounce *bounce_get(struct sd_transport *tp, struct sd_xfer_staged *op)
{
    struct sd_stage *st = tp->stage;
    uint32_t c = class_of(st, op->len);
    uint64_t size = (uint64_t)1 << c;
    if (op->send && st->send_held > 0 && st->send_held + size > st->send_cap)
        return NULL;
    if (st->free_b[c] == NULL && bounce_new(tp, c) == SD_OK) /* beyond the reservation */
        SD_DEBUG("stage", "a %s of %zu bytes made a %llu-byte pinned buffer (%llu bytes held)",
                 op->send ? "send" : "receive", op->len, (unsigned long long)size,
                 (unsigned long long)tp->staging_buffer_bytes);
    struct sd_bounce *b = st->free_b[c];
    if (b == NULL)
        return NULL;
    st->free_b[c] = b->next;
    if (op->send)
        st->send_held += size;
    return b;
}

static void bounce_put(struct sd_transport *tp, struct sd_xfer_staged *op)
{
    struct sd_stage *st = tp->stage;
    struct sd_bounce *b = op->b;
    if (b == NULL)
        return;
    if (op->send)
        st->send_held -= (uint64_t)1 << b->cls;
    b->next = st->free_b[b->cls];
    st->free_b[b->cls] = b;
    op->b = NULL;
}

/* the caller's transfer is done: its callback runs once, as the transport's would */
static void finish(struct sd_xfer *x, int status)
{
    struct sd_xfer_staged *op = &x->staged;
    bounce_put(op->tp, op);
    op->state = 0;
    x->cb = op->cb;
    x->arg = op->arg;
    x->cb(x, status);
}

/* the stage holds x (counted in inflight, as a transfer the transport holds) */
static void hold(struct sd_xfer *x, int state)
{
    struct sd_xfer_staged *op = &x->staged;
    struct sd_stage *st = op->tp->stage;
    op->state = (uint8_t)state;
    op->tp->inflight++;
    if (state == OP_WAIT) {
        op->next = NULL;
        if (st->wait_tail != NULL)
            st->wait_tail->staged.next = x;
        else
            st->wait_head = x;
        st->wait_tail = x;
    } else {
        op->next = st->copying;
        st->copying = x;
    }
}

/* take x out of the stage's list it is in (waiting or copying) */
static void unhold(struct sd_xfer *x)
{
    struct sd_xfer_staged *op = &x->staged;
    struct sd_stage *st = op->tp->stage;
    struct sd_xfer **pp = op->state == OP_WAIT ? &st->wait_head : &st->copying, *prev = NULL;
    for (; *pp != NULL; prev = *pp, pp = &(*pp)->staged.next)
        if (*pp == x) {
            *pp = op->next;
            if (op->state == OP_WAIT && st->wait_tail == x)
                st->wait_tail = prev;
            break;
        }
    op->tp->inflight--;
}

/* enqueue the device's copy; SD_OK, or the hook's refusal */
static int copy(struct sd_xfer *x, void *dst, const void *src, size_t n, int state)
{
    struct sd_xfer_staged *op = &x->staged;
    struct sd_stage *st = op->tp->stage;
    int s = st->h.copy(st->h.ctx, dst, src, n, &op->ticket);
    if (s == SD_OK) {
        op->tp->staged_bytes += n;
        hold(x, state);
    }
    return s;
}

static void stage_cb(struct sd_xfer *x, int status);

/* hand x to the transport, from its bounce buffer */
static int post(struct sd_xfer *x)
{
    struct sd_xfer_staged *op = &x->staged;
    struct sd_stage *st = op->tp->stage;
    op->state = OP_POSTED;
    x->cb = stage_cb;
    x->arg = NULL;
    return op->send ? st->inner->send(op->tp, op->peer, op->tag, op->b->p, op->len, op->b->desc, x)
                    : st->inner->recv(op->tp, op->peer, op->tag, op->ignore, op->b->p, op->len,
                                      op->b->desc, x);
}

/* x has its bounce buffer: a send copies into it, a receive is posted into it */
static int start(struct sd_xfer *x)
{
    struct sd_xfer_staged *op = &x->staged;
    return op->send ? copy(x, op->b->p, op->dev, op->len, OP_COPY_OUT) : post(x);
}

/* the transport completed x (or failed or cancelled it) */
static void stage_cb(struct sd_xfer *x, int status)
{
    struct sd_xfer_staged *op = &x->staged;
    if (op->send || status != SD_OK || op->cancelled) {
        finish(x, op->cancelled && status == SD_OK ? SD_ECANCELED : status);
        return;
    }
    int s = copy(x, op->dev, op->b->p, x->len, OP_COPY_IN);
    if (s != SD_OK)
        finish(x, s);
}

/* a new staged transfer: started at once when a buffer is there, else it waits; a failure to
 * start is the caller's to see, as the transport's own refusals are */
static int submit(struct sd_transport *tp, struct sd_xfer *x, bool send, uint32_t peer,
                  uint64_t tag, uint64_t ignore, const void *buf, size_t len)
{
    struct sd_stage *st = tp->stage;
    struct sd_xfer_staged *op = &x->staged;
    *op = (struct sd_xfer_staged){.tp = tp,
                                  .cb = x->cb,
                                  .arg = x->arg,
                                  .send = send,
                                  .peer = peer,
                                  .tag = tag,
                                  .ignore = ignore,
                                  .dev = (void *)(uintptr_t)buf,
                                  .len = len};
    x->kind = 0; /* not the transport's until posted */
    x->cb = stage_cb;
    x->arg = NULL;
    /* sends queue behind sends that wait; a receive never waits for one (only for memory) */
    if ((send && st->wait_head != NULL) || (op->b = bounce_get(tp, op)) == NULL) {
        hold(x, OP_WAIT);
        return SD_OK;
    }
    int s = start(x);
    if (s != SD_OK) {
        bounce_put(tp, op);
        op->state = 0;
        x->cb = op->cb;
        x->arg = op->arg;
    }
    return s;
}

static int stage_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf,
                      size_t len, void *desc, struct sd_xfer *x)
{
    struct sd_stage *st = tp->stage;
    if (len == 0 || !st->h.is_device(st->h.ctx, buf))
        return st->inner->send(tp, peer, tag, buf, len, desc, x);
    if (peer >= tp->n_peers)
        return SD_EINVAL;
    return submit(tp, x, true, peer, tag, 0, buf, len);
}

static int stage_recv(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore,
                      void *buf, size_t len, void *desc, struct sd_xfer *x)
{
    struct sd_stage *st = tp->stage;
    if (len == 0 || !st->h.is_device(st->h.ctx, buf))
        return st->inner->recv(tp, peer, tag, ignore, buf, len, desc, x);
    if (peer != SD_PEER_ANY && peer >= tp->n_peers)
        return SD_EINVAL;
    return submit(tp, x, false, peer, tag, ignore, buf, len);
}

static void stage_cancel(struct sd_transport *tp, struct sd_xfer *x)
{
    struct sd_stage *st = tp->stage;
    struct sd_xfer_staged *op = &x->staged;
    if (x->cb != stage_cb) {
        st->inner->cancel(tp, x);
        return;
    }
    if (op->state == OP_WAIT) {
        unhold(x);
        finish(x, SD_ECANCELED);
    } else if (op->state == OP_POSTED) {
        op->cancelled = true;
        st->inner->cancel(tp, x);
    } else { /* a copy runs: x completes, cancelled, once the device is done with the buffer */
        op->cancelled = true;
    }
}

/* copies the device finished: sends go to the transport, receives to their callers */
static int advance_copies(struct sd_transport *tp)
{
    struct sd_stage *st = tp->stage;
    int done = 0;
    for (struct sd_xfer *x = st->copying, *next; x != NULL; x = next) {
        struct sd_xfer_staged *op = &x->staged;
        next = op->next;
        int s = st->h.done(st->h.ctx, op->ticket);
        if (s == SD_EAGAIN)
            continue;
        unhold(x);
        if (s == SD_OK && op->cancelled)
            s = SD_ECANCELED;
        else if (s == SD_OK && op->state == OP_COPY_OUT && (s = post(x)) == SD_OK)
            continue; /* the transport has it now */
        finish(x, s);
        done++;
    }
    return done;
}

/* transfers that waited for a bounce buffer, in order, while buffers come */
static int advance_waiting(struct sd_transport *tp)
{
    struct sd_stage *st = tp->stage;
    int done = 0;
    while (st->wait_head != NULL) {
        struct sd_xfer *x = st->wait_head;
        struct sd_xfer_staged *op = &x->staged;
        if ((op->b = bounce_get(tp, op)) == NULL)
            break;
        unhold(x);
        int s = start(x);
        if (s != SD_OK) {
            finish(x, s);
            done++;
        }
    }
    return done;
}

static int stage_progress(struct sd_transport *tp)
{
    struct sd_stage *st = tp->stage;
    /* sends whose copy is done go out before the transport is driven */
    int copied = advance_copies(tp);
    int done = st->inner->progress(tp);
    if (done < 0)
        return done;
    return done + copied + advance_waiting(tp);
}

static bool stage_can_sleep(struct sd_transport *tp)
{
    struct sd_stage *st = tp->stage;
    /* a device copy completes without waking the loop: poll while one runs */
    return st->copying == NULL && st->wait_head == NULL && st->inner->can_sleep(tp);
}

static void stage_close(struct sd_transport *tp)
{
    struct sd_stage *st = tp->stage;
    /* the daemon stops: every buffer goes, free or still held by a transfer (waiting, copying,
     * or posted to the transport, whose completion will not come) */
    while (st->all != NULL) {
        struct sd_bounce *b = st->all;
        st->all = b->all;
        st->inner->mr_dereg(tp, b->mr);
        st->h.pinned_free(st->h.ctx, b->p);
        free(b);
    }
    const struct sd_transport_ops *inner = st->inner;
    if (st->h.release != NULL)
        st->h.release(st->h.ctx);
    tp->stage = NULL;
    tp->ops = inner;
    free(st);
    inner->close(tp);
}

int sd_transport_stage(struct sd_transport *tp, const struct sd_stage_hooks *h, uint64_t cap)
{
    struct sd_stage *st = calloc(1, sizeof(*st));
    if (st == NULL)
        return SD_ENOMEM;
    st->inner = tp->ops;
    st->h = *h;
    st->send_cap = cap;
    st->min_cls = STAGE_MIN_CLASS;
    st->ops = *tp->ops;
    st->ops.send = stage_send;
    st->ops.recv = stage_recv;
    st->ops.cancel = stage_cancel;
    st->ops.progress = stage_progress;
    st->ops.can_sleep = stage_can_sleep;
    st->ops.close = stage_close;
    tp->stage = st;
    tp->ops = &st->ops;
    return SD_OK;
}

int sd_transport_stage_reserve(struct sd_transport *tp, size_t bytes, uint32_t count)
{
    if (tp == NULL || tp->stage == NULL)
        return SD_OK;
    struct sd_stage *st = tp->stage;
    uint32_t c = class_of(st, bytes);
    if (c > st->min_cls)
        st->min_cls = c;
    while (st->n_class[c] < count) {
        int s = bounce_new(tp, c);
        if (s != SD_OK)
            return s;
    }
    return SD_OK;
}

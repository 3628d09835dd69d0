/* The transport's staging of device memory (daemon/transport/stage.c) over a loopback transport
 * written here and a device whose copies run only when the test says so, as a GPU's stream may
 * lag behind the loop:
 *   - device to device through the stage: the bytes arrive; a send is on the wire only once its
 *     copy out is done, a receive completes only once its copy in is done; staging_bytes counts
 *     both; each callback runs once; host memory passes untouched;
 *   - sends hold at most the cap of buffers and wait in order beyond it; receives always get one,
 *     also while sends wait;
 *   - cancelling a waiting send, a send whose copy runs, a posted receive: SD_ECANCELED once,
 *     nothing of it on the wire;
 *   - a copy the device refuses, or that fails on the device: the transfer fails with it;
 *   - a reservation makes the buffers once (no allocation on the data path); close frees every
 *     buffer and releases the hooks. */
#include "check.h"
#include "sd/status.h"
#include "transport/transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a loopback transport: messages from sends match posted receives by tag */

#define MAXQ 64

struct loop {
    struct sd_transport base;
    struct sd_xfer *sends[MAXQ], *recvs[MAXQ];
    const void *sbuf[MAXQ];
    size_t slen[MAXQ];
    void *rbuf[MAXQ];
    size_t rcap[MAXQ];
    int ns, nr;
    int wire; /* messages delivered */
    uint64_t wire_tags[MAXQ];
};

static int loop_mr_reg(struct sd_transport *tp, void *buf, size_t len, void **desc_p,
                       void **handle_p)
{
    (void)tp;
    (void)buf;
    (void)len;
    *desc_p = NULL;
    *handle_p = NULL;
    return SD_OK;
}

static void loop_mr_dereg(struct sd_transport *tp, void *handle)
{
    (void)tp;
    (void)handle;
}

static int loop_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf,
                     size_t len, void *desc, struct sd_xfer *x)
{
    struct loop *l = (struct loop *)tp;
    (void)peer;
    (void)desc;
    x->tag = tag;
    l->sends[l->ns] = x;
    l->sbuf[l->ns] = buf;
    l->slen[l->ns++] = len;
    tp->inflight++;
    return SD_OK;
}

static int loop_recv(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore,
                     void *buf, size_t len, void *desc, struct sd_xfer *x)
{
    struct loop *l = (struct loop *)tp;
    (void)peer;
    (void)ignore;
    (void)desc;
    x->tag = tag;
    l->recvs[l->nr] = x;
    l->rbuf[l->nr] = buf;
    l->rcap[l->nr++] = len;
    tp->inflight++;
    return SD_OK;
}

static void take(struct sd_xfer **q, int *n, int i)
{
    memmove(&q[i], &q[i + 1], (size_t)(*n - i - 1) * sizeof(*q));
    (*n)--;
}

static void loop_cancel(struct sd_transport *tp, struct sd_xfer *x)
{
    struct loop *l = (struct loop *)tp;
    for (int i = 0; i < l->nr; i++)
        if (l->recvs[i] == x) {
            memmove(&l->rbuf[i], &l->rbuf[i + 1], (size_t)(l->nr - i - 1) * sizeof(void *));
            memmove(&l->rcap[i], &l->rcap[i + 1], (size_t)(l->nr - i - 1) * sizeof(size_t));
            take(l->recvs, &l->nr, i);
            tp->inflight--;
            x->cb(x, SD_ECANCELED);
            return;
        }
}

/* the first send and the first receive of its tag meet */
static int loop_progress(struct sd_transport *tp)
{
    struct loop *l = (struct loop *)tp;
    int done = 0;
    for (int s = 0; s < l->ns; s++)
        for (int r = 0; r < l->nr; r++) {
            if (l->recvs[r]->tag != l->sends[s]->tag)
                continue;
            struct sd_xfer *sx = l->sends[s], *rx = l->recvs[r];
            size_t n = l->slen[s] < l->rcap[r] ? l->slen[s] : l->rcap[r];
            memcpy(l->rbuf[r], l->sbuf[s], n);
            l->wire_tags[l->wire++ % MAXQ] = sx->tag;
            memmove(&l->sbuf[s], &l->sbuf[s + 1], (size_t)(l->ns - s - 1) * sizeof(void *));
            memmove(&l->slen[s], &l->slen[s + 1], (size_t)(l->ns - s - 1) * sizeof(size_t));
            take(l->sends, &l->ns, s);
            memmove(&l->rbuf[r], &l->rbuf[r + 1], (size_t)(l->nr - r - 1) * sizeof(void *));
            memmove(&l->rcap[r], &l->rcap[r + 1], (size_t)(l->nr - r - 1) * sizeof(size_t));
            take(l->recvs, &l->nr, r);
            tp->inflight -= 2;
            rx->len = n;
            sx->cb(sx, SD_OK);
            rx->cb(rx, SD_OK);
            return done + 2 + loop_progress(tp);
        }
    return done;
}

static bool loop_can_sleep(struct sd_transport *tp)
{
    (void)tp;
    return true;
}

static int closed;

static void loop_close(struct sd_transport *tp)
{
    (void)tp;
    closed++;
}

static const struct sd_transport_ops loop_ops = {.name = "loop",
                                                 .mr_reg = loop_mr_reg,
                                                 .mr_dereg = loop_mr_dereg,
                                                 .send = loop_send,
                                                 .recv = loop_recv,
                                                 .cancel = loop_cancel,
                                                 .progress = loop_progress,
                                                 .can_sleep = loop_can_sleep,
                                                 .close = loop_close};

/* ---- a device: memory in dev[], copies queued until dev_run */

static uint8_t dev[1 << 22];
static struct {
    void *dst;
    const void *src;
    size_t n;
} pending[256];
static uint64_t queued, ran;
static int refuse_copy, fail_device, pinned_allocs, pinned_frees, released;

static bool h_is_device(void *ctx, const void *p)
{
    (void)ctx;
    return (const uint8_t *)p >= dev && (const uint8_t *)p < dev + sizeof(dev);
}

static int h_copy(void *ctx, void *dst, const void *src, size_t n, uint64_t *ticket_p)
{
    (void)ctx;
    if (refuse_copy)
        return SD_EIO;
    pending[queued % 256].dst = dst;
    pending[queued % 256].src = src;
    pending[queued % 256].n = n;
    *ticket_p = ++queued;
    return SD_OK;
}

static int h_done(void *ctx, uint64_t ticket)
{
    (void)ctx;
    if (ticket > ran)
        return SD_EAGAIN;
    return fail_device ? SD_EIO : SD_OK;
}

/* the device runs what was queued */
static void dev_run(void)
{
    for (; ran < queued; ran++)
        memcpy(pending[ran % 256].dst, pending[ran % 256].src, pending[ran % 256].n);
}

static int h_pinned_alloc(void *ctx, size_t bytes, void **p_p)
{
    (void)ctx;
    pinned_allocs++;
    *p_p = malloc(bytes);
    return *p_p != NULL ? SD_OK : SD_ENOMEM;
}

static void h_pinned_free(void *ctx, void *p)
{
    (void)ctx;
    pinned_frees++;
    free(p);
}

static void h_release(void *ctx)
{
    (void)ctx;
    released++;
}

static const struct sd_stage_hooks hooks = {.is_device = h_is_device,
                                            .copy = h_copy,
                                            .done = h_done,
                                            .pinned_alloc = h_pinned_alloc,
                                            .pinned_free = h_pinned_free,
                                            .release = h_release};

/* ---- transfers and their callbacks */

struct xf {
    struct sd_xfer x;
    int calls, status;
};

static void xf_cb(struct sd_xfer *x, int status)
{
    struct xf *f = (struct xf *)x;
    f->calls++;
    f->status = status;
}

static struct xf xf_new(void)
{
    struct xf f;
    memset(&f, 0, sizeof(f));
    f.x.cb = xf_cb;
    f.status = 1;
    return f;
}

static struct loop lp;

static struct sd_transport *open_loop(uint64_t cap)
{
    memset(&lp, 0, sizeof(lp));
    lp.base.ops = &loop_ops;
    lp.base.n_peers = 2;
    TH_CHECK(sd_transport_stage(&lp.base, &hooks, cap) == SD_OK, "stage");
    return &lp.base;
}

static void progress(struct sd_transport *tp, int rounds)
{
    for (int i = 0; i < rounds; i++)
        tp->ops->progress(tp);
}

static void t_device_to_device(void)
{
    struct sd_transport *tp = open_loop(1 << 20);
    uint8_t *src = dev, *dst = dev + (1 << 20);
    for (int i = 0; i < 100000; i++)
        src[i] = (uint8_t)(i * 13 + 1);
    memset(dst, 0, 100000);
    struct xf s = xf_new(), r = xf_new();
    TH_CHECK(tp->ops->recv(tp, 1, 7, 0, dst, 100000, NULL, &r.x) == SD_OK, "recv");
    TH_CHECK(tp->ops->send(tp, 1, 7, src, 100000, NULL, &s.x) == SD_OK, "send");
    progress(tp, 3);
    TH_CHECK(lp.wire == 0 && s.calls == 0, "a send went on the wire before its copy out ran");
    TH_CHECK(tp->ops->can_sleep(tp) == false, "the loop may sleep while a device copy runs");
    dev_run();
    progress(tp, 1);
    TH_CHECK(lp.wire == 1 && s.calls == 1 && s.status == SD_OK, "the send, once copied out");
    TH_CHECK(r.calls == 0, "a receive completed before its copy in ran");
    dev_run();
    progress(tp, 1);
    TH_CHECK(r.calls == 1 && r.status == SD_OK && r.x.len == 100000, "the receive");
    TH_CHECK(memcmp(src, dst, 100000) == 0, "the bytes that arrived differ");
    TH_CHECK(tp->staged_bytes == 200000, "staged %llu bytes, expected 200000 (both ways)",
             (unsigned long long)tp->staged_bytes);
    TH_CHECK(tp->inflight == 0 && tp->ops->can_sleep(tp), "nothing held afterwards");
    TH_CHECK(r.x.cb == xf_cb && s.x.cb == xf_cb, "the callers' callbacks are theirs again");

    /* host memory is the transport's alone */
    uint8_t hs[64] = {1, 2, 3}, hd[64] = {0};
    struct xf hs_x = xf_new(), hd_x = xf_new();
    uint64_t before = tp->staged_bytes;
    tp->ops->recv(tp, 1, 8, 0, hd, sizeof(hd), NULL, &hd_x.x);
    tp->ops->send(tp, 1, 8, hs, sizeof(hs), NULL, &hs_x.x);
    progress(tp, 1);
    TH_CHECK(hs_x.calls == 1 && hd_x.calls == 1 && hd[2] == 3 && tp->staged_bytes == before,
             "host memory went through the stage");
    int allocs = pinned_allocs;
    tp->ops->close(tp);
    TH_CHECK(closed == 1 && released == 1 && pinned_frees == allocs,
             "close: %d buffers made, %d freed, release %d", allocs, pinned_frees, released);
}

static void t_cap_and_order(void)
{
    closed = released = pinned_allocs = pinned_frees = 0;
    struct sd_transport *tp = open_loop(64 << 10); /* one 64 KiB buffer for sends */
    struct xf s[3] = {xf_new(), xf_new(), xf_new()}, r[3] = {xf_new(), xf_new(), xf_new()};
    for (int i = 0; i < 3; i++) {
        dev[i * 4096] = (uint8_t)(100 + i);
        TH_CHECK(tp->ops->recv(tp, 1, 20 + (uint64_t)i, 0, dev + (1 << 21) + i * 4096, 4096, NULL,
                               &r[i].x) == SD_OK,
                 "recv %d", i);
    }
    for (int i = 0; i < 3; i++)
        TH_CHECK(tp->ops->send(tp, 1, 20 + (uint64_t)i, dev + i * 4096, 4096, NULL, &s[i].x) ==
                     SD_OK,
                 "send %d", i);
    TH_CHECK(queued - ran == 1 && tp->staging_buffer_bytes == 4 * (64 << 10),
             "the first send copies out, the others wait; the receives have buffers (%llu copies "
             "queued, %llu bytes of buffers)",
             (unsigned long long)(queued - ran), (unsigned long long)tp->staging_buffer_bytes);
    /* a receive posted while sends wait is not queued behind them */
    struct xf r4 = xf_new();
    TH_CHECK(tp->ops->recv(tp, 1, 29, 0, dev + (3 << 20), 4096, NULL, &r4.x) == SD_OK && lp.nr == 4,
             "a receive waited behind sends waiting for the cap (%d posted)", lp.nr);
    for (int round = 0; round < 10; round++) {
        dev_run();
        progress(tp, 1);
    }
    tp->ops->cancel(tp, &r4.x);
    TH_CHECK(r4.calls == 1 && r4.status == SD_ECANCELED, "the extra receive, cancelled");
    bool ok = true;
    for (int i = 0; i < 3; i++)
        ok &= s[i].calls == 1 && r[i].calls == 1 && r[i].status == SD_OK &&
              dev[(1 << 21) + i * 4096] == 100 + i && lp.wire_tags[i] == 20 + (uint64_t)i;
    TH_CHECK(ok, "sends beyond the cap waited and went in order, each once, each intact");
    TH_CHECK(tp->staging_buffer_bytes == 5 * (64 << 10),
             "one buffer for the sends (the cap), one per receive: %llu bytes",
             (unsigned long long)tp->staging_buffer_bytes);
    tp->ops->close(tp);
}

static void t_cancel(void)
{
    struct sd_transport *tp = open_loop(64 << 10);
    struct xf a = xf_new(), b = xf_new(), r = xf_new(), c = xf_new();
    tp->ops->send(tp, 1, 30, dev, 4096, NULL, &a.x);        /* its copy runs */
    tp->ops->send(tp, 1, 31, dev + 8192, 4096, NULL, &b.x); /* waits for a buffer */
    tp->ops->recv(tp, 1, 32, 0, dev + 16384, 4096, NULL, &r.x);
    progress(tp, 1);
    tp->ops->cancel(tp, &b.x);
    TH_CHECK(b.calls == 1 && b.status == SD_ECANCELED, "a waiting send cancelled (%d, %d)", b.calls,
             b.status);
    tp->ops->cancel(tp, &a.x);
    TH_CHECK(a.calls == 0, "a send whose copy runs completes when the copy is done, not before");
    dev_run();
    progress(tp, 2);
    TH_CHECK(a.calls == 1 && a.status == SD_ECANCELED && lp.wire == 0,
             "the cancelled send completed cancelled and never reached the wire");
    tp->ops->cancel(tp, &r.x);
    TH_CHECK(r.calls == 1 && r.status == SD_ECANCELED, "a posted receive cancelled");
    /* the device refuses a copy: the send fails at once; fails on the device: at completion */
    refuse_copy = 1;
    TH_CHECK(tp->ops->send(tp, 1, 33, dev, 4096, NULL, &c.x) == SD_EIO && c.calls == 0,
             "a copy the device refused fails the send at the call");
    refuse_copy = 0;
    struct xf d = xf_new();
    tp->ops->send(tp, 1, 34, dev, 4096, NULL, &d.x);
    fail_device = 1;
    dev_run();
    progress(tp, 1);
    fail_device = 0;
    TH_CHECK(d.calls == 1 && d.status == SD_EIO && lp.wire == 0,
             "a copy that failed on the device fails its send (%d, %d)", d.calls, d.status);
    TH_CHECK(tp->inflight == 0, "nothing held after cancels and failures (%llu)",
             (unsigned long long)tp->inflight);
    tp->ops->close(tp);
}

static void t_reserve(void)
{
    pinned_allocs = pinned_frees = 0;
    struct sd_transport *tp = open_loop(1 << 20);
    TH_CHECK(sd_transport_stage_reserve(tp, 256 << 10, 4) == SD_OK && pinned_allocs == 4 &&
                 tp->staging_buffer_bytes == 4 * (256 << 10),
             "a reservation of 4 buffers of 256 KiB made %d", pinned_allocs);
    TH_CHECK(sd_transport_stage_reserve(tp, 256 << 10, 3) == SD_OK && pinned_allocs == 4,
             "a smaller reservation makes none");
    struct xf s[2] = {xf_new(), xf_new()}, r[2] = {xf_new(), xf_new()};
    for (int i = 0; i < 2; i++) { /* a chunk and a short tail: both take reserved buffers */
        size_t n = i ? 1000 : 256 << 10;
        tp->ops->recv(tp, 1, 40 + (uint64_t)i, 0, dev + (2 << 20), n, NULL, &r[i].x);
        tp->ops->send(tp, 1, 40 + (uint64_t)i, dev, n, NULL, &s[i].x);
    }
    for (int round = 0; round < 6; round++) {
        dev_run();
        progress(tp, 1);
    }
    TH_CHECK(r[0].calls == 1 && r[1].calls == 1 && s[0].calls == 1 && s[1].calls == 1 &&
                 pinned_allocs == 4,
             "transfers within the reservation made %d buffers (expected none new)",
             pinned_allocs - 4);
    struct xf big = xf_new();
    tp->ops->recv(tp, 1, 50, 0, dev, 1 << 20, NULL, &big.x);
    TH_CHECK(pinned_allocs == 5, "a receive larger than the reserved buffers gets one made");
    tp->ops->cancel(tp, &big.x);
    int allocs = pinned_allocs;
    tp->ops->close(tp);
    TH_CHECK(pinned_frees == allocs, "close freed %d of %d buffers", pinned_frees, allocs);
}

int main(void)
{
    t_device_to_device();
    t_cap_and_order();
    t_cancel();
    t_reserve();
    return th_summary("test_stage");
}

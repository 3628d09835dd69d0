/* The collective engine on an in-process fake transport (tag matching with wildcards, per-node
 * completion queues, unexpected messages): ring (pipelined by chunk: steps overlap; 4 KiB and
 * 64-byte chunks) and direct all-reduce for 2..5 members and sizes that do not divide evenly,
 * against the exact sums, identical on every member, with the bytes each member sends equal to the
 * formulas; the reduce-scatter (scatter) bitwise the all-reduce on its segment with half the
 * bytes; the quantized (int4, two encodings) all-reduce against the exact sums within its
 * error bound, identical on every member, with the encoded byte formulas and error feedback;
 * chunked multi-piece bulk transfers. */
#include "coll/coll.h"
#include "sd/codec.h"
#include "sd/dtype.h"
#include "sd/model.h"
#include "harness.h"
#include "sd/status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAXN 16

struct msg {
    struct msg *next;
    uint32_t src, dst;
    uint64_t tag;
    void *data;
    size_t len;
};

struct fake {
    struct sd_transport base;
    struct sd_xfer *posted;    /* receives waiting for a message */
    struct sd_xfer *done_head; /* completions to report on progress */
    struct msg *unexpected;
};

static struct fake nodes[MAXN];

static bool matches(const struct sd_xfer *r, uint32_t src, uint64_t tag)
{
    return (r->peer == SD_PEER_ANY || r->peer == src) && ((r->tag ^ tag) & ~r->ignore) == 0;
}

static void complete_later(struct fake *f, struct sd_xfer *x)
{
    x->next_pending = NULL;
    struct sd_xfer **pp = &f->done_head;
    while (*pp)
        pp = &(*pp)->next_pending;
    *pp = x;
}

static void deliver(struct fake *dst, struct sd_xfer *r, const void *data, size_t len, uint64_t tag)
{
    memcpy((void *)r->buf, data, len < r->buflen ? len : r->buflen);
    r->len = len;
    r->tag = tag;
    complete_later(dst, r);
}

static int f_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf, size_t len,
                  void *desc, struct sd_xfer *x)
{
    (void)desc;
    struct fake *src = (struct fake *)tp, *dst = &nodes[peer];
    tp->inflight++;
    x->kind = 1;
    for (struct sd_xfer **pp = &dst->posted; *pp; pp = &(*pp)->next_pending)
        if (matches(*pp, src->base.self, tag)) {
            struct sd_xfer *r = *pp;
            *pp = r->next_pending;
            deliver(dst, r, buf, len, tag);
            complete_later(src, x);
            return SD_OK;
        }
    struct msg *m = calloc(1, sizeof(*m));
    m->src = src->base.self;
    m->tag = tag;
    m->len = len;
    m->data = malloc(len ? len : 1);
    memcpy(m->data, buf, len);
    struct msg **mp = &dst->unexpected; /* keep arrival order */
    while (*mp)
        mp = &(*mp)->next;
    *mp = m;
    complete_later(src, x); /* eager: the send buffer is free again */
    return SD_OK;
}

static int f_recv(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore, void *buf,
                  size_t len, void *desc, struct sd_xfer *x)
{
    (void)desc;
    struct fake *f = (struct fake *)tp;
    tp->inflight++;
    x->kind = 2;
    x->peer = peer;
    x->tag = tag;
    x->ignore = ignore;
    x->buf = buf;
    x->buflen = len;
    for (struct msg **mp = &f->unexpected; *mp; mp = &(*mp)->next)
        if (matches(x, (*mp)->src, (*mp)->tag)) {
            struct msg *m = *mp;
            *mp = m->next;
            deliver(f, x, m->data, m->len, m->tag);
            free(m->data);
            free(m);
            return SD_OK;
        }
    x->next_pending = f->posted;
    f->posted = x;
    return SD_OK;
}

static int f_progress(struct sd_transport *tp)
{
    struct fake *f = (struct fake *)tp;
    int n = 0;
    while (f->done_head) {
        struct sd_xfer *x = f->done_head;
        f->done_head = x->next_pending;
        tp->inflight--;
        x->cb(x, SD_OK);
        n++;
    }
    return n;
}

static const struct sd_transport_ops fake_ops = {
    .name = "fake", .send = f_send, .recv = f_recv, .progress = f_progress};

struct done {
    int finished, status;
};

static void ar_cb(struct sd_allreduce *ar, int status, uint32_t suspect)
{
    struct done *d = ar->p.arg;
    (void)suspect;
    d->finished = 1;
    d->status = status;
}

/* the backend the all-reduces sum with: host, and host-deferred, whose sums happen only when the
 * queue is synced or its tickets polled (a send of a sum the engine did not wait for carries the
 * old values); its sync counted, which the engine must never call (it would hold the daemon's
 * loop on a device) */
static const struct sd_gpu_ops *dev_under_test = &sd_gpu_host_ops;
static struct sd_gpu_ops counted_ops;
static int (*real_sync)(struct sd_gpu_queue *q);
static int syncs;

static int counting_sync(struct sd_gpu_queue *q)
{
    syncs++;
    return real_sync(q);
}

static void use_backend(const struct sd_gpu_ops *ops)
{
    counted_ops = *ops;
    real_sync = ops->sync;
    counted_ops.sync = counting_sync;
    dev_under_test = &counted_ops;
}

/* n fake nodes 0..n-1 with a queue and a pool of `bulks` bulks each; members[i] = i */
static void nodes_init(uint32_t n, struct sd_bulk_pool *pools, uint32_t bulks,
                       struct sd_gpu_queue **queues, uint32_t *members)
{
    for (uint32_t i = 0; i < n; i++) {
        members[i] = i;
        TH_CHECK(dev_under_test->queue_create(&queues[i]) == SD_OK, "queue");
        memset(&nodes[i], 0, sizeof(nodes[i]));
        nodes[i].base.ops = &fake_ops;
        nodes[i].base.self = i;
        nodes[i].base.n_peers = n;
        sd_bulk_pool_init(&pools[i], bulks);
    }
}

/* node i's group of all n nodes (nodes_init's pools and members) */
static struct sd_coll_group node_group(uint32_t i, uint32_t n, struct sd_bulk_pool *pools,
                                       const uint32_t *members)
{
    return (struct sd_coll_group){
        .tp = &nodes[i].base, .pool = &pools[i], .members = members, .n_members = n, .self = i};
}

/* progress every node, and poll its all-reduce's device waits as the daemon's loop does, until
 * all n finished or nothing moves (an all-reduce waiting for its queue is still moving) */
static void drive(uint32_t n, const struct done *done, struct sd_allreduce *ars)
{
    for (int round = 0; round < 100000; round++) {
        int all = 1, moved = 0;
        for (uint32_t i = 0; i < n; i++) {
            moved += f_progress(&nodes[i].base);
            moved += sd_allreduce_waiting(&ars[i]);
            moved += sd_allreduce_poll(&ars[i]);
            all &= done[i].finished;
        }
        if (all || !moved)
            break;
    }
}

/* one all-reduce (or reduce-scatter) of n members over bufs, which it changes (into accs[i]
 * where accs is not NULL); every member must finish, and give its bulks back */
static void run_exact(uint32_t n, size_t count, size_t small_bytes, size_t chunk, bool scatter,
                      float **bufs, float **accs, struct sd_allreduce *ars)
{
    static struct sd_bulk_pool pools[MAXN];
    struct sd_gpu_queue *queues[MAXN] = {0};
    float *tmps[MAXN];
    struct done done[MAXN] = {0};
    uint32_t members[MAXN];
    size_t tmpn = sd_allreduce_tmp_floats(count, n, small_bytes);
    nodes_init(n, pools, 4 * n, queues, members);
    int started = 0;
    for (uint32_t i = 0; i < n; i++) {
        tmps[i] = malloc((tmpn + 1) * sizeof(float));
        started += sd_allreduce_start(&ars[i], &(struct sd_allreduce_param){
                                                   .group = node_group(i, n, pools, members),
                                                   .dev = dev_under_test,
                                                   .queue = queues[i],
                                                   .dtype = SD_DTYPE_FP32,
                                                   .buf = bufs[i],
                                                   .count = count,
                                                   .tmp = tmps[i],
                                                   .tmp_count = tmpn,
                                                   .acc = accs ? accs[i] : NULL,
                                                   .scatter = scatter,
                                                   .tag_base = 0x1000,
                                                   .chunk_bytes = chunk,
                                                   .small_bytes = small_bytes,
                                                   .cb = ar_cb,
                                                   .arg = &done[i]}) == SD_OK;
    }
    TH_CHECK(started == (int)n, "n %u count %zu: %d of %u started", n, count, started, n);
    drive(n, done, ars);
    for (uint32_t i = 0; i < n; i++) {
        TH_CHECK(done[i].finished && done[i].status == SD_OK, "n %u count %zu member %u: %s", n,
                 count, i, done[i].finished ? "failed" : "unfinished");
        TH_CHECK(pools[i].in_use == 0, "bulks not returned");
        free(tmps[i]);
        sd_bulk_pool_fini(&pools[i]);
        dev_under_test->queue_destroy(queues[i]);
    }
}

/* the all-reduce on small integers (every order of sums exact): the exact sums on every member,
 * the bytes the formulas'. acc: add the sum into accumulators that start equal on every member
 * (and at a value the sum is exact with), instead of leaving it in the buffers */
static void run_allreduce(uint32_t n, size_t count, size_t small_bytes, size_t chunk, bool acc)
{
    static struct sd_allreduce ars[MAXN];
    float *bufs[MAXN], *accs[MAXN] = {0};
    for (uint32_t i = 0; i < n; i++) {
        bufs[i] = malloc(count * sizeof(float));
        for (size_t e = 0; e < count; e++) /* small integers: every sum order is exact */
            bufs[i][e] = (float)((e * 7 + i * 13) % 64);
        if (acc) {
            accs[i] = malloc(count * sizeof(float));
            for (size_t e = 0; e < count; e++)
                accs[i][e] = (float)(e % 5) - 2.0f;
        }
    }
    run_exact(n, count, small_bytes, chunk, false, bufs, acc ? accs : NULL, ars);
    int wrong = 0;
    for (uint32_t i = 0; i < n; i++)
        for (size_t e = 0; e < count; e++) {
            float want = 0;
            for (uint32_t j = 0; j < n; j++)
                want += (float)((e * 7 + j * 13) % 64);
            if (acc)
                wrong += accs[i][e] != (float)(e % 5) - 2.0f + want;
            else
                wrong += bufs[i][e] != want;
        }
    bool direct = count * sizeof(float) <= small_bytes;
    TH_CHECK(wrong == 0, "%s n %u count %zu %s%s: %d wrong elements", dev_under_test->name, n,
             count, direct ? "direct" : "ring", acc ? " into acc" : "", wrong);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t want_sent, want_recv;
        if (direct) {
            want_sent = want_recv = (uint64_t)(n - 1) * count * sizeof(float);
        } else {
            /* reduce-scatter: sends every segment but (pos+1), receives all but its own (pos);
             * all-gather: sends all but (pos+2), receives all but (pos+1) */
            size_t b[3], e[3];
            for (uint32_t d = 0; d < 3; d++)
                sd_ring_segment(count, n, (i + d) % n, &b[d], &e[d]);
            want_sent = (uint64_t)(2 * count - (e[1] - b[1]) - (e[2] - b[2])) * sizeof(float);
            want_recv = (uint64_t)(2 * count - (e[0] - b[0]) - (e[1] - b[1])) * sizeof(float);
        }
        TH_CHECK(ars[i].bytes_sent == want_sent && ars[i].bytes_recv == want_recv,
                 "n %u count %zu member %u: sent %llu received %llu, formula %llu / %llu", n, count,
                 i, (unsigned long long)ars[i].bytes_sent, (unsigned long long)ars[i].bytes_recv,
                 (unsigned long long)want_sent, (unsigned long long)want_recv);
        free(bufs[i]);
        free(accs[i]);
    }
}

/* The reduce-scatter (coll.h's scatter) on values whose sums round: member i's segment
 * (sd_scatter_segment, written here as the ring's (i + 1) mod n) bitwise the all-reduce's on the
 * same inputs, within one rounding per addition of the exact (double) sum, and the bytes half
 * the all-reduce's: the ring sends every segment but (i + 1)'s and receives every one but i's;
 * the direct one sends each other member its segment and receives its own from each. */
static void run_scatter(uint32_t n, size_t count, size_t small_bytes, size_t chunk)
{
    static struct sd_allreduce ars[MAXN], rss[MAXN];
    float *in[MAXN], *ar[MAXN], *rs[MAXN];
    uint64_t seed = 0x9e3779b97f4a7c15ull ^ (count * 31 + n);
    for (uint32_t i = 0; i < n; i++) {
        in[i] = malloc(count * sizeof(float) + 1);
        ar[i] = malloc(count * sizeof(float) + 1);
        rs[i] = malloc(count * sizeof(float) + 1);
        for (size_t e = 0; e < count; e++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            in[i][e] = (float)((double)(seed >> 11) / 9007199254740992.0 - 0.5) * 3.0f;
        }
        memcpy(ar[i], in[i], count * sizeof(float));
        memcpy(rs[i], in[i], count * sizeof(float));
    }
    run_exact(n, count, small_bytes, chunk, false, ar, NULL, ars);
    run_exact(n, count, small_bytes, chunk, true, rs, NULL, rss);
    bool direct = count * sizeof(float) <= small_bytes;
    for (uint32_t i = 0; i < n; i++) {
        size_t b = count * ((i + 1) % n) / n, e = count * ((i + 1) % n + 1) / n, len = e - b;
        size_t sb, se;
        sd_scatter_segment(count, n, i, &sb, &se);
        TH_CHECK(sb == b && se == e,
                 "n %u count %zu member %u: segment [%zu, %zu), want [%zu, %zu)", n, count, i, sb,
                 se, b, e);
        int differ = 0, far = 0;
        for (size_t x = b; x < e; x++) {
            double exact = 0, mag = 0;
            for (uint32_t j = 0; j < n; j++) {
                exact += in[j][x];
                mag += fabs(in[j][x]);
            }
            differ += memcmp(&rs[i][x], &ar[i][x], sizeof(float)) != 0;
            far += fabs(rs[i][x] - exact) > (double)n * mag * 6e-8;
        }
        uint64_t want_sent = (count - len) * sizeof(float); /* both: all but its own segment */
        size_t ob = count * i / n, oe = count * (i + 1) / n;
        uint64_t want_recv = (direct ? (uint64_t)(n - 1) * len : count - (oe - ob)) * sizeof(float);
        TH_CHECK(differ == 0 && far == 0,
                 "%s n %u count %zu %s scatter: member %u's segment: %d elements differ from the "
                 "all-reduce's, %d beyond the rounding bound",
                 dev_under_test->name, n, count, direct ? "direct" : "ring", i, differ, far);
        TH_CHECK(rss[i].bytes_sent == want_sent && rss[i].bytes_recv == want_recv &&
                     2 * rss[i].bytes_sent <= ars[i].bytes_sent + 8 * n,
                 "n %u count %zu member %u scatter: sent %llu received %llu, formula %llu / %llu "
                 "(the all-reduce sent %llu)",
                 n, count, i, (unsigned long long)rss[i].bytes_sent,
                 (unsigned long long)rss[i].bytes_recv, (unsigned long long)want_sent,
                 (unsigned long long)want_recv, (unsigned long long)ars[i].bytes_sent);
    }
    for (uint32_t i = 0; i < n; i++) {
        free(in[i]);
        free(ar[i]);
        free(rs[i]);
    }
}

/* the quantized all-reduce (coll.h): segment s of member s is whole blocks of B, written here
 * from the definition: blocks [nb s / n, nb (s + 1) / n) */
static void qseg_ref(size_t count, uint32_t n, uint32_t B, uint32_t s, size_t *b, size_t *e)
{
    size_t nb = (count + B - 1) / B;
    *b = nb * s / n * B < count ? nb * s / n * B : count;
    *e = nb * (s + 1) / n * B < count ? nb * (s + 1) / n * B : count;
}

static size_t enc4(size_t m, uint32_t B)
{
    return 4 * ((m + B - 1) / B) + (m + 1) / 2;
}

static float qinput(size_t e, uint32_t i, uint32_t round)
{
    return (float)((e * 2654435761u + i * 40503u + round * 977u) % 2001) / 1000.0f - 1.0f;
}

/* Every member ends with the same values, each within the two encodings' error of the exact
 * sum: per block, sum over the other members of (their block's largest magnitude) / 14 for the
 * first encoding, plus (the sum's largest magnitude) / 14 for the second; the bytes are
 * the encoded formulas; with error feedback the residual is what the encoding lost. */
static void run_qallreduce(uint32_t n, size_t count, uint32_t B, bool ef)
{
    static struct sd_bulk_pool pools[MAXN];
    static struct sd_allreduce ars[MAXN];
    struct sd_gpu_queue *queues[MAXN] = {0};
    float *bufs[MAXN], *in[MAXN], *errs[MAXN] = {0}, *err0[MAXN] = {0};
    uint8_t *qbufs[MAXN];
    struct done done[MAXN] = {0};
    uint32_t members[MAXN];
    size_t qb = sd_allreduce_qbuf_bytes(count, n, 4, B);
    nodes_init(n, pools, 2 * n, queues, members);
    for (uint32_t i = 0; i < n; i++) {
        bufs[i] = malloc(count * sizeof(float));
        in[i] = malloc(count * sizeof(float));
        qbufs[i] = malloc(qb);
        for (size_t e = 0; e < count; e++)
            in[i][e] = bufs[i][e] = qinput(e, i, 0) * (float)(1 + e / B % 3);
        if (ef) {
            errs[i] = malloc(count * sizeof(float));
            err0[i] = malloc(count * sizeof(float));
            for (size_t e = 0; e < count; e++) /* a residual left by an earlier step */
                err0[i][e] = errs[i][e] = qinput(e, i, 1) * 0.01f;
        }
    }
    int started = 0;
    for (uint32_t i = 0; i < n; i++)
        started += sd_allreduce_start(&ars[i], &(struct sd_allreduce_param){
                                                   .group = node_group(i, n, pools, members),
                                                   .dev = dev_under_test,
                                                   .queue = queues[i],
                                                   .dtype = SD_DTYPE_FP32,
                                                   .qbits = 4,
                                                   .qblock = B,
                                                   .qbuf = qbufs[i],
                                                   .qerr = errs[i],
                                                   .buf = bufs[i],
                                                   .count = count,
                                                   .tag_base = 0x1000,
                                                   .chunk_bytes = 4096,
                                                   .cb = ar_cb,
                                                   .arg = &done[i]}) == SD_OK;
    TH_CHECK(started == (int)n, "quantized n %u count %zu: %d of %u started", n, count, started, n);
    drive(n, done, ars);
    int unfinished = 0, differ = 0, outside = 0;
    double worst = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        unfinished += !done[i].finished || done[i].status != SD_OK;
        differ += memcmp(bufs[i], bufs[0], count * sizeof(float)) != 0;
    }
    for (uint32_t s = 0; s < n; s++) {
        size_t b, e;
        qseg_ref(count, n, B, s, &b, &e);
        for (size_t k0 = b; k0 < e; k0 += B) {
            size_t k1 = k0 + B < e ? k0 + B : e;
            double first = 0.0, most = 0.0;
            for (uint32_t m = 0; m < n; m++) {
                double am = 0.0;
                for (size_t k = k0; k < k1; k++) {
                    double y = (double)in[m][k] + (ef ? (double)err0[m][k] : 0.0);
                    am = fabs(y) > am ? fabs(y) : am;
                }
                first += m == s ? 0.0 : am / 14.0;
            }
            for (size_t k = k0; k < k1; k++) {
                double exact = 0.0;
                for (uint32_t m = 0; m < n; m++)
                    exact += in[m][k] + (ef && m != s ? err0[m][k] : 0.0f);
                most = fabs(exact) + first > most ? fabs(exact) + first : most;
            }
            double bound = first + most / 14.0 + 1e-5;
            for (size_t k = k0; k < k1; k++) {
                double exact = 0.0;
                for (uint32_t m = 0; m < n; m++)
                    exact += in[m][k] + (ef && m != s ? err0[m][k] : 0.0f);
                double d = fabs((double)bufs[0][k] - exact);
                worst = d / bound > worst ? d / bound : worst;
                outside += d > bound;
            }
        }
    }
    TH_CHECK(unfinished == 0 && differ == 0 && outside == 0,
             "%s quantized n %u count %zu B %u%s: %d unfinished, %d members differ from member 0, "
             "%d elements outside the bound (worst at %.2f of it)",
             dev_under_test->name, n, count, B, ef ? " ef" : "", unfinished, differ, outside,
             worst);
    for (uint32_t i = 0; i < n; i++) {
        size_t b, e, mine, want = 0;
        qseg_ref(count, n, B, i, &b, &e);
        mine = e - b;
        for (uint32_t s = 0; s < n; s++) {
            if (s == i)
                continue;
            size_t bs, es;
            qseg_ref(count, n, B, s, &bs, &es);
            want += enc4(es - bs, B) + enc4(mine, B);
        }
        TH_CHECK(ars[i].bytes_sent == want && ars[i].bytes_recv == want &&
                     ars[i].qraw == 2 * 4 * (uint64_t)(count - mine + (n - 1) * mine),
                 "quantized n %u count %zu member %u: sent %llu received %llu (raw %llu), formula "
                 "%zu",
                 n, count, i, (unsigned long long)ars[i].bytes_sent,
                 (unsigned long long)ars[i].bytes_recv, (unsigned long long)ars[i].qraw, want);
        TH_CHECK(pools[i].in_use == 0, "bulks not returned");
        if (ef) { /* segments sent: the residual is what the encoding in its send slot lost */
            float *dq = malloc(count * sizeof(float));
            int bad = 0;
            for (uint32_t s = 0; s < n; s++) {
                if (s == i)
                    continue;
                size_t bs, es;
                qseg_ref(count, n, B, s, &bs, &es);
                size_t stride = qb / (2 * n);
                dev_under_test->dequantize(queues[i], dq + bs, SD_DTYPE_FP32, qbufs[i] + s * stride,
                                           4, es - bs, B, false);
                real_sync(queues[i]); /* the test's own wait: not the engine's */
                for (size_t k = bs; k < es; k++) {
                    float y = in[i][k] + err0[i][k];
                    bad += fabsf(dq[k] + errs[i][k] - y) > 1e-6f * (1.0f + fabsf(y));
                }
            }
            for (size_t k = b; k < e; k++) /* its own segment is never encoded by it */
                bad += errs[i][k] != err0[i][k];
            TH_CHECK(bad == 0, "quantized n %u member %u: %d residuals are not the encoding's loss",
                     n, i, bad);
            free(dq);
        }
        free(bufs[i]);
        free(in[i]);
        free(qbufs[i]);
        free(errs[i]);
        free(err0[i]);
        sd_bulk_pool_fini(&pools[i]);
        dev_under_test->queue_destroy(queues[i]);
    }
}

static int chunks_seen;
static void bulk_done(struct sd_bulk *b, int status)
{
    int *flag = b->arg;
    *flag = status == SD_OK ? 1 : -1;
}
static void bulk_chunk(struct sd_bulk *b, uint32_t piece, size_t off, size_t len)
{
    (void)b, (void)piece, (void)off, (void)len;
    chunks_seen++;
}

/* Given up by its owner (its job failed) while it waits for its queue, nothing in flight: cb at
 * once with the owner's status, every bulk back, nothing waiting; given up once more, or after
 * it finished: nothing (cb once). The other member, given up after its queue let it begin: it
 * waits for its transfers in flight (their completions finish it), posting nothing. */
static void run_abort(void)
{
    enum { N = 2, COUNT = 1000 };
    static struct sd_bulk_pool pools[N];
    static struct sd_allreduce ars[N];
    struct sd_gpu_queue *queues[N] = {0};
    static float bufs[N][COUNT], tmps[N][COUNT];
    struct done done[N] = {0};
    uint32_t members[N];
    use_backend(&sd_gpu_host_deferred_ops);
    nodes_init(N, pools, 4, queues, members);
    for (uint32_t i = 0; i < N; i++)
        TH_CHECK(
            sd_allreduce_start(
                &ars[i], &(struct sd_allreduce_param){.group = node_group(i, N, pools, members),
                                                      .dev = dev_under_test,
                                                      .queue = queues[i],
                                                      .dtype = SD_DTYPE_FP32,
                                                      .buf = bufs[i],
                                                      .count = COUNT,
                                                      .tmp = tmps[i],
                                                      .tmp_count = COUNT,
                                                      .tag_base = 0x2000,
                                                      .chunk_bytes = 256,
                                                      .cb = ar_cb,
                                                      .arg = &done[i]}) == SD_OK,
            "member %u started", i);
    TH_CHECK(sd_allreduce_waiting(&ars[0]) && sd_allreduce_waiting(&ars[1]) && pools[0].in_use == 0,
             "host-deferred: both wait for their queue before anything leaves");
    sd_allreduce_abort(&ars[0], SD_EJOBFAILED);
    TH_CHECK(done[0].finished == 1 && done[0].status == SD_EJOBFAILED && pools[0].in_use == 0 &&
                 !sd_allreduce_waiting(&ars[0]),
             "given up while waiting: finished at once (finished %d, status %d, %u bulks held)",
             done[0].finished, done[0].status, pools[0].in_use);
    done[0].finished = 0;
    sd_allreduce_abort(&ars[0], SD_EJOBFAILED);
    TH_CHECK(done[0].finished == 0 && !sd_allreduce_poll(&ars[0]),
             "given up again: nothing happens");
    for (int i = 0; i < 4 && sd_allreduce_waiting(&ars[1]); i++)
        sd_allreduce_poll(&ars[1]);
    TH_CHECK(!sd_allreduce_waiting(&ars[1]) && ars[1].pending > 0 && !done[1].finished,
             "member 1 began: its transfers in flight (%u)", ars[1].pending);
    uint32_t posted = ars[1].pending;
    sd_allreduce_abort(&ars[1], SD_EJOBFAILED);
    TH_CHECK(!done[1].finished && ars[1].pending == posted,
             "given up with transfers in flight: it waits for them, posting nothing");
    for (uint32_t i = 0; i < N; i++) {
        dev_under_test->queue_destroy(queues[i]);
        while (nodes[i].unexpected != NULL) { /* member 1's sends, which member 0 never takes */
            struct msg *m = nodes[i].unexpected;
            nodes[i].unexpected = m->next;
            free(m->data);
            free(m);
        }
    }
}

static void run_bulk(void)
{
    for (uint32_t i = 0; i < 2; i++) {
        memset(&nodes[i], 0, sizeof(nodes[i]));
        nodes[i].base.ops = &fake_ops;
        nodes[i].base.self = i;
        nodes[i].base.n_peers = 2;
    }
    /* 3 pieces of 10000 bytes in 4096-byte chunks: 3 chunks each */
    static char src[3][10000], dst[30000];
    void *sp[3] = {src[0], src[1], src[2]}, *dp[3] = {dst, dst + 10000, dst + 20000};
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < 10000; i++)
            src[p][i] = (char)(p * 31 + i);
    static struct sd_bulk sb, rb;
    int s_ok = 0, r_ok = 0;
    struct sd_bulk_param rp = {.tp = &nodes[1].base,
                               .peer = 0,
                               .tag = 0x500,
                               .pieces = dp,
                               .n_pieces = 3,
                               .piece_len = 10000,
                               .chunk_bytes = 4096,
                               .cb = bulk_done,
                               .chunk_cb = bulk_chunk,
                               .arg = &r_ok};
    struct sd_bulk_param sp_ = rp;
    sp_.tp = &nodes[0].base;
    sp_.is_send = true;
    sp_.peer = 1;
    sp_.pieces = sp;
    sp_.chunk_cb = NULL;
    sp_.arg = &s_ok;
    TH_CHECK(sd_bulk_start(&rb, &rp) == SD_OK, "bulk recv");
    TH_CHECK(sd_bulk_start(&sb, &sp_) == SD_OK, "bulk send");
    f_progress(&nodes[0].base);
    f_progress(&nodes[1].base);
    TH_CHECK(s_ok == 1 && r_ok == 1 && rb.n == 9 && chunks_seen == 9, "9 chunks, both done");
    TH_CHECK(memcmp(dst, src[0], 10000) == 0 && memcmp(dst + 20000, src[2], 10000) == 0,
             "pieces land in place");
    TH_CHECK(rb.bytes == 30000 && sb.bytes == 30000, "bytes counted");
    /* pieces of different lengths (a coalesced gather): 2 + 1 chunks */
    static struct sd_bulk vs, vr;
    static char vdst[5123];
    void *vsp[2] = {src[0], src[1]}, *vdp[2] = {vdst, vdst + 5000};
    size_t lens[2] = {5000, 123};
    s_ok = r_ok = 0;
    struct sd_bulk_param vrp = {.tp = &nodes[1].base,
                                .peer = 0,
                                .tag = 0x600,
                                .pieces = vdp,
                                .lens = lens,
                                .n_pieces = 2,
                                .chunk_bytes = 4096,
                                .cb = bulk_done,
                                .arg = &r_ok};
    struct sd_bulk_param vsp_ = vrp;
    vsp_.tp = &nodes[0].base;
    vsp_.is_send = true;
    vsp_.peer = 1;
    vsp_.pieces = vsp;
    vsp_.arg = &s_ok;
    TH_CHECK(sd_bulk_start(&vr, &vrp) == SD_OK && sd_bulk_start(&vs, &vsp_) == SD_OK,
             "bulk of unequal pieces posted");
    f_progress(&nodes[0].base);
    f_progress(&nodes[1].base);
    TH_CHECK(s_ok == 1 && r_ok == 1 && vr.n == 3 && vr.bytes == 5123, "3 chunks, 5123 bytes");
    TH_CHECK(memcmp(vdst, src[0], 5000) == 0 && memcmp(vdst + 5000, src[1], 123) == 0,
             "unequal pieces land in place");
    struct sd_bulk busy = {.active = true};
    struct sd_bulk_param bp = sp_;
    bp.n_pieces = 1;
    bp.piece_len = 10;
    TH_CHECK(sd_bulk_start(&busy, &bp) == SD_EINVAL, "an active bulk is refused");
    TH_CHECK(sd_bulk_start(NULL, &bp) == SD_EBUSY, "no bulk (the pool ran out) is refused");
}

/* a value rounded to a 16-bit wire dtype and back */
static double wire_round(float x, int codec)
{
    return codec == SD_CODEC_BF16 ? sd_bf16_to_f32(sd_f32_to_bf16(x))
                                  : sd_fp16_to_f32(sd_f32_to_fp16(x));
}

/* The encoded all-reduce and reduce-scatter with a gradient wire codec (bf16, fp16; qblock 1):
 * every other member's contribution rounded once (u = 2^-8 in bf16, 2^-11 in fp16) and summed
 * in fp32 at the segment's owner, so each element within u (the other members' magnitudes) plus
 * fp32's rounding of n additions of the exact (double) sum; the all-reduce's second pass rounds
 * the sum once more (u |sum|) and leaves every member with the same values. The scatter's
 * segments are sd_scatter_segment's (what the exact one leaves) and its bytes half the
 * all-reduce's, 2 bytes an element. Beside it, written here, the ring reduce-scatter that sends
 * its running partial sum in the wire dtype at each of its n - 1 hops (as NCCL's bf16 ring
 * does): on the same data, the owner's fp32 sum is closer to the exact one (sum of errors)
 * once n is 8 or 16, and its worst element too. */
static void run_wire(uint32_t n, size_t count, int codec, bool scatter, bool versus_ring)
{
    static struct sd_bulk_pool pools[MAXN];
    static struct sd_allreduce ars[MAXN];
    struct sd_gpu_queue *queues[MAXN] = {0};
    float *bufs[MAXN], *in[MAXN];
    uint8_t *qbufs[MAXN];
    struct done done[MAXN] = {0};
    uint32_t members[MAXN];
    size_t qb = sd_allreduce_qbuf_bytes(count, n, codec, 1);
    double u = codec == SD_CODEC_BF16 ? 1.0 / 256 : 1.0 / 2048;
    nodes_init(n, pools, 2 * n, queues, members);
    uint64_t seed = 0x51ed27ull ^ (count * 131 + n * 7 + (uint64_t)codec);
    for (uint32_t i = 0; i < n; i++) {
        bufs[i] = malloc(count * sizeof(float) + 1);
        in[i] = malloc(count * sizeof(float) + 1);
        qbufs[i] = malloc(qb + 1);
        for (size_t e = 0; e < count; e++) { /* mixed signs, magnitudes over 2^-6 .. 2 */
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            double v = (double)(seed >> 11) / 9007199254740992.0 - 0.5;
            in[i][e] = bufs[i][e] = (float)(v * 4.0 * ldexp(1.0, -(int)((seed >> 5) % 7)));
        }
    }
    int started = 0;
    for (uint32_t i = 0; i < n; i++)
        started += sd_allreduce_start(&ars[i], &(struct sd_allreduce_param){
                                                   .group = node_group(i, n, pools, members),
                                                   .dev = dev_under_test,
                                                   .queue = queues[i],
                                                   .dtype = SD_DTYPE_FP32,
                                                   .qbits = codec,
                                                   .qblock = 1,
                                                   .qbuf = qbufs[i],
                                                   .buf = bufs[i],
                                                   .count = count,
                                                   .scatter = scatter,
                                                   .tag_base = 0x1000,
                                                   .chunk_bytes = 4096,
                                                   .cb = ar_cb,
                                                   .arg = &done[i]}) == SD_OK;
    TH_CHECK(started == (int)n, "wire n %u count %zu: %d of %u started", n, count, started, n);
    drive(n, done, ars);
    int unfinished = 0, differ = 0, outside = 0;
    double err_mine = 0.0, err_ring = 0.0, worst_mine = 0.0, worst_ring = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        unfinished += !done[i].finished || done[i].status != SD_OK;
        size_t b, e;
        if (scatter)
            sd_scatter_segment(count, n, i, &b, &e);
        else
            b = 0, e = count;
        for (size_t x = b; x < e; x++) {
            /* the member that summed x: the scatter's (sd_scatter_segment), the all-reduce's
             * member s of segment s */
            uint32_t owner = 0;
            for (uint32_t m = 0; m < n; m++) {
                size_t mb, me;
                if (scatter)
                    sd_scatter_segment(count, n, m, &mb, &me);
                else
                    sd_ring_segment(count, n, m, &mb, &me);
                owner = x >= mb && x < me ? m : owner;
            }
            double exact = 0.0, others = 0.0, mag = 0.0;
            for (uint32_t m = 0; m < n; m++) {
                exact += in[m][x];
                mag += fabs(in[m][x]);
                others += m == owner ? 0.0 : fabs(in[m][x]);
            }
            /* fp16's subnormals below 2^-14 round to within 2^-25 absolute */
            double sub = codec == SD_CODEC_FP16 ? (double)n * ldexp(1.0, -25) : 0.0;
            double bound = u * others + (double)n * mag * 6e-8 + sub +
                           (scatter ? 0.0 : u * (fabs(exact) + u * others) + sub / n);
            double d = fabs((double)bufs[i][x] - exact);
            outside += d > bound;
            if (!scatter) {
                differ += memcmp(&bufs[i][x], &bufs[0][x], sizeof(float)) != 0;
                continue;
            }
            err_mine += d;
            worst_mine = d > worst_mine ? d : worst_mine;
            /* the ring's order for this segment: from member owner + 1 around to the owner,
             * each hop's partial sent rounded to the wire dtype */
            float part = in[(owner + 1) % n][x];
            for (uint32_t h = 2; h <= n; h++)
                part = (float)(wire_round(part, codec) + (double)in[(owner + h) % n][x]);
            double dr = fabs((double)part - exact);
            err_ring += dr;
            worst_ring = dr > worst_ring ? dr : worst_ring;
        }
        uint64_t want_sent = 0, want_recv = 0; /* each member's segment as above */
        size_t ob, oe;
        if (scatter)
            sd_scatter_segment(count, n, i, &ob, &oe);
        else
            sd_ring_segment(count, n, i, &ob, &oe);
        for (uint32_t m = 0; m < n; m++) {
            size_t mb, me;
            if (scatter)
                sd_scatter_segment(count, n, m, &mb, &me);
            else
                sd_ring_segment(count, n, m, &mb, &me);
            if (m != i) {
                want_sent += 2 * (me - mb) + (scatter ? 0 : 2 * (oe - ob));
                want_recv += 2 * (oe - ob) + (scatter ? 0 : 2 * (me - mb));
            }
        }
        TH_CHECK(ars[i].bytes_sent == want_sent && ars[i].bytes_recv == want_recv,
                 "wire %d n %u count %zu member %u %s: sent %llu received %llu, formula %llu / "
                 "%llu",
                 codec, n, count, i, scatter ? "scatter" : "all-reduce",
                 (unsigned long long)ars[i].bytes_sent, (unsigned long long)ars[i].bytes_recv,
                 (unsigned long long)want_sent, (unsigned long long)want_recv);
        TH_CHECK(pools[i].in_use == 0, "bulks not returned");
    }
    TH_CHECK(unfinished == 0 && differ == 0 && outside == 0,
             "%s wire %d n %u count %zu %s: %d unfinished, %d elements differ from member 0's, "
             "%d outside the rounding bound",
             dev_under_test->name, codec, n, count, scatter ? "scatter" : "all-reduce", unfinished,
             differ, outside);
    if (versus_ring) {
        TH_CHECK(err_mine < err_ring && worst_mine <= worst_ring,
                 "wire %d n %u: summed in fp32 at the owner, error %.3g in all (worst %.3g) vs "
                 "the ring that rounds every hop %.3g (worst %.3g)",
                 codec, n, err_mine, worst_mine, err_ring, worst_ring);
        printf("wire %s n %2u, %zu elements: fp32 sum at the owner: error %.3e in all, worst "
               "%.3e; ring rounding every hop: %.3e, worst %.3e (%.1fx)\n",
               codec == SD_CODEC_BF16 ? "bf16" : "fp16", n, count, err_mine, worst_mine, err_ring,
               worst_ring, err_ring / err_mine);
    }
    for (uint32_t i = 0; i < n; i++) {
        free(bufs[i]);
        free(in[i]);
        free(qbufs[i]);
        sd_bulk_pool_fini(&pools[i]);
        dev_under_test->queue_destroy(queues[i]);
    }
}

int main(void)
{
    static const size_t counts[] = {1, 7, 100, 1000, 4099, 65536 + 3};
    const struct sd_gpu_ops *backends[] = {&sd_gpu_host_ops, &sd_gpu_host_deferred_ops};
    for (int be = 0; be < 2; be++) {
        use_backend(backends[be]);
        for (uint32_t n = 2; n <= 5; n++)
            for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                for (int acc = 0; acc < 2; acc++) {
                    run_allreduce(n, counts[c], 0, 4096, acc);    /* always the ring */
                    run_allreduce(n, counts[c], 0, 64, acc);      /* many chunks a step */
                    run_allreduce(n, counts[c], 1 << 20, 0, acc); /* always direct */
                }
            }
    }
    for (int be = 0; be < 2; be++) {
        use_backend(backends[be]);
        for (uint32_t n = 2; n <= 5; n++)
            for (size_t c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                run_scatter(n, counts[c], 0, 4096);
                run_scatter(n, counts[c], 0, 64);
                run_scatter(n, counts[c], 1 << 20, 0);
            }
    }
    static const size_t qcounts[] = {1, 63, 64, 65, 1000, 4099, 65536 + 3};
    for (int be = 0; be < 2; be++) {
        use_backend(backends[be]);
        for (uint32_t n = 2; n <= 5; n++)
            for (size_t c = 0; c < sizeof(qcounts) / sizeof(qcounts[0]); c++)
                for (int ef = 0; ef < 2; ef++) {
                    run_qallreduce(n, qcounts[c], 64, ef);
                    run_qallreduce(n, qcounts[c], 2048, ef);
                }
    }
    static const size_t wcounts[] = {1, 7, 100, 4099};
    for (int be = 0; be < 2; be++) {
        use_backend(backends[be]);
        for (uint32_t n = 2; n <= 5; n++)
            for (size_t c = 0; c < sizeof(wcounts) / sizeof(wcounts[0]); c++)
                for (int sc = 0; sc < 2; sc++) {
                    run_wire(n, wcounts[c], SD_CODEC_BF16, sc, false);
                    run_wire(n, wcounts[c], SD_CODEC_FP16, sc, false);
                }
    }
    use_backend(&sd_gpu_host_ops);
    run_wire(8, 65536, SD_CODEC_BF16, true, true);
    run_wire(16, 65536, SD_CODEC_BF16, true, true);
    run_wire(16, 65536, SD_CODEC_FP16, true, true);
    run_abort();
    TH_CHECK(syncs == 0, "the all-reduces waited for the device %d times", syncs);
    run_bulk();
    return th_summary("test_coll");
}

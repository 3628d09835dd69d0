/* The host backend's kernels against the optimizer formulas evaluated in double by hand, and its
 * shared memory (a sealed memfd). */
#include "harness.h"
#include "sd/dtype.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* pages of [p, p + len) present in memory before anything touched them */
static size_t resident_pages(void *p, size_t len)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = (len + pg - 1) / pg, r = 0;
    unsigned char *vec = calloc(n, 1);
    if (vec != NULL && mincore(p, len, vec) == 0)
        for (size_t i = 0; i < n; i++)
            r += vec[i] & 1;
    free(vec);
    return r;
}

int main(void)
{
    const struct sd_gpu_ops *dev = sd_gpu_find("host");
    TH_CHECK(dev != NULL && strcmp(dev->name, "host") == 0, "host backend present");
    TH_CHECK(sd_gpu_find("no-such-backend") == NULL, "an unknown backend name finds nothing");
    struct sd_gpu_queue *q = NULL;
    TH_CHECK(dev->queue_create(&q) == SD_OK && q != NULL, "queue");

    /* AdamW, two steps, p = 1, g = 0.5 (given as 1.0 with scale 0.5) */
    float master = 1.0f, m = 0, v = 0, grad = 1.0f, w = 0;
    struct sd_adamw_args a = {
        .lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f, .step = 1};
    dev->adamw(q, &a, &master, &m, &v, &grad, 0.5f, &w, SD_DTYPE_FP32, 1);
    /* step 1: p = 0.999, m = 0.05, v = 0.00025, update = 0.1 * 0.5 / (0.5 + 1e-8) */
    double p1 = 1.0 * (1 - 0.1 * 0.01) - 0.1 * (0.05 / 0.1) / (sqrt(0.00025 / 0.001) + 1e-8);
    TH_CHECK(fabs(master - p1) < 1e-6 && w == master && grad == 0.0f && fabs(m - 0.05) < 1e-7,
             "adamw step 1: %.9g vs %.9g", master, p1);
    grad = 1.0f;
    a.step = 2;
    dev->adamw(q, &a, &master, &m, &v, &grad, 0.5f, &w, SD_DTYPE_FP32, 1);
    double m2 = 0.9 * 0.05 + 0.1 * 0.5, v2 = 0.999 * 0.00025 + 0.001 * 0.25;
    double p2 =
        p1 * (1 - 0.001) - 0.1 * (m2 / (1 - 0.81)) / (sqrt(v2 / (1 - 0.999 * 0.999)) + 1e-8);
    TH_CHECK(fabs(master - p2) < 1e-6, "adamw step 2: %.9g vs %.9g", master, p2);

    /* SGD with momentum 0.9 and weight decay 0.01 */
    float sp = 1.0f, buf = 0, sg = 0.5f;
    uint16_t w16;
    struct sd_sgd_args s = {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f};
    dev->sgd(q, &s, &sp, &buf, &sg, 1.0f, &w16, SD_DTYPE_BF16, 1);
    TH_CHECK(fabs(sp - 0.949) < 1e-6 && sg == 0.0f, "sgd step 1: %.9g", sp);
    TH_CHECK(w16 == sd_f32_to_bf16(sp), "w cast to bf16");
    sg = 0.5f;
    dev->sgd(q, &s, &sp, &buf, &sg, 1.0f, &w16, SD_DTYPE_BF16, 1);
    TH_CHECK(fabs(sp - 0.852151) < 1e-6, "sgd step 2: %.9g", sp);

    /* Adam (torch.optim.Adam: the decay added to the gradient), two steps, p = 1, g = 0.5 */
    master = 1.0f, m = 0, v = 0, grad = 1.0f;
    struct sd_adamw_args ad = {.lr = 0.1f,
                               .beta1 = 0.9f,
                               .beta2 = 0.999f,
                               .eps = 1e-8f,
                               .weight_decay = 0.01f,
                               .step = 1,
                               .l2 = true};
    dev->adamw(q, &ad, &master, &m, &v, &grad, 0.5f, &w, SD_DTYPE_FP32, 1);
    double ag1 = 0.5 + 0.01 * 1.0, am1 = 0.1 * ag1, av1 = 0.001 * ag1 * ag1;
    double ap1 = 1.0 - 0.1 * (am1 / 0.1) / (sqrt(av1 / 0.001) + 1e-8);
    TH_CHECK(fabs(master - ap1) < 1e-6 && fabs(m - am1) < 1e-7 && w == master,
             "adam step 1: %.9g vs %.9g (m %.9g vs %.9g)", master, ap1, m, am1);
    grad = 1.0f;
    ad.step = 2;
    dev->adamw(q, &ad, &master, &m, &v, &grad, 0.5f, &w, SD_DTYPE_FP32, 1);
    double ag2 = 0.5 + 0.01 * ap1, am2 = 0.9 * am1 + 0.1 * ag2,
           av2 = 0.999 * av1 + 0.001 * ag2 * ag2;
    double ap2 = ap1 - 0.1 * (am2 / (1 - 0.81)) / (sqrt(av2 / (1 - 0.999 * 0.999)) + 1e-8);
    TH_CHECK(fabs(master - ap2) < 1e-6, "adam step 2: %.9g vs %.9g", master, ap2);

    /* SGD with Nesterov momentum 0.9, weight decay 0.01: the update is g + 0.9 * buf */
    float np = 1.0f, nbuf = 0, ng = 0.5f, nw = 0;
    struct sd_sgd_args ns = {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true};
    dev->sgd(q, &ns, &np, &nbuf, &ng, 1.0f, &nw, SD_DTYPE_FP32, 1);
    double ng1 = 0.5 + 0.01, nb1 = ng1, np1 = 1.0 - 0.1 * (ng1 + 0.9 * nb1);
    TH_CHECK(fabs(np - np1) < 1e-6 && fabs(nbuf - nb1) < 1e-7 && ng == 0.0f && nw == np,
             "nesterov step 1: %.9g vs %.9g", np, np1);
    ng = 0.5f;
    dev->sgd(q, &ns, &np, &nbuf, &ng, 1.0f, &nw, SD_DTYPE_FP32, 1);
    double ng2 = 0.5 + 0.01 * np1, nb2 = 0.9 * nb1 + ng2, np2 = np1 - 0.1 * (ng2 + 0.9 * nb2);
    TH_CHECK(fabs(np - np2) < 1e-6, "nesterov step 2: %.9g vs %.9g", np, np2);

    /* reduce, casts, norm */
    float acc[3] = {1, 2, 3};
    uint16_t h[3] = {sd_f32_to_bf16(0.5f), sd_f32_to_bf16(-2.0f), sd_f32_to_bf16(4.0f)};
    dev->reduce_add(q, acc, h, SD_DTYPE_BF16, 3);
    TH_CHECK(acc[0] == 1.5f && acc[1] == 0.0f && acc[2] == 7.0f, "reduce_add bf16");
    double ss = 0;
    dev->sum_sq(q, acc, 3, &ss);
    TH_CHECK(dev->sync(q) == SD_OK && ss == 1.5 * 1.5 + 49.0, "sum of squares");
    /* the sum of squares of a long vector (its partial sums run in lanes) against a long double
     * sum in plain order, and the same for every length around the lane count */
    enum { NSQ = 1003 };
    float *xs = malloc(NSQ * sizeof(float));
    TH_CHECK(xs != NULL, "alloc");
    for (int i = 0; i < NSQ; i++)
        xs[i] = (float)((i * 37) % 101 - 50) * 0.0173f;
    for (int n = 0; n <= NSQ; n += n < 20 ? 1 : 331) {
        long double ref = 0;
        for (int i = 0; i < n; i++)
            ref += (long double)xs[i] * xs[i];
        double got = -1, again = -2;
        dev->sum_sq(q, xs, (size_t)n, &got);
        TH_CHECK(fabsl((long double)got - ref) <= 1e-15L * ref, "sum_sq of %d: %.17g vs %.17Lg", n,
                 got, ref);
        dev->sum_sq(q, xs, (size_t)n, &again);
        TH_CHECK(again == got, "sum_sq of %d is deterministic", n);
    }

    /* the vectorized AdamW loop gives every element exactly what the same update of that
     * element alone gives */
    float *st = calloc(6 * NSQ, sizeof(float));
    TH_CHECK(st != NULL, "alloc");
    float *pm = st, *pmm = st + NSQ, *pv = st + 2 * NSQ, *pg = st + 3 * NSQ, *pw = st + 4 * NSQ;
    for (int i = 0; i < NSQ; i++) {
        pm[i] = xs[i] + 0.5f;
        pmm[i] = xs[i] * 0.01f;
        pv[i] = xs[i] * xs[i] * 0.001f;
        pg[i] = xs[(i * 7) % NSQ];
    }
    float one[5 * NSQ];
    memcpy(one, st, sizeof(one));
    a.step = 3;
    dev->adamw(q, &a, pm, pmm, pv, pg, 0.25f, pw, SD_DTYPE_FP32, NSQ);
    int differ = 0;
    for (int i = 0; i < NSQ; i++) {
        float e[5] = {one[i], one[NSQ + i], one[2 * NSQ + i], one[3 * NSQ + i], 0};
        dev->adamw(q, &a, &e[0], &e[1], &e[2], &e[3], 0.25f, &e[4], SD_DTYPE_FP32, 1);
        differ += e[0] != pm[i] || e[1] != pmm[i] || e[2] != pv[i] || e[4] != pw[i] || pg[i] != 0;
    }
    TH_CHECK(differ == 0, "adamw over %d elements: %d differ from the one-element update", NSQ,
             differ);
    free(st);
    free(xs);

    float back[3];
    dev->to_f32(q, back, h, SD_DTYPE_BF16, 3);
    TH_CHECK(back[1] == -2.0f, "to_f32");

    /* shared memory: backed and mapped up front (no page faults on first touch, no SIGBUS when
     * memory runs out later), zeroed, sealed against resizing */
    struct sd_mem mem;
    TH_CHECK(dev->alloc(0, 1 << 20, SD_MEM_SHARED, "test", &mem) == 0 && mem.fd >= 0,
             "alloc shared");
    size_t pages = (1u << 20) / (size_t)sysconf(_SC_PAGESIZE);
    size_t res = resident_pages(mem.ptr, 1 << 20);
    TH_CHECK(res == pages, "shared buffer populated: %zu of %zu pages resident", res, pages);
    struct stat sb;
    TH_CHECK(fstat(mem.fd, &sb) == 0 && (uint64_t)sb.st_blocks * 512 >= (1u << 20),
             "memfd backed: %lld bytes allocated", (long long)sb.st_blocks * 512);
    TH_CHECK(((char *)mem.ptr)[12345] == 0, "zeroed");
    TH_CHECK(ftruncate(mem.fd, 4096) != 0, "shrinking a sealed memfd fails");
    TH_CHECK(ftruncate(mem.fd, 1 << 21) != 0, "growing a sealed memfd fails");
    int seals = fcntl(mem.fd, F_GET_SEALS);
    TH_CHECK((seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) ==
                 (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
             "seals %x", seals);
    dev->free(&mem);
    TH_CHECK(mem.fd == -1 && mem.ptr == NULL, "freed");
    TH_CHECK(dev->alloc(0, 1 << 20, 0, "private", &mem) == 0, "alloc private");
    res = resident_pages(mem.ptr, 1 << 20);
    TH_CHECK(res == pages, "private buffer populated: %zu of %zu pages resident", res, pages);
    dev->free(&mem);
    dev->queue_destroy(q);

    /* host-deferred: the same kernels, run when the queue is waited for and not before; a
     * daemon that read a result without waiting would read what was there before */
    const struct sd_gpu_ops *dd = sd_gpu_find("host-deferred");
    struct sd_gpu_queue *dq = NULL;
    TH_CHECK(dd != NULL && dd->host_memory && dd->queue_create(&dq) == SD_OK, "deferred queue");
    float x[4] = {1, 2, 3, 4}, y[4] = {0}, z[4] = {10, 10, 10, 10};
    double sq = -1;
    dd->copy(dq, y, x, sizeof(x));
    dd->reduce_add(dq, z, y, SD_DTYPE_FP32, 4); /* reads what the copy wrote: in order */
    dd->sum_sq(dq, z, 4, &sq);
    uint64_t ticket = 0;
    TH_CHECK(dd->record(dq, &ticket) == SD_OK, "record");
    TH_CHECK(y[0] == 0 && z[0] == 10 && sq == -1, "nothing ran before the wait");
    /* a busy device's first answer, then done */
    TH_CHECK(dd->query(dq, ticket) == SD_EAGAIN && y[0] == 0 && sq == -1,
             "the first query of a ticket: not yet, nothing ran");
    TH_CHECK(dd->query(dq, ticket) == SD_OK, "query runs the queue and reports it done");
    TH_CHECK(y[3] == 4 && z[0] == 11 && z[3] == 14 && sq == 11.0 * 11 + 12 * 12 + 13 * 13 + 14 * 14,
             "after the wait: copy, add, sum of squares in order (%g %g %g)", z[0], z[3], sq);
    dd->zero(dq, &z[1], 2 * sizeof(float));
    TH_CHECK(z[1] == 12, "zero waits for the queue");
    TH_CHECK(dd->sync(dq) == SD_OK && z[0] == 11 && z[1] == 0 && z[2] == 0 && z[3] == 14,
             "zero: exactly its bytes (%g %g %g %g)", z[0], z[1], z[2], z[3]);
    float g1 = 1.0f, mst = 1.0f, m1 = 0, v1 = 0, w1 = 0;
    a.step = 1;
    dd->adamw(dq, &a, &mst, &m1, &v1, &g1, 0.5f, &w1, SD_DTYPE_FP32, 1);
    TH_CHECK(mst == 1.0f && g1 == 1.0f, "adamw waits too");
    TH_CHECK(dd->sync(dq) == SD_OK && fabs(mst - p1) < 1e-6 && g1 == 0.0f && w1 == mst,
             "adamw after the wait: %.9g vs %.9g", mst, p1);
    /* more kernels than the queue holds: the oldest run when it fills, in order */
    float acc1 = 0, unit_value = 1;
    for (int i = 0; i < 10000; i++)
        dd->reduce_add(dq, &acc1, &unit_value, SD_DTYPE_FP32, 1);
    TH_CHECK(acc1 > 0 && acc1 < 10000, "a full queue runs what it holds (%g so far)", acc1);
    TH_CHECK(dd->sync(dq) == SD_OK && acc1 == 10000, "all 10000 after the wait: %g", acc1);
    dd->queue_destroy(dq);
    return th_summary("test_host_backend");
}

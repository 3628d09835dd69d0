/* shard-bench kernels: a device backend's kernels, each as a ratio against the same device's
 * copy bandwidth measured in the same run (read + write bytes per second), as issue 40 states
 * its targets: a 256 MiB unit gathered from 8 shards into one slot (>= 0.9 of one copy),
 * AdamW at 64M parameters (>= 0.9 of the copy's read + write), and the codecs' throughput.
 * Runs on any backend (--backend cuda|hip|emu|host); on a GPU it is the GPU's numbers. */
#include "bench_kernels.h"
#include "sd/codec.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kb {
    const struct sd_gpu_ops *dev;
    struct sd_gpu_queue *q;
    int iters;
    bool json;
    double copy_Bps; /* the baseline: read + write bytes per second of one copy */
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef void (*kb_fn)(struct kb *k, void *arg);

/* the best time of one call over iters, after one warm-up; the queue is drained around each */
static double best(struct kb *k, kb_fn fn, void *arg)
{
    fn(k, arg);
    k->dev->sync(k->q);
    double b = 1e30;
    for (int i = 0; i < k->iters; i++) {
        double t0 = now();
        fn(k, arg);
        if (k->dev->sync(k->q) != SD_OK)
            return -1;
        double t = now() - t0;
        b = t < b ? t : b;
    }
    return b;
}

static void report(struct kb *k, const char *name, double bytes_moved, double t, double target)
{
    double Bps = bytes_moved / t, ratio = k->copy_Bps > 0 ? Bps / k->copy_Bps : 1.0;
    if (k->json)
        printf("{\"name\": \"%s\", \"backend\": \"%s\", \"time_us\": %.1f, \"GBps\": %.2f, "
               "\"ratio_to_copy\": %.3f, \"target\": %.2f}\n",
               name, k->dev->name, t * 1e6, Bps / 1e9, ratio, target);
    else if (target > 0)
        printf("%-28s %10.1f us %9.1f GB/s  %.3f of the copy (target %.2f: %s)\n", name, t * 1e6,
               Bps / 1e9, ratio, target, ratio >= target ? "met" : "NOT met");
    else
        printf("%-28s %10.1f us %9.1f GB/s  %.3f of the copy\n", name, t * 1e6, Bps / 1e9, ratio);
}

struct bufs {
    struct sd_mem m[8];
    int n;
};

static void *alloc(struct kb *k, struct bufs *b, size_t bytes)
{
    if (b->n == 8 || k->dev->alloc(0, bytes, SD_MEM_PRIVATE, "bench", &b->m[b->n]) != SD_OK)
        return NULL;
    return b->m[b->n++].ptr;
}

static void free_all(struct kb *k, struct bufs *b)
{
    while (b->n > 0)
        k->dev->free(&b->m[--b->n]);
}

struct copy_arg {
    void *dst;
    const void *src;
    size_t bytes;
    int pieces;   /* a gather: pieces copies of bytes / pieces from src's pieces into dst */
    bool at_once; /* the pieces in one copy_many (the daemon's gather), else a copy each */
};

static void run_copy(struct kb *k, void *arg)
{
    struct copy_arg *c = arg;
    size_t piece = c->bytes / c->pieces;
    struct sd_gpu_piece p[64];
    int n = c->pieces < 64 ? c->pieces : 64;
    for (int i = 0; i < n; i++)
        p[i] = (struct sd_gpu_piece){.dst = (char *)c->dst + i * piece,
                                     .src = (const char *)c->src + i * piece,
                                     .bytes = piece};
    if (c->at_once) {
        sd_gpu_copy_many(k->dev, k->q, p, (uint32_t)n);
        return;
    }
    for (int i = 0; i < n; i++)
        k->dev->copy(k->q, p[i].dst, p[i].src, p[i].bytes);
}

struct opt_arg {
    float *master, *m, *v, *grad;
    void *w;
    size_t n;
    bool sgd;
    int step;
};

static void run_opt(struct kb *k, void *arg)
{
    struct opt_arg *o = arg;
    struct sd_adamw_args a = {.lr = 1e-3f,
                              .beta1 = 0.9f,
                              .beta2 = 0.999f,
                              .eps = 1e-8f,
                              .weight_decay = 0.01f,
                              .step = (uint64_t)++o->step};
    struct sd_sgd_args s = {.lr = 1e-2f, .momentum = 0.9f, .weight_decay = 0.0f};
    if (o->sgd)
        k->dev->sgd(k->q, &s, o->master, o->m, o->grad, 1.0f, o->w, SD_DTYPE_FP32, o->n);
    else
        k->dev->adamw(k->q, &a, o->master, o->m, o->v, o->grad, 1.0f, o->w, SD_DTYPE_FP32, o->n);
}

struct codec_arg {
    float *x, *err, *y;
    void *enc;
    size_t n;
    int bits, op;
    uint32_t block;
};

static void run_codec(struct kb *k, void *arg)
{
    struct codec_arg *c = arg;
    if (c->op == 0)
        k->dev->quantize(k->q, c->enc, c->bits, c->x, SD_DTYPE_FP32, c->n, c->block);
    else if (c->op == 1)
        k->dev->dequantize(k->q, c->y, SD_DTYPE_FP32, c->enc, c->bits, c->n, c->block, true);
    else
        k->dev->quantize_ef(k->q, c->enc, c->bits, c->x, c->err, c->n, c->block);
}

int sd_bench_kernels(const char *backend, uint64_t size, uint64_t params, int iters, bool json)
{
    struct kb k = {.iters = iters, .json = json};
    k.dev = sd_gpu_find(backend);
    char why[512] = "not built into this binary";
    if (k.dev == NULL ||
        (k.dev->open != NULL && k.dev->open((const int[]){0}, 1, why, sizeof(why)) != SD_OK) ||
        k.dev->queue_create(&k.q) != SD_OK) {
        fprintf(stderr, "shard-bench kernels: backend %s: %s\n", backend, why);
        return 77;
    }
    if (!json)
        printf("# backend %s: %llu-byte copies, %llu parameters, best of %d\n", k.dev->name,
               (unsigned long long)size, (unsigned long long)params, iters);
    struct bufs b = {.n = 0};
    int rc = 1;
    /* the baseline, then a unit gathered from 8 shards into one slot */
    struct copy_arg c = {.bytes = size, .pieces = 1};
    c.src = alloc(&k, &b, size);
    c.dst = alloc(&k, &b, size);
    if (c.src == NULL || c.dst == NULL)
        goto out;
    double t = best(&k, run_copy, &c);
    k.copy_Bps = 2.0 * (double)size / t;
    report(&k, "copy (baseline)", 2.0 * (double)size, t, 0);
    c.pieces = 8;
    report(&k, "gather 8 shards, 8 copies", 2.0 * (double)size, best(&k, run_copy, &c), 0);
    c.at_once = true; /* what the daemon's gather does: the shards in one copy_many */
    report(&k, "gather 8 shards into a slot", 2.0 * (double)size, best(&k, run_copy, &c), 0.9);
    free_all(&k, &b);

    /* the optimizers: fp32 w; bytes are every read and write of the kernel */
    size_t n = params, fb = n * sizeof(float);
    struct opt_arg o = {.n = n};
    o.master = alloc(&k, &b, fb), o.m = alloc(&k, &b, fb), o.v = alloc(&k, &b, fb);
    o.grad = alloc(&k, &b, fb), o.w = alloc(&k, &b, fb);
    if (!o.master || !o.m || !o.v || !o.grad || !o.w)
        goto out;
    /* master, m, v read and written; grad read and zeroed; w written: 36 bytes a parameter */
    report(&k, "adamw (fp32 w)", 36.0 * (double)n, best(&k, run_opt, &o), 0.9);
    o.sgd = true; /* master, buf read and written; grad read and zeroed; w written: 28 */
    report(&k, "sgd momentum (fp32 w)", 28.0 * (double)n, best(&k, run_opt, &o), 0);
    free_all(&k, &b);

    /* the codecs, block 256: bytes are the fp32 input and the encoding, read or written */
    for (int bits = 8; bits >= 4; bits -= 4) {
        struct codec_arg q = {.n = n, .bits = bits, .block = 256};
        size_t enc = sd_codec_bytes(bits, n, 256);
        q.x = alloc(&k, &b, fb), q.y = alloc(&k, &b, fb), q.err = alloc(&k, &b, fb);
        q.enc = alloc(&k, &b, enc);
        if (!q.x || !q.y || !q.err || !q.enc)
            goto out;
        char name[64];
        snprintf(name, sizeof(name), "quantize int%d", bits);
        report(&k, name, (double)(fb + enc), best(&k, run_codec, &q), 0);
        q.op = 1;
        snprintf(name, sizeof(name), "dequantize-add int%d", bits);
        report(&k, name, (double)(2 * fb + enc), best(&k, run_codec, &q), 0);
        q.op = 2;
        snprintf(name, sizeof(name), "quantize_ef int%d", bits);
        report(&k, name, (double)(3 * fb + enc), best(&k, run_codec, &q), 0);
        free_all(&k, &b);
    }
    rc = 0;
out:
    if (rc != 0)
        fprintf(stderr, "shard-bench kernels: cannot allocate the buffers on %s\n", k.dev->name);
    free_all(&k, &b);
    k.dev->queue_destroy(k.q);
    return rc;
}

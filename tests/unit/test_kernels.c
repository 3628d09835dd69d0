/* The device kernels' one source (gpu/kern/kernels.h) against the host backend, every kernel and
 * dtype, lengths 0, 1, 3, 4095, 4097 and 1M+3, aligned and unaligned starts, special values
 * (NaN, infinities, subnormals, fp16 overflow) among the inputs.
 *
 *   test_kernels            the emulation (backend emu) against the host backend
 *   test_kernels cuda|hip   the device, against the emulation bit for bit and the host backend;
 *                           exits 77 (a skip) where the backend is not built or finds no device
 *   SHARD_TEST_QUICK=1      lengths up to 4097 only (for compute-sanitizer)
 *
 * Bitwise everywhere but the sum of squares, which adds in another fixed order than the host
 * backend's (a tree over threads and blocks against 8 lanes): it must be within n 2^-52 of the
 * sum (the bound of any order of n double additions of non-negative terms, each square exact in
 * double), and bitwise equal between the emulation and the device. */
#include "check.h"
#include "sd/codec.h"
#include "sd/dtype.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct bk {
    const struct sd_gpu_ops *ops;
    struct sd_gpu_queue *q;
};

static struct bk host, emu, dut; /* the reference, the emulation, the backend under test */
static bool device;              /* dut is not the emulation (device memory) */
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* a float: mostly N(0, 1)-ish values of several magnitudes, some special */
static float rnd_float(bool specials)
{
    uint32_t r = rnd() % 1000;
    if (specials && r == 0)
        return NAN;
    if (specials && r == 1)
        return (rnd() & 1) ? INFINITY : -INFINITY;
    if (r < 10)
        return ((int)(rnd() % 2001) - 1000) * 1e-7f * 1e-30f; /* subnormal-ish, and fp16 zero */
    if (r < 20)
        return ((int)(rnd() % 2001) - 1000) * 100.0f; /* fp16 overflow */
    if (r < 30)
        return ((int)(rnd() % 2001) - 1000) * 6e-8f; /* fp16 subnormals */
    float u = ((float)rnd() / 65536.0f - 0.5f) * 4.0f;
    return u * powf(2.0f, (float)((int)(rnd() % 16) - 8));
}

static size_t esize(int dtype)
{
    return dtype == SD_DTYPE_FP32 ? 4 : 2;
}

/* n elements of dtype in host memory, from floats (or random bits for 16-bit dtypes) */
static void *make(int dtype, size_t n, bool specials, bool bits16)
{
    uint8_t *p = malloc(n * esize(dtype) + 16);
    for (size_t i = 0; i < n; i++) {
        float f = rnd_float(specials);
        if (dtype == SD_DTYPE_FP32)
            memcpy(p + 4 * i, &f, 4);
        else {
            uint16_t h = bits16                   ? (uint16_t)rnd()
                         : dtype == SD_DTYPE_BF16 ? sd_f32_to_bf16(f)
                                                  : sd_f32_to_fp16(f);
            memcpy(p + 2 * i, &h, 2);
        }
    }
    return p;
}

/* one operand of a kernel: its host bytes, and the copies each backend works on */
#define MAXOP 5
struct opnd {
    void *init; /* host: the input, bytes long */
    size_t bytes, off;
    int fdt; /* 1 + the dtype of its elements where they are floats, 0: bytes (encodings) */
    struct sd_mem mem[3]; /* host, emu, dut */
};

static int backend_index(const struct bk *b)
{
    return b == &host ? 0 : b == &emu ? 1 : 2;
}

static void *at(struct opnd *o, const struct bk *b)
{
    return (uint8_t *)o->mem[backend_index(b)].ptr + o->off;
}

/* every backend's copy of the operands, filled with their inputs (off bytes in: unaligned) */
static void setup(struct opnd *ops, int n)
{
    for (int i = 0; i < n; i++)
        for (int b = 0; b < 3; b++) {
            struct bk *k = b == 0 ? &host : b == 1 ? &emu : &dut;
            if (b == 2 && !device)
                continue;
            int st = k->ops->alloc(0, ops[i].bytes + ops[i].off + 16, SD_MEM_PRIVATE, "test",
                                   &ops[i].mem[b]);
            if (st != SD_OK) {
                fprintf(stderr, "alloc of %zu bytes on %s: %s\n", ops[i].bytes, k->ops->name,
                        sd_status_str(st));
                exit(1);
            }
            k->ops->copy(k->q, at(&ops[i], k), ops[i].init, ops[i].bytes);
        }
}

/* operand i of backend b back in host memory */
static void *result(struct opnd *o, const struct bk *b)
{
    void *h = malloc(o->bytes + 1);
    b->ops->copy(b->q, h, at(o, b), o->bytes);
    if (b->ops->sync(b->q) != SD_OK) {
        fprintf(stderr, "%s: a kernel failed\n", b->ops->name);
        exit(1);
    }
    return h;
}

static void teardown(struct opnd *ops, int n)
{
    for (int i = 0; i < n; i++) {
        for (int b = 0; b < 3; b++) {
            struct bk *k = b == 0 ? &host : b == 1 ? &emu : &dut;
            if (ops[i].mem[b].ptr != NULL)
                k->ops->free(&ops[i].mem[b]);
        }
        free(ops[i].init);
    }
}

/* element i of p, of dtype dt, is a NaN: a device's arithmetic makes NaNs of its own bits
 * (NVIDIA's canonical 0x7fffffff, x86's the operand's or 0xffc00000), so NaN equals NaN between a
 * device and the emulation; the emulation and the host backend agree bit for bit */
static bool is_nan(const uint8_t *p, int dt, size_t i)
{
    if (dt == SD_DTYPE_FP32) {
        uint32_t u;
        memcpy(&u, p + 4 * i, 4);
        return (u & 0x7fffffffu) > 0x7f800000u;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return dt == SD_DTYPE_BF16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
}

/* compares every written operand of emu (and the device) with host's, bit for bit */
static void compare(const char *what, struct opnd *ops, int n)
{
    for (int i = 0; i < n; i++) {
        uint8_t *h = result(&ops[i], &host), *e = result(&ops[i], &emu);
        size_t bad = 0, first = 0;
        for (size_t j = 0; j < ops[i].bytes; j++)
            if (h[j] != e[j] && bad++ == 0)
                first = j;
        TH_CHECK(bad == 0,
                 "%s, operand %d: the emulation differs from the host backend in %zu of %zu bytes "
                 "(first at byte %zu: %02x vs %02x)",
                 what, i, bad, ops[i].bytes, first, bad ? e[first] : 0, bad ? h[first] : 0);
        if (device) {
            uint8_t *d = result(&ops[i], &dut);
            size_t w = ops[i].fdt == 0 ? 1 : esize(ops[i].fdt - 1), dbad = 0;
            for (size_t j = 0; j < ops[i].bytes / w; j++)
                if (memcmp(d + j * w, e + j * w, w) != 0 &&
                    !(w > 1 && is_nan(d, ops[i].fdt - 1, j) && is_nan(e, ops[i].fdt - 1, j)) &&
                    dbad++ == 0)
                    first = j;
            uint32_t dv = 0, ev = 0;
            if (dbad) {
                memcpy(&dv, d + first * w, w);
                memcpy(&ev, e + first * w, w);
            }
            TH_CHECK(dbad == 0,
                     "%s, operand %d: %s differs from the emulation in %zu of %zu %s (first at "
                     "%zu: %#x, the emulation's %#x)",
                     what, i, dut.ops->name, dbad, ops[i].bytes / w, w > 1 ? "elements" : "bytes",
                     first, dv, ev);
            free(d);
        }
        free(h);
        free(e);
    }
}

static const char *const dtn[] = {"fp32", "bf16", "fp16"};
#define EACH_BK(b)                                                                                 \
    for (struct bk *b = &host; b != NULL; b = b == &host ? &emu : b == &emu && device ? &dut : NULL)

static void t_casts(size_t n, size_t skew)
{
    char what[96];
    for (int dt = 0; dt < 3; dt++) {
        struct opnd o[2] = {
            {.init = make(dt, n, true, true), .bytes = n * esize(dt), .off = skew * esize(dt)},
            {.init = calloc(n + 1, 4), .bytes = n * 4, .off = skew * 4, .fdt = 1}};
        setup(o, 2);
        EACH_BK(b)
        b->ops->to_f32(b->q, at(&o[1], b), at(&o[0], b), dt, n);
        snprintf(what, sizeof(what), "to_f32 %s n=%zu skew=%zu", dtn[dt], n, skew);
        compare(what, o + 1, 1);
        teardown(o, 2);

        struct opnd f[2] = {
            {.init = make(SD_DTYPE_FP32, n, true, false), .bytes = n * 4, .off = skew * 4},
            {.init = calloc(n + 1, 4),
             .bytes = n * esize(dt),
             .off = skew * esize(dt),
             .fdt = 1 + dt}};
        setup(f, 2);
        EACH_BK(b)
        b->ops->from_f32(b->q, at(&f[1], b), dt, at(&f[0], b), n);
        snprintf(what, sizeof(what), "from_f32 %s n=%zu skew=%zu", dtn[dt], n, skew);
        compare(what, f + 1, 1);
        teardown(f, 2);

        struct opnd r[2] = {
            {.init = make(SD_DTYPE_FP32, n, true, false),
             .bytes = n * 4,
             .off = skew * 4,
             .fdt = 1},
            {.init = make(dt, n, true, false), .bytes = n * esize(dt), .off = skew * esize(dt)}};
        setup(r, 2);
        EACH_BK(b)
        b->ops->reduce_add(b->q, at(&r[0], b), at(&r[1], b), dt, n);
        snprintf(what, sizeof(what), "reduce_add %s n=%zu skew=%zu", dtn[dt], n, skew);
        compare(what, r, 1);
        teardown(r, 2);
    }
}

static void t_sum_sq(size_t n, size_t skew)
{
    struct opnd o = {.init = make(SD_DTYPE_FP32, n, false, false), .bytes = n * 4, .off = skew * 4};
    setup(&o, 1);
    double s[3] = {0, 0, 0};
    EACH_BK(b)
    {
        b->ops->sum_sq(b->q, at(&o, b), n, &s[backend_index(b)]);
        b->ops->sync(b->q);
    }
    double bound = (double)n * ldexp(1.0, -52) * s[0];
    TH_CHECK(fabs(s[1] - s[0]) <= bound, "sum_sq n=%zu: emulation %.17g, host %.17g (bound %.3g)",
             n, s[1], s[0], bound);
    if (device)
        TH_CHECK(memcmp(&s[2], &s[1], sizeof(double)) == 0,
                 "sum_sq n=%zu: %s %.17g, emulation %.17g (must be bitwise)", n, dut.ops->name,
                 s[2], s[1]);
    teardown(&o, 1);
}

static void t_optim(size_t n, size_t skew)
{
    char what[96];
    for (int dt = 0; dt < 3; dt++) {
        struct opnd o[5];
        for (int i = 0; i < 4; i++)
            o[i] = (struct opnd){.init = make(SD_DTYPE_FP32, n, false, false),
                                 .bytes = n * 4,
                                 .off = skew * 4,
                                 .fdt = 1};
        float *v = o[2].init;
        for (size_t i = 0; i < n; i++)
            v[i] = fabsf(v[i]) * 0.01f; /* the second moment is not negative */
        o[4] = (struct opnd){.init = calloc(n + 1, 4),
                             .bytes = n * esize(dt),
                             .off = skew * esize(dt),
                             .fdt = 1 + dt};
        setup(o, 5);
        struct sd_adamw_args a = {.lr = 1e-3f,
                                  .beta1 = 0.9f,
                                  .beta2 = 0.999f,
                                  .eps = 1e-8f,
                                  .weight_decay = 0.01f,
                                  .step = 7};
        for (int l2 = 0; l2 < 2; l2++) { /* AdamW, then Adam (the decay in the gradient) */
            a.l2 = l2 == 1;
            EACH_BK(b)
            b->ops->adamw(b->q, &a, at(&o[0], b), at(&o[1], b), at(&o[2], b), at(&o[3], b), 0.25f,
                          at(&o[4], b), dt, n);
            snprintf(what, sizeof(what), "%s w %s n=%zu skew=%zu", l2 ? "adam" : "adamw", dtn[dt],
                     n, skew);
            compare(what, o, 5);
        }
        teardown(o, 5);

        struct opnd s[4];
        for (int i = 0; i < 3; i++)
            s[i] = (struct opnd){.init = make(SD_DTYPE_FP32, n, false, false),
                                 .bytes = n * 4,
                                 .off = skew * 4,
                                 .fdt = 1};
        s[3] = (struct opnd){.init = calloc(n + 1, 4),
                             .bytes = n * esize(dt),
                             .off = skew * esize(dt),
                             .fdt = 1 + dt};
        setup(s, 4);
        struct sd_sgd_args g = {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 1e-4f};
        for (int nest = 0; nest < 2; nest++) { /* plain momentum, then Nesterov's */
            g.nesterov = nest == 1;
            EACH_BK(b)
            b->ops->sgd(b->q, &g, at(&s[0], b), at(&s[1], b), at(&s[2], b), 0.5f, at(&s[3], b), dt,
                        n);
            snprintf(what, sizeof(what), "sgd%s w %s n=%zu skew=%zu", nest ? "-nesterov" : "",
                     dtn[dt], n, skew);
            compare(what, s, 4);
        }
        teardown(s, 4);
    }
}

static void t_codecs(size_t n, size_t skew)
{
    static const uint32_t blocks[] = {3, 256};
    char what[128];
    for (int bits = 4; bits <= 8; bits += 4)
        for (int bi = 0; bi < 2; bi++) {
            uint32_t block = blocks[bi];
            size_t enc = sd_codec_bytes(bits, n, block);
            for (int dt = 0; dt < 3; dt++) {
                struct opnd o[2] = {{.init = make(dt, n, true, false),
                                     .bytes = n * esize(dt),
                                     .off = skew * esize(dt)},
                                    {.init = calloc(enc + 1, 1), .bytes = enc, .off = skew * 4}};
                setup(o, 2);
                EACH_BK(b)
                b->ops->quantize(b->q, at(&o[1], b), bits, at(&o[0], b), dt, n, block);
                snprintf(what, sizeof(what), "quantize int%d block %u %s n=%zu skew=%zu", bits,
                         block, dtn[dt], n, skew);
                compare(what, o + 1, 1);
                /* decode what the host encoded, into each dtype and accumulating into fp32 */
                for (int acc = 0; acc < 2; acc++) {
                    int ddt = acc ? SD_DTYPE_FP32 : dt;
                    struct opnd d[2] = {
                        {.init = result(&o[1], &host), .bytes = enc, .off = skew * 4},
                        {.init = make(ddt, n, false, false),
                         .bytes = n * esize(ddt),
                         .off = skew * esize(ddt),
                         .fdt = 1 + ddt}};
                    setup(d, 2);
                    EACH_BK(b)
                    b->ops->dequantize(b->q, at(&d[1], b), ddt, at(&d[0], b), bits, n, block, acc);
                    snprintf(what, sizeof(what),
                             "dequantize int%d block %u into %s%s n=%zu skew=%zu", bits, block,
                             dtn[ddt], acc ? " (accumulate)" : "", n, skew);
                    compare(what, d + 1, 1);
                    teardown(d, 2);
                }
                teardown(o, 2);
            }
            struct opnd e[3] = {
                {.init = make(SD_DTYPE_FP32, n, true, false), .bytes = n * 4, .off = skew * 4},
                {.init = make(SD_DTYPE_FP32, n, false, false),
                 .bytes = n * 4,
                 .off = skew * 4,
                 .fdt = 1},
                {.init = calloc(enc + 1, 1), .bytes = enc, .off = skew * 4}};
            float *err = e[1].init;
            for (size_t i = 0; i < n; i++)
                err[i] *= 0.01f;
            setup(e, 3);
            EACH_BK(b)
            b->ops->quantize_ef(b->q, at(&e[2], b), bits, at(&e[0], b), at(&e[1], b), n, block);
            snprintf(what, sizeof(what), "quantize_ef int%d block %u n=%zu skew=%zu", bits, block,
                     n, skew);
            compare(what, e + 1, 2);
            teardown(e, 3);
        }
}

/* copy_many: 19 pieces (two launches of at most 16) of about n bytes each, from a source operand
 * into a destination one at other places: their ends 16-byte aligned (align 0), 4-byte (1) or
 * anywhere (2), the gaps between them left as they were */
static void t_gather(size_t n, int align)
{
    enum { P = 19 };
    size_t len[P], soff[P], doff[P], stot = 0, dtot = 0;
    const size_t step = align == 0 ? 16 : align == 1 ? 4 : 1, gap = align == 0 ? 0 : step;
    for (int i = 0; i < P; i++) {
        len[i] = n / (1 + i % 3) + (size_t)(i % 5) * step;
        doff[i] = dtot;
        dtot += (len[i] + 15) / 16 * 16 + gap;
    }
    for (int i = P - 1; i >= 0; i--) { /* the sources in the other order */
        soff[i] = stot;
        stot += (len[i] + 15) / 16 * 16 + 2 * gap;
    }
    uint8_t *src = malloc(stot + 1);
    for (size_t i = 0; i < stot; i++)
        src[i] = (uint8_t)rnd();
    struct opnd o[2] = {{.init = src, .bytes = stot + 1, .off = align == 2 ? 1 : 0},
                        {.init = calloc(dtot + 1, 1), .bytes = dtot + 1, .off = 0}};
    setup(o, 2);
    EACH_BK(b)
    {
        struct sd_gpu_piece pc[P];
        for (int i = 0; i < P; i++)
            pc[i] = (struct sd_gpu_piece){.dst = (uint8_t *)at(&o[1], b) + doff[i],
                                          .src = (uint8_t *)at(&o[0], b) + soff[i],
                                          .bytes = len[i]};
        sd_gpu_copy_many(b->ops, b->q, pc, P);
    }
    char what[96];
    snprintf(what, sizeof(what), "copy_many of %d pieces of about %zu bytes, aligned to %zu", P, n,
             step);
    compare(what, o + 1, 1);
    teardown(o, 2);
}

/* every fp16 value to fp32, and fp32 values of every exponent (and the rounding boundaries)
 * to fp16 and bf16, against sd/dtype.h's conversions (the host backend's) */
static void t_exhaustive(void)
{
    size_t n = 65536;
    struct opnd o[2] = {{.init = malloc(2 * n), .bytes = 2 * n},
                        {.init = calloc(n, 4), .bytes = 4 * n, .fdt = 1}};
    for (size_t i = 0; i < n; i++)
        ((uint16_t *)o[0].init)[i] = (uint16_t)i;
    setup(o, 2);
    EACH_BK(b)
    b->ops->to_f32(b->q, at(&o[1], b), at(&o[0], b), SD_DTYPE_FP16, n);
    compare("to_f32 of every fp16", o + 1, 1);
    teardown(o, 2);

    n = 1u << 22; /* 4M floats: a stride through all 2^32 bit patterns, and the boundaries */
    for (int dt = 1; dt < 3; dt++) {
        struct opnd f[2] = {{.init = malloc(4 * n), .bytes = 4 * n},
                            {.init = calloc(n, 2), .bytes = 2 * n, .fdt = 1 + dt}};
        uint32_t *u = f[0].init;
        for (size_t i = 0; i < n / 2; i++)
            u[i] = (uint32_t)(i * 2039u);    /* 2039 * 2^21 covers 2^32 */
        for (size_t i = n / 2; i < n; i++) { /* near fp16's rounding points: 13 low bits */
            uint32_t base = (uint32_t)(i - n / 2) << 13;
            u[i] = base + (uint32_t[]){0, 1, 0xfff, 0x1000, 0x1001, 0x1fff, 0x2fff, 0x3000}[i & 7];
        }
        setup(f, 2);
        EACH_BK(b)
        b->ops->from_f32(b->q, at(&f[1], b), dt, at(&f[0], b), n);
        compare(dt == 1 ? "from_f32 bf16 of 4M bit patterns" : "from_f32 fp16 of 4M bit patterns",
                f + 1, 1);
        teardown(f, 2);
    }
}

static int open_bk(struct bk *b, const char *name)
{
    b->ops = sd_gpu_find(name);
    if (b->ops == NULL)
        return SD_ENOSYS;
    if (b->ops->open != NULL) {
        char why[512];
        int st = b->ops->open((const int[]){0}, 1, why, sizeof(why));
        if (st != SD_OK) {
            printf("test_kernels: skipped: backend %s: %s\n", name, why);
            return st;
        }
    }
    return b->ops->queue_create(&b->q);
}

int main(int argc, char **argv)
{
    const char *name = argc > 1 ? argv[1] : "emu";
    if (open_bk(&host, "host") != SD_OK || open_bk(&emu, "emu") != SD_OK) {
        fprintf(stderr, "test_kernels: the host and emu backends are always built\n");
        return 1;
    }
    if (strcmp(name, "emu") != 0) {
        int st = open_bk(&dut, name);
        if (st == SD_ENOSYS && sd_gpu_find(name) == NULL)
            printf("test_kernels: skipped: backend %s is not built into this binary\n", name);
        if (st != SD_OK)
            return 77;
        device = true;
    }
    t_exhaustive();
    static const size_t lens[] = {0, 1, 3, 4095, 4097, (1u << 20) + 3};
    /* SHARD_TEST_QUICK=1 (under compute-sanitizer, which runs kernels 10-100x slower): up to 4097
     */
    const char *quick = getenv("SHARD_TEST_QUICK");
    size_t nlens = sizeof(lens) / sizeof(lens[0]) - (quick != NULL && strcmp(quick, "1") == 0);
    for (size_t li = 0; li < nlens; li++)
        for (size_t skew = 0; skew < 2; skew++) {
            t_casts(lens[li], skew);
            t_sum_sq(lens[li], skew);
            t_optim(lens[li], skew);
            t_codecs(lens[li], skew);
        }
    for (size_t li = 0; li < nlens; li++)
        for (int align = 0; align < 3; align++)
            t_gather(lens[li], align);
    return th_summary("test_kernels");
}

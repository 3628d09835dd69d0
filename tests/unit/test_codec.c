/* The block quantization codecs (sd/codec.h) of the host and host-deferred backends, against
 * what this test computes itself: each block's largest magnitude m from the input, the error
 * bound m / (2 qmax) per element (plus half a unit in the last place of the decoded value, the
 * rounding to its dtype), the encoded size, the int4 nibble layout written out by hand, the
 * exact decoding of +m and -m, zeros, denormals, non-finite blocks, bf16 in and out, and
 * dequantize-accumulate equal to dequantize then add, for lengths around the block size. */
#include "check.h"
#include "sd/codec.h"
#include "sd/dtype.h"
#include "sd/gpu.h"
#include "sd/model.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 88172645463325252ULL;

static double uniform(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

enum kind { RANDOM, ZEROS, DENORMAL, MIXED, EXTREMES };

static void fill(float *x, size_t n, enum kind k)
{
    for (size_t i = 0; i < n; i++) {
        double u = uniform() * 2 - 1;
        switch (k) {
        case RANDOM:
            x[i] = (float)(u * 3.0);
            break;
        case ZEROS:
            x[i] = 0.0f;
            break;
        case DENORMAL:
            x[i] = (float)(u * 1e-39); /* below FLT_MIN: denormals */
            break;
        case MIXED: /* magnitudes from 1e-30 to 1e30 */
            x[i] = (float)(u * pow(10.0, (uniform() - 0.5) * 60));
            break;
        case EXTREMES: /* +-m at the block's ends, the rest between */
            x[i] = i % 5 == 0 ? 2.5f : i % 5 == 1 ? -2.5f : (float)(u * 2.5);
            break;
        }
    }
}

static float half_ulp(float v)
{
    float a = fabsf(v);
    return (nextafterf(a, INFINITY) - a) / 2;
}

static void check_one(const struct sd_gpu_ops *dev, int bits, uint32_t block, size_t n, enum kind k)
{
    struct sd_gpu_queue *q;
    dev->queue_create(&q);
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    float *acc = malloc(n * sizeof(float)), *acc2 = malloc(n * sizeof(float));
    size_t bytes = sd_codec_bytes(bits, n, block);
    uint8_t *enc = malloc(bytes + 16);
    memset(enc, 0xa5, bytes + 16);
    fill(x, n, k);
    dev->quantize(q, enc, bits, x, SD_DTYPE_FP32, n, block);
    dev->dequantize(q, y, SD_DTYPE_FP32, enc, bits, n, block, false);
    for (size_t i = 0; i < n; i++)
        acc[i] = acc2[i] = (float)i * 0.25f;
    dev->dequantize(q, acc, SD_DTYPE_FP32, enc, bits, n, block, true);
    dev->sync(q);
    size_t nb = (n + block - 1) / block;
    TH_CHECK(bytes == 4 * nb + (bits == 8 ? n : (n + 1) / 2), "bytes %zu", bytes);
    bool in_bound = true, extremes = true, tail = true;
    int qmax = (1 << (bits - 1)) - 1;
    for (size_t b = 0; b < nb; b++) {
        size_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float m = 0;
        for (size_t i = lo; i < hi; i++)
            m = fmaxf(m, fabsf(x[i]));
        float bound = m / (2.0f * qmax);
        for (size_t i = lo; i < hi; i++) {
            double err = fabs((double)x[i] - (double)y[i]);
            if (err > (double)bound * (1 + 1e-6) + half_ulp(y[i]))
                in_bound = false;
            if (fabsf(x[i]) == m && y[i] != x[i])
                extremes = false;
        }
    }
    for (size_t i = 0; i < 16; i++) /* nothing written past the encoded bytes */
        tail = tail && enc[bytes + i] == 0xa5;
    bool same = true;
    for (size_t i = 0; i < n; i++)
        same = same && acc[i] == acc2[i] + y[i];
    TH_CHECK(in_bound, "%s int%d block %u n %zu kind %d: an element outside m / (2 qmax)",
             dev->name, bits, block, n, k);
    TH_CHECK(extremes, "%s int%d block %u n %zu kind %d: +m or -m not decoded exactly", dev->name,
             bits, block, n, k);
    TH_CHECK(tail, "%s int%d n %zu: wrote past the encoded size", dev->name, bits, n);
    TH_CHECK(same, "%s int%d block %u n %zu: dequantize-accumulate differs from dequantize + add",
             dev->name, bits, block, n);
    if (k == ZEROS) {
        bool zero = true;
        for (size_t i = 0; i < n; i++)
            zero = zero && y[i] == 0.0f;
        TH_CHECK(zero, "%s int%d n %zu: zeros did not stay zeros", dev->name, bits, n);
    }
    free(x);
    free(y);
    free(acc);
    free(acc2);
    free(enc);
    dev->queue_destroy(q);
}

/* int4 and int8 layouts written out by hand: block 4, m = 7 so q = x */
static void check_layout(const struct sd_gpu_ops *dev)
{
    struct sd_gpu_queue *q;
    dev->queue_create(&q);
    const float x[6] = {7, -7, 3, -1, 0, 5}; /* blocks {7,-7,3,-1} (m 7), {0,5} (m 5) */
    uint8_t enc[64] = {0};
    dev->quantize(q, enc, 4, x, SD_DTYPE_FP32, 6, 4);
    dev->sync(q);
    float s[2];
    memcpy(s, enc, sizeof(s));
    TH_CHECK(s[0] == 7.0f && s[1] == 5.0f, "int4 scales %g %g", s[0], s[1]);
    /* block 2: q = round(x 7 / 5): 0 -> 0, 5 -> 7 */
    const uint8_t want4[3] = {(uint8_t)((7 & 0xf) | ((-7 & 0xf) << 4)),
                              (uint8_t)((3 & 0xf) | ((-1 & 0xf) << 4)), (uint8_t)(0 | (7 << 4))};
    TH_CHECK(memcmp(enc + 8, want4, 3) == 0, "int4 nibbles %02x %02x %02x", enc[8], enc[9],
             enc[10]);
    memset(enc, 0, sizeof(enc));
    dev->quantize(q, enc, 8, x, SD_DTYPE_FP32, 6, 4);
    dev->sync(q);
    const int8_t want8[6] = {127, -127, 54, -18, 0, 127}; /* round(x 127 / 7), round(x 127 / 5) */
    TH_CHECK(memcmp(enc + 8, want8, 6) == 0, "int8 codes %d %d %d %d %d %d", (int8_t)enc[8],
             (int8_t)enc[9], (int8_t)enc[10], (int8_t)enc[11], (int8_t)enc[12], (int8_t)enc[13]);
    float y[6];
    dev->dequantize(q, y, SD_DTYPE_FP32, enc, 8, 6, 4, false);
    dev->sync(q);
    TH_CHECK(y[0] == 7 && y[1] == -7 && y[5] == 5 && y[4] == 0, "int8 decode %g %g %g %g", y[0],
             y[1], y[4], y[5]);
    dev->queue_destroy(q);
}

/* a NaN or an infinity keeps its block non-finite; the other blocks are as usual */
static void check_nonfinite(const struct sd_gpu_ops *dev, int bits)
{
    struct sd_gpu_queue *q;
    dev->queue_create(&q);
    float x[12], y[12];
    for (int i = 0; i < 12; i++)
        x[i] = (float)i - 5.5f;
    x[1] = NAN;
    x[6] = INFINITY;
    uint8_t enc[128];
    dev->quantize(q, enc, bits, x, SD_DTYPE_FP32, 12, 4);
    dev->dequantize(q, y, SD_DTYPE_FP32, enc, bits, 12, 4, false);
    dev->sync(q);
    bool b0 = true, b1 = true, b2 = true;
    for (int i = 0; i < 4; i++)
        b0 = b0 && !isfinite(y[i]);
    for (int i = 4; i < 8; i++)
        b1 = b1 && !isfinite(y[i]);
    for (int i = 8; i < 12; i++)
        b2 = b2 && isfinite(y[i]) && fabsf(y[i] - x[i]) <= 5.5f / (2.0f * ((1 << (bits - 1)) - 1));
    TH_CHECK(b0 && b1, "%s int%d: a block with NaN or inf decoded to finite numbers", dev->name,
             bits);
    TH_CHECK(b2, "%s int%d: a finite block next to non-finite ones", dev->name, bits);
    dev->queue_destroy(q);
}

/* bf16 in (weights) and bf16 out (a gathered slot) */
static void check_bf16(const struct sd_gpu_ops *dev)
{
    struct sd_gpu_queue *q;
    dev->queue_create(&q);
    enum { N = 1000, B = 64 };
    uint16_t w[N], out[N];
    float xf[N];
    for (int i = 0; i < N; i++) {
        w[i] = sd_f32_to_bf16((float)(uniform() * 2 - 1));
        xf[i] = sd_bf16_to_f32(w[i]);
    }
    uint8_t enc[N + 4 * (N / B + 1)];
    dev->quantize(q, enc, 8, w, SD_DTYPE_BF16, N, B);
    dev->dequantize(q, out, SD_DTYPE_BF16, enc, 8, N, B, false);
    dev->sync(q);
    bool ok = true;
    for (int b = 0; b < (N + B - 1) / B; b++) {
        float m = 0;
        for (int i = b * B; i < N && i < (b + 1) * B; i++)
            m = fmaxf(m, fabsf(xf[i]));
        for (int i = b * B; i < N && i < (b + 1) * B; i++) {
            float y = sd_bf16_to_f32(out[i]);
            float ulp = fabsf(y) / 128.0f; /* bf16: 8 bits of mantissa */
            ok = ok && fabsf(y - xf[i]) <= m / 254.0f + ulp;
        }
    }
    TH_CHECK(ok, "%s: bf16 through int8 outside m / 254 + one bf16 ulp", dev->name);
    dev->queue_destroy(q);
}

/* Error feedback (quantize_ef): the encoding is that of y = x + err, bit for bit; x is left
 * alone; and fed the same x for R rounds, the decoded values add up to R x within one rounding
 * step of the block (the error carried, not accumulated), where plain quantization drifts by
 * up to R steps. */
static void check_ef(const struct sd_gpu_ops *dev, int bits, uint32_t B, size_t n)
{
    struct sd_gpu_queue *q = NULL;
    dev->queue_create(&q);
    size_t eb = sd_codec_bytes(bits, n, B);
    float *x = malloc(n * 4), *x0 = malloc(n * 4), *err = calloc(n, 4), *y = malloc(n * 4);
    float *dec = malloc(n * 4);
    double *sum = calloc(n, sizeof(double));
    uint8_t *enc = malloc(eb), *ref = malloc(eb);
    fill(x, n, RANDOM);
    memcpy(x0, x, n * 4);
    bool same = true, kept = true;
    const int R = 50;
    for (int r = 0; r < R; r++) {
        for (size_t i = 0; i < n; i++)
            y[i] = x[i] + err[i];
        dev->quantize(q, ref, bits, y, SD_DTYPE_FP32, n, B);
        dev->quantize_ef(q, enc, bits, x, err, n, B);
        dev->dequantize(q, dec, SD_DTYPE_FP32, enc, bits, n, B, false);
        dev->sync(q);
        same = same && memcmp(enc, ref, eb) == 0;
        for (size_t i = 0; i < n; i++)
            sum[i] += dec[i];
    }
    kept = memcmp(x, x0, n * 4) == 0;
    double amax = 0.0, worst = 0.0;
    for (size_t i = 0; i < n; i++)
        amax = fmax(amax, fabs(x[i]));
    for (size_t i = 0; i < n; i++)
        worst = fmax(worst, fabs(sum[i] - R * (double)x[i]));
    /* |err| <= the step of a block of y, |y| <= |x| + one step */
    double step = amax / (2 * sd_codec_qmax(bits)) * 1.2 + 1e-6;
    TH_CHECK(same, "%s: int%d ef block %u n %zu: the encoding differs from that of x + err",
             dev->name, bits, B, n);
    TH_CHECK(kept, "%s: int%d ef: x was written", dev->name, bits);
    TH_CHECK(worst <= step,
             "%s: int%d ef block %u n %zu: %d rounds drift %.4g from R x (bound %.4g)", dev->name,
             bits, B, n, R, worst, step);
    free(x), free(x0), free(err), free(y), free(dec), free(sum), free(enc), free(ref);
    dev->queue_destroy(q);
}

int main(void)
{
    const struct sd_gpu_ops *devs[] = {&sd_gpu_host_ops, &sd_gpu_host_deferred_ops};
    const uint32_t blocks[] = {32, 256, 7};
    for (int d = 0; d < 2; d++) {
        for (int bits = 4; bits <= 8; bits += 4)
            for (size_t bi = 0; bi < 3; bi++) {
                uint32_t B = blocks[bi];
                size_t lens[] = {1, B - 1, B, B + 1, 3 * B + 5, 1001, 4097};
                for (size_t li = 0; li < sizeof(lens) / sizeof(lens[0]); li++)
                    for (int k = RANDOM; k <= EXTREMES; k++)
                        if (lens[li] > 0)
                            check_one(devs[d], bits, B, lens[li], (enum kind)k);
            }
        check_layout(devs[d]);
        check_nonfinite(devs[d], 8);
        check_nonfinite(devs[d], 4);
        check_bf16(devs[d]);
        for (int bits = 4; bits <= 8; bits += 4) {
            check_ef(devs[d], bits, 32, 1000);
            check_ef(devs[d], bits, 2048, 4097);
            check_ef(devs[d], bits, 7, 1);
        }
    }
    return th_summary("test_codec");
}

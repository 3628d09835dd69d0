/* The host backend's block quantization kernels (the format is in sd/codec.h). Scales and
 * quotients in double, so that the bound m / (2 qmax) holds for every block, denormal ones
 * included; the result is rounded to its dtype once. */
#include "codec_int.h"
#include "sd/codec.h"
#include "sd/dtype.h"
#include "sd/model.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* nearest integer, ties to even, as nearbyint in the default rounding mode: adding and taking
 * away 1.5 * 2^52 leaves the integer part for |t| < 2^51, and vectorizes */
static inline double round_even(double t)
{
    const double magic = 6755399441055744.0;
    return (t + magic) - magic;
}

/* one block of fp32: its scale, and its codes into q[] (clamped to +-qmax) */
static float quantize_f32_block(const float *restrict x, size_t len, int qmax, int8_t *restrict q)
{
    float m = 0.0f;
    int bad = 0;
    for (size_t i = 0; i < len; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
        bad |= !(a <= FLT_MAX); /* NaN or infinity */
    }
    if (bad) {
        bool nan = false;
        for (size_t i = 0; i < len; i++)
            nan = nan || isnan(x[i]);
        memset(q, 0, len);
        return nan ? NAN : INFINITY;
    }
    double inv = m > 0.0f ? (double)qmax / (double)m : 0.0;
    for (size_t i = 0; i < len; i++) {
        double t = round_even((double)x[i] * inv);
        t = t > qmax ? qmax : t < -qmax ? -qmax : t;
        q[i] = (int8_t)t;
    }
    return m;
}

/* the codes of elements [b0, b0 + len) into vals */
static void store_codes(uint8_t *restrict vals, int bits, size_t b0, size_t len,
                        const int8_t *restrict q)
{
    if (bits == SD_CODEC_INT8) {
        memcpy(vals + b0, q, len);
        return;
    }
    for (size_t i = 0; i < len; i++) { /* nibbles: element b0 + i */
        size_t e = b0 + i;
        uint8_t nib = (uint8_t)(q[i] & 0xf);
        if (e & 1)
            vals[e / 2] = (uint8_t)(vals[e / 2] | nib << 4);
        else
            vals[e / 2] = nib;
    }
}

void sd__codec_quantize(void *dst, int bits, const void *src, int src_dtype, size_t n,
                        uint32_t block)
{
    if (src_dtype == SD_DTYPE_FP32 && block <= SD_CODEC_MAX_BLOCK) {
        float *scales = dst;
        uint8_t *vals = (uint8_t *)dst + 4 * sd_codec_blocks(n, block);
        int qmax = sd_codec_qmax(bits);
        int8_t q[SD_CODEC_MAX_BLOCK];
        for (size_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
            size_t len = b0 + block < n ? block : n - b0;
            scales[k] = quantize_f32_block((const float *)src + b0, len, qmax, q);
            store_codes(vals, bits, b0, len, q);
        }
        return;
    }
    float *scales = dst;
    uint8_t *vals = (uint8_t *)dst + 4 * sd_codec_blocks(n, block);
    int qmax = sd_codec_qmax(bits);
    if (bits == SD_CODEC_INT4)
        memset(vals, 0, (n + 1) / 2);
    for (size_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        size_t b1 = b0 + block < n ? b0 + block : n;
        float m = 0.0f;
        bool finite = true;
        for (size_t i = b0; i < b1; i++) {
            float x = sd__load(src, src_dtype, i);
            if (!isfinite(x)) {
                finite = false;
                m = isnan(x) || isnan(m) ? NAN : INFINITY;
                continue;
            }
            if (finite && fabsf(x) > m)
                m = fabsf(x);
        }
        scales[k] = m;
        double inv = finite && m > 0.0f ? (double)qmax / (double)m : 0.0;
        for (size_t i = b0; i < b1; i++) {
            double t = inv == 0.0 ? 0.0 : round_even((double)sd__load(src, src_dtype, i) * inv);
            int q = t > qmax ? qmax : t < -qmax ? -qmax : (int)t;
            if (bits == SD_CODEC_INT8)
                vals[i] = (uint8_t)(int8_t)q;
            else
                vals[i / 2] |= (uint8_t)((q & 0xf) << (4 * (i & 1)));
        }
    }
}

void sd__codec_quantize_ef(void *dst, int bits, const float *x, float *err, size_t n,
                           uint32_t block)
{
    float *scales = dst;
    uint8_t *vals = (uint8_t *)dst + 4 * sd_codec_blocks(n, block);
    int qmax = sd_codec_qmax(bits);
    static _Thread_local float y[SD_CODEC_MAX_BLOCK];
    static _Thread_local int8_t q[SD_CODEC_MAX_BLOCK];
    if (block > SD_CODEC_MAX_BLOCK)
        block = SD_CODEC_MAX_BLOCK; /* callers check; never a stack overrun */
    for (size_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        size_t len = b0 + block < n ? block : n - b0;
        for (size_t i = 0; i < len; i++)
            y[i] = x[b0 + i] + err[b0 + i];
        float m = quantize_f32_block(y, len, qmax, q);
        scales[k] = m;
        store_codes(vals, bits, b0, len, q);
        double f = (double)m / qmax;
        for (size_t i = 0; i < len; i++) /* what the receiver will not see, for next time */
            err[b0 + i] = isfinite(m) ? (float)((double)y[i] - q[i] * f) : 0.0f;
    }
}

void sd__codec_dequantize(void *dst, int dst_dtype, const void *src, int bits, size_t n,
                          uint32_t block, bool accumulate)
{
    const float *scales = src;
    const uint8_t *vals = (const uint8_t *)src + 4 * sd_codec_blocks(n, block);
    int qmax = sd_codec_qmax(bits);
    if (dst_dtype == SD_DTYPE_FP32 && block <= SD_CODEC_MAX_BLOCK) {
        float *d = dst;
        float v[SD_CODEC_MAX_BLOCK];
        for (size_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
            size_t len = b0 + block < n ? block : n - b0;
            float m = scales[k];
            double f = (double)m / qmax;
            if (!isfinite(m)) {
                for (size_t i = 0; i < len; i++)
                    v[i] = m;
            } else if (bits == SD_CODEC_INT8) {
                const int8_t *q = (const int8_t *)vals + b0;
                for (size_t i = 0; i < len; i++)
                    v[i] = (float)(q[i] * f);
            } else {
                for (size_t i = 0; i < len; i++) {
                    size_t e = b0 + i;
                    int nib = (vals[e / 2] >> (4 * (e & 1))) & 0xf;
                    v[i] = (float)(((nib ^ 8) - 8) * f); /* sign-extend the nibble */
                }
            }
            if (accumulate)
                for (size_t i = 0; i < len; i++)
                    d[b0 + i] += v[i];
            else
                memcpy(d + b0, v, len * sizeof(float));
        }
        return;
    }
    for (size_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        size_t b1 = b0 + block < n ? b0 + block : n;
        float m = scales[k];
        double f = (double)m / qmax;
        for (size_t i = b0; i < b1; i++) {
            int q;
            if (bits == SD_CODEC_INT8) {
                q = (int8_t)vals[i];
            } else {
                int nib = (vals[i / 2] >> (4 * (i & 1))) & 0xf;
                q = nib >= 8 ? nib - 16 : nib;
            }
            float v = isfinite(m) ? (float)(q * f) : m; /* non-finite stays non-finite */
            if (accumulate)
                ((float *)dst)[i] += v;
            else
                sd__store(dst, dst_dtype, i, v);
        }
    }
}

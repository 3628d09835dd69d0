/* The kernels of the device backends, one source for CUDA, HIP and the host emulation
 * (compat.h). Each computes what the host backend (gpu/host.c, gpu/codec.c) computes, with the
 * same operations in the same order per element, so that a kernel's result equals the host
 * backend's bit for bit; only the sum of squares adds in another (fixed) order. Kernels are
 * memory-bound: grid-stride loops over elements, 16-byte vector accesses where every pointer is
 * aligned (the result is the same either way), tails handled, no atomics. The launchers and
 * their grid sizes are kern_ops.c's. */
#ifndef SD_KERN_KERNELS_H
#define SD_KERN_KERNELS_H

#include "compat.h"
#include "params.h"

/* ---- dtype conversions, on the bits: round to nearest even, NaN kept NaN (sd/dtype.h) */

SDK_FN float sdk_bf16_f32(uint16_t h)
{
    return sdk_bits_f32((uint32_t)h << 16);
}

SDK_FN uint16_t sdk_f32_bf16(float f)
{
    uint32_t u = sdk_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and NaN */
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

SDK_FN float sdk_fp16_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) /* infinity, or NaN made quiet */
        return sdk_bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0));
    if (e == 0) {
        if (m == 0)
            return sdk_bits_f32(sign);
        e = 113; /* a subnormal: normalize */
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        return sdk_bits_f32(sign | (e << 23) | ((m & 0x3ffu) << 13));
    }
    return sdk_bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

SDK_FN uint16_t sdk_f32_fp16(float f)
{
    uint32_t u = sdk_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: quiet, the payload's top bits kept */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* 65520 and up round to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* normal in fp16: rebias, round the 13 bits dropped */
        a -= 0x38000000u;
        a += 0xfffu + ((a >> 13) & 1u);
        return (uint16_t)(sign | (a >> 13));
    }
    if (a < 0x33000000u) /* at most 2^-25: rounds to zero (2^-25 ties to the even zero) */
        return (uint16_t)sign;
    /* subnormal in fp16: the value in units of 2^-24, rounded to nearest even */
    uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    q += rem > half || (rem == half && (q & 1u));
    return (uint16_t)(sign | q);
}

SDK_FN float sdk_load(const void *src, int dtype, uint64_t i)
{
    if (dtype == SDK_FP32)
        return ((const float *)src)[i];
    if (dtype == SDK_BF16)
        return sdk_bf16_f32(((const uint16_t *)src)[i]);
    return sdk_fp16_f32(((const uint16_t *)src)[i]);
}

SDK_FN void sdk_store(void *dst, int dtype, uint64_t i, float v)
{
    if (dtype == SDK_FP32)
        ((float *)dst)[i] = v;
    else if (dtype == SDK_BF16)
        ((uint16_t *)dst)[i] = sdk_f32_bf16(v);
    else
        ((uint16_t *)dst)[i] = sdk_f32_fp16(v);
}

SDK_FN int sdk_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* the first element of this thread and the grid's stride */
#define SDK_GRID_FIRST  (SDK_BLOCK * SDK_NTHREADS + sdk_t)
#define SDK_GRID_STRIDE (SDK_BLOCKS * SDK_NTHREADS)

/* ---- elementwise */

SDK_KERNEL sdk_k_reduce_add(float *SDK_RESTRICT acc, const void *SDK_RESTRICT src, int dtype,
                            uint64_t n)
{
    SDK_THREADS
    uint64_t i = SDK_GRID_FIRST, head = 0;
    if (dtype == SDK_FP32 && sdk_aligned16(acc) && sdk_aligned16(src)) {
        sdk_f4 *a4 = (sdk_f4 *)acc;
        const sdk_f4 *s4 = (const sdk_f4 *)src;
        for (uint64_t k = i; k < n / 4; k += SDK_GRID_STRIDE) {
            sdk_f4 a = a4[k], s = s4[k];
            a.x += s.x;
            a.y += s.y;
            a.z += s.z;
            a.w += s.w;
            a4[k] = a;
        }
        head = n / 4 * 4;
    }
    for (uint64_t k = head + i; k < n; k += SDK_GRID_STRIDE)
        acc[k] += sdk_load(src, dtype, k);
    SDK_SYNC
}

SDK_KERNEL sdk_k_to_f32(float *SDK_RESTRICT dst, const void *SDK_RESTRICT src, int dtype,
                        uint64_t n)
{
    SDK_THREADS
    for (uint64_t k = SDK_GRID_FIRST; k < n; k += SDK_GRID_STRIDE)
        dst[k] = sdk_load(src, dtype, k);
    SDK_SYNC
}

SDK_KERNEL sdk_k_from_f32(void *SDK_RESTRICT dst, int dtype, const float *SDK_RESTRICT src,
                          uint64_t n)
{
    SDK_THREADS
    for (uint64_t k = SDK_GRID_FIRST; k < n; k += SDK_GRID_STRIDE)
        sdk_store(dst, dtype, k, src[k]);
    SDK_SYNC
}

/* ---- the sum of squares in double: thread t of block b adds elements b T + t + j (B T) in
 * order (B blocks of T threads, B a function of n only), each block combines its threads' sums
 * in a tree, and one block combines the blocks' the same way. */

SDK_FN void sdk_tree(double *s)
{
    for (unsigned w = SDK_THREADS_PER_BLOCK / 2; w > 0; w /= 2) {
        SDK_THREADS
        if (sdk_t < w)
            s[sdk_t] += s[sdk_t + w];
        SDK_SYNC
    }
}

SDK_KERNEL sdk_k_sumsq_part(const float *SDK_RESTRICT x, uint64_t n, double *SDK_RESTRICT part)
{
    SDK_SHARED(double, s, SDK_THREADS_PER_BLOCK);
    SDK_THREADS
    double acc = 0.0;
    for (uint64_t k = SDK_GRID_FIRST; k < n; k += SDK_GRID_STRIDE)
        acc += (double)x[k] * (double)x[k];
    s[sdk_t] = acc;
    SDK_SYNC
    sdk_tree(s);
    SDK_THREADS
    if (sdk_t == 0)
        part[SDK_BLOCK] = s[0];
    SDK_SYNC
}

SDK_KERNEL sdk_k_sumsq_final(const double *SDK_RESTRICT part, uint32_t parts,
                             double *SDK_RESTRICT out)
{
    SDK_SHARED(double, s, SDK_THREADS_PER_BLOCK);
    SDK_THREADS
    double acc = 0.0;
    for (uint32_t k = sdk_t; k < parts; k += SDK_NTHREADS)
        acc += part[k];
    s[sdk_t] = acc;
    SDK_SYNC
    sdk_tree(s);
    SDK_THREADS
    if (sdk_t == 0)
        *out = s[0];
    SDK_SYNC
}

/* ---- optimizers: host.c's adamw_elem and host_sgd, element by element (AdamW and Adam: l2;
 * SGD with or without Nesterov momentum: nest) */

struct sdk_adamw_out {
    float p, m, v;
};

SDK_FN struct sdk_adamw_out sdk_adamw_elem(const struct sdk_adamw_c *c, float master, float m,
                                           float v, float g)
{
    struct sdk_adamw_out o;
    g = g + c->l2 * master; /* Adam's weight decay (0 for AdamW's: g exactly) */
    float p = master * c->decay;
    float mi = c->b1 * m + c->omb1 * g;
    float vi = c->b2 * v + c->omb2 * g * g;
    float denom = sqrtf(vi) / c->sqrt_bc2 + c->eps;
    o.p = p - c->step_size * (mi / denom);
    o.m = mi;
    o.v = vi;
    return o;
}

SDK_KERNEL sdk_k_adamw(struct sdk_adamw_c c, float *SDK_RESTRICT master, float *SDK_RESTRICT m,
                       float *SDK_RESTRICT v, float *SDK_RESTRICT grad, float scale,
                       void *SDK_RESTRICT w, int w_dtype, uint64_t n)
{
    SDK_THREADS
    uint64_t head = 0;
    if (w_dtype == SDK_FP32 && sdk_aligned16(master) && sdk_aligned16(m) && sdk_aligned16(v) &&
        sdk_aligned16(grad) && sdk_aligned16(w)) {
        sdk_f4 *p4 = (sdk_f4 *)master, *m4 = (sdk_f4 *)m, *v4 = (sdk_f4 *)v, *g4 = (sdk_f4 *)grad,
               *w4 = (sdk_f4 *)w;
        const sdk_f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint64_t k = SDK_GRID_FIRST; k < n / 4; k += SDK_GRID_STRIDE) {
            sdk_f4 p = p4[k], mm = m4[k], vv = v4[k], g = g4[k];
            struct sdk_adamw_out o0 = sdk_adamw_elem(&c, p.x, mm.x, vv.x, g.x * scale);
            struct sdk_adamw_out o1 = sdk_adamw_elem(&c, p.y, mm.y, vv.y, g.y * scale);
            struct sdk_adamw_out o2 = sdk_adamw_elem(&c, p.z, mm.z, vv.z, g.z * scale);
            struct sdk_adamw_out o3 = sdk_adamw_elem(&c, p.w, mm.w, vv.w, g.w * scale);
            p.x = o0.p, p.y = o1.p, p.z = o2.p, p.w = o3.p;
            mm.x = o0.m, mm.y = o1.m, mm.z = o2.m, mm.w = o3.m;
            vv.x = o0.v, vv.y = o1.v, vv.z = o2.v, vv.w = o3.v;
            p4[k] = p;
            w4[k] = p;
            m4[k] = mm;
            v4[k] = vv;
            g4[k] = zero;
        }
        head = n / 4 * 4;
    }
    for (uint64_t k = head + SDK_GRID_FIRST; k < n; k += SDK_GRID_STRIDE) {
        struct sdk_adamw_out o = sdk_adamw_elem(&c, master[k], m[k], v[k], grad[k] * scale);
        master[k] = o.p;
        m[k] = o.m;
        v[k] = o.v;
        sdk_store(w, w_dtype, k, o.p);
        grad[k] = 0.0f;
    }
    SDK_SYNC
}

SDK_KERNEL sdk_k_sgd(struct sdk_sgd_c c, float *SDK_RESTRICT master, float *SDK_RESTRICT buf,
                     float *SDK_RESTRICT grad, float scale, void *SDK_RESTRICT w, int w_dtype,
                     uint64_t n)
{
    SDK_THREADS
    for (uint64_t k = SDK_GRID_FIRST; k < n; k += SDK_GRID_STRIDE) {
        float p = master[k];
        float g = grad[k] * scale;
        g = g + c.wd * p;
        float b = c.mu * buf[k] + g;
        p = p - c.lr * (c.nest != 0.0f ? g + c.mu * b : b);
        buf[k] = b;
        master[k] = p;
        sdk_store(w, w_dtype, k, p);
        grad[k] = 0.0f;
    }
    SDK_SYNC
}

/* ---- block codecs (sd/codec.h), as gpu/codec.c encodes: first each block's scale (its
 * largest magnitude; NaN if it holds a NaN, else infinity if it holds an infinity), then every
 * element's code from its block's scale, a thread per byte of codes, so no two threads write
 * one byte. With err (error feedback), the value encoded is y = x + err, and err becomes what
 * the decoder will not see. */

SDK_FN float sdk_value(const void *src, int dtype, const float *err, uint64_t i)
{
    float x = sdk_load(src, dtype, i);
    return err != 0 ? x + err[i] : x;
}

/* one codec block per 32 threads (a warp on NVIDIA GPUs), 8 blocks per round of a CTA: the
 * threads read the block's elements coalesced, and combine their largest magnitudes in a tree
 * (a maximum is exact in any order) with their NaN and infinity flags */
#define SDK_GROUP  32
#define SDK_GROUPS (SDK_THREADS_PER_BLOCK / SDK_GROUP)

SDK_KERNEL sdk_k_scales(float *SDK_RESTRICT scales, const void *SDK_RESTRICT src, int dtype,
                        const float *SDK_RESTRICT err, uint64_t n, uint32_t block)
{
    SDK_SHARED(float, smax, SDK_THREADS_PER_BLOCK);
    SDK_SHARED(int, sflags, SDK_THREADS_PER_BLOCK); /* 1: a NaN, 2: an infinity */
    const uint64_t blocks = (n + block - 1) / block;
    for (uint64_t base = SDK_BLOCK * SDK_GROUPS; base < blocks; base += SDK_BLOCKS * SDK_GROUPS) {
        SDK_THREADS
        uint64_t b = base + sdk_t / SDK_GROUP;
        float mx = 0.0f;
        int flags = 0;
        if (b < blocks) {
            uint64_t i0 = b * block, i1 = i0 + block < n ? i0 + block : n;
            for (uint64_t i = i0 + sdk_t % SDK_GROUP; i < i1; i += SDK_GROUP) {
                float a = fabsf(sdk_value(src, dtype, err, i));
                flags |= (a != a) | (a == sdk_bits_f32(0x7f800000u)) << 1;
                mx = a > mx ? a : mx;
            }
        }
        smax[sdk_t] = mx;
        sflags[sdk_t] = flags;
        SDK_SYNC
        for (unsigned w = SDK_GROUP / 2; w > 0; w /= 2) {
            SDK_THREADS
            if (sdk_t % SDK_GROUP < w) {
                smax[sdk_t] = smax[sdk_t + w] > smax[sdk_t] ? smax[sdk_t + w] : smax[sdk_t];
                sflags[sdk_t] |= sflags[sdk_t + w];
            }
            SDK_SYNC
        }
        SDK_THREADS
        uint64_t b = base + sdk_t / SDK_GROUP;
        if (sdk_t % SDK_GROUP == 0 && b < blocks)
            scales[b] = sflags[sdk_t] & 1   ? sdk_bits_f32(0x7fc00000u)
                        : sflags[sdk_t] & 2 ? sdk_bits_f32(0x7f800000u)
                                            : smax[sdk_t];
        SDK_SYNC
    }
}

/* one element's code: round(y qmax / m) to nearest even, clamped; 0 where m is 0 or not finite */
SDK_FN int sdk_code(float y, float m, int qmax)
{
    const double magic = 6755399441055744.0; /* 1.5 * 2^52: codec.c's round_even */
    int finite = m - m == 0.0f;
    double inv = finite && m > 0.0f ? (double)qmax / (double)m : 0.0;
    if (inv == 0.0)
        return 0;
    double t = ((double)y * inv + magic) - magic;
    return t > qmax ? qmax : t < -qmax ? -qmax : (int)t;
}

SDK_FN int sdk_encode_elem(const float *scales, const void *src, int dtype, float *err, uint64_t i,
                           uint32_t block, int qmax)
{
    float y = sdk_value(src, dtype, err, i), m = scales[i / block];
    int q = sdk_code(y, m, qmax);
    if (err != 0)
        err[i] = m - m == 0.0f ? (float)((double)y - (double)q * ((double)m / qmax)) : 0.0f;
    return q;
}

SDK_KERNEL sdk_k_encode(uint8_t *SDK_RESTRICT vals, int bits, const float *SDK_RESTRICT scales,
                        const void *SDK_RESTRICT src, int dtype, float *SDK_RESTRICT err,
                        uint64_t n, uint32_t block)
{
    SDK_THREADS
    int qmax = (1 << (bits - 1)) - 1;
    uint64_t bytes = bits == 8 ? n : (n + 1) / 2;
    for (uint64_t k = SDK_GRID_FIRST; k < bytes; k += SDK_GRID_STRIDE) {
        if (bits == 8) {
            vals[k] = (uint8_t)(int8_t)sdk_encode_elem(scales, src, dtype, err, k, block, qmax);
            continue;
        }
        int lo = sdk_encode_elem(scales, src, dtype, err, 2 * k, block, qmax);
        int hi =
            2 * k + 1 < n ? sdk_encode_elem(scales, src, dtype, err, 2 * k + 1, block, qmax) : 0;
        vals[k] = (uint8_t)((lo & 0xf) | (hi & 0xf) << 4);
    }
    SDK_SYNC
}

SDK_KERNEL sdk_k_decode(void *SDK_RESTRICT dst, int dtype, const float *SDK_RESTRICT scales,
                        const uint8_t *SDK_RESTRICT vals, int bits, uint64_t n, uint32_t block,
                        int accumulate)
{
    SDK_THREADS
    int qmax = (1 << (bits - 1)) - 1;
    for (uint64_t k = SDK_GRID_FIRST; k < n; k += SDK_GRID_STRIDE) {
        float m = scales[k / block];
        int q = bits == 8 ? (int)(int8_t)vals[k] : (((vals[k / 2] >> (4 * (k & 1))) & 0xf) ^ 8) - 8;
        float v = m - m == 0.0f ? (float)(q * ((double)m / qmax)) : m;
        if (accumulate)
            ((float *)dst)[k] += v;
        else
            sdk_store(dst, dtype, k, v);
    }
    SDK_SYNC
}

/* ---- copies: several pieces in one launch (a unit's shards gathered into its slot: one launch
 * instead of a copy per shard, whose gaps cost more than the copies on a fast GPU). Block b copies
 * piece b / blocks_per, 16 bytes at a time where both ends are aligned, 4 where they allow, else
 * bytes; the bits move unchanged (integer loads and stores). */

SDK_KERNEL sdk_k_gather(struct sdk_pieces p)
{
    SDK_THREADS
    uint64_t piece = SDK_BLOCK / p.blocks_per;
    if (piece < p.n) {
        uint8_t *d = (uint8_t *)(uintptr_t)p.dst[piece];
        const uint8_t *s = (const uint8_t *)(uintptr_t)p.src[piece];
        uint64_t n = p.bytes[piece], head = 0;
        uint64_t t = (SDK_BLOCK % p.blocks_per) * SDK_NTHREADS + sdk_t;
        uint64_t stride = p.blocks_per * SDK_NTHREADS;
        uintptr_t both = (uintptr_t)d | (uintptr_t)s;
        if ((both & 15u) == 0) {
            for (uint64_t k = t; k < n / 16; k += stride)
                ((sdk_u4 *)d)[k] = ((const sdk_u4 *)s)[k];
            head = n / 16 * 16;
        } else if ((both & 3u) == 0) {
            for (uint64_t k = t; k < n / 4; k += stride)
                ((uint32_t *)d)[k] = ((const uint32_t *)s)[k];
            head = n / 4 * 4;
        }
        for (uint64_t k = head + t; k < n; k += stride)
            d[k] = s[k];
    }
    SDK_SYNC
}

#endif

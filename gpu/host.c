/* The host backend: shard buffers in host memory. Shared buffers are memfds of mode 0600 sealed
 * against shrinking and growing, so a client that maps one cannot fault the daemon by
 * truncating it; those handed out read-only (the gather pool) are also sealed against any write
 * after the daemon's own mapping (F_SEAL_FUTURE_WRITE: no writable mmap, mprotect, write(),
 * reopen for writing or hole punching).
 * Every buffer is backed and mapped up front (fallocate, MAP_POPULATE): memory that is not there
 * fails the allocation with ENOMEM instead of a SIGBUS later, and the first pushes and gathers
 * into a buffer do not pay its page faults (64 MiB of first touches took up to 0.6 s on a busy
 * 2-core host). */
#include "sd/gpu.h"
#include "codec_int.h"
#include "host_int.h"
#include "kern_ops.h"
#include "sd/codec.h"
#include "sd/dtype.h"
#include "sd/log.h"
#include "sd/model.h"
#include "sd/status.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* one device, host memory: device is 0 (the daemon places nothing elsewhere) */
int sd__host_alloc(int device, size_t bytes, int flags, const char *tag, struct sd_mem *mem_p)
{
    (void)device;
    int status;
    size_t len = bytes ? bytes : 1;
    int fd = -1;
    void *ptr;

    if (flags & SD_MEM_SHARED) {
        fd = memfd_create(tag, MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0) {
            status = -errno;
            SD_ERROR("host", "memfd_create(%s): %s", tag, strerror(errno));
            return status;
        }
        if (fchmod(fd, 0600) != 0) { /* memfds are created 0777: /proc/<pid>/fd reopens */
            status = -errno;
            SD_ERROR("host", "fchmod 0600 %s: %s", tag, strerror(errno));
            goto err_close_fd;
        }
        if (ftruncate(fd, (off_t)len) != 0) {
            status = -errno;
            SD_ERROR("host", "ftruncate(%s, %zu): %s", tag, len, strerror(errno));
            goto err_close_fd;
        }
        int e = posix_fallocate(fd, 0, (off_t)len);
        if (e != 0) {
            status = e == ENOSPC || e == ENOMEM ? SD_ENOMEM : -e;
            SD_ERROR("host", "backing %zu bytes for %s: %s", len, tag, strerror(e));
            goto err_close_fd;
        }
        ptr = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL |
                    (flags & SD_MEM_CLIENT_RO ? F_SEAL_FUTURE_WRITE : 0);
        if (ptr != MAP_FAILED && fcntl(fd, F_ADD_SEALS, seals) != 0) {
            status = -errno;
            SD_ERROR("host", "sealing %s: %s", tag, strerror(errno));
            munmap(ptr, len);
            goto err_close_fd;
        }
    } else {
        ptr = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    }
    if (ptr == MAP_FAILED) {
        status = errno == ENOMEM ? SD_ENOMEM : -errno;
        SD_ERROR("host", "mmap %zu bytes for %s: %s", len, tag, strerror(errno));
        goto err_close_fd;
    }
    mem_p->ptr = ptr;
    mem_p->bytes = bytes;
    mem_p->fd = fd;
    mem_p->device = 0;
    return SD_OK;

err_close_fd:
    if (fd >= 0)
        close(fd);
    return status;
}

void sd__host_free(struct sd_mem *mem)
{
    if (mem->ptr != NULL)
        munmap(mem->ptr, mem->bytes ? mem->bytes : 1);
    if (mem->fd >= 0)
        close(mem->fd);
    mem->ptr = NULL;
    mem->fd = -1;
    mem->bytes = 0;
}

void sd__mem_count(uint64_t *used, uint64_t *peak, int64_t bytes)
{
    uint64_t now = __atomic_add_fetch(used, (uint64_t)bytes, __ATOMIC_RELAXED);
    uint64_t was = __atomic_load_n(peak, __ATOMIC_RELAXED);
    while (now > was &&
           !__atomic_compare_exchange_n(peak, &was, now, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        ;
}

uint64_t sd__host_memory_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
}

int sd__host_pinned_alloc(size_t bytes, void **p_p)
{
    void *p = NULL;
    int e = posix_memalign(&p, 4096, bytes ? bytes : 1);
    if (e != 0)
        return SD_ENOMEM;
    *p_p = p;
    return SD_OK;
}

void sd__host_pinned_free(void *p)
{
    free(p);
}

void sd__host_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes)
{
    (void)q;
    memcpy(dst, src, bytes);
}

void sd__host_zero(struct sd_gpu_queue *q, void *dst, size_t bytes)
{
    (void)q;
    memset(dst, 0, bytes);
}

static void host_reduce_add(struct sd_gpu_queue *q, float *restrict acc, const void *restrict src,
                            int dtype, size_t n)
{
    (void)q;
    if (dtype == SD_DTYPE_FP32) {
        const float *s = src;
        for (size_t i = 0; i < n; i++)
            acc[i] += s[i];
    } else if (dtype == SD_DTYPE_BF16) {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            acc[i] += sd_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            acc[i] += sd_fp16_to_f32(s[i]);
    }
}

static void host_to_f32(struct sd_gpu_queue *q, float *restrict dst, const void *restrict src,
                        int dtype, size_t n)
{
    (void)q;
    if (dtype == SD_DTYPE_FP32) {
        memcpy(dst, src, n * sizeof(float));
    } else if (dtype == SD_DTYPE_BF16) {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = sd_bf16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = sd_fp16_to_f32(s[i]);
    }
}

static void host_from_f32(struct sd_gpu_queue *q, void *restrict dst, int dtype,
                          const float *restrict src, size_t n)
{
    (void)q;
    if (dtype == SD_DTYPE_FP32) {
        memcpy(dst, src, n * sizeof(float));
    } else if (dtype == SD_DTYPE_BF16) {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = sd_f32_to_bf16(src[i]);
    } else {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = sd_f32_to_fp16(src[i]);
    }
}

/* Eight partial sums in a fixed order, combined pairwise: one chain of dependent double
 * additions ran at the adder's latency (30% of a 64M-parameter step, longer than reading the
 * data). The association is fixed, so the result does not depend on anything but x. */
#define SUMSQ_LANES 8
static double sum_sq_lanes(const float *restrict x, size_t n)
{
    double s[SUMSQ_LANES] = {0.0};
    size_t i = 0;
    for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES)
        for (size_t j = 0; j < SUMSQ_LANES; j++)
            s[j] += (double)x[i + j] * (double)x[i + j];
    for (size_t j = 0; i < n; i++, j++)
        s[j] += (double)x[i] * (double)x[i];
    for (size_t w = SUMSQ_LANES / 2; w > 0; w /= 2)
        for (size_t j = 0; j < w; j++)
            s[j] += s[j + w];
    return s[0];
}

/* Write the updated master weight into w in its dtype. */
static inline void store_w(void *w, int dtype, size_t i, float p)
{
    sd__store(w, dtype, i, p);
}

/* AdamW as torch.optim.AdamW computes it (decoupled decay, bias correction), with the constants
 * of sdk_adamw_consts (kern_ops.c, the device kernels' too). The expression order is part of the
 * fidelity contract: client/examples/mlp_train.c's reference repeats it, and the device kernels
 * (kern/kernels.h) are tested against this one. */
struct adamw_out {
    float p, m, v;
};

/* One element: the new master weight and moments. */
static inline struct adamw_out adamw_elem(const struct sdk_adamw_c *c, float master, float m,
                                          float v, float g)
{
    g = g + c->l2 * master; /* Adam's weight decay (0 for AdamW's: g exactly) */
    float p = master * c->decay;
    float mi = c->b1 * m + c->omb1 * g;
    float vi = c->b2 * v + c->omb2 * g * g;
    float denom = sqrtf(vi) / c->sqrt_bc2 + c->eps;
    return (struct adamw_out){.p = p - c->step_size * (mi / denom), .m = mi, .v = vi};
}

static void host_adamw(struct sd_gpu_queue *q, const struct sd_adamw_args *a,
                       float *restrict master, float *restrict m, float *restrict v,
                       float *restrict grad, float scale, void *restrict w, int w_dtype, size_t n)
{
    (void)q;
    const struct sdk_adamw_c c = sdk_adamw_consts(a);
    if (w_dtype == SD_DTYPE_FP32) { /* the common case, kept branch-free for vectorization */
        float *restrict wf = w;
        for (size_t i = 0; i < n; i++) {
            struct adamw_out o = adamw_elem(&c, master[i], m[i], v[i], grad[i] * scale);
            master[i] = wf[i] = o.p;
            m[i] = o.m;
            v[i] = o.v;
            grad[i] = 0.0f;
        }
        return;
    }
    for (size_t i = 0; i < n; i++) {
        struct adamw_out o = adamw_elem(&c, master[i], m[i], v[i], grad[i] * scale);
        master[i] = o.p;
        m[i] = o.m;
        v[i] = o.v;
        store_w(w, w_dtype, i, o.p);
        grad[i] = 0.0f;
    }
}

/* SGD with momentum (dampening 0; Nesterov's with nesterov) as torch.optim.SGD computes it; the
 * momentum buffer starts at zero, which equals torch's "first step copies the gradient". */
static void host_sgd(struct sd_gpu_queue *q, const struct sd_sgd_args *a, float *restrict master,
                     float *restrict buf, float *restrict grad, float scale, void *restrict w,
                     int w_dtype, size_t n)
{
    (void)q;
    const float lr = a->lr, mu = a->momentum, wd = a->weight_decay;
    const bool nest = a->nesterov;
    for (size_t i = 0; i < n; i++) {
        float p = master[i];
        float g = grad[i] * scale;
        g = g + wd * p;
        float b = mu * buf[i] + g;
        p = p - lr * (nest ? g + mu * b : b);
        buf[i] = b;
        master[i] = p;
        store_w(w, w_dtype, i, p);
        grad[i] = 0.0f;
    }
}

static void host_sum_sq(struct sd_gpu_queue *q, const float *x, size_t n, double *out)
{
    (void)q;
    *out = sum_sq_lanes(x, n);
}

/* ---- queues: the host backend's work is done when the call returns */

struct sd_gpu_queue {
    uint64_t recorded;
    /* host-deferred: the kernels waiting to run, in order */
    struct deferred_op *ops;
    uint32_t n_ops, cap_ops;
    uint64_t flushes;
    uint64_t lagged; /* host-deferred: the newest ticket a query answered "not yet" */
};

static int host_queue_create(struct sd_gpu_queue **q_p)
{
    struct sd_gpu_queue *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return SD_ENOMEM;
    *q_p = q;
    return SD_OK;
}

static void host_queue_destroy(struct sd_gpu_queue *q)
{
    free(q);
}

int sd__host_sync(struct sd_gpu_queue *q)
{
    (void)q;
    return SD_OK;
}

static int host_record(struct sd_gpu_queue *q, uint64_t *ticket_p)
{
    *ticket_p = ++q->recorded;
    return SD_OK;
}

static int host_query(struct sd_gpu_queue *q, uint64_t ticket)
{
    return ticket <= q->recorded ? SD_OK : SD_EINVAL;
}

static void host_quantize(struct sd_gpu_queue *q, void *dst, int bits, const void *src,
                          int src_dtype, size_t n, uint32_t block)
{
    (void)q;
    sd__codec_quantize(dst, bits, src, src_dtype, n, block);
}

static void host_dequantize(struct sd_gpu_queue *q, void *dst, int dst_dtype, const void *src,
                            int bits, size_t n, uint32_t block, bool accumulate)
{
    (void)q;
    sd__codec_dequantize(dst, dst_dtype, src, bits, n, block, accumulate);
}

static void host_quantize_ef(struct sd_gpu_queue *q, void *dst, int bits, const float *x,
                             float *err, size_t n, uint32_t block)
{
    (void)q;
    sd__codec_quantize_ef(dst, bits, x, err, n, block);
}

const struct sd_gpu_ops sd_gpu_host_ops = {
    .name = "host",
    .client_memory = "host",
    .client_memfds = true,
    .host_memory = true,
    .host_visible = true,
    .alloc = sd__host_alloc,
    .free = sd__host_free,
    .queue_create = host_queue_create,
    .queue_destroy = host_queue_destroy,
    .sync = sd__host_sync,
    .record = host_record,
    .query = host_query,
    .copy = sd__host_copy,
    .zero = sd__host_zero,
    .reduce_add = host_reduce_add,
    .to_f32 = host_to_f32,
    .from_f32 = host_from_f32,
    .sum_sq = host_sum_sq,
    .adamw = host_adamw,
    .sgd = host_sgd,
    .quantize = host_quantize,
    .dequantize = host_dequantize,
    .quantize_ef = host_quantize_ef,
};

/* ---- host-deferred: the same kernels, run only when the queue is waited for (or full), as a
 * GPU stream may run them any time before. The kernels are kept in a ring sized when the queue
 * is created, so enqueueing allocates nothing. */

enum deferred_kind {
    D_COPY,
    D_ZERO,
    D_REDUCE,
    D_TO_F32,
    D_FROM_F32,
    D_SUM_SQ,
    D_ADAMW,
    D_SGD,
    D_QUANT,
    D_QUANT_EF,
    D_DEQUANT
};

struct deferred_op {
    enum deferred_kind kind;
    void *dst;
    const void *src;
    size_t n;
    int dtype;
    float scale;
    float *a, *b, *c, *d; /* adamw: master, m, v, grad; sgd: master, buf, grad */
    struct sd_adamw_args adamw;
    struct sd_sgd_args sgd;
    int bits;
    uint32_t block;
    bool accumulate;
};

#define DEFERRED_OPS 4096

static void deferred_flush(struct sd_gpu_queue *q)
{
    for (uint32_t i = 0; i < q->n_ops; i++) {
        struct deferred_op *o = &q->ops[i];
        switch (o->kind) {
        case D_COPY:
            sd__host_copy(q, o->dst, o->src, o->n);
            break;
        case D_ZERO:
            sd__host_zero(q, o->dst, o->n);
            break;
        case D_REDUCE:
            host_reduce_add(q, o->dst, o->src, o->dtype, o->n);
            break;
        case D_TO_F32:
            host_to_f32(q, o->dst, o->src, o->dtype, o->n);
            break;
        case D_FROM_F32:
            host_from_f32(q, o->dst, o->dtype, o->src, o->n);
            break;
        case D_SUM_SQ:
            *(double *)o->dst = sum_sq_lanes(o->src, o->n);
            break;
        case D_ADAMW:
            host_adamw(q, &o->adamw, o->a, o->b, o->c, o->d, o->scale, o->dst, o->dtype, o->n);
            break;
        case D_SGD:
            host_sgd(q, &o->sgd, o->a, o->b, o->d, o->scale, o->dst, o->dtype, o->n);
            break;
        case D_QUANT:
            sd__codec_quantize(o->dst, o->bits, o->src, o->dtype, o->n, o->block);
            break;
        case D_QUANT_EF:
            sd__codec_quantize_ef(o->dst, o->bits, o->src, o->a, o->n, o->block);
            break;
        case D_DEQUANT:
            sd__codec_dequantize(o->dst, o->dtype, o->src, o->bits, o->n, o->block, o->accumulate);
            break;
        }
    }
    q->n_ops = 0;
    q->flushes++;
}

static struct deferred_op *deferred_push(struct sd_gpu_queue *q, enum deferred_kind kind)
{
    if (q->n_ops == q->cap_ops)
        deferred_flush(q);
    struct deferred_op *o = &q->ops[q->n_ops++];
    memset(o, 0, sizeof(*o));
    o->kind = kind;
    return o;
}

static int deferred_queue_create(struct sd_gpu_queue **q_p)
{
    struct sd_gpu_queue *q = calloc(1, sizeof(*q));
    struct deferred_op *ops = calloc(DEFERRED_OPS, sizeof(*ops));
    if (q == NULL || ops == NULL) {
        free(q);
        free(ops);
        return SD_ENOMEM;
    }
    q->ops = ops;
    q->cap_ops = DEFERRED_OPS;
    *q_p = q;
    return SD_OK;
}

static void deferred_queue_destroy(struct sd_gpu_queue *q)
{
    if (q == NULL)
        return;
    deferred_flush(q);
    free(q->ops);
    free(q);
}

static int deferred_sync(struct sd_gpu_queue *q)
{
    deferred_flush(q);
    return SD_OK;
}

/* Every ticket is reached once its queue ran, as a device's: the first query of a ticket newer
 * than any asked before answers "not yet" (a device still at work, so that the daemon's paths
 * that wait without blocking are taken), the next runs the queue. Older tickets are not held
 * back again: several waiters polling in turn always get there. */
static int deferred_query(struct sd_gpu_queue *q, uint64_t ticket)
{
    if (ticket > q->lagged) {
        q->lagged = ticket;
        return SD_EAGAIN;
    }
    deferred_flush(q);
    return host_query(q, ticket);
}

/* an elementwise kernel (or a sum of squares into *dst) of n elements, kept for later */
static void deferred_enqueue(struct sd_gpu_queue *q, enum deferred_kind kind, void *dst,
                             const void *src, int dtype, size_t n)
{
    struct deferred_op *o = deferred_push(q, kind);
    o->dst = dst;
    o->src = src;
    o->dtype = dtype;
    o->n = n;
}

static void deferred_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes)
{
    deferred_enqueue(q, D_COPY, dst, src, 0, bytes);
}

static void deferred_zero(struct sd_gpu_queue *q, void *dst, size_t bytes)
{
    deferred_enqueue(q, D_ZERO, dst, NULL, 0, bytes);
}

static void deferred_reduce_add(struct sd_gpu_queue *q, float *acc, const void *src, int dtype,
                                size_t n)
{
    deferred_enqueue(q, D_REDUCE, acc, src, dtype, n);
}

static void deferred_to_f32(struct sd_gpu_queue *q, float *dst, const void *src, int dtype,
                            size_t n)
{
    deferred_enqueue(q, D_TO_F32, dst, src, dtype, n);
}

static void deferred_from_f32(struct sd_gpu_queue *q, void *dst, int dtype, const float *src,
                              size_t n)
{
    deferred_enqueue(q, D_FROM_F32, dst, src, dtype, n);
}

static void deferred_sum_sq(struct sd_gpu_queue *q, const float *x, size_t n, double *out)
{
    deferred_enqueue(q, D_SUM_SQ, out, x, 0, n);
}

static void deferred_adamw(struct sd_gpu_queue *q, const struct sd_adamw_args *a, float *master,
                           float *m, float *v, float *grad, float scale, void *w, int w_dtype,
                           size_t n)
{
    struct deferred_op *o = deferred_push(q, D_ADAMW);
    o->adamw = *a;
    o->a = master;
    o->b = m;
    o->c = v;
    o->d = grad;
    o->scale = scale;
    o->dst = w;
    o->dtype = w_dtype;
    o->n = n;
}

static void deferred_sgd(struct sd_gpu_queue *q, const struct sd_sgd_args *a, float *master,
                         float *buf, float *grad, float scale, void *w, int w_dtype, size_t n)
{
    struct deferred_op *o = deferred_push(q, D_SGD);
    o->sgd = *a;
    o->a = master;
    o->b = buf;
    o->d = grad;
    o->scale = scale;
    o->dst = w;
    o->dtype = w_dtype;
    o->n = n;
}

static void deferred_quantize(struct sd_gpu_queue *q, void *dst, int bits, const void *src,
                              int src_dtype, size_t n, uint32_t block)
{
    struct deferred_op *o = deferred_push(q, D_QUANT);
    *o = (struct deferred_op){.kind = D_QUANT,
                              .dst = dst,
                              .src = src,
                              .n = n,
                              .dtype = src_dtype,
                              .bits = bits,
                              .block = block};
}

static void deferred_dequantize(struct sd_gpu_queue *q, void *dst, int dst_dtype, const void *src,
                                int bits, size_t n, uint32_t block, bool accumulate)
{
    struct deferred_op *o = deferred_push(q, D_DEQUANT);
    *o = (struct deferred_op){.kind = D_DEQUANT,
                              .dst = dst,
                              .src = src,
                              .n = n,
                              .dtype = dst_dtype,
                              .bits = bits,
                              .block = block,
                              .accumulate = accumulate};
}

static void deferred_quantize_ef(struct sd_gpu_queue *q, void *dst, int bits, const float *x,
                                 float *err, size_t n, uint32_t block)
{
    struct deferred_op *o = deferred_push(q, D_QUANT_EF);
    *o = (struct deferred_op){
        .kind = D_QUANT_EF, .dst = dst, .src = x, .a = err, .n = n, .bits = bits, .block = block};
}

const struct sd_gpu_ops sd_gpu_host_deferred_ops = {
    .name = "host-deferred",
    .client_memory = "host",
    .client_memfds = true,
    .host_memory = true,
    .host_visible = true,
    .alloc = sd__host_alloc,
    .free = sd__host_free,
    .queue_create = deferred_queue_create,
    .queue_destroy = deferred_queue_destroy,
    .sync = deferred_sync,
    .record = host_record,
    .query = deferred_query,
    .copy = deferred_copy,
    .zero = deferred_zero,
    .reduce_add = deferred_reduce_add,
    .to_f32 = deferred_to_f32,
    .from_f32 = deferred_from_f32,
    .sum_sq = deferred_sum_sq,
    .adamw = deferred_adamw,
    .sgd = deferred_sgd,
    .quantize = deferred_quantize,
    .dequantize = deferred_dequantize,
    .quantize_ef = deferred_quantize_ef,
};

/* every backend built into this binary, by name */
static const struct sd_gpu_ops *const backends[] = {
    &sd_gpu_host_ops,       &sd_gpu_host_deferred_ops, &sd_gpu_emu_ops,
    &sd_gpu_emu_device_ops, &sd_gpu_emu_gpu_ops,       &sd_gpu_emu_gpu_deferred_ops,
#ifdef SHARD_HAVE_CUDA
    &sd_gpu_cuda_ops,
#endif
#ifdef SHARD_HAVE_HIP
    &sd_gpu_hip_ops,
#endif
};

void sd_gpu_copy_many(const struct sd_gpu_ops *dev, struct sd_gpu_queue *q,
                      const struct sd_gpu_piece *pieces, uint32_t n)
{
    if (dev->copy_many != NULL) {
        dev->copy_many(q, pieces, n);
        return;
    }
    for (uint32_t i = 0; i < n; i++)
        dev->copy(q, pieces[i].dst, pieces[i].src, pieces[i].bytes);
}

static int codec_dtype(int codec)
{
    return codec == SD_CODEC_FP16 ? SD_DTYPE_FP16 : SD_DTYPE_BF16;
}

void sd_gpu_encode(const struct sd_gpu_ops *dev, struct sd_gpu_queue *q, void *dst, int codec,
                   const float *src, size_t n, uint32_t block)
{
    if (sd_codec_is_float(codec))
        dev->from_f32(q, dst, codec_dtype(codec), src, n);
    else
        dev->quantize(q, dst, codec, src, SD_DTYPE_FP32, n, block);
}

void sd_gpu_decode(const struct sd_gpu_ops *dev, struct sd_gpu_queue *q, float *dst,
                   const void *src, int codec, size_t n, uint32_t block, bool accumulate)
{
    if (!sd_codec_is_float(codec))
        dev->dequantize(q, dst, SD_DTYPE_FP32, src, codec, n, block, accumulate);
    else if (accumulate)
        dev->reduce_add(q, dst, src, codec_dtype(codec), n);
    else
        dev->to_f32(q, dst, src, codec_dtype(codec), n);
}

void sd_gpu_uuid_format(char *out, size_t len, const uint8_t b[16])
{
    snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

const struct sd_gpu_ops *sd_gpu_find(const char *name)
{
    for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]); i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    return NULL;
}

size_t sd_gpu_list(char *buf, size_t len)
{
    size_t at = 0;
    if (len > 0)
        buf[0] = '\0';
    for (size_t i = 0; i < sizeof(backends) / sizeof(backends[0]) && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? ", " : "", backends[i]->name);
    return at;
}

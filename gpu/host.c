/* The host backend: shard buffers in host memory. Shared buffers are memfds sealed against
 * shrinking and growing, so a client that maps one cannot fault the daemon by truncating it.
 * Every buffer is backed and mapped up front (fallocate, MAP_POPULATE): memory that is not there
 * fails the allocation with ENOMEM instead of a SIGBUS later, and the first pushes and gathers
 * into a buffer do not pay its page faults (64 MiB of first touches took up to 0.6 s on a busy
 * 2-core host). */
#include "sd/gpu.h"
#include "sd/dtype.h"
#include "sd/log.h"
#include "sd/model.h"
#include "sd/status.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int host_alloc(size_t bytes, int flags, const char *tag, struct sd_mem *mem_p)
{
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
        if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
            status = -errno;
            SD_ERROR("host", "sealing %s: %s", tag, strerror(errno));
            goto err_close_fd;
        }
        ptr = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
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
    return SD_OK;

err_close_fd:
    if (fd >= 0)
        close(fd);
    return status;
}

static void host_free(struct sd_mem *mem)
{
    if (mem->ptr != NULL)
        munmap(mem->ptr, mem->bytes ? mem->bytes : 1);
    if (mem->fd >= 0)
        close(mem->fd);
    mem->ptr = NULL;
    mem->fd = -1;
    mem->bytes = 0;
}

static void host_copy(void *dst, const void *src, size_t bytes)
{
    memcpy(dst, src, bytes);
}

static void host_reduce_add(float *restrict acc, const void *restrict src, int dtype, size_t n)
{
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

static void host_to_f32(float *restrict dst, const void *restrict src, int dtype, size_t n)
{
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

static void host_from_f32(void *restrict dst, int dtype, const float *restrict src, size_t n)
{
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
static double host_sum_sq(const float *restrict x, size_t n)
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
    if (dtype == SD_DTYPE_FP32)
        ((float *)w)[i] = p;
    else if (dtype == SD_DTYPE_BF16)
        ((uint16_t *)w)[i] = sd_f32_to_bf16(p);
    else
        ((uint16_t *)w)[i] = sd_f32_to_fp16(p);
}

/* AdamW as torch.optim.AdamW computes it (decoupled decay, bias correction). The expression
 * order is part of the fidelity contract: client/examples/mlp_train.c's reference repeats it. */
struct adamw_consts {
    float decay, b1, b2, omb1, omb2, step_size, sqrt_bc2, eps;
};

struct adamw_out {
    float p, m, v;
};

/* One element: the new master weight and moments. */
static inline struct adamw_out adamw_elem(const struct adamw_consts *c, float master, float m,
                                          float v, float g)
{
    float p = master * c->decay;
    float mi = c->b1 * m + c->omb1 * g;
    float vi = c->b2 * v + c->omb2 * g * g;
    float denom = sqrtf(vi) / c->sqrt_bc2 + c->eps;
    return (struct adamw_out){.p = p - c->step_size * (mi / denom), .m = mi, .v = vi};
}

static void host_adamw(const struct sd_adamw_args *a, float *restrict master, float *restrict m,
                       float *restrict v, float *restrict grad, float scale, void *restrict w,
                       int w_dtype, size_t n)
{
    const float bc1 = 1.0f - powf(a->beta1, (float)a->step);
    const float bc2 = 1.0f - powf(a->beta2, (float)a->step);
    const struct adamw_consts c = {.decay = 1.0f - a->lr * a->weight_decay,
                                   .b1 = a->beta1,
                                   .b2 = a->beta2,
                                   .omb1 = 1.0f - a->beta1,
                                   .omb2 = 1.0f - a->beta2,
                                   .step_size = a->lr / bc1,
                                   .sqrt_bc2 = sqrtf(bc2),
                                   .eps = a->eps};
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

/* SGD with momentum (dampening 0, not Nesterov) as torch.optim.SGD computes it; the momentum
 * buffer starts at zero, which equals torch's "first step copies the gradient". */
static void host_sgd(const struct sd_sgd_args *a, float *restrict master, float *restrict buf,
                     float *restrict grad, float scale, void *restrict w, int w_dtype, size_t n)
{
    const float lr = a->lr, mu = a->momentum, wd = a->weight_decay;
    for (size_t i = 0; i < n; i++) {
        float p = master[i];
        float g = grad[i] * scale;
        g = g + wd * p;
        float b = mu * buf[i] + g;
        p = p - lr * b;
        buf[i] = b;
        master[i] = p;
        store_w(w, w_dtype, i, p);
        grad[i] = 0.0f;
    }
}

const struct sd_gpu_ops sd_gpu_host_ops = {
    .name = "host",
    .alloc = host_alloc,
    .free = host_free,
    .copy = host_copy,
    .reduce_add = host_reduce_add,
    .to_f32 = host_to_f32,
    .from_f32 = host_from_f32,
    .sum_sq = host_sum_sq,
    .adamw = host_adamw,
    .sgd = host_sgd,
};

const struct sd_gpu_ops *sd_gpu_find(const char *name)
{
    if (strcmp(name, "host") == 0)
        return &sd_gpu_host_ops;
    return NULL;
}

/* Device backends behind one vtable (DESIGN.md section 2): host (default), cuda, hip.
 * Every kernel works on a contiguous range; unsupported operations return SD_ENOSYS. */
#ifndef SD_GPU_H
#define SD_GPU_H

#include <stddef.h>
#include <stdint.h>

enum { SD_MEM_PRIVATE = 0, SD_MEM_SHARED = 1 };

struct sd_mem {
    void *ptr;
    size_t bytes;
    int fd; /* memfd for shared host memory, else -1 */
};

struct sd_adamw_args {
    float lr, beta1, beta2, eps, weight_decay;
    uint64_t step; /* 1-based */
};

struct sd_sgd_args {
    float lr, momentum, weight_decay;
};

struct sd_gpu_ops {
    const char *name;
    /* Allocate zeroed memory; SD_MEM_SHARED gives a sealed memfd other processes can map. */
    int (*alloc)(size_t bytes, int flags, const char *tag, struct sd_mem *mem_p);
    void (*free)(struct sd_mem *mem);
    void (*copy)(void *dst, const void *src, size_t bytes);
    /* acc[i] += (float)src[i] with src in dtype */
    void (*reduce_add)(float *acc, const void *src, int src_dtype, size_t n);
    /* dst[i] = (float)src[i] (fp32 destination) */
    void (*to_f32)(float *dst, const void *src, int src_dtype, size_t n);
    /* dst[i] = src[i] rounded to dtype */
    void (*from_f32)(void *dst, int dst_dtype, const float *src, size_t n);
    /* sum of squares in double */
    double (*sum_sq)(const float *x, size_t n);
    /* grad is scaled by `scale`, then zeroed. master/moments fp32, w in w_dtype. */
    void (*adamw)(const struct sd_adamw_args *a, float *master, float *m, float *v, float *grad,
                  float scale, void *w, int w_dtype, size_t n);
    void (*sgd)(const struct sd_sgd_args *a, float *master, float *buf, float *grad, float scale,
                void *w, int w_dtype, size_t n);
};

extern const struct sd_gpu_ops sd_gpu_host_ops;

/* Backend by name ("host", "cuda", "hip"); NULL when not built or unknown. */
const struct sd_gpu_ops *sd_gpu_find(const char *name);

#endif

/* The device backends' kernels behind the vtable's signatures (sd/gpu.h), written once over a
 * launcher: the grid sizes and the optimizers' constants are computed here, and the launcher
 * runs a kernel of kern/kernels.h with them, on a device (cuda.c, hip.c: a module's function
 * on a stream) or through the host emulation (emu.c). */
#ifndef SD_KERN_OPS_H
#define SD_KERN_OPS_H

#include "kern/params.h"
#include "sd/gpu.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sdk_route;

struct sdk_launcher {
    /* run kernel id on `blocks` blocks of SDK_THREADS_PER_BLOCK threads; args[i] points at the
     * kernel's i-th parameter, as cuLaunchKernel takes them */
    void (*launch)(struct sdk_launcher *l, enum sdk_kernel_id id, uint64_t blocks, void **args);
    /* SDK_SUMSQ_MAX_BLOCKS + 1 doubles the kernels may write (the sum's partials and result),
     * on the device launches run on */
    double *scratch;
    /* the device launches run on now (a queue over several devices) */
    int cur;
    /* how the queue runs over several devices (NULL where the backend drives one) */
    const struct sdk_route *route;
};

/* A queue over several devices (sd/gpu.h's queue): the device p lies on (-1: not device
 * memory); run what follows on device d (after the queue's work so far, whatever device ran it;
 * scratch becomes d's); whether device d's kernels read device e's memory (peer access); a copy
 * of the bytes at src on device cur (valid until the next bring: one source a launch); a copy
 * between any two places. Work on several devices at once (copy_many's pieces for several
 * GPUs): run what follows on device d after the queue's work so far on device `from`, not after
 * other branches (branch); then make `from` wait for the work of every device in the mask devs
 * and run there again (merge): the queue is one order again. */
struct sdk_route {
    int (*device_of)(struct sdk_launcher *l, const void *p);
    void (*use)(struct sdk_launcher *l, int d);
    bool (*peer)(struct sdk_launcher *l, int d, int e);
    const void *(*bring)(struct sdk_launcher *l, const void *src, size_t bytes);
    void (*copy)(struct sdk_launcher *l, void *dst, const void *src, size_t bytes);
    void (*branch)(struct sdk_launcher *l, int from, int d);
    void (*merge)(struct sdk_launcher *l, int from, uint64_t devs);
};

/* Several devices: run what follows on the device that holds p (device memory; else where the
 * queue runs now). */
void sdk_at(struct sdk_launcher *l, const void *p);
/* src, bytes long, as the device launches run on reads it: src, or the queue's copy of it there
 * where that device has no peer access to src's */
const void *sdk_readable(struct sdk_launcher *l, const void *src, size_t bytes);

/* the blocks of a grid-stride kernel over `work` items */
uint64_t sdk_blocks(uint64_t work);
/* the blocks of the sum of squares of n elements: a function of n only (the order of the sum) */
uint64_t sdk_sumsq_blocks(uint64_t n);
extern const char *const sdk_kernel_names[SDK_K_COUNT];

/* AdamW's per-step constants from its arguments (the host backend's too: one formula) */
struct sdk_adamw_c sdk_adamw_consts(const struct sd_adamw_args *a);

/* The sum of squares of x: its result lands in l->scratch[SDK_SUMSQ_MAX_BLOCKS] (device memory
 * on a device), where the backend's sum_sq takes it. */
void sdk_sum_sq(struct sdk_launcher *l, const float *x, size_t n);

/* The vtable's kernels for a backend whose struct sd_gpu_queue starts with its struct
 * sdk_launcher (emu.c, dev.c): SDK_KERNEL_OPS in its struct sd_gpu_ops. */
void sdk_op_reduce_add(struct sd_gpu_queue *q, float *acc, const void *src, int dtype, size_t n);
void sdk_op_to_f32(struct sd_gpu_queue *q, float *dst, const void *src, int dtype, size_t n);
void sdk_op_from_f32(struct sd_gpu_queue *q, void *dst, int dtype, const float *src, size_t n);
void sdk_op_adamw(struct sd_gpu_queue *q, const struct sd_adamw_args *a, float *master, float *m,
                  float *v, float *grad, float scale, void *w, int w_dtype, size_t n);
void sdk_op_sgd(struct sd_gpu_queue *q, const struct sd_sgd_args *a, float *master, float *buf,
                float *grad, float scale, void *w, int w_dtype, size_t n);
void sdk_op_quantize(struct sd_gpu_queue *q, void *dst, int bits, const void *src, int src_dtype,
                     size_t n, uint32_t block);
void sdk_op_dequantize(struct sd_gpu_queue *q, void *dst, int dst_dtype, const void *src, int bits,
                       size_t n, uint32_t block, bool accumulate);
void sdk_op_quantize_ef(struct sd_gpu_queue *q, void *dst, int bits, const float *x, float *err,
                        size_t n, uint32_t block);
void sdk_op_gather(struct sd_gpu_queue *q, const struct sd_gpu_piece *pieces, uint32_t n);

#define SDK_KERNEL_OPS                                                                             \
    .reduce_add = sdk_op_reduce_add, .to_f32 = sdk_op_to_f32, .from_f32 = sdk_op_from_f32,         \
    .adamw = sdk_op_adamw, .sgd = sdk_op_sgd, .quantize = sdk_op_quantize,                         \
    .dequantize = sdk_op_dequantize, .quantize_ef = sdk_op_quantize_ef, .copy_many = sdk_op_gather

#endif

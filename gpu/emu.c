/* The emu backend: host memory, and the device backends' kernels (kern/kernels.h) compiled for
 * the host through kern/compat.h's emulation, each block's threads run in order. It runs the
 * one kernel source wherever shardd runs, so CI (no GPU) tests the kernels against the host
 * backend (tests/unit/test_kernels.c) and trains through them (test_fidelity ... emu); on a
 * GPU the device's results are compared with it bit for bit. */
#include "host_int.h"
#include "kern/kernels.h"
#include "kern_ops.h"
#include "sd/status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

_Thread_local struct sdk_emu sdk_emu;

/* one parameter of a launch, by type */
#define A(t, i) (*(t *)args[i])

static void emu_run(enum sdk_kernel_id id, void **args)
{
    switch (id) {
    case SDK_K_REDUCE_ADD:
        sdk_k_reduce_add(A(float *, 0), A(const void *, 1), A(int, 2), A(uint64_t, 3));
        break;
    case SDK_K_TO_F32:
        sdk_k_to_f32(A(float *, 0), A(const void *, 1), A(int, 2), A(uint64_t, 3));
        break;
    case SDK_K_FROM_F32:
        sdk_k_from_f32(A(void *, 0), A(int, 1), A(const float *, 2), A(uint64_t, 3));
        break;
    case SDK_K_SUMSQ_PART:
        sdk_k_sumsq_part(A(const float *, 0), A(uint64_t, 1), A(double *, 2));
        break;
    case SDK_K_SUMSQ_FINAL:
        sdk_k_sumsq_final(A(const double *, 0), A(uint32_t, 1), A(double *, 2));
        break;
    case SDK_K_ADAMW:
        sdk_k_adamw(A(struct sdk_adamw_c, 0), A(float *, 1), A(float *, 2), A(float *, 3),
                    A(float *, 4), A(float, 5), A(void *, 6), A(int, 7), A(uint64_t, 8));
        break;
    case SDK_K_SGD:
        sdk_k_sgd(A(struct sdk_sgd_c, 0), A(float *, 1), A(float *, 2), A(float *, 3), A(float, 4),
                  A(void *, 5), A(int, 6), A(uint64_t, 7));
        break;
    case SDK_K_SCALES:
        sdk_k_scales(A(float *, 0), A(const void *, 1), A(int, 2), A(const float *, 3),
                     A(uint64_t, 4), A(uint32_t, 5));
        break;
    case SDK_K_ENCODE:
        sdk_k_encode(A(uint8_t *, 0), A(int, 1), A(const float *, 2), A(const void *, 3), A(int, 4),
                     A(float *, 5), A(uint64_t, 6), A(uint32_t, 7));
        break;
    case SDK_K_DECODE:
        sdk_k_decode(A(void *, 0), A(int, 1), A(const float *, 2), A(const uint8_t *, 3), A(int, 4),
                     A(uint64_t, 5), A(uint32_t, 6), A(int, 7));
        break;
    case SDK_K_COUNT:
        break;
    }
}

#undef A

static void emu_launch(struct sdk_launcher *l, enum sdk_kernel_id id, uint64_t blocks, void **args)
{
    (void)l;
    sdk_emu.blocks = blocks;
    sdk_emu.threads = SDK_THREADS_PER_BLOCK;
    for (uint64_t b = 0; b < blocks; b++) {
        sdk_emu.block = b;
        emu_run(id, args);
    }
}

/* like the host backend's, every kernel has run when its call returns */
struct sd_gpu_queue {
    struct sdk_launcher l;
    double scratch[SDK_SUMSQ_MAX_BLOCKS + 1];
    uint64_t recorded;
};

static int emu_queue_create(struct sd_gpu_queue **q_p)
{
    struct sd_gpu_queue *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return SD_ENOMEM;
    q->l = (struct sdk_launcher){.launch = emu_launch, .scratch = q->scratch};
    *q_p = q;
    return SD_OK;
}

static void emu_queue_destroy(struct sd_gpu_queue *q)
{
    free(q);
}

static int emu_record(struct sd_gpu_queue *q, uint64_t *ticket_p)
{
    *ticket_p = ++q->recorded;
    return SD_OK;
}

static int emu_query(struct sd_gpu_queue *q, uint64_t ticket)
{
    return ticket <= q->recorded ? SD_OK : SD_EINVAL;
}

static void emu_sum_sq(struct sd_gpu_queue *q, const float *x, size_t n, double *out)
{
    sdk_sum_sq(&q->l, x, n);
    *out = q->scratch[SDK_SUMSQ_MAX_BLOCKS];
}

/* one emulated device: the host's memory, shared as memfds */
static int emu_devices(struct sd_gpu_device *out, int max)
{
    if (max > 0) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        out[0] = (struct sd_gpu_device){
            .index = 0,
            .memory_bytes = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0,
            .fd_handles = true};
        snprintf(out[0].name, sizeof(out[0].name), "emulated (host memory)");
    }
    return 1;
}

#define EMU_OPS                                                                                    \
    .host_visible = true, .devices = emu_devices, .alloc = sd__host_alloc, .free = sd__host_free,  \
    .queue_create = emu_queue_create, .queue_destroy = emu_queue_destroy, .sync = sd__host_sync,   \
    .record = emu_record, .query = emu_query, .copy = sd__host_copy, .zero = sd__host_zero,        \
    .sum_sq = emu_sum_sq, SDK_KERNEL_OPS

const struct sd_gpu_ops sd_gpu_emu_ops = {.name = "emu", .host_memory = true, EMU_OPS};
const struct sd_gpu_ops sd_gpu_emu_device_ops = {
    .name = "emu-device", .host_memory = false, EMU_OPS};

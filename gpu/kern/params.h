/* What the kernels (kernels.h) and their launchers (kern_ops.c) agree on: the kernels' ids and
 * names, the dtype codes, the block size and the constants of the optimizers. C and C++. */
#ifndef SD_KERN_PARAMS_H
#define SD_KERN_PARAMS_H

#include <stdint.h>

#define SDK_THREADS_PER_BLOCK 256
/* a fixed-order sum: partial sums per block, at most this many blocks (a function of n only) */
#define SDK_SUMSQ_MAX_BLOCKS 1024
#define SDK_SUMSQ_PER_THREAD 16

/* sd/model.h's enum sd_dtype (checked in kern_ops.c) */
enum { SDK_FP32 = 0, SDK_BF16 = 1, SDK_FP16 = 2 };

/* AdamW's per-step constants, computed once on the host as the host backend does */
struct sdk_adamw_c {
    float decay, l2, b1, b2, omb1, omb2, step_size, sqrt_bc2, eps;
};

struct sdk_sgd_c {
    float lr, mu, wd, nest; /* nest: 1 for Nesterov momentum, else 0 */
};

/* one launch of copies (a unit's shards gathered into its slot): piece i is bytes[i] bytes from
 * src[i] to dst[i] (addresses as integers: the same layout in C and C++), blocks_per blocks each */
#define SDK_PIECES_MAX 16
struct sdk_pieces {
    uint64_t n, blocks_per;
    uint64_t dst[SDK_PIECES_MAX], src[SDK_PIECES_MAX], bytes[SDK_PIECES_MAX];
};

/* X(id, name): every kernel of kernels.h, in the order of their ids */
#define SDK_KERNELS(X)                                                                             \
    X(SDK_K_REDUCE_ADD, sdk_k_reduce_add)                                                          \
    X(SDK_K_TO_F32, sdk_k_to_f32)                                                                  \
    X(SDK_K_FROM_F32, sdk_k_from_f32)                                                              \
    X(SDK_K_SUMSQ_PART, sdk_k_sumsq_part)                                                          \
    X(SDK_K_SUMSQ_FINAL, sdk_k_sumsq_final)                                                        \
    X(SDK_K_ADAMW, sdk_k_adamw)                                                                    \
    X(SDK_K_SGD, sdk_k_sgd)                                                                        \
    X(SDK_K_SCALES, sdk_k_scales)                                                                  \
    X(SDK_K_ENCODE, sdk_k_encode)                                                                  \
    X(SDK_K_DECODE, sdk_k_decode)                                                                  \
    X(SDK_K_GATHER, sdk_k_gather)

#define SDK_ENUM_ID(id, name) id,
enum sdk_kernel_id { SDK_KERNELS(SDK_ENUM_ID) SDK_K_COUNT };
#undef SDK_ENUM_ID

#endif

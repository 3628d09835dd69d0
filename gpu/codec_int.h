/* What the host kernels share: element access by dtype, and the block-quantization kernels
 * (codec.c) of the host and host-deferred backends. */
#ifndef SD_CODEC_INT_H
#define SD_CODEC_INT_H

#include "sd/dtype.h"
#include "sd/model.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* element i of an array in dtype, as fp32, and back (rounded to nearest even) */
static inline float sd__load(const void *src, int dtype, size_t i)
{
    if (dtype == SD_DTYPE_FP32)
        return ((const float *)src)[i];
    if (dtype == SD_DTYPE_BF16)
        return sd_bf16_to_f32(((const uint16_t *)src)[i]);
    return sd_fp16_to_f32(((const uint16_t *)src)[i]);
}

static inline void sd__store(void *dst, int dtype, size_t i, float v)
{
    if (dtype == SD_DTYPE_FP32)
        ((float *)dst)[i] = v;
    else if (dtype == SD_DTYPE_BF16)
        ((uint16_t *)dst)[i] = sd_f32_to_bf16(v);
    else
        ((uint16_t *)dst)[i] = sd_f32_to_fp16(v);
}

void sd__codec_quantize(void *dst, int bits, const void *src, int src_dtype, size_t n,
                        uint32_t block);
void sd__codec_quantize_ef(void *dst, int bits, const float *x, float *err, size_t n,
                           uint32_t block);
void sd__codec_dequantize(void *dst, int dst_dtype, const void *src, int bits, size_t n,
                          uint32_t block, bool accumulate);

#endif

/* Block quantization codecs (issue 20): the wire format of quantized collectives and quantized
 * secondary copies. Pure definitions; the kernels are the device backends' (sd_gpu_ops.quantize,
 * .dequantize).
 *
 * Symmetric, one fp32 scale per block of B elements (the last block of a buffer may be short;
 * a shard is encoded on its own, so no block spans two shards). The scale stored is the block's
 * largest magnitude m; an element x becomes q = round(x qmax / m) with qmax = 2^(b-1) - 1 (127
 * for int8, 7 for int4), so +m and -m are exactly +qmax and -qmax (DeepSpeed's 2^b / (2 m)
 * clamps +m one step short), and decodes to q m / qmax: the error is at most m / (2 qmax) per
 * element (plus the rounding of the result to its dtype). A block of zeros has m = 0 and decodes
 * to zeros. A block with a NaN or an infinity keeps it in its scale and decodes to non-finite
 * values: a non-finite gradient is never silently turned into numbers (the step's norm fails on
 * it, naming the unit).
 *
 * Encoded buffer of n elements: the ceil(n / B) scales (fp32, little-endian), then the values:
 * int8, one byte each; int4, two per byte, element i in the low nibble of byte i / 2 when i is
 * even and in the high nibble when odd, two's complement. Bytes on the wire: 4 ceil(n / B) + n
 * (int8) or 4 ceil(n / B) + ceil(n / 2) (int4); 2 n for the 16-bit float codecs below. */
#ifndef SD_CODEC_H
#define SD_CODEC_H

#include <stdint.h>

enum { SD_CODEC_INT4 = 4, SD_CODEC_INT8 = 8, SD_CODEC_BF16 = 16, SD_CODEC_FP16 = 17 };

/* The 16-bit float codecs of a gradient wire dtype (plan option ,gwire=): each element rounded to
 * nearest even in bf16 or fp16 (no blocks, no scales; 2 n bytes), decoded exactly into fp32. A
 * non-finite value stays non-finite (fp16: beyond 65504 it becomes an infinity). */
static inline int sd_codec_is_float(int codec)
{
    return codec == SD_CODEC_BF16 || codec == SD_CODEC_FP16;
}

#define SD_CODEC_MIN_BLOCK 2
#define SD_CODEC_MAX_BLOCK 65536

static inline uint64_t sd_codec_blocks(uint64_t n, uint32_t block)
{
    return (n + block - 1) / block;
}

static inline uint64_t sd_codec_bytes(int bits, uint64_t n, uint32_t block)
{
    if (sd_codec_is_float(bits))
        return 2 * n;
    return 4 * sd_codec_blocks(n, block) + (bits == SD_CODEC_INT8 ? n : (n + 1) / 2);
}

static inline int sd_codec_qmax(int bits)
{
    return (1 << (bits - 1)) - 1;
}

#endif

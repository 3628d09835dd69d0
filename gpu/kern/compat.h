/* The mapping under the one kernel source (kernels.h): the same text compiles as CUDA (nvcc), as
 * HIP (hipcc) and, through this header's emulation, as plain C11 on the host, where CI runs it.
 *
 * A kernel is written as phases between barriers. Each phase is an SDK_THREADS ... SDK_SYNC
 * block whose body is one thread's work (its index: sdk_t). On a device every thread of the
 * block runs the body and then waits at the barrier; the emulation runs the body for thread 0,
 * 1, ... in order, which is a legal schedule of the device's, so a kernel whose threads share
 * data only through SDK_SHARED arrays across barriers computes the same on both. Locals live in
 * one phase; what crosses a barrier lives in an SDK_SHARED array indexed by thread. Block
 * reductions combine in a fixed tree, so their results do not depend on scheduling, and the
 * emulation's results equal the device's bit for bit (no FMA contraction on either side:
 * -ffp-contract=off here, --fmad=false / -ffp-contract=off there). */
#ifndef SD_KERN_COMPAT_H
#define SD_KERN_COMPAT_H

#if defined(__CUDACC__) || defined(__HIPCC__)
#define SDK_DEVICE 1
#if defined(__HIPCC__)
#include <hip/hip_runtime.h>
#endif
#include <stdint.h>
#define SDK_KERNEL          extern "C" __global__ void __launch_bounds__(SDK_THREADS_PER_BLOCK)
#define SDK_FN              static __device__ __forceinline__
#define SDK_RESTRICT        __restrict__
#define SDK_SHARED(t, n, c) __shared__ t n[c]
#define SDK_THREADS                                                                                \
    {                                                                                              \
        const unsigned sdk_t = threadIdx.x;
#define SDK_SYNC                                                                                   \
    }                                                                                              \
    __syncthreads();
#define SDK_BLOCK    ((uint64_t)blockIdx.x)
#define SDK_BLOCKS   ((uint64_t)gridDim.x)
#define SDK_NTHREADS ((unsigned)blockDim.x)
typedef float4 sdk_f4;
typedef uint4 sdk_u4;
SDK_FN float sdk_bits_f32(uint32_t u)
{
    return __uint_as_float(u);
}
SDK_FN uint32_t sdk_f32_bits(float f)
{
    return __float_as_uint(f);
}
#else
#define SDK_DEVICE 0
#include <math.h>
#include <stdint.h>
#include <string.h>
/* the emulated block: which one runs, of how many, with how many threads */
struct sdk_emu {
    uint64_t block, blocks;
    unsigned threads;
};
extern _Thread_local struct sdk_emu sdk_emu;
#define SDK_KERNEL          static void
#define SDK_FN              static inline
#define SDK_RESTRICT        restrict
#define SDK_SHARED(t, n, c) t n[c]
#define SDK_THREADS         for (unsigned sdk_t = 0; sdk_t < sdk_emu.threads; sdk_t++) {
#define SDK_SYNC            }
#define SDK_BLOCK           (sdk_emu.block)
#define SDK_BLOCKS          (sdk_emu.blocks)
#define SDK_NTHREADS        (sdk_emu.threads)
typedef struct {
    float x, y, z, w;
} sdk_f4;
typedef struct {
    uint32_t x, y, z, w;
} sdk_u4;
SDK_FN float sdk_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}
SDK_FN uint32_t sdk_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
#endif

#endif

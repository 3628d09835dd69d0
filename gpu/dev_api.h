/* The driver API under dev.c, the one source of the cuda and hip backends: CUDA's driver API
 * (libcuda.so.1) or HIP's module API (libamdhip64.so), both opened at run time. dev.c uses
 * only the names below; each is a function pointer resolved by dlsym in open(). libshard's
 * importer of the daemon's device memory (client/devmem_dev.c) uses DEV_CLIENT_FUNCS and the
 * dev_client_* names the same way, so that it too is one source for both. */
#ifndef SD_DEV_API_H
#define SD_DEV_API_H

#if defined(SD_DEV_CUDA)
#include <cuda.h>

#define DEV_NAME     "cuda"
#define DEV_LIB      "libcuda.so.1"
#define DEV_LIB_HINT "no NVIDIA driver on this machine?"
#define DEV_OPS      sd_gpu_cuda_ops
#define DEV_HMEM     SD_HMEM_CUDA
#define DEV_IMAGE    sd_cuda_fatbin
typedef CUresult dev_res;
typedef CUdevice dev_device;
typedef CUcontext dev_ctx;
typedef CUmodule dev_module;
typedef CUfunction dev_fn;
typedef CUstream dev_stream;
typedef CUevent dev_event;
typedef CUdeviceptr dev_ptr;
typedef CUmemGenericAllocationHandle dev_handle;
typedef CUmemAllocationProp dev_prop;
typedef CUmemAccessDesc dev_access;
#define DEV_OK        CUDA_SUCCESS
#define DEV_NOT_READY CUDA_ERROR_NOT_READY
#define DEV_OOM       CUDA_ERROR_OUT_OF_MEMORY
#define DEV_NODEV     CUDA_ERROR_NO_DEVICE
#define DEV_NOTSUP    CUDA_ERROR_NOT_SUPPORTED

/* the entry points, by their versioned names (cuda.h's macros) */
#define DEV_FUNCS(X)                                                                               \
    X(cuInit)                                                                                      \
    X(cuDriverGetVersion)                                                                          \
    X(cuGetErrorString)                                                                            \
    X(cuDeviceGetCount)                                                                            \
    X(cuDeviceGet)                                                                                 \
    X(cuDeviceGetAttribute)                                                                        \
    X(cuDeviceGetName)                                                                             \
    X(cuDeviceTotalMem)                                                                            \
    X(cuDeviceGetUuid)                                                                             \
    X(cuDeviceCanAccessPeer)                                                                       \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuCtxSetCurrent)                                                                             \
    X(cuModuleLoadData)                                                                            \
    X(cuModuleGetFunction)                                                                         \
    X(cuLaunchKernel)                                                                              \
    X(cuStreamCreate)                                                                              \
    X(cuStreamDestroy)                                                                             \
    X(cuStreamSynchronize)                                                                         \
    X(cuStreamWaitEvent)                                                                           \
    X(cuEventCreate)                                                                               \
    X(cuEventRecord)                                                                               \
    X(cuEventQuery)                                                                                \
    X(cuEventDestroy)                                                                              \
    X(cuMemcpyAsync)                                                                               \
    X(cuMemcpyDtoHAsync)                                                                           \
    X(cuMemsetD8Async)                                                                             \
    X(cuMemsetD8)                                                                                  \
    X(cuMemAlloc)                                                                                  \
    X(cuMemFree)                                                                                   \
    X(cuMemAllocHost)                                                                              \
    X(cuMemFreeHost)                                                                               \
    X(cuMemCreate)                                                                                 \
    X(cuMemRelease)                                                                                \
    X(cuMemAddressReserve)                                                                         \
    X(cuMemAddressFree)                                                                            \
    X(cuMemMap)                                                                                    \
    X(cuMemUnmap)                                                                                  \
    X(cuMemSetAccess)                                                                              \
    X(cuMemExportToShareableHandle)                                                                \
    X(cuMemGetAllocationGranularity)

#define dev_init()                   p_cuInit(0)
#define dev_driver_version(v)        p_cuDriverGetVersion(v)
#define dev_device_count(n)          p_cuDeviceGetCount(n)
#define dev_device_get(d, i)         p_cuDeviceGet(d, i)
#define dev_device_name(buf, len, d) p_cuDeviceGetName(buf, len, d)
#define dev_total_mem(bytes, d)      p_cuDeviceTotalMem(bytes, d)
#define dev_uuid(u, d)               p_cuDeviceGetUuid(u, d)
typedef CUuuid dev_uuid_t;
#define dev_can_access_peer(can, d, p)  p_cuDeviceCanAccessPeer(can, d, p)
#define dev_ctx_retain(c, d)            p_cuDevicePrimaryCtxRetain(c, d)
#define dev_ctx_set(c, d)               p_cuCtxSetCurrent(c)
#define dev_module_load(m, image)       p_cuModuleLoadData(m, image)
#define dev_module_fn(f, m, name)       p_cuModuleGetFunction(f, m, name)
#define dev_launch(f, g, b, s, args)    p_cuLaunchKernel(f, g, 1, 1, b, 1, 1, 0, s, args, NULL)
#define dev_stream_create(s)            p_cuStreamCreate(s, CU_STREAM_NON_BLOCKING)
#define dev_stream_destroy(s)           p_cuStreamDestroy(s)
#define dev_stream_sync(s)              p_cuStreamSynchronize(s)
#define dev_stream_wait(s, e)           p_cuStreamWaitEvent(s, e, 0)
#define dev_event_create(e)             p_cuEventCreate(e, CU_EVENT_DISABLE_TIMING)
#define dev_event_record(e, s)          p_cuEventRecord(e, s)
#define dev_event_query(e)              p_cuEventQuery(e)
#define dev_event_destroy(e)            p_cuEventDestroy(e)
#define dev_copy_async(dst, src, n, s)  p_cuMemcpyAsync(dst, src, n, s)
#define dev_copy_dtoh_async(h, d, n, s) p_cuMemcpyDtoHAsync(h, d, n, s)
#define dev_zero_async(d, n, s)         p_cuMemsetD8Async(d, 0, n, s)
#define dev_zero(d, n)                  p_cuMemsetD8(d, 0, n)
#define dev_malloc(d, n)                p_cuMemAlloc(d, n)
#define dev_mfree(d)                    p_cuMemFree(d)
#define dev_host_malloc(h, n)           p_cuMemAllocHost(h, n)
#define dev_host_free(h)                p_cuMemFreeHost(h)
#define dev_mem_create(h, n, prop)      p_cuMemCreate(h, n, prop, 0)
#define dev_mem_release(h)              p_cuMemRelease(h)
#define dev_va_reserve(d, n)            p_cuMemAddressReserve(d, n, 0, 0, 0)
#define dev_va_free(d, n)               p_cuMemAddressFree(d, n)
#define dev_mem_map(d, n, h)            p_cuMemMap(d, n, 0, h, 0)
#define dev_mem_unmap(d, n)             p_cuMemUnmap(d, n)
#define dev_mem_access(d, n, a, count)  p_cuMemSetAccess(d, n, a, count)
#define dev_mem_export(fd, h)                                                                      \
    p_cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
#define dev_granularity(g, prop)                                                                   \
    p_cuMemGetAllocationGranularity(g, prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)

static inline void dev_prop_init(dev_prop *p, dev_device d, int rdma)
{
    *p = (dev_prop){.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                    .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d}};
    p->allocFlags.gpuDirectRDMACapable = (unsigned char)(rdma ? 1 : 0);
}

static inline void dev_access_init(dev_access *a, dev_device d)
{
    *a = (dev_access){.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d},
                      .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
}

/* a client's: import a VMM allocation's fd, map it (read-only where asked), copy with unified
 * addressing, signal a word of host memory from a stream (devmem_dev.c adds the calling
 * thread's device and context) */
#define DEV_CLIENT_FUNCS(X)                                                                        \
    X(cuInit)                                                                                      \
    X(cuGetErrorString)                                                                            \
    X(cuDeviceGet)                                                                                 \
    X(cuDeviceGetAttribute)                                                                        \
    X(cuCtxGetCurrent)                                                                             \
    X(cuCtxGetDevice)                                                                              \
    X(cuCtxSetCurrent)                                                                             \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuDeviceGetCount)                                                                            \
    X(cuDeviceGetUuid)                                                                             \
    X(cuMemImportFromShareableHandle)                                                              \
    X(cuMemGetAllocationGranularity)                                                               \
    X(cuMemAddressReserve)                                                                         \
    X(cuMemAddressFree)                                                                            \
    X(cuMemMap)                                                                                    \
    X(cuMemUnmap)                                                                                  \
    X(cuMemSetAccess)                                                                              \
    X(cuMemRelease)                                                                                \
    X(cuMemcpy)                                                                                    \
    X(cuMemsetD8)                                                                                  \
    X(cuMemHostRegister)                                                                           \
    X(cuMemHostUnregister)                                                                         \
    X(cuMemHostGetDevicePointer)                                                                   \
    X(cuStreamSynchronize)                                                                         \
    X(cuStreamWriteValue32)

#define DEV_FD_HANDLES_ATTR    "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
#define DEV_HOST_ALREADY       CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
#define dev_client_err(r, s_p) (void)p_cuGetErrorString(r, s_p)
#define dev_client_fd_handles(v, d)                                                                \
    p_cuDeviceGetAttribute(v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, d)
#define dev_client_import(h, fd)                                                                   \
    p_cuMemImportFromShareableHandle(h, (void *)(uintptr_t)(fd),                                   \
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
#define dev_client_copy(dst, src, n)                                                               \
    p_cuMemcpy((CUdeviceptr)(uintptr_t)(dst), (CUdeviceptr)(uintptr_t)(src), n)
#define dev_client_zero(dst, n)        p_cuMemsetD8((CUdeviceptr)(uintptr_t)(dst), 0, n)
#define dev_client_wait()              p_cuStreamSynchronize(NULL)
#define dev_client_host_register(p, n) p_cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_DEVICEMAP)
#define dev_client_host_unregister(p)  p_cuMemHostUnregister(p)
#define dev_client_host_devptr(d_p, p) p_cuMemHostGetDevicePointer(d_p, p, 0)
#define dev_client_stream_write32(s, d, v)                                                         \
    p_cuStreamWriteValue32((CUstream)(s), d, v, CU_STREAM_WRITE_VALUE_DEFAULT)

#elif defined(SD_DEV_HIP)
#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif
#include <hip/hip_runtime_api.h>

#define DEV_NAME      "hip"
#define DEV_LIB       "libamdhip64.so"
#define DEV_LIB_HINT  "no ROCm runtime on this machine?"
#define DEV_OPS       sd_gpu_hip_ops
#define DEV_HMEM      SD_HMEM_ROCR
#define DEV_IMAGE     sd_hip_code_object
typedef hipError_t dev_res;
typedef hipDevice_t dev_device;
typedef int dev_ctx; /* HIP's context API is deprecated: hipSetDevice per thread */
typedef hipModule_t dev_module;
typedef hipFunction_t dev_fn;
typedef hipStream_t dev_stream;
typedef hipEvent_t dev_event;
typedef hipDeviceptr_t dev_ptr;
typedef hipMemGenericAllocationHandle_t dev_handle;
typedef hipMemAllocationProp dev_prop;
typedef hipMemAccessDesc dev_access;
#define DEV_OK        hipSuccess
#define DEV_NOT_READY hipErrorNotReady
#define DEV_OOM       hipErrorOutOfMemory
#define DEV_NODEV     hipErrorNoDevice
#define DEV_NOTSUP    hipErrorNotSupported

#define DEV_FUNCS(X)                                                                               \
    X(hipInit)                                                                                     \
    X(hipDriverGetVersion)                                                                         \
    X(hipGetErrorString)                                                                           \
    X(hipGetDeviceCount)                                                                           \
    X(hipDeviceGet)                                                                                \
    X(hipDeviceGetName)                                                                            \
    X(hipDeviceTotalMem)                                                                           \
    X(hipDeviceGetUuid)                                                                            \
    X(hipDeviceCanAccessPeer)                                                                      \
    X(hipSetDevice)                                                                                \
    X(hipModuleLoadData)                                                                           \
    X(hipModuleGetFunction)                                                                        \
    X(hipModuleLaunchKernel)                                                                       \
    X(hipStreamCreateWithFlags)                                                                    \
    X(hipStreamDestroy)                                                                            \
    X(hipStreamSynchronize)                                                                        \
    X(hipStreamWaitEvent)                                                                          \
    X(hipEventCreateWithFlags)                                                                     \
    X(hipEventRecord)                                                                              \
    X(hipEventQuery)                                                                               \
    X(hipEventDestroy)                                                                             \
    X(hipMemcpyAsync)                                                                              \
    X(hipMemsetD8Async)                                                                            \
    X(hipMemsetD8)                                                                                 \
    X(hipMalloc)                                                                                   \
    X(hipFree)                                                                                     \
    X(hipHostMalloc)                                                                               \
    X(hipHostFree)                                                                                 \
    X(hipMemCreate)                                                                                \
    X(hipMemRelease)                                                                               \
    X(hipMemAddressReserve)                                                                        \
    X(hipMemAddressFree)                                                                           \
    X(hipMemMap)                                                                                   \
    X(hipMemUnmap)                                                                                 \
    X(hipMemSetAccess)                                                                             \
    X(hipMemExportToShareableHandle)                                                               \
    X(hipMemGetAllocationGranularity)

#define dev_init()                      p_hipInit(0)
#define dev_driver_version(v)           p_hipDriverGetVersion(v)
#define dev_device_count(n)             p_hipGetDeviceCount(n)
#define dev_device_get(d, i)            p_hipDeviceGet(d, i)
#define dev_device_name(buf, len, d)    p_hipDeviceGetName(buf, len, d)
#define dev_total_mem(bytes, d)         p_hipDeviceTotalMem(bytes, d)
#define dev_uuid(u, d)                  p_hipDeviceGetUuid(u, d)
typedef hipUUID dev_uuid_t;
#define dev_can_access_peer(can, d, p)  p_hipDeviceCanAccessPeer(can, d, p)
#define dev_ctx_retain(c, d)            (*(c) = 0, hipSuccess)
#define dev_ctx_set(c, d)               p_hipSetDevice(d)
#define dev_module_load(m, image)       p_hipModuleLoadData(m, image)
#define dev_module_fn(f, m, name)       p_hipModuleGetFunction(f, m, name)
#define dev_launch(f, g, b, s, args)    p_hipModuleLaunchKernel(f, g, 1, 1, b, 1, 1, 0, s, args, NULL)
#define dev_stream_create(s)            p_hipStreamCreateWithFlags(s, hipStreamNonBlocking)
#define dev_stream_destroy(s)           p_hipStreamDestroy(s)
#define dev_stream_sync(s)              p_hipStreamSynchronize(s)
#define dev_stream_wait(s, e)           p_hipStreamWaitEvent(s, e, 0)
#define dev_event_create(e)             p_hipEventCreateWithFlags(e, hipEventDisableTiming)
#define dev_event_record(e, s)          p_hipEventRecord(e, s)
#define dev_event_query(e)              p_hipEventQuery(e)
#define dev_event_destroy(e)            p_hipEventDestroy(e)
#define dev_copy_async(dst, src, n, s)  p_hipMemcpyAsync(dst, src, n, hipMemcpyDefault, s)
#define dev_copy_dtoh_async(h, d, n, s) p_hipMemcpyAsync(h, d, n, hipMemcpyDeviceToHost, s)
#define dev_zero_async(d, n, s)         p_hipMemsetD8Async(d, 0, n, s)
#define dev_zero(d, n)                  p_hipMemsetD8(d, 0, n)
#define dev_malloc(d, n)                p_hipMalloc(d, n)
#define dev_mfree(d)                    p_hipFree(d)
#define dev_host_malloc(h, n)           p_hipHostMalloc(h, n, 0)
#define dev_host_free(h)                p_hipHostFree(h)
#define dev_mem_create(h, n, prop)      p_hipMemCreate(h, n, prop, 0)
#define dev_mem_release(h)              p_hipMemRelease(h)
#define dev_va_reserve(d, n)            p_hipMemAddressReserve(d, n, 0, 0, 0)
#define dev_va_free(d, n)               p_hipMemAddressFree(d, n)
#define dev_mem_map(d, n, h)            p_hipMemMap(d, n, 0, h, 0)
#define dev_mem_unmap(d, n)             p_hipMemUnmap(d, n)
#define dev_mem_access(d, n, a, count)  p_hipMemSetAccess(d, n, a, count)
#define dev_mem_export(fd, h)                                                                      \
    p_hipMemExportToShareableHandle(fd, h, hipMemHandleTypePosixFileDescriptor, 0)
#define dev_granularity(g, prop)                                                                   \
    p_hipMemGetAllocationGranularity(g, prop, hipMemAllocationGranularityRecommended)

static inline void dev_prop_init(dev_prop *p, dev_device d, int rdma)
{
    (void)rdma; /* ROCm allocations are RDMA-capable through the amdgpu peer-memory driver */
    *p = (dev_prop){.type = hipMemAllocationTypePinned,
                    .requestedHandleType = hipMemHandleTypePosixFileDescriptor,
                    .location = {.type = hipMemLocationTypeDevice, .id = d}};
}

static inline void dev_access_init(dev_access *a, dev_device d)
{
    *a = (dev_access){.location = {.type = hipMemLocationTypeDevice, .id = d},
                      .flags = hipMemAccessFlagsProtReadWrite};
}

#define DEV_CLIENT_FUNCS(X)                                                                        \
    X(hipInit)                                                                                     \
    X(hipGetErrorString)                                                                           \
    X(hipGetDevice)                                                                                \
    X(hipSetDevice)                                                                                \
    X(hipGetDeviceCount)                                                                           \
    X(hipDeviceGetUuid)                                                                            \
    X(hipMemImportFromShareableHandle)                                                             \
    X(hipMemGetAllocationGranularity)                                                              \
    X(hipMemAddressReserve)                                                                        \
    X(hipMemAddressFree)                                                                           \
    X(hipMemMap)                                                                                   \
    X(hipMemUnmap)                                                                                 \
    X(hipMemSetAccess)                                                                             \
    X(hipMemRelease)                                                                               \
    X(hipMemcpy)                                                                                   \
    X(hipMemsetD8)                                                                                 \
    X(hipHostRegister)                                                                             \
    X(hipHostUnregister)                                                                           \
    X(hipHostGetDevicePointer)                                                                     \
    X(hipStreamSynchronize)                                                                        \
    X(hipStreamWriteValue32)

/* HIP has no attribute for POSIX fd handles: an import that cannot be made says so */
#define DEV_FD_HANDLES_ATTR         "POSIX fd handles of VMM allocations"
#define DEV_HOST_ALREADY            hipErrorHostMemoryAlreadyRegistered
#define dev_client_err(r, s_p)      (*(s_p) = p_hipGetErrorString(r))
#define dev_client_fd_handles(v, d) (*(v) = 1, (void)(d), hipSuccess)
#define dev_client_import(h, fd)                                                                   \
    p_hipMemImportFromShareableHandle(h, (void *)(uintptr_t)(fd),                                  \
                                      hipMemHandleTypePosixFileDescriptor)
#define dev_client_copy(dst, src, n)   p_hipMemcpy(dst, src, n, hipMemcpyDefault)
#define dev_client_zero(dst, n)        p_hipMemsetD8((hipDeviceptr_t)(dst), 0, n)
#define dev_client_wait()              p_hipStreamSynchronize(NULL)
#define dev_client_host_register(p, n) p_hipHostRegister(p, n, hipHostRegisterMapped)
#define dev_client_host_unregister(p)  p_hipHostUnregister(p)
#define dev_client_host_devptr(d_p, p) p_hipHostGetDevicePointer((void **)(d_p), p, 0)
#define dev_client_stream_write32(s, d, v)                                                         \
    p_hipStreamWriteValue32((uintptr_t)(s) == 1 ? NULL : (hipStream_t)(s), (void *)(d), v, 0)

#else
#error "dev.c is built with SD_DEV_CUDA or SD_DEV_HIP"
#endif

#endif

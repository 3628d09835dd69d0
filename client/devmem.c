/* libshard's importers of a job's shared buffers (devmem.h): host memfds, and a GPU's VMM memory
 * passed as POSIX fd handles (CUDA; its driver opened at run time, as shardd's cuda backend
 * does, so that a libshard built with CUDA's headers still runs on machines without a GPU), and
 * emu-gpu's emulated device (memfds this process cannot touch either). */
#include "devmem.h"
#include "sd/region.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

/* ---- host memory: memfds */

static int host_map(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen)
{
    /* populated: the first fetches and pushes do not take the page faults. The pool is
     * private and read-only: pages never written read the daemon's shared memory, and a write
     * lands in a private copy that the write guard catches and discards (wguard.h) */
    void *p = mmap(NULL, bytes ? bytes : 1, read_only ? PROT_READ : PROT_READ | PROT_WRITE,
                   (read_only ? MAP_PRIVATE : MAP_SHARED) | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "mmap: %s", strerror(errno));
        return -errno;
    }
    *ptr_p = p;
    return 0;
}

static void host_unmap(void *ptr, size_t bytes)
{
    munmap(ptr, bytes ? bytes : 1);
}

static int host_copy(void *dst, const void *src, size_t bytes, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    memcpy(dst, src, bytes);
    return 0;
}

static int host_zero(void *dst, size_t bytes, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    memset(dst, 0, bytes);
    return 0;
}

static const struct shard_devmem host_mem = {.name = "host",
                                             .host = true,
                                             .memfds = true,
                                             .map = host_map,
                                             .unmap = host_unmap,
                                             .copy = host_copy,
                                             .zero = host_zero};

/* ---- emu-gpu: the daemon's emulated device (memfds), mapped so that this process cannot touch
 * it either: the pointers handed out are PROT_NONE reservations, the bytes behind them are
 * reached only through copy and zero, as a GPU's through cuMemcpy. A trainer that reads a
 * fetched unit on the host faults here as it would with a GPU's pointer. */

static struct sd_regions emu_regions = SD_REGIONS_INIT;

static int emu_map(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen)
{
    size_t len = bytes ? bytes : 1;
    void *back = mmap(NULL, len, read_only ? PROT_READ : PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, 0);
    if (back == MAP_FAILED) {
        snprintf(err, errlen, "mmap: %s", strerror(errno));
        return -errno;
    }
    void *dev = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct sd_region r = {
        .dev = (uintptr_t)dev, .len = len, .back = back, .fd = -1, .read_only = read_only};
    if (dev == MAP_FAILED || sd_region_add(&emu_regions, &r) != 0) {
        if (dev != MAP_FAILED)
            munmap(dev, len);
        munmap(back, len);
        snprintf(err, errlen, "out of memory for the device's addresses");
        return -ENOMEM;
    }
    *ptr_p = dev;
    return 0;
}

static void emu_unmap(void *ptr, size_t bytes)
{
    struct sd_region r;
    (void)bytes;
    if (ptr != NULL && sd_region_remove(&emu_regions, ptr, &r)) {
        munmap(ptr, r.len);
        munmap(r.back, r.len);
    }
}

/* p's bytes behind the device address, or p itself (host memory); NULL where the copy may not
 * go (past an allocation, a write into a read-only one) */
static void *emu_at(void *p, size_t bytes, bool write, const char *what, char *err, size_t errlen)
{
    struct sd_region r;
    bool past_end;
    void *at = sd_region_host(&emu_regions, p, bytes, &past_end);
    if (at == NULL && !past_end)
        return p;
    if (past_end || (write && sd_region_find(&emu_regions, p, &r, NULL) && r.read_only)) {
        snprintf(err, errlen, "the %s (%p, %zu bytes) %s", what, p, bytes,
                 past_end ? "runs past the end of its device allocation"
                          : "is read-only device memory");
        return NULL;
    }
    return at;
}

static int emu_copy(void *dst, const void *src, size_t bytes, char *err, size_t errlen)
{
    if (bytes == 0)
        return 0;
    void *d = emu_at(dst, bytes, true, "copy's destination", err, errlen);
    void *s = d != NULL ? emu_at((void *)(uintptr_t)src, bytes, false, "copy's source", err, errlen)
                        : NULL;
    if (d == NULL || s == NULL)
        return -EFAULT;
    memcpy(d, s, bytes);
    return 0;
}

static int emu_zero(void *dst, size_t bytes, char *err, size_t errlen)
{
    void *d = bytes > 0 ? emu_at(dst, bytes, true, "destination", err, errlen) : dst;
    if (d == NULL)
        return -EFAULT;
    memset(d, 0, bytes);
    return 0;
}

static const struct shard_devmem emu_mem = {.name = "emu-gpu",
                                            .host = false,
                                            .memfds = true,
                                            .map = emu_map,
                                            .unmap = emu_unmap,
                                            .copy = emu_copy,
                                            .zero = emu_zero};

#ifdef SHARD_CLIENT_CUDA
/* ---- CUDA: VMM memory imported from POSIX fd handles */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>

#define CU_FUNCS(X)                                                                                \
    X(cuInit)                                                                                      \
    X(cuGetErrorString)                                                                            \
    X(cuDeviceGet)                                                                                 \
    X(cuDeviceGetAttribute)                                                                        \
    X(cuCtxGetCurrent)                                                                             \
    X(cuCtxGetDevice)                                                                              \
    X(cuCtxSetCurrent)                                                                             \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuMemImportFromShareableHandle)                                                              \
    X(cuMemGetAllocationPropertiesFromHandle)                                                      \
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
    X(cuStreamWriteValue32)

#define CU_STR2(x) #x
#define CU_STR(x)  CU_STR2(x)
#define CU_PTR(f)  static __typeof__(&f) p_##f;
CU_FUNCS(CU_PTR)
#undef CU_PTR

static struct {
    pthread_mutex_t lock;
    void *lib;
    CUdevice dev;
    CUcontext ctx; /* the device's primary context, where the caller had none current */
    size_t granularity;
} cu = {.lock = PTHREAD_MUTEX_INITIALIZER};

static const char *cu_err(CUresult r)
{
    const char *s = NULL;
    if (p_cuGetErrorString != NULL)
        p_cuGetErrorString(r, &s);
    return s != NULL ? s : "unknown error";
}

/* the thread has a context: its own current one, else the device's primary context */
static CUresult cu_enter(void)
{
    CUcontext cur = NULL;
    CUresult r = p_cuCtxGetCurrent(&cur);
    if (r == CUDA_SUCCESS && cur == NULL)
        r = p_cuCtxSetCurrent(cu.ctx);
    return r;
}

static size_t cu_rounded(size_t bytes)
{
    size_t g = cu.granularity, len = bytes ? bytes : 1;
    return (len + g - 1) / g * g;
}

static int cu_map(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen)
{
    CUmemGenericAllocationHandle h;
    CUdeviceptr ptr = 0;
    size_t len = cu_rounded(bytes);
    CUresult r = cu_enter();
    if (r == CUDA_SUCCESS)
        r = p_cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "importing the daemon's device memory: %s", cu_err(r));
        return -EIO;
    }
    if ((r = p_cuMemAddressReserve(&ptr, len, 0, 0, 0)) != CUDA_SUCCESS)
        goto err_release;
    if ((r = p_cuMemMap(ptr, len, 0, h, 0)) != CUDA_SUCCESS)
        goto err_free;
    /* read-only for the pool: a write through it is refused at the call, the daemon's bytes
     * stay as they are */
    CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cu.dev},
                              .flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                                 : CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    if ((r = p_cuMemSetAccess(ptr, len, &access, 1)) != CUDA_SUCCESS)
        goto err_unmap;
    p_cuMemRelease(h); /* the mapping holds the memory */
    *ptr_p = (void *)(uintptr_t)ptr;
    return 0;

err_unmap:
    p_cuMemUnmap(ptr, len);
err_free:
    p_cuMemAddressFree(ptr, len);
err_release:
    p_cuMemRelease(h);
    snprintf(err, errlen, "mapping %zu bytes of the daemon's device memory: %s", len, cu_err(r));
    return -EIO;
}

static void cu_unmap(void *ptr, size_t bytes)
{
    if (ptr == NULL || cu_enter() != CUDA_SUCCESS)
        return;
    p_cuMemUnmap((CUdeviceptr)(uintptr_t)ptr, cu_rounded(bytes));
    p_cuMemAddressFree((CUdeviceptr)(uintptr_t)ptr, cu_rounded(bytes));
}

static int cu_copy(void *dst, const void *src, size_t bytes, char *err, size_t errlen)
{
    CUresult r = cu_enter();
    if (r == CUDA_SUCCESS) /* unified addressing: host or device on either side */
        r = p_cuMemcpy((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "copying %zu bytes: %s", bytes, cu_err(r));
        return -EIO;
    }
    return 0;
}

static int cu_zero(void *dst, size_t bytes, char *err, size_t errlen)
{
    CUresult r = cu_enter();
    if (r == CUDA_SUCCESS)
        r = p_cuMemsetD8((CUdeviceptr)(uintptr_t)dst, 0, bytes);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "zeroing %zu bytes: %s", bytes, cu_err(r));
        return -EIO;
    }
    return 0;
}

/* The fence page is host memory the daemon shares (a memfd): registered with the device, a
 * stream writes it (cuStreamWriteValue32), as the H100 check of issue 40 did across processes. */
static int cu_stream_write(void *stream, uint32_t *word, uint32_t value, char *err, size_t errlen)
{
    void *page = (void *)((uintptr_t)word & ~(uintptr_t)4095);
    CUdeviceptr dptr = 0;
    CUresult r = cu_enter();
    if (r == CUDA_SUCCESS) {
        r = p_cuMemHostRegister(page, 4096, CU_MEMHOSTREGISTER_DEVICEMAP);
        if (r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
            r = CUDA_SUCCESS;
    }
    if (r == CUDA_SUCCESS)
        r = p_cuMemHostGetDevicePointer(&dptr, word, 0);
    if (r == CUDA_SUCCESS)
        r = p_cuStreamWriteValue32((CUstream)stream, dptr, value, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "signalling the fence page from CUDA stream %p: %s", stream,
                 cu_err(r));
        return -EIO;
    }
    return 0;
}

static void cu_forget_host(void *page, size_t bytes)
{
    (void)bytes;
    if (page != NULL && cu_enter() == CUDA_SUCCESS)
        p_cuMemHostUnregister(page); /* not registered (no stream signalled): an error, none */
}

static const struct shard_devmem cuda_mem = {.name = "cuda",
                                             .host = false,
                                             .map = cu_map,
                                             .unmap = cu_unmap,
                                             .copy = cu_copy,
                                             .zero = cu_zero,
                                             .stream_write = cu_stream_write,
                                             .forget_host = cu_forget_host};

static int cu_open(int device, char *err, size_t errlen)
{
    if (cu.lib != NULL)
        return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(err, errlen,
                 "the job's buffers are CUDA device memory, but libcuda.so.1 is not found here "
                 "(%s)",
                 dlerror());
        return -ENOSYS;
    }
#define CU_LOAD(f)                                                                                 \
    if ((p_##f = (__typeof__(&f))dlsym(lib, CU_STR(f))) == NULL) {                                 \
        snprintf(err, errlen, "libcuda.so.1 has no %s: the driver is too old", CU_STR(f));         \
        dlclose(lib);                                                                              \
        return -ENOSYS;                                                                            \
    }
    CU_FUNCS(CU_LOAD)
#undef CU_LOAD
    CUcontext cur = NULL;
    int fd_handles = 0;
    CUresult r = p_cuInit(0);
    if (r == CUDA_SUCCESS)
        r = p_cuCtxGetCurrent(&cur);
    /* the caller's device where it has a context (torch's), else the daemon's index */
    if (r == CUDA_SUCCESS)
        r = cur != NULL ? p_cuCtxGetDevice(&cu.dev) : p_cuDeviceGet(&cu.dev, device);
    if (r == CUDA_SUCCESS)
        r = p_cuDevicePrimaryCtxRetain(&cu.ctx, cu.dev);
    if (r == CUDA_SUCCESS)
        r = p_cuDeviceGetAttribute(
            &fd_handles, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu.dev);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "CUDA device %d: %s", device, cu_err(r));
        dlclose(lib);
        return -EIO;
    }
    if (!fd_handles) {
        snprintf(err, errlen,
                 "CUDA device %d does not import POSIX fd handles "
                 "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0)",
                 device);
        dlclose(lib);
        return -ENOSYS;
    }
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cu.dev}};
    r = p_cuMemGetAllocationGranularity(&cu.granularity, &prop,
                                        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (r != CUDA_SUCCESS || cu.granularity == 0) {
        snprintf(err, errlen, "the allocation granularity of CUDA device %d: %s", device,
                 cu_err(r));
        dlclose(lib);
        return -EIO;
    }
    cu.lib = lib;
    return 0;
}
#endif

const struct shard_devmem *shard_devmem_open(const char *kind, int device, char *err, size_t errlen)
{
    if (kind == NULL || kind[0] == '\0' || strcmp(kind, "host") == 0)
        return &host_mem;
    if (strcmp(kind, "emu-gpu") == 0)
        return &emu_mem;
#ifdef SHARD_CLIENT_CUDA
    if (strcmp(kind, "cuda") == 0) {
        pthread_mutex_lock(&cu.lock);
        int rc = cu_open(device, err, errlen);
        pthread_mutex_unlock(&cu.lock);
        return rc == 0 ? &cuda_mem : NULL;
    }
#else
    (void)device;
#endif
    snprintf(err, errlen,
             "the job's buffers are %s device memory, which this libshard cannot import (built "
             "without %s's headers; rebuild with them)",
             kind, strcmp(kind, "cuda") == 0 ? "CUDA" : kind);
    return NULL;
}

/* libshard's importer of a GPU's memory, one source over gpu/dev_api.h for CUDA
 * (devmem_cuda.c) and HIP (devmem_hip.c), as the daemon's backends are one source (gpu/dev.c).
 * The daemon's VMM allocations arrive as POSIX fd handles; each is imported
 * (MemImportFromShareableHandle), mapped at a reserved range and given access (read-only for
 * the gather pool: a write is refused at the call, the daemon's bytes stay as they are). The
 * driver is opened at run time, so one libshard runs everywhere. The fence page (host memory the
 * daemon shares) is registered with the device on the first signal a stream writes into it. */
#include "dev_api.h"
#include "devmem.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifndef DEVMEM_OPEN
#error "devmem_dev.c is built through devmem_cuda.c or devmem_hip.c"
#endif

#define DEVMEM_STR2(x) #x
#define DEVMEM_STR(x)  DEVMEM_STR2(x)
#define DEVMEM_PTR(f)  static __typeof__(&f) p_##f;
DEV_CLIENT_FUNCS(DEVMEM_PTR)
#undef DEVMEM_PTR

static struct {
    pthread_mutex_t lock;
    void *lib;
    dev_device dev;
    dev_ctx ctx; /* CUDA: the device's primary context, where the caller had none current */
    size_t granularity;
    bool loaded; /* the entry points are resolved (dm_err may ask the driver) */
} dm = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline dev_res dev_client_device_at(dev_device *d, int i);

/* do the 16 bytes of a device's UUID print as uuid (its hex digits; "GPU-", dashes and case
 * aside)? */
static bool dm_uuid_is(const unsigned char b[16], const char *uuid)
{
    static const char hex[] = "0123456789abcdef";
    int k = 0;
    for (const char *p = uuid; *p != '\0'; p++) {
        int c = tolower((unsigned char)*p);
        if (strchr(hex, c) == NULL)
            continue;
        if (k == 32 || hex[k % 2 == 0 ? b[k / 2] >> 4 : b[k / 2] & 15] != c)
            return false;
        k++;
    }
    return k == 32;
}

/* is device d the daemon's (uuid; "" says nothing: yes)? */
static bool dm_is_daemons(dev_device d, const char *uuid)
{
    dev_uuid_t u;
    return uuid[0] == '\0' ||
           (dev_uuid(&u, d) == DEV_OK && dm_uuid_is((unsigned char *)u.bytes, uuid));
}

/* the device whose UUID is uuid among those this process sees, else -1 */
static int dm_find(const char *uuid)
{
    int count = 0;
    if (uuid[0] == '\0' || dev_device_count(&count) != DEV_OK)
        return -1;
    for (int i = 0; i < count; i++) {
        dev_device d;
        if (dev_client_device_at(&d, i) == DEV_OK && dm_is_daemons(d, uuid))
            return i;
    }
    return -1;
}

#if defined(SD_DEV_CUDA)
static inline dev_res dev_client_device_at(dev_device *d, int i)
{
    return p_cuDeviceGet(d, i);
}

/* the daemon's device: the calling thread's current context's (torch's), which must be the
 * daemon's; else the one with its UUID; else device `index` */
static inline dev_res dev_client_device(dev_device *d, int index, const char *uuid, char *why,
                                        size_t len)
{
    CUcontext cur = NULL;
    dev_res r = p_cuCtxGetCurrent(&cur);
    if (r != DEV_OK)
        return r;
    if (cur != NULL) {
        r = p_cuCtxGetDevice(d);
        if (r == DEV_OK && !dm_is_daemons(*d, uuid)) {
            snprintf(why, len,
                     "this thread's current CUDA device (%d) is not the daemon's GPU %s: make that "
                     "GPU current (cudaSetDevice, torch.cuda.set_device) before registering",
                     (int)*d, uuid);
            return CUDA_ERROR_INVALID_DEVICE;
        }
        return r;
    }
    int found = dm_find(uuid);
    if (uuid[0] != '\0' && found < 0) {
        snprintf(why, len,
                 "the daemon's GPU %s is not visible to this process "
                 "(CUDA_VISIBLE_DEVICES?)",
                 uuid);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    return p_cuDeviceGet(d, found >= 0 ? found : index);
}

/* the thread has a context: its own current one, else the device's primary context c */
static inline dev_res dev_client_enter(dev_ctx c, dev_device d)
{
    (void)d;
    CUcontext cur = NULL;
    dev_res r = p_cuCtxGetCurrent(&cur);
    if (r == DEV_OK && cur == NULL)
        r = p_cuCtxSetCurrent(c);
    return r;
}

static inline void dev_client_access(dev_access *a, dev_device d, int read_only)
{
    *a = (dev_access){.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = d},
                      .flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ
                                         : CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
}
#else
static inline dev_res dev_client_device_at(dev_device *d, int i)
{
    *d = i;
    return hipSuccess;
}

/* the daemon's device: the calling thread's (HIP keeps one per thread, 0 unless set: torch
 * sets it) where it is the daemon's, else the one with its UUID */
static inline dev_res dev_client_device(dev_device *d, int index, const char *uuid, char *why,
                                        size_t len)
{
    (void)index;
    dev_res r = p_hipGetDevice(d);
    if (r != hipSuccess || dm_is_daemons(*d, uuid))
        return r;
    int found = dm_find(uuid);
    if (found < 0) {
        snprintf(why, len,
                 "the daemon's GPU %s is not visible to this process "
                 "(ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES?)",
                 uuid);
        return hipErrorInvalidDevice;
    }
    *d = found;
    return hipSuccess;
}

static inline dev_res dev_client_enter(dev_ctx c, dev_device d)
{
    (void)c;
    int cur = -1;
    dev_res r = p_hipGetDevice(&cur);
    return r == hipSuccess && cur != d ? p_hipSetDevice(d) : r;
}

static inline void dev_client_access(dev_access *a, dev_device d, int read_only)
{
    *a = (dev_access){.location = {.type = hipMemLocationTypeDevice, .id = d},
                      .flags =
                          read_only ? hipMemAccessFlagsProtRead : hipMemAccessFlagsProtReadWrite};
}
#endif

static const char *dm_err(dev_res r)
{
    const char *s = NULL;
    if (dm.loaded)
        dev_client_err(r, &s);
    return s != NULL ? s : "unknown error";
}

static size_t dm_rounded(size_t bytes)
{
    size_t g = dm.granularity, len = bytes ? bytes : 1;
    return (len + g - 1) / g * g;
}

static int dm_map(int fd, size_t bytes, bool read_only, void **ptr_p, char *err, size_t errlen)
{
    dev_handle h;
    dev_ptr ptr = 0;
    size_t len = dm_rounded(bytes);
    dev_res r = dev_client_enter(dm.ctx, dm.dev);
    if (r == DEV_OK)
        r = dev_client_import(&h, fd);
    if (r != DEV_OK) {
        snprintf(err, errlen, "importing the daemon's device memory: %s", dm_err(r));
        return -EIO;
    }
    if ((r = dev_va_reserve(&ptr, len)) != DEV_OK)
        goto err_release;
    if ((r = dev_mem_map(ptr, len, h)) != DEV_OK)
        goto err_free;
    dev_access access;
    dev_client_access(&access, dm.dev, read_only);
    if ((r = dev_mem_access(ptr, len, &access, 1)) != DEV_OK)
        goto err_unmap;
    dev_mem_release(h); /* the mapping holds the memory */
    *ptr_p = (void *)(uintptr_t)ptr;
    return 0;

err_unmap:
    dev_mem_unmap(ptr, len);
err_free:
    dev_va_free(ptr, len);
err_release:
    dev_mem_release(h);
    snprintf(err, errlen, "mapping %zu bytes of the daemon's device memory: %s", len, dm_err(r));
    return -EIO;
}

static void dm_unmap(void *ptr, size_t bytes)
{
    if (ptr == NULL || dev_client_enter(dm.ctx, dm.dev) != DEV_OK)
        return;
    dev_mem_unmap((dev_ptr)(uintptr_t)ptr, dm_rounded(bytes));
    dev_va_free((dev_ptr)(uintptr_t)ptr, dm_rounded(bytes));
}

static int dm_copy(void *dst, const void *src, size_t bytes, char *err, size_t errlen)
{
    dev_res r = dev_client_enter(dm.ctx, dm.dev);
    if (r == DEV_OK) /* unified addressing: host or device on either side */
        r = dev_client_copy(dst, src, bytes);
    /* the legacy stream's copy returns before a copy into device memory is done (from device
     * memory, or once pageable memory is staged): the daemon reads the slot once it is told */
    if (r == DEV_OK) {
        sd_devmem_waits++;
        r = dev_client_wait();
    }
    if (r != DEV_OK) {
        snprintf(err, errlen, "copying %zu bytes: %s", bytes, dm_err(r));
        return -EIO;
    }
    return 0;
}

static int dm_zero(void *dst, size_t bytes, char *err, size_t errlen)
{
    dev_res r = dev_client_enter(dm.ctx, dm.dev);
    if (r == DEV_OK)
        r = dev_client_zero(dst, bytes);
    if (r == DEV_OK) { /* a memset of device memory is asynchronous to the host */
        sd_devmem_waits++;
        r = dev_client_wait();
    }
    if (r != DEV_OK) {
        snprintf(err, errlen, "zeroing %zu bytes: %s", bytes, dm_err(r));
        return -EIO;
    }
    return 0;
}

/* The fence page is host memory the daemon shares (a memfd): registered with the device, a
 * stream writes it (StreamWriteValue32), as the H100 check of issue 40 did across processes. */
static int dm_stream_write(void *stream, uint32_t *word, uint32_t value, char *err, size_t errlen)
{
    void *page = (void *)((uintptr_t)word & ~(uintptr_t)4095);
    dev_ptr dptr = 0;
    dev_res r = dev_client_enter(dm.ctx, dm.dev);
    if (r == DEV_OK) {
        r = dev_client_host_register(page, 4096);
        if (r == DEV_HOST_ALREADY)
            r = DEV_OK;
    }
    if (r == DEV_OK)
        r = dev_client_host_devptr(&dptr, word);
    if (r == DEV_OK)
        r = dev_client_stream_write32(stream, dptr, value);
    if (r != DEV_OK) {
        snprintf(err, errlen, "signalling the fence page from %s stream %p: %s", DEV_NAME, stream,
                 dm_err(r));
        return -EIO;
    }
    return 0;
}

static void dm_forget_host(void *page, size_t bytes)
{
    (void)bytes;
    if (page != NULL && dev_client_enter(dm.ctx, dm.dev) == DEV_OK)
        dev_client_host_unregister(page); /* never registered (no stream signalled): refused */
}

static const struct shard_devmem dm_mem = {.name = DEV_NAME,
                                           .host = false,
                                           .map = dm_map,
                                           .unmap = dm_unmap,
                                           .copy = dm_copy,
                                           .zero = dm_zero,
                                           .stream_write = dm_stream_write,
                                           .forget_host = dm_forget_host};

static int dm_open(int device, const char *uuid, char *err, size_t errlen)
{
    if (dm.lib != NULL) { /* one device per process: a second job's must be the same */
        if (dm_is_daemons(dm.dev, uuid))
            return 0;
        snprintf(err, errlen,
                 "this process imports %s memory on another device than this daemon's GPU %s "
                 "(one GPU per process)",
                 DEV_NAME, uuid);
        return -EINVAL;
    }
    void *lib = dlopen(DEV_LIB, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(err, errlen,
                 "the job's buffers are %s device memory, but %s is not found here (%s)", DEV_NAME,
                 DEV_LIB, dlerror());
        return -ENOSYS;
    }
#define DEVMEM_LOAD(f)                                                                             \
    if ((p_##f = (__typeof__(&f))dlsym(lib, DEVMEM_STR(f))) == NULL) {                             \
        snprintf(err, errlen, "%s has no %s: the driver is too old", DEV_LIB, DEVMEM_STR(f));      \
        dlclose(lib);                                                                              \
        return -ENOSYS;                                                                            \
    }
    DEV_CLIENT_FUNCS(DEVMEM_LOAD)
#undef DEVMEM_LOAD
    dm.loaded = true;
    int fd_handles = 0;
    dev_prop prop;
    char why[256] = "";
    dev_res r = dev_init();
    if (r == DEV_OK)
        r = dev_client_device(&dm.dev, device, uuid, why, sizeof(why));
    if (r != DEV_OK && why[0] != '\0') {
        snprintf(err, errlen, "%s", why);
        goto err_close;
    }
    if (r == DEV_OK)
        r = dev_ctx_retain(&dm.ctx, dm.dev);
    if (r == DEV_OK)
        r = dev_client_fd_handles(&fd_handles, dm.dev);
    if (r != DEV_OK) {
        snprintf(err, errlen, "%s device %d: %s (is there a %s device here?)", DEV_NAME, device,
                 dm_err(r), DEV_NAME);
        goto err_close;
    }
    if (!fd_handles) {
        snprintf(err, errlen, "%s device %d does not import POSIX fd handles (%s is 0)", DEV_NAME,
                 device, DEV_FD_HANDLES_ATTR);
        dm.loaded = false;
        dlclose(lib);
        return -ENOSYS;
    }
    dev_prop_init(&prop, dm.dev, 0);
    r = dev_granularity(&dm.granularity, &prop);
    if (r != DEV_OK || dm.granularity == 0) {
        snprintf(err, errlen, "the allocation granularity of %s device %d: %s", DEV_NAME, device,
                 dm_err(r));
        goto err_close;
    }
    dm.lib = lib;
    return 0;

err_close:
    dm.loaded = false;
    dlclose(lib);
    return -EIO;
}

const struct shard_devmem *DEVMEM_OPEN(int device, const char *uuid, char *err, size_t errlen)
{
    pthread_mutex_lock(&dm.lock);
    int rc = dm_open(device, uuid, err, errlen);
    pthread_mutex_unlock(&dm.lock);
    return rc == 0 ? &dm_mem : NULL;
}

/* The cuda and hip backends, one source over dev_api.h: shard buffers in a GPU's memory, the
 * kernels of kern/kernels.h built by nvcc into a fatbin (sm_80, sm_90, and PTX for later GPUs) or
 * by hipcc into a code object, embedded in this binary. The driver (libcuda.so.1,
 * libamdhip64.so) is loaded at run time, as NCCL's cudawrap does, so one shardd runs everywhere:
 * open() says what is missing on a machine without it.
 *
 * Memory is allocated with the virtual memory management API (MemCreate, mapped at a reserved
 * range) with POSIX file descriptor handles: a shared buffer's fd is what the daemon passes to a
 * client over its socket (SCM_RIGHTS), as it passes a memfd for host memory, so no shared IPC
 * namespace is needed. Queues are streams; record/query are events, so the daemon waits for the
 * device without blocking its loop. */
#include "dev_api.h"
#include "host_int.h"
#include "kern_ops.h"
#include "sd/log.h"
#include "sd/region.h"
#include "sd/status.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern const unsigned char DEV_IMAGE[];

#define DEV_STR2(x) #x
#define DEV_STR(x)  DEV_STR2(x)
#define DEV_PTR(f)  static __typeof__(&f) p_##f;
DEV_FUNCS(DEV_PTR)
#undef DEV_PTR

static struct {
    void *lib;
    dev_device dev;
    dev_ctx ctx;
    dev_module mod;
    dev_fn fn[SDK_K_COUNT];
    size_t granularity;
    int rdma;  /* GPUDirect RDMA with VMM: allocations may ask for it */
    int index; /* the device driven (the driver's index) */
    char name[128];
} g;

static _Thread_local bool g_current;

/* this backend's allocations: what is_device answers from */
static struct sd_regions dev_regions = SD_REGIONS_INIT;

static const char *dev_err(dev_res r)
{
    const char *s = NULL;
#if defined(SD_DEV_CUDA)
    if (p_cuGetErrorString != NULL)
        p_cuGetErrorString(r, &s);
#else
    if (p_hipGetErrorString != NULL)
        s = p_hipGetErrorString(r);
#endif
    return s != NULL ? s : "unknown error";
}

static int status_of(dev_res r)
{
    return r == DEV_OOM ? SD_ENOMEM : r == DEV_NODEV || r == DEV_NOTSUP ? SD_ENOSYS : SD_EIO;
}

static dev_ptr dptr(const void *p)
{
    return (dev_ptr)(uintptr_t)p;
}

/* this thread uses the device's primary context */
static int enter(void)
{
    if (g_current)
        return SD_OK;
    dev_res r = dev_ctx_set(g.ctx, g.dev);
    if (r != DEV_OK) {
        SD_ERROR(DEV_NAME, "setting the context: %s", dev_err(r));
        return SD_EIO;
    }
    g_current = true;
    return SD_OK;
}

/* what device 0 must offer: VMM allocations exported as POSIX fds; RDMA is optional */
static dev_res check_device(char *err, size_t errlen)
{
#if defined(SD_DEV_CUDA)
    int vmm = 0, fds = 0;
    p_cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, g.dev);
    p_cuDeviceGetAttribute(&fds, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                           g.dev);
    p_cuDeviceGetAttribute(&g.rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                           g.dev);
    if (!vmm || !fds) {
        snprintf(err, errlen,
                 "%s (device 0) lacks %s: shardd shares device memory with trainers as POSIX "
                 "file descriptors of VMM allocations",
                 g.name,
                 !vmm ? "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                      : "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED");
        return DEV_NOTSUP;
    }
#else
    (void)err;
    (void)errlen;
    g.rdma = 1; /* HIP has no attribute for it: VMM support shows at the first allocation */
#endif
    return DEV_OK;
}

/* what sharing with trainers needs of device d, and whether RDMA can target its memory */
static void device_caps(dev_device d, bool *fds_p, bool *rdma_p)
{
#if defined(SD_DEV_CUDA)
    int fds = 0, rdma = 0;
    p_cuDeviceGetAttribute(&fds, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                           d);
    p_cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, d);
    *fds_p = fds != 0;
    *rdma_p = rdma != 0;
#else
    (void)d;    /* HIP has no attribute for either: ROCm exports VMM allocations as fds, and the
                 * amdgpu peer-memory driver makes them RDMA targets; the first allocation tells */
    *fds_p = *rdma_p = true;
#endif
}

/* every device the driver sees: its name, memory, what sharing needs, and peer access */
static int dev_devices(struct sd_gpu_device *out, int max)
{
    int count = 0;
    if (g.lib == NULL || dev_device_count(&count) != DEV_OK || count <= 0)
        return 0;
    int n = count < SD_GPU_MAX_DEVICES ? count : SD_GPU_MAX_DEVICES;
    dev_device d[SD_GPU_MAX_DEVICES];
    for (int i = 0; i < n; i++)
        if (dev_device_get(&d[i], i) != DEV_OK)
            return i;
    for (int i = 0; i < n && i < max; i++) {
        struct sd_gpu_device *o = &out[i];
        *o = (struct sd_gpu_device){.index = i};
        dev_device_name(o->name, (int)sizeof(o->name), d[i]);
        size_t bytes = 0;
        if (dev_total_mem(&bytes, d[i]) == DEV_OK)
            o->memory_bytes = bytes;
        device_caps(d[i], &o->fd_handles, &o->rdma);
        o->driven = i == g.index;
        dev_uuid_t u;
        if (dev_uuid(&u, d[i]) == DEV_OK)
            sd_gpu_uuid_format(o->uuid, sizeof(o->uuid), (const uint8_t *)u.bytes);
        for (int j = 0; j < n; j++) {
            int can = 0;
            if (j != i && dev_can_access_peer(&can, d[i], d[j]) == DEV_OK && can)
                o->peers |= 1ULL << j;
        }
    }
    return count;
}

static int dev_open(int device, char *err, size_t errlen)
{
    if (g.lib != NULL)
        return SD_OK;
    void *lib = dlopen(DEV_LIB, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(err, errlen, "the driver library %s is not found (%s): %s", DEV_LIB, DEV_LIB_HINT,
                 dlerror());
        return SD_ENOSYS;
    }
#define DEV_LOAD(f)                                                                                \
    if ((p_##f = (__typeof__(&f))dlsym(lib, DEV_STR(f))) == NULL) {                                \
        snprintf(err, errlen, "%s has no %s: the driver is too old", DEV_LIB, DEV_STR(f));         \
        dlclose(lib);                                                                              \
        return SD_ENOSYS;                                                                          \
    }
    DEV_FUNCS(DEV_LOAD)
#undef DEV_LOAD
    dev_res r;
    int count = 0, version = 0;
    dev_prop prop;
    if ((r = dev_init()) != DEV_OK || (r = dev_device_count(&count)) != DEV_OK) {
        snprintf(err, errlen, "initializing the driver (is there a %s device?): %s", DEV_NAME,
                 dev_err(r));
        goto err_close;
    }
    if (count == 0) {
        snprintf(err, errlen,
                 "no %s device is visible (CUDA_VISIBLE_DEVICES or "
                 "ROCR_VISIBLE_DEVICES?)",
                 DEV_NAME);
        r = DEV_NODEV;
        goto err_close;
    }
    dev_driver_version(&version);
    if (device < 0 || device >= count) {
        snprintf(err, errlen,
                 "devices names %s %d, and the driver sees %d (0 to %d; CUDA_VISIBLE_DEVICES or "
                 "ROCR_VISIBLE_DEVICES renumber them)",
                 DEV_NAME, device, count, count - 1);
        r = DEV_NODEV;
        goto err_close;
    }
    if ((r = dev_device_get(&g.dev, device)) != DEV_OK) {
        snprintf(err, errlen, "device %d: %s", device, dev_err(r));
        goto err_close;
    }
    g.index = device;
    dev_device_name(g.name, (int)sizeof(g.name), g.dev);
    if ((r = check_device(err, errlen)) != DEV_OK)
        goto err_close;
    if ((r = dev_ctx_retain(&g.ctx, g.dev)) != DEV_OK ||
        (r = dev_ctx_set(g.ctx, g.dev)) != DEV_OK) {
        snprintf(err, errlen, "the primary context of %s: %s", g.name, dev_err(r));
        goto err_close;
    }
    g_current = true;
    if ((r = dev_module_load(&g.mod, DEV_IMAGE)) != DEV_OK) {
        snprintf(err, errlen,
                 "loading shardd's kernels on %s: %s (built for other architectures, or a "
                 "driver older than the compiler that built them?)",
                 g.name, dev_err(r));
        goto err_close;
    }
    for (int k = 0; k < SDK_K_COUNT; k++)
        if ((r = dev_module_fn(&g.fn[k], g.mod, sdk_kernel_names[k])) != DEV_OK) {
            snprintf(err, errlen, "kernel %s: %s", sdk_kernel_names[k], dev_err(r));
            goto err_close;
        }
    dev_prop_init(&prop, g.dev, g.rdma);
    if ((r = dev_granularity(&g.granularity, &prop)) != DEV_OK || g.granularity == 0) {
        snprintf(err, errlen, "the allocation granularity of %s: %s", g.name, dev_err(r));
        goto err_close;
    }
    g.lib = lib;
    SD_INFO(DEV_NAME, "%s (device %d of %d), driver %d, granularity %zu KiB, GPUDirect RDMA %s",
            g.name, device, count, version, g.granularity >> 10, g.rdma ? "yes" : "no");
    return SD_OK;

err_close:
    dlclose(lib);
    return status_of(r);
}

static size_t rounded(size_t bytes)
{
    size_t gr = g.granularity, len = bytes ? bytes : 1;
    return (len + gr - 1) / gr * gr;
}

/* Device memory, zeroed: a VMM allocation mapped read-write for this device; with
 * SD_MEM_SHARED its POSIX fd, which a client imports (MemImportFromShareableHandle) and maps,
 * read-only where SD_MEM_CLIENT_RO. */
static int dev_alloc(size_t bytes, int flags, const char *tag, struct sd_mem *mem_p)
{
    if (g.lib == NULL || enter() != SD_OK)
        return SD_ENOSYS;
    size_t len = rounded(bytes);
    dev_prop prop;
    dev_prop_init(&prop, g.dev, g.rdma);
    dev_handle h;
    dev_ptr ptr = 0;
    int fd = -1;
    dev_res r = dev_mem_create(&h, len, &prop);
    if (r != DEV_OK) {
        SD_ERROR(DEV_NAME, "creating %zu bytes for %s: %s", len, tag, dev_err(r));
        return status_of(r);
    }
    if ((r = dev_va_reserve(&ptr, len)) != DEV_OK) {
        SD_ERROR(DEV_NAME, "reserving %zu bytes of addresses for %s: %s", len, tag, dev_err(r));
        goto err_release;
    }
    if ((r = dev_mem_map(ptr, len, h)) != DEV_OK) {
        SD_ERROR(DEV_NAME, "mapping %s: %s", tag, dev_err(r));
        goto err_free_range;
    }
    dev_access access;
    dev_access_init(&access, g.dev);
    /* the legacy stream's memset is asynchronous to the host for device memory, and the queues'
     * non-blocking streams do not wait for it: zeroed before anything of theirs touches it */
    if ((r = dev_mem_access(ptr, len, &access)) != DEV_OK || (r = dev_zero(ptr, len)) != DEV_OK ||
        (r = dev_stream_sync(NULL)) != DEV_OK) {
        SD_ERROR(DEV_NAME, "mapping %s read-write: %s", tag, dev_err(r));
        goto err_unmap;
    }
    if ((flags & SD_MEM_SHARED) && (r = dev_mem_export(&fd, h)) != DEV_OK) {
        SD_ERROR(DEV_NAME, "exporting %s as a file descriptor: %s", tag, dev_err(r));
        goto err_unmap;
    }
    if (sd_region_add(&dev_regions,
                      &(struct sd_region){.dev = (uintptr_t)ptr, .len = len, .fd = -1}) != SD_OK) {
        r = DEV_OOM;
        if (fd >= 0)
            close(fd);
        goto err_unmap;
    }
    dev_mem_release(h); /* the mapping holds the memory until it is unmapped */
    mem_p->ptr = (void *)(uintptr_t)ptr;
    mem_p->bytes = bytes;
    mem_p->fd = fd;
    return SD_OK;

err_unmap:
    dev_mem_unmap(ptr, len);
err_free_range:
    dev_va_free(ptr, len);
err_release:
    dev_mem_release(h);
    return status_of(r);
}

static void dev_free(struct sd_mem *mem)
{
    struct sd_region none;
    if (mem->ptr != NULL)
        sd_region_remove(&dev_regions, mem->ptr, &none);
    if (mem->ptr != NULL && enter() == SD_OK) {
        size_t len = rounded(mem->bytes);
        dev_mem_unmap(dptr(mem->ptr), len); /* frees the memory: its handle was released */
        dev_va_free(dptr(mem->ptr), len);
    }
    if (mem->fd >= 0)
        close(mem->fd);
    mem->ptr = NULL;
    mem->fd = -1;
    mem->bytes = 0;
}

/* ---- queues: a stream, a ring of events for record/query, pinned slots for sums */

#define DEV_EVENTS 256
#define DEV_SUMS   256

struct dev_sum {
    double *out;
    uint64_t before; /* the record count when it was enqueued: done once a later one is */
};

struct sd_gpu_queue {
    struct sdk_launcher l; /* first: the launcher is the queue */
    dev_stream s;
    dev_event ev[DEV_EVENTS];
    uint64_t recorded, reached;
    int error; /* the first failure of a launch or a copy, reported by sync and query */
    dev_ptr scratch;
    double *pinned;                /* [DEV_SUMS]: sums copied back, until published */
    struct dev_sum sums[DEV_SUMS]; /* sums not yet published, in order */
    uint32_t sums_head, sums_n;
};

static void fail(struct sd_gpu_queue *q, const char *what, dev_res r)
{
    if (q->error == SD_OK) {
        SD_ERROR(DEV_NAME, "%s: %s", what, dev_err(r));
        q->error = status_of(r) == SD_ENOMEM ? SD_ENOMEM : SD_EIO;
    }
}

static void launch(struct sdk_launcher *l, enum sdk_kernel_id id, uint64_t blocks, void **args)
{
    struct sd_gpu_queue *q = (struct sd_gpu_queue *)l;
    dev_res r = dev_launch(g.fn[id], (unsigned)blocks, SDK_THREADS_PER_BLOCK, q->s, args);
    if (r != DEV_OK)
        fail(q, sdk_kernel_names[id], r);
}

static void queue_destroy(struct sd_gpu_queue *q);

static int queue_create(struct sd_gpu_queue **q_p)
{
    if (g.lib == NULL || enter() != SD_OK)
        return SD_ENOSYS;
    struct sd_gpu_queue *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return SD_ENOMEM;
    dev_res r;
    if ((r = dev_stream_create(&q->s)) != DEV_OK)
        goto err;
    for (int i = 0; i < DEV_EVENTS; i++)
        if ((r = dev_event_create(&q->ev[i])) != DEV_OK)
            goto err;
    if ((r = dev_malloc(&q->scratch, (SDK_SUMSQ_MAX_BLOCKS + 1) * sizeof(double))) != DEV_OK ||
        (r = dev_host_malloc((void **)&q->pinned, DEV_SUMS * sizeof(double))) != DEV_OK)
        goto err;
    q->l = (struct sdk_launcher){.launch = launch, .scratch = (double *)(uintptr_t)q->scratch};
    *q_p = q;
    return SD_OK;
err:
    SD_ERROR(DEV_NAME, "creating a queue: %s", dev_err(r));
    queue_destroy(q);
    return status_of(r);
}

/* sums whose copy is done, written where their callers asked */
static void publish(struct sd_gpu_queue *q, bool all)
{
    while (q->sums_n > 0) {
        uint32_t i = q->sums_head;
        if (!all && q->sums[i].before >= q->reached)
            break;
        *q->sums[i].out = q->pinned[i];
        q->sums_head = (i + 1) % DEV_SUMS;
        q->sums_n--;
    }
}

static int queue_sync(struct sd_gpu_queue *q)
{
    if (enter() != SD_OK)
        return SD_EIO;
    dev_res r = dev_stream_sync(q->s);
    if (r != DEV_OK)
        fail(q, "synchronizing a stream", r);
    q->reached = q->recorded;
    publish(q, true);
    return q->error;
}

static void queue_destroy(struct sd_gpu_queue *q)
{
    if (q == NULL)
        return;
    if (q->s != NULL) {
        queue_sync(q);
        dev_stream_destroy(q->s);
    }
    for (int i = 0; i < DEV_EVENTS; i++)
        if (q->ev[i] != NULL)
            dev_event_destroy(q->ev[i]);
    if (q->scratch)
        dev_mfree(q->scratch);
    if (q->pinned)
        dev_host_free(q->pinned);
    free(q);
}

static int queue_record(struct sd_gpu_queue *q, uint64_t *ticket_p)
{
    if (enter() != SD_OK)
        return SD_EIO;
    if (q->recorded - q->reached >= DEV_EVENTS - 1) /* the ring is full of unreached events */
        queue_sync(q);
    uint64_t t = q->recorded + 1;
    dev_res r = dev_event_record(q->ev[t % DEV_EVENTS], q->s);
    if (r != DEV_OK) {
        fail(q, "recording an event", r);
        return q->error;
    }
    q->recorded = t;
    *ticket_p = t;
    return SD_OK;
}

static int queue_query(struct sd_gpu_queue *q, uint64_t ticket)
{
    if (ticket > q->recorded)
        return SD_EINVAL;
    if (ticket > q->reached) {
        if (enter() != SD_OK)
            return SD_EIO;
        dev_res r = dev_event_query(q->ev[ticket % DEV_EVENTS]);
        if (r == DEV_NOT_READY)
            return q->error != SD_OK ? q->error : SD_EAGAIN;
        if (r != DEV_OK)
            fail(q, "querying an event", r);
        q->reached = ticket; /* a stream runs in order: the earlier ones are done too */
        publish(q, false);
    }
    return q->error;
}

static void op_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes)
{
    dev_res r = dev_copy_async(dptr(dst), dptr(src), bytes, q->s);
    if (r != DEV_OK)
        fail(q, "copying", r);
}

static void op_zero(struct sd_gpu_queue *q, void *dst, size_t bytes)
{
    dev_res r = dev_zero_async(dptr(dst), bytes, q->s);
    if (r != DEV_OK)
        fail(q, "zeroing", r);
}

/* *out is host memory: the sum is copied into a pinned slot and written to out once a record
 * after it is reached (query) or the queue is synced, never by blocking the caller here */
static void op_sum_sq(struct sd_gpu_queue *q, const float *x, size_t n, double *out)
{
    if (q->sums_n == DEV_SUMS)
        queue_sync(q);
    uint32_t i = (q->sums_head + q->sums_n) % DEV_SUMS;
    sdk_sum_sq(&q->l, x, n);
    dev_res r = dev_copy_dtoh_async(&q->pinned[i], dptr(q->l.scratch + SDK_SUMSQ_MAX_BLOCKS),
                                    sizeof(double), q->s);
    if (r != DEV_OK)
        fail(q, "copying a sum back", r);
    q->sums[i] = (struct dev_sum){.out = out, .before = q->recorded};
    q->sums_n++;
}

static bool dev_is_device(const void *p)
{
    return sd_region_find(&dev_regions, p, NULL, NULL);
}

/* page-locked host memory the device copies into and out of at full speed */
static int dev_pinned_alloc(size_t bytes, void **p_p)
{
    if (g.lib == NULL || enter() != SD_OK)
        return SD_ENOSYS;
    dev_res r = dev_host_malloc(p_p, bytes ? bytes : 1);
    if (r != DEV_OK) {
        SD_ERROR(DEV_NAME, "allocating %zu bytes of pinned host memory: %s", bytes, dev_err(r));
        return status_of(r);
    }
    return SD_OK;
}

/* the device FI_HMEM registrations name: the one this backend drives */
static int dev_hmem_device(void)
{
    return g.index;
}

static void dev_pinned_free(void *p)
{
    if (p != NULL && enter() == SD_OK)
        dev_host_free(p);
}

const struct sd_gpu_ops DEV_OPS = {
    .name = DEV_NAME,
    .client_memory = DEV_NAME,
    .host_memory = false,
    .open = dev_open,
    .devices = dev_devices,
    .alloc = dev_alloc,
    .free = dev_free,
    .queue_create = queue_create,
    .queue_destroy = queue_destroy,
    .sync = queue_sync,
    .record = queue_record,
    .query = queue_query,
    .copy = op_copy,
    .zero = op_zero,
    .sum_sq = op_sum_sq,
    .is_device = dev_is_device,
    .hmem = DEV_HMEM,
    .hmem_device = dev_hmem_device,
    .pinned_alloc = dev_pinned_alloc,
    .pinned_free = dev_pinned_free,
    SDK_KERNEL_OPS,
};

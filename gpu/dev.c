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

/* one device opened (config devices): its primary context, and the kernels loaded there */
struct dev_gpu {
    dev_device dev;
    dev_ctx ctx;
    dev_module mod;
    dev_fn fn[SDK_K_COUNT];
    size_t granularity;
    int rdma;            /* GPUDirect RDMA with VMM: allocations may ask for it */
    int index;           /* the driver's index */
    uint64_t peers;      /* bit j: its kernels read and write opened device j's memory */
    uint64_t used, peak; /* bytes of shardd's allocations on it (the loop's and its workers') */
    char name[128];
};

static struct {
    void *lib;
    int n; /* devices opened, by their place in d (the queues' and regions' numbering) */
    struct dev_gpu d[SD_GPU_MAX_DEVICES];
} g;

/* the opened device whose context this thread uses (-1: none yet) */
static _Thread_local int g_current = -1;

/* this backend's allocations (with the opened device each lives on): what is_device answers */
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

/* this thread uses opened device i's primary context */
static int enter(int i)
{
    if (g_current == i)
        return SD_OK;
    dev_res r = dev_ctx_set(g.d[i].ctx, g.d[i].dev);
    if (r != DEV_OK) {
        SD_ERROR(DEV_NAME, "setting the context of %s (device %d): %s", g.d[i].name, g.d[i].index,
                 dev_err(r));
        return SD_EIO;
    }
    g_current = i;
    return SD_OK;
}

/* bytes allocated (negative: freed) on opened device i, and its peak */
static void count(int i, int64_t bytes)
{
    sd__mem_count(&g.d[i].used, &g.d[i].peak, bytes);
}

/* the opened device with the driver's index `index`, else -1 */
static int opened(int index)
{
    for (int i = 0; i < g.n; i++)
        if (g.d[i].index == index)
            return i;
    return -1;
}

/* what a device must offer: VMM allocations exported as POSIX fds; RDMA is optional */
static dev_res check_device(struct dev_gpu *o, char *err, size_t errlen)
{
#if defined(SD_DEV_CUDA)
    int vmm = 0, fds = 0;
    p_cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, o->dev);
    p_cuDeviceGetAttribute(&fds, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                           o->dev);
    p_cuDeviceGetAttribute(&o->rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                           o->dev);
    if (!vmm || !fds) {
        snprintf(err, errlen,
                 "%s (device %d) lacks %s: shardd shares device memory with trainers as POSIX "
                 "file descriptors of VMM allocations",
                 o->name, o->index,
                 !vmm ? "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                      : "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED");
        return DEV_NOTSUP;
    }
#else
    (void)err;
    (void)errlen;
    o->rdma = 1; /* HIP has no attribute for it: VMM support shows at the first allocation */
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
    (void)d;     /* HIP has no attribute for either: ROCm exports VMM allocations as fds, and the
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
        int k = opened(i);
        o->driven = k >= 0;
        if (k >= 0) {
            o->used_bytes = __atomic_load_n(&g.d[k].used, __ATOMIC_RELAXED);
            o->peak_bytes = __atomic_load_n(&g.d[k].peak, __ATOMIC_RELAXED);
        }
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

/* device `index` into o: its context current, its kernels loaded */
static dev_res open_one(struct dev_gpu *o, int index, int count, char *err, size_t errlen)
{
    dev_res r;
    if (index < 0 || index >= count) {
        snprintf(err, errlen,
                 "devices names %s %d, and the driver sees %d (0 to %d; CUDA_VISIBLE_DEVICES or "
                 "ROCR_VISIBLE_DEVICES renumber them)",
                 DEV_NAME, index, count, count - 1);
        return DEV_NODEV;
    }
    if ((r = dev_device_get(&o->dev, index)) != DEV_OK) {
        snprintf(err, errlen, "device %d: %s", index, dev_err(r));
        return r;
    }
    o->index = index;
    dev_device_name(o->name, (int)sizeof(o->name), o->dev);
    if ((r = check_device(o, err, errlen)) != DEV_OK)
        return r;
    if ((r = dev_ctx_retain(&o->ctx, o->dev)) != DEV_OK ||
        (r = dev_ctx_set(o->ctx, o->dev)) != DEV_OK) {
        snprintf(err, errlen, "the primary context of %s: %s", o->name, dev_err(r));
        return r;
    }
    g_current = -1; /* set below, once every device is in */
    if ((r = dev_module_load(&o->mod, DEV_IMAGE)) != DEV_OK) {
        snprintf(err, errlen,
                 "loading shardd's kernels on %s: %s (built for other architectures, or a "
                 "driver older than the compiler that built them?)",
                 o->name, dev_err(r));
        return r;
    }
    for (int k = 0; k < SDK_K_COUNT; k++)
        if ((r = dev_module_fn(&o->fn[k], o->mod, sdk_kernel_names[k])) != DEV_OK) {
            snprintf(err, errlen, "kernel %s: %s", sdk_kernel_names[k], dev_err(r));
            return r;
        }
    dev_prop prop;
    dev_prop_init(&prop, o->dev, o->rdma);
    if ((r = dev_granularity(&o->granularity, &prop)) != DEV_OK || o->granularity == 0) {
        snprintf(err, errlen, "the allocation granularity of %s: %s", o->name, dev_err(r));
        return r != DEV_OK ? r : DEV_NOTSUP;
    }
    return DEV_OK;
}

static int dev_open(const int *devices, int n, char *err, size_t errlen)
{
    if (g.lib != NULL)
        return SD_OK;
    if (n < 0 || n > SD_GPU_MAX_DEVICES) {
        snprintf(err, errlen, "%d devices to open (at most %d)", n, SD_GPU_MAX_DEVICES);
        return SD_EINVAL;
    }
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
    g.n = 0;
    int all = count < SD_GPU_MAX_DEVICES ? count : SD_GPU_MAX_DEVICES;
    for (int i = 0; i < (n > 0 ? n : all); i++) {
        if ((r = open_one(&g.d[i], n > 0 ? devices[i] : i, count, err, errlen)) != DEV_OK)
            goto err_close;
        g.n = i + 1;
    }
    /* peer access: each device's memory is mapped for the others that reach it (dev_alloc) */
    for (int i = 0; i < g.n; i++)
        for (int j = 0; j < g.n; j++) {
            int can = 0;
            if (j != i && dev_can_access_peer(&can, g.d[i].dev, g.d[j].dev) == DEV_OK && can)
                g.d[i].peers |= 1ULL << j;
        }
    g.lib = lib;
    if (enter(0) != SD_OK) {
        snprintf(err, errlen, "the context of %s would not become current", g.d[0].name);
        g.lib = NULL;
        r = DEV_NOTSUP;
        goto err_close;
    }
    for (int i = 0; i < g.n; i++)
        SD_INFO(DEV_NAME,
                "%s (device %d of %d), driver %d, granularity %zu KiB, GPUDirect RDMA %s, peer "
                "access to %d of the %d others opened",
                g.d[i].name, g.d[i].index, count, version, g.d[i].granularity >> 10,
                g.d[i].rdma ? "yes" : "no", __builtin_popcountll(g.d[i].peers), g.n - 1);
    return SD_OK;

err_close:
    g.n = 0;
    dlclose(lib);
    return status_of(r);
}

static size_t rounded(int i, size_t bytes)
{
    size_t gr = g.d[i].granularity, len = bytes ? bytes : 1;
    return (len + gr - 1) / gr * gr;
}

/* Device memory, zeroed: a VMM allocation on device `index`, mapped read-write for it and for
 * every opened device with peer access to it; with SD_MEM_SHARED its POSIX fd, which a client
 * imports (MemImportFromShareableHandle) and maps, read-only where SD_MEM_CLIENT_RO. */
static int dev_alloc(int index, size_t bytes, int flags, const char *tag, struct sd_mem *mem_p)
{
    int i = g.lib != NULL ? opened(index) : -1;
    if (i < 0) {
        SD_ERROR(DEV_NAME, "allocating %s on device %d, which shardd did not open (devices)", tag,
                 index);
        return g.lib == NULL ? SD_ENOSYS : SD_EINVAL;
    }
    if (enter(i) != SD_OK)
        return SD_EIO;
    size_t len = rounded(i, bytes);
    dev_prop prop;
    dev_prop_init(&prop, g.d[i].dev, g.d[i].rdma);
    dev_handle h;
    dev_ptr ptr = 0;
    int fd = -1;
    dev_res r = dev_mem_create(&h, len, &prop);
    if (r != DEV_OK) {
        SD_ERROR(DEV_NAME, "creating %zu bytes for %s on %s: %s", len, tag, g.d[i].name,
                 dev_err(r));
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
    dev_access access[SD_GPU_MAX_DEVICES];
    int n_access = 0;
    for (int j = 0; j < g.n; j++)
        if (j == i || (g.d[j].peers >> i & 1))
            dev_access_init(&access[n_access++], g.d[j].dev);
    /* the legacy stream's memset is asynchronous to the host for device memory, and the queues'
     * non-blocking streams do not wait for it: zeroed before anything of theirs touches it */
    if ((r = dev_mem_access(ptr, len, access, (size_t)n_access)) != DEV_OK ||
        (r = dev_zero(ptr, len)) != DEV_OK || (r = dev_stream_sync(NULL)) != DEV_OK) {
        SD_ERROR(DEV_NAME, "mapping %s read-write: %s", tag, dev_err(r));
        goto err_unmap;
    }
    if ((flags & SD_MEM_SHARED) && (r = dev_mem_export(&fd, h)) != DEV_OK) {
        SD_ERROR(DEV_NAME, "exporting %s as a file descriptor: %s", tag, dev_err(r));
        goto err_unmap;
    }
    struct sd_region reg = {.dev = (uintptr_t)ptr, .len = len, .fd = -1, .device = i};
    if (sd_region_add(&dev_regions, &reg) != SD_OK) {
        r = DEV_OOM;
        if (fd >= 0)
            close(fd);
        goto err_unmap;
    }
    dev_mem_release(h); /* the mapping holds the memory until it is unmapped */
    count(i, (int64_t)len);
    *mem_p =
        (struct sd_mem){.ptr = (void *)(uintptr_t)ptr, .bytes = bytes, .fd = fd, .device = index};
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
    struct sd_region reg;
    if (mem->ptr != NULL && sd_region_remove(&dev_regions, mem->ptr, &reg) &&
        enter(reg.device) == SD_OK) {
        count(reg.device, -(int64_t)reg.len);
        dev_mem_unmap(dptr(mem->ptr), reg.len); /* frees the memory: its handle was released */
        dev_va_free(dptr(mem->ptr), reg.len);
    }
    if (mem->fd >= 0)
        close(mem->fd);
    mem->ptr = NULL;
    mem->fd = -1;
    mem->bytes = 0;
}

/* ---- queues: a stream per device used (a lane), a ring of events for record/query, pinned
 * slots for sums. The queue's work runs in one order over its lanes: moving to another device,
 * it records the lane it leaves (link) and the next lane's stream waits for that, so the last
 * lane used has everything enqueued before behind it, and its events and its sync cover all. */

#define DEV_EVENTS 256
#define DEV_SUMS   256

struct dev_sum {
    double *out;
    uint64_t before; /* the record count when it was enqueued: done once a later one is */
};

/* the queue on one opened device, made at its first use */
struct dev_lane {
    dev_stream s;
    dev_event link;  /* recorded when the queue moves on to another device */
    dev_ptr scratch; /* the sum of squares' partials and result */
    dev_ptr near;    /* sources brought over from a device without peer access to this one */
    size_t near_bytes;
};

struct sd_gpu_queue {
    struct sdk_launcher l; /* first: the launcher is the queue; l.cur: the lane in use */
    struct dev_lane lane[SD_GPU_MAX_DEVICES];
    dev_event ev[DEV_EVENTS]; /* made on lane ev_lane[i]'s device, recorded on its stream */
    int ev_lane[DEV_EVENTS];
    uint64_t recorded, reached;
    int error;      /* the first failure of a launch or a copy, reported by sync and query */
    double *pinned; /* [DEV_SUMS]: sums copied back, until published */
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

/* lane i's stream, made with its scratch at its first use, its device's context current */
static struct dev_lane *lane(struct sd_gpu_queue *q, int i)
{
    struct dev_lane *ln = &q->lane[i];
    if (enter(i) != SD_OK) {
        fail(q, "entering a device's context", DEV_NOTSUP);
        return NULL;
    }
    if (ln->s != NULL)
        return ln;
    dev_res r;
    dev_stream s = NULL;
    dev_event link = NULL;
    dev_ptr scratch = 0;
    if ((r = dev_stream_create(&s)) != DEV_OK || (r = dev_event_create(&link)) != DEV_OK ||
        (r = dev_malloc(&scratch, (SDK_SUMSQ_MAX_BLOCKS + 1) * sizeof(double))) != DEV_OK) {
        fail(q, "creating a queue's stream", r);
        if (link != NULL)
            dev_event_destroy(link);
        if (s != NULL)
            dev_stream_destroy(s);
        return NULL; /* nothing half made is kept: the next use tries again */
    }
    *ln = (struct dev_lane){.s = s, .link = link, .scratch = scratch};
    return ln;
}

static void launch(struct sdk_launcher *l, enum sdk_kernel_id id, uint64_t blocks, void **args)
{
    struct sd_gpu_queue *q = (struct sd_gpu_queue *)l;
    struct dev_lane *ln = lane(q, l->cur);
    dev_res r = ln == NULL ? DEV_NOTSUP
                           : dev_launch(g.d[l->cur].fn[id], (unsigned)blocks, SDK_THREADS_PER_BLOCK,
                                        ln->s, args);
    if (r != DEV_OK)
        fail(q, sdk_kernel_names[id], r);
}

static int device_of(struct sdk_launcher *l, const void *p)
{
    (void)l;
    struct sd_region reg;
    return p != NULL && sd_region_find(&dev_regions, p, &reg, NULL) ? reg.device : -1;
}

/* lane `to` waits for everything enqueued on lane `from` so far (its link event: recorded in
 * from's context, waited for in to's) */
static void link_lanes(struct sd_gpu_queue *q, int from, int to)
{
    struct dev_lane *f = lane(q, from);
    dev_res r = f == NULL ? DEV_NOTSUP : dev_event_record(f->link, f->s);
    struct dev_lane *t = r == DEV_OK ? lane(q, to) : NULL;
    if (r == DEV_OK)
        r = t == NULL ? DEV_NOTSUP : dev_stream_wait(t->s, f->link);
    if (r != DEV_OK)
        fail(q, "ordering a queue's work across devices", r);
}

/* what follows runs on lane d */
static void run_on(struct sdk_launcher *l, int d)
{
    struct dev_lane *ln = lane((struct sd_gpu_queue *)l, d);
    l->cur = d;
    if (ln != NULL)
        l->scratch = (double *)(uintptr_t)ln->scratch;
}

/* what follows runs on lane d, after everything enqueued so far (on lane cur) */
static void use(struct sdk_launcher *l, int d)
{
    link_lanes((struct sd_gpu_queue *)l, l->cur, d);
    run_on(l, d);
}

/* what follows runs on lane d after lane from's work so far, beside other branches */
static void branch(struct sdk_launcher *l, int from, int d)
{
    if (d != from)
        link_lanes((struct sd_gpu_queue *)l, from, d);
    run_on(l, d);
}

/* lane from waits for every branch (devs), and what follows runs there: one order again */
static void merge(struct sdk_launcher *l, int from, uint64_t devs)
{
    for (uint64_t left = devs & ~(1ULL << from); left != 0; left &= left - 1)
        link_lanes((struct sd_gpu_queue *)l, __builtin_ctzll(left), from);
    run_on(l, from);
}

static bool peer(struct sdk_launcher *l, int d, int e)
{
    (void)l;
    return d == e || (g.d[d].peers >> e & 1);
}

/* src copied over to lane cur's device (no peer access: the driver stages the copy) */
static const void *bring(struct sdk_launcher *l, const void *src, size_t bytes)
{
    struct sd_gpu_queue *q = (struct sd_gpu_queue *)l;
    struct dev_lane *ln = lane(q, l->cur);
    if (ln == NULL)
        return src;
    dev_res r = DEV_OK;
    if (ln->near_bytes < bytes) { /* the old one may still be read by work enqueued */
        if (ln->near && (r = dev_stream_sync(ln->s)) == DEV_OK)
            dev_mfree(ln->near);
        ln->near = 0;
        ln->near_bytes = 0;
        if (r == DEV_OK && (r = dev_malloc(&ln->near, bytes)) == DEV_OK)
            ln->near_bytes = bytes;
    }
    if (r == DEV_OK)
        r = dev_copy_async(ln->near, dptr(src), bytes, ln->s);
    if (r != DEV_OK) {
        fail(q, "bringing a source over from another device", r);
        return src;
    }
    return (const void *)(uintptr_t)ln->near;
}

static void op_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes);

static void lane_copy(struct sdk_launcher *l, void *dst, const void *src, size_t bytes)
{
    op_copy((struct sd_gpu_queue *)l, dst, src, bytes);
}

static void queue_destroy(struct sd_gpu_queue *q);

static int queue_create(struct sd_gpu_queue **q_p)
{
    if (g.lib == NULL || enter(0) != SD_OK)
        return SD_ENOSYS;
    struct sd_gpu_queue *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return SD_ENOMEM;
    dev_res r = DEV_OK;
    struct dev_lane *first = lane(q, 0);
    if (first == NULL) {
        queue_destroy(q);
        return SD_ENOMEM;
    }
    for (int i = 0; i < DEV_EVENTS; i++)
        if ((r = dev_event_create(&q->ev[i])) != DEV_OK)
            goto err;
    if ((r = dev_host_malloc((void **)&q->pinned, DEV_SUMS * sizeof(double))) != DEV_OK)
        goto err;
    q->l = (struct sdk_launcher){
        .launch = launch, .scratch = (double *)(uintptr_t)first->scratch, .cur = 0};
    static const struct sdk_route route = {.device_of = device_of,
                                           .use = use,
                                           .peer = peer,
                                           .bring = bring,
                                           .copy = lane_copy,
                                           .branch = branch,
                                           .merge = merge};
    q->l.route = g.n > 1 ? &route : NULL; /* one device: no lookups */
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
    struct dev_lane *ln = lane(q, q->l.cur); /* it has all the work behind it */
    dev_res r = ln == NULL ? DEV_NOTSUP : dev_stream_sync(ln->s);
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
    if (q->lane[q->l.cur].s != NULL)
        queue_sync(q);
    for (int i = 0; i < DEV_EVENTS; i++)
        if (q->ev[i] != NULL && enter(q->ev_lane[i]) == SD_OK)
            dev_event_destroy(q->ev[i]);
    for (int i = 0; i < g.n; i++) {
        struct dev_lane *ln = &q->lane[i];
        if (ln->s == NULL || enter(i) != SD_OK) /* made whole or not at all */
            continue;
        dev_stream_destroy(ln->s);
        dev_event_destroy(ln->link);
        dev_mfree(ln->scratch);
        if (ln->near)
            dev_mfree(ln->near);
    }
    if (q->pinned)
        dev_host_free(q->pinned);
    free(q);
}

static int queue_record(struct sd_gpu_queue *q, uint64_t *ticket_p)
{
    if (q->recorded - q->reached >= DEV_EVENTS - 1) /* the ring is full of unreached events */
        queue_sync(q);
    uint64_t t = q->recorded + 1;
    uint32_t e = (uint32_t)(t % DEV_EVENTS);
    struct dev_lane *ln = lane(q, q->l.cur);
    dev_res r = ln == NULL ? DEV_NOTSUP : DEV_OK;
    if (r == DEV_OK && (q->ev[e] == NULL || q->ev_lane[e] != q->l.cur)) {
        /* an event is its device's: made anew on this one */
        if (q->ev[e] != NULL && enter(q->ev_lane[e]) == SD_OK)
            dev_event_destroy(q->ev[e]);
        q->ev[e] = NULL;
        r = enter(q->l.cur) != SD_OK ? DEV_NOTSUP : dev_event_create(&q->ev[e]);
        if (r == DEV_OK)
            q->ev_lane[e] = q->l.cur;
    }
    if (r == DEV_OK && enter(q->l.cur) == SD_OK)
        r = dev_event_record(q->ev[e], ln->s);
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
        int e = (int)(ticket % DEV_EVENTS);
        if (enter(q->ev_lane[e]) != SD_OK)
            return SD_EIO;
        dev_res r = dev_event_query(q->ev[e]);
        if (r == DEV_NOT_READY)
            return q->error != SD_OK ? q->error : SD_EAGAIN;
        if (r != DEV_OK)
            fail(q, "querying an event", r);
        q->reached = ticket; /* the queue runs in one order: the earlier ones are done too */
        publish(q, false);
    }
    return q->error;
}

/* a copy runs where its destination is device memory, else where its source is */
static void op_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes)
{
    struct sdk_launcher *l = &q->l;
    sdk_at(l, l->route != NULL && device_of(l, dst) < 0 ? src : dst);
    struct dev_lane *ln = lane(q, l->cur);
    dev_res r = ln == NULL ? DEV_NOTSUP : dev_copy_async(dptr(dst), dptr(src), bytes, ln->s);
    if (r != DEV_OK)
        fail(q, "copying", r);
}

static void op_zero(struct sd_gpu_queue *q, void *dst, size_t bytes)
{
    sdk_at(&q->l, dst);
    struct dev_lane *ln = lane(q, q->l.cur);
    dev_res r = ln == NULL ? DEV_NOTSUP : dev_zero_async(dptr(dst), bytes, ln->s);
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
    sdk_sum_sq(&q->l, x, n); /* on x's device: its scratch */
    struct dev_lane *ln = lane(q, q->l.cur);
    dev_res r = ln == NULL
                    ? DEV_NOTSUP
                    : dev_copy_dtoh_async(&q->pinned[i], dptr(q->l.scratch + SDK_SUMSQ_MAX_BLOCKS),
                                          sizeof(double), ln->s);
    if (r != DEV_OK)
        fail(q, "copying a sum back", r);
    q->sums[i] = (struct dev_sum){.out = out, .before = q->recorded};
    q->sums_n++;
}

static bool dev_is_device(const void *p)
{
    return sd_region_find(&dev_regions, p, NULL, NULL);
}

/* page-locked host memory the devices copy into and out of at full speed (portable: unified
 * addressing makes it every context's) */
static int dev_pinned_alloc(size_t bytes, void **p_p)
{
    if (g.lib == NULL || enter(g_current >= 0 ? g_current : 0) != SD_OK)
        return SD_ENOSYS;
    dev_res r = dev_host_malloc(p_p, bytes ? bytes : 1);
    if (r != DEV_OK) {
        SD_ERROR(DEV_NAME, "allocating %zu bytes of pinned host memory: %s", bytes, dev_err(r));
        return status_of(r);
    }
    return SD_OK;
}

/* the device FI_HMEM registrations of p name: the one it lives on */
static int dev_hmem_device(const void *p)
{
    struct sd_region reg;
    return sd_region_find(&dev_regions, p, &reg, NULL) ? g.d[reg.device].index : g.d[0].index;
}

static void dev_pinned_free(void *p)
{
    if (p != NULL && enter(g_current >= 0 ? g_current : 0) == SD_OK)
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

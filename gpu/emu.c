/* The emu backend: host memory, and the device backends' kernels (kern/kernels.h) compiled for
 * the host through kern/compat.h's emulation, each block's threads run in order. It runs the
 * one kernel source wherever shardd runs, so CI (no GPU) tests the kernels against the host
 * backend (tests/unit/test_kernels.c) and trains through them (test_fidelity ... emu); on a
 * GPU the device's results are compared with it bit for bit. */
#include "host_int.h"
#include "kern/kernels.h"
#include "kern_ops.h"
#include "sd/status.h"

#include "sd/log.h"
#include "sd/region.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

_Thread_local struct sdk_emu sdk_emu;

/* the most devices emu-gpu emulates ($SHARDD_EMU_GPUS) */
#define SD_EMU_MAX_GPUS 8
/* the tickets emu-gpu-deferred remembers the age of ($SHARDD_EMU_LAG_MS) */
#define EMU_LAG_RING 256

/* emu-gpu-deferred: how long each ticket stays "not yet" ($SHARDD_EMU_LAG_MS; 0: only its
 * first query), read when the backend opens */
static uint64_t emu_lag_ns;

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
    case SDK_K_GATHER:
        sdk_k_gather(A(struct sdk_pieces, 0));
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
    uint64_t lagged; /* emu-gpu-deferred: the newest ticket a query answered "not yet" */
    uint64_t rec_ns[EMU_LAG_RING]; /* emu-gpu-deferred: when ticket t % EMU_LAG_RING was recorded */
    /* emu-gpu: where sources a device cannot read are brought (sdk_launcher.bring), per device */
    struct sd_mem *near;
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

static void emu_gpu_free(struct sd_mem *mem);

static void emu_queue_destroy(struct sd_gpu_queue *q)
{
    if (q == NULL)
        return;
    for (int d = 0; q->near != NULL && d < SD_EMU_MAX_GPUS; d++)
        emu_gpu_free(&q->near[d]);
    free(q->near);
    free(q);
}

static int emu_record(struct sd_gpu_queue *q, uint64_t *ticket_p)
{
    *ticket_p = ++q->recorded;
    if (emu_lag_ns > 0)
        q->rec_ns[q->recorded % EMU_LAG_RING] = sd_now_ns();
    return SD_OK;
}

static int emu_query(struct sd_gpu_queue *q, uint64_t ticket)
{
    return ticket <= q->recorded ? SD_OK : SD_EINVAL;
}

/* emu-gpu-deferred: the first query of each ticket newer than any asked before answers "not
 * yet", as a busy GPU's does (the kernels themselves ran at their launch), so that the daemon's
 * polled waits on device memory are taken where no GPU is */
static int emu_query_lagging(struct sd_gpu_queue *q, uint64_t ticket)
{
    if (ticket <= q->recorded && ticket > q->lagged) {
        q->lagged = ticket;
        return SD_EAGAIN;
    }
    if (emu_lag_ns > 0 && ticket <= q->recorded && q->recorded - ticket < EMU_LAG_RING &&
        sd_now_ns() - q->rec_ns[ticket % EMU_LAG_RING] < emu_lag_ns)
        return SD_EAGAIN; /* a device busy that long with what came before */
    return emu_query(q, ticket);
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
        out[0] = (struct sd_gpu_device){.index = 0,
                                        .memory_bytes = sd__host_memory_bytes(),
                                        .fd_handles = true,
                                        .driven = true};
        snprintf(out[0].name, sizeof(out[0].name), "emulated (host memory)");
    }
    return 1;
}

/* emu-gpu: the emulation with the device's memory out of the host's reach, as a GPU's is. An
 * allocation is host memory (its backing, a memfd where shared) that only the backend touches;
 * the daemon gets the address of a reservation of the same size mapped PROT_NONE (its "device
 * address"), so that any read or write of it on the host faults at once, where a GPU's pointer
 * would have read garbage or crashed. Copies and kernels translate device addresses into the
 * backing; a kernel given memory that is not the device's (host memory a GPU's kernel could not
 * read) aborts the daemon naming the kernel, as does an address past the end of an allocation.
 * Clients map the shared allocations' memfds as they do the host backend's: only the daemon's
 * side is a device. */
static struct sd_regions emu_regions = SD_REGIONS_INIT;

/* emu-gpu's devices: how many it sees ($SHARDD_EMU_GPUS, 1 to 8, default 1), which were opened,
 * whether they reach each other's memory ($SHARDD_EMU_PEERS: "all", the default, or "none",
 * where a kernel given another device's memory aborts as a GPU's without peer access faults),
 * and how much memory each has ($SHARDD_EMU_GPU_BYTES: an allocation past it fails) */
static struct {
    int count;
    bool opened[SD_EMU_MAX_GPUS];
    bool peers;
    uint64_t used[SD_EMU_MAX_GPUS], peak[SD_EMU_MAX_GPUS]; /* bytes allocated on each */
    uint64_t capacity; /* each one's memory ($SHARDD_EMU_GPU_BYTES; 0: the host's) */
} emu_gpus = {.count = 1, .opened = {true}, .peers = true};

static void emu_gpu_count(int device, int64_t bytes)
{
    sd__mem_count(&emu_gpus.used[device], &emu_gpus.peak[device], bytes);
}

/* SHARDD_EMU_* shape the emulation for the suite, in test builds only (SHARD_TEST_HOOKS): a
 * production build's emu-gpu is one GPU with the host's memory, whatever the environment says */
static const char *emu_env(const char *name)
{
#ifdef SD_TEST_HOOKS
    return getenv(name);
#else
    (void)name;
    return NULL;
#endif
}

static int emu_gpu_open(const int *devices, int n, char *err, size_t errlen)
{
    const char *count = emu_env("SHARDD_EMU_GPUS"), *peers = emu_env("SHARDD_EMU_PEERS");
    char *end = NULL;
    long c = count != NULL ? strtol(count, &end, 10) : 1;
    if (count != NULL && (end == count || *end != '\0' || c < 1 || c > SD_EMU_MAX_GPUS)) {
        snprintf(err, errlen, "SHARDD_EMU_GPUS is '%s', not a count of 1 to %d", count,
                 SD_EMU_MAX_GPUS);
        return SD_ECONFIG;
    }
    if (peers != NULL && strcmp(peers, "all") != 0 && strcmp(peers, "none") != 0) {
        snprintf(err, errlen, "SHARDD_EMU_PEERS is '%s', not all or none", peers);
        return SD_ECONFIG;
    }
    const char *lag = emu_env("SHARDD_EMU_LAG_MS");
    long lag_ms = lag != NULL ? strtol(lag, &end, 10) : 0;
    if (lag != NULL && (end == lag || *end != '\0' || lag_ms < 0 || lag_ms > 60000)) {
        snprintf(err, errlen, "SHARDD_EMU_LAG_MS is '%s', not 0 to 60000 ms", lag);
        return SD_ECONFIG;
    }
    emu_lag_ns = (uint64_t)lag_ms * 1000000u;
    const char *cap = emu_env("SHARDD_EMU_GPU_BYTES");
    unsigned long long cap_bytes = cap != NULL ? strtoull(cap, &end, 10) : 0;
    if (cap != NULL && (end == cap || *end != '\0' || cap_bytes == 0)) {
        snprintf(err, errlen, "SHARDD_EMU_GPU_BYTES is '%s', not a number of bytes", cap);
        return SD_ECONFIG;
    }
    emu_gpus.capacity = cap_bytes;
    emu_gpus.count = (int)c;
    emu_gpus.peers = peers == NULL || strcmp(peers, "all") == 0;
    for (int i = 0; i < SD_EMU_MAX_GPUS; i++)
        emu_gpus.opened[i] = n == 0 && i < emu_gpus.count; /* n 0: every one seen */
    for (int i = 0; i < n; i++) {
        if (devices[i] < 0 || devices[i] >= emu_gpus.count) {
            snprintf(err, errlen,
                     "devices names emu-gpu %d, and the emulation sees %d (0 to %d; "
                     "a test build's SHARDD_EMU_GPUS sets how many)",
                     devices[i], emu_gpus.count, emu_gpus.count - 1);
            return SD_ENOSYS;
        }
        emu_gpus.opened[devices[i]] = true;
    }
    return SD_OK;
}

/* emu-gpu's devices: memory as the host's, shared as memfds; peer access as set */
static int emu_gpu_devices(struct sd_gpu_device *out, int max)
{
    for (int i = 0; i < emu_gpus.count && i < max; i++) {
        out[i] = (struct sd_gpu_device){
            .index = i,
            .memory_bytes = emu_gpus.capacity ? emu_gpus.capacity : sd__host_memory_bytes(),
            .fd_handles = true,
            .driven = emu_gpus.opened[i],
            .used_bytes = __atomic_load_n(&emu_gpus.used[i], __ATOMIC_RELAXED),
            .peak_bytes = __atomic_load_n(&emu_gpus.peak[i], __ATOMIC_RELAXED)};
        snprintf(out[i].name, sizeof(out[i].name), "emulated GPU (host memory)");
        snprintf(out[i].uuid, sizeof(out[i].uuid), "EMU-%d", i);
        for (int j = 0; j < emu_gpus.count && emu_gpus.peers; j++)
            if (j != i)
                out[i].peers |= 1ULL << j;
    }
    return emu_gpus.count;
}

static int emu_gpu_alloc(int device, size_t bytes, int flags, const char *tag, struct sd_mem *mem_p)
{
    if (device < 0 || device >= SD_EMU_MAX_GPUS || !emu_gpus.opened[device]) {
        SD_ERROR("emu-gpu", "allocating %s on device %d, which was not opened", tag, device);
        return SD_EINVAL;
    }
    struct sd_mem back;
    size_t len = bytes ? bytes : 1;
    uint64_t used = __atomic_load_n(&emu_gpus.used[device], __ATOMIC_RELAXED);
    if (emu_gpus.capacity > 0 && (len > emu_gpus.capacity || used > emu_gpus.capacity - len)) {
        SD_ERROR("emu-gpu",
                 "creating %zu bytes for %s on device %d: out of memory (%llu of %llu "
                 "bytes in use)",
                 len, tag, device, (unsigned long long)used, (unsigned long long)emu_gpus.capacity);
        return SD_ENOMEM; /* as a GPU's allocation fails when its memory is full */
    }
    int status = sd__host_alloc(0, bytes, flags, tag, &back);
    if (status != SD_OK)
        return status;
    void *dev = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct sd_region r = {
        .dev = (uintptr_t)dev, .len = len, .back = back.ptr, .fd = back.fd, .device = device};
    if (dev == MAP_FAILED || sd_region_add(&emu_regions, &r) != SD_OK) {
        if (dev != MAP_FAILED)
            munmap(dev, len);
        sd__host_free(&back);
        return SD_ENOMEM;
    }
    *mem_p = (struct sd_mem){.ptr = dev, .bytes = bytes, .fd = back.fd, .device = device};
    emu_gpu_count(device, (int64_t)len);
    return SD_OK;
}

static void emu_gpu_free(struct sd_mem *mem)
{
    struct sd_region r;
    if (mem->ptr != NULL && sd_region_remove(&emu_regions, mem->ptr, &r)) {
        emu_gpu_count(r.device, -(int64_t)r.len);
        munmap(mem->ptr, r.len);
        struct sd_mem back = {.ptr = r.back, .bytes = mem->bytes, .fd = r.fd};
        sd__host_free(&back);
    }
    *mem = (struct sd_mem){.fd = -1};
}

static bool emu_gpu_is_device(const void *p)
{
    return sd_region_find(&emu_regions, p, NULL, NULL);
}

static bool emu_gpu_peer(int d, int e)
{
    return d == e || emu_gpus.peers;
}

/* p's backing, for bytes from p on; host memory where host_ok (a copy's other side); on device
 * `on` (>= 0: a kernel's parameter there), memory of it or of a peer; else the daemon broke the
 * device's rules: abort naming what. */
static void *emu_gpu_at(const void *p, size_t bytes, bool host_ok, int on, const char *what)
{
    bool past_end;
    if (p == NULL)
        return NULL;
    void *at = sd_region_host(&emu_regions, p, bytes, &past_end);
    struct sd_region r;
    if (at != NULL && on >= 0 && sd_region_find(&emu_regions, p, &r, NULL) &&
        !emu_gpu_peer(on, r.device)) {
        SD_ERROR("emu-gpu",
                 "%s: %p (%zu bytes) is device %d's memory, which a kernel on device "
                 "%d cannot read (no peer access)",
                 what, p, bytes, r.device, on);
        abort();
    }
    if (at != NULL)
        return at;
    if (!past_end && host_ok)
        return (void *)(uintptr_t)p;
    SD_ERROR("emu-gpu", "%s: %p (%zu bytes) %s", what, p, bytes,
             past_end ? "runs past the end of its device allocation"
                      : "is not device memory (a GPU's kernel cannot touch it)");
    abort();
}

static void emu_gpu_copy(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes)
{
    (void)q;
    if (bytes > 0)
        memcpy(emu_gpu_at(dst, bytes, true, -1, "copy's destination"),
               emu_gpu_at(src, bytes, true, -1, "copy's source"), bytes);
}

static void emu_gpu_zero(struct sd_gpu_queue *q, void *dst, size_t bytes)
{
    (void)q;
    if (bytes > 0)
        memset(emu_gpu_at(dst, bytes, false, -1, "zero"), 0, bytes);
}

/* the kernels' parameters: how many, and which are pointers (bit i: parameter i) */
static const struct {
    int n;
    uint32_t ptrs;
} emu_gpu_params[SDK_K_COUNT] = {
    [SDK_K_REDUCE_ADD] = {4, 0x3}, [SDK_K_TO_F32] = {4, 0x3},      [SDK_K_FROM_F32] = {4, 0x5},
    [SDK_K_SUMSQ_PART] = {3, 0x5}, [SDK_K_SUMSQ_FINAL] = {3, 0x5}, [SDK_K_ADAMW] = {9, 0x5e},
    [SDK_K_SGD] = {8, 0x2e},       [SDK_K_SCALES] = {6, 0xb},      [SDK_K_ENCODE] = {8, 0x2d},
    [SDK_K_DECODE] = {8, 0xd},     [SDK_K_GATHER] = {1, 0}};

#define EMU_MAX_ARGS 9

static void emu_gpu_launch(struct sdk_launcher *l, enum sdk_kernel_id id, uint64_t blocks,
                           void **args)
{
    void *ptrs[EMU_MAX_ARGS], *targs[EMU_MAX_ARGS];
    if (id == SDK_K_GATHER) { /* its pointers are in its one parameter, each with its length */
        struct sdk_pieces p = *(struct sdk_pieces *)args[0];
        for (uint64_t i = 0; i < p.n; i++) {
            void *d = (void *)(uintptr_t)p.dst[i], *s = (void *)(uintptr_t)p.src[i];
            const char *wd = "kernel sdk_k_gather, a dst", *ws = "kernel sdk_k_gather, a src";
            p.dst[i] = (uintptr_t)emu_gpu_at(d, p.bytes[i], false, l->cur, wd);
            p.src[i] = (uintptr_t)emu_gpu_at(s, p.bytes[i], false, l->cur, ws);
        }
        void *one[] = {&p};
        emu_launch(l, id, blocks, one);
        return;
    }
    const double *scratch = l->scratch, *scratch_end = l->scratch + SDK_SUMSQ_MAX_BLOCKS + 1;
    char what[64];
    for (int i = 0; i < emu_gpu_params[id].n; i++) {
        targs[i] = args[i];
        if (!(emu_gpu_params[id].ptrs >> i & 1))
            continue;
        const void *p = *(void **)args[i];
        bool queue_scratch = (const double *)p >= scratch && (const double *)p < scratch_end;
        snprintf(what, sizeof(what), "kernel %s, parameter %d", sdk_kernel_names[id], i);
        ptrs[i] = queue_scratch ? (void *)(uintptr_t)p : emu_gpu_at(p, 1, false, l->cur, what);
        targs[i] = &ptrs[i];
    }
    emu_launch(l, id, blocks, targs);
}

static int emu_gpu_device_of(struct sdk_launcher *l, const void *p)
{
    (void)l;
    struct sd_region r;
    return sd_region_find(&emu_regions, p, &r, NULL) ? r.device : -1;
}

static void emu_gpu_use(struct sdk_launcher *l, int d)
{
    l->cur = d; /* one order already: every launch ran at its call */
}

/* branches run one after another here: each launch ran at its call */
static void emu_gpu_branch(struct sdk_launcher *l, int from, int d)
{
    (void)from;
    l->cur = d;
}

static void emu_gpu_merge(struct sdk_launcher *l, int from, uint64_t devs)
{
    (void)devs;
    l->cur = from;
}

static bool emu_gpu_launcher_peer(struct sdk_launcher *l, int d, int e)
{
    (void)l;
    return emu_gpu_peer(d, e);
}

/* a copy of src on the queue's device, in its buffer there (grown as needed) */
static const void *emu_gpu_bring(struct sdk_launcher *l, const void *src, size_t bytes)
{
    struct sd_gpu_queue *q = (struct sd_gpu_queue *)l;
    struct sd_mem *m = &q->near[l->cur];
    if (m->bytes < bytes) {
        emu_gpu_free(m);
        if (emu_gpu_alloc(l->cur, bytes, SD_MEM_PRIVATE, "a source brought over", m) != SD_OK) {
            SD_ERROR("emu-gpu", "no memory to bring %zu bytes to device %d", bytes, l->cur);
            abort();
        }
    }
    emu_gpu_copy(q, m->ptr, src, bytes);
    return m->ptr;
}

static void emu_gpu_launcher_copy(struct sdk_launcher *l, void *dst, const void *src, size_t bytes)
{
    sdk_at(l, dst);
    emu_gpu_copy((struct sd_gpu_queue *)l, dst, src, bytes);
}

static int emu_gpu_queue_create(struct sd_gpu_queue **q_p)
{
    int status = emu_queue_create(q_p);
    if (status != SD_OK)
        return status;
    struct sd_gpu_queue *q = *q_p;
    q->near = calloc(SD_EMU_MAX_GPUS, sizeof(*q->near));
    if (q->near == NULL) {
        emu_queue_destroy(q);
        return SD_ENOMEM;
    }
    for (int d = 0; d < SD_EMU_MAX_GPUS; d++)
        q->near[d].fd = -1;
    for (int d = SD_EMU_MAX_GPUS - 1; d >= 0; d--)
        if (emu_gpus.opened[d])
            q->l.cur = d; /* the first opened */
    static const struct sdk_route route = {.device_of = emu_gpu_device_of,
                                           .use = emu_gpu_use,
                                           .peer = emu_gpu_launcher_peer,
                                           .bring = emu_gpu_bring,
                                           .copy = emu_gpu_launcher_copy,
                                           .branch = emu_gpu_branch,
                                           .merge = emu_gpu_merge};
    q->l.launch = emu_gpu_launch;
    q->l.route = &route;
    return SD_OK;
}

/* emu-device: host memory, kept as a device's (its allocations known, so that the transport
 * tells it from host memory): a provider with FI_HMEM reaches it as host memory
 * (SD_HMEM_HOST), any other stages it, as a GPU's */
static struct sd_regions emu_dev_regions = SD_REGIONS_INIT;

static int emu_device_alloc(int device, size_t bytes, int flags, const char *tag,
                            struct sd_mem *mem_p)
{
    int status = sd__host_alloc(device, bytes, flags, tag, mem_p);
    if (status != SD_OK)
        return status;
    struct sd_region r = {.dev = (uintptr_t)mem_p->ptr,
                          .len = bytes ? bytes : 1,
                          .back = mem_p->ptr,
                          .fd = mem_p->fd};
    if (sd_region_add(&emu_dev_regions, &r) != SD_OK) {
        sd__host_free(mem_p);
        return SD_ENOMEM;
    }
    return SD_OK;
}

static void emu_device_free(struct sd_mem *mem)
{
    struct sd_region r;
    if (mem->ptr != NULL)
        sd_region_remove(&emu_dev_regions, mem->ptr, &r);
    sd__host_free(mem);
}

static bool emu_device_is_device(const void *p)
{
    return sd_region_find(&emu_dev_regions, p, NULL, NULL);
}

#define EMU_OPS                                                                                    \
    .host_visible = true, .client_memory = "host", .client_memfds = true, .devices = emu_devices,  \
    .queue_create = emu_queue_create, .queue_destroy = emu_queue_destroy, .sync = sd__host_sync,   \
    .record = emu_record, .query = emu_query, .copy = sd__host_copy, .zero = sd__host_zero,        \
    .sum_sq = emu_sum_sq, SDK_KERNEL_OPS

const struct sd_gpu_ops sd_gpu_emu_ops = {
    .name = "emu", .host_memory = true, .alloc = sd__host_alloc, .free = sd__host_free, EMU_OPS};
const struct sd_gpu_ops sd_gpu_emu_device_ops = {.name = "emu-device",
                                                 .host_memory = false,
                                                 .alloc = emu_device_alloc,
                                                 .free = emu_device_free,
                                                 .is_device = emu_device_is_device,
                                                 .hmem = SD_HMEM_HOST,
                                                 .pinned_alloc = sd__host_pinned_alloc,
                                                 .pinned_free = sd__host_pinned_free,
                                                 EMU_OPS};
/* emu-gpu's table but for its name and its queue's query */
#define EMU_GPU_OPS                                                                                \
    .host_memory = false, .host_visible = false, .client_memory = "emu-gpu",                       \
    .client_memfds = true, .open = emu_gpu_open, .devices = emu_gpu_devices,                       \
    .alloc = emu_gpu_alloc, .free = emu_gpu_free, .queue_create = emu_gpu_queue_create,            \
    .queue_destroy = emu_queue_destroy, .sync = sd__host_sync, .record = emu_record,               \
    .copy = emu_gpu_copy, .zero = emu_gpu_zero, .sum_sq = emu_sum_sq,                              \
    .is_device = emu_gpu_is_device, .pinned_alloc = sd__host_pinned_alloc,                         \
    .pinned_free = sd__host_pinned_free, SDK_KERNEL_OPS

const struct sd_gpu_ops sd_gpu_emu_gpu_ops = {.name = "emu-gpu", .query = emu_query, EMU_GPU_OPS};
const struct sd_gpu_ops sd_gpu_emu_gpu_deferred_ops = {
    .name = "emu-gpu-deferred", .query = emu_query_lagging, EMU_GPU_OPS};

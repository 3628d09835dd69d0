/* Device backends behind one vtable (DESIGN.md section 2): host (default), cuda, hip.
 * Every kernel works on a contiguous range; unsupported operations return SD_ENOSYS. */
#ifndef SD_GPU_H
#define SD_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* SD_MEM_SHARED: a memfd other processes map (mode 0600, sealed against shrinking and
 * growing); with SD_MEM_CLIENT_RO also against writes through any mapping or fd made after
 * the daemon's own (F_SEAL_FUTURE_WRITE): clients map it read-only and cannot upgrade. */
enum { SD_MEM_PRIVATE = 0, SD_MEM_SHARED = 1, SD_MEM_CLIENT_RO = 2 };

struct sd_mem {
    void *ptr;
    size_t bytes;
    int fd;     /* memfd for shared host memory, else -1 */
    int device; /* the device it lives on (the driver's index; 0 for host memory) */
};

struct sd_adamw_args {
    float lr, beta1, beta2, eps, weight_decay;
    uint64_t step; /* 1-based */
    bool l2;       /* Adam: the weight decay is added to the gradient (torch.optim.Adam), not
                      applied to the weight (AdamW) */
};

struct sd_sgd_args {
    float lr, momentum, weight_decay;
    bool nesterov; /* the update is g + momentum * buf (torch.optim.SGD's nesterov) */
};

/* A queue of device work (a CUDA or HIP stream per device): kernels enqueued on one run in the
 * order they were enqueued and may still be running, or not have started, when the call that
 * enqueued them returns. A backend driving several devices runs each operation on the device
 * that holds what it writes (its destination; sum_sq: its input), makes that device's stream
 * wait for the work enqueued before it on another device, and brings a source that device cannot
 * read (no peer access) over by a copy first: a queue is one order across the devices. Whoever
 * reads what they wrote on the CPU, hands it to the network or to a client, or lets a client
 * overwrite what they read, first waits for the queue: sd_gpu_ops.sync, or record + query where
 * blocking the loop is not wanted. The host backend runs every kernel at once; host-deferred (a
 * test backend) runs them only when the queue is synced or full. */
struct sd_gpu_queue;

/* One device a backend drives, as shardctl topology shows it. */
#define SD_GPU_MAX_DEVICES 64
struct sd_gpu_device {
    int index;
    char name[96];
    uint64_t memory_bytes;
    bool fd_handles; /* its VMM allocations export POSIX fds (what sharing with trainers needs) */
    bool rdma;       /* its VMM allocations can be GPUDirect RDMA targets */
    uint64_t peers;  /* bit j: it reads and writes device j's memory directly (peer access) */
    /* the device's UUID as nvidia-smi -L and torch.cuda.get_device_properties(i).uuid print it
     * ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; "" where the driver has none): what a trainer
     * compares with its own device, whatever CUDA_VISIBLE_DEVICES numbers them */
    char uuid[48];
    bool driven; /* one this backend drives (opened with it: config devices) */
    /* shardd's own allocations on it: now, and the most at once since it started */
    uint64_t used_bytes, peak_bytes;
};

/* How a libfabric provider with FI_HMEM reaches a backend's device memory (sd_gpu_ops.hmem):
 * registered with that interface, sent and received in place, not staged. */
enum sd_hmem {
    SD_HMEM_NONE, /* it cannot: device memory is staged through pinned host buffers */
    SD_HMEM_HOST, /* as host memory (FI_HMEM_SYSTEM): emu-device, which keeps device
                   * bookkeeping on host memory, stands in for a GPU this way */
    SD_HMEM_CUDA, /* FI_HMEM_CUDA, on the device hmem_device names */
    SD_HMEM_ROCR, /* FI_HMEM_ROCR */
};

/* one of several copies enqueued together (copy_many) */
struct sd_gpu_piece {
    void *dst;
    const void *src;
    size_t bytes;
};

struct sd_gpu_ops {
    const char *name;
    bool host_memory; /* its buffers are host memory (backed and freed off the loop) */
    /* its buffers can be read and written on the host even where host_memory is false
     * (emu-device: the device paths of the daemon, run on host memory) */
    bool host_visible;
    /* what a client imports the shared allocations' fds as: "host" (memfds it maps), "cuda" or
     * "hip" (POSIX fd handles of VMM memory), "emu-gpu" (memfds it maps out of its own reach) */
    const char *client_memory;
    /* those fds are memfds (the gather pool's goes out reopened read-only); else a device's fd
     * handles, which the client maps read-only itself */
    bool client_memfds;
    /* Once, before anything else: find the driver and open devices[0..n) (the driver's indices,
     * distinct; n 0: every device it sees), which allocations then name and every queue spans;
     * memory of each is mapped for the others that have peer access to it (NULL: nothing to
     * find; such a backend has one device, 0). On failure err says what is missing (the
     * library, a device, an attribute). */
    int (*open)(const int *devices, int n, char *err, size_t errlen);
    /* After open: how many devices it sees, the first max of them described into out. NULL: it
     * drives none (the host backend). */
    int (*devices)(struct sd_gpu_device *out, int max);
    /* Allocate zeroed memory on `device` (one open named; a backend with one device takes 0);
     * SD_MEM_SHARED gives a sealed memfd other processes can map (a device's fd handle). */
    int (*alloc)(int device, size_t bytes, int flags, const char *tag, struct sd_mem *mem_p);
    void (*free)(struct sd_mem *mem);
    /* A queue of work for this backend; freed with everything enqueued on it completed. */
    int (*queue_create)(struct sd_gpu_queue **q_p);
    void (*queue_destroy)(struct sd_gpu_queue *q);
    /* Wait until everything enqueued on q completed: SD_OK, or the first error of a kernel. */
    int (*sync)(struct sd_gpu_queue *q);
    /* A completion point after everything enqueued on q so far, and whether it was reached:
     * SD_OK, SD_EAGAIN (not yet), or the first error of a kernel before it. */
    int (*record)(struct sd_gpu_queue *q, uint64_t *ticket_p);
    int (*query)(struct sd_gpu_queue *q, uint64_t ticket);
    /* Memory the transport cannot read or write itself (NULL: none, every buffer is host
     * memory): p lies in one of this backend's device allocations. Such memory crosses nodes
     * through pinned host buffers (pinned_alloc, pinned_free) and the backend's copies. */
    bool (*is_device)(const void *p);
    /* How a provider with FI_HMEM reaches that memory (enum sd_hmem), and the index of the
     * device p lies on (NULL: 0). The transport takes FI_HMEM where the provider has it and
     * registers device memory with this interface; elsewhere it stages. */
    int hmem;
    int (*hmem_device)(const void *p);
    int (*pinned_alloc)(size_t bytes, void **p_p);
    void (*pinned_free)(void *p);
    /* The kernels: enqueued on q. */
    void (*copy)(struct sd_gpu_queue *q, void *dst, const void *src, size_t bytes);
    /* the n copies of pieces, in as few launches as the device can (NULL: one copy each; call
     * through sd_gpu_copy_many) */
    void (*copy_many)(struct sd_gpu_queue *q, const struct sd_gpu_piece *pieces, uint32_t n);
    /* dst = bytes zeros */
    void (*zero)(struct sd_gpu_queue *q, void *dst, size_t bytes);
    /* acc[i] += (float)src[i] with src in dtype */
    void (*reduce_add)(struct sd_gpu_queue *q, float *acc, const void *src, int src_dtype,
                       size_t n);
    /* dst[i] = (float)src[i] (fp32 destination) */
    void (*to_f32)(struct sd_gpu_queue *q, float *dst, const void *src, int src_dtype, size_t n);
    /* dst[i] = src[i] rounded to dtype */
    void (*from_f32)(struct sd_gpu_queue *q, void *dst, int dst_dtype, const float *src, size_t n);
    /* *out = the sum of squares of x in double (out is host memory, written by the kernel) */
    void (*sum_sq)(struct sd_gpu_queue *q, const float *x, size_t n, double *out);
    /* grad is scaled by `scale`, then zeroed. master/moments fp32, w in w_dtype. */
    void (*adamw)(struct sd_gpu_queue *q, const struct sd_adamw_args *a, float *master, float *m,
                  float *v, float *grad, float scale, void *w, int w_dtype, size_t n);
    void (*sgd)(struct sd_gpu_queue *q, const struct sd_sgd_args *a, float *master, float *buf,
                float *grad, float scale, void *w, int w_dtype, size_t n);
    /* Block quantization (sd/codec.h): dst (sd_codec_bytes(bits, n, block) bytes) = src's n
     * elements in src_dtype, encoded with bits 8 or 4 in blocks of block elements. */
    void (*quantize)(struct sd_gpu_queue *q, void *dst, int bits, const void *src, int src_dtype,
                     size_t n, uint32_t block);
    /* dst = the n decoded elements in dst_dtype, or with accumulate dst (fp32) += them */
    void (*dequantize)(struct sd_gpu_queue *q, void *dst, int dst_dtype, const void *src, int bits,
                       size_t n, uint32_t block, bool accumulate);
    /* Error feedback (ZeRO++'s LoCo): dst = the encoding of y = x + err (fp32, n each), then
     * err = y - decode(dst); x is only read. A block whose y is not finite leaves its error 0,
     * and its encoding non-finite. */
    void (*quantize_ef)(struct sd_gpu_queue *q, void *dst, int bits, const float *x, float *err,
                        size_t n, uint32_t block);
};

extern const struct sd_gpu_ops sd_gpu_host_ops;
/* The host backend's kernels run only when their queue is synced, queried or full: a daemon that
 * reads a result before waiting for it reads stale memory, and its tests fail. The first query of
 * each ticket answers SD_EAGAIN, as a busy device would, so the waits that poll are taken too. */
extern const struct sd_gpu_ops sd_gpu_host_deferred_ops;

/* The device backends' kernels (gpu/kern/kernels.h) run on the host through the emulation:
 * host memory, each kernel's blocks and threads in order. emu-device: the same, declared device
 * memory (host_memory false), so that the daemon takes its device paths (allocation on the
 * loop, checkpoint loads through a staging buffer) where no GPU is. */
extern const struct sd_gpu_ops sd_gpu_emu_ops;
extern const struct sd_gpu_ops sd_gpu_emu_device_ops;
/* emu-gpu: the same kernels with the device's memory out of the host's reach (gpu/emu.c): the
 * daemon's device addresses fault on the host, and kernels given host memory abort, so that a
 * daemon that would touch a GPU's memory on the host fails its tests where no GPU is. */
extern const struct sd_gpu_ops sd_gpu_emu_gpu_ops;
/* emu-gpu-deferred: emu-gpu whose queue answers the first query of each new ticket "not yet", as
 * a busy GPU does (its kernels ran at their launch): the daemon's polled waits on device memory
 * (staged transfers, a checkpoint's staging and load buffers) are taken where no GPU is. */
extern const struct sd_gpu_ops sd_gpu_emu_gpu_deferred_ops;
/* Built where CUDA's or HIP's compiler was found (-DSHARD_CUDA, -DSHARD_HIP); the driver is
 * loaded at run time (open), so the same binary runs on machines without one. */
extern const struct sd_gpu_ops sd_gpu_cuda_ops;
extern const struct sd_gpu_ops sd_gpu_hip_ops;

/* Backend by name ("host", "host-deferred", "emu", "cuda", "hip"); NULL when not built into
 * this binary or unknown. */
const struct sd_gpu_ops *sd_gpu_find(const char *name);
/* the first device dev drives (its index; 0 for a backend without devices) */
static inline int sd_gpu_first_driven(const struct sd_gpu_ops *dev)
{
    struct sd_gpu_device d[SD_GPU_MAX_DEVICES];
    int n = dev->devices != NULL ? dev->devices(d, SD_GPU_MAX_DEVICES) : 0;
    for (int i = 0; i < n && i < SD_GPU_MAX_DEVICES; i++)
        if (d[i].driven)
            return d[i].index;
    return 0;
}
/* A codec's encoding (sd/codec.h: int4, int8 with blocks; bf16, fp16 rounded element by element)
 * of src's n fp32 elements into dst, and its decoding into fp32 dst (accumulate: dst +=). */
void sd_gpu_encode(const struct sd_gpu_ops *dev, struct sd_gpu_queue *q, void *dst, int codec,
                   const float *src, size_t n, uint32_t block);
void sd_gpu_decode(const struct sd_gpu_ops *dev, struct sd_gpu_queue *q, float *dst,
                   const void *src, int codec, size_t n, uint32_t block, bool accumulate);
/* dev's copy_many, or one copy per piece where it has none */
void sd_gpu_copy_many(const struct sd_gpu_ops *dev, struct sd_gpu_queue *q,
                      const struct sd_gpu_piece *pieces, uint32_t n);
/* a driver's 16 UUID bytes as "GPU-" and 8-4-4-4-12 hex digits (struct sd_gpu_device.uuid) */
void sd_gpu_uuid_format(char *out, size_t len, const uint8_t bytes[16]);
/* The names of the backends built in, comma-separated, into buf; returns the length. */
size_t sd_gpu_list(char *buf, size_t len);

#endif

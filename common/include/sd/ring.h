/* The shared-memory request/completion ring between one client and the daemon.
 *
 * One memfd per client session holds a header, a submission queue (client -> daemon) and a
 * completion queue (daemon -> client), each single-producer single-consumer. Indices are free
 * running 64-bit counters; the slot is index & (entries - 1). Nothing in the region is a pointer.
 * Wake-ups use eventfds only when the other side has said it sleeps (daemon_sleeping,
 * client_waiting), so a busy ring costs no system call per operation.
 *
 * The daemon never trusts the region: it copies each entry out before validating it and checks
 * that the client's head index stays within one ring of the tail. */
#ifndef SD_RING_H
#define SD_RING_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define SD_RING_MAGIC   0x314d445241485353ULL /* "SSHARDM1" little-endian */
#define SD_RING_VERSION 1
#define SD_RING_ENTRIES 256
#define SD_CQE_MSG_LEN  224

enum sd_op {
    SD_OP_NOP = 0,
    SD_OP_FETCH = 1,    /* unit, arg0 = SD_OP_ASIDE or 0 -> value0 = byte offset of the gathered
                           unit in the pool */
    SD_OP_RELEASE = 2,  /* unit, arg0 = SD_OP_ASIDE or 0 */
    SD_OP_PUSH = 3,     /* unit, arg0 = staging slot, arg1 = bytes */
    SD_OP_STEP = 4,     /* -> value0 = bits of the global gradient norm (double), value1 = step */
    SD_OP_INIT = 5,     /* rank 0: unit, arg0 = staging slot holding fp32 initial values */
    SD_OP_READY = 6,    /* barrier: completes once rank 0 has loaded the initial values */
    SD_OP_DROP = 7,     /* forget the cached gathered copy of unit (benchmarks) */
    SD_OP_SAVE = 8,     /* every rank, between steps: arg0 = length of the directory written at
                           RegisterReply.save_path_off -> value0 = the step saved */
    SD_OP_WRITE = 9,    /* every rank, between steps: unit = tensor, arg0 = staging slot |
                           what << 32, arg1 = the tensor's elements (SD_WRITE_STEPS: its step
                           count) -> the fp32 values in the slot into this rank's shards */
    SD_OP_WRITTEN = 10, /* every rank after its writes: barrier; the written weights are the
                           next fetches' -> value0 = the weights generation */
    SD_OP_READ = 11,    /* any rank alone, between steps: unit, arg0 = staging slot | what << 32
                           -> the unit's fp32 master weights (what 0) or optimizer state what,
                           gathered from the job's nodes into the slot (SD_WRITE_STEPS: unit is
                           a tensor, value0 its step count) */
    SD_OP_COUNT
};

/* SD_OP_WRITE's what: the weights (fp32 masters and the weights in their dtype), an optimizer
 * state (1 .. states - 1: AdamW's exp_avg, exp_avg_sq; SGD's momentum_buffer), or the tensor's
 * step count (arg1) */
#define SD_WRITE_WEIGHTS 0u
#define SD_WRITE_STEPS   255u
/* SD_OP_READ's and SD_OP_WRITE's what | SD_STATE_OWN: the rank's own optimizer-state shard of
 * the unit (e->unit a unit; arg1 of a write its elements), at a trainer optimizer's hand-off
 * (sd_optim_in_trainer): a read answers value0 = the shard's first element in the unit, value1 =
 * its elements; SD_STATE_GRAD read so is the shard's reduced gradient, the sum over the ranks
 * (the hand-off's step answer gives in value1 the bits of the double the optimizer multiplies
 * it by: 1 / world, times the clipping factor). Writes only at the hand-off: masters (0) and
 * states 1..N. */
#define SD_STATE_OWN  0x100u
#define SD_STATE_GRAD 254u

/* a fetch or release outside the step's schedule (reading the weights on some ranks only: a
 * save, an evaluation): neither recorded nor matched against the schedule */
#define SD_OP_ASIDE 1u

struct sd_sqe {
    uint32_t op;
    uint32_t unit;
    uint64_t tag;
    uint64_t arg0;
    uint64_t arg1;
};

struct sd_cqe {
    uint64_t tag;
    int32_t status;
    uint32_t op;
    uint64_t value0;
    uint64_t value1;
    char msg[SD_CQE_MSG_LEN]; /* NUL-terminated; set when status != 0 */
};

struct sd_ring_hdr {
    uint64_t magic;
    uint32_t version;
    uint32_t entries;
    uint64_t sq_off, cq_off, total_bytes;
    alignas(64) _Atomic uint64_t sq_head; /* written by the client */
    alignas(64) _Atomic uint64_t sq_tail; /* written by the daemon */
    alignas(64) _Atomic uint64_t cq_head; /* written by the daemon */
    alignas(64) _Atomic uint64_t cq_tail; /* written by the client */
    alignas(64) _Atomic uint32_t daemon_sleeping;
    alignas(64) _Atomic uint32_t client_waiting;
};

_Static_assert(sizeof(struct sd_sqe) == 32, "sqe layout is ABI");
_Static_assert(sizeof(struct sd_cqe) == 256, "cqe layout is ABI");
_Static_assert(offsetof(struct sd_ring_hdr, sq_head) == 64, "ring header layout is ABI");
_Static_assert(offsetof(struct sd_ring_hdr, client_waiting) == 384, "ring header layout is ABI");
_Static_assert(sizeof(struct sd_ring_hdr) == 448, "ring header layout is ABI");

#define SD_RING_SQ_OFF    sizeof(struct sd_ring_hdr)
#define SD_RING_CQ_OFF    (SD_RING_SQ_OFF + SD_RING_ENTRIES * sizeof(struct sd_sqe))
#define SD_RING_BYTES_RAW (SD_RING_CQ_OFF + SD_RING_ENTRIES * sizeof(struct sd_cqe))
#define SD_RING_BYTES     ((SD_RING_BYTES_RAW + 4095) & ~(size_t)4095)

static inline struct sd_sqe *sd_ring_sq(struct sd_ring_hdr *h)
{
    return (struct sd_sqe *)(void *)((char *)h + SD_RING_SQ_OFF);
}
static inline struct sd_cqe *sd_ring_cq(struct sd_ring_hdr *h)
{
    return (struct sd_cqe *)(void *)((char *)h + SD_RING_CQ_OFF);
}

static inline void sd_ring_init(struct sd_ring_hdr *h)
{
    memset(h, 0, sizeof(*h));
    h->magic = SD_RING_MAGIC;
    h->version = SD_RING_VERSION;
    h->entries = SD_RING_ENTRIES;
    h->sq_off = SD_RING_SQ_OFF;
    h->cq_off = SD_RING_CQ_OFF;
    h->total_bytes = SD_RING_BYTES;
}

/* Client: returns 0 or -1 when the submission queue is full. */
static inline int sd_ring_sq_push(struct sd_ring_hdr *h, const struct sd_sqe *e)
{
    uint64_t head = atomic_load_explicit(&h->sq_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&h->sq_tail, memory_order_acquire);
    if (head - tail >= SD_RING_ENTRIES)
        return -1;
    sd_ring_sq(h)[head & (SD_RING_ENTRIES - 1)] = *e;
    atomic_store_explicit(&h->sq_head, head + 1, memory_order_release);
    return 0;
}

/* Daemon: 1 with *e filled, 0 when empty, -1 when the client corrupted the indices. */
static inline int sd_ring_sq_pop(struct sd_ring_hdr *h, struct sd_sqe *e)
{
    uint64_t tail = atomic_load_explicit(&h->sq_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&h->sq_head, memory_order_acquire);
    if (head == tail)
        return 0;
    if (head - tail > SD_RING_ENTRIES)
        return -1;
    *e = sd_ring_sq(h)[tail & (SD_RING_ENTRIES - 1)];
    atomic_store_explicit(&h->sq_tail, tail + 1, memory_order_release);
    return 1;
}

static inline int sd_ring_sq_empty(struct sd_ring_hdr *h)
{
    return atomic_load_explicit(&h->sq_head, memory_order_acquire) ==
           atomic_load_explicit(&h->sq_tail, memory_order_relaxed);
}

/* Daemon: returns 0, or -1 when the client left more completions unread than it may have
 * requests in flight (a misbehaving client). */
static inline int sd_ring_cq_push(struct sd_ring_hdr *h, const struct sd_cqe *e)
{
    uint64_t head = atomic_load_explicit(&h->cq_head, memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(&h->cq_tail, memory_order_acquire);
    if (head - tail >= SD_RING_ENTRIES)
        return -1;
    sd_ring_cq(h)[head & (SD_RING_ENTRIES - 1)] = *e;
    atomic_store_explicit(&h->cq_head, head + 1, memory_order_release);
    return 0;
}

/* Client: 1 with *e filled, 0 when empty. */
/* Client: 1 with *e filled, 0 when empty, -1 when the indices are corrupt (more completions
 * than the ring holds). */
static inline int sd_ring_cq_pop(struct sd_ring_hdr *h, struct sd_cqe *e)
{
    uint64_t tail = atomic_load_explicit(&h->cq_tail, memory_order_relaxed);
    uint64_t head = atomic_load_explicit(&h->cq_head, memory_order_acquire);
    if (head == tail)
        return 0;
    if (head - tail > SD_RING_ENTRIES)
        return -1;
    *e = sd_ring_cq(h)[tail & (SD_RING_ENTRIES - 1)];
    atomic_store_explicit(&h->cq_tail, tail + 1, memory_order_release);
    return 1;
}

/* Wake the other side through its eventfd if its flag says it sleeps; the fence pairs with the
 * sleeper's "set flag, fence, look at the ring once more". */
static inline void sd_ring_wake(_Atomic uint32_t *sleeping, int efd)
{
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(sleeping, memory_order_relaxed) && atomic_exchange(sleeping, 0)) {
        uint64_t one = 1;
        ssize_t w = write(efd, &one, sizeof(one));
        (void)w; /* a full eventfd counter already wakes the reader */
    }
}

const char *sd_op_name(int op);

#endif

/* The fence page of a rank (issue 40): one page of a memfd that the daemon and one trainer map
 * (the trainer's third fd of the registration's reply), holding three monotonic counters that
 * order their work without a round trip through the control socket.
 *
 *   grad_seq    the trainer's: gradients in its staging slots, counted from 1. libshard writes
 *               it before each push; a device trainer's stream writes it after the kernel that
 *               produced the gradient (cuStreamWriteValue32) and the push says so
 *               (SD_PUSH_SIGNAL_LATER): the daemon takes it when the page counts it, polling.
 *               The daemon's own queue never waits on it: a value a client writes must not be
 *               able to hang the daemon's stream. A push whose gradient was not signalled, and
 *               that does not say it will be, is refused.
 *   gather_seq  the daemon's: fetches it answered for this rank, counted from 1, written before
 *               each answer; a device trainer's stream waits for it before the forward reads
 *               the slot.
 *   release_seq the trainer's: releases whose reads a stream still had queued, counted from 1.
 *               A device trainer releases a unit while the kernels that read its slot may not
 *               have run yet (the host runs ahead of the GPU); its stream writes the count after
 *               them and the release says so (SD_RELEASE_SIGNAL_LATER). The daemon answers such
 *               a release at once but keeps the rank's hold on the slot until the page counts it:
 *               the gather pool's planned places are shared by units whose lifetimes do not
 *               overlap on the host, and a gather into a place whose previous unit the GPU still
 *               reads would change the weights under a running forward (seen on an H200: every
 *               step after the first diverged). Looked at, never waited on, by the loop: where a
 *               gather needs the place, the loop polls the page while it waits.
 * Counters compare as the devices' GEQ waits do, (int32_t)(a - b) >= 0, so they wrap. Both sides
 * continue from the page's values, which outlive a trainer (a resumed job's). Offsets, never
 * pointers; the layout is pinned below. */
#ifndef SD_FENCE_H
#define SD_FENCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SD_FENCE_MAGIC       0x45464453u /* "SDFE" */
#define SD_FENCE_VERSION     2u
#define SD_FENCE_BYTES       4096u
#define SD_FENCE_GRAD_OFF    64u
#define SD_FENCE_GATHER_OFF  128u
#define SD_FENCE_RELEASE_OFF 192u

struct sd_fence_page {
    uint32_t magic, version;
    uint8_t pad0[SD_FENCE_GRAD_OFF - 8];
    uint32_t grad_seq; /* 64-byte lines of their own: one writer each */
    uint8_t pad1[SD_FENCE_GATHER_OFF - SD_FENCE_GRAD_OFF - 4];
    uint32_t gather_seq;
    uint8_t pad2[SD_FENCE_RELEASE_OFF - SD_FENCE_GATHER_OFF - 4];
    uint32_t release_seq;
    uint8_t pad3[60];
};

_Static_assert(offsetof(struct sd_fence_page, grad_seq) == SD_FENCE_GRAD_OFF, "fence layout");
_Static_assert(offsetof(struct sd_fence_page, gather_seq) == SD_FENCE_GATHER_OFF, "fence layout");
_Static_assert(offsetof(struct sd_fence_page, release_seq) == SD_FENCE_RELEASE_OFF, "fence layout");
_Static_assert(sizeof(struct sd_fence_page) <= SD_FENCE_BYTES, "fence layout");

/* A push's arg0 is its staging slot, with this bit when the trainer's stream signals the
 * gradient later (shard_push_staged_signalled): the daemon takes the push once grad_seq counts
 * it, looking for it every millisecond, and fails the job when it does not come within
 * op_timeout_ms. Without the bit a push whose gradient is not signalled yet is refused. */
#define SD_PUSH_SIGNAL_LATER (1ull << 63)
/* ... and with this one when it is the rank's last push of the unit before its step
 * (shard_last_micro_step): once every local rank's push of a unit carried it, the daemon may send
 * the unit's gradient across nodes at once (the boundary hop), and a later push of the unit in
 * the same step fails the job. */
#define SD_PUSH_LAST (1ull << 62)

/* A release's arg0 (SD_OP_ASIDE or 0) with this bit: the trainer's stream signals it later on
 * release_seq (shard_release_on_stream); the slot stays held for the rank until the page counts
 * it. */
#define SD_RELEASE_SIGNAL_LATER (1ull << 63)

/* counter a has reached b */
static inline bool sd_fence_reached(uint32_t a, uint32_t b)
{
    return (int32_t)(a - b) >= 0;
}

static inline uint32_t sd_fence_load(const uint32_t *c)
{
    return __atomic_load_n(c, __ATOMIC_ACQUIRE);
}

static inline void sd_fence_store(uint32_t *c, uint32_t v)
{
    __atomic_store_n(c, v, __ATOMIC_RELEASE);
}

#endif

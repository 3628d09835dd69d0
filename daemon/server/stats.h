/* Statistics of jobs (latency samples, bytes by operation and link class) and of the daemon's
 * own thread (allocation calls, CPU time), for shardctl and the allocation invariant. */
#ifndef SD_STATS_H
#define SD_STATS_H

#include "sd/ring.h"
#include "sd/trace.h"

#include <stdbool.h>
#include <stdint.h>

#define SD_LAT_SAMPLES 2048
/* A histogram's bounds: 1, 2.5 and 5 x 10^k ns for k = 3..12 (1 us .. 5000 s); bin i counts the
 * samples above bound i-1 and at most bound i, the last bin those above every bound. The
 * metrics show each operation a window of them (sd_latency_window). */
#define SD_LAT_BOUNDS 30
extern const uint64_t sd_lat_bounds_ns[SD_LAT_BOUNDS];
struct sd_latency {
    uint64_t count;
    uint64_t sum_ns;
    uint64_t bins[SD_LAT_BOUNDS + 1];
    uint32_t samples_ns[SD_LAT_SAMPLES]; /* the most recent ones, ring order */
};
void sd_latency_add(struct sd_latency *l, uint64_t ns);
/* the bounds a histogram of op shows: sd_lat_bounds_ns[*first .. *first + SD_LAT_WINDOW) (a
 * fetch from 10 us to 2.5 s, a step from 1 ms to 250 s, a save from 10 ms to 2500 s) */
#define SD_LAT_WINDOW 16
void sd_latency_window(int op, unsigned *first);
/* q in [0, 1]; sorts a copy on the stack, for the admin path only */
double sd_latency_quantile_us(const struct sd_latency *l, double q);

/* Link classes (DESIGN.md section 4, minimum volume). A copy inside a node is counted once, by
 * the link it would cross between two devices: between ranks of one package (a rank's own
 * memory included) SD_LINK_PACKAGE, between packages of the node SD_LINK_NODE. A buffer of the
 * node rather than of a rank (the gather copy the node's ranks share, the node partial of a
 * gradient reduction, the boundary hop's buffer) belongs to local rank 0; without the
 * hierarchical gather, rank j's own copy to rank j. Bytes across nodes are counted as sent and
 * as received. */
enum sd_link_class {
    SD_LINK_PACKAGE = 0,
    SD_LINK_NODE = 1,
    SD_LINK_INTER_SENT = 2,
    SD_LINK_INTER_RECV = 3,
    SD_LINK_COUNT
};
/* the names shardctl stats uses */
extern const char *const sd_link_names[SD_LINK_COUNT];
struct sd_job_stats {
    uint64_t ops[SD_OP_COUNT];
    uint64_t errors;
    uint64_t bytes[SD_OP_COUNT][SD_LINK_COUNT]; /* by the operation that moved them */
    /* what quantization saved: the same operations unquantized would have moved bytes + saved */
    int64_t saved[SD_OP_COUNT][SD_LINK_COUNT]; /* negative where scales outweigh the gain */
    uint64_t quant_encodes;   /* buffers quantized (w shards, gradient blocks, secondary pieces) */
    uint64_t quant_fallbacks; /* reductions ,qg left exact: units below quant_min_bytes */
    uint64_t steps_nonfinite; /* steps skipped for a gradient that was not finite */
    uint64_t steps_nonfinite_scaled; /* of those, steps under a loss scale (a scaler's backoff) */
    double loss_scale;               /* the last step's loss scale (1: none) */
    uint64_t steps_refused;          /* steps skipped for arguments the ranks did not agree on */
    uint64_t tensors_skipped;        /* tensors a step left alone: no rank gave them a gradient */
    uint64_t bcast_bytes;         /* bytes of rank 0's broadcasts delivered to this node's ranks */
    uint64_t gathers, cache_hits; /* evictions: the unit cache counts them */
    uint64_t coalesced_gathers, coalesced_units; /* transfers that moved several units, and those */
    uint64_t allocs_after_register;
    uint64_t pool_bytes;
    uint64_t memory_bytes;     /* all the job took on this node at registration (kept once freed) */
    uint32_t push_rounds_peak; /* gradient reductions across nodes on the wire at once, at most */
    /* pushes signalled later (a trainer's stream writes the fence page) that were not taken at
     * once, and the time they waited for it or for their round */
    uint64_t signal_waits, signal_wait_ns;
    uint64_t fenced_releases; /* releases a trainer's stream signalled later (release_seq) */
    uint64_t ended_ns;        /* when the job joined the finished list (the metrics' grace) */
    struct sd_trace trace;    /* the flight recorder: the last calls and transfers (trace_ops) */
    struct sd_latency lat[SD_OP_COUNT];
};

/* allocation calls made by this thread (counted where the allocator can be wrapped) */
uint64_t sd_alloc_calls(void);
extern const bool sd_alloc_counted;
uint64_t sd_thread_cpu_ns(void);

#endif

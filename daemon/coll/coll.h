/* The collective engine: algorithms over the transport vtable, independent of jobs and of
 * libfabric. Bulk transfers split into chunks (each its own tagged message) so that a receiver
 * reduces chunk c while chunk c+1 is still on the wire; the ring all-reduce for large buffers and
 * the direct (latency-bound) all-reduce for small ones, which sums in node order. */
#ifndef SD_COLL_H
#define SD_COLL_H

#include "sd/gpu.h"
#include "transport/transport.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_bulk;
typedef void (*sd_bulk_cb)(struct sd_bulk *b, int status);
/* A received chunk: bytes [off, off + len) of piece `piece` are in place. */
typedef void (*sd_bulk_chunk_cb)(struct sd_bulk *b, uint32_t piece, size_t off, size_t len);

struct sd_bulk_xfer {
    struct sd_xfer x;
    struct sd_bulk *b;
    uint32_t piece;
    size_t off, len;
};

/* One chunked send or receive of n_pieces equal pieces to or from one peer. */
struct sd_bulk {
    struct sd_transport *tp;
    uint32_t peer, n, done, failed;
    int status;
    bool active, is_send;
    uint64_t bytes;
    sd_bulk_cb cb;
    sd_bulk_chunk_cb chunk_cb;
    void *arg;
    uint64_t arg2;
    struct sd_bulk *next_free;
    struct sd_bulk_xfer xs[SD_TAG_MAX_CHUNKS];
};

#define SD_BULK_MAX_PIECES 64

/* One chunked send or receive of n_pieces pieces to or from one peer. Chunk i (counted over
 * all pieces in order) travels with the tag's chunk field set to i; chunks are chunk_bytes, or
 * larger where the chunk field would run out (sd_bulk_chunk_bytes), and both ends compute the
 * same. cb runs once, after every chunk completed or failed; chunk_cb (receives) once per
 * chunk in place. */
struct sd_bulk_param {
    struct sd_transport *tp;
    bool is_send;
    uint32_t peer;
    uint64_t tag; /* its chunk field is set per chunk */
    void *const *pieces;
    const size_t *lens; /* bytes of each piece; NULL: every piece is piece_len */
    uint32_t n_pieces;
    size_t piece_len;
    size_t chunk_bytes;
    void *desc; /* the registration (providers with FI_MR_LOCAL) or NULL */
    sd_bulk_cb cb;
    sd_bulk_chunk_cb chunk_cb;
    void *arg;
    uint64_t arg2;
};

/* Post it; 0, or a negative status (nothing posted then; SD_EBUSY for a NULL or active bulk). */
int sd_bulk_start(struct sd_bulk *b, const struct sd_bulk_param *p);

/* The chunk size a bulk of n_pieces, the longest of `longest` bytes, is cut into: chunk_bytes,
 * or larger where the tag's chunk field would run out. Both ends of a transfer compute the
 * same. */
size_t sd_bulk_chunk_bytes(size_t longest, uint32_t n_pieces, size_t chunk_bytes);

/* An exchange with one peer: the receive of recv.bytes into recv.buf (chunk_cb per received
 * chunk) and the send of send.bytes from send.buf, each one piece, with bulks from pool; both
 * complete through cb with arg (and arg2). */
struct sd_coll_span {
    uint64_t tag;
    void *buf;
    size_t bytes;
    void *desc; /* the registration (providers with FI_MR_LOCAL) or NULL */
};
struct sd_bulk_pool;
struct sd_exchange_param {
    struct sd_bulk_pool *pool;
    struct sd_transport *tp;
    uint32_t peer;
    struct sd_coll_span recv, send;
    size_t chunk_bytes;
    sd_bulk_cb cb;
    sd_bulk_chunk_cb chunk_cb;
    void *arg;
    uint64_t arg2;
};
/* Returns how many were posted (0..2); a post that failed sets *status_p (if still 0) and
 * *suspect_p. *rb_p (if not NULL) is the receive's bulk, or NULL. */
uint32_t sd_bulk_exchange(const struct sd_exchange_param *p, struct sd_bulk **rb_p, int *status_p,
                          uint32_t *suspect_p);

/* A pool of bulks, allocated once. */
struct sd_bulk_pool {
    struct sd_bulk *all, *free;
    uint32_t n, in_use;
};
int sd_bulk_pool_init(struct sd_bulk_pool *p, uint32_t n);
void sd_bulk_pool_fini(struct sd_bulk_pool *p);
struct sd_bulk *sd_bulk_get(struct sd_bulk_pool *p);
void sd_bulk_put(struct sd_bulk_pool *p, struct sd_bulk *b);

/* All-reduce (sum) of `count` floats among the nodes in `members` (ascending; self among them),
 * in place. Ring for large buffers, direct for count * 4 <= small_bytes.
 *
 * With acc (count floats, the same values on every member), the sum is added into acc instead
 * and buf is scratch: in the ring, the member that completes a segment's sum adds it into its
 * acc and the all-gather moves that segment of acc, which the others take as theirs (it is the
 * sum they would have computed, bit for bit). A gradient accumulator that every replica keeps
 * identical saves the pass that adds the whole sum into it after the all-reduce; only 1/n of
 * it is added, by its owner. */
struct sd_allreduce;
typedef void (*sd_allreduce_cb)(struct sd_allreduce *ar, int status, uint32_t suspect);

/* The group of an all-reduce: its members (node ids, ascending, self among them) and the
 * resources it runs on. */
struct sd_coll_group {
    struct sd_transport *tp;
    struct sd_bulk_pool *pool;
    const uint32_t *members;
    uint32_t n_members, self;
};

/* The encoded all-reduce (qbits a codec of sd/codec.h: 4 or 8, blocks of qblock; SD_CODEC_BF16
 * or FP16, qblock 1): ZeRO++'s two quantization passes whatever the group size. buf is cut into n
 * segments of whole blocks, segment s being member s's. Each member encodes every other member's
 * segment once (with qerr, error feedback, int codecs only: the encoding error of each element is
 * kept there and added before the next encoding) and sends it to its member; a member adds the
 * decoded ones into its own exact segment in member order, in fp32, encodes that sum once,
 * decodes it back into place (so every member ends with the same values) and sends it to every
 * other member, which decodes it into place. A ring would encode at every one of its 2 (n - 1)
 * steps (and round a partial sum at each). With scatter, only the first pass: member pos owns
 * the segment sd_scatter_segment names (as the exact one's; with qblock 1 the same elements) and
 * ends with its fp32 sum there, never encoded. qbuf holds sd_allreduce_qbuf_bytes bytes. */
size_t sd_allreduce_qbuf_bytes(size_t count, uint32_t n, int qbits, uint32_t qblock);
/* Segment s of count elements in blocks of qblock among n: [begin, end). */
void sd_qsegment(size_t count, uint32_t n, uint32_t qblock, uint32_t s, size_t *begin_p,
                 size_t *end_p);

struct sd_allreduce_param {
    struct sd_coll_group group;
    const struct sd_gpu_ops *dev; /* every sum goes through the device backend, */
    struct sd_gpu_queue *queue;   /* on this queue: a sum leaves or is read once the queue passed
                                   * it (sd_allreduce_poll), never waited for */
    int dtype;                    /* of buf, tmp and acc: SD_DTYPE_FP32 */
    int qbits; /* 0: exact; else the codec (4, 8, SD_CODEC_BF16, SD_CODEC_FP16): no acc, no tmp */
    uint32_t qblock;
    uint8_t *qbuf;
    void *qbuf_desc;
    float *qerr; /* count floats of error feedback, or NULL */
    float *buf;
    size_t count;
    float *tmp; /* ring: ceil(count / n) floats; direct: (n - 1) * count floats */
    size_t tmp_count;
    float *acc; /* NULL: the sum stays in buf */
    /* Only the reduce-scatter: member pos ends with the whole sum of one segment,
     * sd_scatter_segment's, and the rest of its buf holds partial sums; half the bytes of the
     * all-reduce, and each element of that segment summed in the all-reduce's order (the same
     * bits). No acc; encoded (qbits), the first pass above. */
    bool scatter;
    void *buf_desc, *tmp_desc, *acc_desc; /* registrations (providers with FI_MR_LOCAL) or NULL */
    uint64_t
        tag_base; /* an SD_TAG_AR tag: the ring step goes into its seq (sd_tag_set_ring_step) */
    size_t chunk_bytes, small_bytes;
    sd_allreduce_cb cb;
    void *arg;
};

struct sd_allreduce {
    struct sd_allreduce_param p;
    uint32_t pos;
    bool direct;
    uint32_t pending; /* direct: transfers not completed; ring: posted and not completed */
    int status;
    uint32_t suspect;
    uint64_t bytes_sent, bytes_recv;
    /* ring: transfer (step t, chunk c) uses slot t * nch + c of sb's (sends) or rb's (receives)
     * transfers; state 0 not posted, 1 posted, 2 done */
    struct sd_bulk *sb, *rb;
    uint32_t steps, nch, left;
    size_t chunk_floats;
    uint8_t sstate[SD_TAG_MAX_CHUNKS], rstate[SD_TAG_MAX_CHUNKS];
    uint8_t rnext[SD_TAG_MAX_CHUNKS]; /* per chunk index: the next step to post a receive for */
    struct sd_bulk *direct_rb[SD_MAX_NODES > 64 ? 64 : SD_MAX_NODES];
    /* quantized: the phase (0 segments to their members, 1 the sums back), the bytes of a
     * qbuf slot, the send bulks (the receives are direct_rb's), held from start to finish, and
     * what the same transfers would have moved unquantized */
    uint32_t qphase;
    size_t qstride;
    struct sd_bulk *qsb[SD_MAX_NODES > 64 ? 64 : SD_MAX_NODES];
    uint64_t qraw;
    bool running; /* started, not finished */
    /* What goes on once the queue passed the sums enqueued before it, in queue order: a ring
     * receive slot whose sum is forwarded, or the start, the finish, a quantized phase (coll.c's
     * AR_W_*); each with the ticket recorded after its kernels. At most one per ring receive of
     * the reduce-scatter, plus one. */
    uint64_t w_ticket[SD_TAG_MAX_CHUNKS + 1];
    uint16_t w_what[SD_TAG_MAX_CHUNKS + 1];
    uint32_t w_head, w_n;
};

/* tmp must hold sd_allreduce_tmp_floats(count, n, small_bytes) floats. */
size_t sd_allreduce_tmp_floats(size_t count, uint32_t n, size_t small_bytes);
/* SD_EINVAL for a group without self or of fewer than two, a short tmp, another dtype than
 * fp32, a quantized one with acc or without qbuf, or a scatter one quantized or with acc; SD_EBUSY
 * when the pool has no bulks for it now (or through cb, when the start itself waited for the
 * queue). */
int sd_allreduce_start(struct sd_allreduce *ar, const struct sd_allreduce_param *p);
/* The engine never waits for the device: what reads the kernels' results (a send of buf, a
 * receive into the tmp chunk a sum still reads, the caller's cb) goes on once the queue passed
 * them, at once where it already has (the host backends), else from this poll, which the
 * owner calls from its loop while sd_allreduce_waiting: true if something went on. cb may run
 * in it (and start the all-reduce again). */
bool sd_allreduce_poll(struct sd_allreduce *ar);
bool sd_allreduce_waiting(const struct sd_allreduce *ar);
/* The owner gives a running all-reduce up (its job failed): nothing more is posted or waited
 * for (queued kernels finish on their own); cb gets status now when no transfer is in flight,
 * else from the last one's completion (the job's transfers are being cancelled). */
void sd_allreduce_abort(struct sd_allreduce *ar, int status);

/* Ring segment s of count floats among n: [begin, end). */
static inline void sd_ring_segment(size_t count, uint32_t n, uint32_t s, size_t *begin_p,
                                   size_t *end_p)
{
    *begin_p = count * s / n;
    *end_p = count * (s + 1) / n;
}

/* The segment a reduce-scatter leaves summed at member pos of n: the one the ring's last
 * reduce-scatter step completes there, (pos + 1) mod n, whose order of additions starts at member
 * pos + 1 and goes around the ring; the direct exchange uses the same segment. */
static inline void sd_scatter_segment(size_t count, uint32_t n, uint32_t pos, size_t *begin_p,
                                      size_t *end_p)
{
    sd_ring_segment(count, n, (pos + 1) % n, begin_p, end_p);
}

#endif

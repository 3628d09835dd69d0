/* The transport vtable (DESIGN.md section 6): tagged, asynchronous, reliable messages between the
 * daemons of a cluster. The collective engine uses nothing else; the libfabric transport
 * (transport/ofi.c) is the production one. Completions are reported through callbacks from
 * ops->progress(), which the daemon calls from its libuv loop. */
#ifndef SD_TRANSPORT_H
#define SD_TRANSPORT_H

#include "coll/tag.h"
#include "sd/config.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_gpu_ops; /* a device backend (sd/gpu.h) */

struct sd_transport;
struct sd_xfer;
struct sd_stage;
struct sd_bounce;

typedef void (*sd_xfer_cb)(struct sd_xfer *x, int status);

/* private to the stage (stage.c): a transfer of device memory while the stage holds it, kept in
 * the transfer so that staging allocates nothing per transfer */
struct sd_xfer_staged {
    struct sd_xfer *next; /* in the stage's waiting or copying list */
    struct sd_transport *tp;
    sd_xfer_cb cb; /* the caller's */
    void *arg;
    void *dev; /* the caller's device buffer: len bytes (a receive's capacity) */
    size_t len;
    struct sd_bounce *b;
    uint64_t ticket, tag, ignore;
    uint32_t peer;
    uint8_t state;
    bool send, cancelled;
};

/* One send or receive. The caller owns it until the callback ran. */
struct sd_xfer {
    uint64_t opaque[8]; /* provider context (struct fi_context2 fits) */
    sd_xfer_cb cb;
    void *arg;
    uint64_t tag;
    size_t len; /* bytes actually received, for receives */
    uint32_t peer;
    /* receives: the node the message came from (its source address is that node's in the
     * table; a message from an address outside it never completes a receive) */
    uint32_t from;
    /* private to the transport: the link of the one queue it is in (posts waiting for room,
     * sends waiting for a clear-to-send, receives whose clear-to-send waits) */
    struct sd_xfer *next_pending;
    const void *buf;
    size_t buflen;
    void *desc;
    uint64_t ignore;
    int kind;
    uint32_t rail;
    /* private to the transport's rendezvous (rendezvous_bytes): when a send was parked, and
     * where a receive's clear-to-send stands */
    uint64_t since_ns;
    int rdv;
    struct sd_xfer_staged staged;
    /* private to a job's view of the transport (net/job_tp.c): the poster's callback, and the
     * flight recorder's record of the transfer */
    sd_xfer_cb view_cb;
    void *view_trace; /* (struct sd_trace *) */
    uint64_t trace_id;
};

#define SD_PEER_ANY UINT32_MAX

struct sd_transport_ops {
    const char *name;
    /* The local address to publish; *len_p in: buffer size, out: address length. */
    int (*getname)(struct sd_transport *tp, void *addr, size_t *len_p);
    /* Install the cluster's address table (index = node). */
    int (*set_peers)(struct sd_transport *tp, const void *const *addrs, const size_t *lens,
                     uint32_t n);
    /* Register memory once (per job); *desc_p is what send/recv take (NULL if not needed). */
    int (*mr_reg)(struct sd_transport *tp, void *buf, size_t len, void **desc_p, void **handle_p);
    void (*mr_dereg)(struct sd_transport *tp, void *handle);
    int (*send)(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf, size_t len,
                void *desc, struct sd_xfer *x);
    /* peer SD_PEER_ANY: any source; bits set in ignore are wildcards of the tag */
    int (*recv)(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore, void *buf,
                size_t len, void *desc, struct sd_xfer *x);
    /* Cancel a posted receive, or a send still waiting for its receiver's clear-to-send (it
     * completes with SD_ECANCELED); a no-op otherwise. */
    void (*cancel)(struct sd_transport *tp, struct sd_xfer *x);
    /* Node is down for good: its addresses leave the table (the provider may then fail what was
     * posted to it), and sends and receives naming it fail at once from now on. */
    void (*peer_down)(struct sd_transport *tp, uint32_t node);
    /* Node is up but its data path does not carry messages (a probe found it dead): what is
     * posted to it fails, its connections are closed and its addresses put back, so that the
     * next transfer opens new ones. NULL: not supported. */
    int (*peer_reset)(struct sd_transport *tp, uint32_t node);
    /* Node's address (len bytes; 0: none) replaces what the table had for it, whatever its
     * state: an independent daemon's table fills as jobs name their peers. */
    int (*set_peer)(struct sd_transport *tp, uint32_t node, const void *addr, size_t len);
    /* Is addr (len bytes, from a peer: hostile until checked) a name this transport's endpoints
     * could have published: its rails, each of the length and form of this node's own (a
     * sockaddr's family and port for the providers that name endpoints so)? SD_OK, or SD_EINVAL
     * with what is wrong in why. set_peers and set_peer check it too. */
    int (*check_addr)(struct sd_transport *tp, const void *addr, size_t len, char *why,
                      size_t whylen);
    /* Drive progress and run callbacks; returns how many completed, or a negative status. */
    int (*progress)(struct sd_transport *tp);
    /* An fd that becomes readable when progress may have work, or -1. */
    int (*wait_fd)(struct sd_transport *tp);
    /* True if it is safe to sleep on wait_fd now (fi_trywait). */
    bool (*can_sleep)(struct sd_transport *tp);
    /* Stop all I/O (close the endpoint); registrations stay valid until close. */
    void (*quiesce)(struct sd_transport *tp);
    void (*close)(struct sd_transport *tp);
};

struct sd_transport {
    const struct sd_transport_ops *ops;
    uint32_t n_peers;
    uint32_t self;
    /* [n_peers]: the number each peer knows this node by (an independent daemon's peers number
     * it each their own way), which the messages naming their sender carry; NULL: self */
    const uint32_t *self_as;
    uint64_t inflight; /* posted sends and receives not completed */
    /* of them, receives that stand for messages that may never come (pull requests, probes):
     * counted by their posters, so that what is in flight beyond them is work to poll for */
    uint64_t standing;
    /* rendezvous: the threshold in effect (0: off), clear-to-sends sent and received, sends that
     * waited for theirs and sends that found theirs already there, clear-to-sends that waited
     * for credit */
    uint64_t rdv_bytes, cts_sent, cts_received, sends_parked, sends_cleared, cts_deferred;
    uint64_t posts_queued; /* posts that waited for room in an endpoint's queue */
    /* messages from fabric addresses outside the cluster's table, dropped (their receives
     * stand again) */
    uint64_t foreign_dropped;
    uint32_t data_lanes; /* endpoint pairs for bulk data (data_lanes) */
    /* the provider keeps a connection per pair of endpoints (tcp, ofi_rxm), which can outlive
     * the other side's: the cluster probes them (cluster/probe.c) and peer_reset closes them */
    bool connections;
    uint64_t lane_sends[SD_MAX_DATA_LANES]; /* data sends per lane */
    /* device memory staged through pinned host buffers (stage.c): the stage, the bytes copied
     * through it (both ways) and the bytes of bounce buffers it holds */
    struct sd_stage *stage;
    uint64_t staged_bytes, staging_buffer_bytes;
    /* the provider reaches the device backend's memory itself (FI_HMEM): it is registered
     * with the backend's interface and sent and received in place, not staged */
    bool hmem;
};

/* The number peer knows this node by. */
static inline uint32_t sd_transport_self_as(const struct sd_transport *tp, uint32_t peer)
{
    return tp->self_as != NULL && peer < tp->n_peers ? tp->self_as[peer] : tp->self;
}

/* Memory the transport cannot read or write itself (a GPU's, without FI_HMEM), and how bytes
 * move between it and host memory: the device backend's, for sd_transport_stage. */
struct sd_stage_hooks {
    void *ctx;
    bool (*is_device)(void *ctx, const void *p);
    /* enqueue dst = src (one side host memory, the other device memory); a ticket for done */
    int (*copy)(void *ctx, void *dst, const void *src, size_t n, uint64_t *ticket_p);
    /* SD_OK once the copy of ticket is done, SD_EAGAIN before, or its error */
    int (*done)(void *ctx, uint64_t ticket);
    int (*pinned_alloc)(void *ctx, size_t bytes, void **p_p);
    void (*pinned_free)(void *ctx, void *p);
    void (*release)(void *ctx); /* the transport closed: ctx is not used again */
};

/* From now on tp sends device memory from, and receives it into, pinned host buffers (stage.c):
 * tp->ops becomes the staged table over the transport's own. Sends hold at most cap bytes of
 * buffers at once. */
int sd_transport_stage(struct sd_transport *tp, const struct sd_stage_hooks *h, uint64_t cap);
/* At least count buffers of bytes each stand ready (a job's transfers in flight, at its set-up:
 * the data path then allocates none); a no-op on a transport that does not stage. */
int sd_transport_stage_reserve(struct sd_transport *tp, size_t bytes, uint32_t count);

/* Open the libfabric transport for cfg->provider on cfg->fabric_addr, for the shard buffers of
 * backend dev: where dev has device memory a provider may reach (sd_gpu_ops.hmem) and the
 * provider has FI_HMEM, tp->hmem (that memory registered with its interface), else it is to be
 * staged. err says why not. */
int sd_transport_ofi_open(const struct sd_config *cfg, const struct sd_gpu_ops *dev,
                          struct sd_transport **tp_p, char *err, size_t errlen);

#endif

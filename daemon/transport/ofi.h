/* The libfabric transport's private parts, shared by ofi.c (endpoints, posting, completions)
 * and ofi_rdv.c (the rendezvous protocol): the rails, their pending queues, and the state of
 * the rendezvous. Nothing outside transport/ includes it. */
#ifndef SD_TRANSPORT_OFI_H
#define SD_TRANSPORT_OFI_H

#include "transport/transport.h"
#include "sd/gpu.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(((struct sd_xfer *)0)->opaque) >= sizeof(struct fi_context2),
               "sd_xfer must hold a fi_context2");

/* XFER_PARKED: a rendezvous send waiting for its clear-to-send; XFER_CTS: a standing receive of
 * clear-to-sends (the transport's own, not counted in inflight) */
enum { XFER_SEND = 1, XFER_RECV = 2, XFER_PARKED = 3, XFER_CTS = 4 };

/* Endpoints ("rails"): control, clear-to-send (opened only with rendezvous), then one pair per
 * data lane, outbound and inbound. A send on rail r goes to the peer's rail peer_rail(r); a
 * receive on r matches sources there. A chunk travels on lane chunk % lanes, which both ends
 * compute from the tag: each lane is a stream of its own in the provider (with shm, one
 * segmented message in flight per pair of endpoints; with tcp;ofi_rxm, one connection). */
enum { RAIL_CTRL = 0, RAIL_RDV = 1, RAIL_DATA = 2, MAX_RAILS = RAIL_DATA + 2 * SD_MAX_DATA_LANES };

static inline uint32_t peer_rail(uint32_t r)
{
    return r < RAIL_DATA ? r : r ^ 1; /* outbound 2 + 2l <-> inbound 3 + 2l */
}

static inline const char *rail_name(uint32_t r, char *buf, size_t len)
{
    if (r < RAIL_DATA)
        return r == RAIL_CTRL ? "control" : "clear-to-send";
    snprintf(buf, len, "data lane %u %s", (r - RAIL_DATA) / 2, r & 1 ? "inbound" : "outbound");
    return buf;
}

/* A FIFO of transfers, linked through next_pending: a rail's posts that wait for room, or a
 * rendezvous queue. A transfer is in one at a time. */
struct xqueue {
    struct sd_xfer *head, *tail;
};

static inline void xq_push(struct xqueue *q, struct sd_xfer *x)
{
    x->next_pending = NULL;
    if (q->tail)
        q->tail->next_pending = x;
    else
        q->head = x;
    q->tail = x;
}

static inline void xq_push_front(struct xqueue *q, struct sd_xfer *x)
{
    x->next_pending = q->head;
    q->head = x;
    if (q->tail == NULL)
        q->tail = x;
}

static inline struct sd_xfer *xq_pop(struct xqueue *q)
{
    struct sd_xfer *x = q->head;
    if (x != NULL) {
        q->head = x->next_pending;
        if (q->head == NULL)
            q->tail = NULL;
    }
    return x;
}

static inline bool xq_remove(struct xqueue *q, struct sd_xfer *x)
{
    for (struct sd_xfer **pp = &q->head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next_pending)
        if (*pp == x) {
            *pp = x->next_pending;
            if (q->tail == x)
                q->tail = prev;
            return true;
        }
    return false;
}

struct rail {
    struct fid_ep *ep;
    size_t tx_posted, rx_posted;
    struct xqueue pending;
};

struct rdv_msg {
    uint64_t tag;
    uint32_t src;
    uint32_t magic;
};

#define RDV_MAGIC 0x53445254u /* "SDRT" */

/* Standing receives of clear-to-sends. libfabric 1.17's shm loses some of the small messages
 * that arrive while every receive is taken (a few dozen in thousands, measured), so each node
 * keeps at most rdv_credit clear-to-sends unanswered (no data back yet) toward each peer, which
 * together stay within the peer's standing receives; the rest wait in the peer's queue. */
#define RDV_RECV_SLOTS 512

#define RDV_BUCKETS 1024

/* A clear-to-send that arrived before its send lives this long (a receive cancelled when its
 * job failed leaves one behind); then it is dropped. */
#define RDV_STALE_NS (600ULL * 1000000000ULL)

struct rdv_slot {
    struct sd_xfer x;
    struct rdv_msg m;
};

/* Clear-to-sends from peer for tag that arrived before their send, from a pool sized at open:
 * a peer has at most rdv_credit of them unanswered toward this node, together the standing
 * receives; twice that leaves room for those whose receive was cancelled (a failed job), which
 * age out. */
struct rdv_cts {
    struct rdv_cts *next;
    uint64_t tag, since_ns;
    uint32_t peer, count;
};

/* a posted receive's clear-to-send: waiting for credit, waiting for the provider to take it,
 * or sent and not answered yet */
enum { RDV_NONE = 0, RDV_DEFERRED, RDV_RETRY, RDV_OUT };

/* clear-to-sends toward one peer: sent and not answered yet, and the receives waiting for
 * credit */
struct rdv_peer {
    uint32_t out;
    struct xqueue deferred;
};

struct ofi {
    struct sd_transport base;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct rail rails[MAX_RAILS]; /* ep NULL: not opened (clear-to-send without rendezvous) */
    uint32_t n_rails;             /* RAIL_DATA + 2 * base.data_lanes */
    fi_addr_t *peers;             /* [rail * n_peers + node] */
    uint8_t (*addrs)[256];        /* [node]: the published addresses, to put back (peer_reset) */
    size_t *addr_lens;            /* [node] */
    bool *down;                   /* [node] */
    int wait_fd;
    bool need_mr;
    const struct sd_gpu_ops *dev; /* the shard buffers' backend: its device memory, with
                                   * base.hmem, is registered with its FI_HMEM interface */
    uint64_t mr_keys; /* keys asked for so far (a provider without FI_MR_PROV_KEY wants each
                       * registration's own) */
    size_t tx_depth, rx_depth;
    /* rendezvous (base.rdv_bytes > 0) */
    struct rdv_slot *rdv_slots;
    uint32_t rdv_slots_n, rdv_credit;
    void *rdv_desc, *rdv_mr;
    struct sd_xfer *parked[RDV_BUCKETS]; /* sends waiting, chained through next_pending */
    struct rdv_cts *early[RDV_BUCKETS];
    struct rdv_cts *cts_pool, *cts_free;
    uint32_t cts_pool_n, early_n, parked_n;
    struct rdv_peer *rdv_peers; /* [node], with the address table */
    struct xqueue retry;        /* receives whose clear-to-send the provider refused */
    uint64_t rdv_sweep_ns;
};

static inline struct rail *rail_of(struct ofi *o, const struct sd_xfer *x)
{
    return &o->rails[x->rail];
}

static inline int to_status(ssize_t r)
{
    return r == -FI_EAGAIN ? SD_EAGAIN : r == -FI_ETIMEDOUT ? SD_ETIMEDOUT : SD_EIO;
}

/* ---- ofi.c, for the rendezvous */
/* Try to post; returns 0 when posted, SD_EAGAIN when it must wait, or an error. */
int sd_ofi__post(struct ofi *o, struct sd_xfer *x);
/* Post x, counted in inflight already, or queue it behind its rail's pending posts; on an
 * error it is no longer counted. */
int sd_ofi__issue(struct ofi *o, struct sd_xfer *x);

/* ---- ofi_rdv.c */
/* does a send of len bytes with tag wait for a clear-to-send? */
bool sd_ofi__rdv_sized(const struct ofi *o, uint64_t tag, size_t len);
/* park send x until its clear-to-send arrives (or post it, when it already did) */
int sd_ofi__rdv_send(struct ofi *o, struct sd_xfer *x);
/* Take parked send x out (cancel); false if it is not parked. */
bool sd_ofi__rdv_unpark(struct ofi *o, struct sd_xfer *x);
/* Receive x is posted: tell its peer, within the peer's credit. */
void sd_ofi__cts_send(struct ofi *o, struct sd_xfer *x);
/* Receive x completed (or was cancelled): its clear-to-send is answered, or no longer needed,
 * and the next receive waiting for credit toward its peer can send one. */
void sd_ofi__cts_done(struct ofi *o, struct sd_xfer *x);
/* clear-to-sends the provider refused for now, again */
void sd_ofi__cts_retry(struct ofi *o);
/* Once a second: drop clear-to-sends no send came for (their receives were cancelled), and
 * name sends that wait long for theirs. */
void sd_ofi__rdv_sweep(struct ofi *o);
/* the clear-to-send endpoint's standing receives and the early pool */
int sd_ofi__rdv_start(struct ofi *o);

#endif

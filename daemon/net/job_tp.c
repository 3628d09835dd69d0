/* A job's view of the transport: the same transport, with the job's nodes for peers. A job
 * runs on any of the cluster's nodes and numbers them by its ranks (job.h: node, node_ids), so
 * everything it sends, receives and puts in its tags names job nodes; this view maps a peer to
 * the cluster node the transport knows (SD_PEER_ANY stays: the tag says which job and node).
 * Nothing else changes: the completions, the staging of device memory and the counters are
 * the transport's own. */
#include "net.h"
#include "transport/transport.h"
#include "coll/tag.h"
#include "job.h"
#include "sd/status.h"
#include "sd/trace.h"
#include "sd/util.h"

#include <stdlib.h>

struct job_view {
    struct sd_transport base;
    struct sd_transport *tp; /* the node's */
    const uint32_t *ids;     /* [n]: the job's node_ids */
    uint32_t n;
    struct sd_trace *trace; /* the job's flight recorder */
};

static struct job_view *view_of(struct sd_transport *tp)
{
    return (struct job_view *)tp;
}

/* the transport's peer for job node peer (SD_NODE_UNKNOWN: none, or not confirmed yet) */
static uint32_t view_peer(const struct job_view *v, uint32_t peer)
{
    if (peer == SD_PEER_ANY)
        return SD_PEER_ANY;
    return peer < v->n ? v->ids[peer] : SD_NODE_UNKNOWN;
}

/* The flight recorder sees every transfer of the job here: a chunk joins its transfer's record
 * (same direction, peer and tag but the chunk), completed when its last chunk is. */
static void view_done(struct sd_xfer *x, int status)
{
    sd_trace_xfer_done(x->view_trace, x->trace_id, status, sd_now_ns());
    x->cb = x->view_cb;
    x->cb(x, status);
}

/* record x before it is posted (its completion may come from any later progress call) */
static void trace_begin(struct job_view *v, bool send, uint32_t peer, uint64_t tag, size_t len,
                        struct sd_xfer *x)
{
    if (v->trace == NULL || v->trace->recs == NULL)
        return;
    struct sd_tag_fields f = sd_tag_unpack(tag);
    x->trace_id = sd_trace_xfer(v->trace, send, peer, tag & ~sd_tag_mask(SD_TAGF_CHUNK), f.kind,
                                f.unit, f.seq, len, sd_now_ns());
    x->view_trace = v->trace;
    x->view_cb = x->cb;
    x->cb = view_done;
}

/* after the post: one that failed completes nothing (its record says so) */
static int trace_posted(struct sd_xfer *x, int st)
{
    if (st != SD_OK && x->cb == view_done) {
        sd_trace_xfer_done(x->view_trace, x->trace_id, st, sd_now_ns());
        x->cb = x->view_cb;
    }
    return st;
}

static int view_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf,
                     size_t len, void *desc, struct sd_xfer *x)
{
    struct job_view *v = view_of(tp);
    uint32_t p = view_peer(v, peer);
    if (p == SD_NODE_UNKNOWN || p == SD_PEER_ANY)
        return SD_EINVAL;
    trace_begin(v, true, peer, tag, len, x);
    return trace_posted(x, v->tp->ops->send(v->tp, p, tag, buf, len, desc, x));
}

static int view_recv(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore,
                     void *buf, size_t len, void *desc, struct sd_xfer *x)
{
    struct job_view *v = view_of(tp);
    uint32_t p = view_peer(v, peer);
    if (p == SD_NODE_UNKNOWN)
        return SD_EINVAL;
    trace_begin(v, false, peer, tag, len, x);
    return trace_posted(x, v->tp->ops->recv(v->tp, p, tag, ignore, buf, len, desc, x));
}

static int view_mr_reg(struct sd_transport *tp, void *buf, size_t len, void **desc_p,
                       void **handle_p)
{
    struct job_view *v = view_of(tp);
    return v->tp->ops->mr_reg(v->tp, buf, len, desc_p, handle_p);
}

static void view_mr_dereg(struct sd_transport *tp, void *handle)
{
    struct job_view *v = view_of(tp);
    v->tp->ops->mr_dereg(v->tp, handle);
}

static void view_cancel(struct sd_transport *tp, struct sd_xfer *x)
{
    struct job_view *v = view_of(tp);
    v->tp->ops->cancel(v->tp, x);
}

/* what a job does with the transport: the rest (addresses, progress, peers going down) is the
 * node's, on the transport itself */
static const struct sd_transport_ops view_ops = {.name = "job",
                                                 .mr_reg = view_mr_reg,
                                                 .mr_dereg = view_mr_dereg,
                                                 .send = view_send,
                                                 .recv = view_recv,
                                                 .cancel = view_cancel};

int sd_job_tp_open(struct sd_job *job)
{
    struct sd_transport *tp = sd_net_transport(job->xfer.net);
    struct job_view *v = calloc(1, sizeof(*v));
    if (v == NULL)
        return SD_ENOMEM;
    v->base.ops = &view_ops;
    v->base.n_peers = job->nodes;
    v->base.self = job->node;
    v->tp = tp;
    v->ids = job->xfer.node_ids;
    v->n = job->nodes;
    v->trace = &job->stats.trace;
    job->xfer.tp = &v->base;
    return SD_OK;
}

void sd_job_tp_close(struct sd_job *job)
{
    free(job->xfer.tp);
    job->xfer.tp = NULL;
}

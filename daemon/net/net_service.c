/* The node's network service (net_service.h): the transport and cluster a node's jobs share,
 * and the standing receives for pull requests (SD_TAG_REQ). A request is checked for its magic
 * and handed to the job its tag names (fetch.c checks it against the job and serves it); one
 * for a job not confirmed here yet (the coordinator's confirmation can arrive after a faster
 * node already asks) is kept for op_timeout_ms and handed over on confirmation. */
#include "net_service.h"
#include "coll/tag.h"
#include "job.h"
#include "pull.h"
#include "transport/transport.h"
#include "sd/config.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdlib.h>

#define SD_NET_REQ_SLOTS 64
struct sd_net_req {
    struct sd_xfer x;
    struct sd_req_msg msg;
    struct sd_registry *reg;
};
#define SD_NET_EARLY_REQS 256
/* a pull request for a job not confirmed here yet */
struct sd_net_early {
    struct sd_req_msg m;
    uint64_t ns;   /* when it came */
    uint32_t from; /* the cluster node it came from */
};
struct sd_net {
    bool posted;
    struct sd_net_early early[SD_NET_EARLY_REQS];
    uint32_t n_early;
    struct sd_transport *tp;
    struct sd_cluster *cl;
    sd_net_serve_fn serve;
    struct sd_net_req reqs[SD_NET_REQ_SLOTS];
    void *reqs_desc, *reqs_mr; /* reqs registered (providers with FI_MR_LOCAL) */
};

struct sd_cluster *sd_net_cluster(const struct sd_net *net)
{
    return net != NULL ? net->cl : NULL;
}

struct sd_transport *sd_net_transport(const struct sd_net *net)
{
    return net->tp;
}

/* pull request m, received from cluster node from */
static void on_request(struct sd_registry *reg, const struct sd_req_msg *m, uint32_t from)
{
    if (m->magic != SD_REQ_MAGIC) {
        SD_WARN_SPARSE("net", "dropping a malformed pull request");
        return;
    }
    struct sd_job *job = sd_registry_find_tag(reg, m->job_tag);
    if (job != NULL && (m->src >= job->nodes || sd_job_node_id(job, m->src) != from)) {
        SD_WARN_SPARSE("net",
                       "dropping a pull request for job '%s' that names its node %u, from cluster "
                       "node %u (not that node)",
                       job->name, (unsigned)m->src, (unsigned)from);
        return;
    }
    if (job == NULL) { /* maybe confirmed here a moment from now */
        struct sd_net *net = reg->net;
        uint64_t now = sd_now_ns(), keep = (uint64_t)reg->cfg->op_timeout_ms * 1000000ULL;
        uint32_t kept = 0;
        for (uint32_t i = 0; i < net->n_early; i++)
            if (now - net->early[i].ns < keep)
                net->early[kept++] = net->early[i];
        net->n_early = kept;
        if (kept < SD_NET_EARLY_REQS) {
            net->early[net->n_early++] = (struct sd_net_early){.m = *m, .ns = now, .from = from};
            return;
        }
        SD_WARN_SPARSE("net", "too many pull requests for unknown jobs; dropping one for tag %u",
                       m->job_tag);
        return;
    }
    reg->net->serve(job, m);
}

void sd_net_job_confirmed(struct sd_registry *reg, uint32_t job_tag)
{
    struct sd_net *net = reg->net;
    if (net == NULL)
        return;
    uint32_t kept = 0, n = net->n_early;
    struct sd_net_early mine[SD_NET_EARLY_REQS];
    uint32_t n_mine = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (net->early[i].m.job_tag == job_tag)
            mine[n_mine++] = net->early[i];
        else
            net->early[kept++] = net->early[i];
    }
    net->n_early = kept;
    for (uint32_t i = 0; i < n_mine; i++)
        on_request(reg, &mine[i].m, mine[i].from);
}

bool sd_net_busy(const struct sd_registry *reg)
{
    if (reg->net == NULL)
        return false;
    const struct sd_transport *tp = reg->net->tp;
    /* While jobs are here, only the pull requests' standing receives are no work: the probes'
     * keep the millisecond re-poll, which drives what a manual-progress provider (ofi_rxm) does
     * only inside progress calls and its wait fd does not announce (connection setup to a new
     * peer: a meeting under a flood failed its deadline without it). With no job, every standing
     * receive is no work: a daemon whose jobs ended sleeps on the wait fd (it re-polled every
     * millisecond for ever, 2.6% of a core). */
    uint64_t idle = reg->jobs != NULL ? (reg->net->posted ? SD_NET_REQ_SLOTS : 0) : tp->standing;
    return tp->inflight > idle;
}

static void req_recv_cb(struct sd_xfer *x, int status);

static int post_req_recv(struct sd_net_req *r, struct sd_net *net)
{
    struct sd_transport *tp = net->tp;
    r->x.cb = req_recv_cb;
    int st = tp->ops->recv(tp, SD_PEER_ANY, sd_tag_of_kind(SD_TAG_REQ), sd_tag_any_but_kind(),
                           &r->msg, sizeof(r->msg), net->reqs_desc, &r->x);
    tp->standing += st == SD_OK;
    return st;
}

static void req_recv_cb(struct sd_xfer *x, int status)
{
    struct sd_net_req *r = (struct sd_net_req *)x;
    struct sd_registry *reg = r->reg;
    if (reg->net != NULL)
        reg->net->tp->standing--;
    if (status == SD_ECANCELED || reg->net == NULL)
        return; /* cancelled at shutdown */
    if (status == SD_OK && x->len == sizeof(r->msg))
        on_request(reg, &r->msg, x->from);
    else /* a receive the provider failed (a connection torn down under it): it stands again,
          * or each such error would leave one standing receive fewer for good */
        SD_WARN_SPARSE("net",
                       "a pull request's receive completed with %s (%zu bytes); posted again",
                       sd_status_str(status), x->len);
    if (post_req_recv(r, reg->net) != SD_OK)
        SD_ERROR("net", "cannot post a pull request's receive again: this node serves fewer "
                        "gathers at once");
}

/* ---- device memory across nodes: the transport stages it through pinned host buffers, with
 * the backend's copies on a queue of their own (transport/stage.c) */

/* bytes of bounce buffers the node's sends hold at most (receives always get theirs) */
#define SD_NET_STAGE_SEND_BYTES (256ull << 20)

struct dev_stage {
    const struct sd_gpu_ops *dev;
    struct sd_gpu_queue *q;
};

static bool stage_is_device(void *ctx, const void *p)
{
    return ((struct dev_stage *)ctx)->dev->is_device(p);
}

static int stage_copy(void *ctx, void *dst, const void *src, size_t n, uint64_t *ticket_p)
{
    struct dev_stage *ds = ctx;
    ds->dev->copy(ds->q, dst, src, n);
    return ds->dev->record(ds->q, ticket_p);
}

static int stage_done(void *ctx, uint64_t ticket)
{
    struct dev_stage *ds = ctx;
    return ds->dev->query(ds->q, ticket);
}

static int stage_pinned_alloc(void *ctx, size_t bytes, void **p_p)
{
    return ((struct dev_stage *)ctx)->dev->pinned_alloc(bytes, p_p);
}

static void stage_pinned_free(void *ctx, void *p)
{
    ((struct dev_stage *)ctx)->dev->pinned_free(p);
}

static void stage_release(void *ctx)
{
    struct dev_stage *ds = ctx;
    ds->dev->queue_destroy(ds->q);
    free(ds);
}

static int stage_device_memory(struct sd_transport *tp, const struct sd_gpu_ops *dev)
{
    struct dev_stage *ds = calloc(1, sizeof(*ds));
    if (ds == NULL)
        return SD_ENOMEM;
    ds->dev = dev;
    int st = dev->queue_create(&ds->q);
    if (st != SD_OK) {
        free(ds);
        return st;
    }
    struct sd_stage_hooks h = {.ctx = ds,
                               .is_device = stage_is_device,
                               .copy = stage_copy,
                               .done = stage_done,
                               .pinned_alloc = stage_pinned_alloc,
                               .pinned_free = stage_pinned_free,
                               .release = stage_release};
    st = sd_transport_stage(tp, &h, SD_NET_STAGE_SEND_BYTES);
    if (st != SD_OK)
        stage_release(ds);
    return st;
}

int sd_net_start(struct sd_registry *reg, struct sd_transport *tp, struct sd_cluster *cl,
                 sd_net_serve_fn serve)
{
    /* a device whose memory the provider cannot reach (no FI_HMEM, or not for this device) */
    if (reg->dev->is_device != NULL && !tp->hmem) {
        int st = stage_device_memory(tp, reg->dev);
        if (st != SD_OK)
            return st;
    }
    struct sd_net *net = calloc(1, sizeof(*net));
    if (net == NULL)
        return SD_ENOMEM;
    net->tp = tp;
    net->cl = cl;
    net->serve = serve;
    reg->net = net;
    reg->cluster = cl;
    return SD_OK;
}

void sd_net_set_cluster(struct sd_registry *reg, struct sd_cluster *cl)
{
    reg->net->cl = cl;
    reg->cluster = cl;
}

/* Standing receives for pull requests, once the peers are known. */
int sd_net_post_requests(struct sd_registry *reg)
{
    if (reg->net == NULL || reg->net->posted)
        return SD_OK;
    struct sd_net *net = reg->net;
    net->posted = true;
    int st =
        net->tp->ops->mr_reg(net->tp, net->reqs, sizeof(net->reqs), &net->reqs_desc, &net->reqs_mr);
    if (st != SD_OK)
        return st;
    for (uint32_t i = 0; i < SD_NET_REQ_SLOTS; i++) {
        net->reqs[i].reg = reg;
        st = post_req_recv(&net->reqs[i], net);
        if (st != SD_OK)
            return st;
    }
    return SD_OK;
}

/* After the transport was quiesced and every job freed. */
void sd_net_stop(struct sd_registry *reg)
{
    if (reg->net != NULL && reg->net->reqs_mr != NULL)
        reg->net->tp->ops->mr_dereg(reg->net->tp, reg->net->reqs_mr);
    free(reg->net);
    reg->net = NULL;
    reg->cluster = NULL;
}

/* The libfabric transport: three FI_EP_RDM endpoints on one domain. Bulk data leaves through an
 * outbound endpoint and arrives at an inbound one, so the connection a provider such as ofi_rxm
 * makes from node a's outbound endpoint to node b's inbound one carries a's data to b and only
 * b's protocol replies for it (rendezvous reads, acknowledgements) back: b's own data to a never
 * sits in front of them. With one endpoint both ways, each node's replies queue behind its own
 * bulk data and two nodes sending to each other take turns at half the link each. Small
 * latency-bound messages (sd_tag_is_ctrl) use a control endpoint for the same reason. One
 * FI_AV_TABLE holds every node's three endpoints (rail r of node i at r * n + i); one completion
 * queue with a wait fd the libuv loop polls. Provider limits are read back from fi_getinfo;
 * posts beyond an endpoint's tx/rx queue depth, and any -FI_EAGAIN, go to that endpoint's pending
 * queue, retried on progress. Memory is registered only when the provider asks for it
 * (FI_MR_LOCAL). */
#include "transport.h"
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

enum { XFER_SEND = 1, XFER_RECV = 2 };
/* a send on rail r goes to the peer's rail peer_rail[r]; a receive on r matches sources there */
enum { RAIL_OUT = 0, RAIL_IN = 1, RAIL_CTRL = 2, N_RAILS = 3 };
static const uint32_t peer_rail[N_RAILS] = {RAIL_IN, RAIL_OUT, RAIL_CTRL};
static const char *const rail_name[N_RAILS] = {"outbound data", "inbound data", "control"};

struct rail {
    struct fid_ep *ep;
    size_t tx_posted, rx_posted;
    struct sd_xfer *pending_head, *pending_tail;
};

struct ofi {
    struct sd_transport base;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct rail rails[N_RAILS];
    fi_addr_t *peers; /* [rail * n_peers + node] */
    int wait_fd;
    bool need_mr;
    size_t tx_depth, rx_depth;
};

static struct rail *rail_of(struct ofi *o, const struct sd_xfer *x)
{
    return &o->rails[x->rail];
}

static int to_status(ssize_t r)
{
    return r == -FI_EAGAIN ? SD_EAGAIN : r == -FI_ETIMEDOUT ? SD_ETIMEDOUT : SD_EIO;
}

/* The published address: for each rail, one byte with the length of its endpoint's name, then
 * the name. */
static int ofi_getname(struct sd_transport *tp, void *addr, size_t *len_p)
{
    struct ofi *o = (struct ofi *)tp;
    uint8_t *out = addr;
    size_t used = 0;
    for (uint32_t r = 0; r < N_RAILS; r++) {
        if (*len_p < used + 2)
            return SD_EMSGSIZE;
        size_t len = SD_MIN(*len_p - used - 1, 255);
        if (fi_getname(&o->rails[r].ep->fid, out + used + 1, &len) != 0)
            return SD_EMSGSIZE;
        out[used] = (uint8_t)len;
        used += 1 + len;
    }
    *len_p = used;
    return SD_OK;
}

static int ofi_set_peers(struct sd_transport *tp, const void *const *addrs, const size_t *lens,
                         uint32_t n)
{
    struct ofi *o = (struct ofi *)tp;
    free(o->peers);
    o->peers = calloc((size_t)N_RAILS * n, sizeof(*o->peers));
    if (o->peers == NULL)
        return SD_ENOMEM;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *a = addrs[i];
        size_t used = 0;
        for (uint32_t r = 0; r < N_RAILS; r++) {
            if (used >= lens[i] || used + 1 + a[used] > lens[i]) {
                SD_ERROR("ofi", "node %u published a malformed fabric address (%zu bytes)", i,
                         lens[i]);
                return SD_EINVAL;
            }
            int ret = fi_av_insert(o->av, a + used + 1, 1, &o->peers[(size_t)r * n + i], 0, NULL);
            if (ret != 1) {
                SD_ERROR("ofi", "fi_av_insert of node %u's %s endpoint failed: %d", i, rail_name[r],
                         ret);
                return SD_EINVAL;
            }
            used += 1 + a[used];
        }
    }
    tp->n_peers = n;
    return SD_OK;
}

static int ofi_mr_reg(struct sd_transport *tp, void *buf, size_t len, void **desc_p,
                      void **handle_p)
{
    struct ofi *o = (struct ofi *)tp;
    *desc_p = NULL;
    *handle_p = NULL;
    if (!o->need_mr || len == 0)
        return SD_OK;
    struct fid_mr *mr;
    int r = fi_mr_reg(o->domain, buf, len, FI_SEND | FI_RECV, 0, 0, 0, &mr, NULL);
    if (r != 0) {
        SD_ERROR("ofi", "fi_mr_reg of %zu bytes: %s", len, fi_strerror(-r));
        return SD_EIO;
    }
    *desc_p = fi_mr_desc(mr);
    *handle_p = mr;
    return SD_OK;
}

static void ofi_mr_dereg(struct sd_transport *tp, void *handle)
{
    (void)tp;
    if (handle != NULL)
        fi_close(&((struct fid_mr *)handle)->fid);
}

static void pending_push(struct rail *rl, struct sd_xfer *x)
{
    x->next_pending = NULL;
    if (rl->pending_tail)
        rl->pending_tail->next_pending = x;
    else
        rl->pending_head = x;
    rl->pending_tail = x;
}

/* Try to post; returns 0 when posted, SD_EAGAIN when it must wait, or an error. */
static int post(struct ofi *o, struct sd_xfer *x)
{
    struct rail *rl = rail_of(o, x);
    size_t base = (size_t)peer_rail[x->rail] * o->base.n_peers;
    ssize_t r;
    if (x->kind == XFER_SEND) {
        if (rl->tx_posted >= o->tx_depth)
            return SD_EAGAIN;
        r = fi_tsend(rl->ep, x->buf, x->buflen, x->desc, o->peers[base + x->peer], x->tag,
                     x->opaque);
        if (r == 0)
            rl->tx_posted++;
    } else {
        if (rl->rx_posted >= o->rx_depth)
            return SD_EAGAIN;
        fi_addr_t src = x->peer == SD_PEER_ANY ? FI_ADDR_UNSPEC : o->peers[base + x->peer];
        r = fi_trecv(rl->ep, (void *)x->buf, x->buflen, x->desc, src, x->tag, x->ignore, x->opaque);
        if (r == 0)
            rl->rx_posted++;
    }
    if (r == 0)
        return SD_OK;
    if (r == -FI_EAGAIN)
        return SD_EAGAIN;
    SD_ERROR("ofi", "%s of %zu bytes to node %d: %s",
             x->kind == XFER_SEND ? "fi_tsend" : "fi_trecv", x->buflen,
             x->peer == SD_PEER_ANY ? -1 : (int)x->peer, fi_strerror((int)-r));
    return to_status(r);
}

static int submit(struct ofi *o, struct sd_xfer *x)
{
    /* a wildcard over the kind bits could match either rail: such receives stay on data */
    if ((x->ignore >> 60) == 0 && sd_tag_is_ctrl(x->tag))
        x->rail = RAIL_CTRL;
    else
        x->rail = x->kind == XFER_SEND ? RAIL_OUT : RAIL_IN;
    struct rail *rl = rail_of(o, x);
    if (rl->ep == NULL)
        return SD_ENOTCONN;
    o->base.inflight++;
    if (rl->pending_head == NULL) {
        int st = post(o, x);
        if (st != SD_EAGAIN) {
            if (st != SD_OK)
                o->base.inflight--;
            return st;
        }
    }
    pending_push(rl, x);
    return SD_OK;
}

static int ofi_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf,
                    size_t len, void *desc, struct sd_xfer *x)
{
    struct ofi *o = (struct ofi *)tp;
    if (peer >= tp->n_peers)
        return SD_EINVAL;
    x->kind = XFER_SEND;
    x->peer = peer;
    x->tag = tag;
    x->ignore = 0;
    x->buf = buf;
    x->buflen = len;
    x->desc = desc;
    x->len = len;
    return submit(o, x);
}

static int ofi_recv(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore,
                    void *buf, size_t len, void *desc, struct sd_xfer *x)
{
    struct ofi *o = (struct ofi *)tp;
    if (peer != SD_PEER_ANY && peer >= tp->n_peers)
        return SD_EINVAL;
    x->kind = XFER_RECV;
    x->peer = peer;
    x->tag = tag;
    x->ignore = ignore;
    x->buf = buf;
    x->buflen = len;
    x->desc = desc;
    x->len = 0;
    return submit(o, x);
}

static void ofi_cancel(struct sd_transport *tp, struct sd_xfer *x)
{
    struct ofi *o = (struct ofi *)tp;
    if (x->kind != XFER_RECV || rail_of(o, x)->ep == NULL)
        return;
    struct rail *rl = rail_of(o, x);
    /* still in the pending queue: take it out and complete it here */
    for (struct sd_xfer **pp = &rl->pending_head, *prev = NULL; *pp;
         prev = *pp, pp = &(*pp)->next_pending)
        if (*pp == x) {
            *pp = x->next_pending;
            if (rl->pending_tail == x)
                rl->pending_tail = prev;
            o->base.inflight--;
            x->kind = 0;
            x->cb(x, SD_ECANCELED);
            return;
        }
    fi_cancel(&rl->ep->fid, x->opaque);
}

static void complete(struct ofi *o, struct sd_xfer *x, int status, size_t len, uint64_t tag)
{
    if (x->kind == XFER_SEND)
        rail_of(o, x)->tx_posted--;
    else
        rail_of(o, x)->rx_posted--;
    o->base.inflight--;
    if (x->kind == XFER_RECV) {
        x->len = len;
        x->tag = tag;
    }
    x->kind = 0; /* no longer posted: cancel ignores it */
    x->cb(x, status);
}

static int ofi_progress(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    struct fi_cq_tagged_entry e[16];
    int done = 0;
    for (;;) {
        ssize_t n = fi_cq_read(o->cq, e, 16);
        if (n > 0) {
            for (ssize_t i = 0; i < n; i++)
                complete(o, (struct sd_xfer *)e[i].op_context, SD_OK, e[i].len, e[i].tag);
            done += (int)n;
            continue;
        }
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err = {0};
            if (fi_cq_readerr(o->cq, &err, 0) == 1) {
                struct sd_xfer *x = err.op_context;
                SD_WARN_SPARSE("ofi", "completion error on node %d: %s",
                               x->peer == SD_PEER_ANY ? -1 : (int)x->peer,
                               fi_cq_strerror(o->cq, err.prov_errno, err.err_data, NULL, 0));
                complete(o, x, err.err == FI_ECANCELED ? SD_ECANCELED : SD_EIO, err.len, err.tag);
                done++;
                continue;
            }
        }
        break;
    }
    for (uint32_t i = 0; i < N_RAILS; i++) {
        struct rail *rl = &o->rails[i];
        while (rl->pending_head != NULL) {
            struct sd_xfer *x = rl->pending_head;
            int st = post(o, x);
            if (st == SD_EAGAIN)
                break;
            rl->pending_head = x->next_pending;
            if (rl->pending_head == NULL)
                rl->pending_tail = NULL;
            if (st != SD_OK) {
                o->base.inflight--;
                x->cb(x, st);
                done++;
            }
        }
    }
    return done;
}

static int ofi_wait_fd(struct sd_transport *tp)
{
    return ((struct ofi *)tp)->wait_fd;
}

static bool ofi_can_sleep(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    for (uint32_t i = 0; i < N_RAILS; i++)
        if (o->rails[i].pending_head != NULL)
            return false;
    if (o->wait_fd < 0)
        return false;
    struct fid *f = &o->cq->fid;
    return fi_trywait(o->fabric, &f, 1) == FI_SUCCESS;
}

static void ofi_quiesce(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    for (uint32_t i = 0; i < N_RAILS; i++) {
        struct rail *rl = &o->rails[i];
        if (rl->ep)
            fi_close(&rl->ep->fid);
        rl->ep = NULL;
        rl->pending_head = rl->pending_tail = NULL;
    }
}

static void ofi_close(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    ofi_quiesce(tp);
    if (o->av)
        fi_close(&o->av->fid);
    if (o->cq)
        fi_close(&o->cq->fid);
    if (o->domain)
        fi_close(&o->domain->fid);
    if (o->fabric)
        fi_close(&o->fabric->fid);
    if (o->info)
        fi_freeinfo(o->info);
    free(o->peers);
    free(o);
}

static const struct sd_transport_ops ofi_ops = {
    .name = "ofi",
    .getname = ofi_getname,
    .set_peers = ofi_set_peers,
    .mr_reg = ofi_mr_reg,
    .mr_dereg = ofi_mr_dereg,
    .send = ofi_send,
    .recv = ofi_recv,
    .cancel = ofi_cancel,
    .progress = ofi_progress,
    .wait_fd = ofi_wait_fd,
    .can_sleep = ofi_can_sleep,
    .quiesce = ofi_quiesce,
    .close = ofi_close,
};

int sd_transport_ofi_open(const struct sd_config *cfg, struct sd_transport **tp_p, char *err,
                          size_t errlen)
{
    struct ofi *o = calloc(1, sizeof(*o));
    struct fi_info *hints = fi_allocinfo();
    int r;
    if (o == NULL || hints == NULL) {
        free(o);
        fi_freeinfo(hints);
        snprintf(err, errlen, "out of memory");
        return SD_ENOMEM;
    }
    o->base.ops = &ofi_ops;
    o->base.self = (uint32_t)cfg->node;
    o->wait_fd = -1;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(cfg->provider);
    const char *node = cfg->fabric_addr[0] ? cfg->fabric_addr : NULL;
    r = fi_getinfo(FI_VERSION(1, 17), node, NULL, node ? FI_SOURCE : 0, hints, &o->info);
    fi_freeinfo(hints);
    if (r != 0) {
        snprintf(err, errlen,
                 "no libfabric provider '%s' with FI_EP_RDM and tagged messages on %s: %s",
                 cfg->provider, node ? node : "any interface", fi_strerror(-r));
        free(o);
        return SD_ENOSYS;
    }
    const char *step = "fi_fabric";
    if ((r = fi_fabric(o->info->fabric_attr, &o->fabric, NULL)) != 0)
        goto err_close;
    step = "fi_domain";
    if ((r = fi_domain(o->fabric, o->info, &o->domain, NULL)) != 0)
        goto err_close;
    /* read the limits back rather than trusting the hints */
    o->tx_depth = o->info->tx_attr->size ? o->info->tx_attr->size : 256;
    o->rx_depth = o->info->rx_attr->size ? o->info->rx_attr->size : 256;
    o->need_mr = (o->info->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
    struct fi_cq_attr cqa = {
        .format = FI_CQ_FORMAT_TAGGED,
        .wait_obj = FI_WAIT_FD,
        .size =
            SD_MIN(o->tx_depth + o->rx_depth,
                   o->info->domain_attr->cq_cnt ? SD_MAX(o->info->domain_attr->cq_cnt, 64) : 4096)};
    step = "fi_cq_open";
    if ((r = fi_cq_open(o->domain, &cqa, &o->cq, NULL)) != 0) {
        cqa.wait_obj = FI_WAIT_NONE; /* providers without wait objects: poll from the loop */
        if ((r = fi_cq_open(o->domain, &cqa, &o->cq, NULL)) != 0)
            goto err_close;
    } else if (fi_control(&o->cq->fid, FI_GETWAIT, &o->wait_fd) != 0) {
        o->wait_fd = -1;
    }
    struct fi_av_attr ava = {.type = FI_AV_TABLE};
    step = "fi_av_open";
    if ((r = fi_av_open(o->domain, &ava, &o->av, NULL)) != 0)
        goto err_close;
    for (uint32_t i = 0; i < N_RAILS; i++) {
        struct fid_ep **ep = &o->rails[i].ep;
        step = "fi_endpoint";
        if ((r = fi_endpoint(o->domain, o->info, ep, NULL)) != 0)
            goto err_close;
        step = "fi_ep_bind";
        if ((r = fi_ep_bind(*ep, &o->av->fid, 0)) != 0 ||
            (r = fi_ep_bind(*ep, &o->cq->fid, FI_TRANSMIT | FI_RECV)) != 0)
            goto err_close;
        step = "fi_enable";
        if ((r = fi_enable(*ep)) != 0)
            goto err_close;
    }
    SD_INFO(
        "ofi",
        "provider %s, fabric %s, domain %s: outbound, inbound and control endpoints, tx depth %zu, "
        "rx depth %zu each, mr %s, max message %zu",
        o->info->fabric_attr->prov_name, o->info->fabric_attr->name, o->info->domain_attr->name,
        o->tx_depth, o->rx_depth, o->need_mr ? "registered" : "not needed",
        o->info->ep_attr->max_msg_size);
    *tp_p = &o->base;
    return SD_OK;

err_close:
    snprintf(err, errlen, "libfabric %s (provider %s): %s", step, cfg->provider, fi_strerror(-r));
    ofi_close(&o->base);
    return SD_EIO;
}

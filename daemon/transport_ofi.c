/* The libfabric transport: one FI_EP_RDM endpoint, FI_AV_TABLE, tagged messages, one completion
 * queue with a wait fd the libuv loop polls. Provider limits are read back from fi_getinfo;
 * posts beyond the tx/rx queue depth, and any -FI_EAGAIN, go to a pending queue retried on
 * progress. Memory is registered only when the provider asks for it (FI_MR_LOCAL). */
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

struct ofi {
    struct sd_transport base;
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    fi_addr_t *peers;
    int wait_fd;
    bool need_mr;
    size_t tx_depth, rx_depth, tx_posted, rx_posted;
    struct sd_xfer *pending_head, *pending_tail;
};

static int to_status(ssize_t r)
{
    return r == -FI_EAGAIN ? SD_EAGAIN : r == -FI_ETIMEDOUT ? SD_ETIMEDOUT : SD_EIO;
}

static int ofi_getname(struct sd_transport *tp, void *addr, size_t *len_p)
{
    struct ofi *o = (struct ofi *)tp;
    int r = fi_getname(&o->ep->fid, addr, len_p);
    return r == 0 ? SD_OK : SD_EMSGSIZE;
}

static int ofi_set_peers(struct sd_transport *tp, const void *const *addrs, const size_t *lens,
                         uint32_t n)
{
    struct ofi *o = (struct ofi *)tp;
    free(o->peers);
    o->peers = calloc(n, sizeof(*o->peers));
    if (o->peers == NULL)
        return SD_ENOMEM;
    for (uint32_t i = 0; i < n; i++) {
        (void)lens;
        int r = fi_av_insert(o->av, addrs[i], 1, &o->peers[i], 0, NULL);
        if (r != 1) {
            SD_ERROR("ofi", "fi_av_insert of node %u failed: %d", i, r);
            return SD_EINVAL;
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

static void pending_push(struct ofi *o, struct sd_xfer *x)
{
    x->next_pending = NULL;
    if (o->pending_tail)
        o->pending_tail->next_pending = x;
    else
        o->pending_head = x;
    o->pending_tail = x;
}

/* Try to post; returns 0 when posted, SD_EAGAIN when it must wait, or an error. */
static int post(struct ofi *o, struct sd_xfer *x)
{
    ssize_t r;
    if (x->kind == XFER_SEND) {
        if (o->tx_posted >= o->tx_depth)
            return SD_EAGAIN;
        r = fi_tsend(o->ep, x->buf, x->buflen, x->desc, o->peers[x->peer], x->tag, x->opaque);
        if (r == 0)
            o->tx_posted++;
    } else {
        if (o->rx_posted >= o->rx_depth)
            return SD_EAGAIN;
        fi_addr_t src = x->peer == SD_PEER_ANY ? FI_ADDR_UNSPEC : o->peers[x->peer];
        r = fi_trecv(o->ep, (void *)x->buf, x->buflen, x->desc, src, x->tag, x->ignore, x->opaque);
        if (r == 0)
            o->rx_posted++;
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
    if (o->ep == NULL)
        return SD_ENOTCONN;
    o->base.inflight++;
    if (o->pending_head == NULL) {
        int st = post(o, x);
        if (st != SD_EAGAIN) {
            if (st != SD_OK)
                o->base.inflight--;
            return st;
        }
    }
    pending_push(o, x);
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
    if (x->kind != XFER_RECV || o->ep == NULL)
        return;
    /* still in the pending queue: take it out and complete it here */
    for (struct sd_xfer **pp = &o->pending_head, *prev = NULL; *pp;
         prev = *pp, pp = &(*pp)->next_pending)
        if (*pp == x) {
            *pp = x->next_pending;
            if (o->pending_tail == x)
                o->pending_tail = prev;
            o->base.inflight--;
            x->kind = 0;
            x->cb(x, SD_ECANCELED);
            return;
        }
    fi_cancel(&o->ep->fid, x->opaque);
}

static void complete(struct ofi *o, struct sd_xfer *x, int status, size_t len, uint64_t tag)
{
    if (x->kind == XFER_SEND)
        o->tx_posted--;
    else
        o->rx_posted--;
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
    while (o->pending_head != NULL) {
        struct sd_xfer *x = o->pending_head;
        int st = post(o, x);
        if (st == SD_EAGAIN)
            break;
        o->pending_head = x->next_pending;
        if (o->pending_head == NULL)
            o->pending_tail = NULL;
        if (st != SD_OK) {
            o->base.inflight--;
            x->cb(x, st);
            done++;
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
    if (o->pending_head != NULL || o->wait_fd < 0)
        return false;
    struct fid *f = &o->cq->fid;
    return fi_trywait(o->fabric, &f, 1) == FI_SUCCESS;
}

static void ofi_quiesce(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    if (o->ep)
        fi_close(&o->ep->fid);
    o->ep = NULL;
    o->pending_head = o->pending_tail = NULL;
}

static void ofi_close(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    if (o->ep)
        fi_close(&o->ep->fid);
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
    step = "fi_endpoint";
    if ((r = fi_endpoint(o->domain, o->info, &o->ep, NULL)) != 0)
        goto err_close;
    step = "fi_ep_bind";
    if ((r = fi_ep_bind(o->ep, &o->av->fid, 0)) != 0 ||
        (r = fi_ep_bind(o->ep, &o->cq->fid, FI_TRANSMIT | FI_RECV)) != 0)
        goto err_close;
    step = "fi_enable";
    if ((r = fi_enable(o->ep)) != 0)
        goto err_close;
    SD_INFO("ofi",
            "provider %s, fabric %s, domain %s: tx depth %zu, rx depth %zu, mr %s, "
            "max message %zu",
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

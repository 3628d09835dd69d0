/* The node's network service (net_service.h): the transport and cluster a node's jobs share,
 * and the standing receives for pull requests (SD_TAG_REQ). A request is checked for its magic
 * and handed to the job its tag names (fetch.c checks it against the job and serves it); one
 * for a job not confirmed here yet (the coordinator's confirmation can arrive after a faster
 * node already asks) is kept for op_timeout_ms and handed over on confirmation. */
#include "net_service.h"
#include "coll/tag.h"
#include "fetch.h"
#include "pull.h"
#include "registry.h"
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
struct sd_net {
    bool posted;
    struct sd_req_msg early[SD_NET_EARLY_REQS];
    uint64_t early_ns[SD_NET_EARLY_REQS];
    uint32_t n_early;
    struct sd_transport *tp;
    struct sd_cluster *cl;
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

static void on_request(struct sd_registry *reg, const struct sd_req_msg *m)
{
    if (m->magic != SD_REQ_MAGIC) {
        SD_WARN_SPARSE("net", "dropping a malformed pull request");
        return;
    }
    struct sd_job *job = sd_registry_find_tag(reg, m->job_tag);
    if (job == NULL) { /* maybe confirmed here a moment from now */
        struct sd_net *net = reg->net;
        uint64_t now = sd_now_ns(), keep = (uint64_t)reg->cfg->op_timeout_ms * 1000000ULL;
        uint32_t kept = 0;
        for (uint32_t i = 0; i < net->n_early; i++)
            if (now - net->early_ns[i] < keep) {
                net->early[kept] = net->early[i];
                net->early_ns[kept++] = net->early_ns[i];
            }
        net->n_early = kept;
        if (kept < SD_NET_EARLY_REQS) {
            net->early[kept] = *m;
            net->early_ns[kept] = now;
            net->n_early++;
            return;
        }
        SD_WARN_SPARSE("net", "too many pull requests for unknown jobs; dropping one for tag %u",
                       m->job_tag);
        return;
    }
    sd_fetch_on_request(job, m);
}

void sd_net_job_confirmed(struct sd_registry *reg, uint32_t job_tag)
{
    struct sd_net *net = reg->net;
    if (net == NULL)
        return;
    uint32_t kept = 0, n = net->n_early;
    struct sd_req_msg mine[SD_NET_EARLY_REQS];
    uint32_t n_mine = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (net->early[i].job_tag == job_tag) {
            mine[n_mine++] = net->early[i];
            continue;
        }
        net->early[kept] = net->early[i];
        net->early_ns[kept++] = net->early_ns[i];
    }
    net->n_early = kept;
    for (uint32_t i = 0; i < n_mine; i++)
        on_request(reg, &mine[i]);
}

bool sd_net_busy(const struct sd_registry *reg)
{
    return reg->net != NULL && reg->net->tp->inflight > (reg->net->posted ? SD_NET_REQ_SLOTS : 0);
}

static void req_recv_cb(struct sd_xfer *x, int status);

static int post_req_recv(struct sd_net_req *r, struct sd_net *net)
{
    struct sd_transport *tp = net->tp;
    r->x.cb = req_recv_cb;
    return tp->ops->recv(tp, SD_PEER_ANY, sd_tag_of_kind(SD_TAG_REQ), sd_tag_any_but_kind(),
                         &r->msg, sizeof(r->msg), net->reqs_desc, &r->x);
}

static void req_recv_cb(struct sd_xfer *x, int status)
{
    struct sd_net_req *r = (struct sd_net_req *)x;
    struct sd_registry *reg = r->reg;
    if (status == SD_ECANCELED || reg->net == NULL)
        return; /* cancelled at shutdown */
    if (status == SD_OK && x->len == sizeof(r->msg))
        on_request(reg, &r->msg);
    else /* a receive the provider failed (a connection torn down under it): it stands again,
          * or each such error would leave one standing receive fewer for good */
        SD_WARN_SPARSE("net",
                       "a pull request's receive completed with %s (%zu bytes); posted again",
                       sd_status_str(status), x->len);
    if (post_req_recv(r, reg->net) != SD_OK)
        SD_ERROR("net", "cannot post a pull request's receive again: this node serves fewer "
                        "gathers at once");
}

int sd_net_start(struct sd_registry *reg, struct sd_transport *tp, struct sd_cluster *cl)
{
    struct sd_net *net = calloc(1, sizeof(*net));
    if (net == NULL)
        return SD_ENOMEM;
    net->tp = tp;
    net->cl = cl;
    reg->net = net;
    return SD_OK;
}

void sd_net_set_cluster(struct sd_registry *reg, struct sd_cluster *cl)
{
    reg->net->cl = cl;
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
}

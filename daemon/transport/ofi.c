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
 * (FI_MR_LOCAL).
 *
 * Rendezvous (rendezvous_bytes > 0): a message larger than that is sent only once its receiver
 * has said, with a clear-to-send naming the tag, that the matching receive is posted, so no large
 * message ever arrives unexpected. A provider then never buffers megabytes it cannot place, and
 * libfabric < 1.19's shm provider, which hangs when several large messages arrive unexpected in
 * its two-copy protocol (ofiwg/libfabric#9143), can run that protocol. The receiver injects the
 * clear-to-send (16 bytes) when the receive reaches the provider; the sender parks a send whose
 * clear-to-send has not arrived and posts it when it does, and counts the ones that arrive
 * first. Such a message must be received by a receive that names its peer and its exact tag,
 * with a buffer of the message's length (the collective engine's chunks). Clear-to-sends have an
 * endpoint of their own: sharing the control endpoint with them, libfabric 1.17's shm lost pull
 * requests and norm exchanges now and then (runs hung in 3 of 4 attempts; none in 24 since). */
#include "transport/ofi.h"

#include <arpa/inet.h>
#include <netinet/in.h>

/* The published address: for each rail, one byte with the length of its endpoint's name, then
 * the name. */
static int ofi_getname(struct sd_transport *tp, void *addr, size_t *len_p)
{
    struct ofi *o = (struct ofi *)tp;
    uint8_t *out = addr;
    size_t used = 0;
    for (uint32_t r = 0; r < o->n_rails; r++) {
        if (*len_p < used + 2)
            return SD_EMSGSIZE;
        size_t len = SD_MIN(*len_p - used - 1, 255);
        if (o->rails[r].ep == NULL)
            len = 0; /* an endpoint not opened: an empty name */
        else if (fi_getname(&o->rails[r].ep->fid, out + used + 1, &len) != 0)
            return SD_EMSGSIZE;
        out[used] = (uint8_t)len;
        used += 1 + len;
    }
    *len_p = used;
    return SD_OK;
}

/* Is a (len bytes, a peer's) an address this node's endpoints could have published: one name
 * per rail, each as long as this node's own for that rail (the same provider names its
 * endpoints alike), a sockaddr of this node's family with a port where the provider names
 * endpoints by sockaddrs? A malformed one never reaches fi_av_insert, where some providers
 * take it and then fail every later insert (a family 0 in tcp's). */
static int ofi_check_addr(struct sd_transport *tp, const void *addr, size_t len, char *why,
                          size_t whylen)
{
    struct ofi *o = (struct ofi *)tp;
    const uint8_t *a = addr;
    uint8_t mine[256];
    size_t mlen = sizeof(mine), used = 0, ref = 0;
    if (ofi_getname(tp, mine, &mlen) != SD_OK) {
        snprintf(why, whylen, "this node cannot name its own endpoints");
        return SD_EINVAL;
    }
    /* (every endpoint of one provider is named alike: the first this node opened is the
     * reference) */
    for (size_t m = 0; m < mlen && ref == 0; m += 1 + mine[m])
        if (mine[m] != 0)
            ref = m;
    size_t want = mine[ref];
    sa_family_t myfam = 0;
    if (want >= sizeof(myfam))
        memcpy(&myfam, mine + ref + 1, sizeof(myfam));
    uint32_t fmt = o->info != NULL ? o->info->addr_format : FI_FORMAT_UNSPEC;
    bool sockaddr = fmt == FI_SOCKADDR || fmt == FI_SOCKADDR_IN || fmt == FI_SOCKADDR_IN6;
    for (uint32_t r = 0; r < o->n_rails; r++) {
        char rn[32];
        rail_name(r, rn, sizeof(rn));
        if (used >= len || used + 1 + a[used] > len) {
            snprintf(why, whylen, "a fabric address of %zu bytes ends before its %s endpoint", len,
                     rn);
            return SD_EINVAL;
        }
        size_t n = a[used];
        if (n == 0 ? o->rails[peer_rail(r)].ep != NULL : n != want) {
            snprintf(why, whylen, "its %s endpoint's name is %zu bytes; this provider's are %zu",
                     rn, n, want);
            return SD_EINVAL;
        }
        if (sockaddr && n >= sizeof(sa_family_t)) {
            sa_family_t fam;
            memcpy(&fam, a + used + 1, sizeof(fam));
            struct sockaddr_in sin;
            struct sockaddr_in6 sin6;
            uint16_t port = 0;
            if (fam == AF_INET && n >= sizeof(sin)) {
                memcpy(&sin, a + used + 1, sizeof(sin));
                port = sin.sin_port;
            } else if (fam == AF_INET6 && n >= sizeof(sin6)) {
                memcpy(&sin6, a + used + 1, sizeof(sin6));
                port = sin6.sin6_port;
            }
            if (fam != myfam || port == 0) {
                snprintf(why, whylen,
                         "its %s endpoint's address is of family %u, port %u; this node's are of "
                         "family %u",
                         rn, (unsigned)fam, (unsigned)ntohs(port), (unsigned)myfam);
                return SD_EINVAL;
            }
        }
        used += 1 + n;
    }
    if (used != len) {
        snprintf(why, whylen, "a fabric address of %zu bytes has %zu bytes after its endpoints",
                 len, len - used);
        return SD_EINVAL;
    }
    return SD_OK;
}

/* node i's endpoints (its published address a, lens bytes) into the address table; on a
 * failure none of them (what one rail inserted is taken out again) */
static int insert_peer(struct ofi *o, uint32_t i, uint32_t n, const uint8_t *a, size_t len)
{
    size_t used = 0;
    char why[160];
    if (len == 0) /* a number no daemon holds yet (an open cluster's, not rejoined) */
        return SD_ENOENT;
    if (ofi_check_addr(&o->base, a, len, why, sizeof(why)) != SD_OK) {
        SD_ERROR_SPARSE("ofi", "node %u published a malformed fabric address: %s", i, why);
        return SD_EINVAL;
    }
    for (uint32_t r = 0; r < o->n_rails; r++)
        o->peers[(size_t)r * n + i] = FI_ADDR_NOTAVAIL;
    for (uint32_t r = 0; r < o->n_rails; r++) {
        char rn[32];
        fi_addr_t *fa = &o->peers[(size_t)r * n + i];
        if (a[used] == 0 && o->rails[peer_rail(r)].ep != NULL) {
            SD_ERROR_SPARSE("ofi", "node %u has no %s endpoint, which this node uses", i,
                            rail_name(r, rn, sizeof(rn)));
            goto err_remove;
        }
        int ret = a[used] == 0 ? 1 : fi_av_insert(o->av, a + used + 1, 1, fa, 0, NULL);
        if (ret != 1) {
            *fa = FI_ADDR_NOTAVAIL;
            SD_ERROR_SPARSE("ofi", "fi_av_insert of node %u's %s endpoint failed: %d", i,
                            rail_name(r, rn, sizeof(rn)), ret);
            goto err_remove;
        }
        used += 1 + a[used];
    }
    return SD_OK;

err_remove:
    for (uint32_t r = 0; r < o->n_rails; r++) {
        fi_addr_t *fa = &o->peers[(size_t)r * n + i];
        if (*fa != FI_ADDR_NOTAVAIL)
            (void)fi_av_remove(o->av, fa, 1, 0);
        *fa = FI_ADDR_NOTAVAIL;
    }
    return SD_EINVAL;
}

static int ofi_set_peers(struct sd_transport *tp, const void *const *addrs, const size_t *lens,
                         uint32_t n)
{
    struct ofi *o = (struct ofi *)tp;
    /* the new tables whole before the old go: a failure leaves the old ones in use */
    fi_addr_t *peers = calloc((size_t)o->n_rails * n, sizeof(*peers));
    bool *down = calloc(n, sizeof(*down));
    uint8_t(*saved)[256] = calloc(n, sizeof(*saved));
    size_t *saved_lens = calloc(n, sizeof(*saved_lens));
    struct rdv_peer *rdv = o->base.rdv_bytes > 0 ? calloc(n, sizeof(*rdv)) : NULL;
    if (peers == NULL || down == NULL || saved == NULL || saved_lens == NULL ||
        (o->base.rdv_bytes > 0 && rdv == NULL)) {
        free(peers);
        free(down);
        free(saved);
        free(saved_lens);
        free(rdv);
        return SD_ENOMEM;
    }
    free(o->peers);
    free(o->down);
    free(o->addrs);
    free(o->addr_lens);
    o->peers = peers;
    o->down = down;
    o->addrs = saved;
    o->addr_lens = saved_lens;
    tp->n_peers = n;
    if (o->base.rdv_bytes > 0) {
        free(o->rdv_peers);
        o->rdv_peers = rdv;
        o->rdv_credit = SD_MAX(1u, o->rdv_slots_n / SD_MAX(1u, n - 1));
    }
    for (uint32_t i = 0; i < n; i++) {
        o->addr_lens[i] = SD_MIN(lens[i], sizeof(o->addrs[0]));
        memcpy(o->addrs[i], addrs[i], o->addr_lens[i]);
        if (insert_peer(o, i, n, addrs[i], lens[i]) == SD_OK)
            continue;
        /* a node whose address cannot be used is down for the data path (the others' jobs go
         * on; its probes never answer, so no job is placed on it) */
        for (uint32_t r = 0; r < o->n_rails; r++)
            o->peers[(size_t)r * n + i] = FI_ADDR_NOTAVAIL;
        o->down[i] = true;
    }
    return SD_OK;
}

/* the largest chunk libfabric < 1.19's shm copies in place with FI_HMEM (sd_transport_ofi_open) */
#define SHM_HMEM_CHUNK_MAX 4096

/* libfabric's interface for a backend's device memory (sd_gpu_ops.hmem) */
static enum fi_hmem_iface hmem_iface(int hmem)
{
    return hmem == SD_HMEM_CUDA   ? FI_HMEM_CUDA
           : hmem == SD_HMEM_ROCR ? FI_HMEM_ROCR
                                  : FI_HMEM_SYSTEM;
}

/* device memory registered with the backend's interface */
static int hmem_reg(struct ofi *o, void *buf, size_t len, uint64_t key, struct fid_mr **mr_p)
{
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_mr_attr attr = {.mr_iov = &iov,
                              .iov_count = 1,
                              .access = FI_SEND | FI_RECV,
                              .requested_key = key,
                              .iface = hmem_iface(o->dev->hmem)};
    if (attr.iface == FI_HMEM_CUDA && o->dev->hmem_device != NULL)
        attr.device.cuda = o->dev->hmem_device(buf);
    return fi_mr_regattr(o->domain, &attr, 0, mr_p);
}

/* Does the domain register the backend's device memory (FI_HMEM may cover some interfaces
 * only: a shm built without CUDA has it for host memory alone)? A page of it, tried. */
static bool hmem_works(struct ofi *o)
{
    struct sd_mem m;
    if (o->dev->alloc(sd_gpu_first_driven(o->dev), 4096, SD_MEM_PRIVATE, "FI_HMEM probe", &m) !=
        SD_OK)
        return false;
    struct fid_mr *mr;
    int r = hmem_reg(o, m.ptr, 4096, ++o->mr_keys, &mr);
    if (r == 0)
        fi_close(&mr->fid);
    else
        SD_INFO("ofi", "%s has FI_HMEM but cannot register the %s backend's memory (%s)",
                o->info->fabric_attr->prov_name, o->dev->name, fi_strerror(-r));
    o->dev->free(&m);
    return r == 0;
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
    uint64_t key = ++o->mr_keys; /* (one the provider ignores where it picks its own) */
    bool device = tp->hmem && o->dev->is_device(buf); /* the provider reaches it itself */
    int r = device ? hmem_reg(o, buf, len, key, &mr)
                   : fi_mr_reg(o->domain, buf, len, FI_SEND | FI_RECV, 0, key, 0, &mr, NULL);
    if (r != 0) {
        SD_ERROR("ofi", "fi_mr_reg of %zu bytes%s: %s", len,
                 device ? " of device memory (FI_HMEM)" : "", fi_strerror(-r));
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

/* A transfer the provider does not hold (queued, parked, or refused) completes here: no longer
 * counted, and cancel ignores it from now on. */
static void finish_unposted(struct ofi *o, struct sd_xfer *x, int status)
{
    if (x->kind != XFER_CTS)
        o->base.inflight--;
    x->kind = 0;
    x->cb(x, status);
}

/* Try to post; returns 0 when posted, SD_EAGAIN when it must wait, or an error. */
int sd_ofi__post(struct ofi *o, struct sd_xfer *x)
{
    struct rail *rl = rail_of(o, x);
    size_t base = (size_t)peer_rail(x->rail) * o->base.n_peers;
    ssize_t r;
    /* a peer declared down left the address table: a transfer queued for it before (or asked
     * for after) must not reach the provider with its stale address (tcp;ofi_rxm crashed on
     * one) */
    if (x->peer != SD_PEER_ANY && x->peer < o->base.n_peers && o->down[x->peer])
        return SD_EPEER;
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
        if (r == 0 && x->kind == XFER_RECV && x->peer != SD_PEER_ANY && x->ignore == 0 &&
            sd_ofi__rdv_sized(o, x->tag, x->buflen))
            sd_ofi__cts_send(o, x);
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

/* Post x, counted in inflight already, or queue it behind its rail's pending posts; on an
 * error it is no longer counted. */
int sd_ofi__issue(struct ofi *o, struct sd_xfer *x)
{
    struct rail *rl = rail_of(o, x);
    if (rl->pending.head == NULL) {
        int st = sd_ofi__post(o, x);
        if (st != SD_EAGAIN) {
            if (st != SD_OK)
                o->base.inflight--;
            return st;
        }
    }
    o->base.posts_queued++;
    xq_push(&rl->pending, x);
    return SD_OK;
}

static void rail_assign(const struct ofi *o, struct sd_xfer *x)
{
    /* a wildcard over the kind bits could match either rail: such receives stay on data, and a
     * wildcard over the chunk bits on lane 0 */
    if ((x->ignore & sd_tag_mask(SD_TAGF_KIND)) == 0 && sd_tag_is_ctrl(x->tag)) {
        x->rail = RAIL_CTRL;
        return;
    }
    uint32_t lane = (x->ignore & sd_tag_mask(SD_TAGF_CHUNK)) != 0
                        ? 0
                        : sd_tag_chunk(x->tag) % o->base.data_lanes;
    x->rail = RAIL_DATA + 2 * lane + (x->kind == XFER_SEND ? 0 : 1);
}

static int submit(struct ofi *o, struct sd_xfer *x)
{
    rail_assign(o, x);
    if (rail_of(o, x)->ep == NULL)
        return SD_ENOTCONN;
    o->base.inflight++;
    if (x->kind == XFER_SEND && x->rail >= RAIL_DATA)
        o->base.lane_sends[(x->rail - RAIL_DATA) / 2]++;
    if (x->kind == XFER_SEND && sd_ofi__rdv_sized(o, x->tag, x->buflen))
        return sd_ofi__rdv_send(o, x);
    return sd_ofi__issue(o, x);
}

static int ofi_send(struct sd_transport *tp, uint32_t peer, uint64_t tag, const void *buf,
                    size_t len, void *desc, struct sd_xfer *x)
{
    struct ofi *o = (struct ofi *)tp;
    if (peer >= tp->n_peers)
        return SD_EINVAL;
    if (o->down[peer])
        return SD_EPEER;
    x->kind = XFER_SEND;
    x->peer = peer;
    x->tag = tag;
    x->ignore = 0;
    x->buf = buf;
    x->buflen = len;
    x->desc = desc;
    x->len = len;
    x->rdv = RDV_NONE;
    return submit(o, x);
}

static int ofi_recv(struct sd_transport *tp, uint32_t peer, uint64_t tag, uint64_t ignore,
                    void *buf, size_t len, void *desc, struct sd_xfer *x)
{
    struct ofi *o = (struct ofi *)tp;
    if (peer != SD_PEER_ANY && peer >= tp->n_peers)
        return SD_EINVAL;
    if (peer != SD_PEER_ANY && o->down[peer])
        return SD_EPEER;
    x->kind = XFER_RECV;
    x->peer = peer;
    x->tag = tag;
    x->ignore = ignore;
    x->rdv = RDV_NONE;
    x->buf = buf;
    x->buflen = len;
    x->desc = desc;
    x->len = 0;
    return submit(o, x);
}

static void ofi_cancel(struct sd_transport *tp, struct sd_xfer *x)
{
    struct ofi *o = (struct ofi *)tp;
    if (x->kind == XFER_PARKED) { /* a send still waiting for its clear-to-send */
        if (sd_ofi__rdv_unpark(o, x))
            finish_unposted(o, x, SD_ECANCELED);
        return;
    }
    if (x->kind != XFER_RECV || rail_of(o, x)->ep == NULL)
        return;
    struct rail *rl = rail_of(o, x);
    /* still in the pending queue: take it out and complete it here */
    if (xq_remove(&rl->pending, x)) {
        finish_unposted(o, x, SD_ECANCELED);
        return;
    }
    fi_cancel(&rl->ep->fid, x->opaque);
}

static void ofi_peer_down(struct sd_transport *tp, uint32_t node)
{
    struct ofi *o = (struct ofi *)tp;
    if (node >= tp->n_peers || o->down[node] || node == tp->self)
        return;
    o->down[node] = true;
    for (uint32_t r = 0; r < o->n_rails; r++) {
        fi_addr_t *fa = &o->peers[(size_t)r * tp->n_peers + node];
        if (*fa == FI_ADDR_NOTAVAIL)
            continue;
        int ret = fi_av_remove(o->av, fa, 1, 0);
        char rn[32];
        if (ret != 0)
            SD_WARN("ofi", "removing node %u's %s endpoint from the address table: %s", node,
                    rail_name(r, rn, sizeof(rn)), fi_strerror(-ret));
        *fa = FI_ADDR_NOTAVAIL;
    }
    /* what waits in the pending queues for that node fails now (sd_ofi__post refuses it) */
    for (uint32_t i = 0; i < o->n_rails; i++) {
        struct rail *rl = &o->rails[i];
        struct xqueue keep = {0}, dead = {0};
        struct sd_xfer *x;
        while ((x = xq_pop(&rl->pending)) != NULL)
            xq_push(x->peer == node ? &dead : &keep, x);
        rl->pending = keep; /* before the callbacks, which may queue new transfers */
        while ((x = xq_pop(&dead)) != NULL)
            finish_unposted(o, x, SD_EPEER);
    }
}

/* Whether the provider keeps a connection per pair of endpoints (tcp, and ofi_rxm over tcp or
 * verbs), one that can outlive the other side's and so be worth closing. shm, efa and cxi are
 * connectionless: removing a peer's address there only loses what is in flight to it. */
static bool has_connections(const struct fi_info *info)
{
    const char *prov = info->fabric_attr->prov_name;
    return prov != NULL && (strstr(prov, "ofi_rxm") != NULL || strncmp(prov, "tcp", 3) == 0 ||
                            strncmp(prov, "sockets", 7) == 0);
}

/* Node's data path is dead while the node is up: fail what is queued for it, close its
 * connections (removing an address closes the provider's connection to it) and put its
 * addresses back; the next transfer connects anew. SD_ENOSYS where the provider has no
 * connections to close. */
static int ofi_peer_reset(struct sd_transport *tp, uint32_t node)
{
    struct ofi *o = (struct ofi *)tp;
    if (node >= tp->n_peers || node == tp->self || o->addrs == NULL)
        return SD_EINVAL;
    if (!tp->connections)
        return SD_ENOSYS;
    if (!o->down[node])
        ofi_peer_down(tp, node);
    int st = insert_peer(o, node, tp->n_peers, o->addrs[node], o->addr_lens[node]);
    if (st == SD_OK)
        o->down[node] = false;
    return st;
}

static int ofi_set_peer(struct sd_transport *tp, uint32_t node, const void *addr, size_t len)
{
    struct ofi *o = (struct ofi *)tp;
    if (node >= tp->n_peers || node == tp->self || o->addrs == NULL || len > sizeof(o->addrs[0]))
        return SD_EINVAL;
    if (!o->down[node])
        ofi_peer_down(tp, node);
    memcpy(o->addrs[node], addr, len);
    o->addr_lens[node] = len;
    int st = insert_peer(o, node, tp->n_peers, o->addrs[node], len);
    if (st == SD_OK)
        o->down[node] = false;
    if (o->base.rdv_bytes > 0) { /* the credit is shared by the peers in the table */
        uint32_t up = 0;
        for (uint32_t i = 0; i < tp->n_peers; i++)
            up += i != tp->self && !o->down[i];
        o->rdv_credit = SD_MAX(1u, o->rdv_slots_n / SD_MAX(1u, up));
    }
    return st;
}

static void complete(struct ofi *o, struct sd_xfer *x, int status, size_t len, uint64_t tag)
{
    if (x->kind == XFER_SEND)
        rail_of(o, x)->tx_posted--;
    else
        rail_of(o, x)->rx_posted--;
    if (x->kind != XFER_CTS)
        o->base.inflight--;
    if (x->kind == XFER_RECV && x->rdv != RDV_NONE)
        sd_ofi__cts_done(o, x);
    if (x->kind != XFER_SEND) {
        x->len = len;
        x->tag = tag;
    }
    x->kind = 0; /* no longer posted: cancel ignores it */
    x->cb(x, status);
}

/* Post receive x again as it was (its message was dropped), or queue it behind its rail's
 * pending posts; an error completes it. */
static void repost(struct ofi *o, struct sd_xfer *x)
{
    struct rail *rl = rail_of(o, x);
    fi_addr_t src = x->peer == SD_PEER_ANY
                        ? FI_ADDR_UNSPEC
                        : o->peers[(size_t)peer_rail(x->rail) * o->base.n_peers + x->peer];
    ssize_t r = rl->rx_posted >= o->rx_depth ? -FI_EAGAIN
                                             : fi_trecv(rl->ep, (void *)x->buf, x->buflen, x->desc,
                                                        src, x->tag, x->ignore, x->opaque);
    if (r == 0)
        rl->rx_posted++;
    else if (r == -FI_EAGAIN)
        xq_push(&rl->pending, x);
    else
        finish_unposted(o, x, to_status(r));
}

/* Did receive x's message come from a node of the table (x->from: which)? Else it came from
 * an address outside the cluster: dropped, counted and logged, and x stands again. */
static bool from_member(struct ofi *o, struct sd_xfer *x, fi_addr_t src, size_t len, uint64_t tag)
{
    uint32_t n = o->base.n_peers;
    if (src != FI_ADDR_NOTAVAIL && o->peers != NULL) {
        const fi_addr_t *table = o->peers + (size_t)peer_rail(x->rail) * n;
        if (x->peer != SD_PEER_ANY && x->peer < n && table[x->peer] == src) {
            x->from = x->peer;
            return true;
        }
        for (uint32_t i = 0; x->peer == SD_PEER_ANY && i < n; i++)
            if (table[i] == src) {
                x->from = i;
                return true;
            }
    }
    o->base.foreign_dropped++;
    SD_WARN_SPARSE("ofi",
                   "dropped a message (tag kind %u, %zu bytes) from a fabric address outside the "
                   "cluster (%llu so far)",
                   (unsigned)sd_tag_kind(tag), len, (unsigned long long)o->base.foreign_dropped);
    rail_of(o, x)->rx_posted--;
    repost(o, x);
    return false;
}

static int ofi_progress(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    struct fi_cq_tagged_entry e[16];
    fi_addr_t src[16];
    int done = 0;
    for (;;) {
        ssize_t n = fi_cq_readfrom(o->cq, e, 16, src);
        if (n > 0) {
            for (ssize_t i = 0; i < n; i++) {
                struct sd_xfer *x = e[i].op_context;
                if ((x->kind == XFER_RECV || x->kind == XFER_CTS) &&
                    !from_member(o, x, src[i], e[i].len, e[i].tag))
                    continue;
                complete(o, x, SD_OK, e[i].len, e[i].tag);
            }
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
    sd_ofi__cts_retry(o);
    sd_ofi__rdv_sweep(o);
    for (uint32_t i = 0; i < o->n_rails; i++) {
        struct rail *rl = &o->rails[i];
        while (rl->pending.head != NULL) {
            /* out of the queue before posting: a posted receive may join a rendezvous queue
             * through the same link */
            struct sd_xfer *x = xq_pop(&rl->pending);
            int st = sd_ofi__post(o, x);
            if (st == SD_EAGAIN) {
                xq_push_front(&rl->pending, x);
                break;
            }
            if (st != SD_OK) {
                finish_unposted(o, x, st);
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
    for (uint32_t i = 0; i < o->n_rails; i++)
        if (o->rails[i].pending.head != NULL)
            return false;
    if (o->wait_fd < 0 || o->retry.head != NULL)
        return false;
    struct fid *f = &o->cq->fid;
    return fi_trywait(o->fabric, &f, 1) == FI_SUCCESS;
}

static void ofi_quiesce(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    for (uint32_t i = 0; i < o->n_rails; i++) {
        struct rail *rl = &o->rails[i];
        if (rl->ep)
            fi_close(&rl->ep->fid);
        rl->ep = NULL;
        rl->pending = (struct xqueue){0};
    }
    /* parked sends and waiting clear-to-sends are dropped with the rest: the daemon stops */
    memset(o->parked, 0, sizeof(o->parked));
    o->parked_n = 0;
    o->retry.head = o->retry.tail = NULL;
    for (uint32_t i = 0; o->rdv_peers && i < o->base.n_peers; i++)
        o->rdv_peers[i] = (struct rdv_peer){0};
}

static void ofi_close(struct sd_transport *tp)
{
    struct ofi *o = (struct ofi *)tp;
    ofi_quiesce(tp);
    if (o->rdv_mr)
        fi_close(&((struct fid_mr *)o->rdv_mr)->fid);
    free(o->rdv_slots);
    free(o->cts_pool);
    free(o->rdv_peers);
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
    free(o->down);
    free(o->addrs);
    free(o->addr_lens);
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
    .peer_down = ofi_peer_down,
    .peer_reset = ofi_peer_reset,
    .set_peer = ofi_set_peer,
    .check_addr = ofi_check_addr,
    .progress = ofi_progress,
    .wait_fd = ofi_wait_fd,
    .can_sleep = ofi_can_sleep,
    .quiesce = ofi_quiesce,
    .close = ofi_close,
};

int sd_transport_ofi_open(const struct sd_config *cfg, const struct sd_gpu_ops *dev,
                          struct sd_transport **tp_p, char *err, size_t errlen)
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
    o->base.self =
        cfg->node >= 0 ? (uint32_t)cfg->node : 0; /* (an open cluster numbers it later) */
    o->wait_fd = -1;
    hints->ep_attr->type = FI_EP_RDM;
    /* FI_DIRECTED_RECV: a receive naming a peer matches only that peer's messages; FI_SOURCE:
     * completions say where a message came from. A process that is not in the table (no peer
     * of the cluster) is never heard: what it sends matches no directed receive, and one that
     * reaches a receive of any source is dropped (from_member). */
    hints->caps = FI_TAGGED | FI_DIRECTED_RECV | FI_SOURCE;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(cfg->provider);
    /* shm's two-copy protocol: read when the provider initialises, at the first fi_getinfo */
    bool shm = strcmp(cfg->provider, "shm") == 0;
    if (shm && !cfg->shm_cma)
        setenv("FI_SHM_DISABLE_CMA", "1", 1);
    const char *no_cma = getenv("FI_SHM_DISABLE_CMA");
    bool sar = shm && no_cma != NULL &&
               (strcmp(no_cma, "1") == 0 || strcasecmp(no_cma, "yes") == 0 ||
                strcasecmp(no_cma, "true") == 0);
    const char *node = cfg->fabric_addr[0] ? cfg->fabric_addr : NULL;
    /* device memory the provider may reach itself (FI_HMEM): asked for first, and without it
     * that memory is staged through pinned host buffers (net_service.c) */
    bool want_hmem = dev != NULL && dev->is_device != NULL && dev->hmem != SD_HMEM_NONE;
    /* libfabric < 1.19's shm copies device memory above 4 KiB through its two-copy protocol,
     * which hangs when several such messages arrive unexpected (and injects nothing then, so
     * no rendezvous can order them): it stages instead, unless chunks stay that small */
    bool shm_hmem_bug = shm && FI_MINOR(fi_version()) < 19 && FI_MAJOR(fi_version()) == 1 &&
                        cfg->chunk_bytes > SHM_HMEM_CHUNK_MAX;
    if (want_hmem && shm_hmem_bug)
        SD_INFO("ofi",
                "shm of libfabric %u.%u: device memory is staged (its FI_HMEM copies hang on "
                "messages above %d bytes; chunk_bytes %lld)",
                FI_MAJOR(fi_version()), FI_MINOR(fi_version()), SHM_HMEM_CHUNK_MAX,
                (long long)cfg->chunk_bytes);
    want_hmem &= !shm_hmem_bug;
    r = -FI_ENODATA;
    if (want_hmem) {
        hints->caps |= FI_HMEM;
        hints->domain_attr->mr_mode |= FI_MR_HMEM;
        r = fi_getinfo(FI_VERSION(1, 17), node, NULL, node ? FI_SOURCE : 0, hints, &o->info);
        hints->caps &= ~(uint64_t)FI_HMEM;
        hints->domain_attr->mr_mode &= ~FI_MR_HMEM;
        o->base.hmem = r == 0;
    }
    if (r != 0)
        r = fi_getinfo(FI_VERSION(1, 17), node, NULL, node ? FI_SOURCE : 0, hints, &o->info);
    fi_freeinfo(hints);
    o->dev = dev;
    if (r != 0) {
        snprintf(err, errlen,
                 "no libfabric provider '%s' with FI_EP_RDM, tagged messages, directed "
                 "receives and source addresses on %s: %s",
                 cfg->provider, node ? node : "any interface", fi_strerror(-r));
        free(o);
        return SD_ENOSYS;
    }
    o->base.connections = has_connections(o->info);
    const char *step = "fi_fabric";
    if ((r = fi_fabric(o->info->fabric_attr, &o->fabric, NULL)) != 0)
        goto err_close;
    step = "fi_domain";
    if ((r = fi_domain(o->fabric, o->info, &o->domain, NULL)) != 0)
        goto err_close;
    if (o->base.hmem && !hmem_works(o))
        o->base.hmem = false; /* its device memory is staged (host memory registers as ever) */
    if (want_hmem)
        SD_INFO("ofi", "%s %s the %s backend's device memory itself (FI_HMEM)%s", cfg->provider,
                o->base.hmem ? "reaches" : "does not reach", dev->name,
                o->base.hmem ? "" : ": it is staged through pinned host buffers");
    /* read the limits back rather than trusting the hints */
    o->tx_depth = o->info->tx_attr->size ? o->info->tx_attr->size : 256;
    o->rx_depth = o->info->rx_attr->size ? o->info->rx_attr->size : 256;
    if (cfg->queue_depth > 0 && cfg->queue_depth < 128) {
        /* the control endpoint's standing pull-request receives would take every place */
        snprintf(err, errlen, "queue_depth %lld: must be 0 (the provider's) or at least 128",
                 (long long)cfg->queue_depth);
        ofi_close(&o->base);
        return SD_EINVAL;
    }
    if (cfg->queue_depth > 0) { /* fewer posted at once; the rest wait in the pending queues */
        o->tx_depth = SD_MIN(o->tx_depth, (size_t)cfg->queue_depth);
        o->rx_depth = SD_MIN(o->rx_depth, (size_t)cfg->queue_depth);
    }
    /* with FI_HMEM, device memory is registered (FI_MR_HMEM), and then all of the job's */
    o->need_mr = (o->info->domain_attr->mr_mode & (FI_MR_LOCAL | FI_MR_HMEM)) != 0;
    /* shm without CMA copies through bounce buffers (SAR), which libfabric < 1.19 cannot do for
     * several large messages that arrive unexpected: everything above its inject size waits for
     * the receiver */
    o->base.rdv_bytes = cfg->rendezvous_bytes;
    if (sar && o->base.rdv_bytes == 0)
        o->base.rdv_bytes = SD_MAX(o->info->tx_attr->inject_size, sizeof(struct rdv_msg));
    o->base.data_lanes = (uint32_t)cfg->data_lanes;
    o->n_rails = RAIL_DATA + 2 * o->base.data_lanes;
    if (o->base.rdv_bytes > 0 && o->info->tx_attr->inject_size < sizeof(struct rdv_msg)) {
        snprintf(err, errlen,
                 "rendezvous_bytes needs a provider that injects %zu-byte messages; %s injects %zu",
                 sizeof(struct rdv_msg), cfg->provider, o->info->tx_attr->inject_size);
        ofi_close(&o->base);
        return SD_ENOSYS;
    }
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
    for (uint32_t i = 0; i < o->n_rails; i++) {
        if (i == RAIL_RDV && o->base.rdv_bytes == 0)
            continue;
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
    if (o->base.rdv_bytes > 0 && sd_ofi__rdv_start(o) != SD_OK) {
        snprintf(err, errlen, "libfabric (provider %s): cannot post the clear-to-send receives",
                 cfg->provider);
        ofi_close(&o->base);
        return SD_EIO;
    }
    SD_INFO(
        "ofi",
        "provider %s, fabric %s, domain %s: control%s and %u data lane endpoint pair%s, tx depth "
        "%zu, rx depth %zu each, mr %s, max message %zu, inject %zu%s, rendezvous above %llu "
        "bytes%s",
        o->info->fabric_attr->prov_name, o->info->fabric_attr->name, o->info->domain_attr->name,
        o->base.rdv_bytes > 0 ? ", clear-to-send" : "", o->base.data_lanes,
        o->base.data_lanes == 1 ? "" : "s", o->tx_depth, o->rx_depth,
        o->need_mr ? "registered" : "not needed", o->info->ep_attr->max_msg_size,
        o->info->tx_attr->inject_size, sar ? ", shm copies through bounce buffers (no CMA)" : "",
        (unsigned long long)o->base.rdv_bytes, o->base.rdv_bytes ? "" : " (off)");
    *tp_p = &o->base;
    return SD_OK;

err_close:
    snprintf(err, errlen, "libfabric %s (provider %s): %s", step, cfg->provider, fi_strerror(-r));
    ofi_close(&o->base);
    return SD_EIO;
}

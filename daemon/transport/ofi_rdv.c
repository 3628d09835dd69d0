/* The rendezvous protocol of the libfabric transport (rendezvous_bytes > 0): a large message
 * leaves only once its receiver's clear-to-send says the receive is posted; credit per peer
 * within the peer's standing receives; early clear-to-sends kept in a pool sized at open. */
#include "transport/ofi.h"

/* ---- rendezvous */

bool sd_ofi__rdv_sized(const struct ofi *o, uint64_t tag, size_t len)
{
    return o->base.rdv_bytes > 0 && len > o->base.rdv_bytes && !sd_tag_is_ctrl(tag);
}

static uint32_t rdv_bucket(uint32_t peer, uint64_t tag)
{
    uint64_t h = (tag ^ ((uint64_t)peer << 32)) * 0x9e3779b97f4a7c15ULL;
    return (uint32_t)(h >> 54); /* 10 bits: RDV_BUCKETS */
}

/* Tell peer that the receive of tag is posted; false if the provider must be asked again. */
static bool cts_inject(struct ofi *o, uint32_t peer, uint64_t tag)
{
    /* named as the peer knows this node (it checks the name against the fabric's source) */
    uint32_t self = sd_transport_self_as(&o->base, peer);
    struct rdv_msg m = {.tag = tag, .src = self, .magic = RDV_MAGIC};
    uint64_t cts_tag = sd_tag_of_kind(SD_TAG_RDV);
    sd_tag_set(&cts_tag, SD_TAGF_SRC, self); /* self < nodes <= SD_MAX_NODES */
    ssize_t r = fi_tinject(o->rails[RAIL_RDV].ep, &m, sizeof(m),
                           o->peers[(size_t)peer_rail(RAIL_RDV) * o->base.n_peers + peer], cts_tag);
    if (r == 0)
        o->base.cts_sent++;
    if (r != 0 && r != -FI_EAGAIN)
        SD_WARN_SPARSE("ofi", "clear-to-send to node %u: %s", peer, fi_strerror((int)-r));
    return r != -FI_EAGAIN; /* an error: the peer's op times out and names this node */
}

/* Send receive x's clear-to-send now, or behind those the provider could not take yet. */
static void cts_emit(struct ofi *o, struct sd_xfer *x)
{
    o->rdv_peers[x->peer].out++;
    x->rdv = RDV_OUT;
    if (o->retry.head == NULL && cts_inject(o, x->peer, x->tag))
        return;
    x->rdv = RDV_RETRY;
    xq_push(&o->retry, x);
}

/* Receive x is posted: tell its peer, within the peer's credit. */
void sd_ofi__cts_send(struct ofi *o, struct sd_xfer *x)
{
    if (o->rdv_peers == NULL || x->peer >= o->base.n_peers)
        return; /* receives name a peer of the table, installed before any */
    struct rdv_peer *rp = &o->rdv_peers[x->peer];
    if (rp->out < o->rdv_credit && rp->deferred.head == NULL) {
        cts_emit(o, x);
        return;
    }
    x->rdv = RDV_DEFERRED;
    o->base.cts_deferred++;
    xq_push(&rp->deferred, x);
}

void sd_ofi__cts_retry(struct ofi *o)
{
    while (o->retry.head && cts_inject(o, o->retry.head->peer, o->retry.head->tag))
        xq_pop(&o->retry)->rdv = RDV_OUT;
}

/* Receive x completed (or was cancelled): its clear-to-send is answered, or no longer needed,
 * and the next receive waiting for credit toward its peer can send one. */
void sd_ofi__cts_done(struct ofi *o, struct sd_xfer *x)
{
    struct rdv_peer *rp = &o->rdv_peers[x->peer];
    if (x->rdv == RDV_DEFERRED) {
        xq_remove(&rp->deferred, x);
    } else {
        if (x->rdv == RDV_RETRY)
            xq_remove(&o->retry, x);
        rp->out--;
    }
    x->rdv = RDV_NONE;
    while (rp->deferred.head != NULL && rp->out < o->rdv_credit)
        cts_emit(o, xq_pop(&rp->deferred));
}

static void early_free(struct ofi *o, struct rdv_cts **pp)
{
    struct rdv_cts *c = *pp;
    *pp = c->next;
    c->next = o->cts_free;
    o->cts_free = c;
    o->early_n--;
}

/* The link to the early clear-to-sends from peer for tag in bucket b (*link NULL: none). */
static struct rdv_cts **early_find(struct ofi *o, uint32_t b, uint32_t peer, uint64_t tag)
{
    struct rdv_cts **pp = &o->early[b];
    while (*pp && ((*pp)->peer != peer || (*pp)->tag != tag))
        pp = &(*pp)->next;
    return pp;
}

/* A clear-to-send from peer: post the send parked for it, or count it for the send to come. */
static void on_cts(struct ofi *o, uint32_t peer, uint64_t tag)
{
    o->base.cts_received++;
    uint32_t b = rdv_bucket(peer, tag);
    for (struct sd_xfer **pp = &o->parked[b]; *pp; pp = &(*pp)->next_pending) {
        struct sd_xfer *x = *pp;
        if (x->peer != peer || x->tag != tag)
            continue;
        *pp = x->next_pending;
        o->parked_n--;
        x->kind = XFER_SEND;
        int st = sd_ofi__issue(o, x);
        if (st != SD_OK) {
            x->kind = 0;
            x->cb(x, st);
        }
        return;
    }
    struct rdv_cts **pp = early_find(o, b, peer, tag);
    if (*pp == NULL) {
        if (o->cts_free == NULL) { /* full of ones no send came for: drop the oldest */
            struct rdv_cts **oldest = NULL;
            for (uint32_t i = 0; i < RDV_BUCKETS; i++)
                for (struct rdv_cts **q = &o->early[i]; *q; q = &(*q)->next)
                    if (oldest == NULL || (*q)->since_ns < (*oldest)->since_ns)
                        oldest = q;
            SD_WARN_SPARSE("ofi",
                           "%u clear-to-sends wait for their sends; dropping the oldest, from node "
                           "%u",
                           o->early_n, (*oldest)->peer);
            early_free(o, oldest);
            pp = early_find(o, b, peer, tag); /* the eviction may have moved the end */
        }
        struct rdv_cts *c = o->cts_free;
        o->cts_free = c->next;
        *c = (struct rdv_cts){.tag = tag, .peer = peer};
        *pp = c;
        o->early_n++;
    }
    (*pp)->count++;
    (*pp)->since_ns = sd_now_ns();
}

/* A send above rdv_bytes, counted in inflight: post it if its clear-to-send is here, else park
 * it. */
int sd_ofi__rdv_send(struct ofi *o, struct sd_xfer *x)
{
    uint32_t b = rdv_bucket(x->peer, x->tag);
    struct rdv_cts **cp = early_find(o, b, x->peer, x->tag);
    if (*cp != NULL) { /* the receiver is ready */
        o->base.sends_cleared++;
        if (--(*cp)->count == 0)
            early_free(o, cp);
        return sd_ofi__issue(o, x);
    }
    x->kind = XFER_PARKED;
    o->base.sends_parked++;
    x->since_ns = sd_now_ns();
    x->next_pending = NULL;
    struct sd_xfer **pp = &o->parked[b];
    while (*pp) /* at the end: sends of one tag leave in order */
        pp = &(*pp)->next_pending;
    *pp = x;
    o->parked_n++;
    return SD_OK;
}

/* Take parked send x out (cancel); false if it is not parked. */
bool sd_ofi__rdv_unpark(struct ofi *o, struct sd_xfer *x)
{
    for (struct sd_xfer **pp = &o->parked[rdv_bucket(x->peer, x->tag)]; *pp;
         pp = &(*pp)->next_pending)
        if (*pp == x) {
            *pp = x->next_pending;
            o->parked_n--;
            return true;
        }
    return false;
}

static void rdv_recv_cb(struct sd_xfer *x, int status);

static int rdv_post_slot(struct ofi *o, struct rdv_slot *sl)
{
    sl->x.kind = XFER_CTS;
    sl->x.cb = rdv_recv_cb;
    sl->x.arg = o;
    sl->x.peer = SD_PEER_ANY;
    sl->x.tag = sd_tag_of_kind(SD_TAG_RDV);
    sl->x.ignore = sd_tag_any_but_kind();
    sl->x.buf = &sl->m;
    sl->x.buflen = sizeof(sl->m);
    sl->x.desc = o->rdv_desc;
    sl->x.rail = RAIL_RDV;
    sl->x.rdv = RDV_NONE;
    int st = sd_ofi__post(o, &sl->x);
    if (st == SD_EAGAIN) {
        xq_push(&rail_of(o, &sl->x)->pending, &sl->x);
        st = SD_OK;
    }
    return st;
}

static void rdv_recv_cb(struct sd_xfer *x, int status)
{
    struct rdv_slot *sl = (struct rdv_slot *)x;
    struct ofi *o = x->arg;
    if (status == SD_ECANCELED || o->rails[RAIL_RDV].ep == NULL)
        return; /* closing */
    if (status == SD_OK && x->len == sizeof(sl->m) && sl->m.magic == RDV_MAGIC &&
        sl->m.src == x->from) /* from the node it names (a peer in the table) */
        on_cts(o, sl->m.src, sl->m.tag);
    else if (status == SD_OK && x->len == sizeof(sl->m) && sl->m.magic == RDV_MAGIC)
        SD_WARN_SPARSE("ofi", "dropping a clear-to-send that names node %u from node %u",
                       (unsigned)sl->m.src, (unsigned)x->from);
    else
        SD_WARN_SPARSE("ofi", "dropping a malformed clear-to-send (%zu bytes, status %s)", x->len,
                       sd_status_str(status));
    if (rdv_post_slot(o, sl) != SD_OK)
        SD_ERROR("ofi", "cannot repost a clear-to-send receive: large sends to this node stall");
}

/* Once a second: drop clear-to-sends no send came for (their receives were cancelled), and
 * name sends that wait long for theirs. */
void sd_ofi__rdv_sweep(struct ofi *o)
{
    uint64_t now = sd_now_ns();
    if ((o->early_n == 0 && o->parked_n == 0) || now - o->rdv_sweep_ns < 1000000000ULL)
        return;
    o->rdv_sweep_ns = now;
    uint32_t dropped = 0;
    for (uint32_t b = 0; b < RDV_BUCKETS; b++) {
        for (struct rdv_cts **pp = &o->early[b]; *pp;)
            if (now - (*pp)->since_ns > RDV_STALE_NS) {
                early_free(o, pp);
                dropped++;
            } else {
                pp = &(*pp)->next;
            }
        for (struct sd_xfer *x = o->parked[b]; x; x = x->next_pending)
            if (now - x->since_ns > 5000000000ULL)
                SD_WARN_SPARSE("ofi",
                               "a send of tag %#llx to node %u waits for its clear-to-send "
                               "for %llu ms",
                               (unsigned long long)x->tag, x->peer,
                               (unsigned long long)(now - x->since_ns) / 1000000);
    }
    if (dropped)
        SD_DEBUG("ofi", "dropped %u clear-to-sends no send used", dropped);
}

int sd_ofi__rdv_start(struct ofi *o)
{
    o->rdv_slots_n = (uint32_t)SD_MAX(1, SD_MIN(RDV_RECV_SLOTS, o->rx_depth / 2));
    o->rdv_slots = calloc(o->rdv_slots_n, sizeof(*o->rdv_slots));
    o->cts_pool_n = 2 * o->rdv_slots_n;
    o->cts_pool = calloc(o->cts_pool_n, sizeof(*o->cts_pool));
    if (o->rdv_slots == NULL || o->cts_pool == NULL)
        return SD_ENOMEM;
    for (uint32_t i = 0; i < o->cts_pool_n; i++) {
        o->cts_pool[i].next = o->cts_free;
        o->cts_free = &o->cts_pool[i];
    }
    if (o->need_mr) {
        struct fid_mr *mr;
        int r = fi_mr_reg(o->domain, o->rdv_slots, o->rdv_slots_n * sizeof(*o->rdv_slots), FI_RECV,
                          0, 0, 0, &mr, NULL);
        if (r != 0)
            return SD_EIO;
        o->rdv_mr = mr;
        o->rdv_desc = fi_mr_desc(mr);
    }
    for (uint32_t i = 0; i < o->rdv_slots_n; i++) {
        int st = rdv_post_slot(o, &o->rdv_slots[i]);
        if (st != SD_OK)
            return st;
    }
    return SD_OK;
}

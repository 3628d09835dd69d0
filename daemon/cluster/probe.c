/* The probe of each peer's data path (cluster.h: a node is "up" only once it works).
 *
 * The control links say that a peer is alive; the fabric is another path, with connections of
 * its own (tcp;ofi_rxm opens one per pair of endpoints), and a peer can be alive while the
 * fabric connection to it is dead: after a partition heals, each side may still hold a
 * connection the other closed, and rxm then refuses the new connection the other side opens as
 * a duplicate of the one it believes in, so both wait on each other. Every time the address
 * table is installed, each node therefore sends every other a ping on each of its endpoints
 * (the control endpoint and each data lane) and waits for the pongs: the round trip uses both
 * directions of every connection a job will use. A peer is usable for new jobs only once every
 * pong came back; one that stays up keeps its verified path across later tables.
 *
 * A probe that gets no answer within PROBE_TIMEOUT_MS pings again, and a pong of any round
 * since the last reset counts (a loaded machine may answer late: a late answer is not a dead
 * path). Only after PROBE_RESET_TRIES silent rounds in a row are the peer's connections reset
 * (transport peer_reset: closed, addresses put back) and the probe starts over; the peer, whose
 * own probes fail the same way, does the same.
 *
 * A provider without connections (shm, efa, cxi: transport.connections false) has no such
 * state to go stale and is not probed: its peers are usable once up. Probing it is not free
 * either: under libfabric 1.17's shm with its two-copy protocol, clusters whose first fabric
 * traffic was the probes' lost a job's message in about one run of 6 of
 * test_cluster_4x1_shm-sar beside two other cluster tests (0 of 12 without the probes, resets
 * or not, the first ping 1 s after the table or not); the cause inside the provider is not found.
 */
#include "cluster/cluster_int.h"
#include "transport/transport.h"

#define PROBE_TIMEOUT_MS  1000
#define PROBE_RESET_TRIES 3
#define PROBE_MAX_RAILS   (1 + SD_MAX_DATA_LANES) /* the control rail, then the data lanes */

struct probe_msg {
    uint32_t from, pong;
    uint64_t round;
};

struct probe_slot {
    struct sd_xfer x;
    struct probe_msg m;
    struct sd_probe *p;
    uint32_t node, rail;
    bool busy;
};

struct sd_probe {
    struct sd_cluster *cl;
    uint32_t n, rails;
    uint64_t *round;                /* [n]: the round of the pings last sent to each node */
    uint64_t *base;                 /* [n]: pongs of rounds after this one count */
    uint32_t *answered;             /* [n]: rails whose pong came back since base (bits) */
    uint64_t *sent_ns;              /* [n] */
    uint32_t *tries;                /* [n]: rounds without an answer in a row */
    bool *ok;                       /* [n]: every rail answered since the table was installed */
    struct probe_slot *ping, *pong; /* [n * rails] */
    struct probe_slot rx[PROBE_MAX_RAILS];
    bool stopping;
};

static uint64_t probe_tag(uint32_t rail, uint32_t self)
{
    uint64_t tag = 0;
    /* unit 1: the control rail (sd_tag_is_ctrl); chunk: the data lane */
    sd_tag_make(SD_TAG_PROBE, 0, rail == 0 ? 1 : 0, 0, self, &tag);
    if (rail > 0)
        sd_tag_set(&tag, SD_TAGF_CHUNK, rail - 1);
    return tag;
}

static void rx_post(struct probe_slot *s);

static void pong_done(struct sd_xfer *x, int status)
{
    (void)status;
    ((struct probe_slot *)x->arg)->busy = false;
}

static void ping_done(struct sd_xfer *x, int status)
{
    struct probe_slot *s = x->arg;
    s->busy = false;
    if (status != SD_OK && !s->p->stopping)
        SD_DEBUG("cluster", "probe of node %u (rail %u): %s", s->node, s->rail,
                 sd_status_str(status));
}

static void send_slot(struct sd_probe *p, struct probe_slot *s, uint32_t node, uint32_t rail,
                      uint32_t pong, uint64_t round, sd_xfer_cb cb)
{
    struct sd_transport *tp = p->cl->tp;
    if (s->busy)
        return; /* the previous one is still on its way: it does as well */
    uint32_t self = sd_transport_self_as(tp, node); /* (as node knows this one) */
    s->m = (struct probe_msg){.from = self, .pong = pong, .round = round};
    s->x = (struct sd_xfer){.cb = cb, .arg = s};
    s->busy =
        tp->ops->send(tp, node, probe_tag(rail, self), &s->m, sizeof(s->m), NULL, &s->x) == SD_OK;
}

static void rx_done(struct sd_xfer *x, int status)
{
    struct probe_slot *s = x->arg;
    struct sd_probe *p = s->p;
    s->busy = false;
    p->cl->tp->standing--;
    if (p->stopping || status == SD_ECANCELED)
        return;
    struct probe_msg m = s->m;
    /* from the node it names (the transport hears only the table's nodes) */
    bool whole = status == SD_OK && x->len == sizeof(m) && m.from == x->from;
    rx_post(s);
    if (!whole || m.from >= p->n || m.from == p->cl->self)
        return;
    if (!m.pong) { /* a ping: answer on the same rail */
        send_slot(p, &p->pong[m.from * p->rails + s->rail], m.from, s->rail, 1, m.round, pong_done);
        return;
    }
    if (m.round <= p->base[m.from] || m.round > p->round[m.from] || p->ok[m.from])
        return;
    p->answered[m.from] |= 1u << s->rail;
    if (p->answered[m.from] != (1u << p->rails) - 1)
        return;
    p->ok[m.from] = true;
    p->tries[m.from] = 0;
    SD_INFO("cluster",
            "node %u: the data path works (a probe's round trip on %u endpoints, "
            "%.1f ms)",
            m.from, p->rails, (double)(sd_now_ns() - p->sent_ns[m.from]) / 1e6);
}

static void rx_post(struct probe_slot *s)
{
    struct sd_probe *p = s->p;
    struct sd_transport *tp = p->cl->tp;
    if (p->stopping || s->busy)
        return;
    s->x = (struct sd_xfer){.cb = rx_done, .arg = s};
    /* any sender, any source field: the kind, the rail's unit and lane name the receive */
    uint64_t ignore =
        sd_tag_mask(SD_TAGF_JOB) | sd_tag_mask(SD_TAGF_SEQ) | sd_tag_mask(SD_TAGF_SRC);
    s->busy = tp->ops->recv(tp, SD_PEER_ANY, probe_tag(s->rail, 0), ignore, &s->m, sizeof(s->m),
                            NULL, &s->x) == SD_OK;
    tp->standing += s->busy; /* (a receive that waits for a peer's ping: no work to poll for) */
}

static void ping(struct sd_probe *p, uint32_t node)
{
    p->round[node]++;
    p->sent_ns[node] = sd_now_ns();
    for (uint32_t r = 0; r < p->rails; r++)
        send_slot(p, &p->ping[node * p->rails + r], node, r, 0, p->round[node], ping_done);
}

int sd_probe_init(struct sd_cluster *cl)
{
    struct sd_probe *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return SD_ENOMEM;
    p->cl = cl;
    p->n = cl->cap; /* (an open cluster's table grows up to cap) */
    p->rails = 1 + SD_MIN(cl->tp->data_lanes, (uint32_t)SD_MAX_DATA_LANES);
    p->round = calloc(p->n, sizeof(*p->round));
    p->base = calloc(p->n, sizeof(*p->base));
    p->answered = calloc(p->n, sizeof(*p->answered));
    p->sent_ns = calloc(p->n, sizeof(*p->sent_ns));
    p->tries = calloc(p->n, sizeof(*p->tries));
    p->ok = calloc(p->n, sizeof(*p->ok));
    p->ping = calloc((size_t)p->n * p->rails, sizeof(*p->ping));
    p->pong = calloc((size_t)p->n * p->rails, sizeof(*p->pong));
    cl->probe = p;
    if (!p->round || !p->base || !p->answered || !p->sent_ns || !p->tries || !p->ok || !p->ping ||
        !p->pong)
        return SD_ENOMEM;
    for (uint32_t i = 0; i < p->n * p->rails; i++) {
        p->ping[i] = (struct probe_slot){.p = p, .node = i / p->rails, .rail = i % p->rails};
        p->pong[i] = p->ping[i];
    }
    for (uint32_t r = 0; r < p->rails && cl->tp->connections; r++) {
        p->rx[r] = (struct probe_slot){.p = p, .rail = r};
        rx_post(&p->rx[r]);
    }
    return SD_OK;
}

/* A peer that stayed up keeps its verified path (a ping queued behind a running job's bulk
 * data could take longer than the timeout, and a reset would break that job): only the peers
 * that were down, or never answered, are probed. */
void sd_probe_table(struct sd_cluster *cl)
{
    struct sd_probe *p = cl->probe;
    for (uint32_t j = 0; p != NULL && j < p->n; j++) {
        if (j == cl->self || !cl->tp->connections)
            p->ok[j] = true;
        if (p->ok[j] || !cl->alive[j])
            continue;
        p->tries[j] = 0;
        p->base[j] = p->round[j];
        p->answered[j] = 0;
        ping(p, j);
    }
}

void sd_probe_down(struct sd_cluster *cl, uint32_t node)
{
    if (cl->probe != NULL && node < cl->probe->n)
        cl->probe->ok[node] = node == cl->self;
}

void sd_probe_tick(struct sd_cluster *cl, uint64_t now)
{
    struct sd_probe *p = cl->probe;
    for (uint32_t j = 0; p != NULL && cl->ready && j < p->n; j++) {
        if (j == cl->self || p->ok[j] || !cl->alive[j] ||
            now - p->sent_ns[j] < (uint64_t)PROBE_TIMEOUT_MS * 1000000ULL)
            continue;
        p->tries[j]++;
        char missing[96] = "";
        size_t at = 0;
        for (uint32_t r = 0; r < p->rails && at < sizeof(missing) - 16; r++)
            if (!(p->answered[j] & (1u << r)))
                at += (size_t)snprintf(missing + at, sizeof(missing) - at, "%s%s", at ? ", " : "",
                                       r == 0 ? "control" : "data lane");
        bool reset = p->tries[j] % PROBE_RESET_TRIES == 0 && cl->tp->ops->peer_reset != NULL &&
                     cl->tp->ops->peer_reset(cl->tp, j) == SD_OK;
        if (p->tries[j] == PROBE_RESET_TRIES || p->tries[j] % (10 * PROBE_RESET_TRIES) == 0)
            SD_WARN("cluster",
                    "node %u is up but its data path does not answer (%s) after %u ms: %s "
                    "(attempt %u)",
                    j, missing, p->tries[j] * PROBE_TIMEOUT_MS,
                    reset ? "resetting the fabric connections to it and probing again"
                          : "probing again",
                    p->tries[j] + 1);
        if (reset) { /* what was on its way over the old connections is gone */
            p->base[j] = p->round[j];
            p->answered[j] = 0;
        }
        ping(p, j);
    }
}

bool sd_probe_ok(const struct sd_cluster *cl, uint32_t node)
{
    return cl->probe == NULL || (node < cl->probe->n && cl->probe->ok[node]);
}

void sd_probe_stop(struct sd_cluster *cl)
{
    struct sd_probe *p = cl->probe;
    if (p == NULL)
        return;
    p->stopping = true;
    for (uint32_t r = 0; r < p->rails; r++)
        if (p->rx[r].busy)
            cl->tp->ops->cancel(cl->tp, &p->rx[r].x);
}

void sd_probe_free(struct sd_cluster *cl)
{
    struct sd_probe *p = cl->probe;
    if (p == NULL)
        return;
    free(p->round);
    free(p->base);
    free(p->answered);
    free(p->sent_ns);
    free(p->tries);
    free(p->ok);
    free(p->ping);
    free(p->pong);
    free(p);
    cl->probe = NULL;
}

/* What the cluster says of its nodes (cluster.h): whether it formed, which nodes are up and
 * usable for jobs, and the documents shardctl topology shows. */
#include "cluster/cluster_int.h"

#include <string.h>

bool sd_cluster_ready(const struct sd_cluster *cl)
{
    return cl == NULL || cl->ready;
}

bool sd_cluster_fatal(const struct sd_cluster *cl)
{
    return cl != NULL && cl->fatal;
}

bool sd_cluster_alive(const struct sd_cluster *cl, uint32_t node)
{
    return cl == NULL ? node == 0 : node < cl->n && (node == cl->self || cl->alive[node]);
}

bool sd_cluster_usable(const struct sd_cluster *cl, uint32_t node)
{
    return sd_cluster_alive(cl, node) && (cl == NULL || sd_probe_ok(cl, node));
}

uint32_t sd_cluster_nodes(const struct sd_cluster *cl)
{
    return cl ? cl->n : 1;
}

uint32_t sd_cluster_self(const struct sd_cluster *cl)
{
    return cl ? cl->self : 0;
}

json_t *sd_cluster_heartbeat_json(const struct sd_cluster *cl)
{
    uint64_t sent, received, dropped;
    sd_heartbeat_counts(cl ? cl->hb : NULL, &sent, &received, &dropped);
    /* dropped: datagrams of no peer, a bad MAC or an old sequence number; peers_refused:
     * connections that did not prove the cluster's secret */
    return json_pack("{s:b, s:I, s:I, s:I, s:i, s:i, s:I}", "thread", cl != NULL && cl->hb != NULL,
                     "sent", (json_int_t)sent, "received", (json_int_t)received, "dropped",
                     (json_int_t)dropped, "port", cl ? (int)cl->me.hb_port : 0, "peer_port",
                     cl ? (int)cl->me.peer_port : 0, "peers_refused",
                     (json_int_t)(cl ? cl->counts.refused : 0));
}

uint32_t sd_cluster_shown_node(const struct sd_cluster *cl)
{
    return cl != NULL && cl->indep ? 0 : sd_cluster_self(cl);
}

uint32_t sd_cluster_shown_nodes(const struct sd_cluster *cl)
{
    return cl != NULL && cl->indep ? 1 : sd_cluster_nodes(cl);
}

uint32_t sd_cluster_daemon_id(const struct sd_cluster *cl, uint32_t node)
{
    if (cl == NULL || !cl->indep || node >= cl->cap)
        return 0;
    return node == cl->self ? cl->meet.uid : cl->meet.uid_of[node];
}

const char *sd_cluster_node_name(const struct sd_cluster *cl, uint32_t node, char *buf, size_t len)
{
    if (cl == NULL || !cl->indep || node >= cl->cap)
        snprintf(buf, len, "cluster node %u", node);
    else if (node == cl->self)
        snprintf(buf, len, "daemon %08x, this one", cl->meet.uid);
    else
        snprintf(buf, len, "daemon %08x at %s", cl->meet.uid_of[node], cl->peers.addrs[node]);
    return buf;
}

bool sd_cluster_independent(const struct sd_cluster *cl)
{
    return cl != NULL && cl->indep;
}

json_t *sd_cluster_json(const struct sd_cluster *cl, bool all)
{
    if (cl != NULL && cl->indep)
        return sd_meet__json(cl, all);
    json_t *nodes = json_array();
    for (uint32_t i = 0; cl && i < cl->n; i++)
        json_array_append_new(
            nodes, json_pack("{s:i, s:b, s:b, s:s}", "node", (int)i, "self", i == cl->self, "link",
                             cl->by_node[i] != NULL && cl->by_node[i]->authed, "state",
                             i == cl->self        ? "self"
                             : !cl->present[i]    ? "absent"
                             : !cl->alive[i]      ? "down"
                             : sd_probe_ok(cl, i) ? "up"
                                                  : "probing"));
    return nodes;
}

void sd_cluster_counts(const struct sd_cluster *cl, struct sd_cluster_counts *out)
{
    memset(out, 0, sizeof(*out));
    if (cl == NULL)
        return;
    for (uint32_t i = 0; i < cl->n; i++)
        if (i != cl->self && cl->present[i]) {
            out->peers++;
            out->peers_up += cl->alive[i];
        }
    for (const struct link *l = cl->links; l; l = l->next) {
        out->links++;
        out->links_proved += l->authed;
    }
    for (const struct outmsg *o = cl->peers.outbox; o; o = o->next)
        out->outbox_bytes += o->len;
    out->refused = cl->counts.refused;
    out->evicted = cl->counts.evicted;
    out->closed_full = cl->counts.closed_full;
    sd_heartbeat_counts(cl->hb, &out->hb_sent, &out->hb_received, &out->hb_dropped);
}

json_t *sd_cluster_stats_json(const struct sd_cluster *cl, bool all)
{
    json_t *links = json_array();
    size_t outbox = 0;
    for (const struct outmsg *o = cl != NULL ? cl->peers.outbox : NULL; o; o = o->next)
        outbox += o->len;
    for (const struct link *l = cl != NULL ? cl->links : NULL; l; l = l->next) {
        json_t *o =
            json_pack("{s:i, s:b, s:b, s:b, s:I, s:I, s:I}", "node", l->node, "proved", l->authed,
                      "incoming", l->incoming, "peer", l->peer, "rx_buffered",
                      (json_int_t)l->rx_len, "tx_queued", (json_int_t)l->tcp.write_queue_size,
                      "waiting_bytes", (json_int_t)(cl->indep ? sd_meet__waiting_bytes(l) : 0));
        if (all) /* (who this daemon talks to: root's to see) */
            json_object_set_new(o, "address", json_string(l->host));
        json_array_append_new(links, o);
    }
    /* refused: hellos that proved nothing, and connections that timed out before one; evicted:
     * unproved connections closed to admit others (a flood); closed_full: links that left too
     * much buffered (waiting for jobs not here, unread writes) */
    return json_pack("{s:I, s:I, s:I, s:I, s:o}", "refused",
                     (json_int_t)(cl ? cl->counts.refused : 0), "evicted",
                     (json_int_t)(cl ? cl->counts.evicted : 0), "closed_full",
                     (json_int_t)(cl ? cl->counts.closed_full : 0), "outbox_bytes",
                     (json_int_t)outbox, "links", links);
}

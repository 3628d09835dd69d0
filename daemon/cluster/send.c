/* The framing and writing of peer messages on a control link (cluster_int.h): a 4-byte length,
 * then the packed PeerMsg; writes are queued on the libuv stream (at most LINK_WRITE_BYTES: a
 * link whose other end reads nothing goes) and freed once written. Which link a message for a
 * node takes, and the "host:port" of a link's other end. */
#include "cluster/cluster_int.h"

struct wreq {
    uv_write_t req;
    uint8_t *buf;
};

static void write_cb(uv_write_t *req, int status)
{
    struct wreq *w = (struct wreq *)req;
    (void)status;
    free(w->buf);
    free(w);
}

uint8_t *sd_cluster__frame(const Shard__PeerMsg *m, size_t *len_p)
{
    size_t len = protobuf_c_message_get_packed_size(&m->base);
    uint8_t *buf = malloc(len + SD_FRAME_HDR);
    if (buf == NULL)
        return NULL;
    buf[0] = (uint8_t)len;
    buf[1] = (uint8_t)(len >> 8);
    buf[2] = (uint8_t)(len >> 16);
    buf[3] = (uint8_t)(len >> 24);
    protobuf_c_message_pack(&m->base, buf + SD_FRAME_HDR);
    *len_p = len + SD_FRAME_HDR;
    return buf;
}

void sd_cluster__link_write(struct link *l, uint8_t *frame, size_t len)
{
    struct wreq *w =
        l != NULL && !l->closing && !l->stalled && frame != NULL ? malloc(sizeof(*w)) : NULL;
    if (w != NULL && l->tcp.write_queue_size + len > LINK_WRITE_BYTES) {
        /* the other end reads nothing (or far less than it is sent): the link goes at the
         * next tick, not under the caller, which may be walking the links */
        l->stalled = true;
        l->cl->counts.closed_full++;
        SD_WARN_SPARSE("cluster",
                       "the link with node %d (%s) has %zu bytes waiting to be written (at most "
                       "%u): the other end does not read; closing it",
                       l->node, l->host, l->tcp.write_queue_size, LINK_WRITE_BYTES);
        free(w);
        w = NULL;
    }
    if (w == NULL) {
        free(frame);
        return;
    }
    w->buf = frame;
    uv_buf_t b = uv_buf_init((char *)frame, (unsigned)len);
    if (uv_write(&w->req, (uv_stream_t *)&l->tcp, &b, 1, write_cb) != 0) {
        free(frame);
        free(w);
    }
}

void sd_cluster__link_send_raw(struct link *l, const Shard__PeerMsg *m)
{
    if (l == NULL || l->closing)
        return;
    size_t len = 0;
    uint8_t *frame = sd_cluster__frame(m, &len);
    sd_cluster__link_write(l, frame, len);
}

void sd_cluster__link_send(struct link *l, const Shard__PeerMsg *m)
{
    if (l != NULL && l->cl->indep && l->peer && l->authed) /* ids for slots, its job proved */
        sd_meet__send(l, m);
    else
        sd_cluster__link_send_raw(l, m);
}

int sd_cluster__parse_hostport(const char *spec, struct sockaddr_storage *ss)
{
    char host[128];
    const char *colon = strrchr(spec, ':');
    if (colon == NULL || colon == spec || (size_t)(colon - spec) >= sizeof(host))
        return SD_EINVAL;
    memcpy(host, spec, (size_t)(colon - spec));
    host[colon - spec] = '\0';
    int port = atoi(colon + 1);
    if (port <= 0 || port > 65535)
        return SD_EINVAL;
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)ss) == 0)
        return SD_OK;
    if (uv_ip6_addr(host, port, (struct sockaddr_in6 *)ss) == 0)
        return SD_OK;
    return SD_EINVAL;
}

/* Send to a node: the coordinator has a link per node; a member reaches the others through it
 * (in order with its decisions: a peer may not have its confirmation of a job yet), or without
 * it on their direct link (opened for it if need be). */
void sd_cluster__send_to(struct sd_cluster *cl, uint32_t node, const Shard__PeerMsg *m)
{
    if (node == cl->self || node >= cl->n)
        return;
    if (cl->self == 0) {
        if (cl->by_node[node] != NULL)
            sd_cluster__link_send(cl->by_node[node], m);
        return;
    }
    if (node == 0) {
        sd_cluster__link_send(cl->by_node[0], m);
        return;
    }
    if (!sd_cluster__coordinator_up(cl)) { /* without it: on the direct link to node */
        sd_cluster__peer_send(cl, node, m);
        return;
    }
    Shard__PeerRelay r = SHARD__PEER_RELAY__INIT;
    r.to = node;
    r.msg = (Shard__PeerMsg *)m;
    Shard__PeerMsg outer = SHARD__PEER_MSG__INIT;
    outer.msg_case = SHARD__PEER_MSG__MSG_RELAY;
    outer.relay = &r;
    sd_cluster__link_send(cl->by_node[0], &outer);
}

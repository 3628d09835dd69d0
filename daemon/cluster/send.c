/* The framing and writing of peer messages on a control link (cluster_int.h): a 4-byte length,
 * then the packed PeerMsg; writes are queued on the libuv stream and freed once written. */
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
    struct wreq *w = l != NULL && !l->closing && frame != NULL ? malloc(sizeof(*w)) : NULL;
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

/* Framing of control messages: a 4-byte little-endian length, then the packed protobuf message.
 * File descriptors ride along with SCM_RIGHTS. */
#ifndef SD_FRAME_H
#define SD_FRAME_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#define SD_FRAME_HDR        4
#define SD_FRAME_MAX_FDS    8
#define SD_PROTOCOL_VERSION 1

/* Send one message with optional fds. Waits up to timeout_ms for a full socket buffer to drain.
 * Returns 0 or a negative status. */
int sd_frame_send(int fd, const ProtobufCMessage *msg, const int *fds, unsigned nfds,
                  int timeout_ms);
/* Send already-framed raw bytes (tests use it to send garbage). */
int sd_frame_send_raw(int fd, const void *buf, size_t len, const int *fds, unsigned nfds,
                      int timeout_ms);
/* Receive one whole frame. *buf_p is malloc'd (caller frees). fds received are stored in fds
 * (at most max_fds, the rest closed) with their number in *nfds_p. Returns 0, SD_ETIMEDOUT,
 * SD_ECONNRESET (peer closed), SD_EMSGSIZE (frame over max_len) or another negative status. */
int sd_frame_recv(int fd, uint8_t **buf_p, size_t *len_p, int *fds, unsigned max_fds,
                  unsigned *nfds_p, size_t max_len, int timeout_ms);

/* Send what the socket takes now of buf[*off_p, len) without waiting; fds (may be NULL) go with
 * the first byte sent (*off_p 0). SD_OK once all is sent, SD_EAGAIN when the socket is full
 * (*off_p says how far it got), or a negative status. */
int sd_frame_send_some(int fd, const void *buf, size_t len, size_t *off_p, const int *fds,
                       unsigned nfds);

static inline void sd_frame_header(uint8_t *hdr, size_t len)
{
    hdr[0] = (uint8_t)len;
    hdr[1] = (uint8_t)(len >> 8);
    hdr[2] = (uint8_t)(len >> 16);
    hdr[3] = (uint8_t)(len >> 24);
}

static inline uint32_t sd_frame_len(const uint8_t *hdr)
{
    return (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 |
           (uint32_t)hdr[3] << 24;
}

#endif

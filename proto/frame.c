#include "sd/frame.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int wait_fd(int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = sd_now_ns();
        if (now >= deadline_ns)
            return SD_ETIMEDOUT;
        struct pollfd p = {.fd = fd, .events = events};
        int ms = (int)((deadline_ns - now + 999999) / 1000000);
        int r = poll(&p, 1, ms);
        if (r > 0) {
            if ((p.revents & (POLLERR | POLLNVAL)) ||
                ((p.revents & POLLHUP) && !(p.revents & events)))
                return SD_ECONNRESET;
            return SD_OK;
        }
        if (r < 0 && errno != EINTR)
            return -errno;
    }
}

int sd_frame_send_some(int fd, const void *buf, size_t len, size_t *off_p, const int *fds,
                       unsigned nfds)
{
    const uint8_t *p = buf;
    union {
        char buf[CMSG_SPACE(sizeof(int) * SD_FRAME_MAX_FDS)];
        struct cmsghdr align;
    } ctl;

    if (nfds > SD_FRAME_MAX_FDS)
        return SD_EINVAL;
    while (*off_p < len) {
        struct iovec iov = {.iov_base = (void *)(p + *off_p), .iov_len = len - *off_p};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        if (*off_p == 0 && nfds > 0 && fds != NULL) { /* fds travel with the first byte */
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.buf;
            mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
            struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
            memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
        }
        ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            *off_p += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return SD_EAGAIN;
        return (n < 0 && (errno == EPIPE || errno == ECONNRESET)) ? SD_ECONNRESET : -errno;
    }
    return SD_OK;
}

int sd_frame_send_raw(int fd, const void *buf, size_t len, const int *fds, unsigned nfds,
                      int timeout_ms)
{
    size_t off = 0;
    uint64_t deadline = sd_now_ns() + (uint64_t)timeout_ms * 1000000ULL;
    for (;;) {
        size_t before = off;
        int st = sd_frame_send_some(fd, buf, len, &off, before == 0 ? fds : NULL,
                                    before == 0 ? nfds : 0);
        if (st != SD_EAGAIN)
            return st;
        st = wait_fd(fd, POLLOUT, deadline);
        if (st != SD_OK)
            return st;
    }
}

int sd_frame_send(int fd, const ProtobufCMessage *msg, const int *fds, unsigned nfds,
                  int timeout_ms)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    uint8_t stackbuf[4096];
    uint8_t *buf = len + SD_FRAME_HDR <= sizeof(stackbuf) ? stackbuf : malloc(len + SD_FRAME_HDR);
    if (buf == NULL)
        return SD_ENOMEM;
    if (len > UINT32_MAX) {
        if (buf != stackbuf)
            free(buf);
        return SD_EMSGSIZE;
    }
    sd_frame_header(buf, len);
    protobuf_c_message_pack(msg, buf + SD_FRAME_HDR);
    int status = sd_frame_send_raw(fd, buf, len + SD_FRAME_HDR, fds, nfds, timeout_ms);
    if (buf != stackbuf)
        free(buf);
    return status;
}

/* Read exactly len bytes; collects SCM_RIGHTS fds if fds != NULL. */
static int read_full(int fd, uint8_t *buf, size_t len, int *fds, unsigned max_fds, unsigned *nfds_p,
                     uint64_t deadline)
{
    size_t off = 0;
    union {
        char buf[CMSG_SPACE(sizeof(int) * SD_FRAME_MAX_FDS)];
        struct cmsghdr align;
    } ctl;

    while (off < len) {
        struct iovec iov = {.iov_base = buf + off, .iov_len = len - off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        if (fds != NULL) {
            mh.msg_control = ctl.buf;
            mh.msg_controllen = sizeof(ctl.buf);
        }
        ssize_t n = recvmsg(fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n == 0)
            return SD_ECONNRESET;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int status = wait_fd(fd, POLLIN, deadline);
                if (status != SD_OK)
                    return status;
                continue;
            }
            return errno == ECONNRESET ? SD_ECONNRESET : -errno;
        }
        if (fds != NULL) {
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                    continue;
                unsigned cnt = (unsigned)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                int got[SD_FRAME_MAX_FDS];
                memcpy(got, CMSG_DATA(c), sizeof(int) * SD_MIN(cnt, SD_FRAME_MAX_FDS));
                for (unsigned i = 0; i < cnt && i < SD_FRAME_MAX_FDS; i++) {
                    if (*nfds_p < max_fds)
                        fds[(*nfds_p)++] = got[i];
                    else
                        close(got[i]);
                }
            }
        }
        off += (size_t)n;
    }
    return SD_OK;
}

int sd_frame_recv(int fd, uint8_t **buf_p, size_t *len_p, int *fds, unsigned max_fds,
                  unsigned *nfds_p, size_t max_len, int timeout_ms)
{
    uint8_t hdr[SD_FRAME_HDR];
    uint64_t deadline = sd_now_ns() + (uint64_t)timeout_ms * 1000000ULL;
    unsigned nfds = 0;
    int status = read_full(fd, hdr, sizeof(hdr), fds, max_fds, &nfds, deadline);
    if (status != SD_OK)
        goto err_close_fds;
    size_t len = sd_frame_len(hdr);
    if (len > max_len) {
        status = SD_EMSGSIZE;
        goto err_close_fds;
    }
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL) {
        status = SD_ENOMEM;
        goto err_close_fds;
    }
    status = read_full(fd, buf, len, fds, max_fds, &nfds, deadline);
    if (status != SD_OK) {
        free(buf);
        goto err_close_fds;
    }
    *buf_p = buf;
    *len_p = len;
    if (nfds_p != NULL)
        *nfds_p = nfds;
    return SD_OK;

err_close_fds:
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    return status;
}

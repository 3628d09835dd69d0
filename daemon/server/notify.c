/* systemd notifications (notify.h). The protocol is one datagram per message on the unix socket
 * NOTIFY_SOCKET names; abstract names start with '@'. The watchdog ping runs on the event loop's
 * own timer: if the loop is held (a bug, a file system that blocks it), the pings stop and
 * systemd restarts the service after WatchdogSec. */
#include "notify.h"
#include "sd/log.h"
#include "sd/util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define STATUS_EVERY_MS 5000 /* a changed STATUS= goes at most this often (and at READY) */

static int notify_connect(const char *path)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    if ((path[0] != '/' && path[0] != '@') || len < 2 || len >= sizeof(addr.sun_path)) {
        SD_WARN("notify",
                "NOTIFY_SOCKET '%s' is neither a path nor an abstract name ('@...') "
                "that fits a unix address: no notifications",
                path);
        return -1;
    }
    memcpy(addr.sun_path, path, len);
    if (addr.sun_path[0] == '@')
        addr.sun_path[0] = '\0';
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        SD_WARN("notify", "socket for NOTIFY_SOCKET: %s: no notifications", strerror(errno));
        return -1;
    }
    if (connect(fd, (struct sockaddr *)&addr,
                (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) != 0) {
        SD_WARN("notify", "NOTIFY_SOCKET '%s': %s: no notifications", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static void send_msg(struct sd_notify *n, const char *msg)
{
    if (n->fd < 0)
        return;
    /* non-blocking: a manager that does not read makes us drop a message, never wait */
    if (send(n->fd, msg, strlen(msg), MSG_NOSIGNAL) < 0 && errno != EAGAIN)
        SD_WARN_SPARSE("notify", "sending '%.20s' to NOTIFY_SOCKET: %s", msg, strerror(errno));
}

/* STATUS= when it changed (or always) */
static void send_status(struct sd_notify *n, bool always)
{
    char status[sizeof(n->status)];
    n->status_fn(n->arg, status, sizeof(status));
    if (!always && strcmp(status, n->status) == 0)
        return;
    snprintf(n->status, sizeof(n->status), "%s", status);
    char msg[sizeof(n->status) + 8];
    snprintf(msg, sizeof(msg), "STATUS=%s", status);
    send_msg(n, msg);
    n->last_status_ns = sd_now_ns();
}

static void on_timer(uv_timer_t *t)
{
    struct sd_notify *n = t->data;
    if (n->watchdog_ms > 0)
        send_msg(n, "WATCHDOG=1");
    if (sd_now_ns() - n->last_status_ns >= (uint64_t)STATUS_EVERY_MS * 1000000)
        send_status(n, false);
}

/* WATCHDOG_USEC for this process: 0 when unset, invalid or another process's */
static uint64_t watchdog_usec(void)
{
    const char *us = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
    if (us == NULL)
        return 0;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(us, &end, 10);
    if (errno != 0 || end == us || *end != '\0' || v == 0) {
        SD_WARN("notify", "WATCHDOG_USEC '%s' is not a positive number: no watchdog pings", us);
        return 0;
    }
    if (pid != NULL) {
        long long p = strtoll(pid, &end, 10);
        if (end == pid || *end != '\0' || p != (long long)getpid())
            return 0; /* the watchdog is another process's (sd_watchdog_enabled(3)) */
    }
    return v;
}

void sd_notify_init(struct sd_notify *n, uv_loop_t *loop, sd_notify_status_fn fn, void *arg)
{
    *n = (struct sd_notify){.fd = -1, .status_fn = fn, .arg = arg};
    uv_timer_init(loop, &n->timer);
    n->timer.data = n;
    const char *path = getenv("NOTIFY_SOCKET");
    if (path == NULL || path[0] == '\0')
        return;
    n->fd = notify_connect(path);
    if (n->fd < 0)
        return;
    uint64_t us = watchdog_usec();
    if (us > 0)
        n->watchdog_ms = SD_MAX(us / 2000, 1); /* twice per interval, as sd_notify(3) advises */
}

void sd_notify_ready(struct sd_notify *n)
{
    if (n->fd < 0)
        return;
    send_msg(n, "READY=1");
    send_status(n, true);
    uint64_t every = n->watchdog_ms > 0 ? SD_MIN(n->watchdog_ms, STATUS_EVERY_MS) : STATUS_EVERY_MS;
    uv_timer_start(&n->timer, on_timer, every, every);
    if (n->watchdog_ms > 0)
        SD_INFO("notify", "systemd watchdog: WATCHDOG=1 from the event loop every %llu ms",
                (unsigned long long)n->watchdog_ms);
}

void sd_notify_stopping(struct sd_notify *n)
{
    send_msg(n, "STOPPING=1");
    if (!uv_is_closing((uv_handle_t *)&n->timer)) {
        uv_timer_stop(&n->timer);
        uv_close((uv_handle_t *)&n->timer, NULL);
    }
}

void sd_notify_close(struct sd_notify *n)
{
    if (n->fd >= 0)
        close(n->fd);
    n->fd = -1;
}

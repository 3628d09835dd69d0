/* systemd's service notifications (sd_notify(3)'s protocol, without libsystemd): READY=1 once
 * the sockets listen, STATUS= with the jobs, sessions and peers, STOPPING=1 at shutdown, and
 * WATCHDOG=1 sent by the event loop itself while systemd asks for it (WatchdogSec=), so that a
 * loop that stops turning is restarted. Nothing is sent where NOTIFY_SOCKET is unset. */
#ifndef SD_NOTIFY_H
#define SD_NOTIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

/* writes the STATUS= text (without the prefix) into buf */
typedef void (*sd_notify_status_fn)(void *arg, char *buf, size_t len);

struct sd_notify {
    int fd; /* datagram socket connected to NOTIFY_SOCKET, -1 without one */
    uv_timer_t timer;
    uint64_t watchdog_ms;    /* WATCHDOG=1 every this long (half of WATCHDOG_USEC); 0: off */
    uint64_t last_status_ns; /* when STATUS= last went */
    char status[256];        /* the last STATUS= sent */
    sd_notify_status_fn status_fn;
    void *arg;
};

/* Reads NOTIFY_SOCKET (a path, or '@' for an abstract name), WATCHDOG_USEC and WATCHDOG_PID
 * (the watchdog is this process's only when it names our pid, or is unset). Never fails the
 * daemon: a socket that cannot be reached is logged and notifications are off. */
void sd_notify_init(struct sd_notify *n, uv_loop_t *loop, sd_notify_status_fn fn, void *arg);
/* READY=1 with the first STATUS=, then the loop's timer (watchdog and status changes) */
void sd_notify_ready(struct sd_notify *n);
/* STOPPING=1; the timer stops (its handle closes with the loop's others) */
void sd_notify_stopping(struct sd_notify *n);
/* the socket goes (after the loop ended) */
void sd_notify_close(struct sd_notify *n);

#endif

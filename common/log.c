#include "sd/log.h"
#include "sd/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int sd_log_level = SD_LOG_INFO;

static const char *const level_names[] = {"error", "warn", "info", "debug", "trace"};

int sd_log_level_parse(const char *name)
{
    for (int i = 0; i < (int)(sizeof(level_names) / sizeof(level_names[0])); i++)
        if (strcmp(name, level_names[i]) == 0)
            return i;
    return -1;
}

const char *sd_log_level_name(int level)
{
    if (level < 0 || level > SD_LOG_TRACE)
        return "?";
    return level_names[level];
}

int sd_log_ratelimit(uint64_t *last_ms, uint64_t interval_ms)
{
    uint64_t now = sd_now_ns() / 1000000;
    if (*last_ms != 0 && now - *last_ms < interval_ms)
        return 0;
    *last_ms = now ? now : 1;
    return 1;
}

uint64_t sd_log_sparse(struct sd_log_sparse *s, uint32_t burst)
{
    uint64_t now = sd_now_ns() / 1000000;
    if (s->window_ms == 0 || now - s->window_ms >= SD_LOG_SPARSE_MS) {
        uint64_t said = s->suppressed;
        s->window_ms = now ? now : 1;
        s->burst = 1;
        s->suppressed = 0;
        return said + 1;
    }
    if (s->burst < burst) {
        s->burst++;
        return 1;
    }
    s->suppressed++;
    return 0;
}

/* Control characters (a newline, an escape sequence) in what a peer or a client named would
 * forge lines or drive a terminal: written as \xNN, in place, within cap bytes; the length. */
static size_t escape_controls(char *buf, size_t len, size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        n += (unsigned char)buf[i] < 0x20 || buf[i] == 0x7f;
    if (n == 0)
        return len;
    char tmp[SD_LOG_LINE];
    size_t o = 0;
    for (size_t i = 0; i < len && o + 4 < sizeof(tmp); i++) {
        unsigned char c = (unsigned char)buf[i];
        if (c < 0x20 || c == 0x7f)
            o += (size_t)snprintf(tmp + o, sizeof(tmp) - o, "\\x%02x", c);
        else
            tmp[o++] = (char)c;
    }
    o = o < cap ? o : cap;
    memcpy(buf, tmp, o);
    return o;
}

static void log_vwrite(int level, const char *subsys, uint64_t suppressed, const char *fmt,
                       va_list ap)
{
    char buf[SD_LOG_LINE];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03ld %-5s [%s] ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, sd_log_level_name(level), subsys);
    if (n < 0 || (size_t)n >= sizeof(buf))
        return;
    size_t head = (size_t)n, room = sizeof(buf) - 2; /* (the newline, and vsnprintf's NUL) */
    int m = vsnprintf(buf + head, sizeof(buf) - head, fmt, ap);
    if (m < 0)
        return;
    size_t len = head + escape_controls(buf + head, SD_MIN((size_t)m, room - head), room - head);
    if (suppressed > 0 && len < room)
        len += (size_t)snprintf(buf + len, room - len + 1,
                                " (and %llu more like it in the last %d s, not logged)",
                                (unsigned long long)suppressed, SD_LOG_SPARSE_MS / 1000);
    if (len > room)
        len = room;
    buf[len++] = '\n';
    /* one write(2) per line so lines of concurrent processes do not interleave */
    ssize_t w = write(STDERR_FILENO, buf, len);
    (void)w;
}

void sd_log_write(int level, const char *subsys, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, subsys, 0, fmt, ap);
    va_end(ap);
}

void sd_log_write_sparse(int level, const char *subsys, uint64_t said, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, subsys, said > 1 ? said - 1 : 0, fmt, ap);
    va_end(ap);
}

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

void sd_log_write(int level, const char *subsys, const char *fmt, ...)
{
    char buf[1024];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03ld %-5s [%s] ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, sd_log_level_name(level), subsys);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof(buf))
        n += vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof(buf) - 1)
        n = (int)sizeof(buf) - 2;
    buf[n++] = '\n';
    /* one write(2) per line so lines of concurrent processes do not interleave */
    ssize_t w = write(STDERR_FILENO, buf, (size_t)n);
    (void)w;
}

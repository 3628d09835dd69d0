/* Logging: levels, a subsystem tag, the level checked before formatting, debug compiled out of
 * release builds (NDEBUG), and a rate-limited variant for hot paths (libfabric FI_WARN_SPARSE). */
#ifndef SD_LOG_H
#define SD_LOG_H

#include <stdint.h>

enum sd_log_level { SD_LOG_ERROR, SD_LOG_WARN, SD_LOG_INFO, SD_LOG_DEBUG, SD_LOG_TRACE };

extern int sd_log_level;

void sd_log_write(int level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Parse "error"|"warn"|"info"|"debug"|"trace"; returns the level or -1. */
int sd_log_level_parse(const char *name);
const char *sd_log_level_name(int level);
/* True at most once per interval_ms for one call site's state. */
int sd_log_ratelimit(uint64_t *last_ms, uint64_t interval_ms);

/* A log line is at most this long (what is longer is cut). Control characters in it (what a
 * peer or a client named: a newline, an escape) are written as \xNN, so nobody forges a line. */
#define SD_LOG_LINE 1024

/* What a peer or a client can trigger is logged sparsely: the first SD_LOG_SPARSE_BURST lines of
 * a call site in each SD_LOG_SPARSE_MS, then nothing until the next interval, whose first line
 * says how many were not logged (libfabric's FI_WARN_SPARSE, counted). */
#define SD_LOG_SPARSE_MS    5000
#define SD_LOG_SPARSE_BURST 3
struct sd_log_sparse {
    uint64_t window_ms; /* when the current interval began */
    uint32_t burst;     /* lines logged in it */
    uint64_t suppressed;
};
/* 0: not now (counted); else log, with the value minus one not logged before it (burst: the
 * lines an interval, SD_LOG_SPARSE_BURST for the macros below) */
uint64_t sd_log_sparse(struct sd_log_sparse *s, uint32_t burst);
/* a line after sd_log_sparse returned said: it says how many were not logged */
void sd_log_write_sparse(int level, const char *subsys, uint64_t said, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define SD_LOG(level, subsys, ...)                                                                 \
    do {                                                                                           \
        if ((level) <= sd_log_level)                                                               \
            sd_log_write((level), (subsys), __VA_ARGS__);                                          \
    } while (0)

#define SD_ERROR(subsys, ...) SD_LOG(SD_LOG_ERROR, subsys, __VA_ARGS__)
#define SD_WARN(subsys, ...)  SD_LOG(SD_LOG_WARN, subsys, __VA_ARGS__)
#define SD_INFO(subsys, ...)  SD_LOG(SD_LOG_INFO, subsys, __VA_ARGS__)
#ifdef NDEBUG
#define SD_DEBUG(subsys, ...)                                                                      \
    do {                                                                                           \
    } while (0)
#else
#define SD_DEBUG(subsys, ...) SD_LOG(SD_LOG_DEBUG, subsys, __VA_ARGS__)
#endif

/* Log sparsely from this call site (struct sd_log_sparse): a few lines an interval, then a
 * count of those not logged. */
#define SD_LOG_SPARSE_N(level, subsys, burst, ...)                                                 \
    do {                                                                                           \
        static struct sd_log_sparse sd__sparse_;                                                   \
        uint64_t sd__said_;                                                                        \
        if ((level) <= sd_log_level && (sd__said_ = sd_log_sparse(&sd__sparse_, (burst))) != 0)    \
            sd_log_write_sparse((level), (subsys), sd__said_, __VA_ARGS__);                        \
    } while (0)
#define SD_LOG_SPARSE(level, subsys, ...)                                                          \
    SD_LOG_SPARSE_N(level, subsys, SD_LOG_SPARSE_BURST, __VA_ARGS__)
#define SD_WARN_SPARSE(subsys, ...)  SD_LOG_SPARSE(SD_LOG_WARN, subsys, __VA_ARGS__)
#define SD_ERROR_SPARSE(subsys, ...) SD_LOG_SPARSE(SD_LOG_ERROR, subsys, __VA_ARGS__)

#endif

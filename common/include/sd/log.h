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

/* Warn at most once every 5 s from this call site. */
#define SD_WARN_SPARSE(subsys, ...)                                                                \
    do {                                                                                           \
        static uint64_t sd__last_ms_;                                                              \
        if (SD_LOG_WARN <= sd_log_level && sd_log_ratelimit(&sd__last_ms_, 5000))                  \
            sd_log_write(SD_LOG_WARN, (subsys), __VA_ARGS__);                                      \
    } while (0)

#endif

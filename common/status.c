#include "sd/status.h"

#include <stdio.h>
#include <string.h>

/* One table: status, symbolic name, text (libfabric fi_errno.h / libuv UV_ERRNO_MAP style). */
#define SD_STATUS_MAP(X)                                                                           \
    X(SD_OK, "success")                                                                            \
    X(SD_EINVAL, "invalid argument")                                                               \
    X(SD_ENOMEM, "out of memory")                                                                  \
    X(SD_ENOSPC, "no space left (on a device, or in the memory budget or pool)")                   \
    X(SD_ETIMEDOUT, "operation timed out")                                                         \
    X(SD_EPROTO, "protocol error (malformed message)")                                             \
    X(SD_ENOSYS, "operation not supported by this backend or plan")                                \
    X(SD_EBUSY, "resource busy")                                                                   \
    X(SD_EAGAIN, "resource temporarily unavailable")                                               \
    X(SD_EIO, "input/output error")                                                                \
    X(SD_EPERM, "operation not permitted")                                                         \
    X(SD_ENOENT, "no such file or object")                                                         \
    X(SD_EEXIST, "already exists")                                                                 \
    X(SD_ECONNRESET, "connection reset by the daemon")                                             \
    X(SD_ENOTCONN, "not connected to a daemon")                                                    \
    X(SD_EMSGSIZE, "message or buffer has the wrong size")                                         \
    X(SD_ERANGE, "value out of range")                                                             \
    X(SD_ECANCELED, "operation canceled")                                                          \
    X(SD_ESTATE, "call not valid in the current state")                                            \
    X(SD_EMISMATCH, "mismatch between ranks")                                                      \
    X(SD_EJOBFAILED, "the job failed (a rank or peer of it died or aborted)")                      \
    X(SD_EVERSION, "version mismatch")                                                             \
    X(SD_ENOUNIT, "unknown unit id")                                                               \
    X(SD_ENOJOB, "unknown job")                                                                    \
    X(SD_ENOTHELD, "unit is not held by this rank")                                                \
    X(SD_ECONFIG, "invalid configuration")                                                         \
    X(SD_EPEER, "a peer daemon failed")                                                            \
    X(SD_ENONFINITE, "a gradient is not finite; the step was skipped")                             \
    X(SD_EPAUSED, "the job paused: a rank died; register it again to resume")                      \
    X(SD_ENOREPLICA, "some state has no copy left on a node that is up")

const char *sd_status_str(int status)
{
    switch (status) {
#define SD_STATUS_TEXT(code, text)                                                                 \
    case code:                                                                                     \
        return text;
        SD_STATUS_MAP(SD_STATUS_TEXT)
#undef SD_STATUS_TEXT
    default:
        break;
    }
    if (status < 0 && status > -SD_ERR_OFFSET)
        return strerror(-status);
    return "unknown status";
}

const char *sd_status_name(int status)
{
    switch (status) {
#define SD_STATUS_NAME(code, text)                                                                 \
    case code:                                                                                     \
        return #code;
        SD_STATUS_MAP(SD_STATUS_NAME)
#undef SD_STATUS_NAME
    default:
        return "SD_E?";
    }
}

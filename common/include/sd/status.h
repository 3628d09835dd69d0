/* Status codes shared by the daemon, the client library and the tools.
 *
 * 0 is success; errors are negative. Values down to -SD_ERR_OFFSET are negated errno codes;
 * project codes sit below that offset. The public header client/include/shard.h repeats the
 * values under SHARD_ names, and client/shard_status.c pins them equal with _Static_assert. */
#ifndef SD_STATUS_H
#define SD_STATUS_H

#include <errno.h>

#define SD_ERR_OFFSET 1000

enum sd_status {
    SD_OK = 0,
    SD_EINVAL = -EINVAL,
    SD_ENOMEM = -ENOMEM,
    SD_ENOSPC = -ENOSPC,
    SD_ETIMEDOUT = -ETIMEDOUT,
    SD_EPROTO = -EPROTO,
    SD_ENOSYS = -ENOSYS,
    SD_EBUSY = -EBUSY,
    SD_EAGAIN = -EAGAIN,
    SD_EIO = -EIO,
    SD_EPERM = -EPERM,
    SD_ENOENT = -ENOENT,
    SD_EEXIST = -EEXIST,
    SD_ECONNRESET = -ECONNRESET,
    SD_ENOTCONN = -ENOTCONN,
    SD_EMSGSIZE = -EMSGSIZE,
    SD_ERANGE = -ERANGE,
    SD_ECANCELED = -ECANCELED,
    /* project codes */
    SD_ESTATE = -(SD_ERR_OFFSET + 1),     /* call not valid in this state (fetch before register) */
    SD_EMISMATCH = -(SD_ERR_OFFSET + 2),  /* model or schedule differs between ranks */
    SD_EJOBFAILED = -(SD_ERR_OFFSET + 3), /* another rank or peer of the job failed */
    SD_EVERSION = -(SD_ERR_OFFSET + 4),   /* protocol or layout version mismatch */
    SD_ENOUNIT = -(SD_ERR_OFFSET + 5),    /* unknown unit id */
    SD_ENOJOB = -(SD_ERR_OFFSET + 6),     /* unknown job */
    SD_ENOTHELD = -(SD_ERR_OFFSET + 7),   /* release of a unit the rank does not hold */
    SD_ECONFIG = -(SD_ERR_OFFSET + 8),    /* bad configuration value */
    SD_EPEER = -(SD_ERR_OFFSET + 9),      /* a peer daemon failed or vanished */
    SD_ENONFINITE = -(SD_ERR_OFFSET + 10), /* a gradient is not finite: the step was skipped */
    SD_EPAUSED = -(SD_ERR_OFFSET + 11),    /* a rank died; the job waits to be registered again */
    SD_ENOREPLICA = -(SD_ERR_OFFSET + 12), /* some state has no copy on a node that is up */
    SD_ESTATUS_MIN = -(SD_ERR_OFFSET + 12)
};

/* Human-readable text for a status; never NULL, also for unknown values. */
const char *sd_status_str(int status);
/* Short symbolic name ("SD_EINVAL"); never NULL. */
const char *sd_status_name(int status);

#endif

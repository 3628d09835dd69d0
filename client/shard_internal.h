/* Internal entry points of libshard for shardctl and the tests (not in the public header). */
#ifndef SHARD_INTERNAL_H
#define SHARD_INTERNAL_H

#include "shard.h"

#include <stddef.h>
#include <stdint.h>

/* Connect to the daemon's socket (path NULL: $SHARD_SOCKET or the default). */
SHARD_API int shard__connect(const char *socket_path, int *fd_p, char *err, size_t errlen);
/* Post one raw ring entry and wait for its completion: lets tests send what the public API
 * refuses to (unknown units, wrong sizes, bad slots) to check the daemon's own validation. */
SHARD_API int shard__post_raw(shard_ctx_t *ctx, uint32_t op, uint32_t unit, uint64_t a0,
                              uint64_t a1);

/* Wait until every posted gradient push completed; returns the first push error. */
SHARD_API int shard__push_flush(shard_ctx_t *ctx);
/* Drop the daemon's cached gathered copy of a unit, so the next fetch gathers again. */
SHARD_API int shard__drop(shard_ctx_t *ctx, uint32_t unit);

/* Where shard_step_ex writes the step's arguments (tests corrupt them on purpose). */
SHARD_API void *shard__step_args(shard_ctx_t *ctx);

/* The shared ring of an attached context (tests corrupt it on purpose). */
struct sd_ring_hdr;
SHARD_API struct sd_ring_hdr *shard__ring(shard_ctx_t *ctx);

#endif

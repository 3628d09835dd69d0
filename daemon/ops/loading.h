/* loading.c: initial values and the ready barrier. */
#ifndef SD_LOADING_H
#define SD_LOADING_H

#include "job.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct sd_session;
struct sd_sqe;
struct sd_unit_layout;

/* rank 0's initial values of a unit from a staging slot: false while its previous init is still
 * converted or sent (the ring entry waits) */
bool sd_loading_init(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                     uint64_t start);
/* the conversion of rank 0's values (its init call waits) or of a received unit (the next
 * receive waits) is queued on the device: the loop's poll goes on once the queue passed it */
bool sd_loading_queue_waiting(const struct sd_job *job);
bool sd_loading_queue_poll(struct sd_job *job);
void sd_loading_ready(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e,
                      uint64_t start);
/* the registration is agreed: the other nodes start receiving their initial values */
void sd_loading_start(struct sd_job *job);
/* Elements [lo, hi) of unit ul cover the weight shards of node m's ranks, which hold their
 * optimizer-state shards (model.h): all sd_loading_unit reads. A zero3 node gets 1/N of the
 * unit, not all of it. */
void sd_loading_range(const struct sd_job *job, uint32_t m, const struct sd_unit_layout *ul,
                      uint64_t *lo, uint64_t *hi);
/* fp32 values of unit's elements from src_off on (src[0] is element src_off, through this
 * node's sd_loading_range) into this node's shards: the masters and the weights in their dtype.
 * host_src: src is host memory (a checkpoint's staged values), else the backend's. */
void sd_loading_unit(struct sd_job *job, uint32_t unit, const float *src, uint64_t src_off,
                     bool host_src);
/* this node read its part of the checkpoint the job starts from: it is ready */
void sd_loading_loaded(struct sd_job *job);
/* node 0's rank 0 finished loading */
void sd_loading_remote_ready(struct sd_job *job);
/* its state (struct sd_loading_state, its own): at registration, and with the job */
int sd_loading_create(struct sd_job *job);
void sd_loading_destroy(struct sd_job *job);

#endif

/* jobs.c: the daemon's jobs as a whole, above every operation: swept for deadlines, polled for
 * their device queues, told what the cluster says about them, destroyed at shutdown. */
#ifndef SD_JOBS_H
#define SD_JOBS_H

#include <stdbool.h>
#include <stdint.h>

struct sd_cluster_events;
struct sd_job;
struct sd_registry;

/* Check deadlines of registrations and parked operations; free retired jobs whose transfers
 * drained. */
void sd_jobs_sweep(struct sd_registry *reg, uint64_t now_ns);
/* Jobs whose step, push rounds or fetch answers wait for the device's queue: *waiting_p says
 * whether any does (the loop then keeps polling: a device's completion wakes nothing); returns
 * whether any went on. */
bool sd_jobs_poll_queues(struct sd_registry *reg, bool *waiting_p);
void sd_jobs_destroy_all(struct sd_registry *reg);
/* What the cluster tells this node about jobs (cluster.h's events), bound to reg. */
void sd_jobs_cluster_events(struct sd_registry *reg, struct sd_cluster_events *ev_p);

#endif

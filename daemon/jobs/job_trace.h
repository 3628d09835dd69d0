/* A job's flight recorder (sd/trace.h's ring in job->stats.trace) as JSON: the document
 * shardctl trace shows, and the dump a failed job leaves in <runtime_dir>/trace/ (docs/
 * operations.md says how to read it). */
#ifndef SD_JOB_TRACE_H
#define SD_JOB_TRACE_H

#include <jansson.h>
#include <stddef.h>

struct sd_job;

/* {"version": "shardd-trace-1", "job", "node", ..., "calls_taken": [per rank, per op],
 * "entries": [{"record_id", "kind", "profiling_name", "collective_seq_id", "state", ...}]};
 * failing (or NULL): the job is failing with this text (its state says so) */
json_t *sd_job_trace_json(const struct sd_job *job, const char *failing);
/* Writes the document to <runtime_dir>/trace/<job>.<id>.node<n>.json (0600, the job owner's;
 * the directory keeps the 64 latest), its path into path. SD_OK, or an error. */
int sd_job_trace_dump(const struct sd_job *job, const char *failing, char *path, size_t len);

#endif

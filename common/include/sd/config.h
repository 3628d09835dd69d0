/* The daemon's configuration: one table (name, type, default, bounds, help) drives JSON loading,
 * command-line overrides, `shardd --help` and the effective config in `shardctl status`. */
#ifndef SD_CONFIG_H
#define SD_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#define SD_PATH_MAX 256

struct sd_config {
    char runtime_dir[SD_PATH_MAX];
    int64_t node;
    int64_t nodes;
    int64_t ranks_per_node;
    int64_t package_size;
    char backend[24];
    char devices[128];
    uint64_t memory_budget;
    int64_t op_timeout_ms;
    int64_t register_timeout_ms;
    int64_t resume_timeout_ms;
    int64_t max_resume_timeout_ms;
    uint64_t paused_bytes_per_uid;
    int64_t checkpoint_threads;
    int64_t checkpoint_workers;
    int64_t checkpoint_direct;
    char log_level[16];
    char metrics_listen[80];
    int64_t metrics_job_grace_s;
    int64_t trace_ops;
    int64_t max_clients;
    uint64_t max_message_bytes;
    int64_t poll_spin_us;
    int64_t staging_slots;
    int64_t push_rounds;
    uint64_t max_live_bytes;
    int64_t max_jobs;
    int64_t max_jobs_per_uid;
    int64_t max_tensors;
    int64_t max_units;
    int64_t frame_timeout_ms;
    uint64_t control_memory_bytes;
    uint64_t conn_queue_bytes;
    int64_t allowed_gid;
    char provider[64];
    char fabric_addr[64];
    char coordinator[128];
    char cluster_secret_file[SD_PATH_MAX];
    int64_t heartbeat_interval_ms;
    int64_t heartbeat_timeout_ms;
    int64_t heartbeat_port;
    int64_t peer_port;
    int64_t fabric_idle_close_ms;
    int64_t rendezvous_timeout_ms;
    uint64_t chunk_bytes;
    uint64_t small_allreduce_bytes;
    int64_t net_spin;
    int64_t net_poll_us;
    int64_t coalesce_bytes;
    int64_t quant_min_bytes;
    int64_t prefetch_depth;
    uint64_t prefetch_bytes;
    int64_t reuse_distance;
    uint64_t persist_bytes;
    int64_t schedule_max_ops;
    uint64_t rendezvous_bytes;
    int64_t shm_cma;
    int64_t queue_depth;
    int64_t data_lanes;
};

/* data_lanes: endpoint pairs that carry bulk data between two daemons, at most */
#define SD_MAX_DATA_LANES 8

enum sd_config_type { SD_CFG_STRING, SD_CFG_INT, SD_CFG_SIZE };

struct sd_config_entry {
    const char *name;
    enum sd_config_type type;
    const char *defval; /* as text, parsed like any other value */
    int64_t min, max;   /* integers and sizes; for strings, max is the buffer size */
    size_t offset;
    const char *help;
    int cluster; /* must be equal on every node: part of the config digest */
};

extern const struct sd_config_entry sd_config_table[];
extern const unsigned sd_config_table_len;

void sd_config_defaults(struct sd_config *cfg);
/* Set one option from text ("64MiB", "30000", "info"); err names the key and the bad value. */
int sd_config_set(struct sd_config *cfg, const char *name, const char *value, char *err,
                  size_t errlen);
/* Load a JSON object; unknown keys and bad values are errors naming the key, value and file. */
int sd_config_load_file(struct sd_config *cfg, const char *path, char *err, size_t errlen);
/* The most entries option `devices` lists (one per local rank at most, cycled over the ranks). */
#define SD_CONFIG_MAX_DEVICES 64
/* The GPU indices option `devices` lists, in order, into out[0..max): their count (0 where it is
 * empty: local rank i takes GPU i mod the GPUs seen), or SD_ECONFIG with err filled (not a
 * list of indices, an index past 1023, more than max). Local rank i takes out[i mod count]. */
int sd_config_devices(const char *devices, int *out, int max, char *err, size_t errlen);
/* Print every option with its type, default and help. */
void sd_config_print_help(FILE *out);
/* Value of one option as text. */
void sd_config_format(const struct sd_config *cfg, const struct sd_config_entry *e, char *buf,
                      size_t len);
/* Digest of the options that must agree across the cluster; *summary_p (may be NULL) receives
 * "name=value ..." of those options for error messages. */
uint64_t sd_config_digest(const struct sd_config *cfg, char *summary, size_t len);
/* Parse "123", "64KiB", "2MB", "1G" (binary multiples); returns 0 or SD_EINVAL. */
int sd_parse_size(const char *text, uint64_t *value_p);

#endif

#include "sd/config.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define OFF(field) offsetof(struct sd_config, field)

const struct sd_config_entry sd_config_table[] = {
    {"runtime_dir", SD_CFG_STRING, "/run/shardd", 0, SD_PATH_MAX, OFF(runtime_dir),
     "directory for the client socket (created 0700; socket 0660)", 0},
    {"node", SD_CFG_INT, "-1", -1, 1023, OFF(node),
     "index of this node in the cluster (-1: 0 in a fixed cluster; in an open one, the "
     "coordinator assigns it, and node 0 is the coordinator)",
     0},
    {"nodes", SD_CFG_INT, "1", 0, 1024, OFF(nodes),
     "number of nodes (daemons) in a static cluster with a coordinator; 1 (the default): an "
     "independent daemon, which knows only itself and meets the daemons of each job that spans "
     "nodes through the job's leader; 0: an open cluster, which daemons join and leave at any "
     "time through the coordinator (up to 1024)",
     1},
    {"ranks_per_node", SD_CFG_INT, "0", 0, 1024, OFF(ranks_per_node),
     "trainer ranks (devices) per node; 0 takes it from each job (one node only)", 1},
    {"package_size", SD_CFG_INT, "1", 1, 1024, OFF(package_size),
     "ranks that share a package, the topology level below the node (2 for the GCDs of an "
     "MI250X); it must divide the ranks per node, and plans' shard factors align with it",
     1},
    {"backend", SD_CFG_STRING, "host", 0, 24, OFF(backend),
     "device backend for shard buffers: host; host-deferred (kernels run only when the "
     "daemon waits for them: a test of its waits); emu (the GPU kernels' source run on the "
     "host); emu-device (the same, through the daemon's device paths); emu-gpu (the same, its "
     "memory out of the host's reach as a GPU's is; as many GPUs as $SHARDD_EMU_GPUS says, "
     "1 to 8, without peer access where $SHARDD_EMU_PEERS is none, each of "
     "$SHARDD_EMU_GPU_BYTES where set); emu-gpu-deferred (emu-gpu "
     "whose queue "
     "answers each new ticket's first query \"not yet\", as a busy GPU's, every ticket for "
     "$SHARDD_EMU_LAG_MS where set: a test of the daemon's polled waits on device memory); cuda "
     "and hip when "
     "built with them (shardd --help lists those built in)",
     1},
    {"devices", SD_CFG_STRING, "", 0, 128, OFF(devices),
     "the GPUs the device backend drives, by the driver's index (CUDA_VISIBLE_DEVICES "
     "applies): a list of indices, local rank i taking entry i mod the list's length "
     "(\"0,1,2,3\"; \"3\": every rank on GPU 3; \"0,0,1,1\": two ranks a GPU); empty: local "
     "rank i on GPU i mod the GPUs seen. One shardd drives them all: each rank's shards, staging "
     "and copy of "
     "the gathered weights on its GPU, copies between GPUs by peer access where the devices "
     "have it, else staged by the driver",
     1},
    {"memory_budget", SD_CFG_SIZE, "0", 0, INT64_MAX, OFF(memory_budget),
     "bytes all jobs together may allocate; 0 means half of physical memory", 0},
    {"op_timeout_ms", SD_CFG_INT, "30000", 1, 3600000, OFF(op_timeout_ms),
     "deadline for a collective operation to gather all ranks and peers", 1},
    {"register_timeout_ms", SD_CFG_INT, "60000", 1, 3600000, OFF(register_timeout_ms),
     "deadline for all ranks of a job to register", 0},
    {"resume_timeout_ms", SD_CFG_INT, "0", 0, 86400000, OFF(resume_timeout_ms),
     "how long a job whose rank died stays paused, its state kept, for its ranks to register "
     "again and resume from the last completed step (0: a dead rank ends the job); a job can "
     "set its own at registration",
     1},
    {"max_resume_timeout_ms", SD_CFG_INT, "86400000", 0, 604800000, OFF(max_resume_timeout_ms),
     "the longest resume timeout a job may ask for at registration (its state is kept that "
     "long after a rank dies); a longer one is refused",
     0},
    {"paused_bytes_per_uid", SD_CFG_SIZE, "0", 0, INT64_MAX, OFF(paused_bytes_per_uid),
     "memory the paused (or kept) jobs of one uid may hold together; a job that would pass it "
     "fails instead of pausing (0: half the memory budget)",
     0},
    {"checkpoint_threads", SD_CFG_INT, "4", 1, 64, OFF(checkpoint_threads),
     "threads of the file pool that one save's or load's data files take at once (its own and "
     "idle ones that help it, within its user's half of the pool), each with a 4 MiB buffer",
     0},
    {"checkpoint_workers", SD_CFG_INT, "8", 1, 64, OFF(checkpoint_workers),
     "threads of the file pool, where all of the jobs' checkpoint file work runs (each save, "
     "load or commit one at a time, with the rights of the job's owner, idle ones helping); a "
     "user has at most half of them, so one stuck in a filesystem leaves the others to "
     "everyone else",
     0},
    {"checkpoint_direct", SD_CFG_INT, "1", 0, 1, OFF(checkpoint_direct),
     "1: write and read checkpoint data files with O_DIRECT where the filesystem takes it (the "
     "disk moves the daemon's buffers, nothing goes through the page cache); 0: buffered",
     0},
    {"log_level", SD_CFG_STRING, "info", 0, 16, OFF(log_level), "error, warn, info, debug or trace",
     0},
    {"metrics_listen", SD_CFG_STRING, "", 0, 80, OFF(metrics_listen),
     "numeric address:port where GET /metrics answers in Prometheus' text format and GET "
     "/healthz says ok (\"127.0.0.1:9464\" for a scraper on the node, \"0.0.0.0:9464\" for "
     "one across the network, \"[::1]:9464\"; port 0: any free one, shown by shardctl "
     "status); empty (the default): no endpoint. It answers without authentication and names "
     "every job, so it is off unless an operator opens it",
     0},
    {"metrics_job_grace_s", SD_CFG_INT, "300", 0, 86400, OFF(metrics_job_grace_s),
     "seconds a finished job's series stay in the metrics after it ended (a scrape or two sees "
     "its last counts), so that the endpoint's size is bounded by the jobs served",
     0},
    {"trace_ops", SD_CFG_INT, "1024", 0, 1 << 20, OFF(trace_ops),
     "operations each job's flight recorder keeps on this node (its ranks' calls and its "
     "transfers with other nodes, with their states and times), dumped when the job fails and "
     "shown by shardctl trace; 0: off",
     0},
    {"max_clients", SD_CFG_INT, "256", 1, 65536, OFF(max_clients),
     "connections accepted at once (clients and shardctl)", 0},
    {"max_message_bytes", SD_CFG_SIZE, "16MiB", 4096, 1LL << 30, OFF(max_message_bytes),
     "largest control message accepted on the socket", 0},
    {"poll_spin_us", SD_CFG_INT, "200", 0, 1000000, OFF(poll_spin_us),
     "microseconds the daemon keeps polling client rings after the last request before sleeping",
     0},
    {"staging_slots", SD_CFG_INT, "4", 1, 64, OFF(staging_slots),
     "gradient staging slots per client, each the size of the largest unit", 0},
    {"push_rounds", SD_CFG_INT, "2", 1, 4, OFF(push_rounds),
     "gradient reductions across nodes a job keeps on the wire at once, each with buffers the "
     "size of the largest unit",
     0},
    {"max_live_bytes", SD_CFG_SIZE, "0", 0, INT64_MAX, OFF(max_live_bytes),
     "gather pool size per job; 0 sizes it to hold every unit at once", 0},
    {"prefetch_depth", SD_CFG_INT, "2", 0, 1024, OFF(prefetch_depth),
     "gathers issued ahead of the trainers once a job's schedule is frozen (0: on demand)", 0},
    {"prefetch_bytes", SD_CFG_SIZE, "256MiB", 0, INT64_MAX, OFF(prefetch_bytes),
     "bytes of gathers issued ahead at most (the nearest always goes; 0: no limit)", 0},
    {"reuse_distance", SD_CFG_INT, "2", 0, 1 << 30, OFF(reuse_distance),
     "a unit fetched again within this many calls after its release stays gathered", 0},
    {"persist_bytes", SD_CFG_SIZE, "64KiB", 0, INT64_MAX, OFF(persist_bytes),
     "units smaller than this stay gathered for the whole job once the schedule is frozen", 0},
    {"schedule_max_ops", SD_CFG_INT, "0", 0, 1 << 24, OFF(schedule_max_ops),
     "fetch/release/push calls per rank and step that are recorded at most (0: 64 per unit + "
     "256); a longer step runs on demand",
     0},
    {"max_jobs", SD_CFG_INT, "64", 1, 4096, OFF(max_jobs), "jobs served at once", 0},
    {"max_jobs_per_uid", SD_CFG_INT, "16", 1, 4096, OFF(max_jobs_per_uid),
     "jobs one uid may have served or registering at once; past it, that uid's oldest "
     "registration not complete yet is refused for its new one (else the new one is)",
     0},
    {"max_tensors", SD_CFG_INT, "65536", 1, 1 << 20, OFF(max_tensors),
     "tensors a registered model may have, at most", 0},
    {"max_units", SD_CFG_INT, "16384", 1, 16384, OFF(max_units),
     "fetch units a registered model may have, at most", 0},
    {"frame_timeout_ms", SD_CFG_INT, "10000", 100, 3600000, OFF(frame_timeout_ms),
     "a client that leaves a message on the socket incomplete this long is disconnected", 0},
    {"control_memory_bytes", SD_CFG_SIZE, "64MiB", 1 << 20, INT64_MAX, OFF(control_memory_bytes),
     "bytes of incomplete incoming messages and unsent replies of all connections together; "
     "the connection that would pass it is disconnected",
     0},
    {"conn_queue_bytes", SD_CFG_SIZE, "4MiB", 65536, 1LL << 30, OFF(conn_queue_bytes),
     "unsent replies one connection may have queued (a client that does not read them); past "
     "it the connection is closed",
     0},
    {"allowed_gid", SD_CFG_INT, "-1", -1, INT32_MAX, OFF(allowed_gid),
     "-1: any local user may connect (socket 0666, each sees only its own jobs); else only this "
     "group and root (socket 0660 with this group)",
     0},
    {"provider", SD_CFG_STRING, "tcp;ofi_rxm", 0, 64, OFF(provider),
     "libfabric provider between nodes: tcp;ofi_rxm, tcp, shm, efa, verbs;ofi_rxm, cxi (none: "
     "no fabric; an independent daemon then serves jobs on its own node only)",
     1},
    {"fabric_addr", SD_CFG_STRING, "127.0.0.1", 0, 64, OFF(fabric_addr),
     "local address of this node's fabric endpoint (empty: the provider's first)", 0},
    {"coordinator", SD_CFG_STRING, "127.0.0.1:7700", 0, 128, OFF(coordinator),
     "host:port where node 0 listens for the other daemons (control links, heartbeats)", 0},
    {"cluster_secret_file", SD_CFG_STRING, "/etc/shardd/cluster.key", 0, SD_PATH_MAX,
     OFF(cluster_secret_file),
     "the secret every daemon of the cluster holds (16..4096 bytes, owned and readable by the "
     "daemon's user only): peers prove it (HMAC) before they are heard; made when missing if "
     "the coordinator is a loopback address",
     0},
    {"heartbeat_interval_ms", SD_CFG_INT, "500", 10, 60000, OFF(heartbeat_interval_ms),
     "heartbeat period on the control links", 1},
    {"heartbeat_port", SD_CFG_INT, "0", 0, 65535, OFF(heartbeat_port),
     "UDP port of the heartbeat thread (0: any free one, announced to the peers); fix it where a "
     "firewall must let it through",
     0},
    {"peer_port", SD_CFG_INT, "0", 0, 65535, OFF(peer_port),
     "TCP port where a daemon accepts the control links of the daemons it shares a job with. "
     "A cluster's member: 0 is any free one, announced through the coordinator. An independent "
     "daemon (nodes 1) listens once a job spans nodes: 0 is 7701, where the ranks of the jobs it "
     "leads (rank 0's node) name it (SHARD_LEADER_PORT); fix it where a firewall must let it "
     "through",
     0},
    {"fabric_idle_close_ms", SD_CFG_INT, "10000", 0, 86400000, OFF(fabric_idle_close_ms),
     "an independent daemon (nodes 1) closes its fabric and peer links this long after its last "
     "job went, giving back the provider's buffers (ofi_rxm's: about 280 MB on tcp); the next "
     "job across nodes opens them again (0: kept open)",
     0},
    {"heartbeat_timeout_ms", SD_CFG_INT, "5000", 50, 600000, OFF(heartbeat_timeout_ms),
     "a peer silent this long is declared down and its jobs fail", 1},
    {"rendezvous_timeout_ms", SD_CFG_INT, "60000", 100, 3600000, OFF(rendezvous_timeout_ms),
     "deadline for every node to join the cluster at start-up", 0},
    {"chunk_bytes", SD_CFG_SIZE, "256KiB", 4096, 1LL << 30, OFF(chunk_bytes),
     "large transfers are split into chunks of this size and pipelined", 1},
    {"coalesce_bytes", SD_CFG_SIZE, "1MiB", 0, 1LL << 30, OFF(coalesce_bytes),
     "consecutive units smaller than this whose gathers the frozen schedule issues together "
     "travel as one transfer per peer, up to this many bytes (0: never)",
     0},
    {"quant_min_bytes", SD_CFG_SIZE, "16KiB", 0, 1LL << 30, OFF(quant_min_bytes),
     "plan option qg: a unit whose block of the reduce-scatter across nodes (fp32) is smaller "
     "than this is reduced exactly (quantizing costs more than it saves there); counted as a "
     "fallback",
     1},
    {"small_allreduce_bytes", SD_CFG_SIZE, "64KiB", 0, 1LL << 30, OFF(small_allreduce_bytes),
     "all-reduces up to this size use the latency-bound direct algorithm instead of the ring", 1},
    {"net_spin", SD_CFG_INT, "0", 0, 1, OFF(net_spin),
     "1: busy-poll the fabric while transfers are in flight (cores to spare); 0: see net_poll_us",
     0},
    {"net_poll_us", SD_CFG_INT, "0", 0, 1000000, OFF(net_poll_us),
     "microseconds the daemon keeps polling the fabric (yielding the core) after the last "
     "completion while transfers are in flight, before it sleeps on the completion queue's wait "
     "fd (re-polled every millisecond)",
     0},
    {"rendezvous_bytes", SD_CFG_SIZE, "0", 0, 1LL << 30, OFF(rendezvous_bytes),
     "messages between daemons larger than this are sent only after their receiver said the "
     "receive is posted (one 16-byte clear-to-send each), so none arrives unexpected (0: off; "
     "shm_cma 0 turns it on at the provider's inject size)",
     1},
    {"shm_cma", SD_CFG_INT, "1", 0, 1, OFF(shm_cma),
     "shm provider: 1 moves large messages with one process_vm_readv copy (CMA); 0 with two "
     "copies through shared bounce buffers (FI_SHM_DISABLE_CMA=1), faster where "
     "process_vm_readv is slow",
     1},
    {"queue_depth", SD_CFG_INT, "0", 0, 65536, OFF(queue_depth),
     "sends and receives posted to each fabric endpoint at once, at most: 0 (the provider's "
     "queue sizes) or 128 and more; the rest wait in the daemon's queue. 64 standing pull-request "
     "receives take half of the control endpoint's, and with rendezvous half of the "
     "clear-to-send endpoint's are standing receives",
     1},
    {"data_lanes", SD_CFG_INT, "1", 1, SD_MAX_DATA_LANES, OFF(data_lanes),
     "pairs of fabric endpoints that carry bulk data between two daemons: a transfer's chunks "
     "are spread over them, each a stream of its own in the provider (shm moves one segmented "
     "message at a time per pair of endpoints; tcp;ofi_rxm opens a connection per pair)",
     1},
};
const unsigned sd_config_table_len = SD_ARRAY_SIZE(sd_config_table);

int sd_parse_size(const char *text, uint64_t *value_p)
{
    char *end;
    errno = 0;
    if (text == NULL || !isdigit((unsigned char)text[0]))
        return SD_EINVAL;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno != 0)
        return SD_EINVAL;
    uint64_t mult = 1;
    if (*end != '\0') {
        switch (toupper((unsigned char)*end)) {
        case 'K':
            mult = 1ULL << 10;
            break;
        case 'M':
            mult = 1ULL << 20;
            break;
        case 'G':
            mult = 1ULL << 30;
            break;
        case 'T':
            mult = 1ULL << 40;
            break;
        default:
            return SD_EINVAL;
        }
        end++;
        if (strcmp(end, "") != 0 && strcasecmp(end, "B") != 0 && strcasecmp(end, "iB") != 0)
            return SD_EINVAL;
    }
    if (v > UINT64_MAX / mult)
        return SD_EINVAL;
    *value_p = v * mult;
    return SD_OK;
}

static const struct sd_config_entry *find_entry(const char *name)
{
    for (unsigned i = 0; i < sd_config_table_len; i++)
        if (strcmp(sd_config_table[i].name, name) == 0)
            return &sd_config_table[i];
    return NULL;
}

static int check_string(const struct sd_config_entry *e, const char *value, char *err,
                        size_t errlen)
{
    if (strcmp(e->name, "log_level") == 0 && sd_log_level_parse(value) < 0) {
        snprintf(err, errlen, "option '%s': '%s' is not one of error, warn, info, debug, trace",
                 e->name, value);
        return SD_ECONFIG;
    }
    int devs[SD_CONFIG_MAX_DEVICES];
    if (strcmp(e->name, "devices") == 0 &&
        sd_config_devices(value, devs, SD_CONFIG_MAX_DEVICES, err, errlen) < 0)
        return SD_ECONFIG;
    if (strcmp(e->name, "backend") == 0 && strcmp(value, "host") != 0 &&
        strcmp(value, "host-deferred") != 0 && strcmp(value, "emu") != 0 &&
        strcmp(value, "emu-device") != 0 && strcmp(value, "emu-gpu") != 0 &&
        strcmp(value, "emu-gpu-deferred") != 0 && strcmp(value, "cuda") != 0 &&
        strcmp(value, "hip") != 0) {
        snprintf(err, errlen,
                 "option '%s': '%s' is not one of host, host-deferred, emu, emu-device, emu-gpu, "
                 "emu-gpu-deferred, cuda, hip",
                 e->name, value);
        return SD_ECONFIG;
    }
    return SD_OK;
}

int sd_config_devices(const char *devices, int *out, int max, char *err, size_t errlen)
{
    const char *p = devices;
    int n = 0;
    if (p[0] == '\0')
        return 0;
    for (;;) {
        char *end;
        if (!isdigit((unsigned char)*p)) {
            snprintf(err, errlen, "option 'devices': '%s' is not a list of GPU indices", devices);
            return SD_ECONFIG;
        }
        long d = strtol(p, &end, 10);
        if (d > 1023) {
            snprintf(err, errlen, "option 'devices': GPU %ld is past 1023", d);
            return SD_ECONFIG;
        }
        if (n == max) {
            snprintf(err, errlen, "option 'devices': '%s' lists more than %d GPUs", devices, max);
            return SD_ECONFIG;
        }
        out[n++] = (int)d;
        if (*end == '\0')
            return n;
        if (*end != ',') {
            snprintf(err, errlen, "option 'devices': '%s' is not a list of GPU indices", devices);
            return SD_ECONFIG;
        }
        p = end + 1;
    }
}

int sd_config_set(struct sd_config *cfg, const char *name, const char *value, char *err,
                  size_t errlen)
{
    const struct sd_config_entry *e = find_entry(name);
    char *base = (char *)cfg;
    if (e == NULL) {
        snprintf(err, errlen, "unknown option '%s' (shardd --help lists them)", name);
        return SD_ECONFIG;
    }
    switch (e->type) {
    case SD_CFG_STRING:
        if (strlen(value) >= (size_t)e->max) {
            snprintf(err, errlen, "option '%s': value '%.40s...' is longer than %lld bytes", name,
                     value, (long long)e->max - 1);
            return SD_ECONFIG;
        }
        if (check_string(e, value, err, errlen) != SD_OK)
            return SD_ECONFIG;
        memcpy(base + e->offset, value, strlen(value) + 1);
        return SD_OK;
    case SD_CFG_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(value, &end, 0);
        if (errno != 0 || end == value || *end != '\0' || v < e->min || v > e->max) {
            snprintf(err, errlen, "option '%s': expected an integer in [%lld, %lld], got '%s'",
                     name, (long long)e->min, (long long)e->max, value);
            return SD_ECONFIG;
        }
        *(int64_t *)(void *)(base + e->offset) = v;
        return SD_OK;
    }
    case SD_CFG_SIZE: {
        uint64_t v;
        if (sd_parse_size(value, &v) != SD_OK || v < (uint64_t)e->min || v > (uint64_t)e->max) {
            snprintf(err, errlen,
                     "option '%s': expected a size such as 4096, 64KiB or 2GiB in [%lld, %lld], "
                     "got '%s'",
                     name, (long long)e->min, (long long)e->max, value);
            return SD_ECONFIG;
        }
        *(uint64_t *)(void *)(base + e->offset) = v;
        return SD_OK;
    }
    }
    return SD_ECONFIG;
}

void sd_config_defaults(struct sd_config *cfg)
{
    char err[256];
    memset(cfg, 0, sizeof(*cfg));
    for (unsigned i = 0; i < sd_config_table_len; i++) {
        int status = sd_config_set(cfg, sd_config_table[i].name, sd_config_table[i].defval, err,
                                   sizeof(err));
        (void)status;
    }
}

int sd_config_load_file(struct sd_config *cfg, const char *path, char *err, size_t errlen)
{
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL) {
        snprintf(err, errlen, "config %s: line %d column %d: %s", path, jerr.line, jerr.column,
                 jerr.text);
        return SD_ECONFIG;
    }
    int status = SD_OK;
    if (!json_is_object(root)) {
        snprintf(err, errlen, "config %s: the top level must be a JSON object", path);
        status = SD_ECONFIG;
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        char text[SD_PATH_MAX + 32], msg[512];
        if (json_is_string(val)) {
            snprintf(text, sizeof(text), "%s", json_string_value(val));
        } else if (json_is_integer(val)) {
            snprintf(text, sizeof(text), "%" JSON_INTEGER_FORMAT, json_integer_value(val));
        } else {
            char *dump = json_dumps(val, JSON_ENCODE_ANY | JSON_COMPACT);
            snprintf(err, errlen, "config %s: option '%s': expected a string or integer, got %s",
                     path, key, dump ? dump : "?");
            free(dump);
            status = SD_ECONFIG;
            goto out;
        }
        status = sd_config_set(cfg, key, text, msg, sizeof(msg));
        if (status != SD_OK) {
            snprintf(err, errlen, "config %s: %s", path, msg);
            goto out;
        }
    }
out:
    json_decref(root);
    return status;
}

void sd_config_format(const struct sd_config *cfg, const struct sd_config_entry *e, char *buf,
                      size_t len)
{
    const char *base = (const char *)cfg;
    switch (e->type) {
    case SD_CFG_STRING:
        snprintf(buf, len, "%s", base + e->offset);
        break;
    case SD_CFG_INT:
        snprintf(buf, len, "%" PRId64, *(const int64_t *)(const void *)(base + e->offset));
        break;
    case SD_CFG_SIZE:
        snprintf(buf, len, "%" PRIu64, *(const uint64_t *)(const void *)(base + e->offset));
        break;
    }
}

uint64_t sd_config_digest(const struct sd_config *cfg, char *summary, size_t len)
{
    uint64_t h = SD_FNV_SEED;
    size_t off = 0;
    char buf[SD_PATH_MAX + 32];
    if (summary != NULL && len > 0)
        summary[0] = '\0';
    for (unsigned i = 0; i < sd_config_table_len; i++) {
        const struct sd_config_entry *e = &sd_config_table[i];
        if (!e->cluster)
            continue;
        sd_config_format(cfg, e, buf, sizeof(buf));
        h = sd_hash_str(sd_hash_str(h, e->name), buf);
        if (summary != NULL && off < len)
            off +=
                (size_t)snprintf(summary + off, len - off, "%s%s=%s", off ? " " : "", e->name, buf);
    }
    return h;
}

void sd_config_print_help(FILE *out)
{
    static const char *const type_names[] = {"string", "int", "size"};
    fprintf(out, "Options (JSON keys in --config FILE, or --NAME VALUE on the command line):\n");
    for (unsigned i = 0; i < sd_config_table_len; i++) {
        const struct sd_config_entry *e = &sd_config_table[i];
        fprintf(out, "  %-20s %-6s default %-12s %s\n", e->name, type_names[e->type], e->defval,
                e->help);
    }
}

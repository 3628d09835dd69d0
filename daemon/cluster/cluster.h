/* The control plane between the daemons of a cluster (DESIGN.md section 6): TCP links driven by
 * the libuv loop, node 0 the coordinator, and a direct link between two members while a job
 * spans both (its messages and heartbeats: a job between members outlives the coordinator).
 * Rendezvous (hello with node, version, config digest and fabric address; the address table once
 * every node is present), heartbeats, and the messages that keep jobs consistent across nodes:
 * report/confirm/refuse of a registration, abort, ready. A job runs on any of the cluster's nodes:
 * its nodes are numbered by its ranks (job node i serves ranks i * k .. i * k + k - 1), and the
 * coordinator's confirmation maps them to the cluster's. Messages about a job name cluster nodes;
 * the job's node list goes with them. */
#ifndef SD_CLUSTER_H
#define SD_CLUSTER_H

#include "sd/config.h"
#include "transport/transport.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

/* where an independent daemon that leads a job takes its peers' links when peer_port is 0 (the
 * port its ranks name with the leader's host: libshard's SHARD_LEADER_PORT) */
#define SD_MEET_PORT 7701

struct sd_cluster;
struct Shard__JobSaved;
struct Shard__JobRecover;

/* What the cluster tells this node about jobs, and asks of it. The cluster knows jobs only by
 * their names and transport tags; the daemon's jobs implement these (sd_jobs_cluster_events). */
struct sd_cluster_events {
    void *ctx;
    /* the coordinator's decision on a registration: nodes[i] is the cluster node of job node i */
    void (*job_confirmed)(void *ctx, const char *job, uint32_t tag, const uint32_t *nodes,
                          uint32_t n);
    void (*job_refused)(void *ctx, const char *job, int status, const char *msg);
    /* the job failed (or paused, status SD_EPAUSED) on another node; tag: its transport tag (0:
     * not known), step: the steps it had taken there */
    void (*job_aborted)(void *ctx, const char *job, uint32_t tag, int status, uint64_t step,
                        const char *msg);
    /* the job's node 0's rank 0 loaded the initial values */
    void (*job_remote_ready)(void *ctx, const char *job);
    /* every node's ranks left the job */
    void (*job_ended)(void *ctx, const char *job);
    /* the job's node 0: a node wrote its part of a save; the others: node 0 committed it (or
     * not) */
    void (*job_saved)(void *ctx, const struct Shard__JobSaved *m);
    void (*job_save_done)(void *ctx, const char *job, uint64_t seq, int status, const char *msg);
    /* the job's node 0 asks for this node's part of a recovery (shardctl checkpoint --job) */
    void (*job_recover)(void *ctx, const struct Shard__JobRecover *m);
    void (*node_down)(void *ctx, uint32_t node, const char *reason);
    /* the address table is installed: the standing receives can be posted */
    int (*formed)(void *ctx);
    /* a transport tag a job of this node still uses (active or retiring) */
    bool (*tag_in_use)(void *ctx, uint32_t tag);
    /* the tags of this node's jobs still in use, at most cap of them into tags: how many */
    uint32_t (*tags_in_use)(void *ctx, uint32_t *tags, uint32_t cap);
    /* need[id] set for every cluster node id < n that a job on this node spans (it needs a
     * control link to it); the others left as they are */
    void (*nodes_in_use)(void *ctx, bool *need, uint32_t n);
    /* the job of that name on this node (of that transport tag; 0: any) spans cluster node
     * node: may node's direct link speak of it? */
    bool (*job_spans)(void *ctx, const char *job, uint32_t tag, uint32_t node);
    /* an independent daemon: the token of the job of that name here (false: none has one) */
    bool (*job_token)(void *ctx, const char *job, uint8_t token[32]);
    /* an independent daemon: a confirmed job here that spans node (NULL: none) */
    const char *(*job_spanning)(void *ctx, uint32_t node);
};

/* On failure *cl_p may be set too (handles half made): sd_cluster_stop, run the loop, then
 * sd_cluster_free, as after a success. */
int sd_cluster_start(struct sd_cluster **cl_p, uv_loop_t *loop, const struct sd_config *cfg,
                     struct sd_transport *tp, const struct sd_cluster_events *ev);
void sd_cluster_stop(struct sd_cluster *cl);
/* free once the loop has run the close callbacks of its handles */
void sd_cluster_free(struct sd_cluster *cl);
bool sd_cluster_ready(const struct sd_cluster *cl);
/* Set when the cluster cannot form (refused, rendezvous deadline): the daemon must exit. */
bool sd_cluster_fatal(const struct sd_cluster *cl);
bool sd_cluster_alive(const struct sd_cluster *cl, uint32_t node);
/* node is alive and its data path works (the probe of the last address table came back):
 * jobs that span it may start */
bool sd_cluster_usable(const struct sd_cluster *cl, uint32_t node);
uint32_t sd_cluster_nodes(const struct sd_cluster *cl);
/* this daemon's cluster node (0 without a cluster) */
uint32_t sd_cluster_self(const struct sd_cluster *cl);
/* a daemon without a cluster list (nodes 1) that meets the daemons of each job it serves */
bool sd_cluster_independent(const struct sd_cluster *cl);
/* what the attach reply and shardctl say: the cluster's node and node count (an independent
 * daemon: node 0 of 1, its own; shardctl topology lists the daemons it met) */
uint32_t sd_cluster_shown_node(const struct sd_cluster *cl);
uint32_t sd_cluster_shown_nodes(const struct sd_cluster *cl);
/* node as messages name it: "cluster node N", or an independent daemon's "daemon ID at
 * IP:PORT" (its numbers are its own) */
const char *sd_cluster_node_name(const struct sd_cluster *cl, uint32_t node, char *buf, size_t len);
/* An independent daemon serving a node other than job's leader's: what went wrong reaching
 * its leader (into buf), or NULL when nothing did */
const char *sd_cluster_leader_trouble(const struct sd_cluster *cl, const char *job, char *buf,
                                      size_t len);
/* an independent daemon: the id of the daemon it numbers node (its own for itself; 0: none) */
uint32_t sd_cluster_daemon_id(const struct sd_cluster *cl, uint32_t node);

/* A job finished registering on this node (status 0) or failed to. The coordinator confirms it
 * once every node reported the same model, world and start: the step it starts from, and
 * whether it resumes a paused job. */
struct sd_job_report {
    const char *job;
    uint64_t digest;
    uint32_t world, ranks_per_node;
    uint32_t job_node; /* the job's node this one is: its ranks' rank / ranks_per_node */
    uint64_t start_step;
    bool resumed;
    const uint8_t *token; /* its ranks' job token (token_len bytes; 0: none) */
    uint32_t token_len;
    /* an independent daemon: its leader's "ip:port" (its ranks' Register.leader) */
    const char *leader;
    int status;
    const char *msg;
};
void sd_cluster_report_job(struct sd_cluster *cl, const struct sd_job_report *r);
/* Tell every node of the job that it failed (or paused: status SD_EPAUSED) here, after step
 * steps; tag: the job's transport tag; node_ids: its nodes' cluster nodes (NULL before the
 * confirmation: the nodes that reported it are told). */
struct sd_job_abort {
    const char *job;
    const uint32_t *node_ids;
    uint32_t nodes, tag;
    uint64_t step;
    int status;
    const char *msg;
};
void sd_cluster_abort_job(struct sd_cluster *cl, const struct sd_job_abort *a);
/* The job's node 0: rank 0 finished loading the initial values; tell its other nodes (ids: the
 * job's cluster nodes, n of them). */
void sd_cluster_job_ready(struct sd_cluster *cl, const char *job, const uint32_t *ids, uint32_t n);
/* A member wrote its part of a save: tell the job's node 0 (cluster node to). */
void sd_cluster_job_saved(struct sd_cluster *cl, uint32_t to, const struct Shard__JobSaved *m);
/* The job's node 0: the save is committed (status 0) or given up; tell the job's other nodes. */
void sd_cluster_job_save_done(struct sd_cluster *cl, const char *job, const uint32_t *ids,
                              uint32_t n, uint64_t seq, int status, const char *msg);
/* The job's node 0: ask cluster node node for its part of a recovery. */
void sd_cluster_job_recover(struct sd_cluster *cl, uint32_t node,
                            const struct Shard__JobRecover *m);
/* Every local rank of the job left this node: the job ends once all its nodes said so. Returns
 * false when no coordination is possible (the coordinator is down): end it locally. */
bool sd_cluster_job_left(struct sd_cluster *cl, const char *job, const uint32_t *ids, uint32_t n);
/* Node states for shardctl topology; all: the caller is root, who sees the other daemons' ids
 * and addresses (anyone else, their number and state only). */
json_t *sd_cluster_json(const struct sd_cluster *cl, bool all);
/* The control links for shardctl stats: counts of refused and evicted connections, and each
 * link's buffered bytes (its address: root's to see) */
json_t *sd_cluster_stats_json(const struct sd_cluster *cl, bool all);
/* The control plane's counts, as the metrics show them (all 0 without a cluster). */
struct sd_cluster_counts {
    uint32_t peers, peers_up;     /* the other daemons in the table, and those up */
    uint32_t links, links_proved; /* control links open, and those whose end proved itself */
    uint64_t refused, evicted;    /* connections that proved nothing, and those evicted */
    uint64_t closed_full;         /* links closed for what they left buffered */
    uint64_t outbox_bytes;        /* messages waiting for a link */
    uint64_t hb_sent, hb_received, hb_dropped; /* heartbeat datagrams */
};
void sd_cluster_counts(const struct sd_cluster *cl, struct sd_cluster_counts *out);
/* The heartbeat thread's datagrams: sent, received, dropped (unknown sender, magic or digest). */
json_t *sd_cluster_heartbeat_json(const struct sd_cluster *cl);

#endif

/* Test harness: real shardd processes, real clients, deadlines on everything. */
#ifndef TH_HARNESS_H
#define TH_HARNESS_H

#include "check.h"
#include "shard.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

struct json_t;

struct th_daemon {
    pid_t pid;
    char dir[256];  /* test directory (removed by th_daemon_stop when the test passed) */
    char sock[320]; /* client socket */
    char log[320];
};

#define TH_MAX_NODES 8
struct th_cluster {
    int nodes, k, port;
    bool open;  /* an open cluster (nodes 0): the daemons get no index, node 0 is the coordinator */
    bool netns; /* node i's daemon in a network namespace of its own, ns[i], at address addr[i] */
    /* independent daemons (nodes 1): no cluster arguments at all (on loopback each its own
     * peer_port, port + i; in namespaces the default 7701) */
    bool indep;
    char base[64]; /* the cluster's directory; node i's is base/node<i> */
    struct th_daemon d[TH_MAX_NODES];
    char ns[TH_MAX_NODES][32], addr[TH_MAX_NODES][20], veth[TH_MAX_NODES][16], bridge[16];
};
/* Start `nodes` daemons on loopback (k ranks each) with extra arguments for every one. */
int th_cluster_start(struct th_cluster *c, int nodes, int k, const char *const *extra);
/* Stop every daemon still running and, when they all exited cleanly and no check failed, remove
 * the cluster's directory (a killed node's log included); returns the number that did not exit
 * cleanly. */
int th_cluster_stop(struct th_cluster *c);
/* Start an open cluster of `nodes` daemons on loopback (--nodes 0, no ranks per node: jobs give
 * theirs), one after the other: node i is the i-th to join, which the coordinator numbers i. */
int th_open_cluster_start(struct th_cluster *c, int nodes, const char *const *extra);
/* The same, each daemon in a network namespace of its own (ip netns exec), its veth on a private
 * bridge: every byte between nodes crosses a network device, not loopback. The trainers reach
 * the daemons' sockets from here. TH_NO_NETNS (77) when namespaces cannot be made (not root, no
 * iproute2); th_cluster_stop removes them (and so does the exit of a test that stopped early). */
#define TH_NO_NETNS 77
int th_netns_cluster_start(struct th_cluster *c, int nodes, const char *const *extra);
/* Start `nodes` independent daemons, each knowing only itself, in network namespaces
 * (netns true; TH_NO_NETNS when they cannot be made) or on loopback. */
int th_indep_cluster_start(struct th_cluster *c, int nodes, bool netns, const char *const *extra);
/* where node i of an independent cluster leads a job: "ip:port" into buf */
const char *th_cluster_leader(const struct th_cluster *c, int i, char *buf, size_t len);
/* The bytes node i of a netns cluster sent onto its link so far (its veth's, frames' headers
 * included), or -1 (not a netns cluster, or unreadable). */
long long th_node_wire_sent(const struct th_cluster *c, int i);
/* shardctl --json --socket sock checkpoint --job job dir (its output in outdir): its exit code,
 * its answer parsed into *doc_p (NULL when not JSON) */
int th_checkpoint_job(const char *outdir, const char *sock, const char *job, const char *dir,
                      struct json_t **doc_p);
/* Register rank of job (world, ranks_per_node; one fp32 tensor of 1536, zero3, sgd) at the
 * daemon at sock and detach: the status, the daemon's message in err. $TH_JOB_SECRET (16 bytes
 * or more): the job's secret. */
int th_register_one(const char *sock, const char *job, uint32_t rank, uint32_t world,
                    uint32_t ranks_per_node, char *err, size_t errlen);
/* The same for rank of job (world, one rank per node) with the job's secret and its leader
 * ("ip:port"; NULL: none named): the status, the daemon's message in err. */
int th_register_secret(const char *sock, const char *job, uint32_t rank, uint32_t world,
                       const char *secret, const char *leader, char *err, size_t errlen);
/* An independent daemon's id (shardctl topology, as root; 0: none shown) */
uint32_t th_daemon_id(const char *sock);
/* Is every daemon of c running? A check fails naming each one that is not (a crash), so a test
 * can stop there instead of each later job waiting out its registration deadline for it. */
bool th_cluster_alive(const struct th_cluster *c, const char *what);
/* Start node i of c again (after it was killed) with the cluster's arguments and extra: it
 * rejoins the cluster. Its earlier log is kept as <log>.before-restart. */
int th_cluster_node_restart(struct th_cluster *c, int i, const char *const *extra);

/* The binaries the tests run: the build's (SHARDD_PATH, MLP_TRAIN_PATH), or the copies
 * th_binaries_reachable made. */
const char *th_shardd_path(void);
const char *th_mlp_train_path(void);
/* Tests that run daemons or trainers as other users: a clone in a directory those users cannot
 * enter (root's home, mode 0700) holds binaries they cannot execute, so copy shardd, mlp_train
 * and libshard (mode 0755) into dir (made, mode 0755), which they reach, run those from now on,
 * and put dir first on LD_LIBRARY_PATH (for the processes this one starts). 0, or -1 (a check
 * failed, naming what). */
int th_binaries_reachable(const char *dir);

/* Start shardd with extra "--key", "value" arguments (NULL-terminated list, may be NULL). */
int th_daemon_start(struct th_daemon *d, const char *const *extra);
/* The same under the command wrap (setpriv --reuid=...: another user), in a directory owned
 * by owner. */
int th_daemon_start_as(struct th_daemon *d, const char *const *wrap, uid_t owner,
                       const char *const *extra);
/* SIGTERM and wait; returns the exit code (0: clean shutdown, no leaks), or -1 on timeout. */
int th_daemon_stop(struct th_daemon *d);
bool th_daemon_alive(const struct th_daemon *d);
/* Spawn argv with stdout+stderr to out_path (or inherited when NULL). */
pid_t th_spawn(const char *const *argv, const char *out_path);
/* Exit code; 128+signal if killed by a signal; -1 if it ran past timeout_ms (then killed). */
int th_wait(pid_t pid, int timeout_ms);
/* One admin command; returns the daemon's JSON (malloc'd) or NULL. */
char *th_admin(const char *sock, const char *cmd);
/* The same, parsed (jansson); NULL when the daemon did not answer or the document is not JSON. */
struct json_t *th_admin_json(const char *sock, const char *cmd);
/* The integer at a dotted path ("ops.fetch.bytes.inter_node_recv") of o, or -1. */
long long th_json_int(struct json_t *o, const char *path);
/* The job's entry of a daemon's stats document (a reference), or NULL. A job whose transfers
 * still run after its ranks left (serving the final dump's gather) is listed as retiring until
 * they finished: waits for that, 10 s at most, so that its byte counters are final. */
struct json_t *th_job_stats(const char *sock, const char *job);
/* Train with mlp_train: world ranks of job (rank r on socks[r / k]) and the one-process
 * --reference, each with args (NULL-terminated, the options they share); rank 0 dumps its
 * parameters into dump, the reference into ref; logs go to dir/job-<rank>.log (the
 * reference's rank is world). rcs[0..world] receive the exit codes; returns how many are not
 * 0. */
#define TH_MAX_RANKS 64
/* mlp_train as rank `rank` of job on the daemon at sock, with the options args and more (each
 * NULL-terminated, either may be NULL; 56 at most), its output into log */
pid_t th_spawn_rank(const char *sock, const char *job, int rank, const char *const *args,
                    const char *const *more, const char *log);
int th_train(const char *dir, const char *job, const char *const *socks, int k, int world,
             const char *const *args, const char *dump, const char *ref, int *rcs);
/* Two fp32 parameter dumps: n values, how many differ at all, how many lie outside
 * |a - b| <= tol + tol |b| (tol 0: bitwise), the largest difference. False if a file is missing,
 * empty, or the sizes differ. */
struct th_dump_diff {
    size_t n, differ, outside;
    double maxd;
    double rms; /* sqrt(mean (a - b)^2) */
};
bool th_compare_dumps(const char *a, const char *b, double tol, struct th_dump_diff *d);
/* th_train on cluster c (rank r on node r / c->k, nodes * k ranks; args carry the same --world),
 * logs and dumps in node 0's directory: checks every process exited 0 (what names the run in
 * the messages) and compares rank 0's parameters with the reference's within tol into *dd.
 * False when a process failed or the dumps cannot be compared. */
bool th_cluster_train(const struct th_cluster *c, const char *job, const char *const *args,
                      const char *what, double tol, struct th_dump_diff *dd);
/* The padded parameter count of job as the daemon at sock lists it (shardctl jobs), or -1. */
long long th_job_params(const char *sock, const char *job);
/* n tensors "t0", "t1", ... of 4 fp32 elements, 8 to a unit; with dup_last the last one is
 * named like the one before it. One allocation (names included): free() it. NULL if out of
 * memory. */
shard_tensor_t *th_many_tensors(uint32_t n, bool dup_last);

/* Read a whole file (malloc'd) or NULL. */
char *th_read_file(const char *path, size_t *len_p);
/* How many times text occurs in the file at path (0 when it cannot be read). */
int th_count_in_file(const char *path, const char *text);
double th_now_s(void);

#endif

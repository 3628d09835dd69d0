/* The cluster's private parts, shared by links.c (TCP links, rendezvous, heartbeats, the
 * address table) and coordinator.c (node 0's decisions about jobs). */
#ifndef SD_CLUSTER_INT_H
#define SD_CLUSTER_INT_H

#include "cluster/auth.h"
#include "cluster/cluster.h"
#include "cluster/heartbeat.h"
#include "cluster/meet_key.h"
#include "sd/frame.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include "shard.pb-c.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_PEER_MSG (1u << 20)
/* before a link proves the secret: its messages' size, how long it may take, how many wait */
#define MAX_HELLO_MSG (16u << 10)
#define SD_AUTH_MS    5000
/* Unproved connections (accepted, no hello that proved anything yet): at most this many, and
 * this many from one source address; past either, the oldest of the source holding the most
 * goes, so that a flood from one address evicts its own and never a peer's handshake. */
#define MAX_UNAUTHED            64
#define MAX_UNAUTHED_PER_SOURCE 8
/* An independent daemon's link: what it may buffer for the jobs proved on it that have not
 * registered here yet (messages and bytes), and what may wait to be written on it before the
 * other end is taken to read nothing (the link is closed, logged) */
#define MEET_WAIT_BYTES  (256u << 10)
#define LINK_WRITE_BYTES (32u << 20)
/* the connections one source address may hold once proved (each a daemon's link to this one:
 * one per daemon on that host, a replaced one closing) */
#define MAX_PROVED_PER_SOURCE 16
/* messages for one peer that may wait for a link to it (the oldest goes past that) */
#define OUTBOX_MAX 256
/* a member that lost the coordinator tries to reconnect this often */
#define SD_REJOIN_RETRY_MS 1000
/* a direct link between members that no job has needed this long goes */
#define SD_PEER_IDLE_MS 3000
#define SD_PEER_ADDR    64 /* "ip:port" of a member's peer listener */
/* the listeners' backlog: connections the kernel holds until the loop accepts them (a flood's
 * among them; the kernel caps it at net.core.somaxconn) */
#define SD_LISTEN_BACKLOG 4096

#define SD_NO_NODE UINT32_MAX

struct link {
    uv_tcp_t tcp;
    uv_connect_t conn; /* a member's link to a job peer: its connect */
    struct sd_cluster *cl;
    int node;      /* -1 until its hello (a link to a job peer: the peer's from the start) */
    bool authed;   /* the other end proved the cluster's secret (auth.h): it is heard */
    bool incoming; /* accepted here (its hello comes to this end) */
    bool peer;     /* between two members that share a job (not a link to the coordinator) */
    bool retired;  /* closed because no job needs it (or a newer one replaced it): no failure */
    uint8_t nonce_c[SD_AUTH_NONCE], nonce_m[SD_AUTH_NONCE]; /* the coordinator's, the member's */
    uint8_t hb_key[SD_SHA256_BYTES];                        /* the session's heartbeat key */
    uint64_t created_ns;
    char host[48]; /* the other end's IP address ("?": not known) */
    uint8_t *rx;
    size_t rx_len, rx_cap;
    uint64_t last_seen_ns;
    bool closing;
    bool stalled; /* more than LINK_WRITE_BYTES wait to be written: closed at the next tick */
    /* independent daemons (meet.c): the job whose token keyed the handshake, and the jobs the
     * other end and this one proved on the link since */
    char job[64];
    struct meet_proof *proved, *told;
    /* proofs of jobs not registered here yet, and the messages about them that came after */
    struct meet_wait *waiting;
    struct link *next;
};

/* A message for a member whose direct link is being opened (peers.c). */
struct outmsg {
    struct outmsg *next;
    uint32_t node;
    char job[64];      /* the job it is about ("": none): an independent link proves it first */
    uint64_t since_ns; /* an independent daemon's wait for a leader not there yet has an end */
    uint8_t *frame;
    size_t len;
};

/* Coordinator: registrations of a job reported by its nodes. */
struct coord_job {
    struct coord_job *next;
    char name[64];
    uint32_t nodes, reported;
    uint32_t *at; /* [nodes]: the cluster node that reported each job node (SD_NO_NODE: none) */
    uint64_t digest;
    uint32_t world, ranks_per_node;
    uint64_t start_step; /* the first report's (a resume's step, a checkpoint's) */
    bool resumed;
    uint32_t first; /* the cluster node that reported first */
    /* the job token its reports carry (token_len 0: none): reports of one name with different
     * tokens are registrations apart, and the first complete one is the job */
    uint8_t token[SD_JOB_TOKEN_BYTES];
    uint32_t token_len;
    int status;
    char msg[512];
    uint64_t deadline_ns;
    uint64_t refused0, evicted0; /* the daemon's counts of refused and evicted connections then */
    /* the transport tags its nodes' jobs use (JobReport.busy_tags): its own is another */
    uint8_t busy[(1u << SD_TAG_JOB_BITS) / 8];
};

/* Nodes whose ranks of a job all left: the coordinator's record of every job, a member's of
 * its own (which end there when all did, without the coordinator). */
struct coord_left {
    struct coord_left *next;
    char name[64];
    uint32_t nodes, left;
    uint32_t *at; /* [nodes]: the job's cluster nodes */
    uint8_t *seen;
};

/* Coordinator: a confirmed job's transport tag, in use until the job ends everywhere (it may run
 * on nodes without the coordinator: its own jobs are not all there is) */
struct coord_live {
    struct coord_live *next;
    char name[64];
    uint32_t tag;
    uint32_t nodes;
    uint32_t *at; /* [nodes]: its cluster nodes (once all are down, nothing will end it) */
    uint8_t token[SD_JOB_TOKEN_BYTES]; /* its job token (coord_job's) */
    uint32_t token_len;
};

struct sd_cluster {
    uv_loop_t *loop;
    const struct sd_config *cfg;
    struct sd_auth auth; /* the cluster's secret */
    struct {
        uint64_t refused;     /* connections that did not prove it (or a job's token) */
        uint64_t evicted;     /* unproved connections closed to admit others (sd_cluster__admit) */
        uint64_t closed_full; /* links closed for what they left buffered (MEET_WAIT_BYTES...) */
    } counts;
    struct sd_transport *tp;
    struct sd_cluster_events ev;
    /* nodes in the table (an open cluster's grows as daemons join), at most cap; self is
     * SD_NO_NODE in an open cluster's member until the coordinator numbered it */
    uint32_t n, cap, self;
    bool open; /* nodes 0: daemons join and leave through the coordinator, which numbers them */
    /* nodes 1: an independent daemon (meet.c), slot 1 of its own table, which fills as jobs
     * name their daemons (n is cap; slot 0 is never used) */
    bool indep;
    struct {
        uint32_t uid;           /* this daemon's id: its key's hash (meet_key.c), new each start */
        struct sd_meet_key key; /* its key pair */
        uint8_t (*key_of)[SD_MEET_KEY]; /* [cap]: each slot's daemon's key (0s: not known) */
        uint32_t *uid_of;               /* [cap]: the id of each slot's daemon (0: not known yet) */
        uint32_t *as;                   /* [cap]: the number each slot's daemon gives this one */
        uint32_t slots;                 /* slots in use up to (cap; fewer for a test) */
        struct meet_leader *leaders;    /* which slot leads each job registering here */
        struct meet_wire *wire;         /* scratch: a message with ids for slots */
    } meet;
    struct { /* this daemon's fabric address, heartbeat and peer ports, for its hello */
        uint8_t addr[256];
        size_t addr_len;
        uint32_t hb_port, peer_port;
    } me;
    bool ready, fatal, stopping;
    bool rejoining; /* member: lost the coordinator after the cluster formed; reconnecting */
    struct link *connecting;     /* member: the link whose connect is pending, or NULL */
    uint64_t connect_started_ns; /* when it began */
    uint64_t digest;
    char summary[1024];
    uint8_t (*addrs)[256];
    size_t *addr_len;
    bool *present, *alive;
    protobuf_c_boolean *down_scratch; /* [n]: the down flags of a table being installed */
    uint32_t *hb_port;                /* [n]: UDP heartbeat port of each node (0: none) */
    struct sd_heartbeat *hb;          /* the heartbeat thread (heartbeat.c) */
    struct sd_probe *probe;           /* the peers' data paths (probe.c) */
    /* coordinator: link of each node; member: [0] is the coordinator, [i] a job peer's */
    struct link **by_node;
    struct link *links;
    /* the coordinator's for every daemon, a member's for its job peers (loop set: listening) */
    uv_tcp_t listener;
    struct {
        char (*addrs)[SD_PEER_ADDR]; /* [cap]: each member's peer listener ("": none) */
        bool *dialing;               /* [cap]: a member's connect to that job peer is pending */
        uint64_t *idle_ns;     /* [cap]: since when no job needs the link to it (0: one does) */
        bool *need;            /* [cap]: scratch, the nodes this node's jobs span */
        struct outmsg *outbox; /* messages waiting for a direct link being opened */
        /* [cap]: dials to that daemon that failed since a link to it last came up, and how the
         * last one did (what a job waiting for its leader is told) */
        uint32_t *dial_fails;
        char (*dial_why)[256];
    } peers;
    uv_timer_t timer;
    uv_timer_t retry;
    uv_connect_t connect_req;
    uint64_t start_ns, hb_seq;
    struct {
        uint16_t next_tag;
        struct coord_job *jobs;   /* the coordinator's registrations */
        struct coord_left *lefts; /* jobs whose nodes are leaving (the coordinator's, a member's) */
        struct coord_live *live;  /* the coordinator's confirmed jobs */
        uint32_t reserved; /* an open coordinator: numbers below may be members' not back yet */
    } track;
};

/* ---- links.c, for the coordinator and the direct links */
struct link *sd_cluster__link_new(struct sd_cluster *cl);
void sd_cluster__read_start(struct link *l);
void sd_cluster__on_connection(uv_stream_t *server, int status);
int sd_cluster__parse_hostport(const char *spec, struct sockaddr_storage *ss);
/* the heartbeat thread's peer for node: l's other end, port, and l's session key */
void sd_cluster__hb_peer(struct sd_cluster *cl, uint32_t node, struct link *l, uint32_t port);
/* install the address table: every node up but those in down[] (NULL: none) */
int sd_cluster__install_table(struct sd_cluster *cl, const protobuf_c_boolean *down);
/* refuse l's daemon (told, logged) and close the link */
void sd_cluster__refuse(struct link *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* the same, logged by the caller */
void sd_cluster__refuse_text(struct link *l, const char *text);

/* ---- peers.c: a member's direct links to its job peers */
bool sd_cluster__job_peer_up(const struct sd_cluster *cl, uint32_t node);
/* a member's link to the coordinator is up (proved) */
bool sd_cluster__coordinator_up(const struct sd_cluster *cl);
/* m to member node on their direct link, opened for it if need be (m waits in the outbox) */
void sd_cluster__peer_send(struct sd_cluster *cl, uint32_t node, const Shard__PeerMsg *m);
void sd_cluster__outbox_drop(struct sd_cluster *cl, uint32_t node, const char *why);
/* Without the coordinator, the member that decides job's registration (as the coordinator
 * would): one of the nodes up by the job's name, the same on every member (SD_NO_NODE: none) */
uint32_t sd_cluster__job_coordinator(const struct sd_cluster *cl, const char *job);
void sd_cluster__peer_lost(struct sd_cluster *cl, uint32_t node, const char *reason);
bool sd_cluster__table_fits(struct sd_cluster *cl, const Shard__PeerTable *t);
void sd_cluster__member_table(struct sd_cluster *cl, struct link *l, const Shard__PeerTable *t);
bool sd_cluster__peer_heard(struct link *l, const Shard__PeerMsg *m);
/* A member: node left job name (ids: its nodes): the job ends here once every node left or is
 * down; gone: node is (down, or its direct link lost), a job that waits for it ends without;
 * ended: the coordinator ended the job (its JobEnd) */
void sd_cluster__member_left(struct sd_cluster *cl, const char *name, uint32_t node,
                             const uint32_t *ids, uint32_t n);
void sd_cluster__member_gone(struct sd_cluster *cl, uint32_t node);
void sd_cluster__member_ended(struct sd_cluster *cl, const char *name);
/* listen for job peers' direct links on host ("": every address) at port (0: any free one);
 * 0 or a libuv error */
int sd_cluster__listen_peers(struct sd_cluster *cl, const char *host, uint32_t port);
/* Link l proved the secret and is node's: a member's link to the coordinator, or a direct link
 * to a job peer (of two links between the same members, the one the lower node opened stays). */
void sd_cluster__adopt_peer(struct link *l, uint32_t node);
/* a member's hello on its job peer's listener (proved) */
void sd_cluster__on_peer_hello(struct link *l, const Shard__PeerHello *h);
void sd_cluster__link_send(struct link *l, const Shard__PeerMsg *m);
/* m on l as it is (an independent daemon's: no ids translated, no proof first) */
void sd_cluster__link_send_raw(struct link *l, const Shard__PeerMsg *m);
/* m packed behind its frame header (malloc'd; NULL: no memory), and such a frame written on l
 * (which takes it) */
uint8_t *sd_cluster__frame(const Shard__PeerMsg *m, size_t *len_p);
void sd_cluster__link_write(struct link *l, uint8_t *frame, size_t len);
/* send m to node (its link; a member's to another member goes through the coordinator) */
void sd_cluster__send_to(struct sd_cluster *cl, uint32_t node, const Shard__PeerMsg *m);

void sd_cluster__link_close(struct link *l, const char *why);
/* a message that came on l (decoded): heard, or dropped */
void sd_cluster__on_message(struct link *l, const Shard__PeerMsg *m);
/* the coordinator: a hello that proved the secret (version, config, the node's place) */
void sd_cluster__on_hello(struct link *l, const Shard__PeerHello *h);

/* ---- handshake.c, for the links */
/* "a.b.c.d:port" of l's other end */
const char *sd_cluster__link_addr(struct link *l, char *buf, size_t len);
/* the same without the port: "a.b.c.d" ("?" where not IPv4) */
const char *sd_cluster__link_host(struct link *l, char *buf, size_t len);
/* the coordinator: a new link gets its nonce */
void sd_cluster__challenge(struct link *l);
/* l was just accepted: room for it among the unproved connections (the oldest of the source
 * holding the most goes, counted and logged; MAX_UNAUTHED, MAX_UNAUTHED_PER_SOURCE); false: l
 * itself was closed (its source holds too many proved links) */
bool sd_cluster__admit(struct sd_cluster *cl, struct link *l);
/* l goes without failing anything at either end: the other end is told (a bye with reason),
 * and l is closed as retired (why, for this end's log) */
void sd_cluster__link_bye(struct link *l, const char *reason, const char *why);
/* a dial of this daemon's to node failed (why: how): kept for what its jobs are told */
void sd_cluster__dial_failed(struct sd_cluster *cl, uint32_t node, const char *why);
/* the coordinator: is the hello's MAC right? (welcome sent) else refused and closed */
bool sd_cluster__hello_authentic(struct link *l, const Shard__PeerHello *h);
/* An independent daemon refuses a hello that proves no job's token here (a job it does not
 * serve, a wrong MAC, no job named): one text to the other end whatever the reason, so that
 * nobody learns which jobs a daemon serves; counted, and the reason (why) logged sparsely with
 * the job's name escaped. */
#define SD_REFUSE_UNPROVED                                                                         \
    "authentication failed: the hello proves no job this daemon serves (a job's nodes share its "  \
    "secret, and its ranks there must have registered)"
void sd_cluster__refuse_unproved(struct link *l, const char *job, const char *why);
/* the same check with key a, without the welcome: l is authed and has its heartbeat key */
bool sd_cluster__hello_verify(struct link *l, const Shard__PeerHello *h, const struct sd_auth *a);
/* a message on a link that has not proved the secret */
void sd_cluster__on_unauthed(struct link *l, const Shard__PeerMsg *m);

/* ---- meet.c: independent daemons, which meet per job */
int sd_meet__init(struct sd_cluster *cl);
/* the slot of daemon uid (this daemon's for its own; SD_NO_NODE: none) */
uint32_t sd_meet__slot_by_uid(const struct sd_cluster *cl, uint32_t uid);
/* a slot no daemon holds (or one nothing names any more, emptied); SD_NO_NODE: none */
uint32_t sd_meet__slot_new(struct sd_cluster *cl);
/* slot holds daemon uid (fabric address fab, fab_len bytes; heartbeat port hb; peer listener
 * pa, "" or NULL to keep what it has): its fabric address goes into the transport's table */
int sd_meet__slot_fill(struct sd_cluster *cl, uint32_t slot, uint32_t uid, const uint8_t *fab,
                       size_t fab_len, uint32_t hb, const char *pa);
/* a slot taken for a daemon that could not be filled, free again */
void sd_meet__slot_release(struct sd_cluster *cl, uint32_t slot);
/* slot leads job's registration */
void sd_meet__leader_note(struct sd_cluster *cl, const char *job, uint32_t slot);
/* ready at once, alone in its table */
int sd_meet__start(struct sd_cluster *cl);
void sd_meet__free(struct sd_cluster *cl);
/* ---- meet_wire.c: an independent daemon's messages on its links */
struct meet_wire *sd_meet__wire_new(void);
void sd_meet__link_free(struct link *l);
/* the job m is about (NULL: none, a link's own message) */
const char *sd_meet__job_of(const Shard__PeerMsg *m);
/* l's handshake proved job's token, both ways */
void sd_meet__proved(struct link *l, const char *job);
/* m on l with daemons named by their ids, after a proof of its job's token where l needs one */
void sd_meet__send(struct link *l, const Shard__PeerMsg *m);
/* m's frame with ids (for the outbox), and one such frame about job written on l */
uint8_t *sd_meet__frame(struct sd_cluster *cl, const Shard__PeerMsg *m, size_t *len_p);
void sd_meet__flush(struct link *l, const char *job, uint8_t *frame, size_t len);
/* the bytes waiting on l for the proofs of jobs not registered here yet */
size_t sd_meet__waiting_bytes(const struct link *l);
/* m came on independent link l: proofs taken, ids made slots; false: not heard further */
bool sd_meet__receive(struct link *l, Shard__PeerMsg *m);
/* the hello's fields of an independent daemon, and the key (the job's token) of its MAC */
/* ---- meet.c again: the handshake, registrations */
void sd_meet__hello_fields(struct link *l, Shard__PeerHello *h, struct sd_auth *a);
void sd_meet__on_hello(struct link *l, const Shard__PeerHello *h);
void sd_meet__on_welcome(struct link *l, const Shard__PeerWelcome *w);
void sd_meet__adopt(struct link *l, uint32_t slot);
/* proofs that waited for their jobs to register here: checked again (and given up after the
 * registration's deadline) */
void sd_meet__tick(struct sd_cluster *cl, uint64_t now);
/* this node's report of a job spanning nodes: to the job's leader (leader: "ip:port"), or
 * decided here when it is */
void sd_meet__report(struct sd_cluster *cl, const Shard__JobReport *r, const char *leader);
/* what jobs gone from here left: their leaders' notes, slots dialed for them that never met */
void sd_meet__forget(struct sd_cluster *cl);
/* the slot that leads job's registration (SD_NO_NODE: none known) */
uint32_t sd_meet__leader(const struct sd_cluster *cl, const char *job);
json_t *sd_meet__json(const struct sd_cluster *cl, bool all);

/* ---- probe.c, for the links: every peer's data path, probed at each table */
int sd_probe_init(struct sd_cluster *cl);
void sd_probe_table(struct sd_cluster *cl);
void sd_probe_down(struct sd_cluster *cl, uint32_t node);
void sd_probe_tick(struct sd_cluster *cl, uint64_t now);
bool sd_probe_ok(const struct sd_cluster *cl, uint32_t node);
void sd_probe_stop(struct sd_cluster *cl);
void sd_probe_free(struct sd_cluster *cl);

/* ---- coordinator.c, for the links */
void sd_cluster__broadcast_table(struct sd_cluster *cl);
void sd_cluster__coord_report(struct sd_cluster *cl, const Shard__JobReport *rep);
/* The same for a report that came on node from's link: one in another node's name is dropped
 * (logged). */
void sd_cluster__coord_report_from(struct sd_cluster *cl, int from, const Shard__JobReport *rep);
/* Is an abort that came on node from's link heard: from is a node of the job and aborts for
 * itself (else logged, and dropped)? */
bool sd_cluster__coord_abort_heard(struct sd_cluster *cl, int from, const Shard__JobAbort *a);
void sd_cluster__coord_left(struct sd_cluster *cl, const char *name, uint32_t node,
                            const uint32_t *ids, uint32_t n);
/* a member's JobAbort (or the coordinator's own): pass it on to the job's other nodes */
void sd_cluster__coord_abort(struct sd_cluster *cl, const Shard__PeerMsg *m);
/* a member's direct links: which job peers need one (and open it), which not any more (close
 * them once idle SD_PEER_IDLE_MS); at each tick and each confirmation */
void sd_cluster__peer_links(struct sd_cluster *cl, uint64_t now);
/* May node speak for job name: it is one of a confirmed job's nodes, or reported a registration
 * of that name; a name no confirmed job has (a registration's, an unknown one): any node. A
 * member's abort, left and relayed job messages for a running job it is not in are dropped. */
bool sd_cluster__coord_member(const struct sd_cluster *cl, const char *name, uint32_t node);
/* The same for a message of node's about the job (what: its name, for the log): true if heard,
 * else logged (once in 5 s per *logged_ms, the message kind's) and false. */
bool sd_cluster__coord_hears(const struct sd_cluster *cl, const char *name, int node,
                             const char *what, uint64_t *logged_ms);
/* May node from's message of job name go on to node to (both are its nodes)? Else logged. */
bool sd_cluster__coord_relays(const struct sd_cluster *cl, int from, const char *name, uint32_t to);
/* The job a member's message for another member is about (the coordinator relays a job's
 * messages only: ready, saved, save done, recover), or NULL. */
const char *sd_cluster__relayed_job(const Shard__PeerMsg *m);

/* the record of name's nodes (ids) that left, node among them now (made when missing; NULL:
 * no memory, or ids do not fit); and one dropped */
struct coord_left *sd_cluster__left_note(struct sd_cluster *cl, const char *name, uint32_t node,
                                         const uint32_t *ids, uint32_t n);
void sd_cluster__left_drop(struct sd_cluster *cl, struct coord_left *l);
/* in l, node left (or is gone); and every node that is down (they will never say so) */
void sd_cluster__left_mark(struct coord_left *l, uint32_t node);
void sd_cluster__left_mark_down(const struct sd_cluster *cl, struct coord_left *l);
/* the job of name ended: the tag of the (oldest) confirmed job of that name is free */
void sd_cluster__live_end(struct sd_cluster *cl, const char *name);

/* registrations that missed their deadline are refused */
void sd_cluster__coord_sweep(struct sd_cluster *cl, uint64_t now);
/* a node went down: the jobs it was part of are decided without it */
void sd_cluster__coord_node_down(struct sd_cluster *cl, uint32_t node);
void sd_cluster__coord_free(struct sd_cluster *cl);

#endif

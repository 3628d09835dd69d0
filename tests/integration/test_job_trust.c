/* A member of the cluster that is not one of a job's nodes (it holds the cluster's secret: a
 * daemon of another job, or a process with the key) tries to end a job that runs on two other
 * nodes, through the coordinator: an abort of it (under every transport tag it might have), a
 * relayed "save done" and "recover" addressed to the job's other node, a "left" of it. The
 * coordinator drops each, naming the node and the job in its log, and the job trains on to its
 * one-process reference bitwise. The member is this test: it joins an open cluster of two
 * daemons as a third (a hello MAC'd with the cluster's secret over the coordinator's nonce).
 *
 * Then a job with a secret (mlp_train --job-secret-file): the member reports itself into its
 * registration first, as the job's node 1 with a token of its own; the job forms of the nodes
 * whose ranks gave the secret, the member is refused (logged, naming it), its report of the
 * running job refused too, a report in another node's name dropped, and its aborts of the job
 * dropped; the job trains bitwise as its reference. A registration under way (one of its two
 * ranks registered) is not the member's to end either: its abort without a tag, addressed to
 * the job's nodes, is dropped (logged, naming it), and the registration completes.
 *
 * The member also dials node 1's listener for job peers (direct links between members that
 * share a job): refused without the secret, as node 0 or node 1 itself, or as a join, closed on
 * a frame of 1 GiB or one that does not decode; heard
 * as itself, its abort of the job, a "ready" of it, a confirmation of a registration (the
 * coordinator's to make while it is up) and a node-down of node 0 are dropped (logged), and the
 * job trains on bitwise. */
#include "harness.h"
#include "peer.h"
#include "shard.h"
#include "cluster/auth.h"
#include "sd/config.h"
#include "sd/hmac.h"
#include "sd/frame.h"
#include "sd/status.h"
#include "shard.pb-c.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static struct th_cluster cl;
static const char *extra[] = {"--op-timeout-ms", "20000", NULL};

/* A hello at the daemon listening on port: as node `node` (UINT32_MAX: an open cluster's
 * coordinator numbers it), on a direct link to a job peer (peer) or a join, with the cluster's
 * secret or a wrong one. The connection (-1: none), and the answer's kind in *answer (-1: none;
 * *why: a refusal's reason). */
static int hello_at(int port, uint32_t node, bool peer, bool secret_ok, int *answer, char *why,
                    size_t whylen)
{
    char key[128], err[512];
    snprintf(key, sizeof(key), "%s/cluster.key", cl.base);
    struct sd_config cfg; /* as the daemons of an open cluster, with their options */
    th_peer_config(&cfg, "0", extra);
    snprintf(cfg.cluster_secret_file, sizeof(cfg.cluster_secret_file), "%s", key);
    struct sd_auth secret;
    TH_CHECK(sd_auth_load(&cfg, &secret, err, sizeof(err)) == 0, "the cluster's secret: %s", err);
    if (!secret_ok)
        secret.key[0] ^= 1;
    *answer = -1;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        TH_CHECK(false, "connect to the daemon at port %d", port);
        close(fd);
        return -1;
    }
    Shard__PeerMsg *ch = th_peer_recv(fd, 5000);
    uint8_t nc[SD_AUTH_NONCE] = {0}, nm[SD_AUTH_NONCE], mac[SD_SHA256_BYTES];
    bool got = ch != NULL && ch->msg_case == SHARD__PEER_MSG__MSG_CHALLENGE &&
               ch->challenge->nonce.len == SD_AUTH_NONCE;
    if (got)
        memcpy(nc, ch->challenge->nonce.data, SD_AUTH_NONCE);
    if (ch)
        shard__peer_msg__free_unpacked(ch, NULL);
    TH_CHECK(got, "the challenge of the daemon at port %d", port);
    sd_auth_nonce(nm);
    char summary[1024];
    uint8_t addr[4] = {0}; /* four endpoints with empty names: nothing on the fabric */
    Shard__PeerHello h = SHARD__PEER_HELLO__INIT;
    h.node = node;
    h.was = UINT32_MAX;
    h.peer = peer;
    h.protocol_version = SD_PROTOCOL_VERSION;
    h.config_digest = sd_config_digest(&cfg, summary, sizeof(summary));
    h.config_summary = summary;
    h.version = SHARD_VERSION;
    h.fabric_addr.data = addr;
    h.fabric_addr.len = sizeof(addr);
    h.nonce.data = nm;
    h.nonce.len = sizeof(nm);
    sd_auth_hello_mac(&secret, nc, nm, &h, mac);
    h.mac.data = mac;
    h.mac.len = sizeof(mac);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_HELLO;
    m.hello = &h;
    th_peer_send(fd, &m);
    /* a welcome, and at a member's listener a refusal after it where the proved hello is not
     * heard (else its first heartbeat: the welcome stands) */
    for (int k = 0; k < 2; k++) {
        Shard__PeerMsg *w = th_peer_recv(fd, k == 0 ? 5000 : 500);
        if (w == NULL)
            break;
        bool refused = w->msg_case == SHARD__PEER_MSG__MSG_REFUSE;
        if (k == 0 || refused)
            *answer = (int)w->msg_case;
        if (refused && why != NULL)
            snprintf(why, whylen, "%s", w->refuse->reason);
        bool more = w->msg_case == SHARD__PEER_MSG__MSG_WELCOME && port != cl.port;
        shard__peer_msg__free_unpacked(w, NULL);
        if (!more)
            break;
    }
    return fd;
}

/* joins as a member: the connection to the coordinator, once welcomed (*you: the node the
 * coordinator numbered it); -1 if not */
static int join(uint32_t *you)
{
    int answer;
    int fd = hello_at(cl.port, UINT32_MAX, false, true, &answer, NULL, 0);
    bool welcomed = fd >= 0 && answer == SHARD__PEER_MSG__MSG_WELCOME;
    TH_CHECK(welcomed, "the coordinator welcomes the member (message %d)", answer);
    if (!welcomed) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    *you = UINT32_MAX;
    for (int i = 0; i < 20 && *you == UINT32_MAX; i++) { /* the address table numbers it */
        Shard__PeerMsg *t = th_peer_recv(fd, 500);
        if (t != NULL && t->msg_case == SHARD__PEER_MSG__MSG_TABLE)
            *you = t->table->you;
        if (t)
            shard__peer_msg__free_unpacked(t, NULL);
    }
    TH_CHECK(*you != UINT32_MAX, "the coordinator numbers the member (%u)", *you);
    return fd;
}

/* the member reports itself (node `as`, its own number or not) as job node 1 of the 2 of job,
 * with a job token of its own */
static void report_into(int fd, const char *job, uint32_t as)
{
    uint8_t token[SD_JOB_TOKEN_BYTES];
    memset(token, 0x5a, sizeof(token));
    Shard__JobReport r = SHARD__JOB_REPORT__INIT;
    r.job = (char *)job;
    r.node = as;
    r.digest = 1;
    r.world = 2;
    r.ranks_per_node = 1;
    r.job_node = 1;
    r.message = "";
    r.job_token.data = token;
    r.job_token.len = sizeof(token);
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_REPORT;
    m.job_report = &r;
    th_peer_send(fd, &m);
}

/* an abort of job, addressed to cluster nodes 0 and 1, as node origin, under tag (0: none) */
static void send_abort(int fd, const char *job, uint32_t origin, uint32_t tag, const char *why)
{
    uint32_t nodes[2] = {0, 1};
    Shard__JobAbort a = SHARD__JOB_ABORT__INIT;
    a.job = (char *)job;
    a.status = SD_EPEER;
    a.message = (char *)why;
    a.origin = origin;
    a.tag = tag;
    a.nodes = nodes;
    a.n_nodes = 2;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_ABORT;
    m.job_abort = &a;
    th_peer_send(fd, &m);
}

/* The member at node 1's listener for job peers (its direct links; the coordinator's table
 * announces the port): without the secret, as node 0 (the coordinator), as node 1 itself, and
 * a join (not a peer) refused, each saying so; as itself (a member node 1 knows) it is heard,
 * yet no job spans both: its abort of `job`, a "ready" of it, and a node-down of node 0 (which
 * only the coordinator declares) are dropped, logged. The number of refusals shardctl counts
 * grows. */
static void forge_direct(const char *job, uint32_t you)
{
    json_t *doc = th_admin_json(cl.d[1].sock, "topology");
    int port = (int)th_json_int(doc, "heartbeats.peer_port");
    long long refused0 = th_json_int(doc, "heartbeats.peers_refused");
    json_decref(doc);
    TH_CHECK(port > 0, "node 1 announces its port for job peers (%d)", port);
    if (port <= 0)
        return;
    struct {
        uint32_t node;
        bool peer, secret;
        const char *why;
    } bad[] = {{you, true, false, NULL},
               {0, true, true, "not a member this node knows"},
               {1, true, true, "not a member this node knows"},
               {you, false, true, "joins the cluster at the coordinator"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int answer;
        char why[512] = "";
        int fd = hello_at(port, bad[i].node, bad[i].peer, bad[i].secret, &answer, why, sizeof(why));
        TH_CHECK(answer == SHARD__PEER_MSG__MSG_REFUSE &&
                     (bad[i].why == NULL || strstr(why, bad[i].why) != NULL),
                 "node 1's listener for job peers: a hello as node %u (peer %d, secret %d) got "
                 "%d '%s'",
                 bad[i].node, bad[i].peer, bad[i].secret, answer, why);
        if (fd >= 0)
            close(fd);
    }
    /* bytes that are no message: a frame of 1 GiB announced, and one that does not decode */
    static const uint8_t junk[2][8] = {{0, 0, 0, 0x40, 1, 2, 3, 4},
                                       {4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff}};
    for (int i = 0; i < 2; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
        bool closed = false;
        if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
            send(fd, junk[i], sizeof(junk[i]), MSG_NOSIGNAL) == (ssize_t)sizeof(junk[i])) {
            for (int k = 0; k < 4 && !closed; k++) { /* its challenge, then the end */
                Shard__PeerMsg *r = th_peer_recv(fd, 5000);
                closed = r == NULL;
                if (r)
                    shard__peer_msg__free_unpacked(r, NULL);
            }
        }
        TH_CHECK(closed, "node 1's listener for job peers kept a connection that sent %s",
                 i == 0 ? "a 1 GiB frame header" : "an undecodable frame");
        close(fd);
    }
    TH_CHECK(th_daemon_alive(&cl.d[1]), "node 1 died of the bytes at its listener for job peers");
    doc = th_admin_json(cl.d[1].sock, "topology");
    TH_CHECK(th_json_int(doc, "heartbeats.peers_refused") > refused0,
             "node 1 counts the hello without the secret among the refused");
    json_decref(doc);
    int answer;
    int fd = hello_at(port, you, true, true, &answer, NULL, 0);
    TH_CHECK(answer == SHARD__PEER_MSG__MSG_WELCOME, "node 1 hears member %u as a job peer (%d)",
             you, answer);
    if (fd < 0)
        return;
    for (uint32_t tag = 1; tag <= 8; tag++)
        send_abort(fd, job, you, tag, "forged on a direct link");
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    Shard__JobReady rd = SHARD__JOB_READY__INIT;
    rd.job = (char *)job;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_READY;
    m.job_ready = &rd;
    th_peer_send(fd, &m);
    /* a decision on a job's registration, which only the coordinator makes while it is up */
    uint32_t ids[2] = {0, 1};
    Shard__JobConfirm jc = SHARD__JOB_CONFIRM__INIT;
    jc.job = "pending";
    jc.tag = 77;
    jc.nodes = ids;
    jc.n_nodes = 2;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_CONFIRM;
    m.job_confirm = &jc;
    th_peer_send(fd, &m);
    Shard__NodeDown nd = SHARD__NODE_DOWN__INIT;
    nd.node = 0;
    nd.reason = "forged on a direct link";
    m.msg_case = SHARD__PEER_MSG__MSG_NODE_DOWN;
    m.node_down = &nd;
    th_peer_send(fd, &m);
    usleep(200000);
    close(fd);
}

/* the member's attempts on job `job`, which runs on cluster nodes 0 and 1 */
static void forge(int fd, const char *job)
{
    uint32_t nodes[2] = {0, 1};
    for (uint32_t tag = 1; tag <= 8; tag++)
        send_abort(fd, job, 1, tag, "forged: a member that is not the job's");
    Shard__JobSaveDone d = SHARD__JOB_SAVE_DONE__INIT;
    d.job = (char *)job;
    d.seq = 1;
    d.status = SD_EIO;
    d.message = "forged save";
    Shard__PeerMsg inner = SHARD__PEER_MSG__INIT;
    inner.msg_case = SHARD__PEER_MSG__MSG_JOB_SAVE_DONE;
    inner.job_save_done = &d;
    Shard__PeerRelay r = SHARD__PEER_RELAY__INIT;
    r.to = 1;
    r.msg = &inner;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_RELAY;
    m.relay = &r;
    th_peer_send(fd, &m);
    Shard__JobRecover rc = SHARD__JOB_RECOVER__INIT;
    rc.job = (char *)job;
    rc.seq = 1;
    rc.dir = "/tmp";
    rc.from = 2;
    rc.node = 1;
    Shard__PeerMsg inner2 = SHARD__PEER_MSG__INIT;
    inner2.msg_case = SHARD__PEER_MSG__MSG_JOB_RECOVER;
    inner2.job_recover = &rc;
    r.msg = &inner2;
    th_peer_send(fd, &m);
    Shard__JobLeft l = SHARD__JOB_LEFT__INIT;
    l.job = (char *)job;
    l.node = 2;
    l.nodes = nodes;
    l.n_nodes = 2;
    Shard__PeerMsg ml = SHARD__PEER_MSG__INIT;
    ml.msg_case = SHARD__PEER_MSG__MSG_JOB_LEFT;
    ml.job_left = &l;
    th_peer_send(fd, &ml);
}

/* a registration in progress: one rank of job "pending" (world 2, a node each) */
struct reg {
    const char *sock;
    uint32_t rank;
    int st;
    char err[256];
    shard_ctx_t *ctx;
};

static void *register_rank(void *arg)
{
    struct reg *r = arg;
    static uint64_t dims[1] = {64};
    static float init[64];
    const float *inits[1] = {init};
    shard_tensor_t t = {.name = "w", .ndim = 1, .dims = dims, .dtype = SHARD_FP32};
    shard_model_t m = {.job = "pending",
                       .rank = r->rank,
                       .world = 2,
                       .ranks_per_node = 1,
                       .plan = "zero3",
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 0.1f},
                       .init = r->rank == 0 ? inits : NULL};
    r->st = shard_attach(r->sock, &r->ctx);
    if (r->st == 0)
        r->st = shard_register(r->ctx, &m);
    if (r->st != 0)
        snprintf(r->err, sizeof(r->err), "%s", shard_last_error(r->ctx));
    return NULL;
}

/* the member ends a registration it has no part in: an abort without a tag (a registration's,
 * confirmed jobs have one), addressed to the nodes the job will run on */
static void forge_registration_abort(int fd, const char *job, uint32_t you)
{
    send_abort(fd, job, you, 0, "forged: a member that is not the registration's");
}

struct training {
    const char *job;
    char dir[300], dump[400], ref[400], secret[400];
    int failed;
};

/* t in dir base/name: job name, with a secret file when secret */
static void training_init(struct training *t, const char *name, bool secret)
{
    memset(t, 0, sizeof(*t));
    t->job = name;
    snprintf(t->dir, sizeof(t->dir), "%s/%s", cl.base, name);
    mkdir(t->dir, 0755);
    snprintf(t->dump, sizeof(t->dump), "%s/params.bin", t->dir);
    snprintf(t->ref, sizeof(t->ref), "%s/ref.bin", t->dir);
    if (!secret)
        return;
    snprintf(t->secret, sizeof(t->secret), "%s/job.key", t->dir);
    FILE *f = fopen(t->secret, "w");
    TH_CHECK(f != NULL, "the job's secret file");
    if (f != NULL) {
        for (int i = 0; i < 32; i++) /* (a test's secret: any 16-4096 bytes) */
            fputc((i * 37 + 11) & 0xff, f);
        fclose(f);
    }
}

/* the job trained bitwise as its reference */
static void trained(struct training *t)
{
    TH_CHECK(t->failed == 0, "%s: every rank and the reference exited 0 (%d did not)", t->job,
             t->failed);
    struct th_dump_diff dd;
    TH_CHECK(th_compare_dumps(t->dump, t->ref, 0.0, &dd) && dd.differ == 0,
             "%s trained bitwise as its reference (%zu of %zu differ)", t->job, dd.differ, dd.n);
}

static void *train(void *arg)
{
    struct training *t = arg;
    const char *socks[2] = {cl.d[0].sock, cl.d[1].sock};
    const char *args[] = {
        "--world",  "2",  "--ranks-per-node", "1",  "--plan",  "zero3", "--steps", "40",
        "--hidden", "64", "--compute-ms",     "20", "--quiet", NULL,    NULL,      NULL};
    if (t->secret[0] != '\0') { /* the job's secret, the same file for every rank */
        args[13] = "--job-secret-file";
        args[14] = t->secret;
    }
    int rcs[3];
    t->failed = th_train(t->dir, t->job, socks, 1, 2, args, t->dump, t->ref, rcs);
    return NULL;
}

/* job's state on node 0's daemon, or "" */
static void job_state(const char *job, char *out, size_t len)
{
    out[0] = '\0';
    json_t *doc = th_admin_json(cl.d[0].sock, "jobs");
    json_t *jobs = doc ? json_object_get(doc, "jobs") : NULL;
    size_t i;
    json_t *j;
    json_array_foreach(jobs, i, j)
    {
        const char *name = json_string_value(json_object_get(j, "name"));
        if (name && strcmp(name, job) == 0)
            snprintf(out, len, "%s", json_string_value(json_object_get(j, "state")) ?: "");
    }
    json_decref(doc);
}

/* wait until job runs on node 0 */
static void wait_running(const char *job)
{
    char state[32] = "";
    for (int i = 0; i < 400 && strcmp(state, "running") != 0; i++) {
        usleep(25000);
        job_state(job, state, sizeof(state));
    }
    TH_CHECK(strcmp(state, "running") == 0, "%s runs on nodes 0 and 1 (%s)", job, state);
}

int main(void)
{
    if (th_open_cluster_start(&cl, 2, extra) != 0)
        return th_summary("test_job_trust");
    struct training t, g;
    training_init(&t, "victim", false);
    training_init(&g, "guarded", true);
    pthread_t th, tg;
    char want[256];
    pthread_create(&th, NULL, train, &t);
    wait_running("victim");
    /* a registration under way: rank 0 of "pending" registered on node 0, rank 1 comes last */
    struct reg r0 = {.sock = cl.d[0].sock, .rank = 0}, r1 = {.sock = cl.d[1].sock, .rank = 1};
    pthread_t t0, t1;
    pthread_create(&t0, NULL, register_rank, &r0);
    char state[32] = "";
    for (int i = 0; i < 400 && strcmp(state, "registering") != 0; i++) {
        usleep(10000);
        job_state("pending", state, sizeof(state));
    }
    TH_CHECK(strcmp(state, "registering") == 0, "pending registers on node 0 (%s)", state);
    /* (the member sends no heartbeats: all it does is done within the cluster's timeout) */
    uint32_t you = UINT32_MAX;
    int fd = join(&you);
    if (fd >= 0) {
        /* the job with a secret: the member reports itself into its registration before its
         * ranks come, as its node 1 */
        report_into(fd, "guarded", you);
        forge(fd, "victim");
        forge_direct("victim", you);
        forge_registration_abort(fd, "pending", you);
    }
    pthread_create(&tg, NULL, train, &g);
    wait_running("guarded");
    if (fd >= 0) { /* once it runs: again, in node 1's name, then its aborts */
        report_into(fd, "guarded", you);
        report_into(fd, "guarded", 1);
        forge(fd, "guarded");
        usleep(300000);
    }
    pthread_join(th, NULL);
    pthread_join(tg, NULL);
    trained(&t);
    trained(&g);
    pthread_create(&t1, NULL, register_rank, &r1);
    pthread_join(t0, NULL);
    pthread_join(t1, NULL);
    TH_CHECK(r0.st == 0 && r1.st == 0,
             "the registration the member tried to end completes (rank 0: %d %s; rank 1: %d %s)",
             r0.st, r0.err, r1.st, r1.err);
    shard_detach(r0.ctx);
    shard_detach(r1.ctx);
    char *log = th_read_file(cl.d[0].log, NULL);
    snprintf(want, sizeof(want),
             "node %u sent an abort of job 'pending', whose registration it has not reported: "
             "dropped",
             you);
    TH_CHECK(log != NULL && strstr(log, want) != NULL,
             "the coordinator drops the member's abort of a registration, naming it");
    TH_CHECK(log != NULL && strstr(log, "is not a node of job 'victim': its abort of the job "
                                        "dropped") != NULL,
             "the coordinator drops the member's abort, naming it");
    TH_CHECK(log != NULL && strstr(log, "not both its nodes: dropped") != NULL,
             "the coordinator drops the member's relayed job messages");
    TH_CHECK(log != NULL &&
                 strstr(log, "is not a node of job 'victim': its 'left' dropped") != NULL,
             "the coordinator drops the member's 'left'");
    char *log1 = th_read_file(cl.d[1].log, NULL);
    snprintf(want, sizeof(want),
             "node %u's direct link carried a message (kind %d) that is not its to send here "
             "(no job of victim spans both",
             you, SHARD__PEER_MSG__MSG_JOB_ABORT);
    TH_CHECK(log1 != NULL && strstr(log1, want) != NULL,
             "node 1 drops the member's abort of victim on a direct link, naming it");
    snprintf(want, sizeof(want), "node %u's direct link carried a message (kind %d)", you,
             SHARD__PEER_MSG__MSG_NODE_DOWN);
    TH_CHECK(log1 != NULL && strstr(log1, want) != NULL,
             "node 1 drops the member's node-down of node 0 on a direct link, naming it");
    snprintf(want, sizeof(want), "node %u's direct link carried a message (kind %d)", you,
             SHARD__PEER_MSG__MSG_JOB_CONFIRM);
    TH_CHECK(log1 != NULL && strstr(log1, want) != NULL,
             "node 1 drops the member's confirmation of a registration on a direct link");
    TH_CHECK(log1 != NULL && strstr(log1, "node 0 is down") == NULL,
             "node 1 took the member's word that node 0 is down");
    free(log1);
    snprintf(want, sizeof(want),
             "job 'guarded': node(s) %u registered it with another job secret than its nodes: "
             "not nodes of the job, refused",
             you);
    TH_CHECK(log != NULL && strstr(log, want) != NULL,
             "the member's report into the registration is refused once the job formed of the "
             "nodes with its secret, naming it");
    snprintf(want, sizeof(want),
             "job 'guarded': node %u registered it with another job secret than the nodes it "
             "runs on: not a node of the job, refused",
             you);
    TH_CHECK(log != NULL && strstr(log, want) != NULL,
             "its report of the running job is refused at once, naming it");
    snprintf(want, sizeof(want), "node %u reported job 'guarded' as node 1: dropped", you);
    TH_CHECK(log != NULL && strstr(log, want) != NULL, "a report in another node's name dropped");
    free(log);
    if (fd >= 0)
        close(fd);
    TH_CHECK(th_cluster_stop(&cl) == 0, "both daemons stop cleanly");
    return th_summary("test_job_trust");
}

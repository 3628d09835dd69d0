/* Daemons without a cluster (nodes 1) hear a job's traffic only from the job's daemons (issue
 * 38, "trust"): two independent daemons on loopback train job j (its ranks name daemon 0 the
 * leader and give the job's secret) while this test, a process on the same network that is not
 * one of j's, attacks daemon 0's peer port:
 * - a hello for j MAC'd with a wrong token: refused (authentication failed), logged;
 * - a hello for a job daemon 0 does not serve: refused, naming it;
 * - a hello for job x, which this test registered on daemon 0 itself (it holds x's secret), as
 *   daemon 1 (its id, from shardctl topology): refused, the hello does not prove daemon 1's key
 *   (a forged rejoin);
 * - a hello for x from a daemon with another configuration (op_timeout_ms): refused, naming
 *   both configurations;
 * - a hello for x as a new daemon: heard (x's token proves it is one of x's); on that link, an
 *   abort of j, a "ready" of j, a proof of j's token with a wrong MAC, a node-down of daemon 1
 *   and an address table: each dropped, logged;
 * - heartbeat datagrams naming each number daemon 0 may give daemon 1, with wrong MACs:
 *   dropped (counted);
 * and j trains on to its one-process reference (within 1e-5, as every run of it), both daemons
 * up. Then daemon 1 restarted three times (a new id each time) serves a job with daemon 0 each
 * time, daemon 0 reusing the slots of the daemons gone (it has 2: SHARDD_TEST_MEET_SLOTS).
 * A job whose node-0 rank names another leader (torchrun's MASTER_ADDR on one machine) is refused
 * at once naming the address, where the leader is and the variable; a leader nobody served
 * leaves no "meeting" entry once its job is gone. */
#include "harness.h"
#include "peer.h"
#include "peer_hello.h"
#include "shard.h"
#include "cluster/auth.h"
#include "sd/config.h"
#include "sd/frame.h"
#include "sd/hmac.h"
#include "sd/status.h"
#include "shard.pb-c.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static struct th_cluster cl;
static const char *const extra[] = {"--heartbeat-interval-ms",
                                    "100",
                                    "--heartbeat-timeout-ms",
                                    "2000",
                                    "--register-timeout-ms",
                                    "8000",
                                    NULL};

/* a hello at daemon 0's peer port as daemon `id` for job (key: the MAC's), with a fabric address
 * of rails that name 127.0.0.1:1 (nothing there), and the daemons' configuration or another
 * (agree) */
static void hello_as(struct th_meet *mt, const char *job, uint32_t id, const struct sd_auth *key,
                     bool agree)
{
    struct th_hello h = {
        .port = cl.port, .job = job, .id = id, .key = key, .extra = extra, .other_config = !agree};
    th_hello(&h, mt);
}

static void hello(struct th_meet *mt, const char *job, uint32_t id, const struct sd_auth *key)
{
    hello_as(mt, job, id, key, true);
}

static uint32_t daemon_id(int i)
{
    return th_daemon_id(cl.d[i].sock);
}

static bool log_has(int i, const char *text)
{
    for (double end = th_now_s() + 60; th_now_s() < end; usleep(50000)) {
        char *log = th_read_file(cl.d[i].log, NULL);
        bool has = log != NULL && strstr(log, text) != NULL;
        free(log);
        if (has)
            return true;
    }
    return false;
}

struct x_reg {
    int st;
    char err[512];
};

/* rank 0 of job x on daemon 0 (world 2, one rank per node: it registers until its node 1,
 * which never comes, is given up) */
static void *register_x(void *arg)
{
    struct x_reg *r = arg;
    r->st = th_register_one(cl.d[0].sock, "x", 0, 2, 1, r->err, sizeof(r->err));
    return NULL;
}

/* rank 1 of job "lost" on daemon 1, naming a leader nobody serves (port 1): its registration
 * times out, naming the leader */
static void *register_lost(void *arg)
{
    struct x_reg *r = arg;
    r->st = th_register_secret(cl.d[1].sock, "lost", 1, 2, "the secret of job lost, this test's",
                               "127.0.0.1:1", r->err, sizeof(r->err));
    return NULL;
}

/* what this test sends on its link proved for x, about job j and daemon 1 */
static void attack_link(int fd, uint32_t d0, uint32_t d1)
{
    uint32_t nodes[2] = {d0, d1};
    Shard__JobAbort ab = SHARD__JOB_ABORT__INIT;
    ab.job = "j";
    ab.status = SD_EPEER;
    ab.message = "forged";
    ab.origin = d1;
    ab.nodes = nodes;
    ab.n_nodes = 2;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_ABORT;
    m.job_abort = &ab;
    th_peer_send(fd, &m);
    Shard__JobReady rd = SHARD__JOB_READY__INIT;
    rd.job = "j";
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_READY;
    m.job_ready = &rd;
    th_peer_send(fd, &m);
    uint8_t mac[SD_SHA256_BYTES];
    memset(mac, 0x5a, sizeof(mac));
    Shard__JobProof pr = SHARD__JOB_PROOF__INIT;
    pr.job = "j";
    pr.mac.data = mac;
    pr.mac.len = sizeof(mac);
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_PROOF;
    m.job_proof = &pr;
    th_peer_send(fd, &m);
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_ABORT; /* (still not proved) */
    m.job_abort = &ab;
    th_peer_send(fd, &m);
    Shard__NodeDown nd = SHARD__NODE_DOWN__INIT;
    nd.node = d1;
    nd.reason = "forged";
    m.msg_case = SHARD__PEER_MSG__MSG_NODE_DOWN;
    m.node_down = &nd;
    th_peer_send(fd, &m);
    Shard__PeerTable t = SHARD__PEER_TABLE__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_TABLE;
    m.table = &t;
    th_peer_send(fd, &m);
}

/* heartbeats naming each number daemon 0 may give daemon 1, MAC'd with a wrong key */
static long long forge_heartbeats(uint32_t port)
{
    json_t *before = th_admin_json(cl.d[0].sock, "topology");
    long long dropped = th_json_int(before, "heartbeats.dropped");
    json_decref(before);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    struct {
        uint32_t magic, node;
        uint64_t seq;
        uint8_t mac[16];
    } d = {.magic = 0x53444842u, .seq = 1ull << 50};
    memset(d.mac, 0x77, sizeof(d.mac));
    int sent = 0;
    for (uint32_t node = 0; node < 16; node++) {
        d.node = node;
        sent += sendto(fd, &d, sizeof(d), 0, (struct sockaddr *)&to, sizeof(to)) == sizeof(d);
    }
    close(fd);
    usleep(300000);
    json_t *after = th_admin_json(cl.d[0].sock, "topology");
    long long more = th_json_int(after, "heartbeats.dropped") - dropped;
    json_decref(after);
    TH_CHECK(sent == 16 && more >= 16, "forged heartbeats: %d sent, %lld more dropped", sent, more);
    return more;
}

/* Daemon 1 restarted three times, each time under a new id, each serving a job with daemon 0:
 * daemon 0 (2 slots for the daemons it meets: SHARDD_TEST_MEET_SLOTS) reuses the slots of the
 * daemons that are gone (daemon 1's last incarnations, this test's link). */
static void reuse_slots(const char *leader, const char *secret)
{
    const char *args[] = {"--world",  "2",     "--ranks-per-node",  "1",
                          "--plan",   "zero3", "--steps",           "3",
                          "--leader", leader,  "--job-secret-file", secret,
                          "--quiet",  NULL}; /* (mlp_train --leader: no variable) */
    for (int round = 0; round < 3; round++) {
        kill(cl.d[1].pid, SIGKILL);
        th_wait(cl.d[1].pid, 10000);
        cl.d[1].pid = 0;
        TH_CHECK(th_cluster_node_restart(&cl, 1, extra) == 0, "daemon 1 did not restart");
        char job[16], l0[400], l1[400];
        snprintf(job, sizeof(job), "again%d", round);
        snprintf(l0, sizeof(l0), "%s/%s-0.log", cl.base, job);
        snprintf(l1, sizeof(l1), "%s/%s-1.log", cl.base, job);
        pid_t p0 = th_spawn_rank(cl.d[0].sock, job, 0, args, NULL, l0);
        pid_t p1 = th_spawn_rank(cl.d[1].sock, job, 1, args, NULL, l1);
        int e0 = th_wait(p0, 60000), e1 = th_wait(p1, 60000);
        TH_CHECK(e0 == 0 && e1 == 0,
                 "%s on daemon 0 and daemon 1's incarnation %d: exits %d %d "
                 "(logs %s, %s)",
                 job, round + 2, e0, e1, l0, l1);
    }
    TH_CHECK(log_has(0, "is free again"), "daemon 0 did not reuse a slot");
}

/* does daemon i's topology list a daemon it is still meeting (one dialed that never answered)? */
static bool lists_meeting(int i)
{
    char *topo = th_admin(cl.d[i].sock, "topology");
    bool meeting = topo == NULL || strstr(topo, "\"meeting\"") != NULL;
    free(topo);
    return meeting;
}

/* torchrun on one machine (issue 56): its MASTER_ADDR=127.0.0.1 names the default port, where no
 * daemon of a local cluster listens. Rank 0's node leads, so its daemon refuses at once, naming
 * the address dialed, where the leader is, and (libshard) the variable; nothing is left to meet.
 * And the job whose node 1 dialed a leader nobody serves (lost, above) left no "meeting" entry
 * once it was gone. */
static void wrong_leader(const char *leader)
{
    bool stale = true;
    for (double end = th_now_s() + 10; stale && th_now_s() < end; usleep(100000))
        stale = lists_meeting(1);
    TH_CHECK(!stale, "daemon 1 still lists the leader nobody served as meeting");
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    char err[1024] = "";
    double t0 = th_now_s();
    int st = th_register_secret(cl.d[0].sock, "torchrun-here", 0, 2,
                                "the secret of job torchrun-here", NULL, err, sizeof(err));
    double took = th_now_s() - t0;
    unsetenv("MASTER_ADDR");
    char where[128];
    snprintf(where, sizeof(where), "this one, at %s", leader);
    TH_CHECK(st == SHARD_EINVAL && took < 10.0 && strstr(err, "127.0.0.1:7701") &&
                 strstr(err, where) && strstr(err, "from MASTER_ADDR") &&
                 strstr(err, "set SHARD_LEADER"),
             "node 0's ranks naming a leader that is not their daemon: %d after %.1f s: '%s'", st,
             took, err);
    printf("a wrong leader on rank 0's node: refused in %.2f s: %s\n", took, err);
    TH_CHECK(!lists_meeting(0), "daemon 0 lists a daemon it is meeting after the refusal");
}

int main(void)
{
    setenv("SHARDD_TEST_MEET_SLOTS", "4", 1); /* (2 daemons met at once: reuse_slots) */
    int rc = th_indep_cluster_start(&cl, 2, false, extra);
    if (rc != 0) {
        fprintf(stderr, "cannot start 2 independent daemons\n");
        return 1;
    }
    char leader[64], secret[400], dump[400], ref[400];
    th_cluster_leader(&cl, 0, leader, sizeof(leader));
    snprintf(secret, sizeof(secret), "%s/j.secret", cl.base);
    FILE *f = fopen(secret, "w");
    TH_CHECK(f != NULL && fputs("the secret of job j, 32 bytes or so", f) >= 0 && fclose(f) == 0,
             "j's secret file");
    snprintf(dump, sizeof(dump), "%s/j.bin", cl.base);
    snprintf(ref, sizeof(ref), "%s/j-ref.bin", cl.base);
    const char *args[] = {
        "--world",           "2",    "--ranks-per-node", "1",  "--plan",         "zero3",
        "--steps",           "40",   "--compute-ms",     "40", "--compute-mode", "sleep",
        "--job-secret-file", secret, "--quiet",          NULL};
    setenv("SHARD_LEADER", leader, 1);
    const char *dumps[] = {"--dump-params", dump, NULL};
    char log0[400], log1[400], logr[400];
    snprintf(log0, sizeof(log0), "%s/j-0.log", cl.base);
    snprintf(log1, sizeof(log1), "%s/j-1.log", cl.base);
    snprintf(logr, sizeof(logr), "%s/j-ref.log", cl.base);
    pid_t r0 = th_spawn_rank(cl.d[0].sock, "j", 0, args, dumps, log0);
    pid_t r1 = th_spawn_rank(cl.d[1].sock, "j", 1, args, NULL, log1);
    unsetenv("SHARD_LEADER");
    const char *reference[] = {"--reference", "--dump-params", ref, NULL};
    pid_t rr = th_spawn_rank(NULL, NULL, -1, args, reference, logr);
    TH_CHECK(log_has(0, "job 'j' ready"), "job j did not start on daemon 0");
    uint32_t d0 = daemon_id(0), d1 = daemon_id(1);
    TH_CHECK(d0 != 0 && d1 != 0 && d0 != d1, "the daemons' ids: %08x %08x", d0, d1);

    /* j's token, guessed wrong */
    struct sd_auth wrong;
    th_job_token("not the secret of job j at all", "j", &wrong);
    struct th_meet mt;
    hello(&mt, "j", 0x12345678, &wrong);
    TH_CHECK(mt.answer == SHARD__PEER_MSG__MSG_REFUSE && strstr(mt.why, "authentication failed"),
             "a hello for j with a wrong token: answer %d '%s'", mt.answer, mt.why);
    close(mt.fd);
    TH_CHECK(log_has(0, "for job 'j': its HMAC does not match the job's token"),
             "daemon 0 did not log the refusal");
    char served[sizeof(mt.why)];
    snprintf(served, sizeof(served), "%s", mt.why);
    hello(&mt, "nosuch", 0x12345678, &wrong);
    /* (the same words: nobody learns from a refusal which jobs a daemon serves) */
    TH_CHECK(mt.answer == SHARD__PEER_MSG__MSG_REFUSE && strcmp(mt.why, served) == 0,
             "a hello for a job daemon 0 does not serve: answer %d '%s' (for j: '%s')", mt.answer,
             mt.why, served);
    TH_CHECK(log_has(0, "for job 'nosuch': no job of that name"),
             "daemon 0 did not log why it refused the hello for 'nosuch'");
    close(mt.fd);

    struct x_reg lost = {0};
    pthread_t lost_th;
    pthread_create(&lost_th, NULL, register_lost, &lost);
    /* job x, which this test serves itself: its secret is this test's */
    setenv("TH_JOB_SECRET", "the secret of job x, this test's", 1);
    struct x_reg xr = {0};
    pthread_t th;
    pthread_create(&th, NULL, register_x, &xr);
    TH_CHECK(log_has(0, "job 'x' (id"), "daemon 0 did not create job x");
    struct sd_auth x_token;
    th_job_token("the secret of job x, this test's", "x", &x_token);
    hello(&mt, "x", d1, &x_token); /* as daemon 1, from elsewhere: without daemon 1's key */
    TH_CHECK(mt.answer == SHARD__PEER_MSG__MSG_REFUSE &&
                 strstr(mt.why, "does not prove that daemon's key"),
             "a hello for x as daemon 1 (a forged rejoin): answer %d '%s'", mt.answer, mt.why);
    close(mt.fd);
    hello_as(&mt, "x", 0, &x_token, false); /* one of x's, another configuration */
    TH_CHECK(mt.answer == SHARD__PEER_MSG__MSG_REFUSE && strstr(mt.why, "must agree") &&
                 strstr(mt.why, "op_timeout_ms=1234"),
             "a hello for x from a daemon configured otherwise: answer %d '%s'", mt.answer, mt.why);
    close(mt.fd);
    hello(&mt, "x", 0, &x_token); /* as itself (its own key's id): one of x's */
    TH_CHECK(mt.answer == SHARD__PEER_MSG__MSG_WELCOME,
             "a hello for x as a new daemon: answer %d '%s'", mt.answer, mt.why);
    if (mt.answer == SHARD__PEER_MSG__MSG_WELCOME) {
        attack_link(mt.fd, d0, d1);
        TH_CHECK(log_has(0, "sent a message about job 'j' (kind 8) without proving"),
                 "daemon 0 did not log the abort of j it dropped");
        TH_CHECK(log_has(0, "did not prove job 'j''s token"),
                 "daemon 0 did not log the proof of j it refused");
        TH_CHECK(log_has(0, "sent a coordinator's message (kind 10)"),
                 "daemon 0 did not log the node-down it dropped");
        forge_heartbeats(mt.hb_port);
    }
    close(mt.fd);

    int e0 = th_wait(r0, 120000), e1 = th_wait(r1, 120000), er = th_wait(rr, 120000);
    TH_CHECK(e0 == 0 && e1 == 0 && er == 0, "job j's ranks exited %d %d, its reference %d", e0, e1,
             er);
    struct th_dump_diff dd;
    bool same = e0 == 0 && th_compare_dumps(dump, ref, 1e-5, &dd) && dd.outside == 0;
    TH_CHECK(same, "job j: outside 1e-5 of its reference after the attacks");
    if (same)
        printf("job j trained to its reference through every attack (%zu parameters, max %g)\n",
               dd.n, dd.maxd);
    pthread_join(th, NULL);
    unsetenv("TH_JOB_SECRET");
    TH_CHECK(xr.st != 0, "job x (its node 1 never came) registered");
    pthread_join(lost_th, NULL);
    TH_CHECK(lost.st == SHARD_ETIMEDOUT &&
                 strstr(lost.err, "its leader (127.0.0.1:1) did not confirm it within 16000 ms"),
             "a job whose leader nobody serves: %d '%s'", lost.st, lost.err);
    wrong_leader(leader);
    reuse_slots(leader, secret);
    for (int i = 0; i < 2; i++)
        TH_CHECK(th_daemon_alive(&cl.d[i]), "daemon %d died", i);
    TH_CHECK(th_cluster_stop(&cl) == 0, "daemons did not shut down cleanly");
    return th_summary("test_meet_trust");
}

/* A process without the cluster's secret that reaches the coordinator's port or its heartbeat
 * port (issue 36). On a 2-node cluster (one rank each) a job trains while:
 *  - a forger connects as node 1 and says hello without a MAC, with a wrong one, and twice in a
 *    row (the "rejoin" that used to replace node 1's live link); another sends a job message
 *    before any hello; a hello MAC'd with the real secret but over another connection's nonce
 *    (a replay) is refused too; each is told "authentication failed" (never the configuration)
 *    and logged, no link is dropped and the job trains on to its reference's parameters;
 *  - then node 1 is stopped (SIGSTOP) while a forger sends datagrams "from node 1" to node 0's
 *    heartbeat port: node 0 declares node 1 down within the heartbeat timeout all the same. */
#include "harness.h"
#include "sd/log.h"
#include "cluster/auth.h"
#include "sd/frame.h"
#include "sd/status.h"
#include "shard.pb-c.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static struct th_cluster cl;

static int connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int last_recv_st; /* the last read's status, for the failure messages */

/* the next peer message, or NULL (closed, timed out: *timed_out_p, when given) */
static Shard__PeerMsg *recv_msg_st(int fd, int timeout_ms, bool *timed_out_p)
{
    uint8_t *buf = NULL;
    size_t n = 0;
    int st = sd_frame_recv(fd, &buf, &n, NULL, 0, NULL, 1 << 20, timeout_ms);
    last_recv_st = st;
    if (timed_out_p != NULL)
        *timed_out_p = st == SD_ETIMEDOUT;
    if (st != 0)
        return NULL;
    Shard__PeerMsg *m = shard__peer_msg__unpack(NULL, n, buf);
    free(buf);
    return m;
}

static Shard__PeerMsg *recv_msg(int fd, int timeout_ms)
{
    return recv_msg_st(fd, timeout_ms, NULL);
}

static char reads[160]; /* what try_hello's two reads returned, for its callers' messages */

/* what the coordinator answers to hello h on a new connection (its nonce put in by fill), with
 * the refusal's text in why; true when the connection was then closed */
static bool try_hello(void (*fill)(Shard__PeerHello *h, const uint8_t *nc, uint8_t *mac),
                      int hellos, char *why, size_t len)
{
    why[0] = '\0';
    int fd = connect_port(cl.port);
    if (fd < 0)
        return false;
    Shard__PeerMsg *ch = recv_msg(fd, 3000);
    bool got = ch != NULL && ch->msg_case == SHARD__PEER_MSG__MSG_CHALLENGE &&
               ch->challenge->nonce.len == SD_AUTH_NONCE;
    uint8_t nc[SD_AUTH_NONCE] = {0}, nm[SD_AUTH_NONCE], mac[SD_SHA256_BYTES];
    if (got)
        memcpy(nc, ch->challenge->nonce.data, SD_AUTH_NONCE);
    if (ch)
        shard__peer_msg__free_unpacked(ch, NULL);
    TH_CHECK(got, "the coordinator's first message is a challenge with a nonce");
    uint8_t addr[8] = {1, 2, 3, 4};
    memset(nm, 7, sizeof(nm));
    for (int i = 0; i < hellos; i++) {
        Shard__PeerHello h = SHARD__PEER_HELLO__INIT;
        h.node = 1;
        h.protocol_version = SD_PROTOCOL_VERSION;
        h.version = SHARD_VERSION;
        h.config_summary = "";
        h.fabric_addr.data = addr;
        h.fabric_addr.len = sizeof(addr);
        h.nonce.data = nm;
        h.nonce.len = sizeof(nm);
        fill(&h, nc, mac);
        Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
        m.msg_case = SHARD__PEER_MSG__MSG_HELLO;
        m.hello = &h;
        sd_frame_send(fd, &m.base, NULL, 0, 2000);
    }
    /* a closed connection answers at once; the long waits are for a loaded machine, where a
     * refusal that came after a short one read as a connection left open (the flake) */
    Shard__PeerMsg *r = recv_msg(fd, 15000);
    int r_st = last_recv_st;
    /* Linux reports a reset before the bytes still queued ahead of it: the refusal can come
     * on the read after the one that said "reset" (seen under ctest -j3) */
    if (r == NULL && r_st == SD_ECONNRESET) {
        r = recv_msg(fd, 1000);
        r_st = last_recv_st;
    }
    if (r != NULL && r->msg_case == SHARD__PEER_MSG__MSG_REFUSE)
        snprintf(why, len, "%s", r->refuse->reason);
    else if (r != NULL)
        snprintf(why, len, "(message %d)", (int)r->msg_case);
    if (r)
        shard__peer_msg__free_unpacked(r, NULL);
    bool timed_out;
    Shard__PeerMsg *after = recv_msg_st(fd, 15000, &timed_out);
    bool closed = after == NULL && !timed_out;
    snprintf(reads, sizeof(reads), "reads: %s then %s (message %d)", sd_status_str(r_st),
             sd_status_str(last_recv_st), after ? (int)after->msg_case : -1);
    if (after)
        shard__peer_msg__free_unpacked(after, NULL);
    close(fd);
    return closed;
}

static void no_mac(Shard__PeerHello *h, const uint8_t *nc, uint8_t *mac)
{
    (void)nc;
    (void)mac;
    h->nonce.len = 0;
}

static void wrong_mac(Shard__PeerHello *h, const uint8_t *nc, uint8_t *mac)
{
    (void)nc;
    memset(mac, 0xab, SD_SHA256_BYTES);
    h->mac.data = mac;
    h->mac.len = SD_SHA256_BYTES;
}

static struct sd_auth secret;
static uint8_t other_nonce[SD_AUTH_NONCE];

/* MAC'd with the real secret, but over a nonce that is not this connection's */
static void replayed_mac(Shard__PeerHello *h, const uint8_t *nc, uint8_t *mac)
{
    (void)nc;
    sd_auth_hello_mac(&secret, other_nonce, h->nonce.data, h, mac);
    h->mac.data = mac;
    h->mac.len = SD_SHA256_BYTES;
}

static void forged_hellos(void)
{
    char why[512];
    bool closed = try_hello(no_mac, 1, why, sizeof(why));
    TH_CHECK(closed && strstr(why, "authentication failed"), "a hello without a MAC: '%s'", why);
    TH_CHECK(!strstr(why, "op_timeout_ms"), "the configuration was told to a stranger: %s", why);
    closed = try_hello(wrong_mac, 1, why, sizeof(why));
    TH_CHECK(closed && strstr(why, "authentication failed"), "a wrong MAC: '%s'", why);
    /* the second hello of the old attack: the refusal of the first may be lost to the reset
     * that closing a connection with unread bytes sends; the link is closed all the same */
    closed = try_hello(wrong_mac, 2, why, sizeof(why));
    TH_CHECK(closed && (why[0] == '\0' || strstr(why, "authentication failed")),
             "two hellos: '%s' (%s)", why, reads);
    memset(other_nonce, 0x11, sizeof(other_nonce));
    closed = try_hello(replayed_mac, 1, why, sizeof(why));
    TH_CHECK(closed && strstr(why, "authentication failed"), "a replayed hello: '%s'", why);
    /* a job message before any hello */
    int fd = connect_port(cl.port);
    Shard__PeerMsg *ch = recv_msg(fd, 3000);
    if (ch)
        shard__peer_msg__free_unpacked(ch, NULL);
    Shard__JobAbort a = SHARD__JOB_ABORT__INIT;
    a.job = "victim";
    a.message = "forged";
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_ABORT;
    m.job_abort = &a;
    sd_frame_send(fd, &m.base, NULL, 0, 2000);
    Shard__PeerMsg *r = recv_msg(fd, 3000);
    TH_CHECK(r == NULL, "a job message before the hello was answered (%d)",
             r ? (int)r->msg_case : 0);
    if (r)
        shard__peer_msg__free_unpacked(r, NULL);
    close(fd);
}

static atomic_int forging;
static int hb_port0;

/* datagrams "from node 1" to node 0's heartbeat port, every 50 ms */
static void *forger(void *arg)
{
    (void)arg;
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)hb_port0)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    uint64_t seq = 1ull << 50;
    while (atomic_load(&forging)) {
        struct {
            uint32_t magic, node;
            uint64_t seq;
            uint8_t mac[16];
        } d = {.magic = 0x53444842u, .node = 1, .seq = seq++};
        for (int i = 0; i < 16; i++)
            d.mac[i] = (uint8_t)rand();
        sendto(fd, &d, sizeof(d), 0, (struct sockaddr *)&to, sizeof(to));
        uint8_t old[24] = {0x42, 0x48, 0x44, 0x53, 1};
        sendto(fd, old, sizeof(old), 0, (struct sockaddr *)&to, sizeof(to));
        usleep(50000);
    }
    close(fd);
    return NULL;
}

static bool log_has(int node, const char *word)
{
    char *t = th_read_file(cl.d[node].log, NULL);
    bool has = t && strstr(t, word);
    free(t);
    return has;
}

int main(void)
{
    const char *extra[] = {"--heartbeat-timeout-ms", "1500", NULL};
    if (th_cluster_start(&cl, 2, 1, extra) != 0) {
        fprintf(stderr, "the cluster did not form\n");
        return 1;
    }
    char key[128], err[512];
    snprintf(key, sizeof(key), "%s/cluster.key", cl.base);
    struct sd_config cfg;
    sd_config_defaults(&cfg);
    snprintf(cfg.cluster_secret_file, sizeof(cfg.cluster_secret_file), "%s", key);
    TH_CHECK(sd_auth_load(&cfg, &secret, err, sizeof(err)) == 0, "the cluster's secret: %s", err);

    char dir[300], ref[400], dump[400], log[2][400];
    snprintf(dir, sizeof(dir), "%s/job", cl.base);
    mkdir(dir, 0755);
    snprintf(dump, sizeof(dump), "%s/params.bin", dir);
    snprintf(ref, sizeof(ref), "%s/ref.bin", dir);
    const char *args[] = {"--world",  "2",  "--plan",       "zero3", "--steps", "60",
                          "--hidden", "32", "--compute-ms", "10",    "--quiet", NULL};
    pid_t r[2];
    for (int i = 0; i < 2; i++) {
        snprintf(log[i], sizeof(log[i]), "%s/rank%d.log", dir, i);
        const char *more[] = {"--dump-params", dump, NULL};
        r[i] = th_spawn_rank(cl.d[i].sock, "victim", i, args, i == 0 ? more : NULL, log[i]);
    }
    usleep(500000);
    forged_hellos();
    for (int i = 0; i < 2; i++) {
        char *t = th_read_file(log[i], NULL);
        TH_CHECK(th_wait(r[i], 120000) == 0, "rank %d beside the forged hellos: %s", i, t ? t : "");
        free(t);
    }
    const char *rargv[] = {MLP_TRAIN_PATH, "--reference",   "--world", "2",        "--plan",
                           "zero3",        "--steps",       "60",      "--hidden", "32",
                           "--quiet",      "--dump-params", ref,       NULL};
    TH_CHECK(th_wait(th_spawn(rargv, NULL), 60000) == 0, "the reference");
    struct th_dump_diff dd;
    TH_CHECK(th_compare_dumps(dump, ref, 1e-5, &dd) && dd.differ == 0,
             "the job's parameters differ from its reference (%zu of %zu)", dd.differ, dd.n);
    TH_CHECK(!log_has(0, "is down") && !log_has(1, "is down"), "a node was declared down");
    char *l0 = th_read_file(cl.d[0].log, NULL);
    int logged = 0;
    for (const char *p = l0; p && (p = strstr(p, "does not prove the cluster's secret")); p++)
        logged++;
    free(l0);
    /* (logged sparsely: the first SD_LOG_SPARSE_BURST of an interval; the count has them all) */
    TH_CHECK(logged >= SD_LOG_SPARSE_BURST, "node 0 logged %d of the 4 forged hellos", logged);
    json_t *topo = th_admin_json(cl.d[0].sock, "topology");
    json_t *hb = json_object_get(topo, "heartbeats");
    long long refused = (long long)json_integer_value(json_object_get(hb, "peers_refused"));
    hb_port0 = (int)json_integer_value(json_object_get(hb, "port"));
    json_decref(topo);
    TH_CHECK(refused >= 4, "node 0 counts %lld refused peers", refused);
    printf("5 forged connections refused (%lld counted), the job trained to its reference, no "
           "node declared down\n",
           refused);

    /* node 1 stops; the forger speaks for it */
    atomic_store(&forging, 1);
    pthread_t t;
    pthread_create(&t, NULL, forger, NULL);
    usleep(200000);
    double t0 = th_now_s();
    kill(cl.d[1].pid, SIGSTOP);
    double down = -1;
    while (th_now_s() - t0 < 15.0 && down < 0) {
        if (log_has(0, "node 1 is down"))
            down = th_now_s() - t0;
        usleep(50000);
    }
    atomic_store(&forging, 0);
    pthread_join(t, NULL);
    kill(cl.d[1].pid, SIGCONT);
    topo = th_admin_json(cl.d[0].sock, "topology");
    long long dropped = (long long)json_integer_value(
        json_object_get(json_object_get(topo, "heartbeats"), "dropped"));
    json_decref(topo);
    printf("node 1 stopped while forged heartbeats arrived: declared down after %.1f s; %lld "
           "datagrams dropped\n",
           down, dropped);
    /* 1.5 s timeout; the link's and the thread's checks run each heartbeat interval */
    TH_CHECK(down > 0 && down < 6.0, "node 1 declared down after %.1f s (timeout 1.5 s)", down);
    TH_CHECK(dropped >= 10, "%lld forged datagrams dropped", dropped);
    TH_CHECK(th_cluster_stop(&cl) == 0, "the daemons did not stop cleanly");
    return th_summary("test_peer_auth");
}

#include "harness.h"
#include "shard.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

double th_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

pid_t th_spawn(const char *const *argv, const char *out_path)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (out_path != NULL) {
            int fd = open(out_path, O_WRONLY | O_CREAT | O_APPEND, 0644);
            if (fd >= 0) {
                dup2(fd, 1);
                dup2(fd, 2);
                close(fd);
            }
        }
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    return pid;
}

int th_wait(pid_t pid, int timeout_ms)
{
    double end = th_now_s() + timeout_ms / 1000.0;
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (r < 0)
            return -2;
        if (th_now_s() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(2000);
    }
}

static bool can_connect(const char *path)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(a.sun_path))
        return false;
    memcpy(a.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

static int daemon_start_in(struct th_daemon *d, const char *const *extra, bool wait_socket);

static char shardd_copy[400], mlp_copy[400];

const char *th_shardd_path(void)
{
    return shardd_copy[0] ? shardd_copy : SHARDD_PATH;
}

const char *th_mlp_train_path(void)
{
    return mlp_copy[0] ? mlp_copy : MLP_TRAIN_PATH;
}

/* src copied to dst with mode 0755 */
static int copy_exec(const char *src, const char *dst)
{
    size_t len = 0;
    char *data = th_read_file(src, &len);
    int fd = data != NULL ? open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0755) : -1;
    bool ok = fd >= 0 && write(fd, data, len) == (ssize_t)len && fchmod(fd, 0755) == 0;
    if (fd >= 0)
        ok &= close(fd) == 0;
    free(data);
    TH_CHECK(ok, "copy %s to %s", src, dst);
    return ok ? 0 : -1;
}

int th_binaries_reachable(const char *dir)
{
    char s[400], m[400];
    if ((mkdir(dir, 0755) != 0 && errno != EEXIST) || chmod(dir, 0755) != 0) {
        TH_CHECK(false, "make %s for the binaries other users run", dir);
        return -1;
    }
    char lib[400], src_lib[400];
    snprintf(s, sizeof(s), "%s/shardd", dir);
    snprintf(m, sizeof(m), "%s/mlp_train", dir);
    snprintf(lib, sizeof(lib), "%s/libshard.so.0", dir);
    snprintf(src_lib, sizeof(src_lib), "%s", LIBSHARD_PATH);
    if (copy_exec(SHARDD_PATH, s) != 0 || copy_exec(MLP_TRAIN_PATH, m) != 0 ||
        copy_exec(src_lib, lib) != 0)
        return -1;
    /* (mlp_train's run path names the build's libshard: the loader looks here first) */
    const char *old = getenv("LD_LIBRARY_PATH");
    char path[1200];
    snprintf(path, sizeof(path), "%s%s%s", dir, old != NULL && old[0] ? ":" : "",
             old != NULL ? old : "");
    setenv("LD_LIBRARY_PATH", path, 1);
    snprintf(shardd_copy, sizeof(shardd_copy), "%s", s);
    snprintf(mlp_copy, sizeof(mlp_copy), "%s", m);
    return 0;
}

/* a command the next daemon starts under (setpriv to another user), or NULL */
static const char *const *daemon_wrap;

int th_daemon_start(struct th_daemon *d, const char *const *extra)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/shardd-test-XXXXXX");
    if (mkdtemp(d->dir) == NULL)
        return -1;
    return daemon_start_in(d, extra, true);
}

int th_daemon_start_as(struct th_daemon *d, const char *const *wrap, uid_t owner,
                       const char *const *extra)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/shardd-test-XXXXXX");
    if (mkdtemp(d->dir) == NULL || chown(d->dir, owner, owner) != 0)
        return -1;
    daemon_wrap = wrap;
    int rc = daemon_start_in(d, extra, true);
    daemon_wrap = NULL;
    return rc;
}

/* ---- network namespaces: one per node, veths on a bridge of the cluster's own */

/* the namespaces and bridge made by this process, removed at its exit if not before */
static struct th_cluster *netns_made;

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    return system(cmd);
}

static void netns_remove(struct th_cluster *c)
{
    if (!c->netns)
        return;
    for (int i = 0; i < c->nodes; i++)
        if (c->ns[i][0] != '\0')
            sh("ip netns del %s 2>/dev/null", c->ns[i]);
    if (c->bridge[0] != '\0')
        sh("ip link del %s 2>/dev/null", c->bridge);
    c->netns = false;
    netns_made = NULL;
}

static void netns_atexit(void)
{
    if (netns_made != NULL)
        netns_remove(netns_made);
}

/* c's namespaces, named after this process: 10.<a>.<b>.<i + 1>/24 for node i */
static int netns_make(struct th_cluster *c, int nodes)
{
    if (geteuid() != 0 || sh("command -v ip >/dev/null 2>&1") != 0)
        return TH_NO_NETNS;
    int pid = (int)getpid(), a = 150 + pid % 50, b = (pid / 50) % 250;
    c->netns = true;
    c->nodes = nodes;
    snprintf(c->bridge, sizeof(c->bridge), "thbr%d", pid);
    /* what a killed test of the same pid left behind goes first */
    for (int i = 0; i < nodes; i++)
        sh("ip netns del thns%d-%d 2>/dev/null", pid, i);
    sh("ip link del %s 2>/dev/null", c->bridge);
    if (sh("ip link add %s type bridge && ip link set %s up", c->bridge, c->bridge) != 0) {
        c->bridge[0] = '\0';
        netns_remove(c);
        return TH_NO_NETNS;
    }
    netns_made = c;
    static bool registered;
    if (!registered)
        atexit(netns_atexit);
    registered = true;
    for (int i = 0; i < nodes; i++) {
        snprintf(c->ns[i], sizeof(c->ns[i]), "thns%d-%d", pid, i);
        snprintf(c->addr[i], sizeof(c->addr[i]), "10.%d.%d.%d", a, b, i + 1);
        char *host = c->veth[i], node[16];
        snprintf(host, sizeof(c->veth[i]), "th%dh%d", pid, i);
        snprintf(node, sizeof(node), "th%dn%d", pid, i);
        if (sh("ip netns add %s && ip link add %s type veth peer name %s && "
               "ip link set %s netns %s && ip link set %s master %s up && "
               "ip netns exec %s ip link set lo up && "
               "ip netns exec %s ip addr add %s/24 dev %s && ip netns exec %s ip link set %s up",
               c->ns[i], host, node, node, c->ns[i], host, c->bridge, c->ns[i], c->ns[i],
               c->addr[i], node, c->ns[i], node) != 0) {
            fprintf(stderr, "cannot make network namespace %s\n", c->ns[i]);
            netns_remove(c);
            return -1;
        }
    }
    return 0;
}

long long th_node_wire_sent(const struct th_cluster *c, int i)
{
    if (!c->netns || i < 0 || i >= c->nodes)
        return -1;
    /* the bridge's side of node i's veth pair receives what the node sends */
    char path[128];
    snprintf(path, sizeof(path), "/sys/class/net/%s/statistics/rx_bytes", c->veth[i]);
    char *text = th_read_file(path, NULL);
    long long v = text != NULL ? atoll(text) : -1;
    free(text);
    return v;
}

/* node i of c with its cluster arguments and extra */
static int cluster_node_start(struct th_cluster *c, int i, const char *const *extra)
{
    char nodes_s[16], k_s[16], coord[64], node_s[16], key[128];
    snprintf(nodes_s, sizeof(nodes_s), "%d", c->nodes);
    snprintf(k_s, sizeof(k_s), "%d", c->k);
    snprintf(coord, sizeof(coord), "%s:%d", c->netns ? c->addr[0] : "127.0.0.1", c->port);
    snprintf(node_s, sizeof(node_s), "%d", i);
    /* the daemons make the cluster's secret themselves (a loopback coordinator) */
    snprintf(key, sizeof(key), "%s/cluster.key", c->base);
    struct th_daemon *d = &c->d[i];
    snprintf(d->dir, sizeof(d->dir), "%s/node%d", c->base, i);
    mkdir(d->dir, 0700);
    const char *args[64] = {"--nodes",
                            nodes_s,
                            "--node",
                            node_s,
                            "--ranks-per-node",
                            k_s,
                            "--coordinator",
                            coord,
                            "--cluster-secret-file",
                            key};
    int n = 10;
    if (c->open) { /* no index but the coordinator's, no node count, no ranks per node */
        const char *open[] = {"--nodes", "0", "--coordinator", coord, "--cluster-secret-file", key,
                              "--node",  "0"};
        n = i == 0 ? 8 : 6;
        memcpy(args, open, sizeof(open));
    }
    char peer_port[16];
    if (c->indep) { /* nothing of a cluster: on loopback a port of its own */
        n = 0;
        snprintf(peer_port, sizeof(peer_port), "%d", c->port + i);
        if (!c->netns) {
            args[n++] = "--peer-port";
            args[n++] = peer_port;
        }
    }
    if (c->netns) { /* its namespace, its address there */
        args[n++] = "--fabric-addr";
        args[n++] = c->addr[i];
    }
    for (int j = 0; extra && extra[j] && n < 62; j++)
        args[n++] = extra[j];
    args[n] = NULL;
    const char *wrap[] = {"/usr/bin/env", "ip", "netns", "exec", c->ns[i], NULL};
    daemon_wrap = c->netns ? wrap : NULL;
    int rc = daemon_start_in(d, args, true);
    daemon_wrap = NULL;
    return rc;
}

int th_cluster_node_restart(struct th_cluster *c, int i, const char *const *extra)
{
    char old[400];
    snprintf(old, sizeof(old), "%s.before-restart", c->d[i].log);
    rename(c->d[i].log, old);
    return cluster_node_start(c, i, extra);
}

/* a cluster that did not form: its daemons go before the next attempt */
static void kill_all(struct th_cluster *c)
{
    for (int i = 0; i < c->nodes; i++)
        if (c->d[i].pid > 0) {
            kill(c->d[i].pid, SIGKILL);
            th_wait(c->d[i].pid, 5000);
            c->d[i].pid = 0;
        }
}

/* the daemon at d logged that it has an address table, within 15 s */
static bool node_formed(const struct th_daemon *d)
{
    for (double end = th_now_s() + 15; th_now_s() < end; usleep(20000)) {
        char *log = th_read_file(d->log, NULL);
        bool formed = log && strstr(log, "nodes formed") != NULL;
        free(log);
        if (formed)
            return true;
    }
    return false;
}

/* a fixed cluster's daemons start at once; an open one's one after the other (numbered in this
 * order by the coordinator) */
static int cluster_start_as(struct th_cluster *c, int nodes, int k, bool open, bool indep,
                            bool netns, const char *const *extra)
{
    char base[64];
    snprintf(base, sizeof(base), "/tmp/shardd-cluster-XXXXXX");
    if (nodes > TH_MAX_NODES || mkdtemp(base) == NULL)
        return -1;
    srand((unsigned)getpid());
    struct th_cluster net = {0};
    if (netns) {
        int rc = netns_make(&net, nodes);
        if (rc != 0) {
            rmdir(base);
            return rc;
        }
        /* the cluster's secret, as an operator copies it to every node (a daemon makes it only
         * for a coordinator on loopback) */
        rc = sh("umask 077 && head -c 32 /dev/urandom > '%s/cluster.key'", base);
        if (rc != 0) {
            netns_remove(&net);
            return -1;
        }
    }
    for (int attempt = 0; attempt < 5; attempt++) {
        memcpy(c, &net, sizeof(*c)); /* the namespaces, if any, and nothing else */
        if (netns)
            netns_made = c;
        memcpy(c->base, base, sizeof(c->base));
        c->nodes = nodes;
        c->k = k;
        c->open = open;
        c->indep = indep;
        c->port = 20000 + rand() % 12000; /* below the kernel's ephemeral ports (32768) */
        int ok = 1;
        for (int i = 0; i < nodes && ok; i++)
            ok = cluster_node_start(c, i, extra) == 0 && (!open || node_formed(&c->d[i]));
        if (ok && (nodes == 1 || open || indep))
            return 0; /* one node, or daemons that meet per job: no cluster to form */
        /* the cluster formed once every node logs it (a member installs the address table
         * a moment after node 0: a registration before that is refused) */
        bool formed = ok;
        for (int i = 0; formed && i < nodes; i++)
            formed = node_formed(&c->d[i]);
        if (formed)
            return 0;
        kill_all(c);
    }
    fprintf(stderr, "cluster of %d nodes did not form; logs under %s\n", nodes, base);
    netns_remove(c);
    return -1;
}

static int cluster_start(struct th_cluster *c, int nodes, int k, bool open, bool netns,
                         const char *const *extra)
{
    return cluster_start_as(c, nodes, k, open, false, netns, extra);
}

int th_indep_cluster_start(struct th_cluster *c, int nodes, bool netns, const char *const *extra)
{
    return cluster_start_as(c, nodes, 0, false, true, netns, extra);
}

const char *th_cluster_leader(const struct th_cluster *c, int i, char *buf, size_t len)
{
    snprintf(buf, len, "%s:%d", c->netns ? c->addr[i] : "127.0.0.1", c->netns ? 7701 : c->port + i);
    return buf;
}

int th_cluster_start(struct th_cluster *c, int nodes, int k, const char *const *extra)
{
    return cluster_start(c, nodes, k, false, false, extra);
}

int th_open_cluster_start(struct th_cluster *c, int nodes, const char *const *extra)
{
    return cluster_start(c, nodes, 0, true, false, extra);
}

int th_netns_cluster_start(struct th_cluster *c, int nodes, const char *const *extra)
{
    return cluster_start(c, nodes, 0, true, true, extra);
}

int th_cluster_stop(struct th_cluster *c)
{
    int bad = 0;
    for (int i = 0; i < c->nodes; i++)
        if (c->d[i].pid > 0) {
            kill(c->d[i].pid, SIGCONT);
            int rc = th_daemon_stop(&c->d[i]);
            if (rc != 0) {
                fprintf(stderr, "node %d: exit code %d\n", i, rc);
                bad++;
            }
        }
    if (c->base[0] != '\0' && bad == 0 && !th_failed) {
        char cmd[128];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", c->base);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", c->base);
    }
    netns_remove(c);
    return bad;
}

static int daemon_start_in(struct th_daemon *d, const char *const *extra, bool wait_socket)
{
    char rundir[300];
    snprintf(rundir, sizeof(rundir), "%s/run", d->dir);
    snprintf(d->sock, sizeof(d->sock), "%s/shardd.sock", rundir);
    snprintf(d->log, sizeof(d->log), "%s/shardd.log", d->dir);
    const char *argv[64];
    int n = 0;
    for (int i = 0; daemon_wrap && daemon_wrap[i] && n < 20; i++)
        argv[n++] = daemon_wrap[i];
    argv[n++] = th_shardd_path();
    argv[n++] = "--runtime-dir";
    argv[n++] = rundir;
    bool backend_named = false;
    for (int i = 0; extra && extra[i] && n < 60; i++) {
        backend_named |= strcmp(extra[i], "--backend") == 0;
        argv[n++] = extra[i];
    }
    /* SHARD_TEST_BACKEND: the backend of every daemon whose test names none (a whole suite run
     * through emu-gpu's device memory, say) */
    const char *backend = getenv("SHARD_TEST_BACKEND");
    if (backend != NULL && backend[0] != '\0' && !backend_named) {
        argv[n++] = "--backend";
        argv[n++] = backend;
    }
    argv[n] = NULL;
    d->pid = th_spawn(argv, d->log);
    double end = th_now_s() + 10.0;
    while (wait_socket && th_now_s() < end) {
        if (can_connect(d->sock))
            return 0;
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            d->pid = 0;
            return -1;
        }
        usleep(5000);
    }
    return -1;
}

bool th_daemon_alive(const struct th_daemon *d)
{
    return d->pid > 0 && kill(d->pid, 0) == 0 && waitpid(d->pid, NULL, WNOHANG) == 0;
}

int th_daemon_stop(struct th_daemon *d)
{
    if (d->pid <= 0)
        return -1;
    kill(d->pid, SIGTERM);
    int rc = th_wait(d->pid, 10000);
    d->pid = 0;
    struct stat st;
    bool sock_gone = stat(d->sock, &st) != 0;
    if (rc != 0 || !sock_gone || th_failed) {
        fprintf(stderr, "daemon exit code %d, socket %s; log %s follows:\n", rc,
                sock_gone ? "removed" : "left behind", d->log);
        char *log = th_read_file(d->log, NULL);
        if (log) {
            size_t len = strlen(log);
            fputs(len > 6000 ? log + len - 6000 : log, stderr);
            free(log);
        }
    } else {
        char cmd[600];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", d->dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", d->dir);
    }
    return sock_gone ? rc : (rc ? rc : 99);
}

char *th_admin(const char *sock, const char *cmd)
{
    char *json = NULL;
    shard_admin(sock, cmd, NULL, &json); /* the document also when the command failed */
    return json;
}

json_t *th_admin_json(const char *sock, const char *cmd)
{
    char *js = th_admin(sock, cmd);
    json_t *doc = js ? json_loads(js, 0, NULL) : NULL;
    free(js);
    return doc;
}

long long th_json_int(json_t *o, const char *path)
{
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", path);
    json_t *cur = o;
    for (char *save = NULL, *tok = strtok_r(buf, ".", &save); tok && cur;
         tok = strtok_r(NULL, ".", &save))
        cur = json_object_get(cur, tok);
    return cur ? (long long)json_integer_value(cur) : -1;
}

json_t *th_job_stats(const char *sock, const char *job)
{
    json_t *found = NULL;
    for (double end = th_now_s() + 10; found == NULL && th_now_s() < end;) {
        json_t *doc = th_admin_json(sock, "stats");
        size_t i;
        json_t *j;
        json_array_foreach(json_object_get(doc, "jobs"), i, j)
        {
            if (strcmp(json_string_value(json_object_get(j, "job")), job) == 0 &&
                !json_is_true(json_object_get(j, "retiring")))
                found = json_incref(j);
        }
        json_decref(doc);
        if (found == NULL)
            usleep(20000);
    }
    return found;
}

bool th_cluster_alive(const struct th_cluster *c, const char *what)
{
    bool alive = true;
    for (int i = 0; i < c->nodes; i++)
        if (!th_daemon_alive(&c->d[i])) {
            TH_CHECK(false, "%s: node %d's daemon is not running (log %s)", what, i, c->d[i].log);
            alive = false;
        }
    return alive;
}

bool th_cluster_train(const struct th_cluster *c, const char *job, const char *const *args,
                      const char *what, double tol, struct th_dump_diff *dd)
{
    const char *dir = c->d[0].dir;
    int world = c->nodes * c->k, rcs[TH_MAX_RANKS + 1];
    if (world > TH_MAX_RANKS) {
        TH_CHECK(false, "%s: %d ranks, the harness trains at most %d", what, world, TH_MAX_RANKS);
        return false;
    }
    if (!th_cluster_alive(c, what))
        return false;
    char dump[400], ref[400];
    snprintf(dump, sizeof(dump), "%s/%s.bin", dir, job);
    snprintf(ref, sizeof(ref), "%s/%s-ref.bin", dir, job);
    const char *socks[TH_MAX_NODES];
    for (int i = 0; i < c->nodes; i++)
        socks[i] = c->d[i].sock;
    if (th_train(dir, job, socks, c->k, world, args, dump, ref, rcs) != 0) {
        for (int rank = 0; rank <= world; rank++)
            TH_CHECK(rcs[rank] == 0, "%s: process %d exit code %d (log %s/%s-%d.log)", what, rank,
                     rcs[rank], dir, job, rank);
        return false;
    }
    bool ok = th_compare_dumps(dump, ref, tol, dd);
    TH_CHECK(ok, "%s: dump sizes", what);
    return ok;
}

long long th_job_params(const char *sock, const char *job)
{
    json_t *doc = th_admin_json(sock, "jobs");
    size_t i;
    json_t *j;
    long long p = -1;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        if (strcmp(json_string_value(json_object_get(j, "name")), job) == 0)
            p = (long long)json_integer_value(json_object_get(j, "parameters"));
    }
    json_decref(doc);
    return p;
}

pid_t th_spawn_rank(const char *sock, const char *job, int rank, const char *const *args,
                    const char *const *more, const char *log)
{
    char rs[16];
    snprintf(rs, sizeof(rs), "%d", rank);
    const char *argv[64] = {MLP_TRAIN_PATH};
    int n = 1;
    if (sock != NULL) { /* else the one-process reference: no daemon, no rank */
        const char *own[] = {"--socket", sock, "--job", job, "--rank", rs};
        for (size_t i = 0; i < sizeof(own) / sizeof(own[0]); i++)
            argv[n++] = own[i];
    }
    for (int i = 0; args != NULL && args[i] != NULL && n < 60; i++)
        argv[n++] = args[i];
    for (int i = 0; more != NULL && more[i] != NULL && n < 62; i++)
        argv[n++] = more[i];
    argv[n] = NULL;
    return th_spawn(argv, log);
}

int th_train(const char *dir, const char *job, const char *const *socks, int k, int world,
             const char *const *args, const char *dump, const char *ref, int *rcs)
{
    pid_t pids[TH_MAX_RANKS + 1];
    if (world > TH_MAX_RANKS)
        return world + 1;
    for (int rank = 0; rank <= world; rank++) {
        char log[400];
        snprintf(log, sizeof(log), "%s/%s-%d.log", dir, job, rank);
        const char *dumps[] = {"--dump-params", dump, NULL};
        const char *reference[] = {"--reference", "--dump-params", ref, NULL};
        if (rank < world)
            pids[rank] =
                th_spawn_rank(socks[rank / k], job, rank, args, rank == 0 ? dumps : NULL, log);
        else
            pids[rank] = th_spawn_rank(NULL, NULL, -1, args, reference, log);
    }
    int failed = 0;
    for (int rank = 0; rank <= world; rank++) {
        rcs[rank] = th_wait(pids[rank], 120000);
        failed += rcs[rank] != 0;
    }
    return failed;
}

bool th_compare_dumps(const char *a_path, const char *b_path, double tol, struct th_dump_diff *d)
{
    size_t na = 0, nb = 0;
    float *a = (float *)(void *)th_read_file(a_path, &na);
    float *b = (float *)(void *)th_read_file(b_path, &nb);
    *d = (struct th_dump_diff){0};
    bool ok = a != NULL && b != NULL && na == nb && na > 0;
    double ss = 0.0;
    for (size_t i = 0; ok && i < na / sizeof(float); i++) {
        double diff = fabs((double)a[i] - b[i]);
        ss += diff * diff;
        d->maxd = fmax(d->maxd, diff);
        d->differ += a[i] != b[i];
        d->outside += !(diff <= tol + tol * fabs(b[i]));
        d->n++;
    }
    d->rms = d->n ? sqrt(ss / (double)d->n) : 0.0;
    free(a);
    free(b);
    return ok;
}

int th_count_in_file(const char *path, const char *text)
{
    char *data = th_read_file(path, NULL);
    int n = 0;
    for (const char *p = data; p != NULL && (p = strstr(p, text)) != NULL; p += strlen(text))
        n++;
    free(data);
    return n;
}

char *th_read_file(const char *path, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    buf[got] = '\0';
    if (len_p)
        *len_p = got;
    return buf;
}

shard_tensor_t *th_many_tensors(uint32_t n, bool dup_last)
{
    static const uint64_t four = 4;
    enum { NAME = 16 };
    shard_tensor_t *ts = calloc(n, sizeof(*ts) + NAME);
    if (ts == NULL)
        return NULL;
    char *names = (char *)(ts + n);
    for (uint32_t i = 0; i < n; i++) {
        char *name = names + (size_t)i * NAME;
        snprintf(name, NAME, "t%u", dup_last && n > 1 && i == n - 1 ? n - 2 : i);
        ts[i] = (shard_tensor_t){.name = name, .ndim = 1, .dims = &four, .unit = i / 8};
    }
    return ts;
}

int th_checkpoint_job(const char *outdir, const char *sock, const char *job, const char *dir,
                      json_t **doc_p)
{
    static int calls;
    char out[400];
    snprintf(out, sizeof(out), "%s/shardctl-%s-%d.json", outdir, job, calls++);
    const char *argv[] = {SHARDCTL_PATH, "--json", "--socket", sock, "checkpoint",
                          "--job",       job,      dir,        NULL};
    int rc = th_wait(th_spawn(argv, out), 120000);
    char *text = th_read_file(out, NULL);
    *doc_p = text ? json_loads(text, 0, NULL) : NULL;
    if (*doc_p == NULL)
        fprintf(stderr, "shardctl checkpoint --job %s: %s\n", job, text ? text : "(no output)");
    free(text);
    return rc;
}

/* attach to sock, register m, detach: the status, the daemon's message in err */
static int attach_register(const char *sock, const shard_model_t *m, char *err, size_t errlen)
{
    shard_ctx_t *ctx = NULL;
    int st = shard_attach(sock, &ctx);
    if (st == 0)
        st = shard_register(ctx, m);
    snprintf(err, errlen, "%s", ctx ? shard_last_error(ctx) : "attach failed");
    if (ctx)
        shard_detach(ctx);
    return st;
}

uint32_t th_daemon_id(const char *sock)
{
    json_t *doc = th_admin_json(sock, "topology");
    const char *id = json_string_value(
        json_object_get(json_array_get(json_object_get(doc, "topology"), 0), "id"));
    uint32_t v = id != NULL ? (uint32_t)strtoul(id, NULL, 16) : 0;
    json_decref(doc);
    return v;
}

int th_register_secret(const char *sock, const char *job, uint32_t rank, uint32_t world,
                       const char *secret, const char *leader, char *err, size_t errlen)
{
    uint64_t dims[1] = {1536};
    shard_tensor_t t = {.name = "w", .ndim = 1, .dims = dims, .dtype = SHARD_FP32};
    shard_model_t m = {.job = job,
                       .rank = rank,
                       .world = world,
                       .plan = "zero3",
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 0.1f},
                       .ranks_per_node = 1,
                       .job_secret = secret,
                       .job_secret_len = strlen(secret),
                       .leader = leader};
    return attach_register(sock, &m, err, errlen);
}

int th_register_one(const char *sock, const char *job, uint32_t rank, uint32_t world,
                    uint32_t ranks_per_node, char *err, size_t errlen)
{
    uint64_t dims[1] = {1536};
    shard_tensor_t t = {.name = "x", .ndim = 1, .dims = dims, .dtype = SHARD_FP32, .unit = 0};
    shard_model_t m = {.job = job,
                       .rank = rank,
                       .world = world,
                       .plan = "zero3",
                       .tensors = &t,
                       .n_tensors = 1,
                       .optimizer = {.name = "sgd", .lr = 0.1f},
                       .ranks_per_node = ranks_per_node};
    const char *secret = getenv("TH_JOB_SECRET");
    if (secret != NULL && strlen(secret) >= 16) {
        m.job_secret = secret;
        m.job_secret_len = strlen(secret);
    }
    return attach_register(sock, &m, err, errlen);
}

/* shardd: the per-node daemon. */
#include "cluster/cluster.h"
#include "fetch.h"
#include "schedule.h"
#include "step.h"
#include "file_pool.h"
#include "net_service.h"
#include "metrics.h"
#include "notify.h"
#include "resume.h"
#include "jobs.h"
#include "registry.h"
#include "server.h"
#include "transport/transport.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <dirent.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *out)
{
    fprintf(out,
            "usage: shardd [--config FILE] [--node N] [--runtime-dir DIR] [--OPTION VALUE ...]\n"
            "\n"
            "The shardd per-node daemon: holds sharded model states of training jobs and serves\n"
            "the trainer processes of this node through libshard (Unix socket + shared memory).\n"
            "Without --config it runs one node on the host backend with the defaults below.\n"
            "Command-line options override the config file; '-' and '_' are interchangeable.\n"
            "\n"
            "  --config FILE   JSON object of options\n"
            "  --help          this text\n"
            "  --version       print the version\n"
            "\n");
    sd_config_print_help(out);
    char built[128];
    sd_gpu_list(built, sizeof(built));
    fprintf(out, "\nDevice backends built in: %s.\n", built);
    fprintf(out, "Signals: SIGTERM or SIGINT shut down cleanly.\n");
#ifdef SD_TEST_HOOKS
    fprintf(out, "This build has the test hooks (-DSHARD_TEST_HOOKS=ON): it reads the "
                 "SHARDD_TEST_* variables; build without them for production.\n");
#endif
}

/* Open file descriptors as a bitmap, to name any that are leaked at exit. */
#define FD_TRACK 4096
static int fd_snapshot(unsigned char *set)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (d == NULL)
        return -1;
    memset(set, 0, FD_TRACK / 8);
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == dirfd(d) || fd >= FD_TRACK)
            continue;
        set[fd / 8] |= (unsigned char)(1u << (fd % 8));
        n++;
    }
    closedir(d);
    return n;
}

static int report_leaked_fds(const unsigned char *before)
{
    unsigned char after[FD_TRACK / 8];
    int leaked = 0;
    if (fd_snapshot(after) < 0)
        return 0;
    for (int fd = 0; fd < FD_TRACK; fd++) {
        if (!(after[fd / 8] & (1u << (fd % 8))) || (before[fd / 8] & (1u << (fd % 8))))
            continue;
        char path[64], target[256] = "?";
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
        ssize_t n = readlink(path, target, sizeof(target) - 1);
        target[n > 0 ? n : 1] = '\0';
        SD_ERROR("main", "leaked file descriptor %d -> %s", fd, target);
        leaked++;
    }
    return leaked;
}

struct app {
    struct sd_server srv;
    struct sd_registry *reg;
    uv_loop_t *loop;
    bool fabric_failed; /* an independent daemon's fabric could not open: why */
    char fabric_err[512];
    struct sd_transport *tp;
    struct sd_cluster *cl;
    /* an independent daemon's fabric, closed after fabric_idle_close_ms without jobs: the
     * timer that looks, since when it has none, and the closed cluster whose handles the loop
     * closes before its memory goes */
    uv_timer_t fabric_idle;
    uint64_t idle_since_ns;
    struct sd_cluster *retired[8];
    uint32_t n_retired;
    uv_timer_t reap;
    uv_signal_t sigterm, sigint, sigusr1;
    uv_check_t fatal_check;
    struct sd_notify notify;   /* systemd's (inited: from READY on) */
    struct sd_metrics metrics; /* GET /metrics (metrics_listen) */
    bool notify_on;
    unsigned stall_ms; /* SHARDD_TEST_STALL_MS: SIGUSR1 holds the loop this long (tests) */
};

/* systemd's STATUS=: the jobs by state, the clients, the peers up */
static void app_status(void *arg, char *buf, size_t len)
{
    const struct app *app = arg;
    uint32_t running = 0, paused = 0, failed = 0, other = 0;
    for (const struct sd_job *job = app->reg->jobs; job != NULL; job = job->next) {
        if (sd_resume_paused(job))
            paused++;
        else if (job->state == SD_JOB_READY)
            running++;
        else if (job->state == SD_JOB_FAILED)
            failed++;
        else
            other++;
    }
    int off = snprintf(buf, len,
                       "jobs: %u running, %u paused, %u failed, %u starting or ending; "
                       "%u clients",
                       running, paused, failed, other, app->srv.n_sessions);
    if (app->cl != NULL && off > 0 && (size_t)off < len) {
        uint32_t nodes = sd_cluster_nodes(app->cl), self = sd_cluster_self(app->cl), up = 0;
        for (uint32_t i = 0; i < nodes; i++)
            up += i != self && sd_cluster_alive(app->cl, i);
        snprintf(buf + off, len - (size_t)off, "; peers: %u of %u up", up,
                 nodes > 0 ? nodes - 1 : 0);
    }
}

/* Shut down in an order that keeps memory alive while the fabric may write into it: control
 * links, the standing receives, the endpoint, then jobs and their memory. */
static void app_stop(struct app *app)
{
    if (app->notify_on)
        sd_notify_stopping(&app->notify);
    sd_metrics_stop(&app->metrics);
    uv_timer_stop(&app->fabric_idle);
    uv_close((uv_handle_t *)&app->fabric_idle, NULL);
    uv_close((uv_handle_t *)&app->reap, NULL); /* (main frees the retired cluster) */
    if (app->cl != NULL)
        sd_cluster_stop(app->cl);
    if (app->tp != NULL) { /* no more progress, no more writes into job memory */
        sd_server_detach_transport(&app->srv);
        app->tp->ops->quiesce(app->tp);
    }
    sd_server_stop(&app->srv); /* frees every job, deregistering its memory */
    if (app->tp != NULL) {
        sd_net_stop(app->reg);
        app->tp->ops->close(app->tp);
        app->tp = NULL;
    }
    uv_signal_stop(&app->sigterm);
    uv_signal_stop(&app->sigint);
    uv_signal_stop(&app->sigusr1);
    uv_close((uv_handle_t *)&app->sigterm, NULL);
    uv_close((uv_handle_t *)&app->sigint, NULL);
    uv_close((uv_handle_t *)&app->sigusr1, NULL);
    uv_check_stop(&app->fatal_check);
    uv_close((uv_handle_t *)&app->fatal_check, NULL);
}

/* The cluster could not form (refused, rendezvous deadline): stop with an error. */
static void fatal_check_cb(uv_check_t *h)
{
    struct app *app = h->data;
    if (sd_cluster_fatal(app->cl) && !app->srv.stopping)
        app_stop(app);
}

static void on_signal(uv_signal_t *h, int signum)
{
    struct app *app = h->data;
    SD_INFO("main", "signal %d: shutting down", signum);
    app_stop(app);
}

#ifdef SD_TEST_HOOKS
/* A test hook: the event loop held up, as a long piece of work on it would (the heartbeat
 * thread must keep the node in the cluster meanwhile). */
static void on_stall(uv_signal_t *h, int signum)
{
    struct app *app = h->data;
    (void)signum;
    SD_WARN("main", "SIGUSR1: holding the event loop for %u ms (SHARDD_TEST_STALL_MS)",
            app->stall_ms);
    usleep(app->stall_ms * 1000u);
    SD_WARN("main", "the event loop runs again");
}
#endif

static int parse_args(int argc, char **argv, struct sd_config *cfg)
{
    char err[512];
    const char *config_file = NULL;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            config_file = argv[i + 1];
    if (config_file != NULL && sd_config_load_file(cfg, config_file, err, sizeof(err)) != SD_OK) {
        fprintf(stderr, "shardd: %s\n", err);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(a, "--version") == 0) {
            printf("shardd %s\n", SHARD_VERSION);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0') {
            fprintf(stderr, "shardd: unexpected argument '%s' (see shardd --help)\n", a);
            return 2;
        }
        char name[64];
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (nlen >= sizeof(name)) {
            fprintf(stderr, "shardd: unknown option '%s' (see shardd --help)\n", a);
            return 2;
        }
        memcpy(name, a + 2, nlen);
        name[nlen] = '\0';
        for (char *p = name; *p; p++)
            if (*p == '-')
                *p = '_';
        const char *value = eq ? eq + 1 : (i + 1 < argc ? argv[++i] : NULL);
        if (value == NULL) {
            fprintf(stderr, "shardd: option --%s needs a value\n", name);
            return 2;
        }
        if (strcmp(name, "config") == 0)
            continue;
        if (sd_config_set(cfg, name, value, err, sizeof(err)) != SD_OK) {
            fprintf(stderr, "shardd: %s\n", err);
            return 2;
        }
    }
    if (cfg->nodes > 1 && cfg->ranks_per_node == 0) {
        fprintf(stderr,
                "shardd: a cluster of %lld nodes needs ranks_per_node (the ranks of "
                "each node)\n",
                (long long)cfg->nodes);
        return 2;
    }
    if (cfg->resume_timeout_ms > cfg->max_resume_timeout_ms) {
        fprintf(stderr, "shardd: resume_timeout_ms %lld is above max_resume_timeout_ms %lld\n",
                (long long)cfg->resume_timeout_ms, (long long)cfg->max_resume_timeout_ms);
        return 2;
    }
    if (cfg->nodes == 0 && cfg->node > 0) {
        fprintf(stderr,
                "shardd: option 'node' is %lld in an open cluster (nodes 0): give 0 to the "
                "coordinator, and no node to the others (the coordinator numbers them)\n",
                (long long)cfg->node);
        return 2;
    }
    if (cfg->nodes > 0 && cfg->node < 0)
        cfg->node = 0;
    if (cfg->nodes > 0 && cfg->node >= cfg->nodes) {
        fprintf(stderr, "shardd: option 'node' is %lld but there are only %lld nodes\n",
                (long long)cfg->node, (long long)cfg->nodes);
        return 2;
    }
    return 0;
}

/* SIGTERM and SIGINT wait for the loop's handlers, from the process's first instruction on.
 * The libraries libfabric loads install their own before main runs: libinfinipath's (a
 * dependency of the psm providers) calls exit() from the handler, which a SIGTERM during
 * startup ran in the middle of whatever the process was doing (seen hanging in a
 * pthread_create under ASan, whose leak check waited on the thread registry the interrupted
 * call held). Blocked here, in the executable's preinit array, which runs before any shared
 * library's constructor, the signals stay pending through the libraries' constructors and
 * main's start, are blocked in every thread started meanwhile, and arrive in the main thread
 * once the loop's handlers are installed and main unblocks them. */
static void mask_stop_signals(int how)
{
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    pthread_sigmask(how, &stop_signals, NULL);
}

static void block_stop_signals_at_exec(int argc, char **argv, char **envp)
{
    (void)argc;
    (void)argv;
    (void)envp;
    mask_stop_signals(SIG_BLOCK);
}

__attribute__((used, section(".preinit_array"))) static void (*const preinit_block)(
    int, char **, char **) = block_stop_signals_at_exec;

/* Open the backend on the GPUs config devices lists (each once; empty: every GPU it sees) and
 * fill the cycle local ranks take their GPU from (rank_dev[i mod n]): the list as given, else
 * the GPUs opened in order, else GPU 0 (a backend without devices). */
static int open_backend(const struct sd_gpu_ops *dev, const struct sd_config *cfg, int *rank_dev,
                        int *n_p, char *why, size_t len)
{
    int n = sd_config_devices(cfg->devices, rank_dev, SD_CONFIG_MAX_DEVICES, why, len);
    if (n < 0)
        return n;
    int distinct[SD_CONFIG_MAX_DEVICES], nd = 0;
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int j = 0; j < nd; j++)
            seen |= distinct[j] == rank_dev[i];
        if (!seen)
            distinct[nd++] = rank_dev[i];
    }
    if (dev->open == NULL) {
        if (nd > 1 || (nd == 1 && distinct[0] != 0)) {
            snprintf(why, len,
                     "devices names GPU %d, and backend '%s' drives no GPU (devices empty or 0)",
                     nd > 1 && distinct[0] == 0 ? distinct[1] : distinct[0], dev->name);
            return SD_ECONFIG;
        }
        rank_dev[0] = 0;
        *n_p = 1;
        return SD_OK;
    }
    if (nd > SD_GPU_MAX_DEVICES) {
        snprintf(why, len, "devices names %d GPUs; one shardd drives at most %d", nd,
                 SD_GPU_MAX_DEVICES);
        return SD_ECONFIG;
    }
    int st = dev->open(distinct, nd, why, len);
    if (st != SD_OK)
        return st;
    if (n == 0) { /* local rank i on the i-th GPU seen, mod their count */
        struct sd_gpu_device d[SD_GPU_MAX_DEVICES];
        int seen = dev->devices != NULL ? dev->devices(d, SD_GPU_MAX_DEVICES) : 0;
        for (int i = 0; i < seen && i < SD_GPU_MAX_DEVICES; i++)
            if (d[i].driven)
                rank_dev[n++] = d[i].index;
        if (n == 0)
            rank_dev[n++] = 0;
    }
    *n_p = n;
    return SD_OK;
}

/* the operations the schedule drives (schedule.h): bound here, above them all */
static const struct sd_sched_driver sched_driver = {.prefetch = sd_fetch_prefetch,
                                                    .flush = sd_fetch_prefetch_flush,
                                                    .would_join = sd_fetch_would_join,
                                                    .fenced_poll = sd_fetch_fenced_poll,
                                                    .fenced_blocked = sd_fetch_fenced_blocked,
                                                    .step_running = sd_step_running};

static struct app *the_app; /* (a job may open the fabric after the start: open_fabric) */

/* the clusters close_fabric retired, once the loop ran their handles' close callbacks */
static void reap_cb(uv_timer_t *h)
{
    struct app *app = h->data;
    for (uint32_t i = 0; i < app->n_retired; i++)
        sd_cluster_free(app->retired[i]);
    app->n_retired = 0;
    /* the provider's pools went back to malloc: to the kernel now (glibc's dynamic mmap
     * threshold serves the pools of a reopened fabric from the heap, which free keeps) */
    malloc_trim(0);
}

/* An independent daemon's fabric and control plane, closed (with no job here, active or
 * retiring: none holds memory registered with it): ofi_rxm's
 * buffer pools go back (about 280 MB on tcp), and the peer links and the heartbeats stop. The
 * next job across nodes opens them again, and the daemon meets its peers as a restarted one
 * would (a new key, a new id). A cluster's daemon keeps them: its peers count on it. */
static void close_fabric(struct app *app)
{
    uv_timer_stop(&app->fabric_idle);
    if (app->cl != NULL)
        sd_cluster_stop(app->cl);
    if (app->tp != NULL) {
        sd_server_detach_transport(&app->srv);
        app->tp->ops->quiesce(app->tp);
        sd_net_stop(app->reg);
        app->tp->ops->close(app->tp);
        app->tp = NULL;
    }
    /* the handles it closed call back at the end of this turn of the loop (a timer started
     * now, even of 0 ms, may run in this turn's timer phase: 100 ms is past it) */
    if (app->cl != NULL && app->n_retired < sizeof(app->retired) / sizeof(app->retired[0]))
        app->retired[app->n_retired++] = app->cl;
    else if (app->cl != NULL) /* (8 closes within 100 ms: each needs a job to open it) */
        SD_WARN("main", "a closed cluster's memory is kept: %u wait to be freed", app->n_retired);
    /* the ended jobs shardctl still lists named their daemons by the closed cluster's numbers,
     * which the next opening gives to others: they keep the daemons' ids instead */
    for (struct sd_job *job = app->reg->finished; job != NULL; job = job->next) {
        for (uint32_t n = 0; n < job->nodes && !job->xfer.node_ids_are_daemon_ids; n++)
            job->xfer.node_ids[n] = job->xfer.node_ids[n] == SD_NODE_UNKNOWN
                                        ? 0
                                        : sd_cluster_daemon_id(app->cl, job->xfer.node_ids[n]);
        job->xfer.node_ids_are_daemon_ids = true;
    }
    app->cl = NULL;
    uv_timer_start(&app->reap, reap_cb, 100, 0);
    app->reg->fabric_closes++;
}

/* fabric_idle_close_ms after the last job here went, the fabric closes */
static void fabric_idle_cb(uv_timer_t *h)
{
    struct app *app = h->data;
    const struct sd_registry *reg = app->reg;
    if (reg->n_jobs > 0 || reg->zombies != NULL || reg->stuck_jobs > 0 || app->srv.stopping) {
        app->idle_since_ns = 0;
        return;
    }
    uint64_t now = sd_now_ns();
    if (app->idle_since_ns == 0)
        app->idle_since_ns = now;
    if (now - app->idle_since_ns < (uint64_t)reg->cfg->fabric_idle_close_ms * 1000000ULL)
        return;
    SD_INFO("main",
            "no job for %lld ms: the fabric and the peer links are closed until a job "
            "spans nodes again (fabric_idle_close_ms)",
            (long long)reg->cfg->fabric_idle_close_ms);
    close_fabric(app);
}

/* The fabric and the control plane, once: a cluster's at the start, an independent daemon's
 * when a job first spans nodes (sd_registry.open_fabric). */
static int open_fabric(struct sd_registry *reg, char *err, size_t errlen)
{
    struct app *app = the_app;
    const struct sd_config *cfg = reg->cfg;
    if (app->cl != NULL && !app->fabric_failed)
        return SD_OK;
    if (app->fabric_failed || (cfg->nodes == 1 && strcmp(cfg->provider, "none") == 0)) {
        snprintf(err, errlen,
                 "this daemon has no fabric (provider %s%s%s): it serves jobs on "
                 "its own node only",
                 cfg->provider, app->fabric_failed ? ": " : "",
                 app->fabric_failed ? app->fabric_err : "");
        return SD_ENOSYS;
    }
    err[0] = '\0';
    int status = sd_transport_ofi_open(cfg, reg->dev, &app->tp, err, errlen);
    if (status == SD_OK)
        status = sd_net_start(reg, app->tp, NULL, sd_fetch_on_request);
    struct sd_cluster_events ev;
    sd_jobs_cluster_events(reg, &ev);
    if (status == SD_OK)
        status = sd_cluster_start(&app->cl, app->loop, cfg, app->tp, &ev);
    if (status != SD_OK) {
        if (err[0] == '\0')
            snprintf(err, errlen, "%s", sd_status_str(status));
        if (cfg->nodes == 1) { /* (the start's failure ends a cluster's daemon instead) */
            SD_ERROR("main", "cannot open the fabric for jobs across nodes: %s", err);
            snprintf(app->fabric_err, sizeof(app->fabric_err), "%s", err);
            app->fabric_failed = true;
            sd_cluster_stop(app->cl);
        }
        return status;
    }
    sd_net_set_cluster(reg, app->cl);
    if (sd_server_attach_transport(&app->srv, app->tp) != SD_OK) {
        snprintf(err, errlen, "out of memory");
        close_fabric(app);
        return SD_ENOMEM;
    }
    if (cfg->nodes == 1) {
        SD_INFO("main", "a job spans nodes: the fabric (%s) and the peer links are open",
                cfg->provider);
        if (cfg->fabric_idle_close_ms > 0) {
            uint64_t period = (uint64_t)SD_MIN(1000, SD_MAX(cfg->fabric_idle_close_ms / 4, 10));
            app->idle_since_ns = 0;
            uv_timer_start(&app->fabric_idle, fabric_idle_cb, period, period);
        }
    }
    return SD_OK;
}

int main(int argc, char **argv)
{
    static struct sd_config cfg;
    static struct sd_registry reg;
    static struct app app;
    static unsigned char fds_at_start[FD_TRACK / 8];

    sd_config_defaults(&cfg);
    int r = parse_args(argc, argv, &cfg);
    if (r != 0)
        return r == 1 ? 0 : r;
    sd_log_level = sd_log_level_parse(cfg.log_level);
    signal(SIGPIPE, SIG_IGN);
    mask_stop_signals(SIG_BLOCK); /* again: a loader that skipped the preinit array (none known) */

    const struct sd_gpu_ops *dev = sd_gpu_find(cfg.backend);
    if (dev == NULL) {
        char built[128];
        sd_gpu_list(built, sizeof(built));
        fprintf(stderr, "shardd: backend '%s' is not built into this shardd (built in: %s)\n",
                cfg.backend, built);
        return 2;
    }
    char why[512];
    int rank_dev[SD_CONFIG_MAX_DEVICES], n_rank_dev = 0;
    if (open_backend(dev, &cfg, rank_dev, &n_rank_dev, why, sizeof(why)) != SD_OK) {
        fprintf(stderr, "shardd: backend '%s' cannot start: %s\n", cfg.backend, why);
        return 2;
    }
    uv_loop_t loop;
    uv_loop_init(&loop);
    /* libuv's signal pipe lives as long as the process: take the baseline after it exists */
    uv_signal_init(&loop, &app.sigterm);
    uv_signal_init(&loop, &app.sigint);
    uv_signal_init(&loop, &app.sigusr1);
    uv_timer_init(&loop, &app.fabric_idle);
    uv_timer_init(&loop, &app.reap);
    app.fabric_idle.data = app.reap.data = &app;
    fd_snapshot(fds_at_start);
    sd_registry_init(&reg, &cfg, dev);
    reg.loop = &loop;
    memcpy(reg.rank_dev, rank_dev, sizeof(rank_dev));
    reg.n_rank_dev = (uint32_t)n_rank_dev;
    reg.sched_driver = &sched_driver;
    int status = sd_server_start(&app.srv, &loop, &cfg, &reg);
    if (status != SD_OK) {
        fprintf(stderr, "shardd: cannot start: %s\n", sd_status_str(status));
        uv_close((uv_handle_t *)&app.sigterm, NULL);
        uv_close((uv_handle_t *)&app.sigint, NULL);
        uv_close((uv_handle_t *)&app.sigusr1, NULL);
        uv_close((uv_handle_t *)&app.fabric_idle, NULL);
        uv_close((uv_handle_t *)&app.reap, NULL);
        uv_run(&loop, UV_RUN_DEFAULT);
        uv_loop_close(&loop);
        return 1;
    }
#ifdef SD_TEST_HOOKS /* tests only: the start held with its socket up, before the loop's           \
                      * signal handlers exist (a SIGTERM in that window must end it cleanly) */
    const char *start_stall = getenv("SHARDD_TEST_START_STALL_MS");
    if (start_stall != NULL)
        usleep((useconds_t)strtoul(start_stall, NULL, 10) * 1000u);
#endif
    /* the jobs' file work, off the loop (nothing runs on the loop before uv_run) */
    if (sd_file_pool_start(&reg.files, &loop, (uint32_t)cfg.checkpoint_workers) != SD_OK) {
        fprintf(stderr, "shardd: cannot start the file workers\n");
        return 1;
    }
    app.sigterm.data = app.sigint.data = &app;
    uv_signal_start(&app.sigterm, on_signal, SIGTERM);
    uv_signal_start(&app.sigint, on_signal, SIGINT);
    mask_stop_signals(SIG_UNBLOCK); /* one that came meanwhile arrives now */
#ifdef SD_TEST_HOOKS /* tests only (SHARD_TEST_HOOKS): SIGUSR1 holds the loop that long */
    const char *stall = getenv("SHARDD_TEST_STALL_MS");
    app.stall_ms = stall ? (unsigned)strtoul(stall, NULL, 10) : 0;
    app.sigusr1.data = &app;
    if (app.stall_ms > 0)
        uv_signal_start(&app.sigusr1, on_stall, SIGUSR1);
#endif
    app.reg = &reg;
    uv_check_init(&loop, &app.fatal_check);
    app.fatal_check.data = &app;
    uv_check_start(&app.fatal_check, fatal_check_cb);
    /* Prometheus' endpoint (off unless metrics_listen names an address) */
    char metrics_why[256];
    if (sd_metrics_start(&app.metrics, &loop, cfg.metrics_listen, sd_metrics_exposition, &app.srv,
                         metrics_why, sizeof(metrics_why)) != SD_OK) {
        fprintf(stderr, "shardd: cannot start: %s\n", metrics_why);
        app_stop(&app);
        uv_run(&loop, UV_RUN_DEFAULT);
        uv_loop_close(&loop);
        return 1;
    }
    app.srv.metrics_at = app.metrics.bound;
    /* a fixed cluster of several, or an open one: its fabric and control plane now; an
     * independent daemon (nodes 1) opens them when a job first spans nodes (reg.open_fabric) */
    app.loop = &loop;
    the_app = &app;
    reg.open_fabric = open_fabric;
    if (cfg.nodes != 1) {
        char err[512] = "";
        status = open_fabric(&reg, err, sizeof(err));
        if (status != SD_OK) {
            fprintf(stderr, "shardd: cannot join the cluster: %s\n",
                    err[0] ? err : sd_status_str(status));
            app_stop(&app);
            uv_run(&loop, UV_RUN_DEFAULT);
            sd_cluster_free(app.cl);
            uv_loop_close(&loop);
            return 1;
        }
    }
    if (cfg.nodes == 1)
        SD_INFO("main", "shardd %s, an independent daemon, backend %s, pid %d", SHARD_VERSION,
                cfg.backend, (int)getpid());
    else if (cfg.nodes == 0)
        SD_INFO("main", "shardd %s, %s of an open cluster, backend %s, pid %d", SHARD_VERSION,
                cfg.node == 0 ? "the coordinator" : "a member (numbered when it joins)",
                cfg.backend, (int)getpid());
    else
        SD_INFO("main", "shardd %s node %lld/%lld, backend %s, pid %d", SHARD_VERSION,
                (long long)cfg.node, (long long)cfg.nodes, cfg.backend, (int)getpid());
    sd_notify_init(&app.notify, &loop, app_status, &app);
    app.notify_on = true;
    sd_notify_ready(&app.notify);

    uv_run(&loop, UV_RUN_DEFAULT);
    bool fatal = sd_cluster_fatal(app.cl);
    if (!app.srv.stopping) /* uv_stop from the cluster */
        app_stop(&app);
    uv_run(&loop, UV_RUN_DEFAULT);
    sd_cluster_free(app.cl);
    for (uint32_t i = 0; i < app.n_retired; i++)
        sd_cluster_free(app.retired[i]);
    sd_notify_close(&app.notify);
    int rc = uv_loop_close(&loop) == 0 ? 0 : 3;
    if (rc != 0)
        SD_ERROR("main", "event loop still had open handles at exit");
    if (reg.stuck_jobs > 0) {
        /* file tasks stuck in a filesystem hold their jobs' memory and files: not leaks */
        SD_WARN("main", "exiting with %u jobs left to file tasks stuck in a filesystem",
                reg.stuck_jobs);
        return rc;
    }
    if (report_leaked_fds(fds_at_start) > 0)
        rc = 4;
    if (reg.n_jobs != 0 || reg.used != 0) {
        SD_ERROR("main", "%u jobs / %llu bytes still accounted at exit", reg.n_jobs,
                 (unsigned long long)reg.used);
        rc = 5;
    }
    if (fatal) {
        SD_ERROR("main", "could not join the cluster");
        return 1;
    }
    if (rc == 0)
        SD_INFO("main", "clean shutdown");
    return rc;
}

/* What GET /metrics answers (metrics.h): the daemon's and its jobs' counters in Prometheus' text
 * exposition format (version 0.0.4). The same numbers shardctl stats and status show, under
 * Prometheus' names: a shardd_ prefix, base units (_bytes, _seconds), _total on counters;
 * labels job, op, link, state, kind, gpu. A finished job's series stay metrics_job_grace_s, so
 * the answer grows with the jobs served, never with the jobs seen. */
#include "metrics.h"
#include "cluster/cluster.h"
#include "hop.h"
#include "job_mem.h"
#include "net.h"
#include "resume.h"
#include "secondary.h"
#include "server.h"
#include "sd/http.h"
#include "sd/util.h"
#include "transport/transport.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static void family(struct sd_text *t, const char *name, const char *type, const char *help)
{
    sd_text_printf(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(struct sd_text *t, const char *name, const char *help, double v)
{
    family(t, name, "gauge", help);
    sd_text_printf(t, "%s %.17g\n", name, v);
}

static void counter(struct sd_text *t, const char *name, const char *help, uint64_t v)
{
    family(t, name, "counter", help);
    sd_text_printf(t, "%s %llu\n", name, (unsigned long long)v);
}

/* the jobs a scrape shows: active, retiring, and finished within the grace */
struct shown {
    const struct sd_job **job;
    char (*label)[160]; /* job="name" (escaped) */
    uint8_t *list;      /* 0: active, 1: retiring, 2: finished */
    uint32_t n;
};

static bool collect(const struct sd_server *srv, struct shown *s)
{
    const struct sd_registry *reg = srv->reg;
    uint64_t now = sd_now_ns(), grace = (uint64_t)srv->cfg->metrics_job_grace_s * 1000000000ULL;
    const struct sd_job *lists[3] = {reg->jobs, reg->zombies, reg->finished};
    uint32_t cap = 0;
    for (int li = 0; li < 3; li++)
        for (const struct sd_job *j = lists[li]; j != NULL; j = j->next)
            cap++;
    memset(s, 0, sizeof(*s));
    s->job = calloc(cap + 1, sizeof(*s->job));
    s->label = calloc(cap + 1, sizeof(*s->label));
    s->list = calloc(cap + 1, sizeof(*s->list));
    if (s->job == NULL || s->label == NULL || s->list == NULL)
        return false;
    for (int li = 0; li < 3; li++)
        for (const struct sd_job *j = lists[li]; j != NULL; j = j->next) {
            if (li == 2 && now - j->stats.ended_ns > grace)
                continue;
            char esc[140];
            sd_prom_escape(esc, sizeof(esc), j->name);
            snprintf(s->label[s->n], sizeof(s->label[0]), "job=\"%s\"", esc);
            s->list[s->n] = (uint8_t)li;
            s->job[s->n++] = j;
        }
    return true;
}

static const char *job_state(const struct sd_job *job, bool retiring)
{
    if (retiring)
        return "retiring";
    return sd_resume_paused(job) ? "paused" : sd_job_state_name(job->state);
}

static void daemon_metrics(const struct sd_server *srv, struct sd_text *t)
{
    const struct sd_registry *reg = srv->reg;
    const struct sd_config *cfg = srv->cfg;
    family(t, "shardd_build_info", "gauge",
           "The daemon's version, device backend and fabric provider (always 1).");
    sd_text_printf(t, "shardd_build_info{version=\"%s\",backend=\"%s\",provider=\"%s\"} 1\n",
                   SHARD_VERSION, cfg->backend, cfg->provider);
    /* (an independent daemon opens it for jobs across nodes, and closes it when none is left) */
    gauge(t, "shardd_fabric_open", "1 while the fabric and the peer links are open.",
          srv->tp != NULL);
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    double up_s = (double)(sd_now_ns() - srv->start_ns) / 1e9;
    gauge(t, "shardd_start_time_seconds", "When the daemon started, in seconds since the epoch.",
          (double)rt.tv_sec + (double)rt.tv_nsec / 1e9 - up_s);
    gauge(t, "shardd_sessions", "Trainer processes and shardctl connections attached.",
          srv->n_sessions);
    /* jobs by the state shardctl jobs shows */
    static const char *const states[] = {"registering", "loading",  "running", "failed",
                                         "closing",     "finished", "paused",  "retiring"};
    uint32_t counts[8] = {0};
    for (const struct sd_job *j = reg->jobs; j; j = j->next) {
        const char *state = job_state(j, false);
        for (int i = 0; i < 8; i++)
            counts[i] += strcmp(state, states[i]) == 0;
    }
    for (const struct sd_job *j = reg->zombies; j; j = j->next)
        counts[7]++;
    family(t, "shardd_jobs", "gauge",
           "Jobs this daemon serves, by state (retiring: every rank left, transfers still "
           "hold its memory).");
    for (int i = 0; i < 8; i++)
        if (i != 5)
            sd_text_printf(t, "shardd_jobs{state=\"%s\"} %u\n", states[i], counts[i]);
    gauge(t, "shardd_memory_budget_bytes", "Bytes all jobs together may allocate (memory_budget).",
          (double)reg->budget);
    gauge(t, "shardd_memory_used_bytes",
          "Bytes the jobs hold now, host and device together (shardd_job_memory_bytes by kind).",
          (double)reg->used);
    struct sd_gpu_device d[SD_GPU_MAX_DEVICES];
    int n = reg->dev->devices != NULL ? reg->dev->devices(d, SD_GPU_MAX_DEVICES) : 0;
    if (n > 0) {
        family(t, "shardd_gpu_memory_bytes", "gauge", "Each GPU's memory.");
        for (int i = 0; i < n && i < SD_GPU_MAX_DEVICES; i++)
            sd_text_printf(t, "shardd_gpu_memory_bytes{gpu=\"%d\"} %llu\n", d[i].index,
                           (unsigned long long)d[i].memory_bytes);
        family(t, "shardd_gpu_memory_used_bytes", "gauge",
               "Device memory the daemon holds on each GPU.");
        for (int i = 0; i < n && i < SD_GPU_MAX_DEVICES; i++)
            sd_text_printf(t, "shardd_gpu_memory_used_bytes{gpu=\"%d\"} %llu\n", d[i].index,
                           (unsigned long long)d[i].used_bytes);
    }
    gauge(t, "shardd_control_memory_bytes",
          "Receive buffers and queued replies of every client connection "
          "(control_memory_bytes bounds them).",
          (double)srv->ctl_bytes);
    counter(t, "shardd_connections_refused_total",
            "Client connections refused at accept (max_clients, file descriptors, allowed_gid).",
            srv->refused);
    counter(t, "shardd_connections_dropped_total",
            "Client connections dropped for their input or their unread replies.", srv->dropped);
    counter(t, "shardd_event_loop_polls_total",
            "Passes of the event loop's polling (an idle daemon should not count up).", srv->polls);
    if (srv->tp != NULL) {
        counter(t, "shardd_staging_bytes_total",
                "Device memory staged through pinned host buffers to cross the fabric.",
                srv->tp->staged_bytes);
        gauge(t, "shardd_staging_buffer_bytes", "Pinned host buffers held for staging.",
              (double)srv->tp->staging_buffer_bytes);
        counter(t, "shardd_fabric_foreign_dropped_total",
                "Fabric messages from addresses outside the daemon's peers, dropped unread.",
                srv->tp->foreign_dropped);
    }
    const struct sd_cluster *cl = sd_net_cluster(reg->net);
    if (cl != NULL) {
        struct sd_cluster_counts c;
        sd_cluster_counts(cl, &c);
        family(t, "shardd_peers", "gauge", "Other daemons in the cluster's table, up or down.");
        sd_text_printf(t, "shardd_peers{state=\"up\"} %u\nshardd_peers{state=\"down\"} %u\n",
                       c.peers_up, c.peers - c.peers_up);
        family(t, "shardd_peer_links", "gauge",
               "Control links to other daemons, by whether their end proved itself.");
        sd_text_printf(t,
                       "shardd_peer_links{proved=\"true\"} %u\n"
                       "shardd_peer_links{proved=\"false\"} %u\n",
                       c.links_proved, c.links - c.links_proved);
        counter(t, "shardd_peer_connections_refused_total",
                "Peer connections that proved nothing (no secret, no job's token).", c.refused);
        counter(t, "shardd_peer_connections_evicted_total",
                "Unproved peer connections closed to admit others (a flood).", c.evicted);
        counter(t, "shardd_peer_links_closed_full_total",
                "Peer links closed for what they left buffered.", c.closed_full);
        gauge(t, "shardd_peer_outbox_bytes", "Control messages waiting for a link.",
              (double)c.outbox_bytes);
        family(t, "shardd_heartbeats_total", "counter",
               "Heartbeat datagrams sent, received, and dropped (no peer, bad MAC, replayed).");
        sd_text_printf(t,
                       "shardd_heartbeats_total{direction=\"sent\"} %llu\n"
                       "shardd_heartbeats_total{direction=\"received\"} %llu\n"
                       "shardd_heartbeats_total{direction=\"dropped\"} %llu\n",
                       (unsigned long long)c.hb_sent, (unsigned long long)c.hb_received,
                       (unsigned long long)c.hb_dropped);
    }
}

/* one counter family over the shown jobs: field(job) */
#define JOB_COUNTER(t, s, name, help, expr)                                                        \
    do {                                                                                           \
        family(t, name, "counter", help);                                                          \
        for (uint32_t i_ = 0; i_ < (s)->n; i_++) {                                                 \
            const struct sd_job *job = (s)->job[i_];                                               \
            sd_text_printf(t, "%s{%s} %llu\n", name, (s)->label[i_], (unsigned long long)(expr));  \
        }                                                                                          \
    } while (0)

static void op_histograms(const struct shown *s, struct sd_text *t)
{
    family(t, "shardd_job_operation_seconds", "histogram",
           "Time from a rank's call to its completion, per operation (fetch: a unit's gather; "
           "push: a gradient reduced; step: the optimizer step; save: a checkpoint; init: "
           "rank 0's initial values).");
    for (uint32_t i = 0; i < s->n; i++)
        for (int op = SD_OP_FETCH; op < SD_OP_COUNT; op++) {
            const struct sd_latency *l = &s->job[i]->stats.lat[op];
            unsigned first;
            sd_latency_window(op, &first);
            uint64_t cum = 0;
            for (unsigned b = 0; b < first; b++)
                cum += l->bins[b];
            for (unsigned b = first; b < first + SD_LAT_WINDOW; b++) {
                cum += l->bins[b];
                sd_text_printf(t,
                               "shardd_job_operation_seconds_bucket{%s,op=\"%s\",le=\"%g\"} "
                               "%llu\n",
                               s->label[i], sd_op_name(op), (double)sd_lat_bounds_ns[b] / 1e9,
                               (unsigned long long)cum);
            }
            sd_text_printf(t,
                           "shardd_job_operation_seconds_bucket{%s,op=\"%s\",le=\"+Inf\"} %llu\n"
                           "shardd_job_operation_seconds_sum{%s,op=\"%s\"} %.9f\n"
                           "shardd_job_operation_seconds_count{%s,op=\"%s\"} %llu\n",
                           s->label[i], sd_op_name(op), (unsigned long long)l->count, s->label[i],
                           sd_op_name(op), (double)l->sum_ns / 1e9, s->label[i], sd_op_name(op),
                           (unsigned long long)l->count);
        }
}

static void job_bytes(const struct shown *s, struct sd_text *t, bool unquantized)
{
    const char *name =
        unquantized ? "shardd_job_unquantized_bytes_total" : "shardd_job_bytes_total";
    family(t, name, "counter",
           unquantized ? "What the same operations would have moved without quantization."
                       : "Bytes moved, by the operation that moved them and the link they "
                         "crossed (intra_package, intra_node, inter_node_sent, "
                         "inter_node_recv), as encoded on the wire.");
    for (uint32_t i = 0; i < s->n; i++)
        for (int op = SD_OP_FETCH; op < SD_OP_COUNT; op++)
            for (int c = 0; c < SD_LINK_COUNT; c++) {
                const struct sd_job_stats *st = &s->job[i]->stats;
                int64_t v = (int64_t)st->bytes[op][c] + (unquantized ? st->saved[op][c] : 0);
                sd_text_printf(t, "%s{%s,op=\"%s\",link=\"%s\"} %lld\n", name, s->label[i],
                               sd_op_name(op), sd_link_names[c], (long long)v);
            }
}

static void job_metrics(const struct shown *s, struct sd_text *t)
{
    family(t, "shardd_job_info", "gauge",
           "A job this daemon serves or served: its plan, owner, ranks and state (always 1).");
    for (uint32_t i = 0; i < s->n; i++) {
        const struct sd_job *job = s->job[i];
        char plan[64];
        sd_prom_escape(plan, sizeof(plan), job->plan.name);
        sd_text_printf(t,
                       "shardd_job_info{%s,plan=\"%s\",uid=\"%d\",world=\"%u\",nodes=\"%u\","
                       "state=\"%s\"} 1\n",
                       s->label[i], plan, (int)job->uid, job->world, job->nodes,
                       job_state(job, s->list[i] == 1));
    }
    family(t, "shardd_job_failed", "gauge",
           "A job that failed here, with the status it failed with (always 1).");
    for (uint32_t i = 0; i < s->n; i++)
        if (s->job[i]->state == SD_JOB_FAILED)
            sd_text_printf(t, "shardd_job_failed{%s,status=\"%s\"} 1\n", s->label[i],
                           sd_status_name(s->job[i]->fail_status));
    JOB_COUNTER(t, s, "shardd_job_steps_total", "Optimizer steps taken.", job->steps);
    family(t, "shardd_job_operations_total", "counter", "Calls served, per operation.");
    for (uint32_t i = 0; i < s->n; i++)
        for (int op = SD_OP_FETCH; op < SD_OP_COUNT; op++)
            sd_text_printf(t, "shardd_job_operations_total{%s,op=\"%s\"} %llu\n", s->label[i],
                           sd_op_name(op), (unsigned long long)s->job[i]->stats.ops[op]);
    op_histograms(s, t);
    job_bytes(s, t, false);
    job_bytes(s, t, true);
    JOB_COUNTER(t, s, "shardd_job_errors_total", "Calls that completed with an error.",
                job->stats.errors);
    JOB_COUNTER(t, s, "shardd_job_steps_nonfinite_total",
                "Steps skipped on every rank for a gradient that was not finite.",
                job->stats.steps_nonfinite);
    JOB_COUNTER(t, s, "shardd_job_steps_nonfinite_scaled_total",
                "Of those, steps under a loss scale: a dynamic loss scaler's overflows.",
                job->stats.steps_nonfinite_scaled);
    family(t, "shardd_job_loss_scale", "gauge", "The last step's loss scale (1: none).");
    for (uint32_t i = 0; i < s->n; i++)
        sd_text_printf(t, "shardd_job_loss_scale{%s} %.17g\n", s->label[i],
                       s->job[i]->stats.loss_scale);
    JOB_COUNTER(t, s, "shardd_job_steps_refused_total",
                "Steps skipped for arguments the ranks did not agree on.",
                job->stats.steps_refused);
    JOB_COUNTER(t, s, "shardd_job_gathers_total", "Units gathered (cache hits not counted).",
                job->stats.gathers);
    JOB_COUNTER(t, s, "shardd_job_cache_hits_total", "Fetches served by a unit still gathered.",
                job->stats.cache_hits);
    JOB_COUNTER(t, s, "shardd_job_boundary_hops_early_total",
                "Units sent across nodes during the backward (shard_last_micro_step).",
                sd_hop_early_count(job));
    JOB_COUNTER(t, s, "shardd_job_quant_encodes_total", "Buffers quantized.",
                job->stats.quant_encodes);
    JOB_COUNTER(t, s, "shardd_job_broadcast_bytes_total",
                "Bytes of rank 0's broadcasts delivered to this node's ranks.",
                job->stats.bcast_bytes);
    family(t, "shardd_job_memory_bytes", "gauge",
           "Memory a job holds on this node, by kind (w, g, os: its ranks' shards of each state; "
           "secondary, gather_pool, staging; total: all it took at registration).");
    for (uint32_t i = 0; i < s->n; i++) {
        if (s->list[i] == 2)
            continue; /* (its memory went) */
        const struct sd_job *job = s->job[i];
        uint64_t arena[SD_STATE_COUNT];
        sd_job_mem_arena_bytes(job, arena);
        for (int st = 0; st < SD_STATE_COUNT; st++)
            sd_text_printf(t, "shardd_job_memory_bytes{%s,kind=\"%s\"} %llu\n", s->label[i],
                           sd_state_name(st), (unsigned long long)(arena[st] * job->k));
        uint64_t sec = sd_sec_holder_bytes(job) * sd_sec_holders(job);
        uint64_t staging = (uint64_t)job->mem.staging_slots * job->mem.staging_slot_bytes * job->k;
        sd_text_printf(t,
                       "shardd_job_memory_bytes{%s,kind=\"secondary\"} %llu\n"
                       "shardd_job_memory_bytes{%s,kind=\"gather_pool\"} %llu\n"
                       "shardd_job_memory_bytes{%s,kind=\"staging\"} %llu\n"
                       "shardd_job_memory_bytes{%s,kind=\"total\"} %llu\n",
                       s->label[i], (unsigned long long)sec, s->label[i],
                       (unsigned long long)job->stats.pool_bytes, s->label[i],
                       (unsigned long long)staging, s->label[i],
                       (unsigned long long)job->mem.bytes_total);
    }
}

void sd_metrics_exposition(void *arg, struct sd_text *out)
{
    const struct sd_server *srv = arg;
    struct shown s;
    if (collect(srv, &s)) {
        daemon_metrics(srv, out);
        job_metrics(&s, out);
    } else {
        out->failed = true;
    }
    free(s.job);
    free(s.label);
    free(s.list);
}

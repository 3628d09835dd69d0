/* shardctl: inspect a running shardd (status, jobs, groups, topology, stats, schedule), and
 * plan a model that does not exist yet (plan: no daemon). */
#include "shard.h"
#include "shardctl.h"
#include "sd/ckpt.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *out)
{
    fprintf(out,
            "usage: shardctl [--socket PATH] [--job NAME] [--json] COMMAND\n"
            "\n"
            "Commands:\n"
            "  status     version, uptime, effective configuration, clients, jobs\n"
            "  jobs       registered jobs: state, world, plan, units, memory, steps\n"
            "  groups     per job and state: shard factor, partition and replication groups\n"
            "  topology   this node, the cluster size, the backend's devices (memory, fd\n"
            "             sharing, RDMA, peer access) and the jobs' rank placement\n"
            "  stats      per job: operations, bytes by link class, latency percentiles,\n"
            "             allocations since registration\n"
            "  schedule   per job: the frozen fetch/release/push order, prefetch distance, each\n"
            "             gather's pool offset, size and lifetime, the pool peak next to the sum\n"
            "             of all units and the largest unit, invalidations\n"
            "  plan       without a daemon: per-rank memory of each state and the inter-node\n"
            "             bytes per step of a plan for a hypothetical model:\n"
            "             plan --params N --world W --ranks-per-node K --plan PLAN\n"
            "                  [--package-size P] [--accum S] [--dtype bf16|fp32]\n"
            "                  [--optimizer adamw|sgd] [--gbit-per-node B] [--regather] [--json]\n"
            "                  [--compute-s C] [--last-marked]\n"
            "             (defaults: package 1, accum 1, bf16, adamw; with B, the time too:\n"
            "             what moves beside the forward and backward and what the step waits\n"
            "             for after the last backward, and the predicted step time,\n"
            "             max(C, beside) + after, C being a rank's measured forward and\n"
            "             backward of a step; --regather: the gather pool does not keep a\n"
            "             unit from forward to backward, so each fetch gathers it again;\n"
            "             --last-marked: the script says which backward is the step's last,\n"
            "             so a hop inside-node g groups need goes during the backward)\n"
            "             plan --pick --params N --world W --ranks-per-node K\n"
            "                  --gbit-per-node B [--compute-s C] [--last-marked]\n"
            "                  [--max-rank-bytes M] [--f-os F] [the options above]\n"
            "             every per-state plan topo:W/G/OS of the world (unquantized) ranked\n"
            "             by predicted step time, then a rank's memory, then the copies\n"
            "             inside the node; M: a rank's w, g, os and secondary bytes at most;\n"
            "             F: only plans with the optimizer states over F ranks\n"
            "             The formulas (common/include/sd/cost.h): N nodes of K ranks, S_w =\n"
            "             params x weight bytes, S_g = 4 params, G_X = f_X / K nodes per group\n"
            "             of state X (1 when f_X <= K), R = N / G_g; each node sends per step\n"
            "               fetch  gathers (G_w - 1) / G_w S_w (gathers: 1, or 2 accum with\n"
            "                      --regather; times K without the hierarchical gather)\n"
            "               push   accum (G_g - 1) / G_g S_g (the reduce-scatter)\n"
            "               step   2 (R - 1) / R S_g / G_g (the boundary all-reduce; half,\n"
            "                      a reduce-scatter to the owners, where f_os = N K without\n"
            "                      ,qg or ,hop-ar), plus the weights' all-gather when\n"
            "                      f_w < f_os and f_os > K\n"
            "             and each rank holds w S_w / f_w, g S_g / f_g, os 12 params / f_os\n"
            "             (AdamW; 8 with SGD). ,qw / ,qg / ,qsec count int8 / int4 blocks:\n"
            "             params (1 + 4 / B) and params (1/2 + 4 / B) bytes; ,gwire=bf16 or\n"
            "             fp16 halves the push and the hop (2-byte gradients on the wire)\n"
            "  checkpoint --job NAME DIR\n"
            "             write a checkpoint of a running, paused or failed job into DIR from\n"
            "             the daemons still up (each state from one live replica); ask node\n"
            "             0's daemon. A failed job keeps its state only with resume_timeout_ms.\n"
            "             Exit 1 when refused: with the extents no live node holds\n"
            "  drop --job NAME\n"
            "             (root) drop the state a paused job (or a failed one kept with\n"
            "             resume_timeout_ms) holds on this node now, instead of at its timeout;\n"
            "             run it on each node of the job\n"
            "  trace      per job: its flight recorder on this node, the last operations\n"
            "             (trace_ops) of its ranks' calls and its transfers with other nodes,\n"
            "             with their states and times; what is waiting first (--json: the\n"
            "             document a failed job also dumps into <runtime_dir>/trace/)\n"
            "  trace --merge PATH...\n"
            "             without a daemon: the dumps of every node of a job (files, or\n"
            "             directories of them) read together: the call most ranks wait in, the\n"
            "             ranks that never made it (with their last call), and what each node\n"
            "             waited in\n"
            "  checkpoint-info DIR\n"
            "             without a daemon: the checkpoint at DIR (or the one DIR/LATEST names):\n"
            "             step, plan, world, tensors, bytes per state and file, and every\n"
            "             extent's crc32c checked; exit 1 when it does not load or verify\n"
            "\n"
            "Options:\n"
            "  --socket PATH  daemon socket (default $SHARD_SOCKET, else /run/shardd/shardd.sock)\n"
            "  --job NAME     only this job\n"
            "  --json         print the daemon's JSON document instead of tables\n"
            "  --version      print the version and exit\n");
}

static void print_jobs(json_t *jobs)
{
    char mem[32], par[32];
    printf("%-20s %4s %-11s %5s %-10s %5s %12s %10s %10s %6s\n", "JOB", "ID", "STATE", "WORLD",
           "PLAN", "UNITS", "PARAMETERS", "PARAM-MEM", "MEMORY", "STEPS");
    size_t i;
    json_t *j;
    json_array_foreach(jobs, i, j)
    {
        json_t *alloc = json_object_get(j, "allocating");
        bool retiring = json_is_true(json_object_get(j, "retiring"));
        printf("%-20s %4lld %-11s %5lld %-10s %5lld %12lld %10s %10s %6lld\n", str(j, "name"),
               num(j, "id"),
               json_is_true(alloc) ? "allocating"
               : retiring          ? "retiring"
                                   : str(j, "state"),
               num(j, "world"), str(j, "plan"), num(j, "units"), num(j, "parameters"),
               sd_fmt_bytes(par, sizeof(par), (uint64_t)num(j, "parameter_bytes")),
               sd_fmt_bytes(mem, sizeof(mem), (uint64_t)num(j, "memory_bytes")), num(j, "steps"));
        if (str(j, "error")[0])
            printf("    %s\n", str(j, "error"));
        if (retiring)
            printf("    every rank left; transfers with node(s) %s still hold its memory\n",
                   str(j, "transfers_pending_with_nodes"));
    }
    if (json_array_size(jobs) == 0)
        printf("(no jobs)\n");
}

static void print_status(json_t *doc)
{
    char b1[32], b2[32];
    printf("shardd %s, pid %lld, up %.1f s, node %lld of %lld\n", str(doc, "version"),
           num(doc, "pid"), json_real_value(json_object_get(doc, "uptime_s")), num(doc, "node"),
           num(doc, "nodes"));
    printf("socket %s\n", str(doc, "socket"));
    printf("memory %s used of %s budget\n",
           sd_fmt_bytes(b1, sizeof(b1), (uint64_t)num(doc, "memory_used_bytes")),
           sd_fmt_bytes(b2, sizeof(b2), (uint64_t)num(doc, "memory_budget_bytes")));
    printf("polling passes since start %lld\n\n", num(doc, "poll_passes"));
    printf("configuration:\n");
    const char *key;
    json_t *v;
    json_object_foreach(json_object_get(doc, "config"), key, v)
    {
        if (json_is_string(v))
            printf("  %-20s %s\n", key, json_string_value(v));
        else
            printf("  %-20s %lld\n", key, (long long)json_integer_value(v));
    }
    json_t *clients = json_object_get(doc, "clients");
    printf("\nclients: %zu\n", json_array_size(clients));
    size_t i;
    json_t *c;
    if (json_array_size(clients) > 0)
        printf("  %-8s %-8s %-6s %-20s %s\n", "SESSION", "PID", "UID", "JOB", "RANK");
    json_array_foreach(clients, i, c)
    {
        printf("  %-8lld %-8lld %-6lld %-20s %lld\n", num(c, "session"), num(c, "pid"),
               num(c, "uid"), json_is_string(json_object_get(c, "job")) ? str(c, "job") : "-",
               num(c, "rank"));
    }
    printf("\n");
    print_jobs(json_object_get(doc, "jobs"));
}

static void print_group_list(json_t *groups)
{
    size_t i, k;
    json_t *g, *r;
    json_array_foreach(groups, i, g)
    {
        printf(" [");
        json_array_foreach(g, k, r)
            printf("%s%lld", k ? " " : "", (long long)json_integer_value(r));
        printf("]");
    }
    printf("\n");
}

static void print_groups(json_t *doc)
{
    size_t i;
    json_t *j;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        printf("job %s: plan %s, world %lld (%lld per node, packages of %lld), hierarchical "
               "gather %s, 2-hop sync %s\n",
               str(j, "job"), str(j, "plan"), num(j, "world"), num(j, "ranks_per_node"),
               num(j, "package_size"),
               json_is_true(json_object_get(j, "hierarchical")) ? "on" : "off",
               json_is_true(json_object_get(j, "two_hop")) ? "on" : "off");
        const char *state;
        json_t *s;
        json_object_foreach(json_object_get(j, "states"), state, s)
        {
            char b[32];
            printf("  %-2s f=%-4lld %lld node(s) per group, %s per rank\n", state,
                   num(s, "shard_factor"), num(s, "nodes_per_group"),
                   sd_fmt_bytes(b, sizeof(b), (uint64_t)num(s, "bytes_per_rank")));
            printf("          partition:");
            print_group_list(json_object_get(s, "partition"));
            printf("          replication:");
            print_group_list(json_object_get(s, "replication"));
            printf("          shard of rank 0..:");
            size_t k;
            json_t *r;
            json_array_foreach(json_object_get(s, "ranks"), k, r) printf(" %lld", num(r, "shard"));
            printf("\n");
        }
        json_t *sec = json_object_get(j, "secondary");
        printf("  secondary partition: ");
        if (num(sec, "ranks") == 0)
            printf("none\n");
        else
            printf("sec=%lld, %s\n", num(sec, "ranks"), str(sec, "effect"));
        printf("  memory per rank:\n");
        const char *what;
        json_t *m;
        json_object_foreach(json_object_get(j, "memory_per_rank"), what, m)
        {
            char b[32];
            if (!json_is_object(m))
                continue;
            printf("    %-12s %10s   %s\n", what,
                   sd_fmt_bytes(b, sizeof(b), (uint64_t)num(m, "bytes")), str(m, "formula"));
        }
    }
    if (json_array_size(json_object_get(doc, "jobs")) == 0)
        printf("(no jobs)\n");
}

/* an independent daemon (nodes 1): its id, the daemons it met (its own numbers for them, their
 * ids and peer listeners) */
static void print_independent(json_t *doc)
{
    size_t i;
    json_t *n;
    json_t *nodes = json_object_get(doc, "topology");
    const char *id = str(json_array_get(nodes, 0), "id");
    printf("an independent daemon%s%s, backend %s, ranks per node %lld%s, ranks per package "
           "%lld\n",
           id[0] ? ", id " : "", id, str(doc, "backend"), num(doc, "ranks_per_node"),
           num(doc, "ranks_per_node") == 0 ? " (from each job)" : " (for jobs that give none)",
           num(doc, "package_size"));
    printf("levels: package (%lld ranks) < node < the job's nodes\n", num(doc, "package_size"));
    if (json_is_false(json_object_get(doc, "ids_shown"))) {
        printf("the daemons it met, by its numbers (their ids and addresses are root's to see):\n");
        json_array_foreach(nodes, i, n)
        {
            if (i > 0)
                printf("  node %-4lld %s%s\n", num(n, "node"), str(n, "state"),
                       json_is_true(json_object_get(n, "link")) ? ", linked" : "");
        }
        return;
    }
    if (!id[0] && num(doc, "fabric_closes") > 0) {
        printf("its fabric is closed (no job here since; fabric_idle_close_ms): it meets other "
               "daemons through their jobs\n");
        return;
    }
    if (!id[0]) {
        printf("no job has spanned nodes yet: it meets other daemons through their jobs\n");
        return;
    }
    printf("it met %zu daemons through their jobs (provider %s)\n",
           json_array_size(nodes) ? json_array_size(nodes) - 1 : 0, str(doc, "provider"));
    json_array_foreach(nodes, i, n)
    {
        if (i > 0)
            printf("  node %-4lld daemon %s at %s: %s%s\n", num(n, "node"), str(n, "id"),
                   str(n, "peer_addr"), str(n, "state"),
                   json_is_true(json_object_get(n, "link")) ? ", linked" : "");
    }
}

static void print_topology(json_t *doc)
{
    size_t i;
    json_t *n, *j, *d;
    bool indep = json_is_true(json_object_get(doc, "independent"));
    if (indep) {
        print_independent(doc);
    } else {
        printf("node %lld of %lld, backend %s, ranks per node %lld%s, ranks per package %lld\n",
               num(doc, "node"), num(doc, "nodes"), str(doc, "backend"), num(doc, "ranks_per_node"),
               num(doc, "ranks_per_node") == 0 ? " (from each job)" : "", num(doc, "package_size"));
        printf("levels: package (%lld ranks) < node < cluster (%lld nodes)\n",
               num(doc, "package_size"), num(doc, "nodes"));
        if (num(doc, "nodes") > 1)
            printf("cluster %s, provider %s\n",
                   json_is_true(json_object_get(doc, "cluster_ready")) ? "formed" : "forming",
                   str(doc, "provider"));
        json_array_foreach(json_object_get(doc, "topology"), i, n)
        {
            /* link: a control link joins the two (the coordinator's, or a job peer's) */
            printf("  node %-4lld %s%s\n", num(n, "node"), str(n, "state"),
                   json_is_true(json_object_get(n, "link")) ? ", linked" : "");
        }
    }
    json_t *devs = json_object_get(doc, "devices");
    if (json_array_size(devs) == 0)
        printf("devices: none (the %s backend keeps shards in host memory)\n", str(doc, "backend"));
    json_array_foreach(devs, i, d)
    {
        char mem[32], peers[256] = "";
        size_t k, off = 0;
        json_t *p;
        json_array_foreach(json_object_get(d, "peers"), k, p)
        {
            off += (size_t)snprintf(peers + off, sizeof(peers) - SD_MIN(off, sizeof(peers)),
                                    "%s%lld", k ? " " : "", (long long)json_integer_value(p));
        }
        char used[32] = "", u1[32], u2[32];
        if (json_is_true(json_object_get(d, "driven")))
            snprintf(used, sizeof(used), " (shardd %s, peak %s)",
                     sd_fmt_bytes(u1, sizeof(u1), (uint64_t)num(d, "used_bytes")),
                     sd_fmt_bytes(u2, sizeof(u2), (uint64_t)num(d, "peak_bytes")));
        printf("device %lld%s: %s%s%s, %s%s, fd sharing %s, RDMA %s, peer access: %s\n",
               num(d, "index"), json_is_true(json_object_get(d, "driven")) ? " (driven)" : "",
               str(d, "name"), str(d, "uuid")[0] ? " " : "", str(d, "uuid"),
               sd_fmt_bytes(mem, sizeof(mem), (uint64_t)num(d, "memory_bytes")), used,
               json_is_true(json_object_get(d, "fd_handles")) ? "yes" : "no",
               json_is_true(json_object_get(d, "rdma")) ? "yes" : "no", peers[0] ? peers : "none");
    }
    json_t *cycle = json_object_get(doc, "rank_devices");
    if (json_array_size(devs) > 0 && json_array_size(cycle) > 0) {
        printf("local rank i on device");
        json_array_foreach(cycle, i, d)
        {
            printf("%s%lld", i ? "," : " [", (long long)json_integer_value(d));
        }
        printf("][i mod %zu]\n", json_array_size(cycle));
    }
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        /* (an independent daemon's numbers are its own: the daemons' ids) */
        json_t *daemons = json_object_get(j, "node_daemons");
        printf("job %s: world %lld = %lld nodes x %lld ranks on %s", str(j, "name"),
               num(j, "world"), num(j, "nodes"), num(j, "ranks_per_node"),
               daemons != NULL ? "daemons" : "cluster nodes");
        size_t k;
        json_t *r;
        json_array_foreach(daemons != NULL ? daemons : json_object_get(j, "node_ids"), k, r)
        {
            if (json_is_string(r))
                printf("%s%s", k ? "," : " ", json_string_value(r)[0] ? json_string_value(r) : "?");
            else if (json_integer_value(r) < 0)
                printf("%s?", k ? "," : " ");
            else
                printf("%s%lld", k ? "," : " ", (long long)json_integer_value(r));
        }
        printf(" (this one its node %lld); ranks here:", num(j, "node"));
        json_array_foreach(json_object_get(j, "ranks"), k, r)
        {
            printf(" %lld%s", num(r, "rank"),
                   json_is_true(json_object_get(r, "attached")) ? "" : "(gone)");
            if (json_array_size(devs) > 0) /* the GPU its buffers live on */
                printf("@gpu%lld", num(r, "device"));
        }
        printf("\n");
    }
}

static void print_stats(json_t *doc)
{
    size_t i;
    json_t *j;
    char b1[32], b2[32], b3[32], b4[32];
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        json_t *tot = json_object_get(j, "bytes");
        printf("job %s: %lld steps, %lld errors, gathers %lld, cache hits %lld, evictions %lld, "
               "allocations since registration %lld\n",
               str(j, "job"), num(j, "steps"), num(j, "errors"), num(j, "gathers"),
               num(j, "cache_hits"), num(j, "evictions"), num(j, "allocations_since_register"));
        printf("  bytes: intra-package %s, intra-node %s, inter-node sent %s, received %s; "
               "gradient reductions across nodes in flight at most %lld\n",
               sd_fmt_bytes(b1, sizeof(b1), (uint64_t)num(tot, "intra_package")),
               sd_fmt_bytes(b2, sizeof(b2), (uint64_t)num(tot, "intra_node")),
               sd_fmt_bytes(b3, sizeof(b3), (uint64_t)num(tot, "inter_node_sent")),
               sd_fmt_bytes(b4, sizeof(b4), (uint64_t)num(tot, "inter_node_recv")),
               num(j, "push_rounds_peak"));
        json_t *sec = json_object_get(j, "secondary");
        if (json_is_true(json_object_get(sec, "active")))
            printf("  secondary partition: %lld ranks, fetches served from it %lld, refills %lld\n",
                   num(sec, "ranks"), num(sec, "loads"), num(sec, "stores"));
        printf("  %-8s %10s %10s %10s %10s %12s %12s %12s %12s\n", "OP", "COUNT", "P50-US",
               "P99-US", "MAX-US", "INTRA-PKG", "INTRA-NODE", "INTER-SENT", "INTER-RECV");
        const char *op;
        json_t *o;
        json_object_foreach(json_object_get(j, "ops"), op, o)
        {
            json_t *b = json_object_get(o, "bytes");
            printf("  %-8s %10lld %10.1f %10.1f %10.1f %12s %12s %12s %12s\n", op, num(o, "count"),
                   json_real_value(json_object_get(o, "p50_us")),
                   json_real_value(json_object_get(o, "p99_us")),
                   json_real_value(json_object_get(o, "max_us")),
                   sd_fmt_bytes(b1, sizeof(b1), (uint64_t)num(b, "intra_package")),
                   sd_fmt_bytes(b2, sizeof(b2), (uint64_t)num(b, "intra_node")),
                   sd_fmt_bytes(b3, sizeof(b3), (uint64_t)num(b, "inter_node_sent")),
                   sd_fmt_bytes(b4, sizeof(b4), (uint64_t)num(b, "inter_node_recv")));
        }
    }
    if (json_array_size(json_object_get(doc, "jobs")) == 0)
        printf("(no jobs)\n");
    json_t *peers = json_object_get(doc, "peers"), *l;
    if (peers == NULL)
        return;
    printf("control links: %zu; connections refused %lld (proved nothing), evicted %lld (a "
           "flood's), closed for what they buffered %lld; messages waiting for links %s\n",
           json_array_size(json_object_get(peers, "links")), num(peers, "refused"),
           num(peers, "evicted"), num(peers, "closed_full"),
           sd_fmt_bytes(b1, sizeof(b1), (uint64_t)num(peers, "outbox_bytes")));
    json_array_foreach(json_object_get(peers, "links"), i, l)
    {
        printf("  node %-4lld %-8s %s%s: read buffer %s, to write %s, waiting for jobs %s\n",
               num(l, "node"), json_is_true(json_object_get(l, "proved")) ? "proved" : "unproved",
               json_is_true(json_object_get(l, "incoming")) ? "from " : "to ",
               str(l, "address")[0] ? str(l, "address") : "(root's to see)",
               sd_fmt_bytes(b1, sizeof(b1), (uint64_t)num(l, "rx_buffered")),
               sd_fmt_bytes(b2, sizeof(b2), (uint64_t)num(l, "tx_queued")),
               sd_fmt_bytes(b3, sizeof(b3), (uint64_t)num(l, "waiting_bytes")));
    }
}

static void print_schedule(json_t *jobs)
{
    char b[5][32];
    size_t i, k;
    json_t *j, *e;
    json_array_foreach(jobs, i, j)
    {
        printf("job %s (%s): schedule %s, %lld steps, %lld invalidations, %lld freezes\n",
               str(j, "job"), str(j, "job_state"), str(j, "state"), num(j, "steps"),
               num(j, "invalidations"), num(j, "freezes"));
        if (num(j, "freezes") == 0) {
            printf("  (not frozen yet: the first step records it)\n");
            continue;
        }
        char reuse[64];
        long long rd = num(j, "reuse_distance");
        snprintf(reuse, sizeof(reuse), rd < 0 ? "unlimited (the pool holds every unit)" : "%lld",
                 rd);
        printf("  frozen after step %lld: %lld calls per step, %lld gathers, prefetch depth %lld "
               "(at most %s ahead), reuse distance %s\n",
               num(j, "frozen_after_step"), num(j, "calls_per_step"), num(j, "gathers_per_step"),
               num(j, "prefetch_depth"),
               num(j, "prefetch_bytes")
                   ? sd_fmt_bytes(b[0], sizeof(b[0]), (uint64_t)num(j, "prefetch_bytes"))
                   : "any bytes",
               reuse);
        long long peak = num(j, "pool_peak_bytes"), lb = num(j, "pool_lower_bound_bytes");
        printf("  pool peak %s = %.3fx the most bytes live at once (%s); all units %s, largest "
               "%s, pool %s\n",
               sd_fmt_bytes(b[0], sizeof(b[0]), (uint64_t)peak),
               lb ? (double)peak / (double)lb : 0.0, sd_fmt_bytes(b[1], sizeof(b[1]), (uint64_t)lb),
               sd_fmt_bytes(b[2], sizeof(b[2]), (uint64_t)num(j, "units_sum_bytes")),
               sd_fmt_bytes(b[3], sizeof(b[3]), (uint64_t)num(j, "largest_unit_bytes")),
               sd_fmt_bytes(b[4], sizeof(b[4]), (uint64_t)num(j, "pool_bytes")));
        printf("  prefetches %lld, fetches found ready %lld, waits %lld, conflicts %lld; daemon "
               "CPU per fetch %.2f us frozen vs %.2f us before (of which starting gathers %.2f vs "
               "%.2f)\n",
               num(j, "prefetches"), num(j, "prefetch_hits"), num(j, "waits"), num(j, "conflicts"),
               json_real_value(json_object_get(j, "fetch_cpu_us_frozen")),
               json_real_value(json_object_get(j, "fetch_cpu_us_unfrozen")),
               json_real_value(json_object_get(j, "fetch_issue_cpu_us_frozen")),
               json_real_value(json_object_get(j, "fetch_issue_cpu_us_unfrozen")));
        if (!json_is_true(json_object_get(j, "plan_kept"))) {
            printf("  (the job ended: its gathers and call order went with its memory)\n");
            continue;
        }
        printf("  %-6s %-6s %12s %12s %7s %7s\n", "GATHER", "UNIT", "OFFSET", "BYTES", "ISSUE",
               "END");
        json_array_foreach(json_object_get(j, "slots"), k, e)
        {
            printf("  %-6zu %-6lld %12lld %12lld %7lld %7lld\n", k, num(e, "unit"),
                   num(e, "offset"), num(e, "bytes"), num(e, "issue"), num(e, "end"));
        }
        printf("  order:");
        json_array_foreach(json_object_get(j, "order"), k, e)
        {
            const char *op = str(e, "op");
            printf("%s%c%lld", k % 16 == 0 ? "\n   " : " ",
                   op[0] == 'f'   ? 'F'
                   : op[0] == 'r' ? 'R'
                                  : 'P',
                   num(e, "unit"));
        }
        printf("\n  (F fetch, R release, P push; issue and end are positions in the order)\n");
    }
    if (json_array_size(jobs) == 0)
        printf("(no jobs)\n");
}

/* checkpoint-info: read and verify a checkpoint offline (sd/ckpt.h) */
static int run_checkpoint_info(const char *dir, bool as_json)
{
    struct sd_ckpt ck;
    char err[1200];
    if (dir == NULL) {
        fprintf(stderr, "shardctl: checkpoint-info needs a directory\n");
        return 2;
    }
    int status = sd_ckpt_open(dir, &ck, err, sizeof(err));
    if (status != SD_OK) {
        fprintf(stderr, "shardctl: checkpoint-info: %s\n", err);
        return 1;
    }
    uint64_t bad = 0;
    char verr[1200] = "";
    int vst = sd_ckpt_verify(&ck, &bad, verr, sizeof(verr));
    uint64_t state_bytes[SD_CKPT_MAX_STATES] = {0}, params = 0;
    uint64_t *file_bytes = calloc(ck.n_files + 1, sizeof(uint64_t));
    for (uint64_t i = 0; i < ck.n_extents; i++) {
        const struct sd_ckpt_extent *x = &ck.extents[i];
        uint64_t b = (x->end - x->begin) * sizeof(float);
        state_bytes[x->state] += b;
        if (file_bytes != NULL)
            file_bytes[x->file] += b;
    }
    for (uint32_t t = 0; t < ck.n_tensors; t++)
        params += ck.tensors[t].numel;
    json_t *states = json_object(), *files = json_object();
    for (uint32_t st = 0; st < ck.n_states; st++)
        json_object_set_new(states, sd_ckpt_state_name(ck.optim_kind, st),
                            json_integer((json_int_t)state_bytes[st]));
    for (uint32_t f = 0; f < ck.n_files; f++)
        json_object_set_new(files, ck.files[f],
                            json_integer(file_bytes ? (json_int_t)file_bytes[f] : 0));
    json_t *doc = json_pack(
        "{s:s, s:s, s:I, s:s, s:I, s:I, s:I, s:s, s:I, s:I, s:I, s:I, s:o, s:o, s:b, s:I, s:s}",
        "path", ck.path, "job", ck.job, "step", (json_int_t)ck.step, "plan", ck.plan, "world",
        (json_int_t)ck.world, "nodes", (json_int_t)ck.nodes, "ranks_per_node",
        (json_int_t)ck.ranks_per_node, "optimizer", sd_optim_name(ck.optim_kind), "tensors",
        (json_int_t)ck.n_tensors, "parameters", (json_int_t)params, "extents",
        (json_int_t)ck.n_extents, "bytes", (json_int_t)ck.bytes, "state_bytes", states,
        "file_bytes", files, "crc_ok", vst == SD_OK, "crc_bad_extents", (json_int_t)bad,
        "crc_error", verr);
    if (as_json) {
        char *out = json_dumps(doc, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        puts(out);
        free(out);
    } else {
        char b[32];
        printf("checkpoint %s\n", ck.path);
        printf("  job %s, step %llu, plan %s, world %u (%u nodes x %u ranks), %s\n", ck.job,
               (unsigned long long)ck.step, ck.plan, ck.world, ck.nodes, ck.ranks_per_node,
               sd_optim_name(ck.optim_kind));
        printf("  %u tensors, %llu parameters, %llu extents, %s\n", ck.n_tensors,
               (unsigned long long)params, (unsigned long long)ck.n_extents,
               sd_fmt_bytes(b, sizeof(b), ck.bytes));
        for (uint32_t st = 0; st < ck.n_states; st++)
            printf("  %-16s %s\n", sd_ckpt_state_name(ck.optim_kind, st),
                   sd_fmt_bytes(b, sizeof(b), state_bytes[st]));
        for (uint32_t f = 0; f < ck.n_files; f++)
            printf("  %-16s %s\n", ck.files[f],
                   sd_fmt_bytes(b, sizeof(b), file_bytes ? file_bytes[f] : 0));
        if (vst == SD_OK)
            printf("  crc32c: all %llu extents verify\n", (unsigned long long)ck.n_extents);
        else
            printf("  crc32c: %llu of %llu extents FAIL; first: %s\n", (unsigned long long)bad,
                   (unsigned long long)ck.n_extents, verr);
    }
    json_decref(doc);
    free(file_bytes);
    sd_ckpt_close(&ck);
    return vst == SD_OK ? 0 : 1;
}

/* checkpoint --job NAME DIR: node 0's daemon writes it from the live replicas */
static int run_checkpoint(const char *socket, const char *job, const char *dir, bool as_json)
{
    if (job == NULL || dir == NULL) {
        fprintf(stderr, "shardctl: checkpoint needs --job NAME and a directory\n");
        return 2;
    }
    char abs[SD_CKPT_PATH_MAX];
    if (dir[0] != '/') { /* the daemon's working directory is not ours */
        if (getcwd(abs, sizeof(abs) - strlen(dir) - 2) == NULL) {
            fprintf(stderr, "shardctl: checkpoint: cannot resolve '%s'\n", dir);
            return 2;
        }
        strcat(abs, "/");
        strcat(abs, dir);
        dir = abs;
    }
    char *text = NULL;
    int status = shard_checkpoint_job(socket, job, dir, &text);
    if (text == NULL) {
        fprintf(stderr, "shardctl: %s\n", shard_last_error(NULL));
        return 1;
    }
    json_t *doc = json_loads(text, 0, NULL);
    if (as_json || doc == NULL) {
        puts(text);
    } else if (status == SD_OK) {
        printf("job %s: step %lld written to %s (%.1f MiB in %lld files, %.0f ms)\n", job,
               num(doc, "step"), str(doc, "checkpoint"), (double)num(doc, "bytes") / 1048576.0,
               num(doc, "files"), json_real_value(json_object_get(doc, "ms")));
        json_t *lost = json_object_get(doc, "lost_nodes");
        if (json_array_size(lost) > 0) {
            printf("  from the replicas: nodes");
            for (size_t i = 0; i < json_array_size(lost); i++)
                printf(" %lld", (long long)json_integer_value(json_array_get(lost, i)));
            printf(" lost\n");
        }
    } else {
        fprintf(stderr, "shardctl: checkpoint: %s: %s\n", sd_status_str(status), str(doc, "error"));
        json_t *missing = json_object_get(doc, "missing");
        size_t n = json_array_size(missing);
        if (n > 0)
            fprintf(stderr, "missing extents (%zu):\n  %-32s %-24s %s\n", n, "tensor", "range",
                    "os shard");
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_array_get(missing, i), *range = json_object_get(x, "range");
            char r[64];
            snprintf(r, sizeof(r), "[%lld, %lld)",
                     (long long)json_integer_value(json_array_get(range, 0)),
                     (long long)json_integer_value(json_array_get(range, 1)));
            fprintf(stderr, "  %-32s %-24s %lld\n", str(x, "tensor"), r, num(x, "shard"));
        }
    }
    json_decref(doc);
    shard_free(text);
    return status == SD_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    const char *ck_dir = NULL;
    struct plan_args pa = {.package = 1, .accum = 1, .dtype = "bf16", .optimizer = "adamw"};
    const char *socket = NULL, *job = NULL, *cmd = NULL;
    bool as_json = false, merge = false;
    char *merge_paths[256];
    int n_merge = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(argv[i], "--version") == 0) {
            printf("shardctl %s\n", SHARD_VERSION);
            return 0;
        } else if (strcmp(argv[i], "--json") == 0) {
            as_json = true;
        } else if (strcmp(argv[i], "--regather") == 0 && cmd != NULL && strcmp(cmd, "plan") == 0) {
            pa.regather = true;
        } else if (strcmp(argv[i], "--pick") == 0 && cmd != NULL && strcmp(cmd, "plan") == 0) {
            pa.pick = true;
        } else if (strcmp(argv[i], "--last-marked") == 0 && cmd != NULL &&
                   strcmp(cmd, "plan") == 0) {
            pa.last_marked = true;
        } else if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) {
            socket = argv[++i];
        } else if (strcmp(argv[i], "--job") == 0 && i + 1 < argc) {
            job = argv[++i];
        } else if (strcmp(argv[i], "--merge") == 0 && cmd != NULL && strcmp(cmd, "trace") == 0) {
            merge = true;
        } else if (argv[i][0] != '-' && merge && n_merge < 256) {
            merge_paths[n_merge++] = argv[i];
        } else if (argv[i][0] != '-' && cmd == NULL) {
            cmd = argv[i];
        } else if (argv[i][0] != '-' && ck_dir == NULL &&
                   (strcmp(cmd, "checkpoint-info") == 0 || strcmp(cmd, "checkpoint") == 0)) {
            ck_dir = argv[i];
        } else {
            /* plan's options: -1 not one of them, -2 a bad value (said) */
            int pr = cmd != NULL && strcmp(cmd, "plan") == 0 && i + 1 < argc
                         ? shardctl_plan_arg(&pa, argv[i], argv[i + 1])
                         : -1;
            if (pr == -1) {
                fprintf(stderr, "shardctl: unexpected argument '%s'\n", argv[i]);
                usage(stderr);
            }
            if (pr != 0)
                return 2;
            i++;
        }
    }
    if (cmd != NULL && strcmp(cmd, "plan") == 0)
        return shardctl_plan(&pa, as_json);
    if (merge) {
        if (n_merge == 0) {
            fprintf(stderr, "shardctl: trace --merge needs the dumps (files or directories)\n");
            return 2;
        }
        return shardctl_trace_merge(n_merge, merge_paths, as_json);
    }
    if (cmd != NULL && strcmp(cmd, "checkpoint-info") == 0)
        return run_checkpoint_info(ck_dir, as_json);
    if (cmd != NULL && strcmp(cmd, "checkpoint") == 0)
        return run_checkpoint(socket, job, ck_dir, as_json);
    static const char *const cmds[] = {"status", "jobs",     "groups", "topology",
                                       "stats",  "schedule", "drop",   "trace"};
    bool known = false;
    for (size_t i = 0; cmd && i < SD_ARRAY_SIZE(cmds); i++)
        known |= strcmp(cmd, cmds[i]) == 0;
    if (!known) {
        fprintf(stderr, cmd ? "shardctl: unknown command '%s'\n" : "shardctl: no command%s\n",
                cmd ? cmd : "");
        usage(stderr);
        return 2;
    }

    char *text = NULL;
    int status = shard_admin(socket, cmd, job, &text);
    if (text == NULL) {
        fprintf(stderr, "shardctl: %s\n", shard_last_error(NULL));
        return 1;
    }
    json_error_t jerr;
    json_t *doc = json_loads(text, 0, &jerr);
    shard_free(text);
    int rc = 0;
    if (status != SD_OK) {
        const char *why = doc != NULL ? str(doc, "error") : "";
        fprintf(stderr, "shardctl: %s: %s%s%s%s%s\n", cmd, sd_status_str(status), job ? " " : "",
                job ? job : "", why[0] ? ": " : "", why);
        rc = 1;
    } else if (doc == NULL) {
        fprintf(stderr, "shardctl: daemon sent invalid JSON: %s\n", jerr.text);
        rc = 1;
    } else if (as_json) {
        char *out = json_dumps(doc, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        puts(out);
        free(out);
    } else if (strcmp(cmd, "status") == 0) {
        print_status(doc);
    } else if (strcmp(cmd, "jobs") == 0) {
        print_jobs(json_object_get(doc, "jobs"));
    } else if (strcmp(cmd, "groups") == 0) {
        print_groups(doc);
    } else if (strcmp(cmd, "topology") == 0) {
        print_topology(doc);
    } else if (strcmp(cmd, "schedule") == 0) {
        print_schedule(json_object_get(doc, "jobs"));
    } else if (strcmp(cmd, "trace") == 0) {
        shardctl_trace_print(json_object_get(doc, "jobs"));
    } else if (strcmp(cmd, "drop") == 0) {
        printf("job %s: the state it kept (%.1f MiB, uid %lld) is dropped\n", str(doc, "dropped"),
               (double)num(doc, "bytes") / 1048576.0, num(doc, "uid"));
    } else {
        print_stats(doc);
    }
    json_decref(doc);
    return rc;
}

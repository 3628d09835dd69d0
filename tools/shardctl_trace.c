/* shardctl trace: a job's flight recorder on one node (the daemon's document), and --merge: the
 * dumps of every node of a job read together, naming the operation the ranks wait in and the
 * rank (and node) that never reached it, or, when every rank reached it, the transfers between
 * nodes still open (a cut link, a node that stopped answering), and what each node was waiting
 * for. */
#include "shardctl.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool open_state(json_t *e)
{
    const char *st = str(e, "state");
    return strcmp(st, "scheduled") == 0 || strcmp(st, "started") == 0;
}

/* seconds before the dump (or the document) that e began */
static double age_s(json_t *doc, json_t *e)
{
    return (double)(num(doc, "dumped_at_ns") - num(e, "time_created_ns")) / 1e9;
}

static void describe(json_t *doc, json_t *e, char *buf, size_t len)
{
    if (strcmp(str(e, "kind"), "call") == 0)
        snprintf(buf, len, "%s #%lld of unit %lld, %s %.1f s before the dump", str(e, "op"),
                 num(e, "collective_seq_id"), num(e, "unit"), str(e, "state"), age_s(doc, e));
    else
        snprintf(buf, len,
                 "%s %s of unit %lld (seq %lld) %s node %lld, %s %.1f s before the dump%s",
                 str(e, "kind"), str(e, "op"), num(e, "unit"), num(e, "collective_seq_id"),
                 strcmp(str(e, "kind"), "send") == 0 ? "to" : "from", num(e, "peer_node"),
                 str(e, "state"), age_s(doc, e),
                 num(e, "chunks_pending") > 0 ? " (chunks still pending)" : "");
}

void shardctl_trace_print(json_t *jobs)
{
    size_t i;
    json_t *doc;
    json_array_foreach(jobs, i, doc)
    {
        printf("job %s (node %lld of %lld, ranks %lld..%lld, %s): %s after %lld steps%s%s\n",
               str(doc, "job"), num(doc, "node"), num(doc, "nodes"), num(doc, "first_rank"),
               num(doc, "first_rank") + num(doc, "ranks_per_node") - 1, str(doc, "plan"),
               str(doc, "state"), num(doc, "steps"), str(doc, "error")[0] ? ": " : "",
               str(doc, "error"));
        json_t *entries = json_object_get(doc, "entries"), *e;
        size_t j, n = json_array_size(entries), open = 0;
        char text[256];
        json_array_foreach(entries, j, e)
        {
            if (!open_state(e))
                continue;
            if (open++ == 0)
                printf("  waiting:\n");
            describe(doc, e, text, sizeof(text));
            if (strcmp(str(e, "kind"), "call") == 0)
                printf("    rank %lld: %s\n", num(e, "rank"), text);
            else
                printf("    %s\n", text);
        }
        if (open == 0)
            printf("  nothing waiting\n");
        printf("  the last %zu of %zu records:\n", n < 12 ? n : 12, n);
        for (j = n > 12 ? n - 12 : 0; j < n; j++) {
            e = json_array_get(entries, j);
            describe(doc, e, text, sizeof(text));
            if (strcmp(str(e, "kind"), "call") == 0)
                printf("    %6lld  rank %lld: %s\n", num(e, "record_id"), num(e, "rank"), text);
            else
                printf("    %6lld  %s\n", num(e, "record_id"), text);
        }
    }
}

/* ---- --merge */

#define MAX_DOCS 1024

static int load(const char *path, json_t **docs, int *n)
{
    DIR *d = opendir(path);
    if (d != NULL) {
        struct dirent *e;
        int st = 0;
        while ((e = readdir(d)) != NULL && st == 0) {
            size_t l = strlen(e->d_name);
            if (l > 5 && strcmp(e->d_name + l - 5, ".json") == 0) {
                char p[4096];
                snprintf(p, sizeof(p), "%s/%s", path, e->d_name);
                st = load(p, docs, n);
            }
        }
        closedir(d);
        return st;
    }
    json_error_t err;
    json_t *doc = json_load_file(path, 0, &err);
    if (doc == NULL) {
        fprintf(stderr, "shardctl trace --merge: %s: %s (line %d)\n", path, err.text, err.line);
        return 1;
    }
    if (strcmp(str(doc, "version"), "shardd-trace-1") != 0) {
        fprintf(stderr, "shardctl trace --merge: %s is not a shardd flight recorder dump\n", path);
        json_decref(doc);
        return 1;
    }
    if (*n >= MAX_DOCS) {
        json_decref(doc);
        return 1;
    }
    docs[(*n)++] = doc;
    return 0;
}

/* the open call (op, seq) most ranks wait in, and how many */
struct waited {
    char op[32];
    long long seq, unit;
    int ranks;
};

/* No rank holds the others back (each reached the call most wait in, or none waits in one):
 * the transfers between nodes still open, by pair of nodes, into lines and out's
 * "stuck_transfers"; the verdict "transfers", or "none" when nothing is open either. */
static void stuck_transfers(json_t **mine, int m, long long nodes, json_t *lines, json_t *out)
{
    struct pair {
        long long node, peer;
        int sends, recvs;
        double oldest_s;
    } p[64];
    int np = 0;
    for (int i = 0; i < m; i++) {
        json_t *e;
        size_t j;
        json_array_foreach(json_object_get(mine[i], "entries"), j, e)
        {
            if (strcmp(str(e, "kind"), "call") == 0 || !open_state(e))
                continue;
            long long node = num(mine[i], "node"), peer = num(e, "peer_node");
            int k = 0;
            while (k < np && (p[k].node != node || p[k].peer != peer))
                k++;
            if (k == np) {
                if (np == 64)
                    continue;
                p[np++] = (struct pair){.node = node, .peer = peer};
            }
            if (strcmp(str(e, "kind"), "send") == 0)
                p[k].sends++;
            else
                p[k].recvs++;
            double age = age_s(mine[i], e);
            p[k].oldest_s = age > p[k].oldest_s ? age : p[k].oldest_s;
        }
    }
    char line[512];
    json_t *list = json_array();
    if (np == 0)
        json_array_append_new(lines, json_string("no rank holds the others back, and no transfer "
                                                 "between nodes is open"));
    else
        json_array_append_new(lines, json_string("no rank holds the others back: the nodes wait "
                                                 "on transfers between them (a link, or a node "
                                                 "that stopped answering)"));
    for (int k = 0; k < np; k++) {
        bool dumped = false;
        for (int i = 0; i < m; i++)
            dumped |= num(mine[i], "node") == p[k].peer;
        char note[64] = "";
        if (!dumped && p[k].peer < nodes)
            snprintf(note, sizeof(note), " (node %lld left no dump)", p[k].peer);
        snprintf(line, sizeof(line),
                 "node %lld with node %lld: %d send(s), %d receive(s) open, the oldest %.1f s "
                 "before its dump%s",
                 p[k].node, p[k].peer, p[k].sends, p[k].recvs, p[k].oldest_s, note);
        json_array_append_new(lines, json_string(line));
        json_array_append_new(list,
                              json_pack("{s:I, s:I, s:i, s:i, s:f}", "node", (json_int_t)p[k].node,
                                        "peer_node", (json_int_t)p[k].peer, "sends", p[k].sends,
                                        "receives", p[k].recvs, "oldest_s", p[k].oldest_s));
    }
    json_object_set_new(out, "stuck_transfers", list);
    json_object_set_new(out, "verdict", json_string(np ? "transfers" : "none"));
}

static void merge_job(json_t **docs, int n, const char *job, bool as_json)
{
    /* the dumps of this job, by node */
    json_t *mine[MAX_DOCS];
    int m = 0;
    long long nodes = 0;
    for (int i = 0; i < n; i++)
        if (strcmp(str(docs[i], "job"), job) == 0) {
            mine[m++] = docs[i];
            nodes = num(docs[i], "nodes");
        }
    json_t *out = json_pack("{s:s, s:I, s:i}", "job", job, "nodes", (json_int_t)nodes, "dumps", m);
    json_t *lines = json_array();
    char line[512];
    /* every rank's open calls: the collective most of them wait in */
    struct waited w[64];
    int nw = 0;
    for (int i = 0; i < m; i++) {
        json_t *e;
        size_t j;
        json_array_foreach(json_object_get(mine[i], "entries"), j, e)
        {
            if (strcmp(str(e, "kind"), "call") != 0 || !open_state(e))
                continue;
            int k = 0;
            while (k < nw &&
                   (strcmp(w[k].op, str(e, "op")) != 0 || w[k].seq != num(e, "collective_seq_id")))
                k++;
            if (k == nw && nw < 64) {
                snprintf(w[nw].op, sizeof(w[nw].op), "%s", str(e, "op"));
                w[nw].seq = num(e, "collective_seq_id");
                w[nw].unit = num(e, "unit");
                w[nw++].ranks = 0;
            }
            if (k < nw)
                w[k].ranks++;
        }
    }
    int best = -1;
    for (int k = 0; k < nw; k++)
        if (best < 0 || w[k].ranks > w[best].ranks)
            best = k;
    json_t *culprits = json_array();
    if (best >= 0) {
        snprintf(line, sizeof(line), "%d rank(s) wait in %s #%lld (unit %lld)", w[best].ranks,
                 w[best].op, w[best].seq, w[best].unit);
        json_array_append_new(lines, json_string(line));
        json_object_set_new(out, "waited_in",
                            json_pack("{s:s, s:I, s:I, s:i}", "op", w[best].op, "seq",
                                      (json_int_t)w[best].seq, "unit", (json_int_t)w[best].unit,
                                      "ranks", w[best].ranks));
        /* the ranks that did not reach it: fewer calls of that op than its seq */
        for (int i = 0; i < m; i++) {
            json_t *c;
            size_t j;
            json_array_foreach(json_object_get(mine[i], "calls_taken"), j, c)
            {
                long long taken = num(c, w[best].op);
                if (taken >= w[best].seq)
                    continue;
                long long rank = num(c, "rank");
                /* its last record */
                json_t *e, *last = NULL;
                size_t q;
                json_array_foreach(json_object_get(mine[i], "entries"), q, e)
                {
                    if (strcmp(str(e, "kind"), "call") == 0 && num(e, "rank") == rank)
                        last = e;
                }
                char what[256] = "no call recorded";
                if (last != NULL)
                    describe(mine[i], last, what, sizeof(what));
                snprintf(line, sizeof(line),
                         "rank %lld (node %lld) never called %s #%lld: it took %lld; its last "
                         "call: %s",
                         rank, num(mine[i], "node"), w[best].op, w[best].seq, taken, what);
                json_array_append_new(lines, json_string(line));
                json_array_append_new(
                    culprits, json_pack("{s:I, s:I, s:I, s:s}", "rank", (json_int_t)rank, "node",
                                        (json_int_t)num(mine[i], "node"), "calls_taken",
                                        (json_int_t)taken, "last_call", what));
            }
        }
    } else {
        json_array_append_new(lines, json_string("no rank waits in a call"));
    }
    if (json_array_size(culprits) > 0)
        json_object_set_new(out, "verdict", json_string("rank"));
    else
        stuck_transfers(mine, m, nodes, lines, out);
    json_object_set_new(out, "culprits", culprits);
    /* what each node waited in */
    json_t *per_node = json_array();
    for (long long node = 0; node < nodes; node++) {
        json_t *doc = NULL;
        for (int i = 0; i < m; i++)
            if (num(mine[i], "node") == node)
                doc = mine[i];
        if (doc == NULL) {
            snprintf(line, sizeof(line), "node %lld: no dump", node);
            json_array_append_new(lines, json_string(line));
            continue;
        }
        json_t *waits = json_array(), *e;
        size_t j;
        json_array_foreach(json_object_get(doc, "entries"), j, e)
        {
            if (!open_state(e))
                continue;
            char what[256];
            describe(doc, e, what, sizeof(what));
            if (strcmp(str(e, "kind"), "call") == 0) {
                char with_rank[300];
                snprintf(with_rank, sizeof(with_rank), "rank %lld: %s", num(e, "rank"), what);
                json_array_append_new(waits, json_string(with_rank));
            } else {
                json_array_append_new(waits, json_string(what));
            }
        }
        size_t nwaits = json_array_size(waits);
        snprintf(line, sizeof(line), "node %lld (%s%s%.120s): %s", node, str(doc, "state"),
                 str(doc, "error")[0] ? ": " : "", str(doc, "error"),
                 nwaits ? "waiting in" : "waiting in nothing");
        json_array_append_new(lines, json_string(line));
        json_t *wt;
        json_array_foreach(waits, j, wt)
        {
            snprintf(line, sizeof(line), "  %s", json_string_value(wt));
            json_array_append_new(lines, json_string(line));
        }
        json_array_append_new(per_node, json_pack("{s:I, s:s, s:o}", "node", (json_int_t)node,
                                                  "state", str(doc, "state"), "waiting", waits));
    }
    json_object_set_new(out, "nodes_waiting", per_node);
    json_object_set_new(out, "report", lines);
    if (as_json) {
        char *s = json_dumps(out, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        puts(s);
        free(s);
    } else {
        printf("job %s: %d dump(s) of %lld node(s)\n", job, m, nodes);
        json_t *l;
        size_t j;
        json_array_foreach(lines, j, l) printf("  %s\n", json_string_value(l));
    }
    json_decref(out);
}

int shardctl_trace_merge(int n_paths, char **paths, bool as_json)
{
    static json_t *docs[MAX_DOCS];
    int n = 0, rc = 0;
    for (int i = 0; i < n_paths; i++)
        rc |= load(paths[i], docs, &n);
    if (n == 0) {
        fprintf(stderr, "shardctl trace --merge: no dump found (give the files the failure "
                        "messages name, or `shardctl trace --job J --json` of each node saved "
                        "to files)\n");
        return 1;
    }
    /* one report per job named in the dumps */
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int k = 0; k < i; k++)
            seen |= strcmp(str(docs[k], "job"), str(docs[i], "job")) == 0;
        if (!seen)
            merge_job(docs, n, str(docs[i], "job"), as_json);
    }
    for (int i = 0; i < n; i++)
        json_decref(docs[i]);
    return rc;
}

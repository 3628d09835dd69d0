/* The cached schedule (issue 4) with real daemons and trainers:
 *  - identical sequences are frozen after the first step and replayed with prefetch; the
 *    parameters equal the reference run's; no allocation while frozen over 20 steady steps;
 *    the same with a gather pool too small to keep every unit (planned places, re-gathers);
 *  - a rank that makes different calls fails the job naming the position and the ranks, on one
 *    node (recordings compared) and across nodes (digests compared);
 *  - a layer skipped on one step, and an extra forward-only pass, fall back to on-demand
 *    fetching for that step, re-freeze, and still end equal to the reference run. */
#include "harness.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static struct th_daemon d;

static json_t *job_doc(const char *sock, const char *cmd, const char *job)
{
    json_t *doc = th_admin_json(sock, cmd);
    size_t i;
    json_t *j, *found = NULL;
    json_array_foreach(json_object_get(doc, "jobs"), i, j)
    {
        json_t *name = json_object_get(j, "job");
        if (name && strcmp(json_string_value(name), job) == 0)
            found = json_incref(j);
    }
    json_decref(doc);
    return found;
}

static long long num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return v ? (long long)json_integer_value(v) : -1;
}

struct run {
    const char *name, *plan;
    int world, steps, accum;
    const char *extra[6];
    double tol; /* 0: bitwise */
    bool expect_fail;
};

/* Start world ranks plus the reference; returns the number of processes that failed. */
static int train(const char *const *socks, int k, const struct run *r)
{
    char world[16], steps[16], accum[16], dump[400], ref[400];
    snprintf(world, sizeof(world), "%d", r->world);
    snprintf(steps, sizeof(steps), "%d", r->steps);
    snprintf(accum, sizeof(accum), "%d", r->accum);
    snprintf(dump, sizeof(dump), "%s/%s.bin", d.dir, r->name);
    snprintf(ref, sizeof(ref), "%s/%s-ref.bin", d.dir, r->name);
    const char *args[20] = {"--world", world,    "--steps", steps,    "--accum",
                            accum,     "--plan", r->plan,   "--quiet"};
    int n = 9;
    for (int i = 0; r->extra[i]; i++)
        args[n++] = r->extra[i];
    args[n] = NULL;
    int rcs[TH_MAX_RANKS + 1];
    int failed = th_train(d.dir, r->name, socks, k, r->world, args, dump, ref, rcs);
    if (r->expect_fail)
        return failed;
    for (int rank = 0; rank <= r->world; rank++)
        TH_CHECK(rcs[rank] == 0, "%s: process %d exit code %d (log %s/%s-%d.log)", r->name, rank,
                 rcs[rank], d.dir, r->name, rank);
    struct th_dump_diff dd;
    TH_CHECK(th_compare_dumps(dump, ref, r->tol, &dd), "%s: parameter dumps", r->name);
    TH_CHECK(dd.outside == 0, "%s: %zu parameters differ from the reference (tolerance %g)",
             r->name, dd.outside, r->tol);
    return failed;
}

/* a finished job's schedule and stats */
static void expect_schedule(const char *sock, const char *job, long long freezes,
                            long long invalidations, long long calls)
{
    json_t *sc = job_doc(sock, "schedule", job), *st = job_doc(sock, "stats", job);
    TH_CHECK(sc != NULL && st != NULL, "%s: schedule and stats", job);
    if (sc == NULL || st == NULL)
        return;
    TH_CHECK(strcmp(json_string_value(json_object_get(sc, "state")), "frozen") == 0,
             "%s: schedule %s", job, json_string_value(json_object_get(sc, "state")));
    TH_CHECK(num(sc, "freezes") == freezes && num(sc, "invalidations") == invalidations,
             "%s: %lld freezes (want %lld), %lld invalidations (want %lld)", job,
             num(sc, "freezes"), freezes, num(sc, "invalidations"), invalidations);
    TH_CHECK(num(sc, "calls_per_step") == calls, "%s: %lld calls per step, formula %lld", job,
             num(sc, "calls_per_step"), calls);
    TH_CHECK(num(sc, "prefetch_hits") > 0, "%s: fetches found their unit gathered ahead", job);
    long long peak = num(sc, "pool_peak_bytes"), lb = num(sc, "pool_lower_bound_bytes");
    TH_CHECK(peak >= lb && lb >= num(sc, "largest_unit_bytes") && peak <= num(sc, "pool_bytes"),
             "%s: pool peak %lld, lower bound %lld, largest unit %lld, pool %lld", job, peak, lb,
             num(sc, "largest_unit_bytes"), num(sc, "pool_bytes"));
    if (json_is_true(json_object_get(st, "allocations_counted"))) {
        TH_CHECK(num(sc, "allocations_while_frozen") == 0,
                 "%s: %lld allocations while the schedule was frozen", job,
                 num(sc, "allocations_while_frozen"));
        TH_CHECK(num(st, "allocations_since_register") == 0,
                 "%s: %lld allocations since registration", job,
                 num(st, "allocations_since_register"));
    } else {
        printf("%s: allocations are not counted in this build (sanitizer)\n", job);
    }
    printf("%s: frozen %lld time(s), %lld invalidations, %lld prefetches, %lld fetches found "
           "ready, pool peak %lld (lower bound %lld, pool %lld)\n",
           job, num(sc, "freezes"), num(sc, "invalidations"), num(sc, "prefetches"),
           num(sc, "prefetch_hits"), peak, lb, num(sc, "pool_bytes"));
    json_decref(sc);
    json_decref(st);
}

static bool log_has(const char *name, int rank, const char *what)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/%s-%d.log", d.dir, name, rank);
    char *text = th_read_file(path, NULL);
    bool found = text && strstr(text, what);
    if (!found)
        fprintf(stderr, "%s rank %d log lacks '%s':\n%s\n", name, rank, what, text ? text : "");
    free(text);
    return found;
}

int main(void)
{
    const char *extra[] = {"--log-level", "info", NULL};
    if (th_daemon_start(&d, extra) != 0) {
        TH_CHECK(0, "daemon start");
        return th_summary("test_replay");
    }
    const char *socks[1] = {d.sock};
    /* 4 layers: per micro-step 2 calls per layer forward, 3 backward */
    struct run steady = {"steady", "zero3", 2, 21, 2, {NULL}, 0, false};
    train(socks, 4, &steady);
    expect_schedule(d.sock, "steady", 1, 0, 2 * 5 * 4);

    /* a pool for one large unit and the small ones: planned places, units gathered again */
    struct run tight = {"tight", "zero3", 2, 21, 2, {"--max-live-bytes", "900000", NULL}, 0, false};
    train(socks, 4, &tight);
    expect_schedule(d.sock, "tight", 1, 0, 2 * 5 * 4);

    struct run skip = {"skip", "zero3", 2, 12, 2, {"--skip-layer", "5:1", NULL}, 0, false};
    train(socks, 4, &skip);
    expect_schedule(d.sock, "skip", 2, 1, 2 * 5 * 4);

    /* evaluation after steps 5, 10, 15, 20 (the last one runs into the final dump) */
    struct run eval = {"eval", "mics:2", 4, 20, 1, {"--eval-every", "5", NULL}, 1e-5, false};
    train(socks, 4, &eval);
    expect_schedule(d.sock, "eval", 4, 4, 5 * 4);

    struct run div = {"div", "zero3", 2, 5, 1, {"--diverge-from", "1", NULL}, 0, true};
    TH_CHECK(train(socks, 4, &div) == 2, "both ranks of the divergent job fail");
    TH_CHECK(log_has("div", 0,
                     "schedule: ranks 0 and 1 of one partition group made different "
                     "calls in step 1: at call 0 rank 0 made fetch unit 0, rank 1 "
                     "made fetch unit 3"),
             "the error names the position, the ranks and their calls");
    char *status = th_admin(d.sock, "status");
    TH_CHECK(status != NULL, "the daemon answers after the divergent job");
    free(status);
    TH_CHECK(th_daemon_stop(&d) == 0, "clean shutdown");

    /* across nodes: both ranks of node 1 make the extra call; the digests differ */
    /* coalesce_bytes 2 MiB: the two 578 KiB hidden layers of the nok job travel together */
    struct th_cluster cl;
    static const char *const copts[] = {"--coalesce-bytes", "2MiB", NULL};
    if (th_cluster_start(&cl, 2, 2, copts) != 0) {
        TH_CHECK(0, "cluster start");
        return th_summary("test_replay");
    }
    const char *csocks[2] = {cl.d[0].sock, cl.d[1].sock};
    snprintf(d.dir, sizeof(d.dir), "%s", cl.d[0].dir);
    struct run ndiv = {"ndiv", "zero3", 4, 5, 1, {"--diverge-from", "2", NULL}, 0, true};
    TH_CHECK(train(csocks, 2, &ndiv) == 4, "every rank of the divergent job fails");
    TH_CHECK(log_has("ndiv", 0, "recorded different calls in step 1") &&
                 log_has("ndiv", 3, "recorded different calls in step 1"),
             "the error names the nodes");
    struct run nok = {"nok", "zero3", 4, 6, 2, {NULL}, 1e-5, false};
    train(csocks, 2, &nok);
    expect_schedule(cl.d[0].sock, "nok", 1, 0, 2 * 5 * 4);
    expect_schedule(cl.d[1].sock, "nok", 1, 0, 2 * 5 * 4);
    /* consecutive units under coalesce_bytes travel together, and the parameters above still
     * equal the reference */
    for (int i = 0; i < 2; i++) {
        json_t *st = job_doc(cl.d[i].sock, "stats", "nok");
        long long cg = num(st, "coalesced_gathers"), cu = num(st, "coalesced_units");
        TH_CHECK(cg > 0 && cu >= 2 * cg, "node %d: %lld coalesced gathers moved %lld units", i, cg,
                 cu);
        json_decref(st);
    }
    TH_CHECK(th_cluster_stop(&cl) == 0, "cluster shutdown");
    return th_summary("test_replay");
}

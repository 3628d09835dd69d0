/* Recovery from replicas (issue 22, item 4): shardctl checkpoint --job J DIR writes a checkpoint
 * of a running, paused or failed job from the daemons still up.
 *
 * - node loss: 4 nodes x 2 ranks under mics:2 (the optimizer states on every node), SIGKILL the
 *   daemon of node 1 mid-training; the survivors keep the failed job's state (resume_timeout_ms)
 *   and node 0 writes a complete checkpoint, node 2 writing the shards node 1 would have. It
 *   holds one copy of every state and verifies; a 2-node cluster loads it under zero3 and trains
 *   10 more steps: equal to mlp_train --reference --load of the same checkpoint.
 * - no replica: the same under zero3, node 3 killed: refused (SHARD_ENOREPLICA), and the missing
 *   extents it lists are exactly those node 3 wrote in the job's last regular save (its
 *   data-3.bin): an independent account of what only node 3 held. Nothing is left in DIR.
 * - running and paused: on 2 nodes x 2 ranks a job saves after every step (shard_save); a
 *   checkpoint written meanwhile by shardctl equals the job's own of the same step bit for bit.
 *   A second run of the same job is paused (a rank SIGKILLed, resume_timeout_ms): its recovered
 *   checkpoint equals the first run's of that step bit for bit (the runs are deterministic).
 * - refusals: an unknown job, a daemon that is not node 0. */
#include "harness.h"
#include "sd/ckpt.h"
#include "sd/status.h"
#include "sd/util.h"

#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TOL_FP32 1e-5

static char base[256];

/* rank r of job on cluster c: mlp_train with the shared options and extra ones */
static pid_t start_rank(const struct th_cluster *c, const char *job, const char *plan, int r,
                        const char *steps, const char *const *extra)
{
    char world[16], log[400];
    snprintf(world, sizeof(world), "%d", c->nodes * c->k);
    snprintf(log, sizeof(log), "%s/%s-%d.log", base, job, r);
    const char *args[] = {"--world",      world, "--plan",         plan,    "--steps", steps,
                          "--hidden",     "64",  "--seed",         "7",     "--accum", "2",
                          "--compute-ms", "3",   "--compute-mode", "sleep", "--quiet", NULL};
    return th_spawn_rank(c->d[r / c->k].sock, job, r, args, extra, log);
}

/* shardctl --json --socket sock checkpoint --job job dir: its exit code, its answer */
static int shardctl_checkpoint(const char *sock, const char *job, const char *dir, json_t **doc_p)
{
    return th_checkpoint_job(base, sock, job, dir, doc_p);
}

/* wait until job (ready, on the daemon at sock) has taken at least n steps; false after 60 s */
static bool wait_steps(const char *sock, const char *job, long long n)
{
    for (double end = th_now_s() + 60; th_now_s() < end; usleep(20000)) {
        json_t *doc = th_admin_json(sock, "jobs"), *j;
        size_t i;
        long long steps = -1;
        json_array_foreach(json_object_get(doc, "jobs"), i, j)
        {
            const char *name = json_string_value(json_object_get(j, "name"));
            const char *state = json_string_value(json_object_get(j, "state"));
            if (name && state && strcmp(name, job) == 0 && strcmp(state, "running") == 0)
                steps = (long long)json_integer_value(json_object_get(j, "steps"));
        }
        json_decref(doc);
        if (steps >= n)
            return true;
    }
    TH_CHECK(false, "job %s did not reach step %lld within 60 s", job, n);
    return false;
}

static void kill_node(struct th_cluster *c, int node)
{
    kill(c->d[node].pid, SIGKILL);
    th_wait(c->d[node].pid, 10000);
    c->d[node].pid = 0; /* th_cluster_stop passes it over */
}

/* every rank exits (none hangs); returns how many exited 0 */
static int wait_ranks(const pid_t *pids, int n)
{
    int ok = 0, hung = 0;
    for (int r = 0; r < n; r++) {
        int rc = th_wait(pids[r], 60000);
        ok += rc == 0;
        hung += rc == -1;
    }
    TH_CHECK(hung == 0, "%d ranks did not exit within 60 s", hung);
    return ok;
}

/* the checkpoint at dir holds one copy of every state and verifies */
static void check_complete(const char *dir, const char *plan)
{
    struct sd_ckpt ck;
    char err[1200];
    uint64_t bad = 0, params = 0;
    int st = sd_ckpt_open(dir, &ck, err, sizeof(err));
    TH_CHECK(st == SD_OK, "%s: %s", dir, err);
    if (st != SD_OK)
        return;
    for (uint32_t t = 0; t < ck.n_tensors; t++)
        params += ck.tensors[t].numel;
    TH_CHECK(strcmp(ck.plan, plan) == 0 && ck.bytes == params * ck.n_states * sizeof(float),
             "%s: plan %s, %llu bytes for %llu parameters x %u states", dir, ck.plan,
             (unsigned long long)ck.bytes, (unsigned long long)params, ck.n_states);
    TH_CHECK(sd_ckpt_verify(&ck, &bad, err, sizeof(err)) == SD_OK && bad == 0, "%s: %s", dir, err);
    sd_ckpt_close(&ck);
}

/* every state of every tensor of checkpoints a and b, bit for bit */
static void same_state(const char *a, const char *b)
{
    struct sd_ckpt x, y;
    char err[1200];
    if (sd_ckpt_open(a, &x, err, sizeof(err)) != SD_OK) {
        TH_CHECK(false, "%s: %s", a, err);
        return;
    }
    if (sd_ckpt_open(b, &y, err, sizeof(err)) != SD_OK) {
        TH_CHECK(false, "%s: %s", b, err);
        sd_ckpt_close(&x);
        return;
    }
    struct sd_ckpt_reader rx, ry;
    sd_ckpt_reader_init(&rx, &x, err, sizeof(err));
    sd_ckpt_reader_init(&ry, &y, err, sizeof(err));
    uint64_t n = 0, differ = 0;
    TH_CHECK(x.step == y.step && x.n_tensors == y.n_tensors && x.n_states == y.n_states,
             "%s and %s: steps %llu and %llu", a, b, (unsigned long long)x.step,
             (unsigned long long)y.step);
    for (uint32_t t = 0; t < x.n_tensors && t < y.n_tensors; t++) {
        uint64_t numel = x.tensors[t].numel;
        float *fa = malloc(numel * sizeof(float)), *fb = malloc(numel * sizeof(float));
        for (uint32_t s = 0; fa && fb && s < x.n_states; s++) {
            int sa = sd_ckpt_read(&rx, s, t, 0, numel, fa, err, sizeof(err));
            int sb = sd_ckpt_read(&ry, s, t, 0, numel, fb, err, sizeof(err));
            TH_CHECK(sa == SD_OK && sb == SD_OK, "reading tensor %u state %u: %s", t, s, err);
            for (uint64_t i = 0; i < numel; i++, n++)
                differ += memcmp(&fa[i], &fb[i], sizeof(float)) != 0;
            TH_CHECK(x.tensors[t].steps == y.tensors[t].steps, "tensor %u: steps %llu vs %llu", t,
                     (unsigned long long)x.tensors[t].steps,
                     (unsigned long long)y.tensors[t].steps);
        }
        free(fa);
        free(fb);
    }
    TH_CHECK(differ == 0 && n > 0, "%s vs %s: %llu of %llu values differ", a, b,
             (unsigned long long)differ, (unsigned long long)n);
    printf("%s = %s: %llu values of step %llu, bit for bit\n", b, a, (unsigned long long)n,
           (unsigned long long)x.step);
    sd_ckpt_reader_free(&rx);
    sd_ckpt_reader_free(&ry);
    sd_ckpt_close(&x);
    sd_ckpt_close(&y);
}

static const char *const keep[] = {"--resume-timeout-ms", "60000", NULL};

/* mics:2 on 4 x 2, node 1 lost: recovered from the replicas, loaded on 2 x 2 under zero3 */
/* job's 8 ranks on the 4 x 2 cluster a, node `node` SIGKILLed once the job took 12 steps:
 * every rank must fail */
static void train_then_lose(struct th_cluster *a, const char *job, const char *plan,
                            const char *const *extra, int node)
{
    pid_t pids[8];
    for (int r = 0; r < 8; r++)
        pids[r] = start_rank(a, job, plan, r, "2000", extra);
    wait_steps(a->d[0].sock, job, 12);
    kill_node(a, node);
    TH_CHECK(wait_ranks(pids, 8) == 0, "every rank of %s fails once node %d is lost", job, node);
}

static void node_loss(void)
{
    struct th_cluster a, b;
    char dir[300];
    snprintf(dir, sizeof(dir), "%s/from-replicas", base);
    TH_CHECK(th_cluster_start(&a, 4, 2, keep) == 0, "4 x 2 cluster");
    train_then_lose(&a, "lost", "mics:2", NULL, 1);
    json_t *doc = NULL;
    int rc = shardctl_checkpoint(a.d[0].sock, "lost", dir, &doc);
    TH_CHECK(rc == 0 && doc != NULL, "checkpoint from the survivors: exit %d", rc);
    long long step = th_json_int(doc, "step");
    json_t *lost = json_object_get(doc, "lost_nodes");
    TH_CHECK(step > 0 && json_array_size(lost) == 1 &&
                 json_integer_value(json_array_get(lost, 0)) == 1 && th_json_int(doc, "files") == 2,
             "step %lld, lost nodes [1], 2 files (node 0's and node 2's, for node 1's shard)",
             step);
    printf("recovered step %lld of 'lost' without node 1: %s\n", step,
           json_string_value(json_object_get(doc, "checkpoint")));
    json_decref(doc);
    check_complete(dir, "mics:2");
    /* node 2 is not the coordinator */
    rc = shardctl_checkpoint(a.d[2].sock, "lost", dir, &doc);
    const char *err = json_string_value(json_object_get(doc, "error"));
    TH_CHECK(rc == 1 && err && strstr(err, "node 0"), "node 2 refuses, naming node 0: %s",
             err ? err : "(none)");
    json_decref(doc);
    rc = shardctl_checkpoint(a.d[0].sock, "no-such-job", dir, &doc);
    TH_CHECK(rc == 1 && th_json_int(doc, "status") == SD_ENOJOB, "an unknown job: exit %d", rc);
    json_decref(doc);
    TH_CHECK(th_cluster_stop(&a) == 0, "the survivors stop cleanly");

    TH_CHECK(th_cluster_start(&b, 2, 2, NULL) == 0, "2 x 2 cluster");
    char steps[32];
    snprintf(steps, sizeof(steps), "%lld", step + 10);
    const char *args[] = {"--world", "4", "--plan",  "zero3", "--steps", steps, "--hidden", "64",
                          "--seed",  "7", "--accum", "2",     "--load",  dir,   "--quiet",  NULL};
    struct th_dump_diff dd;
    if (th_cluster_train(&b, "continued", args, "zero3 on 2 x 2 from the replicas", TOL_FP32,
                         &dd)) {
        TH_CHECK(dd.outside == 0, "%zu of %zu parameters outside the tolerance (max %g)",
                 dd.outside, dd.n, dd.maxd);
        printf("continued to step %s on 2 x 2: %zu parameters, %zu differ from the reference, "
               "max %.3g\n",
               steps, dd.n, dd.differ, dd.maxd);
    }
    TH_CHECK(th_cluster_stop(&b) == 0, "2 x 2 cluster stopped uncleanly");
}

/* merged [begin, end) ranges per tensor name, as "name:b-e;" text in order */
static void add_range(json_t *by_tensor, const char *name, long long b, long long e)
{
    json_t *a = json_object_get(by_tensor, name);
    if (a == NULL) {
        a = json_array();
        json_object_set_new(by_tensor, name, a);
    }
    json_array_append_new(a, json_pack("[I, I]", (json_int_t)b, (json_int_t)e));
}

static int cmp_range(const void *x, const void *y)
{
    const long long *a = x, *b = y;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

static void ranges_text(json_t *by_tensor, char *out, size_t len)
{
    size_t off = 0;
    out[0] = '\0';
    const char *name;
    json_t *a;
    json_object_foreach(by_tensor, name, a)
    {
        size_t n = json_array_size(a);
        long long(*r)[2] = calloc(n + 1, sizeof(*r));
        for (size_t i = 0; i < n; i++) {
            r[i][0] = (long long)json_integer_value(json_array_get(json_array_get(a, i), 0));
            r[i][1] = (long long)json_integer_value(json_array_get(json_array_get(a, i), 1));
        }
        qsort(r, n, sizeof(*r), cmp_range);
        for (size_t i = 0; i < n && off < len; i++) {
            long long b = r[i][0], e = r[i][1];
            while (i + 1 < n && r[i + 1][0] == e)
                e = r[++i][1];
            off += (size_t)snprintf(out + off, len - off, "%s:%lld-%lld;", name, b, e);
        }
        free(r);
    }
}

/* zero3 on 4 x 2, node 3 lost: refused, the missing extents are node 3's of its last save */
static void no_replica(void)
{
    struct th_cluster a;
    char dir[300], saves[300];
    snprintf(dir, sizeof(dir), "%s/refused", base);
    snprintf(saves, sizeof(saves), "%s/zero3-saves", base);
    TH_CHECK(th_cluster_start(&a, 4, 2, keep) == 0, "4 x 2 cluster");
    const char *save[] = {"--save-every", "3", "--save-dir", saves, NULL};
    train_then_lose(&a, "only-copy", "zero3", save, 3);
    json_t *doc = NULL;
    int rc = shardctl_checkpoint(a.d[0].sock, "only-copy", dir, &doc);
    TH_CHECK(rc == 1 && th_json_int(doc, "status") == SD_ENOREPLICA, "refused: exit %d", rc);
    const char *err = json_string_value(json_object_get(doc, "error"));
    printf("refused as it must: %s\n", err ? err : "(no error)");
    /* what is missing, and what node 3 alone wrote in the last save */
    json_t *got = json_object(), *want = json_object();
    json_t *missing = json_object_get(doc, "missing");
    for (size_t i = 0; i < json_array_size(missing); i++) {
        json_t *x = json_array_get(missing, i), *range = json_object_get(x, "range");
        add_range(got, json_string_value(json_object_get(x, "tensor")),
                  (long long)json_integer_value(json_array_get(range, 0)),
                  (long long)json_integer_value(json_array_get(range, 1)));
        TH_CHECK(json_array_size(json_object_get(x, "states")) == 3, "every state is missing");
    }
    struct sd_ckpt ck;
    char e2[1200];
    if (sd_ckpt_open(saves, &ck, e2, sizeof(e2)) == SD_OK) {
        for (uint64_t i = 0; i < ck.n_extents; i++) {
            const struct sd_ckpt_extent *x = &ck.extents[i];
            if (x->state == 0 && strcmp(ck.files[x->file], "data-3.bin") == 0)
                add_range(want, ck.tensors[x->tensor].name, (long long)x->begin, (long long)x->end);
        }
        sd_ckpt_close(&ck);
    } else {
        TH_CHECK(false, "the job's last save: %s", e2);
    }
    static char g[8192], w[8192];
    ranges_text(got, g, sizeof(g));
    ranges_text(want, w, sizeof(w));
    TH_CHECK(g[0] != '\0' && strcmp(g, w) == 0,
             "the missing extents are node 3's of the last save:\n  listed %s\n  node 3 %s", g, w);
    printf("missing, as node 3 held them: %s\n", g);
    json_decref(got);
    json_decref(want);
    json_decref(doc);
    struct stat sb;
    char latest[400];
    snprintf(latest, sizeof(latest), "%s/LATEST", dir);
    TH_CHECK(stat(latest, &sb) != 0, "a refused checkpoint leaves no LATEST in %s", dir);
    TH_CHECK(th_cluster_stop(&a) == 0, "the survivors stop cleanly");
}

/* A running job's checkpoint, and a paused job's, against the job's own saves */
static void running_and_paused(void)
{
    struct th_cluster a;
    char saves[300], live[300], paused[300], p[400];
    snprintf(saves, sizeof(saves), "%s/own-saves", base);
    snprintf(live, sizeof(live), "%s/while-running", base);
    snprintf(paused, sizeof(paused), "%s/while-paused", base);
#ifdef SD_TEST_HOOKS
    /* node 1 writes its part of a recovery 600 ms late: the job's next steps reach their
     * optimizer while that worker still reads the os shards, and must go on once it is done */
    setenv("SHARDD_TEST_FILE_STALL", "1:600:recover", 1);
#endif
    TH_CHECK(th_cluster_start(&a, 2, 2, NULL) == 0, "2 x 2 cluster");
    unsetenv("SHARDD_TEST_FILE_STALL");
    const char *opts[] = {"--save-every",        "1",     "--save-dir", saves,
                          "--resume-timeout-ms", "60000", NULL};
    pid_t pids[4];
    for (int r = 0; r < 4; r++)
        pids[r] = start_rank(&a, "live", "zero3", r, "80", opts);
    wait_steps(a.d[0].sock, "live", 10);
    json_t *doc = NULL;
    int rc = 1;
    for (int i = 0; i < 40 && rc != 0; i++) { /* EBUSY while the job saves */
        json_decref(doc);
        rc = shardctl_checkpoint(a.d[0].sock, "live", live, &doc);
        if (rc != 0)
            usleep(50 * 1000);
    }
    TH_CHECK(rc == 0, "checkpoint of the running job");
    long long step = th_json_int(doc, "step");
    json_decref(doc);
    TH_CHECK(wait_ranks(pids, 4) == 4, "the running job completes");
    snprintf(p, sizeof(p), "%s/step-%08lld", saves, step);
    same_state(p, live);

    /* the same job again, paused by a SIGKILLed rank */
    const char *opts2[] = {"--resume-timeout-ms", "60000", NULL};
    for (int r = 0; r < 4; r++)
        pids[r] = start_rank(&a, "paused", "zero3", r, "80", opts2);
    wait_steps(a.d[0].sock, "paused", 10);
    kill(pids[3], SIGKILL);
    usleep(500 * 1000);
    rc = shardctl_checkpoint(a.d[0].sock, "paused", paused, &doc);
    TH_CHECK(rc == 0, "checkpoint of the paused job");
    step = th_json_int(doc, "step");
    json_decref(doc);
    for (int r = 0; r < 3; r++)
        kill(pids[r], SIGKILL);
    wait_ranks(pids, 4);
    snprintf(p, sizeof(p), "%s/step-%08lld", saves, step);
    TH_CHECK(step > 0 && step < 80, "paused at step %lld", step);
    same_state(p, paused);
    TH_CHECK(th_cluster_stop(&a) == 0, "2 x 2 cluster stopped uncleanly");
}

int main(void)
{
    snprintf(base, sizeof(base), "/tmp/test_recover.%d", (int)getpid());
    mkdir(base, 0755);
    node_loss();
    no_replica();
    running_and_paused();
    int rc = th_summary("test_recover");
    if (rc == 0) {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", base);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", base);
    }
    return rc;
}

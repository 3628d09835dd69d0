/* Checkpoints (issue 22): save under one world and plan, load under another, and crash safety.
 *
 * test_checkpoint reshard: on 2 nodes x 2 ranks, mics:2 (fp32, bf16) and topo:1/2/4 save at
 * step 10; on 4 nodes x 2 ranks zero3 (and topo:2/4/8) loads them and trains to step 20; then
 * zero3 saves and mics:2 on 2 x 2 loads. Each continued run is compared with mlp_train
 * --reference --load, which reads the checkpoint itself (docs/checkpoints.md's format, its own
 * crc32c) and continues with the new world: the fidelity tests' tolerances. Also: a checkpoint
 * holds one copy of the states (file bytes = parameters x states x 4), a flipped byte is refused
 * naming the file and the extent, a different model is refused naming the first difference;
 * node 0's ranks 700 ms late to every save (the other node reports its part before node 0's
 * save begins) still commit every save; node 1's write stalled 6 s fails the save at node 0's
 * deadline, naming node 1.
 *
 * test_checkpoint device [BACKEND]: the daemon's device paths (backend emu-gpu, whose memory
 * faults when the daemon touches it on the host, as a GPU's: allocation on the loop, saves and
 * loads through a staging buffer and the backend's copies and casts, transfers across nodes
 * staged) against the host backend's: saved on 2 x 2 under emu-gpu (fp32 and bf16; the data
 * files bitwise equal to the same run's on the host backend), loaded on 4 x 2 under the host
 * backend; saved there, loaded on 2 x 2 under emu-gpu; each continued run against the
 * reference. BACKEND emu-device runs the same with device memory the host may touch;
 * host-deferred with host memory whose kernels run only when the daemon waits for them (a save's
 * write and a load's reads start, and a load ends, once the loop's poll saw the device there).
 *
 * test_checkpoint crash [TRIALS]: a one-node job saves after every step while a trainer or the
 * daemon is SIGKILLed at a random moment; afterwards LATEST names a complete checkpoint that
 * verifies and loads, and the next save removes what the interrupted one left. */
#include "harness.h"
#include "sd/ckpt.h"
#include "sd/status.h"
#include "sd/util.h"

#include <dirent.h>
#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TOL_FP32 1e-5
#define TOL_BF16 0.0078125 /* 2^-7: one bf16 ulp */

static char base[256];

/* a cluster run of mlp_train with the shared options and extra ones; false on a failure */
static bool train(const struct th_cluster *c, const char *job, const char *plan, int steps,
                  const char *dtype, const char *save, const char *load, double tol)
{
    char world[16], st[16], what[128];
    snprintf(world, sizeof(world), "%d", c->nodes * c->k);
    snprintf(st, sizeof(st), "%d", steps);
    const char *args[32] = {"--world", world, "--plan",   plan, "--steps", st,  "--dtype", dtype,
                            "--seed",  "7",   "--hidden", "64", "--accum", "2", "--quiet"};
    int n = 15;
    if (save != NULL) {
        args[n++] = "--save-every";
        args[n++] = "10";
        args[n++] = "--save-dir";
        args[n++] = save;
    }
    if (load != NULL) {
        args[n++] = "--load";
        args[n++] = load;
    }
    args[n] = NULL;
    snprintf(what, sizeof(what), "%s %s world %s%s%s", plan, dtype, world, load ? " loading " : "",
             load ? load : "");
    struct th_dump_diff dd;
    if (!th_cluster_train(c, job, args, what, tol, &dd))
        return false;
    TH_CHECK(dd.outside == 0, "%s: %zu of %zu parameters outside the tolerance %g (max %g)", what,
             dd.outside, dd.n, tol, dd.maxd);
    printf("%s: %zu parameters, %zu differ from the reference, max %.3g\n", what, dd.n, dd.differ,
           dd.maxd);
    return dd.outside == 0;
}

/* the checkpoint at dir holds one copy of every state, and LATEST names step */
static void check_saved(const char *dir, uint64_t step, const char *plan)
{
    struct sd_ckpt ck;
    char err[1200];
    int st = sd_ckpt_open(dir, &ck, err, sizeof(err));
    TH_CHECK(st == SD_OK, "%s: %s", dir, err);
    if (st != SD_OK)
        return;
    uint64_t params = 0, bad = 0, files = 0;
    for (uint32_t t = 0; t < ck.n_tensors; t++)
        params += ck.tensors[t].numel;
    for (uint32_t f = 0; f < ck.n_files; f++) {
        char p[SD_CKPT_PATH_MAX + 80];
        struct stat sb;
        snprintf(p, sizeof(p), "%s/%s", ck.path, ck.files[f]);
        files += stat(p, &sb) == 0 ? (uint64_t)sb.st_size : 0;
    }
    TH_CHECK(ck.step == step && strcmp(ck.plan, plan) == 0, "%s: step %llu plan %s", dir,
             (unsigned long long)ck.step, ck.plan);
    TH_CHECK(files == params * ck.n_states * sizeof(float) && ck.bytes == files,
             "%s: data files hold %llu bytes, one copy of %llu parameters x %u states is %llu", dir,
             (unsigned long long)files, (unsigned long long)params, ck.n_states,
             (unsigned long long)(params * ck.n_states * sizeof(float)));
    TH_CHECK(sd_ckpt_verify(&ck, &bad, err, sizeof(err)) == SD_OK && bad == 0, "%s: %s", dir, err);
    sd_ckpt_close(&ck);
}

/* a run that must fail, its rank 0's log naming every one of the words */
static void train_refused(const struct th_cluster *c, const char *job, const char *load,
                          const char *hidden, const char *const *words)
{
    char world[16], log[400];
    snprintf(world, sizeof(world), "%d", c->nodes * c->k);
    pid_t pids[TH_MAX_RANKS];
    int world_n = c->nodes * c->k, failed = 0;
    snprintf(log, sizeof(log), "%s/%s-0.log", base, job);
    const char *args[] = {"--world",  world,  "--plan", "zero3", "--steps", "20",
                          "--hidden", hidden, "--load", load,    "--quiet", NULL};
    for (int r = 0; r < world_n; r++) {
        char lg[400];
        snprintf(lg, sizeof(lg), "%s/%s-%d.log", base, job, r);
        pids[r] = th_spawn_rank(c->d[r / c->k].sock, job, r, args, NULL, lg);
    }
    for (int r = 0; r < world_n; r++)
        failed += th_wait(pids[r], 60000) != 0;
    TH_CHECK(failed == world_n, "%s: %d of %d ranks failed; all must", job, failed, world_n);
    char *text = th_read_file(log, NULL);
    for (int i = 0; words[i] != NULL; i++)
        TH_CHECK(text && strstr(text, words[i]), "%s: rank 0's error does not name '%s': %s", job,
                 words[i], text ? text : "(no log)");
    if (text != NULL)
        printf("%s refused as it must: %s", job, text);
    free(text);
}

/* the 4 ranks of a 2 x 2 zero3 job saving into dir after every 2 of `steps` steps, node 0's
 * ranks `delay0` ms late to each save; their logs base/JOB-R.log; returns how many failed or
 * hung for 30 s */
static int run_saving(const struct th_cluster *c, const char *job, const char *dir,
                      const char *steps, const char *delay0, char logs[4][400])
{
    const char *args[] = {"--world",  "4",  "--plan",       "zero3", "--steps",    steps,
                          "--hidden", "64", "--save-every", "2",     "--save-dir", dir,
                          "--quiet",  NULL};
    pid_t pids[4];
    for (int r = 0; r < 4; r++) {
        snprintf(logs[r], 400, "%s/%s-%d.log", base, job, r);
        const char *late[] = {"--save-delay-ms", r < 2 ? delay0 : "0", NULL};
        pids[r] = th_spawn_rank(c->d[r / c->k].sock, job, r, args, late, logs[r]);
    }
    int failed = 0;
    for (int r = 0; r < 4; r++)
        failed += th_wait(pids[r], 30000) != 0;
    return failed;
}

/* node 0's ranks come to every save 700 ms after node 1's, which has written its part and
 * reported it before node 0's save has begun: the report is kept, every save commits */
static void late_node0(const struct th_cluster *c)
{
    char dir[300], logs[4][400];
    snprintf(dir, sizeof(dir), "%s/late", base);
    int failed = run_saving(c, "late", dir, "6", "700", logs);
    char *text = th_read_file(logs[0], NULL);
    TH_CHECK(failed == 0, "node 0's ranks late to the saves: %d of 4 ranks failed or hung: %s",
             failed, text ? text : "(no log)");
    free(text);
    uint64_t step = 0;
    struct sd_ckpt ck;
    char err[1200];
    if (sd_ckpt_open(dir, &ck, err, sizeof(err)) == SD_OK) {
        step = ck.step;
        sd_ckpt_close(&ck);
    }
    TH_CHECK(step == 6, "node 0 late to the saves: LATEST holds step %llu, not 6: %s",
             (unsigned long long)step, step ? "" : err);
    printf("node 0's ranks 700 ms late to each of 3 saves: all committed, LATEST step %llu\n",
           (unsigned long long)step);
}

static int count_leftovers(const char *dir)
{
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *de;
    while (d != NULL && (de = readdir(d)) != NULL)
        n += strncmp(de->d_name, ".tmp-", 5) == 0;
    if (d != NULL)
        closedir(d);
    return n;
}

/* a file task stalls (SHARDD_TEST_FILE_STALL=NODE:MS:WHAT, a hung filesystem) under an
 * op_timeout_ms of 1500: the operation fails once its deadline passes, naming the node and what
 * did not finish, every rank is answered then and not when the stall ends, nothing of the
 * stuck save is left in the directory once its worker returns, and a daemon asked to stop
 * while a worker is still stuck exits within its bound (5 s) */
static void stalled(int nodes, int node, const char *what, int stall_ms, const char *load,
                    const char *const *words)
{
    struct th_cluster c;
    const char *extra[] = {"--op-timeout-ms", "1500", NULL};
    char env[64], job[64], dir[400], logs[4][400];
    snprintf(env, sizeof(env), "%d:%d:%s", node, stall_ms, what);
    snprintf(job, sizeof(job), "stalled-%s-%d", what, node);
    setenv("SHARDD_TEST_FILE_STALL", env, 1);
    int st = th_cluster_start(&c, nodes, 4 / nodes, extra);
    unsetenv("SHARDD_TEST_FILE_STALL");
    TH_CHECK(st == 0, "%d x %d cluster with node %d's %s stalled", nodes, 4 / nodes, node, what);
    if (st != 0)
        return;
    snprintf(dir, sizeof(dir), "%s/%s", base, job);
    double t0 = th_now_s();
    int failed = 0, named = 0;
    if (load == NULL) {
        failed = run_saving(&c, job, dir, "4", "0", logs);
    } else {
        const char *args[] = {"--world",  "4",  "--plan", "zero3", "--steps", "12",
                              "--hidden", "64", "--load", load,    "--quiet", NULL};
        pid_t pids[4];
        for (int r = 0; r < 4; r++) {
            snprintf(logs[r], 400, "%s/%s-%d.log", base, job, r);
            pids[r] = th_spawn_rank(c.d[r / c.k].sock, job, r, args, NULL, logs[r]);
        }
        for (int r = 0; r < 4; r++)
            failed += th_wait(pids[r], 30000) != 0;
    }
    double took = th_now_s() - t0;
    for (int r = 0; r < 4; r++) {
        char *text = th_read_file(logs[r], NULL);
        bool all = text != NULL;
        for (int w = 0; all && words[w] != NULL; w++)
            all = strstr(text, words[w]) != NULL;
        named += all;
        if (r == 0)
            printf("node %d's %s stalled %d ms: %s", node, what, stall_ms,
                   text ? text : "(no log)\n");
        free(text);
    }
    TH_CHECK(failed == 4 && named == 4,
             "node %d's %s stalled: %d of 4 ranks failed, %d were told '%s ... %s'", node, what,
             failed, named, words[0], words[1] ? words[1] : "");
    TH_CHECK(took < 5.5,
             "node %d's %s stalled: the ranks were answered %.1f s after they started: the "
             "deadline (1.5 s and the data at 16 MiB/s) did not fire before the stall ended",
             node, what, took);
    if (stall_ms < 8000) { /* the worker returns: what it made goes */
        usleep((useconds_t)(stall_ms - (int)(took * 1000) + 1500) * 1000);
        int left = count_leftovers(dir);
        TH_CHECK(left == 0, "node %d's %s stalled: %d temporary directories left in %s", node, what,
                 left, dir);
    }
    double s0 = th_now_s();
    TH_CHECK(th_cluster_stop(&c) == 0, "the cluster with node %d's %s stalled stopped uncleanly",
             node, what);
    TH_CHECK(th_now_s() - s0 < 9.0,
             "stopping with a worker stuck for %d ms took %.1f s (the bound is 5 s a daemon)",
             stall_ms, th_now_s() - s0);
}

static int copy_file(const char *from, const char *to)
{
    size_t n;
    char *b = th_read_file(from, &n);
    FILE *f = b ? fopen(to, "wb") : NULL;
    int rc = f != NULL && fwrite(b, 1, n, f) == n ? 0 : -1;
    if (f != NULL)
        fclose(f);
    free(b);
    return rc;
}

/* every kind of file task stalled in turn: its operation fails at its deadline */
static int stalls(void)
{
    /* node 1's own deadline or node 0's for its report, whichever comes first */
    const char *node1_save[] = {"node 1", "did not", NULL};
    stalled(2, 1, "save", 6000, NULL, node1_save);
    const char *node0_save[] = {"node 0", "writing its part of the checkpoint did not finish",
                                NULL};
    stalled(2, 0, "save", 6000, NULL, node0_save);
    const char *commit[] = {"node 0", "committing the checkpoint did not finish", NULL};
    stalled(2, 0, "commit", 60000, NULL, commit); /* still stuck when the daemons stop */
    /* a checkpoint to load */
    struct th_cluster c;
    char d_z3[300], logs[4][400];
    snprintf(d_z3, sizeof(d_z3), "%s/to-load", base);
    TH_CHECK(th_cluster_start(&c, 2, 2, NULL) == 0, "2 x 2 cluster");
    TH_CHECK(run_saving(&c, "to-load", d_z3, "10", "0", logs) == 0, "saving a checkpoint to load");
    TH_CHECK(th_cluster_stop(&c) == 0, "2 x 2 cluster stopped uncleanly");
    const char *load_words[] = {"node 0", "reading its part of the checkpoint did not finish",
                                NULL};
    stalled(1, 0, "load", 6000, d_z3, load_words);
    const char *open_words[] = {"reading the checkpoint's manifest did not finish", NULL};
    stalled(2, 0, "open", 6000, d_z3, open_words);
    return th_summary("test_checkpoint stall");
}

static int reshard(void)
{
    struct th_cluster a, b;
    char d_mics[300], d_bf16[300], d_topo[300], d_z3[300], d_z3bf[300], bad[300], p[400], q[400];
    snprintf(d_mics, sizeof(d_mics), "%s/mics", base);
    snprintf(d_bf16, sizeof(d_bf16), "%s/mics-bf16", base);
    snprintf(d_topo, sizeof(d_topo), "%s/topo", base);
    snprintf(d_z3, sizeof(d_z3), "%s/zero3", base);
    snprintf(d_z3bf, sizeof(d_z3bf), "%s/zero3-bf16", base);
    snprintf(bad, sizeof(bad), "%s/flipped", base);

    TH_CHECK(th_cluster_start(&a, 2, 2, NULL) == 0, "2 x 2 cluster");
    late_node0(&a);
    train(&a, "save-mics", "mics:2", 10, "fp32", d_mics, NULL, TOL_FP32);
    train(&a, "save-mics-bf16", "mics:2", 10, "bf16", d_bf16, NULL, TOL_BF16);
    train(&a, "save-topo", "topo:1/2/4", 10, "fp32", d_topo, NULL, TOL_FP32);
    TH_CHECK(th_cluster_stop(&a) == 0, "2 x 2 cluster stopped uncleanly");
    check_saved(d_mics, 10, "mics:2");
    check_saved(d_bf16, 10, "mics:2");
    check_saved(d_topo, 10, "topo:1/2/4");

    TH_CHECK(th_cluster_start(&b, 4, 2, NULL) == 0, "4 x 2 cluster");
    train(&b, "load-mics", "zero3", 20, "fp32", NULL, d_mics, TOL_FP32);
    train(&b, "load-mics-bf16", "zero3", 20, "bf16", NULL, d_bf16, TOL_BF16);
    train(&b, "load-topo", "topo:2/4/8", 20, "fp32", NULL, d_topo, TOL_FP32);
    train(&b, "save-zero3", "zero3", 10, "fp32", d_z3, NULL, TOL_FP32);
    train(&b, "save-zero3-bf16", "zero3", 10, "bf16", d_z3bf, NULL, TOL_BF16);
    /* one node: across two, the other's first fetch may time out first */
    check_saved(d_z3, 10, "zero3");
    check_saved(d_z3bf, 10, "zero3");

    /* one flipped byte in node 1's file: refused, naming the file and the extent */
    snprintf(p, sizeof(p), "%s/step-00000010", bad);
    mkdir(bad, 0750);
    mkdir(p, 0750);
    const char *names[] = {"MANIFEST", "data-0.bin", "data-1.bin", "data-2.bin", "data-3.bin"};
    for (size_t i = 0; i < SD_ARRAY_SIZE(names); i++) {
        snprintf(p, sizeof(p), "%s/step-00000010/%s", d_z3, names[i]);
        snprintf(q, sizeof(q), "%s/step-00000010/%s", bad, names[i]);
        TH_CHECK(copy_file(p, q) == 0, "copy %s", p);
    }
    snprintf(q, sizeof(q), "%s/LATEST", bad);
    FILE *f = fopen(q, "w");
    fputs("step-00000010\n", f);
    fclose(f);
    snprintf(q, sizeof(q), "%s/step-00000010/data-1.bin", bad);
    f = fopen(q, "r+b");
    TH_CHECK(f != NULL, "open %s", q);
    if (f != NULL) {
        fseek(f, 1000, SEEK_SET);
        int ch = fgetc(f);
        fseek(f, 1000, SEEK_SET);
        fputc(ch ^ 0x10, f);
        fclose(f);
    }
    const char *corrupt_words[] = {"data-1.bin", "extent", "corrupt", NULL};
    train_refused(&b, "load-corrupt", bad, "64", corrupt_words);
    /* another model: refused at registration, naming the first difference */
    const char *model_words[] = {"fc0.weight", "shape", NULL};
    train_refused(&b, "load-other-model", d_z3, "32", model_words);
    TH_CHECK(th_cluster_stop(&b) == 0, "4 x 2 cluster stopped uncleanly");

    TH_CHECK(th_cluster_start(&a, 2, 2, NULL) == 0, "2 x 2 cluster again");
    train(&a, "load-zero3", "mics:2", 20, "fp32", NULL, d_z3, TOL_FP32);
    train(&a, "load-zero3-bf16", "mics:2", 20, "bf16", NULL, d_z3bf, TOL_BF16);
    TH_CHECK(th_cluster_stop(&a) == 0, "2 x 2 cluster stopped uncleanly");
    return th_summary("test_checkpoint reshard");
}

/* ---- crash safety */

/* 2 ranks on d: save after every step of a model of about 1.6M parameters (19 MiB a save) */
static void start_job(const struct th_daemon *d, const char *dir, bool load, int steps,
                      pid_t pids[2], int trial)
{
    char st[16];
    snprintf(st, sizeof(st), "%d", steps);
    const char *args[] = {"--world",  "2",          "--plan",  "zero3", "--hidden", "512",
                          "--layers", "8",          "--steps", st,      "--quiet",  "--save-every",
                          "1",        "--save-dir", dir,       NULL};
    const char *loading[] = {"--load", dir, NULL};
    for (int r = 0; r < 2; r++) {
        char log[400];
        snprintf(log, sizeof(log), "%s/crash-%d-%d.log", base, trial, r);
        pids[r] = th_spawn_rank(d->sock, "crash", r, args, load ? loading : NULL, log);
    }
}

static bool latest_ok(const char *dir, uint64_t *step_p)
{
    struct sd_ckpt ck;
    char err[1200];
    uint64_t bad = 0;
    if (sd_ckpt_open(dir, &ck, err, sizeof(err)) != SD_OK) {
        TH_CHECK(false, "after the kill, %s does not open: %s", dir, err);
        return false;
    }
    int st = sd_ckpt_verify(&ck, &bad, err, sizeof(err));
    TH_CHECK(st == SD_OK && bad == 0, "after the kill, %s does not verify: %s", ck.path, err);
    *step_p = ck.step;
    sd_ckpt_close(&ck);
    return st == SD_OK;
}

static int crash(int trials)
{
    struct th_daemon d;
    char dir[300], latest[400];
    snprintf(dir, sizeof(dir), "%s/crash", base);
    snprintf(latest, sizeof(latest), "%s/LATEST", dir);
    unsigned seed = (unsigned)time(NULL);
    srand(seed);
    printf("crash trials: %d, seed %u\n", trials, seed);
    TH_CHECK(th_daemon_start(&d, NULL) == 0, "shardd");
    int daemon_kills = 0, rank_kills = 0, seen_partial = 0;
    uint64_t last_step = 0;
    for (int t = 0; t < trials; t++) {
        struct stat sb;
        bool have = stat(latest, &sb) == 0;
        pid_t pids[2];
        start_job(&d, dir, have, 100000, pids, t);
        /* the job registers, loads and saves every step (tens of ms each): a moment in one */
        usleep(300000 + (useconds_t)(rand() % 500) * 1000);
        bool kill_daemon = t % 2 == 1;
        if (kill_daemon) {
            kill(d.pid, SIGKILL);
            daemon_kills++;
        } else {
            kill(pids[rand() % 2], SIGKILL);
            rank_kills++;
        }
        for (int r = 0; r < 2; r++)
            if (th_wait(pids[r], 60000) == -1)
                TH_CHECK(false, "trial %d: rank %d did not exit after the kill", t, r);
        if (kill_daemon) {
            th_wait(d.pid, 10000);
            seen_partial += count_leftovers(dir) > 0;
            TH_CHECK(th_daemon_start(&d, NULL) == 0, "trial %d: shardd restarted", t);
        }
        if (stat(latest, &sb) == 0) {
            uint64_t step = 0;
            latest_ok(dir, &step);
            TH_CHECK(step >= last_step, "trial %d: LATEST went back from step %llu to %llu", t,
                     (unsigned long long)last_step, (unsigned long long)step);
            last_step = step;
        }
    }
    /* the last checkpoint loads; its saves remove what interrupted ones left (a log line each) */
    pid_t pids[2];
    start_job(&d, dir, true, (int)last_step + 2, pids, trials);
    for (int r = 0; r < 2; r++)
        TH_CHECK(th_wait(pids[r], 120000) == 0, "the job loading step %llu: rank %d failed",
                 (unsigned long long)last_step, r);
    uint64_t step = 0;
    latest_ok(dir, &step);
    TH_CHECK(step == last_step + 2, "after loading step %llu and 2 more steps LATEST is %llu",
             (unsigned long long)last_step, (unsigned long long)step);
    TH_CHECK(count_leftovers(dir) == 0, "%d partial checkpoints left in %s", count_leftovers(dir),
             dir);
    TH_CHECK(last_step > 0, "no save completed in %d trials", trials);
    printf("%d trials (%d daemons, %d ranks killed): partial checkpoints left by %d daemon kills, "
           "all removed; last step saved %llu\n",
           trials, daemon_kills, rank_kills, seen_partial, (unsigned long long)last_step);
    TH_CHECK(th_daemon_stop(&d) == 0, "shardd did not shut down cleanly");
    return th_summary("test_checkpoint crash");
}

static void remove_tree(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *de;
    while (d != NULL && (de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char p[1024];
        struct stat sb;
        snprintf(p, sizeof(p), "%s/%s", path, de->d_name);
        if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
            remove_tree(p);
        else
            unlink(p);
    }
    if (d != NULL)
        closedir(d);
    rmdir(path);
}

/* backend: emu-gpu (device memory the daemon cannot touch on the host), emu-device, or
 * host-deferred (host memory, kernels run only when the daemon waits for them) */
static int device(const char *backend)
{
    const char *dev_args[] = {"--backend", backend, NULL};
    int nodes = 2, k = 2;
    struct th_cluster a, b;
    char d_dev[300], d_devbf[300], d_host[300];
    snprintf(d_dev, sizeof(d_dev), "%s/device", base);
    snprintf(d_devbf, sizeof(d_devbf), "%s/device-bf16", base);
    snprintf(d_host, sizeof(d_host), "%s/host", base);

    /* the same run on the host backend: the device's data files must equal its bit for bit
     * (the emulated kernels equal the host backend's, the plan and world fix the layout), which
     * the loads below could not see: the reference reads the files the daemon wrote */
    char d_ref[300];
    snprintf(d_ref, sizeof(d_ref), "%s/host-ref", base);
    TH_CHECK(th_cluster_start(&a, nodes, k, NULL) == 0, "%d x %d cluster on host", nodes, k);
    train(&a, "host-ref", "mics:2", 10, "fp32", d_ref, NULL, TOL_FP32);
    TH_CHECK(th_cluster_stop(&a) == 0, "host cluster stopped uncleanly");

    TH_CHECK(th_cluster_start(&a, nodes, k, dev_args) == 0, "%d x %d cluster on %s", nodes, k,
             backend);
    train(&a, "dev-save", "mics:2", 10, "fp32", d_dev, NULL, TOL_FP32);
    train(&a, "dev-save-bf16", "mics:2", 10, "bf16", d_devbf, NULL, TOL_BF16);
    TH_CHECK(th_cluster_stop(&a) == 0, "%s cluster stopped uncleanly", backend);
    check_saved(d_dev, 10, "mics:2");
    check_saved(d_devbf, 10, "mics:2");
    for (int node = 0; node < nodes; node++) {
        char p[400], q[400];
        size_t np = 0, nq = 0;
        snprintf(p, sizeof(p), "%s/step-00000010/data-%d.bin", d_dev, node);
        snprintf(q, sizeof(q), "%s/step-00000010/data-%d.bin", d_ref, node);
        char *x = th_read_file(p, &np), *y = th_read_file(q, &nq);
        TH_CHECK(x && y && np == nq && np > 0 && memcmp(x, y, np) == 0,
                 "data-%d.bin saved from %s (%zu bytes) differs from the host backend's (%zu "
                 "bytes)",
                 node, backend, np, nq);
        free(x);
        free(y);
    }

    TH_CHECK(th_cluster_start(&b, 4, 2, NULL) == 0, "4 x 2 cluster on host");
    train(&b, "host-load", "zero3", 20, "fp32", NULL, d_dev, TOL_FP32);
    train(&b, "host-load-bf16", "zero3", 20, "bf16", NULL, d_devbf, TOL_BF16);
    train(&b, "host-save", "zero3", 10, "fp32", d_host, NULL, TOL_FP32);
    TH_CHECK(th_cluster_stop(&b) == 0, "4 x 2 host cluster stopped uncleanly");
    check_saved(d_host, 10, "zero3");

    TH_CHECK(th_cluster_start(&a, nodes, k, dev_args) == 0, "%s cluster again", backend);
    train(&a, "dev-load", "mics:2", 20, "fp32", NULL, d_host, TOL_FP32);
    train(&a, "dev-load-topo", "topo:1/2/4", 20, "fp32", NULL, d_dev, TOL_FP32);
    TH_CHECK(th_cluster_stop(&a) == 0, "%s cluster stopped uncleanly", backend);
    return th_summary("test_checkpoint device");
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "reshard";
    snprintf(base, sizeof(base), "/tmp/shardd-ckpt-XXXXXX");
    if (mkdtemp(base) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    int rc = strcmp(mode, "crash") == 0    ? crash(argc > 2 ? atoi(argv[2]) : 50)
             : strcmp(mode, "stall") == 0  ? stalls()
             : strcmp(mode, "device") == 0 ? device(argc > 2 ? argv[2] : "emu-gpu")
                                           : reshard();
    if (rc == 0)
        remove_tree(base);
    else
        fprintf(stderr, "kept %s for inspection\n", base);
    return rc;
}

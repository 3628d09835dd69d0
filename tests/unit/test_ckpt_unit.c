/* A job's checkpoints (daemon/persist/checkpoint.c, ckpt_commit.c, ckpt_load.c, with loading.c)
 * without a daemon: the modules linked alone with the host backend and a job built by hand (its w
 * and os arenas holding values the test knows), on one node, their file work run in place (no
 * file pool: the registry without a loop), in a temporary directory; fakes of the optimizer's
 * bookkeeping, the step and the cluster. test_checkpoint runs saves and loads across daemons,
 * worlds and plans with real trainers; this one checks the modules' own logic:
 *  - a save (zero3, 2 ranks, AdamW): nothing happens before the last rank's call; then every
 *    rank is answered with the step and the save's number; LATEST names step-00000007, which
 *    the format's reader (common/ckpt.c) opens and verifies (every crc), and whose every state
 *    of every tensor equals the arenas' values by the definition of the shards; the tensors'
 *    own step counts and the groups' hyperparameters are the optimizer's;
 *  - one replica per extent: a ddp save of 2 ranks writes each element once (rank 0's);
 *  - refusals of a save: a relative path or none (EINVAL), a rank twice (EBUSY), ranks to
 *    different directories (EMISMATCH naming both), a rank in a step meanwhile (ESTATE);
 *  - a load into another plan and world (ddp, 1 rank; mics:2, 2 ranks): the manifest read at
 *    registration (opened), the masters, moments and weights (fp32, bf16) in every rank's
 *    shards equal the saved values, the step, tensor steps and hyperparameters restored, the
 *    job loaded (ready);
 *  - a checkpoint of another model refused at registration naming the difference; a load
 *    directory that is not absolute refused at creation. */
#include "check.h"
#include "bulk_fake.h"
#include "checkpoint.h"
#include "cluster/cluster.h"
#include "fetch.h"
#include "job_fixture.h"
#include "file_pool.h"
#include "loading.h"
#include "optimizer.h"
#include "recover.h"
#include "schedule.h"
#include "step.h"
#include "sd/ckpt.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define N_TENSORS 2

/* ---- what the fakes record, and how they answer */
static struct {
    int arrived; /* sd_step_arrived */
    int events_text, ev_status, restores;
    char ev_msg[1200];
    uint64_t restored_step, set_steps[N_TENSORS];
    struct sd_hparams restored_hp;
} F;

static uint64_t tensor_steps[N_TENSORS] = {7, 5};
static struct sd_hparams hp[1] = {
    {.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.1f}};

uint64_t sd_optim_applied(const struct sd_job *job)
{
    (void)job;
    return 7;
}

const uint64_t *sd_optim_tensor_steps(const struct sd_job *job)
{
    (void)job;
    return tensor_steps;
}

const struct sd_hparams *sd_optim_hparams(const struct sd_job *job)
{
    (void)job;
    return hp;
}

void sd_optim_set_tensor_steps(struct sd_job *job, uint32_t t, uint64_t steps)
{
    (void)job;
    if (t < N_TENSORS)
        F.set_steps[t] = steps;
}

void sd_optim_restore(struct sd_job *job, const struct sd_hparams *groups, uint32_t n,
                      uint64_t step)
{
    (void)job;
    F.restores++;
    F.restored_step = step;
    if (n > 0)
        F.restored_hp = groups[0];
}

bool sd_step_running(const struct sd_job *job)
{
    (void)job;
    return false;
}

void sd_sched_prefetch(struct sd_job *job)
{
    (void)job;
}

uint32_t sd_step_arrived(const struct sd_job *job)
{
    (void)job;
    return (uint32_t)F.arrived;
}

bool sd_recover_target(const struct sd_job *job)
{
    (void)job;
    return false;
}

void sd_recover_done(struct sd_job *job, int status, const char *msg, const struct sd_ckpt *man,
                     const char *final)
{
    (void)job;
    (void)status;
    (void)msg;
    (void)man;
    (void) final;
}

struct sd_file_pool *sd_job_files(const struct sd_job *job)
{
    (void)job;
    return NULL; /* the work runs in place, as the owner */
}

void sd_file_pool_submit(struct sd_file_pool *pool, struct sd_file_task *t)
{
    (void)pool;
    (void)t;
}

void sd_file_pool_parallel(struct sd_file_pool *pool, uint32_t threads, uint64_t n,
                           sd_ckpt_par_fn *fn, void *arg)
{
    (void)pool;
    (void)threads;
    for (uint64_t i = 0; i < n; i++)
        fn(arg, 0, i);
}

struct sd_cluster *sd_job_cluster(const struct sd_job *job)
{
    (void)job;
    return NULL;
}

void sd_cluster_job_saved(struct sd_cluster *cl, uint32_t node, const Shard__JobSaved *m)
{
    (void)cl;
    (void)node;
    (void)m;
}

void sd_cluster_job_save_done(struct sd_cluster *cl, const char *job, const uint32_t *ids,
                              uint32_t n, uint64_t seq, int status, const char *msg)
{
    (void)cl;
    (void)job;
    (void)ids;
    (void)n;
    (void)seq;
    (void)status;
    (void)msg;
}

void sd_cluster_job_ready(struct sd_cluster *cl, const char *job, const uint32_t *ids, uint32_t n)
{
    (void)cl;
    (void)job;
    (void)ids;
    (void)n;
}

bool sd_job_event_text(struct sd_job *job, enum sd_job_event ev, int status, const char *text)
{
    (void)job;
    (void)ev;
    F.events_text++;
    F.ev_status = status;
    snprintf(F.ev_msg, sizeof(F.ev_msg), "%s", text ? text : "");
    return false;
}

const char *sd_job_values_from(const struct sd_job *job)
{
    return sd_ckpt_loading(job) ? "loading a checkpoint" : NULL;
}

bool sd_job_shards_busy(const struct sd_job *job)
{
    (void)job;
    return false;
}

void sd_fetch_serve_queue(struct sd_job *job)
{
    (void)job;
}

/* ---- the jobs */
static const uint64_t sizes[N_TENSORS] = {3000, 5000};

/* state s (0 master, 1 exp_avg, 2 exp_avg_sq) of tensor t's element i */
static float value(uint32_t s, uint32_t t, uint64_t i)
{
    return (float)(s + 1) * 0.5f + (float)t * 100.0f + (float)i * 0.0137f + 1.0f / 3.0f;
}

struct fixture {
    struct th_job tj;
    struct sd_job *job;
    struct sd_mem control[2];
    struct sd_session *ranks[2];
    uint32_t node_ids[1];
};

/* a job of plan on 1 x k, AdamW, its state READY (fill: the arenas hold the values) or LOADING
 * from load */
static bool setup(struct fixture *fx, const char *plan, uint32_t k, int dtype, bool fill,
                  const char *load, char *err, size_t errlen)
{
    memset(fx, 0, sizeof(*fx));
    th_fake_reset();
    th_bulks_reset();
    if (!th_job_build(&fx->tj, plan, 1, k, 0, sizes, N_TENSORS, dtype))
        return false;
    struct sd_job *job = fx->job = &fx->tj.job;
    job->model.optim.kind = SD_OPTIM_ADAMW;
    job->model.optim.lr = 0.01f;
    fx->tj.cfg.checkpoint_threads = 2;
    fx->tj.cfg.op_timeout_ms = 10000;
    th_job_state_arenas(&fx->tj);
    job->ranks = fx->ranks;
    job->xfer.node_ids = fx->node_ids;
    job->mem.fence = fx->control;
    job->mem.save_path_off = 512;
    for (uint32_t r = 0; r < k; r++) {
        fx->control[r].bytes = 512 + SD_CKPT_PATH_MAX;
        fx->control[r].ptr = calloc(1, fx->control[r].bytes);
        fx->ranks[r] = &fx->tj.s[r];
    }
    struct sd_fsid owner = {.uid = geteuid(), .gid = getegid()};
    int st = sd_ckpt_job_init(job, &owner, load, err, errlen);
    sd_loading_create(job);
    job->state = load != NULL ? SD_JOB_LOADING : SD_JOB_READY;
    if (!fill)
        return st == SD_OK;
    const struct sd_layout *l = &job->layout;
    for (uint32_t r = 0; r < k; r++)
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            const struct sd_tensor_layout *tl = &l->tensors[ul->first_tensor];
            uint64_t b, e;
            sd_layout_shard(ul, &job->plan, SD_STATE_OS, r, &b, &e);
            for (uint32_t s = 0; s < 3; s++)
                for (uint64_t i = b; i < e; i++)
                    sd_job_os_state(job, r, s, ul)[i - b] =
                        i < tl->offset + tl->numel ? value(s, u, i) : 0;
        }
    return st == SD_OK;
}

static void teardown(struct fixture *fx)
{
    sd_loading_destroy(fx->job);
    sd_ckpt_job_free(fx->job);
    for (uint32_t r = 0; r < fx->job->k; r++)
        free(fx->control[r].ptr);
    th_job_free(&fx->tj);
}

/* local rank r's save to dir with tag */
static void save(struct fixture *fx, uint32_t r, const char *dir, uint64_t tag)
{
    size_t len = strlen(dir);
    memcpy(sd_job_control(fx->job, r, fx->job->mem.save_path_off), dir, len);
    struct sd_sqe e = {.op = SD_OP_SAVE, .tag = tag, .arg0 = len};
    sd_ckpt_save(fx->job, &fx->tj.s[r], &e);
}

static char root[256];

/* the checkpoint in dir against the values, through the format's reader: elements that differ */
static long check_saved(const char *dir, uint64_t *bytes_p)
{
    struct sd_ckpt ck;
    char err[512];
    if (sd_ckpt_open(dir, &ck, err, sizeof(err)) != SD_OK) {
        TH_CHECK(false, "open %s: %s", dir, err);
        return -1;
    }
    uint64_t bad = 0;
    TH_CHECK(sd_ckpt_verify(&ck, &bad, err, sizeof(err)) == SD_OK && bad == 0,
             "every extent's crc holds (%s)", err);
    TH_CHECK(ck.step == 7 && ck.n_states == 3 && ck.n_tensors == N_TENSORS &&
                 ck.tensors[0].steps == 7 && ck.tensors[1].steps == 5 && ck.n_groups == 1 &&
                 ck.groups[0].lr == hp[0].lr && ck.groups[0].weight_decay == hp[0].weight_decay,
             "its step, the tensors' steps and the hyperparameters are the optimizer's");
    *bytes_p = ck.bytes;
    struct sd_ckpt_reader rd;
    long diff = 0;
    if (sd_ckpt_reader_init(&rd, &ck, err, sizeof(err)) == SD_OK) {
        for (uint32_t t = 0; t < N_TENSORS; t++) {
            float *v = calloc(sizes[t], sizeof(float));
            for (uint32_t s = 0; s < 3; s++) {
                if (sd_ckpt_read(&rd, s, t, 0, sizes[t], v, err, sizeof(err)) != SD_OK) {
                    TH_CHECK(false, "read: %s", err);
                    diff++;
                    continue;
                }
                for (uint64_t i = 0; i < sizes[t]; i++)
                    diff += v[i] != value(s, t, i);
            }
            free(v);
        }
        sd_ckpt_reader_free(&rd);
    }
    sd_ckpt_close(&ck);
    return diff;
}

static void test_save(void)
{
    struct fixture fx;
    char err[512], dir[300];
    snprintf(dir, sizeof(dir), "%s/run", root);
    if (!setup(&fx, "zero3", 2, SD_DTYPE_FP32, true, NULL, err, sizeof(err)))
        return;
    save(&fx, 0, dir, 10);
    TH_CHECK(th_fake.done == 0 && access(dir, F_OK) != 0, "save: nothing before the last rank");
    save(&fx, 0, dir, 11);
    TH_CHECK(th_fake.fails == 1 && th_fake.fail_status == SD_EBUSY, "save: a rank twice (%s)",
             th_fake.fail_msg);
    save(&fx, 1, "/elsewhere", 12);
    TH_CHECK(th_fake.fails == 2 && th_fake.fail_status == SD_EMISMATCH &&
                 strstr(th_fake.fail_msg, "/elsewhere") != NULL &&
                 strstr(th_fake.fail_msg, dir) != NULL,
             "save: ranks to different directories refused naming both (%s)", th_fake.fail_msg);
    save(&fx, 1, "relative/x", 13);
    TH_CHECK(th_fake.fails == 3 && th_fake.fail_status == SD_EINVAL &&
                 strstr(th_fake.fail_msg, "not an absolute path") != NULL,
             "save: a relative path refused (%s)", th_fake.fail_msg);
    save(&fx, 1, "", 14);
    TH_CHECK(th_fake.fails == 4 && th_fake.fail_status == SD_EINVAL, "save: no path refused");
    F.arrived = 1;
    save(&fx, 1, dir, 15);
    TH_CHECK(th_fake.fails == 5 && th_fake.fail_status == SD_ESTATE &&
                 strstr(th_fake.fail_msg, "in step 1") != NULL,
             "save: refused while a rank of the node is in a step (%s)", th_fake.fail_msg);
    F.arrived = 0;
    save(&fx, 1, dir, 16);
    int a = th_answered(0, 10), b = th_answered(1, 16);
    TH_CHECK(a >= 0 && b >= 0 && th_fake.ans[a].status == SD_OK && th_fake.ans[b].status == SD_OK &&
                 th_fake.ans[a].v0 == 7 && th_fake.ans[a].v1 == 1,
             "save: both ranks answered with step 7, save 1 (%d %s)",
             a >= 0 ? th_fake.ans[a].status : -1, a >= 0 ? th_fake.ans[a].msg : "");
    char latest[400], buf[64] = "";
    snprintf(latest, sizeof(latest), "%s/LATEST", dir);
    FILE *f = fopen(latest, "r");
    if (f != NULL) {
        TH_CHECK(fgets(buf, sizeof(buf), f) != NULL, "LATEST read");
        fclose(f);
    }
    TH_CHECK(strncmp(buf, "step-00000007", 13) == 0, "LATEST names step-00000007 ('%s')", buf);
    uint64_t bytes = 0;
    long diff = check_saved(dir, &bytes);
    TH_CHECK(diff == 0, "every state of every tensor saved as the arenas hold it (%ld differ)",
             diff);
    TH_CHECK(bytes == 3 * (sizes[0] + sizes[1]) * sizeof(float),
             "each element of each state saved once (%llu bytes)", (unsigned long long)bytes);
    teardown(&fx);

    /* ddp: two replicas of everything, written once */
    snprintf(dir, sizeof(dir), "%s/ddp", root);
    if (!setup(&fx, "ddp", 2, SD_DTYPE_FP32, true, NULL, err, sizeof(err)))
        return;
    save(&fx, 1, dir, 20);
    save(&fx, 0, dir, 21);
    TH_CHECK(th_answered(0, 21) >= 0 && th_answered(1, 20) >= 0, "ddp save: answered");
    diff = check_saved(dir, &bytes);
    char data[400];
    snprintf(data, sizeof(data), "%s/step-00000007/data-0.bin", dir);
    struct stat sb;
    TH_CHECK(diff == 0 && stat(data, &sb) == 0 &&
                 (uint64_t)sb.st_size == 3 * (sizes[0] + sizes[1]) * sizeof(float),
             "ddp save: one replica per extent (%lld bytes, %ld differ)", (long long)sb.st_size,
             diff);
    teardown(&fx);
}

/* load the first save into plan on 1 x k */
static void test_load(const char *plan, uint32_t k, int dtype)
{
    struct fixture fx;
    char err[512], dir[300];
    snprintf(dir, sizeof(dir), "%s/run", root);
    memset(&F, 0, sizeof(F));
    if (!setup(&fx, plan, k, dtype, false, dir, err, sizeof(err))) {
        TH_CHECK(false, "%s: load set up: %s", plan, err);
        return;
    }
    struct sd_job *job = fx.job;
    TH_CHECK(!sd_ckpt_opened(job) && sd_ckpt_loading(job), "%s: not opened before it is read",
             plan);
    sd_ckpt_open_start(job);
    TH_CHECK(sd_ckpt_opened(job) && F.events_text == 1 && F.ev_status == SD_OK &&
                 sd_ckpt_start_step(job) == 7,
             "%s: the manifest read at registration, step 7 (%s)", plan, F.ev_msg);
    sd_ckpt_load_start(job);
    TH_CHECK(th_fake.job_fails == 0 && job->state == SD_JOB_READY && job->steps == 7,
             "%s: loaded and ready at step 7 (%s)", plan, th_fake.job_msg);
    TH_CHECK(F.restores == 1 && F.restored_step == 7 && F.restored_hp.lr == hp[0].lr &&
                 F.set_steps[0] == 7 && F.set_steps[1] == 5,
             "%s: the step, hyperparameters and tensor steps restored", plan);
    const struct sd_layout *l = &job->layout;
    long bad = 0;
    for (uint32_t r = 0; r < k; r++)
        for (uint32_t u = 0; u < l->n_units; u++) {
            const struct sd_unit_layout *ul = &l->units[u];
            uint64_t b, e;
            sd_layout_shard(ul, &job->plan, SD_STATE_OS, r, &b, &e);
            for (uint32_t s = 0; s < 3; s++)
                for (uint64_t i = b; i < e && i < sizes[u]; i++)
                    bad += sd_job_os_state(job, r, s, ul)[i - b] != value(s, u, i);
            sd_layout_shard(ul, &job->plan, SD_STATE_W, r, &b, &e);
            const uint8_t *w = sd_job_w_shard(job, r, u);
            for (uint64_t i = b; i < e && i < sizes[u]; i++) {
                if (dtype == SD_DTYPE_BF16) {
                    uint16_t h;
                    memcpy(&h, w + 2 * (i - b), 2);
                    bad += h != th_bf16(value(0, u, i));
                } else {
                    float x;
                    memcpy(&x, w + 4 * (i - b), 4);
                    bad += x != value(0, u, i);
                }
            }
        }
    TH_CHECK(bad == 0,
             "%s: every rank's masters, moments and weights are the saved values (%ld "
             "differ)",
             plan, bad);
    teardown(&fx);
}

static void test_refusals(void)
{
    struct fixture fx;
    char err[512], dir[300];
    snprintf(dir, sizeof(dir), "%s/run", root);
    TH_CHECK(!setup(&fx, "zero3", 2, SD_DTYPE_FP32, false, "relative/dir", err, sizeof(err)) &&
                 strstr(err, "not an absolute path") != NULL,
             "a load directory that is not absolute refused (%s)", err);
    teardown(&fx);
    /* another model: a tensor of another size */
    memset(&F, 0, sizeof(F));
    th_fake_reset();
    th_bulks_reset();
    memset(&fx, 0, sizeof(fx));
    static const uint64_t other[N_TENSORS] = {3000, 4000};
    th_job_build(&fx.tj, "zero3", 1, 2, 0, other, N_TENSORS, SD_DTYPE_FP32);
    fx.job = &fx.tj.job;
    fx.job->model.optim.kind = SD_OPTIM_ADAMW;
    th_job_state_arenas(&fx.tj);
    struct sd_fsid owner = {.uid = geteuid(), .gid = getegid()};
    TH_CHECK(sd_ckpt_job_init(fx.job, &owner, dir, err, sizeof(err)) == SD_OK, "another model's");
    sd_loading_create(fx.job);
    sd_ckpt_open_start(fx.job);
    TH_CHECK(F.events_text == 1 && F.ev_status != SD_OK && strstr(F.ev_msg, "another model") &&
                 !sd_ckpt_opened(fx.job),
             "a checkpoint of another model refused at registration naming it (%s)", F.ev_msg);
    teardown(&fx);
}

int main(void)
{
    snprintf(root, sizeof(root), "/tmp/test_ckpt_unit.XXXXXX");
    if (mkdtemp(root) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    test_save();
    test_load("ddp", 1, SD_DTYPE_FP32);
    test_load("mics:2", 2, SD_DTYPE_BF16);
    test_load("zero3", 2, SD_DTYPE_FP32);
    test_refusals();
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
    if (system(cmd) != 0)
        fprintf(stderr, "note: could not remove %s\n", root);
    return th_summary("test_ckpt_unit");
}

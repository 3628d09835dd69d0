/* Jobs that outlive their trainers (daemon/persist/resume.c) without a daemon: the module linked
 * alone with the host backend, jobs built by hand in one registry (their w and os arenas) and
 * fakes of the rest (the step's progress, the optimizer's take-over, the loading's end, the job's
 * failure with its text); the integration test test_resume runs the same with real daemons and
 * trainers. Checked:
 *  - a rank that dies between steps pauses the job at once (EPAUSED, told to the other nodes,
 *    naming the rank, the step and resume_timeout_ms); during a step it pauses once the step is
 *    over (the event), its name taken meanwhile (pausing); without a resume timeout, or while
 *    loading, nothing pauses;
 *  - another node's pause: between steps, or of the step not entered here, at once (not told
 *    back); of the step the other node finished, after this node finished it too;
 *  - a uid past paused_bytes_per_uid fails instead of pausing, naming the share;
 *  - the state kept for its deadline: dropped by the sweep after it (not while a recovery reads
 *    it), and by root's drop at once (refused for a job that holds none, and while needed);
 *  - a registration of the paused job's name (attach): another uid (EPERM), another model or
 *    world (EMISMATCH naming them), a checkpoint to load instead (the paused state goes); the
 *    same: it takes the state over: the w and os arenas copied bit for bit (also when the
 *    device answers later, through the loop's poll), the steps and the optimizer taken over,
 *    the old job let go naming the new one, the new one loaded; arenas of other sizes fail it;
 *  - kept after a lost node (keep), within the share; the json shardctl shows. */
#include "check.h"
#include "job_fixture.h"
#include "loading.h"
#include "optimizer.h"
#include "resume.h"
#include "step.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdlib.h>
#include <string.h>

/* ---- what the fakes record, and how they answer */
static struct {
    bool step_running, before_apply, shards_busy, handoff;
    const char *needed;
    int fails, fail_status;
    bool told;
    char fail_msg[800];
    int take_overs, loaded;
} F;

void sd_job_fail_text(struct sd_job *job, int status, const char *text, bool tell_peers)
{
    F.fails++;
    F.fail_status = status;
    F.told = tell_peers;
    snprintf(F.fail_msg, sizeof(F.fail_msg), "%s", text);
    job->state = SD_JOB_FAILED;
}

bool sd_step_running(const struct sd_job *job)
{
    (void)job;
    return F.step_running;
}

bool sd_step_handoff(const struct sd_job *job, uint32_t local)
{
    (void)job;
    (void)local;
    return F.handoff;
}

bool sd_step_before_apply(const struct sd_job *job)
{
    (void)job;
    return F.before_apply;
}

bool sd_job_shards_busy(const struct sd_job *job)
{
    (void)job;
    return F.shards_busy;
}

const char *sd_job_state_needed(const struct sd_job *job)
{
    (void)job;
    return F.needed;
}

static struct sd_hparams hp_old[1] = {{.lr = 0.25f}};

const struct sd_hparams *sd_optim_hparams(const struct sd_job *job)
{
    (void)job;
    return hp_old;
}

void sd_optim_take_over(struct sd_job *job, const struct sd_job *old)
{
    (void)job;
    (void)old;
    F.take_overs++;
}

void sd_loading_loaded(struct sd_job *job)
{
    job->state = SD_JOB_READY;
    F.loaded++;
}

/* ---- the jobs */
struct fixture {
    struct sd_registry reg;
    struct sd_config cfg;
    struct th_job old, new; /* a job and the one that resumes it */
};

static const uint64_t sizes[2] = {3000, 5000};

/* a job of plan on 1 x 2, ready, in fx's registry, with its arenas (values: seed) */
static void make_job(struct fixture *fx, struct th_job *tj, const char *plan, uint32_t seed,
                     uint64_t timeout_ms, uint64_t id)
{
    th_job_build(tj, plan, 1, 2, 0, sizes, 2, SD_DTYPE_FP32);
    th_job_state_arenas(tj);
    struct sd_job *job = &tj->job;
    job->reg = &fx->reg;
    job->id = id;
    job->uid = 5;
    job->steps = 7;
    job->digest = sd_model_digest(&job->model);
    job->mem.bytes_total = 1000;
    for (uint32_t r = 0; r < job->k; r++)
        for (int st = 0; st < SD_STATE_COUNT; st++) {
            struct sd_mem *a = sd_job_arena(job, r, st);
            for (size_t i = 0; a->ptr != NULL && i < a->bytes; i++)
                ((uint8_t *)a->ptr)[i] = (uint8_t)(seed + r * 31 + i * 7);
        }
    sd_resume_create(job, timeout_ms);
    job->next = fx->reg.jobs;
    fx->reg.jobs = job;
    fx->reg.n_jobs++;
}

static void setup(struct fixture *fx, uint64_t timeout_ms)
{
    memset(fx, 0, sizeof(*fx));
    memset(&F, 0, sizeof(F));
    th_fake_reset();
    fx->cfg.resume_timeout_ms = 30000;
    fx->reg.cfg = &fx->cfg;
    fx->reg.dev = &sd_gpu_host_ops;
    fx->reg.budget = 1 << 20;
    make_job(fx, &fx->old, "zero3", 1, timeout_ms, 1);
}

static void teardown(struct fixture *fx)
{
    for (struct sd_job *j = fx->reg.jobs; j; j = j->next) {
        sd_resume_unlink(j);
        sd_resume_destroy(j);
        th_job_free(j == &fx->old.job ? &fx->old : &fx->new);
    }
}

static struct sd_session dead = {.rank = 1, .pid = 4242};

static void test_pause(void)
{
    struct fixture fx;
    setup(&fx, 0);
    struct sd_job *job = &fx.old.job;
    job->state = SD_JOB_READY;
    TH_CHECK(!sd_resume_rank_died(job, &dead, "was killed") && F.fails == 0,
             "no resume timeout: a dead rank does not pause the job");
    teardown(&fx);

    setup(&fx, 2000);
    job = &fx.old.job;
    job->state = SD_JOB_LOADING;
    TH_CHECK(!sd_resume_rank_died(job, &dead, "was killed"), "loading: nothing to keep");
    job->state = SD_JOB_READY;
    TH_CHECK(sd_resume_rank_died(job, &dead, "was killed") && F.fails == 1 &&
                 F.fail_status == SD_EPAUSED && F.told &&
                 strstr(F.fail_msg, "rank 1 (pid 4242) was killed") != NULL &&
                 strstr(F.fail_msg, "paused after step 7") != NULL &&
                 strstr(F.fail_msg, "within 2000 ms") != NULL,
             "between steps: paused at once, told to the others, naming rank and step (%s)",
             F.fail_msg);
    TH_CHECK(sd_resume_paused(job) && sd_resume_holds_state(job) &&
                 sd_resume_find(&fx.reg, job->name) == job,
             "its state waits to be taken over under its name");
    teardown(&fx);

    /* during a step: after it */
    setup(&fx, 2000);
    job = &fx.old.job;
    job->state = SD_JOB_READY;
    F.step_running = true;
    TH_CHECK(sd_resume_rank_died(job, &dead, "hung up") && F.fails == 0 && sd_resume_pausing(job) &&
                 !sd_resume_paused(job),
             "during a step: pausing, not paused yet");
    struct sd_job_ev ev = {.kind = SD_JOB_EV_PUSHED};
    TH_CHECK(!sd_resume_module.event(job, &ev) && F.fails == 0, "another event: nothing");
    ev.kind = SD_JOB_EV_STEP_OVER;
    job->steps = 8;
    TH_CHECK(sd_resume_module.event(job, &ev) && F.fails == 1 && F.fail_status == SD_EPAUSED &&
                 F.told && strstr(F.fail_msg, "paused after step 8") != NULL &&
                 sd_resume_paused(job),
             "the step over: paused after it (%s)", F.fail_msg);
    teardown(&fx);

    /* at a trainer optimizer's hand-off, the rank owing its update: no pause to wait for (the
     * caller fails the job at once) */
    setup(&fx, 2000);
    job = &fx.old.job;
    job->state = SD_JOB_READY;
    F.step_running = F.handoff = true;
    TH_CHECK(!sd_resume_rank_died(job, &dead, "was killed") && F.fails == 0 &&
                 !sd_resume_pausing(job),
             "a rank that dies owing its trainer update: not kept, the job fails");
    F.handoff = false; /* one that gave its update back: the step completes, then the pause */
    TH_CHECK(sd_resume_rank_died(job, &dead, "was killed") && sd_resume_pausing(job),
             "a rank that dies after giving its update back: paused after the step");
    teardown(&fx);
}

static void test_peer_paused(void)
{
    struct fixture fx;
    for (int c = 0; c < 4; c++) {
        setup(&fx, 2000);
        struct sd_job *job = &fx.old.job;
        job->state = SD_JOB_READY;
        F.step_running = c > 0;
        F.before_apply = c == 1;
        uint64_t step = c == 2 ? 8 : 7; /* (this node has taken 7) */
        if (c == 3)
            step = 12; /* a node far ahead: a warning, and it pauses */
        bool r = sd_resume_peer_paused(job, step, "node 1 paused");
        if (c == 2) {
            TH_CHECK(r && F.fails == 0 && sd_resume_pausing(job),
                     "the step the other node finished: finished here first");
            struct sd_job_ev ev = {.kind = SD_JOB_EV_STEP_OVER};
            sd_resume_module.event(job, &ev);
        }
        TH_CHECK(r && F.fails == 1 && F.fail_status == SD_EPAUSED && !F.told &&
                     strcmp(F.fail_msg, "node 1 paused") == 0 && sd_resume_paused(job),
                 "case %d: paused with the other node's text, not told back (%s)", c, F.fail_msg);
        teardown(&fx);
    }
    setup(&fx, 0);
    fx.old.job.state = SD_JOB_READY;
    TH_CHECK(!sd_resume_peer_paused(&fx.old.job, 7, "x"), "no resume timeout here: it must fail");
    teardown(&fx);
}

static void test_share_and_drop(void)
{
    struct fixture fx;
    setup(&fx, 2000);
    fx.cfg.paused_bytes_per_uid = 1500;
    make_job(&fx, &fx.new, "zero3", 2, 2000, 2);
    fx.new.job.state = SD_JOB_READY;
    fx.old.job.state = SD_JOB_READY;
    sd_resume_rank_died(&fx.old.job, &dead, "was killed");
    TH_CHECK(F.fail_status == SD_EPAUSED && sd_resume_kept_bytes(&fx.reg, 5) == 1000,
             "the first paused job within the share");
    sd_resume_rank_died(&fx.new.job, &dead, "was killed");
    TH_CHECK(F.fails == 2 && F.fail_status == SD_EJOBFAILED && !sd_resume_paused(&fx.new.job) &&
                 strstr(F.fail_msg, "paused_bytes_per_uid") != NULL,
             "a second one past the uid's share fails instead, naming it (%s)", F.fail_msg);
    TH_CHECK(!sd_resume_keep(&fx.new.job), "past the share, a failed job is not kept either");

    /* the sweep: not before the deadline, not while needed */
    struct sd_job *job = &fx.old.job;
    uint64_t now = sd_now_ns();
    int let_go = th_fake.events[SD_JOB_EV_LET_GO];
    sd_resume_sweep(job, now);
    TH_CHECK(sd_resume_paused(job), "before its deadline it stays");
    F.needed = "a recovery reads it";
    sd_resume_sweep(job, now + 3000000000ull);
    TH_CHECK(sd_resume_paused(job), "past it, while a recovery reads it, it stays");
    char err[256];
    TH_CHECK(sd_resume_drop(job, err, sizeof(err)) == SD_EBUSY &&
                 strstr(err, "a recovery reads it") != NULL,
             "root's drop waits for the recovery (%s)", err);
    F.needed = NULL;
    sd_resume_sweep(job, now + 3000000000ull);
    TH_CHECK(!sd_resume_paused(job) && job->fail_status == SD_EJOBFAILED &&
                 strstr(job->fail_msg, "not registered again within 2000 ms") != NULL &&
                 th_fake.events[SD_JOB_EV_LET_GO] == let_go + 1,
             "past its deadline the state is dropped and the job let go (%s)", job->fail_msg);
    TH_CHECK(sd_resume_drop(job, err, sizeof(err)) == SD_ESTATE &&
                 strstr(err, "not paused or kept") != NULL,
             "a drop of a job holding no state refused (%s)", err);
    teardown(&fx);

    /* kept after a lost node, dropped by root */
    setup(&fx, 2000);
    job = &fx.old.job;
    job->state = SD_JOB_FAILED;
    sd_resume_module.failing(job, SD_JOB_READY);
    TH_CHECK(sd_resume_failed_ready(job) && sd_resume_keep(job) && sd_resume_kept(job) &&
                 sd_resume_holds_state(job) && !sd_resume_keep(job),
             "a job failed while ready is kept (once)");
    json_t *js = sd_resume_json(job);
    TH_CHECK(json_is_true(json_object_get(js, "kept")) &&
                 json_integer_value(json_object_get(js, "timeout_ms")) == 2000 &&
                 json_integer_value(json_object_get(js, "dropped_in_ms")) > 1000,
             "shardctl's json: kept, its timeout, its time left");
    json_decref(js);
    TH_CHECK(sd_resume_drop(job, err, sizeof(err)) == SD_OK && !sd_resume_kept(job),
             "root drops a kept state");
    teardown(&fx);
}

/* the new job registers under the paused one's name */
static void test_take_over(bool deferred)
{
    const char *how = deferred ? "a device behind" : "at once";
    struct fixture fx;
    setup(&fx, 2000);
    struct sd_job *old = &fx.old.job;
    old->state = SD_JOB_READY;
    sd_resume_rank_died(old, &dead, "was killed");
    make_job(&fx, &fx.new, "zero3", 9, 2000, 2);
    struct sd_job *job = &fx.new.job;
    job->state = SD_JOB_LOADING;
    char err[512];
    job->uid = 6;
    TH_CHECK(sd_resume_attach(job, old, "", err, sizeof(err)) == SD_EPERM &&
                 strstr(err, "uid 5, not uid 6") != NULL,
             "%s: another uid refused (%s)", how, err);
    job->uid = 5;
    job->world = 4;
    TH_CHECK(sd_resume_attach(job, old, "", err, sizeof(err)) == SD_EMISMATCH &&
                 strstr(err, "world 2, this registration 4") != NULL,
             "%s: another world refused naming both (%s)", how, err);
    job->world = 2;
    TH_CHECK(sd_resume_attach(job, old, NULL, err, sizeof(err)) == SD_OK &&
                 sd_resume_resuming(job) && sd_resume_start_step(job) == 7 &&
                 !sd_resume_holds_state(old) && sd_resume_find(&fx.reg, old->name) == NULL,
             "%s: the same model: it resumes from step 7, the paused job taken", how);
    struct sd_hparams h;
    TH_CHECK(sd_resume_hparams(job, 0, &h) && h.lr == 0.25f && sd_resume_reclaim(job) == 1000,
             "%s: the paused job's hyperparameters and memory come with it", how);
    TH_CHECK(sd_resume_module.gives_values(job) != NULL, "%s: its values come from there", how);
    th_fake.queue_eagain = deferred ? 1 : 0;
    sd_resume_load(job);
    if (deferred) {
        TH_CHECK(F.loaded == 0 && sd_resume_queue_waiting(job), "%s: the copy waits", how);
        TH_CHECK(sd_resume_queue_poll(job), "%s: the loop's poll sees it done", how);
    }
    int bad = 0;
    for (uint32_t r = 0; r < 2; r++)
        for (int st = 0; st < SD_STATE_COUNT; st++) {
            if (st == SD_STATE_G)
                continue;
            struct sd_mem *a = sd_job_arena(old, r, st), *b = sd_job_arena(job, r, st);
            bad += a->bytes != b->bytes || memcmp(a->ptr, b->ptr, a->bytes) != 0;
        }
    TH_CHECK(bad == 0, "%s: the w and os arenas copied bit for bit", how);
    TH_CHECK(F.take_overs == 1 && F.loaded == 1 && job->steps == 7 && job->state == SD_JOB_READY &&
                 sd_resume_resumed(old) && !sd_resume_paused(old) &&
                 strstr(old->fail_msg, "resumed by job id 2") != NULL &&
                 th_fake.events[SD_JOB_EV_LET_GO] == 1,
             "%s: the optimizer and steps taken over, the old job let go naming the new (%s)", how,
             old->fail_msg);
    json_t *js = sd_resume_json(job);
    TH_CHECK(json_integer_value(json_object_get(js, "resumed_from_step")) == 7,
             "%s: the json says where it resumed from", how);
    json_decref(js);
    teardown(&fx);
}

static void test_attach_other(void)
{
    struct fixture fx;
    setup(&fx, 2000);
    struct sd_job *old = &fx.old.job;
    old->state = SD_JOB_READY;
    sd_resume_rank_died(old, &dead, "was killed");
    make_job(&fx, &fx.new, "zero3", 9, 2000, 2);
    struct sd_job *job = &fx.new.job;
    char err[512];
    TH_CHECK(sd_resume_attach(job, old, "/ckpt/run", err, sizeof(err)) == SD_OK &&
                 !sd_resume_resuming(job),
             "a checkpoint to load instead: the paused job is not taken");
    sd_resume_sweep(old, sd_now_ns());
    TH_CHECK(!sd_resume_paused(old), "and its state goes at the next sweep");
    teardown(&fx);

    /* arenas of another size (another plan's) */
    setup(&fx, 2000);
    old = &fx.old.job;
    old->state = SD_JOB_READY;
    sd_resume_rank_died(old, &dead, "was killed");
    make_job(&fx, &fx.new, "ddp", 9, 2000, 2);
    job = &fx.new.job;
    job->digest = old->digest;
    TH_CHECK(sd_resume_attach(job, old, "", err, sizeof(err)) == SD_OK, "attached");
    F.shards_busy = true;
    sd_resume_load(job);
    TH_CHECK(F.loaded == 0 && th_fake.job_fails == 0, "a save of the paused job runs: it waits");
    F.shards_busy = false;
    job->state = SD_JOB_LOADING;
    sd_resume_sweep(job, sd_now_ns());
    TH_CHECK(th_fake.job_fails == 1 && th_fake.job_status == SD_EMISMATCH &&
                 strstr(th_fake.job_msg, "arena of rank 0") != NULL && F.loaded == 0,
             "the sweep retries; arenas of other sizes fail the job naming them (%s)",
             th_fake.job_msg);
    teardown(&fx);
}

int main(void)
{
    test_pause();
    test_peer_paused();
    test_share_and_drop();
    test_take_over(false);
    test_take_over(true);
    test_attach_other();
    return th_summary("test_resume_unit");
}

/* A rank's registration (daemon/jobs/register.c) without a daemon: the module linked alone with the
 * model's parsing (proto, common), a registry built by hand and fakes of the job's life (create,
 * destroy, refuse everywhere, the complete registration), of resume (paused and pausing jobs) and
 * of checkpoints (the directory a job loads); the answers a session gets are recorded. Checked:
 *  - what a message alone can be refused for (EINVAL): a bad job name, a job token of another
 *    length, a model without tensors; nothing created;
 *  - the first rank creates the job (its checkpoint's manifest read), the others join it; the job
 *    is told each registration (sd_job_registered) and is complete with k ranks;
 *  - a rank that registers differently (model, checkpoint, world, job secret, ranks per node,
 *    max_live_bytes, resume_timeout_ms) is refused EMISMATCH naming the difference, and the ranks
 *    already there hear it (refuse everywhere); once every rank is there, a stray is refused
 *    alone; a rank registered twice EEXIST naming the holder's pid;
 *  - ownership: another uid EPERM naming both, also for a paused job of that name; the owner
 *    resumes a paused job (attach), and an attach that fails destroys the new job;
 *  - a rank not on this node EINVAL naming the ranks it serves; a running job's name EEXIST;
 *  - registrations that wait for a job of their name on its way out (failed with ranks still
 *    attached, pausing, or a rank's holder that hung up): not answered while it goes, registered
 *    once it went (the sweep's retry), ETIMEDOUT past register_timeout_ms, forgotten when their
 *    session ends;
 *  - the caps: max_jobs (EBUSY), max_jobs_per_uid (the uid's oldest incomplete registration
 *    refused for the new one; none: the new one refused). */
#include "check.h"
#include "checkpoint.h"
#include "job.h"
#include "job_life.h"
#include "register.h"
#include "registry.h"
#include "resume.h"
#include "session.h"
#include "sd/model.h"
#include "sd/model_msg.h"
#include "sd/status.h"
#include "sd/util.h"
#include "shard.pb-c.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- what the fakes record, and how they answer */
static struct {
    int errors, status; /* sd_session_send_error: how many, the last one's status and text */
    char msg[1024];
    int creates, destroys, registered, opens, refusals, refuse_status, attaches;
    char refuse_msg[640];
    int attach_status;
    struct sd_job *paused, *pausing;
    const struct sd_session *hung_up;
    uint64_t resume_ms; /* the job's resume_timeout_ms (the one job of a case) */
    char load[256];     /* the directory the job loads */
} F;

static void reset(void)
{
    memset(&F, 0, sizeof(F));
}

int sd_session_send_error(struct sd_session *s, int status, const char *fmt, ...)
{
    (void)s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(F.msg, sizeof(F.msg), fmt, ap);
    va_end(ap);
    F.errors++;
    F.status = status;
    return SD_OK;
}

bool sd_session_hung_up(const struct sd_session *s)
{
    return s == F.hung_up;
}

/* job.c's, as it reads them */
bool sd_job_name_valid(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > 63 || name[0] == '.' || name[0] == '-')
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
              (name[i] >= '0' && name[i] <= '9') || strchr("._-:,+=@", name[i]) != NULL))
            return false;
    return true;
}

bool sd_job_token_is(const struct sd_job *job, const void *token, size_t len)
{
    return len == job->xfer.token_len && memcmp(token, job->xfer.token, len) == 0;
}

uint32_t sd_job_ranks_per_node(const struct sd_config *cfg, const Shard__Register *msg)
{
    return msg->ranks_per_node ? msg->ranks_per_node : (uint32_t)cfg->ranks_per_node;
}

const char *sd_job_state_name(enum sd_job_state s)
{
    static const char *names[] = {"registering", "loading", "ready",
                                  "failed",      "closing", "finished"};
    return (unsigned)s < sizeof(names) / sizeof(names[0]) ? names[s] : "?";
}

/* job_life.c's: a job of the registration's shape, linked first in the registry */
struct sd_job *sd_job_create(struct sd_registry *reg, const Shard__Register *msg,
                             struct sd_model *model, const struct sd_fsid *owner, int *status_p,
                             char *err, size_t errlen)
{
    uint32_t k = sd_job_ranks_per_node(reg->cfg, msg);
    if (msg->world == 0 || k == 0 || msg->world % k != 0) {
        *status_p = SD_EINVAL;
        snprintf(err, errlen, "world size %u with %u ranks a node", msg->world, k);
        return NULL;
    }
    struct sd_job *job = calloc(1, sizeof(*job));
    job->reg = reg;
    snprintf(job->name, sizeof(job->name), "%s", msg->job);
    job->id = ++reg->next_job_id;
    job->uid = owner->uid;
    job->world = msg->world;
    job->k = k;
    job->node = msg->rank / k;
    job->first_rank = job->node * k;
    job->ranks = calloc(k, sizeof(*job->ranks));
    job->mem.max_live_bytes = msg->max_live_bytes;
    job->model = *model;
    memset(model, 0, sizeof(*model));
    job->digest = sd_model_digest(&job->model);
    job->created_ns = sd_now_ns();
    if (msg->job_token.len == SD_JOB_TOKEN_BYTES) {
        memcpy(job->xfer.token, msg->job_token.data, SD_JOB_TOKEN_BYTES);
        job->xfer.token_len = SD_JOB_TOKEN_BYTES;
    }
    job->state = SD_JOB_REGISTERING;
    F.resume_ms = msg->resume_timeout_ms;
    snprintf(F.load, sizeof(F.load), "%s", msg->load ? msg->load : "");
    job->next = reg->jobs;
    reg->jobs = job;
    reg->n_jobs++;
    F.creates++;
    return job;
}

void sd_job_destroy(struct sd_job *job)
{
    struct sd_registry *reg = job->reg;
    for (struct sd_job **pp = &reg->jobs; *pp; pp = &(*pp)->next)
        if (*pp == job) {
            *pp = job->next;
            reg->n_jobs--;
            break;
        }
    sd_model_free(&job->model);
    free(job->ranks);
    free(job);
    F.destroys++;
}

void sd_job_registered(struct sd_job *job)
{
    (void)job;
    F.registered++;
}

void sd_job_refuse_everywhere(struct sd_job *job, int status, const char *msg)
{
    (void)job;
    F.refusals++;
    F.refuse_status = status;
    snprintf(F.refuse_msg, sizeof(F.refuse_msg), "%s", msg);
}

/* resume.c's */
struct sd_job *sd_resume_find(struct sd_registry *reg, const char *name)
{
    (void)reg;
    return F.paused != NULL && strcmp(F.paused->name, name) == 0 ? F.paused : NULL;
}

bool sd_resume_paused(const struct sd_job *job)
{
    return job == F.paused;
}

bool sd_resume_kept(const struct sd_job *job)
{
    (void)job;
    return false;
}

bool sd_resume_pausing(const struct sd_job *job)
{
    return job == F.pausing;
}

int sd_resume_attach(struct sd_job *job, struct sd_job *old, const char *load, char *err,
                     size_t errlen)
{
    (void)job;
    (void)old;
    (void)load;
    F.attaches++;
    if (F.attach_status != SD_OK)
        snprintf(err, errlen, "the paused job's model differs");
    return F.attach_status;
}

uint64_t sd_resume_timeout(const struct sd_registry *reg, uint64_t asked)
{
    (void)reg;
    return asked;
}

uint64_t sd_resume_timeout_ms(const struct sd_job *job)
{
    (void)job;
    return F.resume_ms;
}

/* checkpoint.c's */
const char *sd_ckpt_load_dir(const struct sd_job *job)
{
    (void)job;
    return F.load;
}

void sd_ckpt_open_start(struct sd_job *job)
{
    (void)job;
    F.opens++;
}

/* ---- registrations */
struct reg_msg {
    Shard__Register m;
    Shard__TensorDesc t[2], *tp[2];
    uint64_t dims[2][2];
    Shard__Optimizer opt;
    uint8_t token[SD_JOB_TOKEN_BYTES];
};

/* rank of world (2 ranks a node) of job name: two tensors, SGD, zero3 */
static void reg_init(struct reg_msg *r, const char *name, uint32_t rank, uint32_t world)
{
    memset(r, 0, sizeof(*r));
    r->m = (Shard__Register)SHARD__REGISTER__INIT;
    r->opt = (Shard__Optimizer)SHARD__OPTIMIZER__INIT;
    r->opt.kind = 1;
    r->opt.lr = 0.1f;
    for (int i = 0; i < 2; i++) {
        r->t[i] = (Shard__TensorDesc)SHARD__TENSOR_DESC__INIT;
        r->t[i].name = i ? "b" : "a";
        r->dims[i][0] = 64 * (i + 1);
        r->dims[i][1] = 8;
        r->t[i].dims = r->dims[i];
        r->t[i].n_dims = 2;
        r->t[i].unit = (uint32_t)i;
        r->tp[i] = &r->t[i];
    }
    r->m.job = (char *)name;
    r->m.rank = rank;
    r->m.world = world;
    r->m.plan = "zero3";
    r->m.tensors = r->tp;
    r->m.n_tensors = 2;
    r->m.optimizer = &r->opt;
    r->m.ranks_per_node = 2;
    r->m.load = "";
    r->m.leader = "";
    memset(r->token, 7, sizeof(r->token));
    r->m.job_token.data = r->token;
    r->m.job_token.len = sizeof(r->token);
}

struct fixture {
    struct sd_registry reg;
    struct sd_config cfg;
    struct sd_session s[6];
};

static void setup(struct fixture *fx)
{
    memset(fx, 0, sizeof(*fx));
    reset();
    fx->cfg.max_tensors = 1000;
    fx->cfg.max_units = 1000;
    fx->cfg.max_jobs = 16;
    fx->cfg.max_jobs_per_uid = 8;
    fx->cfg.register_timeout_ms = 60000;
    fx->cfg.ranks_per_node = 2;
    fx->reg.cfg = &fx->cfg;
    for (int i = 0; i < 6; i++)
        fx->s[i] = (struct sd_session){.pid = 1000 + i, .cred = {.uid = 5}};
}

static void teardown(struct fixture *fx)
{
    sd_job_register_free(&fx->reg);
    while (fx->reg.jobs != NULL)
        sd_job_destroy(fx->reg.jobs);
    if (F.paused != NULL) {
        sd_model_free(&F.paused->model);
        free(F.paused->ranks);
        free(F.paused);
        F.paused = NULL;
    }
}

static void do_register(struct fixture *fx, int si, struct reg_msg *r)
{
    sd_job_register(&fx->reg, &fx->s[si], &r->m);
}

/* an error since `before` errors, with status and text in it */
static bool refused(int before, int status, const char *text)
{
    return F.errors == before + 1 && F.status == status && strstr(F.msg, text) != NULL;
}

static void test_message(void)
{
    struct fixture fx;
    setup(&fx);
    struct reg_msg r;
    const char *names[] = {
        "",    ".hidden", "-x",
        "a b", "x/y",     "0123456789012345678901234567890123456789012345678901234567890123"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        reg_init(&r, names[i], 0, 2);
        int e = F.errors;
        do_register(&fx, 0, &r);
        TH_CHECK(refused(e, SD_EINVAL, "a job name is 1..63"), "name '%s' refused (%d: %s)",
                 names[i], F.status, F.msg);
    }
    reg_init(&r, "j", 0, 2);
    r.m.job_token.len = 5;
    int e = F.errors;
    do_register(&fx, 0, &r);
    TH_CHECK(refused(e, SD_EINVAL, "a job token of 5 bytes"), "a 5-byte token refused (%s)", F.msg);
    reg_init(&r, "j", 0, 2);
    r.m.n_tensors = 0;
    do_register(&fx, 0, &r);
    TH_CHECK(refused(e + 1, SD_EINVAL, "model has 0 tensors"), "a model without tensors (%s)",
             F.msg);
    reg_init(&r, "j", 0, 2);
    r.m.optimizer = NULL;
    do_register(&fx, 0, &r);
    TH_CHECK(refused(e + 2, SD_EINVAL, "no optimizer"), "a model without optimizer (%s)", F.msg);
    TH_CHECK(F.creates == 0 && fx.reg.n_jobs == 0 && fx.s[0].job == NULL,
             "no job created by a refused message");
    teardown(&fx);
}

static void test_create_join(void)
{
    struct fixture fx;
    setup(&fx);
    struct reg_msg r0, r1;
    reg_init(&r0, "j", 0, 2);
    reg_init(&r1, "j", 1, 2);
    do_register(&fx, 0, &r0);
    struct sd_job *job = fx.reg.jobs;
    TH_CHECK(F.errors == 0 && F.creates == 1 && F.opens == 1 && job != NULL && fx.s[0].job == job &&
                 job->ranks[0] == &fx.s[0] && job->n_registered == 1 && F.registered == 1,
             "rank 0 creates the job, its checkpoint opened, and is its first rank (%s)", F.msg);
    do_register(&fx, 1, &r1);
    TH_CHECK(F.errors == 0 && F.creates == 1 && fx.s[1].job == job && fx.s[1].rank == 1 &&
                 fx.s[1].local == 1 && job->n_registered == 2 && F.registered == 2,
             "rank 1 joins it (%s)", F.msg);
    /* a stray once every rank is there */
    struct reg_msg rs;
    reg_init(&rs, "j", 1, 2);
    rs.m.world = 4;
    do_register(&fx, 2, &rs);
    TH_CHECK(refused(0, SD_EMISMATCH, "world 4 differs from world 2") && F.refusals == 0,
             "a stray registering differently once all are there: refused alone (%s)", F.msg);
    do_register(&fx, 2, &r1);
    TH_CHECK(refused(1, SD_EEXIST, "rank 1 is already registered by pid 1001"),
             "rank 1 registered twice (%s)", F.msg);
    /* another uid */
    fx.s[3].cred.uid = 6;
    do_register(&fx, 3, &r1);
    TH_CHECK(refused(2, SD_EPERM, "belongs to uid 5, you are uid 6"), "another uid (%s)", F.msg);
    /* a running job's name */
    job->state = SD_JOB_READY;
    do_register(&fx, 4, &r1);
    TH_CHECK(refused(3, SD_EEXIST, "already ready"), "a running job's name (%s)", F.msg);
    teardown(&fx);
}

/* rank 1 registers with one difference: refused naming it, rank 0 hears it */
static void test_mismatch(void)
{
    static const char *what[] = {"model digest",
                                 "loads checkpoint",
                                 "world 4 differs",
                                 "another job secret",
                                 "no job secret",
                                 "ranks per node",
                                 "max_live_bytes 1024 differs",
                                 "resume_timeout_ms 5000 differs"};
    uint8_t other[SD_JOB_TOKEN_BYTES];
    memset(other, 9, sizeof(other));
    for (int c = 0; c < (int)(sizeof(what) / sizeof(what[0])); c++) {
        struct fixture fx;
        setup(&fx);
        struct reg_msg r0, r1;
        reg_init(&r0, "j", 0, 2);
        reg_init(&r1, "j", 1, 2);
        switch (c) {
        case 0:
            r1.dims[1][1] = 9;
            break;
        case 1:
            r1.m.load = "/ckpt/x";
            break;
        case 2:
            r1.m.world = 4;
            break;
        case 3:
            r1.m.job_token.data = other;
            break;
        case 4:
            r1.m.job_token.len = 0;
            break;
        case 5:
            r1.m.ranks_per_node = 1;
            r1.m.rank = 0; /* (rank 1 of 1 a node would be on node 1) */
            break;
        case 6:
            r1.m.max_live_bytes = 1024;
            break;
        case 7:
            r1.m.resume_timeout_ms = 5000;
            break;
        }
        do_register(&fx, 0, &r0);
        do_register(&fx, 1, &r1);
        TH_CHECK(refused(0, SD_EMISMATCH, what[c]) && F.refusals == 1 &&
                     F.refuse_status == SD_EMISMATCH && strstr(F.refuse_msg, what[c]) != NULL &&
                     strstr(F.refuse_msg, "pid 1001") != NULL,
                 "a rank whose %s: refused, and the job's ranks told (%s / %s)", what[c], F.msg,
                 F.refuse_msg);
        TH_CHECK(fx.reg.jobs->n_registered == 1, "%s: the refused rank did not join", what[c]);
        teardown(&fx);
    }
}

static void test_node_and_owner(void)
{
    struct fixture fx;
    setup(&fx);
    struct reg_msg r0, r2;
    reg_init(&r0, "j", 0, 4);
    reg_init(&r2, "j", 2, 4);
    do_register(&fx, 0, &r0);
    do_register(&fx, 1, &r2);
    TH_CHECK(refused(0, SD_EINVAL, "node 0 serves ranks 0..1 of world 4") && F.refusals == 0 &&
                 fx.reg.n_jobs == 1,
             "rank 2 is not on this node (%s)", F.msg);
    teardown(&fx);

    /* a paused job of that name: its owner resumes it, another uid is refused */
    setup(&fx);
    F.paused = calloc(1, sizeof(*F.paused));
    snprintf(F.paused->name, sizeof(F.paused->name), "p");
    F.paused->uid = 7;
    reg_init(&r0, "p", 0, 2);
    do_register(&fx, 0, &r0);
    TH_CHECK(refused(0, SD_EPERM, "a paused job of that name belongs to uid 7") && F.creates == 0 &&
                 F.attaches == 0,
             "another uid's paused job refused before anything of it is touched (%s)", F.msg);
    fx.s[1].cred.uid = 7;
    F.attach_status = SD_EMISMATCH;
    do_register(&fx, 1, &r0);
    TH_CHECK(refused(1, SD_EMISMATCH, "the paused job's model differs") && F.attaches == 1 &&
                 F.destroys == 1 && fx.reg.n_jobs == 0,
             "an attach that fails: refused, the new job destroyed (%s)", F.msg);
    F.attach_status = SD_OK;
    do_register(&fx, 1, &r0);
    TH_CHECK(F.errors == 2 && F.attaches == 2 && fx.reg.n_jobs == 1 && fx.s[1].job != NULL,
             "the owner resumes its paused job (%s)", F.msg);
    teardown(&fx);
}

static void test_waits(void)
{
    struct fixture fx;
    setup(&fx);
    struct reg_msg r0, r1;
    reg_init(&r0, "j", 0, 2);
    reg_init(&r1, "j", 1, 2);
    do_register(&fx, 0, &r0);
    do_register(&fx, 1, &r1);
    struct sd_job *job = fx.reg.jobs;
    job->state = SD_JOB_FAILED;
    job->n_left = 1;
    do_register(&fx, 2, &r0);
    TH_CHECK(F.errors == 0 && sd_job_register_waits(&fx.reg, &fx.s[2]),
             "a job failed with a rank still attached: the registration waits (%s)", F.msg);
    sd_job_register_retry(&fx.reg);
    TH_CHECK(F.errors == 0 && sd_job_register_waits(&fx.reg, &fx.s[2]) && F.creates == 1,
             "while it goes, the retry leaves it waiting");
    sd_job_destroy(job);
    sd_job_register_retry(&fx.reg);
    TH_CHECK(F.errors == 0 && !sd_job_register_waits(&fx.reg, &fx.s[2]) && F.creates == 2 &&
                 fx.s[2].job == fx.reg.jobs,
             "once it went, the retry registers it in a new job (%s)", F.msg);

    /* a pausing job: its deadline passes */
    F.pausing = fx.reg.jobs;
    fx.reg.jobs->state = SD_JOB_READY;
    fx.cfg.register_timeout_ms = 0;
    do_register(&fx, 3, &r1);
    TH_CHECK(F.errors == 0 && sd_job_register_waits(&fx.reg, &fx.s[3]),
             "a pausing job: the registration waits");
    sd_job_register_retry(&fx.reg);
    TH_CHECK(refused(0, SD_ETIMEDOUT, "register_timeout_ms") &&
                 strstr(F.msg, "pauses once the step is over") != NULL &&
                 !sd_job_register_waits(&fx.reg, &fx.s[3]),
             "past register_timeout_ms it is refused naming why it waited (%s)", F.msg);

    /* forgotten with its session */
    fx.cfg.register_timeout_ms = 60000;
    do_register(&fx, 4, &r1);
    TH_CHECK(sd_job_register_waits(&fx.reg, &fx.s[4]), "waits again");
    sd_job_register_forget(&fx.reg, &fx.s[4]);
    TH_CHECK(!sd_job_register_waits(&fx.reg, &fx.s[4]), "forgotten when its session ends");
    F.pausing = NULL;
    teardown(&fx);

    /* a rank whose holder hung up: the new one waits for it to be reaped */
    setup(&fx);
    do_register(&fx, 0, &r0);
    job = fx.reg.jobs;
    F.hung_up = &fx.s[0];
    do_register(&fx, 1, &r0);
    TH_CHECK(F.errors == 0 && sd_job_register_waits(&fx.reg, &fx.s[1]),
             "rank 0's holder hung up: its restart waits");
    job->ranks[0] = NULL; /* reaped */
    job->n_registered = 0;
    F.hung_up = NULL;
    sd_job_register_retry(&fx.reg);
    TH_CHECK(F.errors == 0 && job->ranks[0] == &fx.s[1] &&
                 !sd_job_register_waits(&fx.reg, &fx.s[1]),
             "once reaped, the restart holds rank 0 (%s)", F.msg);
    teardown(&fx);
}

static void test_caps(void)
{
    struct fixture fx;
    setup(&fx);
    fx.cfg.max_jobs_per_uid = 1;
    struct reg_msg a, b, c;
    reg_init(&a, "a", 0, 2);
    reg_init(&b, "b", 0, 2);
    reg_init(&c, "c", 0, 2);
    do_register(&fx, 0, &a);
    do_register(&fx, 1, &b);
    TH_CHECK(F.errors == 0 && F.refusals == 1 && F.refuse_status == SD_EBUSY &&
                 strstr(F.refuse_msg, "job 'a' of uid 5") != NULL &&
                 strstr(F.refuse_msg, "max_jobs_per_uid is 1") != NULL && F.creates == 2,
             "past max_jobs_per_uid the uid's oldest incomplete registration is refused for the "
             "new one (%s)",
             F.refuse_msg);
    for (struct sd_job *j = fx.reg.jobs; j; j = j->next)
        j->state = SD_JOB_READY;
    do_register(&fx, 2, &c);
    TH_CHECK(refused(0, SD_EBUSY, "max_jobs_per_uid is 1") && F.creates == 2,
             "with none incomplete, the new one is refused (%s)", F.msg);
    teardown(&fx);

    setup(&fx);
    fx.cfg.max_jobs = 1;
    do_register(&fx, 0, &a);
    fx.s[1].cred.uid = 9;
    do_register(&fx, 1, &b);
    TH_CHECK(refused(0, SD_EBUSY, "max_jobs is 1") && F.creates == 1, "max_jobs (%s)", F.msg);
    teardown(&fx);
}

int main(void)
{
    test_message();
    test_create_join();
    test_mismatch();
    test_node_and_owner();
    test_waits();
    test_caps();
    return th_summary("test_register");
}

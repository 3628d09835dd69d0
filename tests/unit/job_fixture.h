/* What the unit tests of one module of the daemon share (test_push_round, test_push,
 * test_step): a job built by hand (model, plan, layout, the shape fields job.c sets, the host
 * backend and its queue, the ranks' g arenas) and fakes of the rest of the daemon that record
 * what the module did: the answers to the ranks' calls, refusals, the job's failure, the events it
 * raised, the device queue's marks (th_fake). */
#ifndef TH_JOB_FIXTURE_H
#define TH_JOB_FIXTURE_H

#include "job.h"
#include "job_module.h"
#include "net.h"
#include "session.h"

#include <stdbool.h>
#include <stdint.h>

#define TH_JOB_MAX_TENSORS 4
#define TH_JOB_MAX_K       8
#define TH_MAX_ANSWERS     64
#define TH_MAX_POSTS       32

struct th_job {
    struct sd_registry reg;
    struct sd_config cfg;
    struct sd_tensor_desc tensors[TH_JOB_MAX_TENSORS];
    struct sd_job job;
    struct sd_mem arena[TH_JOB_MAX_K * SD_STATE_COUNT]; /* the g arenas (th_job_g_arenas) */
    struct sd_session s[TH_JOB_MAX_K];                  /* local rank r's session */
};

/* n tensors of sizes[i] elements in dtype, tensor i in unit i, under plan on node `node` of
 * nodes x k ranks: SGD, the host backend and a queue of its own, the job READY. False (a failed
 * check naming the plan) when the plan or the layout is refused. */
bool th_job_build(struct th_job *tj, const char *plan, uint32_t nodes, uint32_t k, uint32_t node,
                  const uint64_t *sizes, uint32_t n, int dtype);
/* each local rank's g arena (job->mem.arena), its values random in [-1, 1] */
void th_job_g_arenas(struct th_job *tj);
/* each local rank's w arena (the units' shards in their dtype, job->mem.w_off set as the job's
 * life sets it) and os arena (master and moments), zeroed */
void th_job_state_arenas(struct th_job *tj);
void th_job_free(struct th_job *tj);
/* local rank r's g arena */
float *th_job_g(struct th_job *tj, uint32_t r);
/* uniform in [-1, 1] (rand()) */
float th_rand_unit(void);
/* x in bf16, rounded to nearest even (the reference of the weights' conversion) */
uint16_t th_bf16(float x);

/* What the fakes saw. */
struct th_answer {
    uint32_t local;
    uint64_t tag, v0, v1;
    int status;
    char msg[256];
};
struct th_fake {
    struct th_answer ans[TH_MAX_ANSWERS]; /* sd_session_complete, in order */
    int done;
    int fails, fail_status; /* sd_session_fail */
    char fail_msg[256];
    int job_fails, job_status; /* sd_job_fail (the job becomes FAILED) */
    char job_msg[512];
    int events[16];           /* sd_job_event, per kind */
    uint32_t last_event_unit; /* sd_job_event_unit's last unit */
    /* the fake engine: the all-reduces and exchanges the module started, for the test to
     * complete (their callbacks) in the order it chooses */
    struct sd_job_allreduce ar[TH_MAX_POSTS];
    int n_ar;
    struct sd_exchange_param ex[TH_MAX_POSTS];
    int n_ex;
    int queue_eagain; /* sd_job_queue_mark answers SD_EAGAIN this many more times */
    int op_done;      /* sd_op_done: operations answered */
};
extern struct th_fake th_fake;
/* forget what the fakes saw */
void th_fake_reset(void);
/* the index of local rank local's answer with tag, or -1 */
int th_answered(uint32_t local, uint64_t tag);

#endif

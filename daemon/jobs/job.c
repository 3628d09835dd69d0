/* The job's core, below every operation: its failure (the modules stopped and their parked
 * calls completed, the other nodes told), the walks over the modules (events, device-queue
 * polls, what is in flight), the shape facts every operation may ask, the gathered weights on
 * its GPUs. It includes no operation's header: it reaches them through job_module.h. The job's
 * life (registration, confirmation, departures, retirement, deadlines) is job_life.c's. */
#include "cluster/cluster.h"
#include "job.h"
#include "job_module.h"
#include "job_trace.h"
#include "registry.h"
#include "sd/hmac.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *sd_job_state_name(enum sd_job_state s)
{
    static const char *const names[] = {"registering", "loading", "running",
                                        "failed",      "closing", "finished"};
    return names[s];
}

/* The modules stopped when the job fails, in this order. */
static const struct sd_job_module *const failing_order[] = {&sd_resume_module, &sd_step_module,
                                                            &sd_net_module};

bool sd_job_node_alive(const struct sd_job *job, uint32_t n)
{
    if (n == job->node)
        return true;
    uint32_t id = sd_job_node_id(job, n);
    return id != SD_NODE_UNKNOWN && sd_cluster_alive(sd_job_cluster(job), id);
}

const char *sd_job_peer_name(const struct sd_job *job, uint32_t n, char *buf, size_t len)
{
    uint32_t id = job->nodes > 1 ? sd_job_node_id(job, n) : SD_NODE_UNKNOWN;
    if (id == SD_NODE_UNKNOWN)
        snprintf(buf, len, "node %u", n);
    else {
        char name[128];
        snprintf(buf, len, "node %u (%s)", n,
                 sd_cluster_node_name(sd_job_cluster(job), id, name, sizeof(name)));
    }
    return buf;
}

uint32_t sd_job_node_of(const struct sd_job *job, uint32_t id)
{
    for (uint32_t n = 0; n < job->nodes; n++)
        if (job->xfer.node_ids[n] == id)
            return n;
    return SD_NODE_UNKNOWN;
}

/* Tell the job's other nodes it failed (or paused) here: the nodes the coordinator confirmed,
 * or before that, those that reported it. */
void sd_job_abort_peers(struct sd_job *job, int status, const char *msg)
{
    sd_cluster_abort_job(
        sd_job_cluster(job),
        &(struct sd_job_abort){.job = job->name,
                               .node_ids = job->xfer.tag != 0 ? job->xfer.node_ids : NULL,
                               .nodes = job->nodes,
                               .tag = job->xfer.tag,
                               .step = job->steps,
                               .status = status,
                               .msg = msg});
}

bool sd_job_token_is(const struct sd_job *job, const void *token, size_t len)
{
    return len == job->xfer.token_len && sd_mem_equal(token, job->xfer.token, len);
}

uint32_t sd_job_ranks_per_node(const struct sd_config *cfg, const Shard__Register *msg)
{
    if (msg->ranks_per_node != 0)
        return msg->ranks_per_node;
    /* (an open cluster without a ranks_per_node: a job that gives none is one node's) */
    return cfg->nodes > 1 || cfg->ranks_per_node ? (uint32_t)cfg->ranks_per_node : msg->world;
}

bool sd_job_name_valid(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n >= sizeof(((struct sd_job *)0)->name) || name[0] == '.' || name[0] == '-')
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || (ch != '\0' && strchr("._-:,+=@", ch) != NULL);
        if (!ok)
            return false;
    }
    return true;
}

/* its_dump: another node's dump, named after this node's (sd_job_fail_from_peer) */
static void fail_text(struct sd_job *job, int status, const char *text, bool tell_peers,
                      const char *its_dump)
{
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
        return;
    /* the flight recorder as the failure found it (calls still scheduled, transfers started),
     * and the message says where it went: the cause first, the paths where they fit */
    char with_trace[sizeof(job->fail_msg)], dump[SD_PATH_MAX + 160], tail[2 * SD_PATH_MAX + 240];
    int tl = 0;
    if (status != SD_EPAUSED && sd_job_trace_dump(job, text, dump, sizeof(dump)) == SD_OK)
        tl = snprintf(tail, sizeof(tail), SD_TRACE_TAIL "%s; shardctl trace%s%s)", dump,
                      its_dump[0] != '\0' ? "; the failing node's: " : "", its_dump);
    else if (its_dump[0] != '\0')
        tl = snprintf(tail, sizeof(tail), " (the failing node's flight recorder: %s)", its_dump);
    if (tl > 0) {
        int room = (int)sizeof(with_trace) - 1 - tl - 3;
        size_t n = strlen(text);
        if (room < 0)
            room = 0;
        if (n > (size_t)room) {
            memcpy(with_trace, text, (size_t)room);
            memcpy(with_trace + room, "...", 4);
        } else {
            memcpy(with_trace, text, n + 1);
        }
        size_t have = strlen(with_trace);
        size_t add = SD_MIN(strlen(tail), sizeof(with_trace) - 1 - have);
        memcpy(with_trace + have, tail, add);
        with_trace[have + add] = '\0';
        text = with_trace;
    }
    if (status == SD_EPAUSED)
        SD_WARN("job", "%s", text);
    else
        SD_WARN("job", "job '%s' failed: %s", job->name, text);
    enum sd_job_state was = job->state;
    job->state = SD_JOB_FAILED;
    job->fail_status = status;
    snprintf(job->fail_msg, sizeof(job->fail_msg), "%s", text);
    for (size_t i = 0; i < SD_ARRAY_SIZE(failing_order); i++)
        if (failing_order[i]->failing != NULL)
            failing_order[i]->failing(job, (int)was);
    if (job->nodes > 1 && was != SD_JOB_REGISTERING && tell_peers)
        sd_job_abort_peers(job, status, text);
    sd_job_fail_parked(job, status, text, true);
}

int sd_job_queue_mark(struct sd_job *job, bool behind, uint64_t *ticket_p)
{
    const struct sd_gpu_ops *dev = job->reg->dev;
    int st = dev->record(job->mem.queue, ticket_p);
    if (st != SD_OK)
        return st;
    return behind ? SD_EAGAIN : dev->query(job->mem.queue, *ticket_p);
}

void sd_job_backend_failed(struct sd_job *job, int status)
{
    sd_job_fail(job, status, "the %s backend failed: %s", job->reg->dev->name,
                sd_status_str(status));
}

const char *sd_job_name(const struct sd_job *job)
{
    return job->name;
}

void sd_job_count_error(struct sd_job *job)
{
    job->stats.errors++;
}

void sd_job_fail_text(struct sd_job *job, int status, const char *text, bool tell_peers)
{
    fail_text(job, status, text, tell_peers, "");
}

void sd_job_fail_from_peer(struct sd_job *job, int status, const char *text, const char *its_dump)
{
    fail_text(job, status, text, false, its_dump);
}

void sd_job_fail(struct sd_job *job, int status, const char *fmt, ...)
{
    char text[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    sd_job_fail_text(job, status, text, true);
}

void sd_job_missing_ranks(const struct sd_job *job, const bool *present, char *out, size_t len)
{
    size_t off = 0;
    out[0] = '\0';
    for (uint32_t r = 0; r < job->k && off < len; r++)
        if (!present[r])
            off += (size_t)snprintf(out + off, len - off, "%s%u", off ? ", " : "",
                                    job->first_rank + r);
}

/* The order parked calls are completed in when the job fails or pauses. */
static const struct sd_job_module *const fail_order[] = {
    &sd_push_module, &sd_fetch_module,    &sd_loading_module, &sd_values_module,
    &sd_step_module, &sd_dispatch_module, &sd_ckpt_module};

/* ---- shape facts (job.h) */

bool sd_job_node_rounds(const struct sd_job *job)
{
    return job->nodes > 1 && (job->plan.f[SD_STATE_G] > job->k || !job->plan.two_hop);
}

uint32_t sd_job_push_gens(const struct sd_job *job)
{
    return sd_job_node_rounds(job) ? (uint32_t)job->reg->cfg->push_rounds : 1;
}

bool sd_job_weights_remote(const struct sd_job *job)
{
    return job->nodes > 1 && job->gnodes[SD_STATE_OS] > 1 &&
           job->plan.f[SD_STATE_W] < job->plan.f[SD_STATE_OS];
}

/* The modules that wait for other modules' completions (push: for the step's end); the job's
 * life last (it may free the job). */
static const struct sd_job_module *const event_order[] = {
    &sd_push_module, &sd_step_module, &sd_values_module, &sd_resume_module, &sd_life_module};

static bool raise_ev(struct sd_job *job, const struct sd_job_ev *e)
{
    bool taken = false;
    for (size_t i = 0; i < SD_ARRAY_SIZE(event_order); i++)
        taken |= event_order[i]->event != NULL && event_order[i]->event(job, e);
    return taken;
}

bool sd_job_event_ended(struct sd_job *job, enum sd_job_event ev, int status, uint32_t peer)
{
    return raise_ev(
        job, &(struct sd_job_ev){.kind = ev, .status = status, .peer = peer, .unit = UINT32_MAX});
}

bool sd_job_event_unit(struct sd_job *job, enum sd_job_event ev, uint32_t unit)
{
    return raise_ev(
        job, &(struct sd_job_ev){.kind = ev, .status = SD_OK, .peer = UINT32_MAX, .unit = unit});
}

bool sd_job_event_text(struct sd_job *job, enum sd_job_event ev, int status, const char *text)
{
    return raise_ev(
        job,
        &(struct sd_job_ev){
            .kind = ev, .status = status, .peer = UINT32_MAX, .text = text, .unit = UINT32_MAX});
}

/* The modules asked what is in flight, in this order: the first that has something names it. */
static const struct sd_job_module *const activity_order[] = {&sd_step_module, &sd_push_module,
                                                             &sd_fetch_module, &sd_loading_module};

bool sd_job_activity(const struct sd_job *job, char *what, size_t len, uint64_t *since_ns)
{
    for (size_t i = 0; i < SD_ARRAY_SIZE(activity_order); i++)
        if (activity_order[i]->activity != NULL &&
            activity_order[i]->activity(job, what, len, since_ns))
            return true;
    return false;
}

bool sd_job_event(struct sd_job *job, enum sd_job_event ev)
{
    return sd_job_event_ended(job, ev, SD_OK, UINT32_MAX);
}

/* The modules that wait for the job's device queue, in the order they are polled (the step
 * last: its poll may end the job's step, which the others' results feed). */
static const struct sd_job_module *const queue_order[] = {
    &sd_resume_module, &sd_loading_module, &sd_values_module, &sd_ckpt_module,
    &sd_fetch_module,  &sd_push_module,    &sd_step_module};

bool sd_job_queue_waiting(const struct sd_job *job)
{
    for (size_t i = 0; i < sizeof(queue_order) / sizeof(queue_order[0]); i++)
        if (queue_order[i]->queue_waiting != NULL && queue_order[i]->queue_waiting(job))
            return true;
    return false;
}

bool sd_job_queue_poll(struct sd_job *job)
{
    bool moved = false;
    for (size_t i = 0; i < sizeof(queue_order) / sizeof(queue_order[0]); i++)
        if (queue_order[i]->queue_poll != NULL)
            moved |= queue_order[i]->queue_poll(job);
    return moved;
}

/* The modules whose workers may use the job's shards off the loop. */
static const struct sd_job_module *const worker_order[] = {&sd_ckpt_module};

bool sd_job_shards_busy(const struct sd_job *job)
{
    for (size_t i = 0; i < sizeof(worker_order) / sizeof(worker_order[0]); i++)
        if (worker_order[i]->shards_busy != NULL && worker_order[i]->shards_busy(job))
            return true;
    return false;
}

/* The modules that may give the job its values. */
static const struct sd_job_module *const source_order[] = {&sd_ckpt_module, &sd_resume_module};

const char *sd_job_state_needed(const struct sd_job *job)
{
    for (size_t i = 0; i < sizeof(worker_order) / sizeof(worker_order[0]); i++) {
        const char *why =
            worker_order[i]->needs_state != NULL ? worker_order[i]->needs_state(job) : NULL;
        if (why != NULL)
            return why;
    }
    return NULL;
}

const char *sd_job_values_from(const struct sd_job *job)
{
    for (size_t i = 0; i < sizeof(source_order) / sizeof(source_order[0]); i++) {
        const char *what =
            source_order[i]->gives_values != NULL ? source_order[i]->gives_values(job) : NULL;
        if (what != NULL)
            return what;
    }
    return NULL;
}

/* Complete every module's parked calls with an error (fail_order); with_fetches: also ranks
 * waiting for an in-flight gather. */
void sd_job_fail_parked(struct sd_job *job, int status, const char *msg, bool with_fetches)
{
    char text[SD_CQE_MSG_LEN]; /* what a completion carries: a longer message is cut */
    size_t at = 0;
    if (status != SD_EPAUSED)
        at = SD_MIN((size_t)snprintf(text, sizeof(text), "job '%s' failed: ", job->name),
                    sizeof(text) - 1);
    snprintf(text + at, sizeof(text) - at, "%s", msg);
    for (size_t i = 0; i < sizeof(fail_order) / sizeof(fail_order[0]); i++)
        if (fail_order[i]->fail_parked != NULL)
            fail_order[i]->fail_parked(job, status, text, with_fetches);
}

struct sd_cluster *sd_job_cluster(const struct sd_job *job)
{
    return job->reg->cluster;
}

/* ---- the gathered weights on the job's GPUs */

const struct sd_mem *sd_job_rank_pool(const struct sd_job *job, uint32_t local)
{
    for (uint32_t i = 0; i < job->mem.n_pool_copies; i++)
        if (job->mem.pool_copy[i].device == sd_job_rank_device(job, local))
            return &job->mem.pool_copy[i];
    return &job->mem.pool;
}

void sd_job_pool_publish(struct sd_job *job, uint64_t off, uint64_t bytes)
{
    struct sd_gpu_piece pieces[SD_GPU_MAX_DEVICES];
    uint32_t n = 0;
    for (uint32_t i = 0; i < job->mem.n_pool_copies && n < SD_GPU_MAX_DEVICES; i++)
        pieces[n++] = (struct sd_gpu_piece){.dst = (uint8_t *)job->mem.pool_copy[i].ptr + off,
                                            .src = (const uint8_t *)job->mem.pool.ptr + off,
                                            .bytes = bytes};
    /* together: a backend driving several GPUs runs the copies at once, each on its GPU */
    sd_gpu_copy_many(job->reg->dev, job->mem.queue, pieces, n);
}

struct sd_file_pool *sd_job_files(const struct sd_job *job)
{
    return job->reg->files;
}

/* A job's life, above every operation: registration (all ranks, same model, with a deadline),
 * the layout reply, the coordinator's confirmation, loading's start, departures, refusal,
 * retirement and the registration's and the modules' deadlines; the modules' states created and
 * destroyed with the job. */
#include "checkpoint.h"
#include "cluster/cluster.h"
#include "job_life.h"
#include "job_mem.h"
#include "job_module.h"
#include "net.h"
#include "fetch.h"
#include "loading.h"
#include "recover.h"
#include "resume.h"
#include "session.h"
#include "sd/model_msg.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The modules whose states are created with the job, allocated with its memory, released and
 * destroyed, in this order (job_module.h). */
static const struct sd_job_module *const life_order[] = {
    &sd_step_module, &sd_optim_module, &sd_loading_module, &sd_values_module,
    &sd_push_module, &sd_sched_module, &sd_sec_module,     &sd_quant_module};

void sd_job_free(struct sd_job *job)
{
    sd_job_mem_free(job); /* never while sd_ckpt_busy: its worker may use the memory */
    sd_layout_free(&job->layout);
    sd_model_free(&job->model);
    free(job->ranks);
    free(job->xfer.node_ids);
    sd_trace_fini(&job->stats.trace);
    sd_recover_forget(job->reg, job, "the job's state was dropped");
    sd_ckpt_job_free(job);
    for (size_t i = 0; i < sizeof(life_order) / sizeof(life_order[0]); i++)
        if (life_order[i]->destroy != NULL)
            life_order[i]->destroy(job);
    sd_resume_unlink(job);
    sd_resume_destroy(job);
    free(job);
}

static void job_unlink_rank(struct sd_job *job, struct sd_session *s);

/* A job that never became ready: nothing worth keeping. */
void sd_job_destroy(struct sd_job *job)
{
    for (uint32_t r = 0; job->ranks != NULL && r < job->k; r++)
        if (job->ranks[r] != NULL)
            job_unlink_rank(job, job->ranks[r]);
    sd_registry_unlink(job->reg, job);
    /* a paused job it was to resume is resumable again now, not once the memory below goes: a
     * registration that comes meanwhile finds it (sd_resume_find) */
    sd_resume_unlink(job);
    if (job->mem
            .allocating) { /* the worker writes its buffers: alloc_after_cb (job_mem.c) frees it */
        job->mem.doomed = true;
        return;
    }
    if (sd_ckpt_busy(job)) { /* a file worker uses it: freed once it is done (the sweep) */
        sd_ckpt_drop(job);
        job->mem.doomed = true;
        sd_registry_add_retiring(job->reg, job);
        return;
    }
    SD_DEBUG("job", "job '%s' (id %llu) dropped", job->name, (unsigned long long)job->id);
    sd_job_free(job);
}

void sd_job_retire(struct sd_job *job)
{
    sd_registry_unlink(job->reg, job);
    if (!sd_job_net_idle(job)) {
        /* transfers still read or write its memory: free it once they are done */
        sd_job_net_cancel(job);
        job->retire_pending = true;
        sd_registry_add_retiring(job->reg, job);
        return;
    }
    sd_job_bury(job);
}

/* Every rank left: free the job's memory, keep its record and statistics for shardctl. */
void sd_job_bury(struct sd_job *job)
{
    sd_job_mem_free(job);
    if (job->state != SD_JOB_FAILED || sd_resume_resumed(job))
        job->state = SD_JOB_FINISHED; /* a job resumed by another one ended as it should */
    SD_INFO("job", "job '%s' (id %llu) %s after %llu steps; memory released", job->name,
            (unsigned long long)job->id, sd_job_state_name(job->state),
            (unsigned long long)job->steps);
    struct sd_job *oldest = sd_registry_add_finished(job->reg, job);
    if (oldest != NULL)
        sd_job_free(oldest);
}

/* the step the job starts from: the paused job's it resumes, else the checkpoint's it loads */
static uint64_t start_step(const struct sd_job *job)
{
    return sd_resume_resuming(job) ? sd_resume_start_step(job) : sd_ckpt_start_step(job);
}

/* Send the layout and the shared fds to one registered rank. */
static int job_send_layout(struct sd_job *job, struct sd_session *s)
{
    const struct sd_layout *l = &job->layout;
    int status = SD_ENOMEM;
    Shard__UnitLayout *units = calloc(l->n_units, sizeof(*units));
    Shard__UnitLayout **up = calloc(l->n_units, sizeof(*up));
    Shard__TensorLayout *tens = calloc(l->n_tensors, sizeof(*tens));
    Shard__TensorLayout **tp = calloc(l->n_tensors, sizeof(*tp));
    s->holds = calloc(l->n_units, sizeof(*s->holds));
    if (!units || !up || !tens || !tp || !s->holds)
        goto out;
    for (uint32_t u = 0; u < l->n_units; u++) {
        shard__unit_layout__init(&units[u]);
        units[u].numel = l->units[u].numel;
        units[u].used = l->units[u].used;
        units[u].dtype = (uint32_t)l->units[u].dtype;
        units[u].first_tensor = l->units[u].first_tensor;
        units[u].n_tensors = l->units[u].n_tensors;
        up[u] = &units[u];
    }
    for (uint32_t t = 0; t < l->n_tensors; t++) {
        shard__tensor_layout__init(&tens[t]);
        tens[t].offset = l->tensors[t].offset;
        tens[t].numel = l->tensors[t].numel;
        tp[t] = &tens[t];
    }
    uint32_t factors[SD_STATE_COUNT];
    for (int st = 0; st < SD_STATE_COUNT; st++)
        factors[st] = job->plan.f[st];
    Shard__RegisterReply rep = SHARD__REGISTER_REPLY__INIT;
    rep.job_id = job->id;
    rep.n_units = l->n_units;
    rep.units = up;
    rep.n_tensors = l->n_tensors;
    rep.tensors = tp;
    const struct sd_mem *pool = sd_job_rank_pool(job, s->local); /* on the rank's GPU */
    rep.pool_bytes = pool->bytes;
    rep.staging_slots = job->mem.staging_slots;
    rep.staging_slot_bytes = job->mem.staging_slot_bytes;
    rep.n_shard_factor = SD_STATE_COUNT;
    rep.shard_factor = factors;
    rep.ranks_per_node = job->k;
    rep.step_args_off = job->mem.step_args_off;
    rep.step_args_bytes = job->mem.step_args_bytes;
    rep.save_path_off = job->mem.save_path_off;
    rep.start_step = start_step(job);
    rep.resumed = sd_resume_resuming(job);
    uint32_t n_groups = sd_model_groups(&job->model);
    Shard__Optimizer *gd = calloc(n_groups, sizeof(*gd));
    Shard__Optimizer **gp = calloc(n_groups, sizeof(*gp));
    if (gd == NULL || gp == NULL) {
        free(gd);
        free(gp);
        goto out;
    }
    for (uint32_t g = 0; g < n_groups; g++) {
        struct sd_hparams h;
        if (!sd_resume_hparams(job, g, &h))
            h = sd_ckpt_hparams(job, g);
        sd_hparams_to_msg(&h, job->model.optim.kind, &gd[g]);
        gp[g] = &gd[g];
    }
    rep.n_groups = n_groups;
    rep.groups = gp;
    Shard__DaemonMsg out = SHARD__DAEMON_MSG__INIT;
    out.msg_case = SHARD__DAEMON_MSG__MSG_REGISTER;
    out.register_ = &rep;

    rep.memory = (char *)job->reg->dev->client_memory;
    struct sd_gpu_device gpu[SD_GPU_MAX_DEVICES];
    int n_gpus =
        job->reg->dev->devices != NULL ? job->reg->dev->devices(gpu, SD_GPU_MAX_DEVICES) : 0;
    for (int i = 0; i < n_gpus && i < SD_GPU_MAX_DEVICES; i++)
        if (gpu[i].index ==
            sd_job_rank_device(job, s->local)) { /* the rank's GPU (config devices) */
            rep.device = gpu[i].index;
            rep.device_uuid = gpu[i].uuid;
        }
    /* the pool goes out read-only: clients read gathered weights, never write them (a memfd
     * reopened read-only; a device's fd handle, which the client maps read-only) */
    bool memfd = job->reg->dev->client_memfds;
    int ro = pool->fd;
    if (memfd) {
        char path[64];
        snprintf(path, sizeof(path), "/proc/self/fd/%d", pool->fd);
        if ((ro = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
            status = -errno;
            goto out;
        }
    }
    int fds[3] = {ro, job->mem.staging[s->local].fd, job->mem.fence[s->local].fd};
    status = sd_session_send(s, &out, fds, 3);
    if (memfd)
        close(ro);
    free(gd);
    free(gp);
    if (status == SD_OK)
        s->registered = true;
out:
    free(units);
    free(up);
    free(tens);
    free(tp);
    return status;
}

static void job_unlink_rank(struct sd_job *job, struct sd_session *s)
{
    if (job->ranks[s->local] == s)
        job->ranks[s->local] = NULL;
    s->job = NULL;
}

/* Registration is agreed (one node: at once; across nodes: confirmed by the coordinator):
 * answer every local rank with the layout and start loading the initial values. */
static void job_start_loading(struct sd_job *job)
{
    job->state = SD_JOB_LOADING;
    job->stats.allocs_after_register = 0;
    char b[32], c[32];
    SD_INFO("job",
            "job '%s' registered: %u ranks (%u on this node, %u nodes), plan %s, %u units, %s of "
            "parameters, %s allocated in %.1f ms",
            job->name, job->world, job->k, job->nodes, job->plan.name, job->layout.n_units,
            sd_fmt_bytes(b, sizeof(b), job->layout.total_bytes),
            sd_fmt_bytes(c, sizeof(c), job->mem.bytes_total), (double)job->mem.alloc_ns / 1e6);
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        if (s != NULL && job_send_layout(job, s) != SD_OK) {
            sd_job_fail(job, SD_ECONNRESET, "rank %u could not be sent its layout",
                        job->first_rank + r);
            return;
        }
    }
    if (sd_resume_resuming(job))
        sd_resume_load(job); /* every node takes its part of the paused job over */
    else if (sd_ckpt_loading(job))
        sd_ckpt_load_start(job); /* every node reads its part of the checkpoint */
    else if (job->nodes > 1)
        sd_loading_start(job);
}

/* The job's nodes' data paths work (their probes came back): loading may start. False: it
 * waits (sd_job_sweep tries again until the registration's deadline). */
static bool job_paths_ready(struct sd_job *job)
{
    job->xfer.paths_wait = false;
    for (uint32_t n = 0; n < job->nodes; n++)
        if (n != job->node && !sd_cluster_usable(sd_job_cluster(job), job->xfer.node_ids[n])) {
            job->xfer.paths_wait = true;
            return false;
        }
    return true;
}

void sd_job_confirm(struct sd_job *job, uint32_t tag, const uint32_t *ids, uint32_t n)
{
    uint32_t self = sd_cluster_self(sd_job_cluster(job));
    bool ok = n == job->nodes && ids[job->node] == self;
    for (uint32_t i = 0; ok && i < n; i++)
        for (uint32_t j = 0; j < i; j++)
            ok &= ids[i] != ids[j];
    if (!ok) {
        char text[200];
        snprintf(text, sizeof(text),
                 "the coordinator confirmed the job on %u nodes with this one (node %u) not "
                 "its node %u: a protocol error",
                 n, self, job->node);
        sd_job_refuse_everywhere(job, SD_EPROTO, text);
        return;
    }
    struct sd_job *other = sd_registry_find_tag(job->reg, tag);
    if (other != NULL && other != job) { /* (the reports say which tags are in use here) */
        char text[200];
        snprintf(text, sizeof(text),
                 "the coordinator confirmed the job with transport tag %u, which job '%.64s' "
                 "still uses on this node: a protocol error",
                 tag, other->name);
        sd_job_refuse_everywhere(job, SD_EPROTO, text);
        return;
    }
    job->xfer.tag = tag;
    memcpy(job->xfer.node_ids, ids, n * sizeof(*ids));
    /* the job's nodes must be reachable over the fabric first: a node whose data path is still
     * being probed (a table just installed) is waited for, within the registration's deadline */
    if (job_paths_ready(job))
        job_start_loading(job);
}

/* Refuse the registration to every local rank and drop the job. */
void sd_job_refuse(struct sd_job *job, int status, const char *msg)
{
    SD_WARN("job", "job '%s' refused: %s", job->name, msg);
    for (uint32_t r = 0; r < job->k; r++) {
        struct sd_session *s = job->ranks[r];
        if (s == NULL)
            continue;
        sd_session_send_error(s, status, "register: %s", msg);
        job_unlink_rank(job, s);
    }
    /* confirmed already (it waited for its nodes' data paths): the nodes that went on end the
     * job once this one, too, said its ranks left */
    if (job->nodes > 1 && job->xfer.tag != 0)
        sd_cluster_job_left(sd_job_cluster(job), job->name, job->xfer.node_ids, job->nodes);
    sd_job_destroy(job);
}

void sd_job_refuse_everywhere(struct sd_job *job, int status, const char *msg)
{
    if (job->nodes > 1)
        sd_job_abort_peers(job, status, msg);
    sd_job_refuse(job, status, msg);
}

/* The job's memory is allocated (status SD_OK) or not (err says why): one node starts at once,
 * several ask the coordinator. */
void sd_job_allocated(struct sd_job *job, int status, const char *err)
{
    if (job->nodes == 1) {
        if (status != SD_OK)
            sd_job_refuse(job, status, err);
        else
            job_start_loading(job);
        return;
    }
    /* the coordinator's decision comes back through sd_job_confirmed / sd_job_refused, possibly
     * before this call returns (node 0 decides locally): touch nothing of job afterwards */
    job->register_deadline_ns =
        sd_now_ns() + 2 * (uint64_t)job->reg->cfg->register_timeout_ms * 1000000ULL;
    sd_cluster_report_job(sd_job_cluster(job),
                          &(struct sd_job_report){.job = job->name,
                                                  .digest = job->digest,
                                                  .world = job->world,
                                                  .ranks_per_node = job->k,
                                                  .job_node = job->node,
                                                  .start_step = start_step(job),
                                                  .resumed = sd_resume_resuming(job),
                                                  .token = job->xfer.token,
                                                  .token_len = job->xfer.token_len,
                                                  .leader = job->xfer.leader,
                                                  .status = status,
                                                  .msg = status == SD_OK ? "" : err});
}

struct sd_job *sd_job_create(struct sd_registry *reg, const Shard__Register *msg,
                             struct sd_model *model, const struct sd_fsid *owner, int *status_p,
                             char *err, size_t errlen)
{
    *status_p = SD_EINVAL;
    const struct sd_config *cfg = reg->cfg;
    if (msg->world == 0 || msg->world > SD_MAX_WORLD) {
        snprintf(err, errlen, "world size %u must be in 1..%d", msg->world, SD_MAX_WORLD);
        return NULL;
    }
    if (msg->resume_timeout_ms > (uint64_t)cfg->max_resume_timeout_ms) {
        snprintf(err, errlen,
                 "resume_timeout_ms %llu is longer than this daemon allows (max_resume_timeout_ms "
                 "%lld)",
                 (unsigned long long)msg->resume_timeout_ms, (long long)cfg->max_resume_timeout_ms);
        return NULL;
    }
    /* a job spans nodes [0, world / k): k is the job's (its registration's), else the daemon's,
     * else one node takes all its ranks */
    uint32_t k = sd_job_ranks_per_node(cfg, msg);
    uint32_t nodes = k ? msg->world / k : 0;
    if (k == 0 || msg->world % k != 0) {
        snprintf(err, errlen,
                 "world size %u is not a multiple of ranks_per_node %u (every node of a job "
                 "serves %u ranks)",
                 msg->world, k, k);
        return NULL;
    }
    /* an independent daemon (nodes 1) forms a job across nodes through its leader, with a
     * secret; it opens its fabric and peer links when a job first spans nodes */
    bool indep = cfg->nodes == 1;
    if (nodes > 1 && indep && msg->job_token.len == 0) {
        snprintf(err, errlen,
                 "world size %u spans %u nodes of %u ranks, whose daemons form the job through "
                 "its leader: it needs a job secret, which proves its nodes to each other "
                 "(SHARD_JOB_SECRET_FILE; mlp_train --job-secret-file; shard.torch.wrap's "
                 "job_secret)",
                 msg->world, nodes, k);
        return NULL;
    }
    if (nodes > 1 && indep && msg->rank >= k && msg->rank < msg->world && msg->leader[0] == '\0') {
        snprintf(err, errlen,
                 "world size %u spans %u nodes of %u ranks and rank %u named no leader (the "
                 "daemon of rank 0's node): set SHARD_LEADER=host[:port], or run under torchrun "
                 "(MASTER_ADDR) or srun (SLURM_STEP_NODELIST)",
                 msg->world, nodes, k, msg->rank);
        return NULL;
    }
    char why[400];
    if (nodes > 1 && indep && reg->open_fabric != NULL &&
        reg->open_fabric(reg, why, sizeof(why)) != SD_OK) {
        snprintf(err, errlen, "world size %u needs %u nodes of %u ranks, and %s", msg->world, nodes,
                 k, why);
        return NULL;
    }
    const struct sd_cluster *cl = sd_net_cluster(reg->net);
    /* (an independent daemon meets as many as the job names) */
    uint32_t have = sd_cluster_independent(cl) ? SD_MAX_NODES - 2 : sd_cluster_nodes(cl);
    if (nodes > have) {
        snprintf(err, errlen,
                 "world size %u needs %u nodes of %u ranks; this cluster has %u (at most "
                 "world %llu)",
                 msg->world, nodes, k, have, (unsigned long long)have * k);
        return NULL;
    }
    if (k > SD_MAX_LOCAL_RANKS) {
        snprintf(err, errlen,
                 "%u ranks on this node (world %u over %u nodes); a node serves at most %d ranks",
                 k, msg->world, nodes, SD_MAX_LOCAL_RANKS);
        return NULL;
    }
    if (nodes > 1 && !sd_cluster_ready(sd_net_cluster(reg->net))) {
        snprintf(err, errlen,
                 "the cluster has not formed yet (waiting for the other daemons); "
                 "retry in a moment");
        return NULL;
    }
    if (msg->rank >= msg->world) {
        snprintf(err, errlen, "rank %u is not below world size %u", msg->rank, msg->world);
        return NULL;
    }
    if (nodes > 1 && msg->rank >= k && msg->leader[0] != '\0' &&
        (strlen(msg->leader) >= SD_JOB_LEADER_MAX ||
         strspn(msg->leader, "0123456789.:[]abcdefABCDEF") != strlen(msg->leader) ||
         strchr(msg->leader, ':') == NULL)) {
        snprintf(err, errlen,
                 "the job's leader '%.64s' is not ip:port (libshard resolves SHARD_LEADER, "
                 "MASTER_ADDR or Slurm's first host to an IPv4 address: is it a name this "
                 "node resolves?)",
                 msg->leader);
        return NULL;
    }
    struct sd_job *job = calloc(1, sizeof(*job));
    if (job == NULL) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    job->reg = reg;
    snprintf(job->name, sizeof(job->name), "%s", msg->job);
    job->id = ++reg->next_job_id;
    job->uid = owner->uid;
    job->world = msg->world;
    job->mem.max_live_bytes = msg->max_live_bytes;
    job->k = k;
    /* the job's node this one is, by the rank: its cluster node is the coordinator's to map */
    job->node = msg->rank / k;
    job->first_rank = job->node * k;
    job->xfer.node_ids = malloc(nodes * sizeof(*job->xfer.node_ids));
    for (uint32_t n = 0; job->xfer.node_ids != NULL && n < nodes; n++)
        job->xfer.node_ids[n] =
            n == job->node ? sd_cluster_self(sd_net_cluster(reg->net)) : SD_NODE_UNKNOWN;
    job->topo = (struct sd_topo){
        .nodes = nodes, .ranks_per_node = k, .package_size = (uint32_t)cfg->package_size};
    job->model = *model;
    memset(model, 0, sizeof(*model));
    job->digest = sd_model_digest(&job->model);
    snprintf(job->xfer.leader, sizeof(job->xfer.leader), "%s", msg->leader);
    if (msg->job_token.len == SD_JOB_TOKEN_BYTES) { /* (any other length: refused before) */
        memcpy(job->xfer.token, msg->job_token.data, SD_JOB_TOKEN_BYTES);
        job->xfer.token_len = SD_JOB_TOKEN_BYTES;
    }
    job->created_ns = sd_now_ns();
    job->register_deadline_ns = job->created_ns + (uint64_t)cfg->register_timeout_ms * 1000000ULL;
    job->ranks = calloc(k, sizeof(*job->ranks));
    int status = sd_trace_init(&job->stats.trace, (uint32_t)cfg->trace_ops, job->first_rank, k);
    if (status == SD_OK)
        status = sd_plan_parse(job->model.plan, &job->topo, &job->plan, err, errlen);
    if (status == SD_OK)
        status = sd_layout_build(&job->model, &job->plan, &job->layout, err, errlen);
    job->nodes = nodes;
    if (status == SD_OK)
        status = sd_ckpt_job_init(job, owner, msg->load, err, errlen);
    if (status == SD_OK)
        status = sd_resume_create(job, sd_resume_timeout(reg, msg->resume_timeout_ms));
    for (int st = 0; st < SD_STATE_COUNT; st++)
        job->gnodes[st] = job->plan.f[st] > k ? job->plan.f[st] / k : 1;
    job->slots_per_unit = job->gnodes[SD_STATE_W] > 1 && !job->plan.hierarchical ? k : 1;
    for (size_t i = 0; status == SD_OK && i < sizeof(life_order) / sizeof(life_order[0]); i++)
        if (life_order[i]->create != NULL)
            status = life_order[i]->create(job);
    if (status == SD_OK)
        job->n_slots = job->layout.n_units * job->slots_per_unit;
    if (status == SD_OK) {
        job->mem.w_off = calloc(job->layout.n_units, sizeof(*job->mem.w_off));
        if (job->mem.w_off == NULL)
            status = SD_ENOMEM;
    }
    if (status != SD_OK || !job->ranks || !job->xfer.node_ids) {
        if (status == SD_OK)
            snprintf(err, errlen, "out of memory");
        *status_p = status == SD_OK ? SD_ENOMEM : status;
        sd_job_free(job);
        return NULL;
    }
    for (uint32_t u = 0; u < job->layout.n_units; u++) {
        job->mem.w_off[u] = job->mem.w_arena_bytes;
        job->mem.w_arena_bytes += sd_job_w_shard_bytes(job, u);
    }
    sd_registry_link(reg, job);
    return job;
}

void sd_job_registered(struct sd_job *job)
{
    if (job->state == SD_JOB_REGISTERING && job->n_registered == job->k && sd_ckpt_opened(job) &&
        !job->mem.allocating && job->mem.bytes_total == 0)
        sd_job_mem_alloc(job);
}

void sd_job_leave(struct sd_job *job, struct sd_session *s, const char *reason)
{
    if (job->state == SD_JOB_REGISTERING) {
        bool complete = job->n_registered == job->k;
        job_unlink_rank(job, s);
        job->n_registered--;
        if (complete) {
            /* the node reported the registration (across nodes the coordinator may have
             * confirmed it already): it cannot go on without this rank; end it everywhere */
            char text[160];
            snprintf(text, sizeof(text), "rank %u (pid %d) %s while the job registered", s->rank,
                     (int)s->pid, reason);
            sd_job_refuse_everywhere(job, SD_ECONNRESET, text);
        } else if (job->n_registered == 0) {
            sd_job_destroy(job);
        }
        return;
    }
    if (s->registered)
        sd_fetch_release_holds(job, s);
    if (s->has_stalled) {
        s->has_stalled = false;
    }
    job_unlink_rank(job, s);
    job->n_left++;
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING) {
        /* already over */
    } else if (strcmp(reason, "detached") == 0) {
        job->state = SD_JOB_CLOSING;
        job->fail_status = SD_EJOBFAILED;
        snprintf(job->fail_msg, sizeof(job->fail_msg), "rank %u (pid %d) detached after step %llu",
                 s->rank, (int)s->pid, (unsigned long long)job->steps);
        SD_INFO("job", "job '%s' closing: %s", job->name, job->fail_msg);
        sd_job_fail_parked(job, SD_EJOBFAILED, job->fail_msg, false);
    } else if (!sd_resume_rank_died(job, s, reason)) {
        sd_job_fail(job, SD_EJOBFAILED, "rank %u (pid %d) %s after step %llu", s->rank, (int)s->pid,
                    reason, (unsigned long long)job->steps);
    }
    if (job->n_left < job->k || sd_resume_all_left(job))
        return;
    /* across nodes the job ends when every node's ranks left: peers may still gather this
     * node's shards (a rank saving the final weights) */
    if (job->nodes > 1 && !job->retire_pending) {
        job->retire_pending = true;
        if (sd_cluster_job_left(sd_job_cluster(job), job->name, job->xfer.node_ids, job->nodes))
            return; /* sd_job_ended retires it, maybe already did */
    }
    sd_job_retire(job);
}

/* The modules' deadlines in the order they are checked: the first that fails the job names
 * the reason. */
static const struct sd_job_module *const sweep_order[] = {&sd_step_module,     &sd_ckpt_module,
                                                          &sd_dispatch_module, &sd_loading_module,
                                                          &sd_values_module,   &sd_push_module};
int sd_job_modules_alloc(struct sd_job *job)
{
    int status = SD_OK;
    for (size_t i = 0; status == SD_OK && i < sizeof(life_order) / sizeof(life_order[0]); i++)
        if (life_order[i]->alloc != NULL)
            status = life_order[i]->alloc(job);
    return status;
}

void sd_job_modules_release(struct sd_job *job)
{
    for (size_t i = 0; i < sizeof(life_order) / sizeof(life_order[0]); i++)
        if (life_order[i]->release != NULL)
            life_order[i]->release(job);
}

/* Deadlines: a registration whose ranks did not all come, a job paused too long, the transfers
 * across nodes, then every module's (sweep_order). */
void sd_job_sweep(struct sd_job *job, uint64_t now)
{
    uint64_t op_timeout = (uint64_t)job->reg->cfg->op_timeout_ms * 1000000ULL;
    if (sd_ckpt_work_sweep(job, now))
        return; /* a file task past its deadline failed its operation: the job may be gone */
    if (job->state == SD_JOB_REGISTERING) {
        if (job->xfer.paths_wait) {
            if (now < job->register_deadline_ns) {
                if (job_paths_ready(job)) /* its nodes' data paths work now */
                    job_start_loading(job);
                return;
            }
            sd_job_refuse_everywhere(job, SD_ETIMEDOUT,
                                     "the data paths to the job's nodes did not work within "
                                     "the registration's deadline (register_timeout_ms)");
            return;
        }
        if (now < job->register_deadline_ns || job->mem.allocating)
            return;
        char missing[128];
        bool present[1024];
        for (uint32_t r = 0; r < job->k && r < 1024; r++)
            present[r] = job->ranks[r] != NULL;
        sd_job_missing_ranks(job, present, missing, sizeof(missing));
        char why[640];
        const char *trouble =
            sd_cluster_leader_trouble(sd_net_cluster(job->reg->net), job->name, why, sizeof(why));
        for (uint32_t r = 0; r < job->k; r++) {
            struct sd_session *s = job->ranks[r];
            if (s == NULL)
                continue;
            if (missing[0] != '\0')
                sd_session_send_error(s, SD_ETIMEDOUT,
                                      "register job '%s': ranks %s did not register within %lld ms "
                                      "(register_timeout_ms)",
                                      job->name, missing,
                                      (long long)job->reg->cfg->register_timeout_ms);
            else if (job->reg->cfg->nodes == 1 && trouble != NULL) /* it could not reach it */
                sd_session_send_error(
                    s, SD_ETIMEDOUT,
                    "register job '%s': its leader (%s) did not confirm it within %lld ms: %s",
                    job->name, job->xfer.leader, 2 * (long long)job->reg->cfg->register_timeout_ms,
                    trouble);
            else if (job->reg->cfg->nodes == 1) /* its leader never decided */
                sd_session_send_error(
                    s, SD_ETIMEDOUT,
                    "register job '%s': its leader (%s) did not confirm it within %lld ms "
                    "(the job's other nodes did not all register, or the leader is not "
                    "reachable there)",
                    job->name, job->xfer.leader[0] ? job->xfer.leader : "this daemon",
                    2 * (long long)job->reg->cfg->register_timeout_ms);
            else /* this node's ranks all came; the coordinator never decided */
                sd_session_send_error(
                    s, SD_ETIMEDOUT,
                    "register job '%s': the coordinator did not confirm it within "
                    "%lld ms (the job's other nodes did not all register, or "
                    "the coordinator is unreachable)",
                    job->name, 2 * (long long)job->reg->cfg->register_timeout_ms);
            job_unlink_rank(job, s);
        }
        sd_job_destroy(job);
        return;
    }
    sd_resume_sweep(job, now);        /* may drop the job */
    if (job->state == SD_JOB_CLOSING) /* fetches still run: a stalled one fails at its deadline */
        sd_dispatch_module.sweep(job, now, op_timeout);
    if (job->state == SD_JOB_FAILED || job->state == SD_JOB_CLOSING)
        return;
    if (job->nodes > 1 && job->state == SD_JOB_READY) {
        sd_job_net_sweep(job, now);
        if (job->state == SD_JOB_FAILED)
            return;
    }
    for (size_t i = 0; i < sizeof(sweep_order) / sizeof(sweep_order[0]); i++)
        if (sweep_order[i]->sweep != NULL && sweep_order[i]->sweep(job, now, op_timeout))
            return;
}

/* ---- the job's events (job_module.h) that its life takes: last of the modules (it may free
 * the job) */
static bool life_event(struct sd_job *job, const struct sd_job_ev *ev)
{
    switch (ev->kind) {
    case SD_JOB_EV_LET_GO:
        if (job->n_left == job->k)
            sd_job_retire(job);
        return true;
    case SD_JOB_EV_OPENED:
        if (ev->status == SD_OK)
            sd_job_registered(job);
        else if (job->nodes > 1) /* the coordinator refuses it on every node */
            sd_job_allocated(job, ev->status, ev->text);
        else
            sd_job_refuse(job, ev->status, ev->text); /* frees the job */
        return true;
    default:
        return false;
    }
}

const struct sd_job_module sd_life_module = {.name = "life", .event = life_event};

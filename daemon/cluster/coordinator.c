/* The coordinator (node 0): a job's registration is confirmed once every node of it reported
 * the same model, or refused; its transport tag is chosen; a job ends once every node's ranks
 * left it. Members forward what they report to the coordinator. */
#include "cluster/cluster_int.h"

/* ---- coordinator: job registration across nodes */

static struct coord_job *coord_job_find(struct sd_cluster *cl, const char *name, bool create,
                                        uint32_t nodes)
{
    for (struct coord_job *j = cl->jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    if (!create)
        return NULL;
    struct coord_job *j = calloc(1, sizeof(*j));
    j->seen = calloc(nodes, 1);
    snprintf(j->name, sizeof(j->name), "%s", name);
    j->nodes = nodes;
    j->deadline_ns = sd_now_ns() + (uint64_t)cl->cfg->register_timeout_ms * 1000000ULL;
    j->next = cl->jobs;
    cl->jobs = j;
    return j;
}

static void coord_job_free(struct sd_cluster *cl, struct coord_job *job)
{
    for (struct coord_job **pp = &cl->jobs; *pp; pp = &(*pp)->next)
        if (*pp == job) {
            *pp = job->next;
            break;
        }
    free(job->seen);
    free(job);
}

static void coord_decide(struct sd_cluster *cl, struct coord_job *j)
{
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    Shard__JobConfirm c = SHARD__JOB_CONFIRM__INIT;
    Shard__JobRefuse r = SHARD__JOB_REFUSE__INIT;
    if (j->status == SD_OK) {
        /* a tag no active job uses */
        uint32_t tag;
        for (;;) {
            cl->next_tag = (uint16_t)(cl->next_tag % ((1u << SD_TAG_JOB_BITS) - 1) + 1);
            tag = cl->next_tag;
            if (!cl->ev.tag_in_use(cl->ev.ctx, tag))
                break;
        }
        c.job = j->name;
        c.tag = tag;
        m.msg_case = SHARD__PEER_MSG__MSG_JOB_CONFIRM;
        m.job_confirm = &c;
    } else {
        r.job = j->name;
        r.status = j->status;
        r.message = j->msg;
        m.msg_case = SHARD__PEER_MSG__MSG_JOB_REFUSE;
        m.job_refuse = &r;
    }
    for (uint32_t i = 1; i < j->nodes; i++)
        if (j->seen[i])
            sd_cluster__link_send(cl->by_node[i], &m);
    if (j->status == SD_OK)
        cl->ev.job_confirmed(cl->ev.ctx, j->name, c.tag);
    else
        cl->ev.job_refused(cl->ev.ctx, j->name, j->status, j->msg);
    coord_job_free(cl, j);
}

void sd_cluster__coord_forget(struct sd_cluster *cl, const char *name)
{
    struct coord_job *cj = coord_job_find(cl, name, false, 0);
    if (cj != NULL)
        coord_job_free(cl, cj);
}

void sd_cluster__coord_report(struct sd_cluster *cl, const Shard__JobReport *rep)
{
    uint32_t k = rep->ranks_per_node ? rep->ranks_per_node : (uint32_t)cl->cfg->ranks_per_node;
    uint32_t nodes = k ? rep->world / k : 0;
    if (rep->node >= cl->n || nodes == 0 || nodes > cl->n)
        return;
    struct coord_job *j = coord_job_find(cl, rep->job, true, nodes);
    if (rep->node >= j->nodes || j->seen[rep->node])
        return;
    j->seen[rep->node] = 1;
    j->reported++;
    if (j->reported == 1) {
        j->digest = rep->digest;
        j->world = rep->world;
        j->ranks_per_node = k;
        j->start_step = rep->start_step;
        j->resumed = rep->resumed;
        j->first = rep->node;
    }
    if (j->status == SD_OK) {
        if (rep->status != SD_OK) {
            j->status = rep->status;
            snprintf(j->msg, sizeof(j->msg), "node %u: %s", rep->node, rep->message);
        } else if (k != j->ranks_per_node) {
            j->status = SD_EMISMATCH;
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': node %u registered %u ranks per node, node %u %u: every rank "
                     "must give the same ranks_per_node",
                     rep->job, rep->node, k, j->first, j->ranks_per_node);
        } else if (rep->digest != j->digest || rep->world != j->world) {
            j->status = SD_EMISMATCH;
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': node %u registered model digest %016llx (world %u), another node "
                     "%016llx (world %u): every rank must register the same model",
                     rep->job, rep->node, (unsigned long long)rep->digest, rep->world,
                     (unsigned long long)j->digest, j->world);
        } else if (rep->resumed != j->resumed || rep->start_step != j->start_step) {
            /* a resume takes every node's paused state over, all of the same step */
            j->status = SD_EMISMATCH;
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': node %u %s step %llu, node %u %s step %llu: every node must "
                     "resume the same paused job (was resume_timeout_ms over on one of them?)",
                     rep->job, rep->node, rep->resumed ? "resumes a paused job after" : "starts at",
                     (unsigned long long)rep->start_step, j->first,
                     j->resumed ? "resumes a paused job after" : "starts at",
                     (unsigned long long)j->start_step);
        }
    }
    if (j->reported == j->nodes || j->status != SD_OK)
        coord_decide(cl, j);
}

void sd_cluster__coord_sweep(struct sd_cluster *cl, uint64_t now)
{
    for (struct coord_job *j = cl->jobs, *next; j; j = next) {
        next = j->next;
        bool dead = false;
        for (uint32_t i = 0; i < j->nodes; i++)
            dead |= !cl->alive[i];
        if (now < j->deadline_ns && !dead)
            continue;
        char missing[256];
        size_t off = 0;
        missing[0] = '\0';
        for (uint32_t i = 0; i < j->nodes && off < sizeof(missing); i++)
            if (!j->seen[i])
                off += (size_t)snprintf(missing + off, sizeof(missing) - off, "%s%u",
                                        off ? ", " : "", i);
        j->status = SD_ETIMEDOUT;
        snprintf(j->msg, sizeof(j->msg),
                 "job '%s': nodes %s did not register all their ranks within %lld ms "
                 "(register_timeout_ms)%s",
                 j->name, missing, (long long)cl->cfg->register_timeout_ms,
                 dead ? " or are down" : "");
        coord_decide(cl, j);
    }
}

/* ---- coordinator: a job ends when the ranks of all its nodes left */

void sd_cluster__coord_left(struct sd_cluster *cl, const char *name, uint32_t node, uint32_t nodes)
{
    if (nodes == 0 || node >= nodes)
        return;
    struct coord_left *l;
    for (l = cl->lefts; l; l = l->next)
        if (strcmp(l->name, name) == 0)
            break;
    if (l == NULL) {
        l = calloc(1, sizeof(*l));
        l->seen = calloc(nodes, 1);
        snprintf(l->name, sizeof(l->name), "%s", name);
        l->nodes = nodes;
        l->next = cl->lefts;
        cl->lefts = l;
        /* nodes already down will never report */
        for (uint32_t i = 0; i < nodes; i++)
            if (i != cl->self && cl->ready && !cl->alive[i] && !l->seen[i]) {
                l->seen[i] = 1;
                l->left++;
            }
    }
    if (!l->seen[node]) {
        l->seen[node] = 1;
        l->left++;
    }
    if (l->left < l->nodes)
        return;
    for (struct coord_left **pp = &cl->lefts; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    Shard__JobEnd e = SHARD__JOB_END__INIT;
    e.job = l->name;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_END;
    m.job_end = &e;
    for (uint32_t i = 1; i < l->nodes; i++)
        if (cl->alive[i])
            sd_cluster__link_send(cl->by_node[i], &m);
    char job[64];
    snprintf(job, sizeof(job), "%s", l->name);
    free(l->seen);
    free(l);
    cl->ev.job_ended(cl->ev.ctx, job);
}

bool sd_cluster_job_left(struct sd_cluster *cl, const char *job, uint32_t job_nodes)
{
    if (cl->self == 0) {
        sd_cluster__coord_left(cl, job, 0, job_nodes);
        return true;
    }
    if (!cl->alive[0] || cl->by_node[0] == NULL)
        return false;
    Shard__JobLeft jl = SHARD__JOB_LEFT__INIT;
    jl.job = (char *)job;
    jl.node = cl->self;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_LEFT;
    m.job_left = &jl;
    sd_cluster__link_send(cl->by_node[0], &m);
    return true;
}

void sd_cluster_report_job(struct sd_cluster *cl, const struct sd_job_report *jr)
{
    Shard__JobReport r = SHARD__JOB_REPORT__INIT;
    r.job = (char *)jr->job;
    r.node = cl->self;
    r.digest = jr->digest;
    r.world = jr->world;
    r.ranks_per_node = jr->ranks_per_node;
    r.start_step = jr->start_step;
    r.resumed = jr->resumed;
    r.status = jr->status;
    r.message = (char *)(jr->msg ? jr->msg : "");
    if (cl->self == 0) {
        sd_cluster__coord_report(cl, &r);
        return;
    }
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_REPORT;
    m.job_report = &r;
    sd_cluster__send_to(cl, 0, &m);
}

void sd_cluster_abort_job(struct sd_cluster *cl, const struct sd_job_abort *ja)
{
    const char *job = ja->job;
    uint32_t job_nodes = ja->nodes;
    Shard__JobAbort a = SHARD__JOB_ABORT__INIT;
    a.job = (char *)job;
    a.status = ja->status;
    a.message = (char *)ja->msg;
    a.origin = cl->self;
    a.tag = ja->tag;
    a.step = ja->step;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_ABORT;
    m.job_abort = &a;
    if (cl->self == 0) {
        for (uint32_t i = 1; i < job_nodes; i++)
            sd_cluster__link_send(cl->by_node[i], &m);
        struct coord_job *cj = coord_job_find(cl, job, false, 0);
        if (cj != NULL)
            coord_job_free(cl, cj);
    } else {
        sd_cluster__send_to(cl, 0, &m);
    }
}

void sd_cluster_job_ready(struct sd_cluster *cl, const char *job, uint32_t job_nodes)
{
    Shard__JobReady r = SHARD__JOB_READY__INIT;
    r.job = (char *)job;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_READY;
    m.job_ready = &r;
    for (uint32_t i = 1; i < job_nodes; i++)
        sd_cluster__send_to(cl, i, &m);
}

void sd_cluster_job_saved(struct sd_cluster *cl, const Shard__JobSaved *r)
{
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_SAVED;
    m.job_saved = (Shard__JobSaved *)r;
    sd_cluster__send_to(cl, 0, &m);
}

void sd_cluster_job_save_done(struct sd_cluster *cl, const char *job, uint32_t job_nodes,
                              uint64_t seq, int status, const char *msg)
{
    Shard__JobSaveDone d = SHARD__JOB_SAVE_DONE__INIT;
    d.job = (char *)job;
    d.seq = seq;
    d.status = status;
    d.message = (char *)(msg ? msg : "");
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_SAVE_DONE;
    m.job_save_done = &d;
    for (uint32_t i = 1; i < job_nodes; i++)
        sd_cluster__send_to(cl, i, &m);
}

void sd_cluster_job_recover(struct sd_cluster *cl, uint32_t node, const Shard__JobRecover *r)
{
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_RECOVER;
    m.job_recover = (Shard__JobRecover *)r;
    if (cl->self == 0 && node < cl->n && cl->alive[node])
        sd_cluster__send_to(cl, node, &m);
}

/* a dead node's ranks have left every job */
void sd_cluster__coord_node_down(struct sd_cluster *cl, uint32_t node)
{
    for (struct coord_left *l = cl->lefts, *next; l; l = next) {
        next = l->next;
        if (node < l->nodes)
            sd_cluster__coord_left(cl, l->name, node, l->nodes);
    }
}

void sd_cluster__coord_free(struct sd_cluster *cl)
{
    while (cl->jobs)
        coord_job_free(cl, cl->jobs);
    while (cl->lefts) {
        struct coord_left *l = cl->lefts;
        cl->lefts = l->next;
        free(l->seen);
        free(l);
    }
}

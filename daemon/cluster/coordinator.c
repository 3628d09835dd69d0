/* The coordinator (node 0): a job's registration is confirmed once every node of it reported
 * the same model, or refused; its transport tag is chosen and its nodes mapped (job node i is
 * the cluster node whose ranks are i * k .. i * k + k - 1: a job runs on any of the cluster's
 * nodes); a job ends once every node's ranks left it. Members forward what they report to the
 * coordinator, and what they tell each other goes through it (PeerRelay), in order with its
 * decisions; without it, on their direct links (a job spans both). */
#include "cluster/cluster_int.h"

/* The address table to every member up (each told which node it is). */
void sd_cluster__broadcast_table(struct sd_cluster *cl)
{
    ProtobufCBinaryData *a = calloc(cl->n, sizeof(*a));
    protobuf_c_boolean *down = calloc(cl->n, sizeof(*down));
    if (a == NULL || down == NULL) {
        free(a);
        free(down);
        return;
    }
    for (uint32_t i = 0; i < cl->n; i++) {
        a[i].data = cl->addrs[i];
        a[i].len = cl->addr_len[i];
        down[i] = !cl->alive[i];
    }
    Shard__PeerTable t = SHARD__PEER_TABLE__INIT;
    t.n_fabric_addrs = cl->n;
    t.fabric_addrs = a;
    t.n_down = cl->n;
    t.down = down;
    t.n_hb_ports = cl->n;
    t.hb_ports = cl->hb_port;
    char **peer = calloc(cl->n, sizeof(*peer));
    for (uint32_t i = 0; peer != NULL && i < cl->n; i++)
        peer[i] = cl->peers.addrs[i];
    t.n_peer_addrs = peer != NULL ? cl->n : 0;
    t.peer_addrs = peer;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_TABLE;
    m.table = &t;
    for (uint32_t i = 1; i < cl->n; i++)
        if (cl->alive[i]) {
            t.you = i;
            sd_cluster__link_send(cl->by_node[i], &m);
        }
    free(a);
    free(down);
    free(peer);
}

/* ---- coordinator: job registration across nodes */

static bool same_token(const uint8_t *a, uint32_t alen, const uint8_t *b, size_t blen)
{
    return alen == blen && sd_mem_equal(a, b, alen);
}

/* the registration of name whose reports carry token (len bytes), made when missing with
 * create */
static struct coord_job *coord_job_find(struct sd_cluster *cl, const char *name,
                                        const ProtobufCBinaryData *token, bool create,
                                        uint32_t nodes)
{
    for (struct coord_job *j = cl->track.jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0 &&
            same_token(j->token, j->token_len, token->data, token->len))
            return j;
    if (!create || token->len > SD_JOB_TOKEN_BYTES)
        return NULL;
    struct coord_job *j = calloc(1, sizeof(*j));
    if (j == NULL || (j->at = malloc(nodes * sizeof(*j->at))) == NULL) {
        free(j);
        return NULL;
    }
    for (uint32_t i = 0; i < nodes; i++)
        j->at[i] = SD_NO_NODE;
    snprintf(j->name, sizeof(j->name), "%s", name);
    if (token->len > 0) /* (no data at all without a token) */
        memcpy(j->token, token->data, token->len);
    j->token_len = (uint32_t)token->len;
    j->nodes = nodes;
    j->deadline_ns = sd_now_ns() + (uint64_t)cl->cfg->register_timeout_ms * 1000000ULL;
    j->refused0 = cl->counts.refused;
    j->evicted0 = cl->counts.evicted;
    j->next = cl->track.jobs;
    cl->track.jobs = j;
    return j;
}

static void coord_job_free(struct sd_cluster *cl, struct coord_job *job)
{
    for (struct coord_job **pp = &cl->track.jobs; *pp; pp = &(*pp)->next)
        if (*pp == job) {
            *pp = job->next;
            break;
        }
    free(job->at);
    free(job);
}

/* the job node a cluster node reported (SD_NO_NODE: none) */
static uint32_t coord_job_node_of(const struct coord_job *j, uint32_t node)
{
    for (uint32_t i = 0; i < j->nodes; i++)
        if (j->at[i] == node)
            return i;
    return SD_NO_NODE;
}

/* the registration of name that node reported (NULL: none) */
static struct coord_job *coord_job_reported(struct sd_cluster *cl, const char *name, uint32_t node)
{
    for (struct coord_job *j = cl->track.jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0 && coord_job_node_of(j, node) != SD_NO_NODE)
            return j;
    return NULL;
}

static bool coord_tag_live(const struct sd_cluster *cl, uint32_t tag)
{
    for (const struct coord_live *l = cl->track.live; l; l = l->next)
        if (l->tag == tag)
            return true;
    return false;
}

/* does a confirmed job of name carry that token? */
static bool coord_live_token(const struct sd_cluster *cl, const char *name, const uint8_t *token,
                             uint32_t len)
{
    for (const struct coord_live *l = cl->track.live; l; l = l->next)
        if (strcmp(l->name, name) == 0 && same_token(l->token, l->token_len, token, len))
            return true;
    return false;
}

static bool coord_name_live(const struct sd_cluster *cl, const char *name)
{
    for (const struct coord_live *l = cl->track.live; l; l = l->next)
        if (strcmp(l->name, name) == 0)
            return true;
    return false;
}

bool sd_cluster__coord_member(const struct sd_cluster *cl, const char *name, uint32_t node)
{
    bool known = false;
    for (const struct coord_live *l = cl->track.live; l; l = l->next) {
        if (strcmp(l->name, name) != 0)
            continue;
        known = true;
        for (uint32_t i = 0; i < l->nodes; i++)
            if (l->at[i] == node)
                return true;
    }
    for (const struct coord_job *j = cl->track.jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0 && coord_job_node_of(j, node) != SD_NO_NODE &&
            (!known || coord_live_token(cl, name, j->token, j->token_len)))
            return true; /* it reported a registration of that name (the running one's secret) */
    return !known;
}

bool sd_cluster__coord_hears(const struct sd_cluster *cl, const char *name, int node,
                             const char *what, uint64_t *logged_ms)
{
    if (node >= 0 && sd_cluster__coord_member(cl, name, (uint32_t)node))
        return true;
    if (SD_LOG_WARN <= sd_log_level && sd_log_ratelimit(logged_ms, 5000))
        sd_log_write(SD_LOG_WARN, "cluster", "node %d is not a node of job '%s': its %s dropped",
                     node, name, what);
    return false;
}

bool sd_cluster__coord_relays(const struct sd_cluster *cl, int from, const char *name, uint32_t to)
{
    if (from >= 0 && sd_cluster__coord_member(cl, name, (uint32_t)from) &&
        sd_cluster__coord_member(cl, name, to))
        return true;
    SD_WARN_SPARSE("cluster",
                   "node %d asked to relay a message of job '%s' to node %u, and they are not "
                   "both its nodes: dropped",
                   from, name, to);
    return false;
}

const char *sd_cluster__relayed_job(const Shard__PeerMsg *m)
{
    switch (m->msg_case) {
    case SHARD__PEER_MSG__MSG_JOB_READY:
        return m->job_ready->job;
    case SHARD__PEER_MSG__MSG_JOB_SAVED:
        return m->job_saved->job;
    case SHARD__PEER_MSG__MSG_JOB_SAVE_DONE:
        return m->job_save_done->job;
    case SHARD__PEER_MSG__MSG_JOB_RECOVER:
        return m->job_recover->job;
    default:
        return NULL;
    }
}

/* the job of that name ended everywhere: its tag is free (the oldest of the name's) */
void sd_cluster__live_end(struct sd_cluster *cl, const char *name)
{
    struct coord_live **last = NULL;
    for (struct coord_live **pp = &cl->track.live; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->name, name) == 0)
            last = pp;
    if (last != NULL) {
        struct coord_live *l = *last;
        *last = l->next;
        free(l->at);
        free(l);
    }
}

static void coord_refuse_strangers(struct sd_cluster *cl, const char *name);

/* why a node whose ranks gave a job token of len bytes is not one of the job's */
static const char *stranger_why(uint32_t len)
{
    return len ? "whose ranks gave another job secret than this node's "
                 "(shard_model_t.job_secret)"
               : "whose ranks gave a job secret, and this node's none "
                 "(shard_model_t.job_secret)";
}

/* The decision on j, told to the nodes that reported it, and to also (SD_NO_NODE: none), a
 * node whose report could not be part of it and which j does not list. */
static void coord_decide(struct sd_cluster *cl, struct coord_job *j, uint32_t also)
{
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    Shard__JobConfirm c = SHARD__JOB_CONFIRM__INIT;
    Shard__JobRefuse r = SHARD__JOB_REFUSE__INIT;
    /* a tag no active job uses */
    uint32_t tag = 0;
    for (uint32_t tries = 0; j->status == SD_OK && tag == 0; tries++) {
        if (tries == (1u << SD_TAG_JOB_BITS) - 1) {
            j->status = SD_EBUSY;
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': every one of the %u transport tags is in use by a job of the "
                     "cluster",
                     j->name, (1u << SD_TAG_JOB_BITS) - 1);
            break;
        }
        cl->track.next_tag = (uint16_t)(cl->track.next_tag % ((1u << SD_TAG_JOB_BITS) - 1) + 1);
        bool busy = j->busy[cl->track.next_tag / 8] & (1u << (cl->track.next_tag % 8));
        if (!busy && !cl->ev.tag_in_use(cl->ev.ctx, cl->track.next_tag) &&
            !coord_tag_live(cl, cl->track.next_tag))
            tag = cl->track.next_tag;
    }
    if (j->status == SD_OK) {
        struct coord_live *live = calloc(1, sizeof(*live));
        if (live != NULL && (live->at = malloc(j->nodes * sizeof(*live->at))) != NULL) {
            snprintf(live->name, sizeof(live->name), "%s", j->name);
            memcpy(live->token, j->token, j->token_len);
            live->token_len = j->token_len;
            live->tag = tag;
            live->nodes = j->nodes;
            memcpy(live->at, j->at, j->nodes * sizeof(*live->at));
            live->next = cl->track.live;
            cl->track.live = live;
        } else { /* (without: the tag may be reused while the job runs) */
            free(live);
        }
        c.job = j->name;
        c.tag = tag;
        c.nodes = j->at;
        c.n_nodes = j->nodes;
        m.msg_case = SHARD__PEER_MSG__MSG_JOB_CONFIRM;
        m.job_confirm = &c;
    } else {
        r.job = j->name;
        r.status = j->status;
        r.message = j->msg;
        m.msg_case = SHARD__PEER_MSG__MSG_JOB_REFUSE;
        m.job_refuse = &r;
    }
    bool here = also == cl->self;
    if (also != SD_NO_NODE && !here)
        sd_cluster__send_to(cl, also, &m);
    for (uint32_t i = 0; i < j->nodes; i++) {
        if (j->at[i] == cl->self)
            here = true;
        else if (j->at[i] != SD_NO_NODE)
            sd_cluster__send_to(cl, j->at[i], &m);
    }
    if (here && j->status == SD_OK)
        cl->ev.job_confirmed(cl->ev.ctx, j->name, c.tag, j->at, j->nodes);
    else if (here)
        cl->ev.job_refused(cl->ev.ctx, j->name, j->status, j->msg);
    bool confirmed = j->status == SD_OK;
    char name[64];
    snprintf(name, sizeof(name), "%s", j->name);
    coord_job_free(cl, j);
    if (confirmed) {
        coord_refuse_strangers(cl, name);
        sd_cluster__peer_links(cl, sd_now_ns()); /* a member that decided it: its peers' links */
    }
}

/* The job of name was confirmed: the registrations of that name whose reports carry another
 * job token (another secret, or none) are nodes without the job's secret: refused, and said. */
static void coord_refuse_strangers(struct sd_cluster *cl, const char *name)
{
    for (struct coord_job *j = cl->track.jobs, *next; j; j = next) {
        next = j->next;
        if (strcmp(j->name, name) != 0)
            continue;
        char nodes[128] = "";
        for (uint32_t i = 0, off = 0; i < j->nodes && off < sizeof(nodes); i++)
            if (j->at[i] != SD_NO_NODE)
                off += (uint32_t)snprintf(nodes + off, sizeof(nodes) - off, "%s%u", off ? ", " : "",
                                          j->at[i]);
        SD_WARN("cluster",
                "job '%s': node(s) %s registered it with %s job secret than its nodes: not "
                "nodes of the job, refused",
                name, nodes, j->token_len ? "another" : "no");
        j->status = SD_EPERM;
        snprintf(j->msg, sizeof(j->msg), "job '%s' runs on other nodes, %s", name,
                 stranger_why(j->token_len));
        coord_decide(cl, j, SD_NO_NODE);
        next = cl->track.jobs; /* the list changed: start over (each pass removes one) */
    }
}

/* the first mismatch between a report and the job's first one, in j->msg */
static void coord_check(struct coord_job *j, const Shard__JobReport *rep, uint32_t k)
{
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

/* A report of a job that runs with another job token (another secret, or none): that node is
 * not one of its nodes; refused, and said. */
static void coord_refuse_stranger(struct sd_cluster *cl, const Shard__JobReport *rep)
{
    SD_WARN("cluster",
            "job '%s': node %u registered it with %s job secret than the nodes it runs on: not "
            "a node of the job, refused",
            rep->job, rep->node, rep->job_token.len ? "another" : "no");
    if (rep->status != SD_OK)
        return; /* its registration failed there already */
    char msg[256];
    snprintf(msg, sizeof(msg), "job '%s' runs on other nodes, %s", rep->job,
             stranger_why((uint32_t)rep->job_token.len));
    Shard__JobRefuse r = SHARD__JOB_REFUSE__INIT;
    r.job = rep->job;
    r.status = SD_EPERM;
    r.message = msg;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_REFUSE;
    m.job_refuse = &r;
    if (rep->node == cl->self)
        cl->ev.job_refused(cl->ev.ctx, rep->job, SD_EPERM, msg);
    else
        sd_cluster__send_to(cl, rep->node, &m);
}

/* A node reported its part of a job: the job's node it is comes from its ranks (job_node =
 * rank / ranks_per_node), so that any cluster nodes can serve a job, in any order. */
void sd_cluster__coord_report(struct sd_cluster *cl, const Shard__JobReport *rep)
{
    uint32_t k = rep->ranks_per_node ? rep->ranks_per_node : (uint32_t)cl->cfg->ranks_per_node;
    uint32_t nodes = k ? rep->world / k : 0;
    if (rep->node >= cl->n || nodes < 2 || nodes > cl->n)
        return; /* (a job of one node registers there alone) */
    if (coord_name_live(cl, rep->job) &&
        !coord_live_token(cl, rep->job, rep->job_token.data, (uint32_t)rep->job_token.len)) {
        coord_refuse_stranger(cl, rep);
        return;
    }
    struct coord_job *j = coord_job_find(cl, rep->job, &rep->job_token, true, nodes);
    if (j == NULL || coord_job_node_of(j, rep->node) != SD_NO_NODE)
        return; /* (out of memory; or this node reported already) */
    uint32_t jn = rep->job_node;
    if (jn >= j->nodes) {
        if (j->status == SD_OK) {
            j->status = SD_EMISMATCH;
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': node %u serves ranks %u..%u, beyond the %u nodes of world %u "
                     "(every node of the job must register the same world and ranks per node)",
                     rep->job, rep->node, jn * k, jn * k + k - 1, j->nodes, j->world);
        }
        coord_decide(cl, j, rep->node);
        return;
    }
    if (j->at[jn] != SD_NO_NODE) {
        if (j->status == SD_OK) {
            j->status = SD_EMISMATCH;
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': nodes %u and %u both registered ranks %u..%u (rank / "
                     "ranks_per_node %u): each node of a job serves its own ranks",
                     rep->job, j->at[jn], rep->node, jn * k, jn * k + k - 1, k);
        }
        coord_decide(cl, j, rep->node);
        return;
    }
    j->at[jn] = rep->node;
    j->reported++;
    for (size_t i = 0; i < rep->n_busy_tags;
         i++) /* (a job that outlived a coordinator's restart) */
        if (rep->busy_tags[i] < (1u << SD_TAG_JOB_BITS))
            j->busy[rep->busy_tags[i] / 8] |= (uint8_t)(1u << (rep->busy_tags[i] % 8));
    if (j->reported == 1) {
        j->digest = rep->digest;
        j->world = rep->world;
        j->ranks_per_node = k;
        j->start_step = rep->start_step;
        j->resumed = rep->resumed;
        j->first = rep->node;
    }
    if (j->status == SD_OK)
        coord_check(j, rep, k);
    if (j->reported == j->nodes || j->status != SD_OK)
        coord_decide(cl, j, SD_NO_NODE);
}

void sd_cluster__coord_report_from(struct sd_cluster *cl, int from, const Shard__JobReport *rep)
{
    if (from >= 0 && rep->node == (uint32_t)from) {
        sd_cluster__coord_report(cl, rep);
        return;
    }
    SD_WARN_SPARSE("cluster",
                   "node %d reported job '%.64s' as node %u: dropped (a node reports its own "
                   "registrations)",
                   from, rep->job, rep->node);
}

bool sd_cluster__coord_abort_heard(struct sd_cluster *cl, int from, const Shard__JobAbort *a)
{
    static uint64_t logged;
    if (!sd_cluster__coord_hears(cl, a->job, from, "abort of the job", &logged))
        return false;
    if (a->origin != (uint32_t)from) {
        SD_WARN_SPARSE("cluster",
                       "node %d sent an abort of job '%.64s' as node %u: dropped (a node aborts "
                       "for itself)",
                       from, a->job, a->origin);
        return false;
    }
    /* a name no confirmed job has is every node's to report (how registrations start), not to
     * end: an abort without a tag (a registration's) comes from a node that reported it */
    if (a->tag != 0 || coord_name_live(cl, a->job) ||
        coord_job_reported(cl, a->job, (uint32_t)from) != NULL)
        return true;
    SD_WARN_SPARSE("cluster",
                   "node %d sent an abort of job '%.64s', whose registration it has not reported: "
                   "dropped",
                   from, a->job);
    return false;
}

void sd_cluster__coord_sweep(struct sd_cluster *cl, uint64_t now)
{
    for (struct coord_job *j = cl->track.jobs, *next; j; j = next) {
        next = j->next;
        bool dead = false;
        for (uint32_t i = 0; i < j->nodes; i++)
            dead |= j->at[i] != SD_NO_NODE && j->at[i] != cl->self && !cl->alive[j->at[i]];
        if (now < j->deadline_ns && !dead)
            continue;
        char missing[256];
        size_t off = 0;
        missing[0] = '\0';
        for (uint32_t i = 0; i < j->nodes && off < sizeof(missing); i++)
            if (j->at[i] == SD_NO_NODE)
                off += (size_t)snprintf(missing + off, sizeof(missing) - off, "%s%u..%u",
                                        off ? ", " : "", i * j->ranks_per_node,
                                        (i + 1) * j->ranks_per_node - 1);
        j->status = SD_ETIMEDOUT;
        if (dead)
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': a node that registered part of it went down before ranks %s "
                     "registered",
                     j->name, missing);
        else if (cl->counts.refused > j->refused0 || cl->counts.evicted > j->evicted0)
            /* (their nodes may have: a flood kept their daemons' links out) */
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': ranks %s did not register on any node within %lld ms "
                     "(register_timeout_ms); meanwhile this daemon refused %llu and evicted %llu "
                     "connections that proved no job at its peer port %u: if those ranks did "
                     "register, their daemons could not reach it (a flood, or another job "
                     "secret there?)",
                     j->name, missing, (long long)cl->cfg->register_timeout_ms,
                     (unsigned long long)(cl->counts.refused - j->refused0),
                     (unsigned long long)(cl->counts.evicted - j->evicted0), cl->me.peer_port);
        else
            snprintf(j->msg, sizeof(j->msg),
                     "job '%s': ranks %s did not register on any node within %lld ms "
                     "(register_timeout_ms)",
                     j->name, missing, (long long)cl->cfg->register_timeout_ms);
        coord_decide(cl, j, SD_NO_NODE);
    }
}

/* ---- coordinator: a job ends when the ranks of all its nodes left */

static void coord_left_free(struct coord_left *l)
{
    free(l->at);
    free(l->seen);
    free(l);
}

static struct coord_left *coord_left_new(struct sd_cluster *cl, const char *name,
                                         const uint32_t *ids, uint32_t n)
{
    struct coord_left *l = calloc(1, sizeof(*l));
    if (l == NULL || (l->seen = calloc(n, 1)) == NULL ||
        (l->at = malloc(n * sizeof(*l->at))) == NULL) {
        if (l != NULL)
            coord_left_free(l);
        return NULL;
    }
    snprintf(l->name, sizeof(l->name), "%s", name);
    memcpy(l->at, ids, n * sizeof(*ids));
    l->nodes = n;
    l->next = cl->track.lefts;
    cl->track.lefts = l;
    sd_cluster__left_mark_down(cl, l);
    return l;
}

void sd_cluster__left_mark(struct coord_left *l, uint32_t node)
{
    for (uint32_t i = 0; i < l->nodes; i++)
        if (l->at[i] == node && !l->seen[i]) {
            l->seen[i] = 1;
            l->left++;
        }
}

void sd_cluster__left_mark_down(const struct sd_cluster *cl, struct coord_left *l)
{
    for (uint32_t i = 0; i < l->nodes; i++)
        if (l->at[i] != cl->self && cl->ready && (l->at[i] >= cl->n || !cl->alive[l->at[i]]))
            sd_cluster__left_mark(l, l->at[i]);
}

struct coord_left *sd_cluster__left_note(struct sd_cluster *cl, const char *name, uint32_t node,
                                         const uint32_t *ids, uint32_t n)
{
    if (n == 0 || n > cl->n)
        return NULL;
    struct coord_left *l;
    for (l = cl->track.lefts; l; l = l->next)
        if (strcmp(l->name, name) == 0)
            break;
    if (l == NULL && (l = coord_left_new(cl, name, ids, n)) == NULL)
        return NULL;
    sd_cluster__left_mark(l, node);
    return l;
}

void sd_cluster__left_drop(struct sd_cluster *cl, struct coord_left *l)
{
    for (struct coord_left **pp = &cl->track.lefts; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    coord_left_free(l);
}

/* node (a cluster node) left the job whose nodes are ids */
void sd_cluster__coord_left(struct sd_cluster *cl, const char *name, uint32_t node,
                            const uint32_t *ids, uint32_t n)
{
    struct coord_left *l = sd_cluster__left_note(cl, name, node, ids, n);
    if (l == NULL || l->left < l->nodes)
        return;
    for (struct coord_left **pp = &cl->track.lefts; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    Shard__JobEnd e = SHARD__JOB_END__INIT;
    e.job = l->name;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_END;
    m.job_end = &e;
    bool here = false;
    for (uint32_t i = 0; i < l->nodes; i++) {
        here |= l->at[i] == cl->self;
        if (l->at[i] != cl->self && l->at[i] < cl->n && cl->alive[l->at[i]])
            sd_cluster__send_to(cl, l->at[i], &m);
    }
    char job[64];
    snprintf(job, sizeof(job), "%s", l->name);
    coord_left_free(l);
    sd_cluster__live_end(cl, job);
    if (here)
        cl->ev.job_ended(cl->ev.ctx, job);
}

bool sd_cluster_job_left(struct sd_cluster *cl, const char *job, const uint32_t *ids, uint32_t n)
{
    Shard__JobLeft jl = SHARD__JOB_LEFT__INIT;
    jl.job = (char *)job;
    jl.node = cl->self;
    jl.nodes = (uint32_t *)ids;
    jl.n_nodes = n;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_LEFT;
    m.job_left = &jl;
    if (cl->self == 0) { /* the members track it too (it may go before their ranks do) */
        for (uint32_t i = 0; i < n; i++)
            if (ids[i] != 0 && ids[i] < cl->n && cl->by_node[ids[i]] != NULL)
                sd_cluster__link_send(cl->by_node[ids[i]], &m);
        sd_cluster__coord_left(cl, job, 0, ids, n);
        return true;
    }
    /* a member tells its job peers on their direct links, and the coordinator; the job ends
     * here once every node left (or is down), whichever of them says so first. A peer up but
     * out of reach without the coordinator: the job ends here alone (the caller retires it) */
    bool coordinated = cl->alive[0] && cl->by_node[0] != NULL;
    bool reach = true;
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] != 0 && ids[i] != cl->self && ids[i] < cl->n && cl->alive[ids[i]] &&
            !sd_cluster__job_peer_up(cl, ids[i]))
            reach = false;
    if (!coordinated && !reach)
        return false;
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] != 0 && ids[i] != cl->self && sd_cluster__job_peer_up(cl, ids[i]))
            sd_cluster__link_send(cl->by_node[ids[i]], &m);
    if (coordinated)
        sd_cluster__link_send(cl->by_node[0], &m);
    sd_cluster__member_left(cl, job, cl->self, ids, n);
    return true;
}

void sd_cluster_report_job(struct sd_cluster *cl, const struct sd_job_report *jr)
{
    Shard__JobReport r = SHARD__JOB_REPORT__INIT;
    r.job = (char *)jr->job;
    r.node = cl->self;
    r.job_node = jr->job_node;
    r.digest = jr->digest;
    r.world = jr->world;
    r.ranks_per_node = jr->ranks_per_node;
    r.start_step = jr->start_step;
    r.resumed = jr->resumed;
    r.job_token.data = (uint8_t *)jr->token;
    r.job_token.len = jr->token_len;
    r.status = jr->status;
    r.message = (char *)(jr->msg ? jr->msg : "");
    uint32_t busy[1u << SD_TAG_JOB_BITS];
    r.busy_tags = busy;
    r.n_busy_tags = cl->ev.tags_in_use(cl->ev.ctx, busy, (uint32_t)(sizeof(busy) / sizeof(*busy)));
    if (cl->indep) { /* to the job's leader, which its ranks named */
        sd_meet__report(cl, &r, jr->leader);
        return;
    }
    /* the coordinator decides; without it, the member the job's name picks among those up */
    uint32_t decides =
        sd_cluster__coordinator_up(cl) ? 0 : sd_cluster__job_coordinator(cl, jr->job);
    if (decides != 0 && jr->status == SD_OK)
        SD_INFO("cluster", "job '%s' registers without the coordinator: node %u decides it",
                jr->job, decides);
    if (decides == cl->self) {
        sd_cluster__coord_report(cl, &r);
        return;
    }
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_REPORT;
    m.job_report = &r;
    if (decides == 0)
        sd_cluster__send_to(cl, 0, &m);
    else if (decides != SD_NO_NODE)
        sd_cluster__peer_send(cl, decides, &m);
}

void sd_cluster__coord_abort(struct sd_cluster *cl, const Shard__PeerMsg *m)
{
    const Shard__JobAbort *a = m->job_abort;
    /* the sender's registration of the name (another one of that name, whose reports carry
     * another job token, is not its to end) */
    struct coord_job *cj = coord_job_reported(cl, a->job, a->origin);
    /* the job's nodes as its sender knows them (of a confirmed job: those that are its nodes;
     * the receivers end only the job of the abort's tag); a registration given up (no tag)
     * goes to the nodes that reported it so far */
    bool live = coord_name_live(cl, a->job);
    for (uint32_t i = 0; i < a->n_nodes && (live || a->tag != 0); i++)
        if (a->nodes[i] != a->origin && a->nodes[i] != cl->self && a->nodes[i] < cl->n &&
            (!live || sd_cluster__coord_member(cl, a->job, a->nodes[i])))
            sd_cluster__send_to(cl, a->nodes[i], m);
    if (cj != NULL && (a->n_nodes == 0 || (!live && a->tag == 0)))
        for (uint32_t i = 0; i < cj->nodes; i++)
            if (cj->at[i] != SD_NO_NODE && cj->at[i] != a->origin && cj->at[i] != cl->self)
                sd_cluster__send_to(cl, cj->at[i], m);
    if (cj != NULL)
        coord_job_free(cl, cj);
}

void sd_cluster_abort_job(struct sd_cluster *cl, const struct sd_job_abort *ja)
{
    Shard__JobAbort a = SHARD__JOB_ABORT__INIT;
    a.job = (char *)ja->job;
    a.status = ja->status;
    a.message = (char *)ja->msg;
    a.origin = cl->self;
    a.tag = ja->tag;
    a.step = ja->step;
    a.nodes = (uint32_t *)ja->node_ids;
    a.n_nodes = ja->node_ids != NULL ? ja->nodes : 0;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_ABORT;
    m.job_abort = &a;
    if (cl->self == 0) {
        sd_cluster__coord_abort(cl, &m);
        return;
    }
    /* through the coordinator, in order with its decisions (a peer may not have its
     * confirmation yet); without it, a running job's nodes hear it on their direct links, and
     * a registration's goes to the member that decides it */
    if (sd_cluster__coordinator_up(cl)) {
        sd_cluster__send_to(cl, 0, &m);
        return;
    }
    if (ja->tag == 0) {
        uint32_t jc = sd_cluster__job_coordinator(cl, ja->job);
        if (jc == cl->self)
            sd_cluster__coord_abort(cl, &m);
        else if (jc != SD_NO_NODE)
            sd_cluster__peer_send(cl, jc, &m);
        return;
    }
    for (uint32_t i = 0; i < a.n_nodes; i++)
        sd_cluster__peer_send(cl, a.nodes[i], &m);
}

/* m to each of the job's nodes but this one */
static void send_to_job(struct sd_cluster *cl, const uint32_t *ids, uint32_t n,
                        const Shard__PeerMsg *m)
{
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] != cl->self)
            sd_cluster__send_to(cl, ids[i], m);
}

void sd_cluster_job_ready(struct sd_cluster *cl, const char *job, const uint32_t *ids, uint32_t n)
{
    Shard__JobReady r = SHARD__JOB_READY__INIT;
    r.job = (char *)job;
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_READY;
    m.job_ready = &r;
    send_to_job(cl, ids, n, &m);
}

void sd_cluster_job_saved(struct sd_cluster *cl, uint32_t to, const Shard__JobSaved *r)
{
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_SAVED;
    m.job_saved = (Shard__JobSaved *)r;
    sd_cluster__send_to(cl, to, &m);
}

void sd_cluster_job_save_done(struct sd_cluster *cl, const char *job, const uint32_t *ids,
                              uint32_t n, uint64_t seq, int status, const char *msg)
{
    Shard__JobSaveDone d = SHARD__JOB_SAVE_DONE__INIT;
    d.job = (char *)job;
    d.seq = seq;
    d.status = status;
    d.message = (char *)(msg ? msg : "");
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_SAVE_DONE;
    m.job_save_done = &d;
    send_to_job(cl, ids, n, &m);
}

void sd_cluster_job_recover(struct sd_cluster *cl, uint32_t node, const Shard__JobRecover *r)
{
    Shard__PeerMsg m = SHARD__PEER_MSG__INIT;
    m.msg_case = SHARD__PEER_MSG__MSG_JOB_RECOVER;
    m.job_recover = (Shard__JobRecover *)r;
    if (node < cl->n && cl->alive[node])
        sd_cluster__send_to(cl, node, &m);
}

/* a dead node's ranks have left every job; a job whose nodes are all down ends */
void sd_cluster__coord_node_down(struct sd_cluster *cl, uint32_t node)
{
    for (struct coord_live **pp = &cl->track.live; *pp;) {
        struct coord_live *l = *pp;
        bool up = false;
        for (uint32_t i = 0; i < l->nodes; i++)
            up |= l->at[i] == cl->self || (l->at[i] < cl->n && cl->alive[l->at[i]]);
        if (up) {
            pp = &l->next;
            continue;
        }
        *pp = l->next;
        free(l->at);
        free(l);
    }
    for (struct coord_left *l = cl->track.lefts, *next; l; l = next) {
        next = l->next;
        for (uint32_t i = 0; i < l->nodes; i++)
            if (l->at[i] == node) {
                sd_cluster__coord_left(cl, l->name, node, l->at, l->nodes);
                break;
            }
    }
}

void sd_cluster__coord_free(struct sd_cluster *cl)
{
    while (cl->track.jobs)
        coord_job_free(cl, cl->track.jobs);
    while (cl->track.lefts) {
        struct coord_left *l = cl->track.lefts;
        cl->track.lefts = l->next;
        coord_left_free(l);
    }
    while (cl->track.live) {
        struct coord_live *l = cl->track.live;
        cl->track.live = l->next;
        free(l->at);
        free(l);
    }
}

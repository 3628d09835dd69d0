/* A job's schedule on this node (DESIGN.md sections 3 and 7).
 *
 * Record: during the first step every fetch, release and push a local rank makes is appended
 * to its recording (arrays sized at registration). Check: when every local rank called step,
 * the ranks of each partition group must have made the same calls (else the job fails naming
 * the first differing position and the ranks); across nodes the recordings' digests travel
 * with the gradient norm (job_net.c). Freeze: the node's sequence is planned (common/schedule.c):
 * one pool place per gather, fixed offsets from the interval packer, prefetch issue positions.
 * Replay: each rank's calls are matched against the frozen sequence; a fetch uses its planned
 * place; gathers are issued ahead of the leading rank. A call off the schedule makes the rest
 * of the step on demand (first fit in the pool, rebuilt from what is resident), is counted and
 * logged (rate-limited), and the next step is recorded and frozen again. Data never depends on
 * the schedule: every fetch still checks the unit's weights generation. */
#include "job_module.h"
#include "job.h"
#include "schedule.h"
#include "session.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The schedule of a job on this node (schedule.h): only this file reads or writes it. */
struct sd_job_sched {
    enum sd_sched_state state;
    uint32_t cap;      /* calls recorded per rank and step at most */
    uint32_t *rec;     /* [k * cap] this step's calls per local rank */
    uint32_t *rec_len; /* [k] */
    bool overflow;     /* a rank made more calls than cap: not frozen */
    bool freeze_next;  /* the recording checked out: frozen when the step completes */
    bool deviated;     /* this step left the schedule: on demand until the step ends */
    uint64_t digest;   /* of this node's recording (0: not recording), exchanged between nodes */
    uint32_t n;        /* frozen calls per step */
    uint32_t *ops;     /* [cap] */
    struct sd_sched_plan plan;
    uint32_t *scratch;    /* the planner's */
    uint64_t *slot_bytes; /* [n_units] */
    uint64_t stride;      /* bytes between a unit's per-rank copies (no hierarchical gather) */
    struct sd_sched_params params; /* as planned (prefetch depth may be lowered to fit) */
    uint32_t *cursor;              /* [k] next position of each local rank */
    uint32_t lead;                 /* the furthest position a local rank reached this step */
    uint32_t *pf_next; /* [k] next gather to issue, per copy (one copy with the hierarchy) */
    bool in_prefetch;  /* a gather that completes at once must not re-enter */
    uint32_t want_iv;  /* the gather a fetch being served uses, else NONE */
    uint64_t want_off;
    uint64_t frozen_at_step;
    uint64_t freezes, invalidations, deviations, prefetches, prefetch_hits, waits, conflicts;
    uint64_t cpu_ns[2], fetches[2]; /* fetch handling: [0] not frozen, [1] frozen */
    uint64_t issue_ns[2];           /* of cpu_ns: starting gathers (the same work either way) */
    uint64_t issue_ns_in_call;      /* gather starts while a fetch call is timed */
    bool in_call;                   /* scheduled_op is timing a call */
    uint64_t allocs_frozen;         /* allocations made while serving calls on the schedule */
};

const char *sd_sched_state_name(enum sd_sched_state s)
{
    switch (s) {
    case SD_SCHED_RECORDING:
        return "recording";
    case SD_SCHED_FROZEN:
        return "frozen";
    case SD_SCHED_OFF:
        return "on-demand";
    }
    return "?";
}

uint64_t sd_thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline uint64_t unit_bytes(const struct sd_job *job, uint32_t u)
{
    return sd_unit_bytes(&job->layout.units[u]);
}

/* offset of a unit's copy for local slot lslot inside its planned place */
static inline uint64_t copy_off(const struct sd_job *job, const struct sd_unit_state *us)
{
    return (uint64_t)us->lslot * sd_round_up(unit_bytes(job, us->unit), SD_CACHELINE);
}

int sd_sched_alloc(struct sd_job *job)
{
    if (job->sched == NULL && (job->sched = calloc(1, sizeof(*job->sched))) == NULL)
        return SD_ENOMEM;
    struct sd_job_sched *sc = job->sched;
    uint32_t n_units = job->layout.n_units, k = job->k;
    int64_t cfg_cap = job->reg->cfg->schedule_max_ops;
    sc->cap = cfg_cap > 0 ? (uint32_t)cfg_cap : 64 * n_units + 256;
    sc->rec = calloc((size_t)k * sc->cap, sizeof(*sc->rec));
    sc->rec_len = calloc(k, sizeof(*sc->rec_len));
    sc->cursor = calloc(k, sizeof(*sc->cursor));
    sc->pf_next = calloc(k, sizeof(*sc->pf_next));
    sc->ops = calloc(sc->cap, sizeof(*sc->ops));
    sc->plan.iv = calloc(sc->cap, sizeof(*sc->plan.iv));
    sc->plan.iv_unit = calloc(sc->cap, sizeof(*sc->plan.iv_unit));
    sc->plan.occ = calloc(sc->cap, sizeof(*sc->plan.occ));
    sc->scratch = calloc(3 * (size_t)n_units + sc->cap, sizeof(*sc->scratch));
    sc->slot_bytes = calloc(n_units, sizeof(*sc->slot_bytes));
    if (!sc->rec || !sc->rec_len || !sc->cursor || !sc->pf_next || !sc->ops || !sc->plan.iv ||
        !sc->plan.iv_unit || !sc->plan.occ || !sc->scratch || !sc->slot_bytes)
        return SD_ENOMEM;
    for (uint32_t u = 0; u < n_units; u++)
        sc->slot_bytes[u] = job->slots_per_unit * sd_round_up(unit_bytes(job, u), SD_CACHELINE);
    for (uint32_t i = 0; i < job->n_slots; i++)
        job->cache.units[i].plan_iv = SD_SCHED_NONE;
    sc->state = SD_SCHED_RECORDING;
    sc->want_iv = SD_SCHED_NONE;
    return SD_OK;
}

void sd_sched_free(struct sd_job *job)
{
    struct sd_job_sched *sc = job->sched;
    if (sc == NULL)
        return;
    free(sc->rec);
    free(sc->rec_len);
    free(sc->cursor);
    free(sc->pf_next);
    free(sc->ops);
    free(sc->plan.iv);
    free(sc->plan.iv_unit);
    free(sc->plan.occ);
    free(sc->scratch);
    free(sc->slot_bytes);
    sc->rec = sc->ops = sc->plan.iv_unit = sc->plan.occ = sc->scratch = NULL;
    sc->rec_len = sc->cursor = sc->pf_next = NULL;
    sc->plan.iv = NULL;
    sc->slot_bytes = NULL;
}

static uint32_t entry_of(const struct sd_sqe *e)
{
    enum sd_sched_op op = e->op == SD_OP_FETCH     ? SD_SCHED_FETCH
                          : e->op == SD_OP_RELEASE ? SD_SCHED_RELEASE
                                                   : SD_SCHED_PUSH;
    return sd_sched_entry(op, e->unit);
}

/* Leave the schedule for the rest of this step: the first-fit list is rebuilt from what is
 * resident or in flight, and the next step is recorded again. */
static void deviate(struct sd_job *job, const char *why)
{
    struct sd_job_sched *sc = job->sched;
    sc->deviated = true;
    sc->invalidations++;
    SD_WARN_SPARSE("sched",
                   "job '%s' step %llu: %s; fetching on demand for the rest of the step and "
                   "recording a new schedule (%llu invalidations so far)",
                   job->name, (unsigned long long)job->steps + 1, why,
                   (unsigned long long)sc->invalidations);
    job->cache.spool.n_used = 0;
    for (uint32_t i = 0; i < job->n_slots; i++) {
        struct sd_unit_state *us = &job->cache.units[i];
        us->plan_iv = SD_SCHED_NONE;
        if (us->resident || us->inflight)
            sd_slot_pool_take(&job->cache.spool, us->pool_off, unit_bytes(job, us->unit));
    }
}

void sd_sched_aside(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    struct sd_job_sched *sc = job->sched;
    sc->want_iv = SD_SCHED_NONE; /* placed as on demand */
    if (sc->state != SD_SCHED_FROZEN || sc->deviated)
        return;
    char why[96];
    snprintf(why, sizeof(why), "rank %u fetched unit %u aside (outside the schedule)", s->rank,
             e->unit);
    deviate(job, why);
}

static void describe_entry(char *out, size_t len, uint32_t entry)
{
    snprintf(out, len, "%s unit %u", sd_sched_op_name(sd_sched_op_of(entry)),
             sd_sched_unit_of(entry));
}

uint32_t sd_sched_before(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e)
{
    struct sd_job_sched *sc = job->sched;
    sc->want_iv = SD_SCHED_NONE;
    if (sc->state != SD_SCHED_FROZEN || sc->deviated)
        return SD_SCHED_NONE;
    uint32_t entry = entry_of(e), c = sc->cursor[s->local];
    if (c >= sc->n || sc->ops[c] != entry) {
        char got[48], want[48], why[192];
        describe_entry(got, sizeof(got), entry);
        if (c < sc->n)
            describe_entry(want, sizeof(want), sc->ops[c]);
        else
            snprintf(want, sizeof(want), "step");
        snprintf(why, sizeof(why), "rank %u called %s at position %u where the schedule has %s",
                 s->rank, got, c, want);
        deviate(job, why);
        return SD_SCHED_NONE;
    }
    if (e->op != SD_OP_FETCH)
        return c;
    uint32_t I = sc->plan.occ[c];
    struct sd_unit_state *us = sd_job_slot(job, e->unit, s->local);
    uint64_t off = sc->plan.iv[I].off + copy_off(job, us);
    if ((us->resident || us->inflight) && us->pool_off == off && us->gen == job->weights_gen)
        sc->prefetch_hits++; /* already there (prefetched, reused or persistent) */
    else if (us->resident && !us->inflight && us->refs == 0 && us->pool_off != off)
        sd_unit_cache_evict(&job->cache, us); /* cached elsewhere: gather it again into its place */
    sc->want_iv = I;
    sc->want_off = off;
    return c;
}

bool sd_sched_after(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint32_t pos,
                    bool consumed)
{
    struct sd_job_sched *sc = job->sched;
    uint64_t want_off = sc->want_off;
    uint32_t want_iv = sc->want_iv;
    bool on_schedule = pos != SD_SCHED_NONE && !sc->deviated;
    sc->want_iv = SD_SCHED_NONE;
    if (!consumed) {
        sc->waits += on_schedule && !s->has_stalled; /* once per call, not per retry */
        return on_schedule;
    }
    if (sc->state == SD_SCHED_RECORDING) {
        if (sc->rec_len[s->local] < sc->cap)
            sc->rec[(size_t)s->local * sc->cap + sc->rec_len[s->local]++] = entry_of(e);
        else
            sc->overflow = true;
    }
    if (!on_schedule)
        return false;
    sc->cursor[s->local] = pos + 1;
    if (pos + 1 > sc->lead)
        sc->lead = pos + 1;
    if (e->op == SD_OP_FETCH && want_iv != SD_SCHED_NONE) {
        struct sd_unit_state *us = sd_job_slot(job, e->unit, s->local);
        if ((us->resident || us->inflight) && us->pool_off == want_off)
            us->plan_iv = want_iv;
    }
    sd_sched_prefetch(job);
    return true;
}

/* does copy us, cached or in flight, lie in [off, off + len)? */
static bool occupies(const struct sd_job *job, const struct sd_unit_state *us, uint64_t off,
                     uint64_t len)
{
    return (us->resident || us->inflight) && us->pool_off < off + len &&
           off < us->pool_off + unit_bytes(job, us->unit);
}

/* true if no copy but self lies in [off, off + len) */
static bool place_empty(const struct sd_job *job, const struct sd_unit_state *self, uint64_t off,
                        uint64_t len)
{
    for (uint32_t i = 0; i < job->n_slots; i++)
        if (&job->cache.units[i] != self && occupies(job, &job->cache.units[i], off, len))
            return false;
    return true;
}

/* Make [off, off + len) free of cached copies. SD_EAGAIN while a copy the plan placed there is
 * still held or being gathered (a slower rank), SD_EBUSY if a copy off the plan is. */
static int claim(struct sd_job *job, uint64_t off, uint64_t len)
{
    for (uint32_t i = 0; i < job->n_slots; i++) {
        struct sd_unit_state *us = &job->cache.units[i];
        if (!occupies(job, us, off, len))
            continue;
        if (us->inflight || us->refs > 0)
            return us->plan_iv == SD_SCHED_NONE ? SD_EBUSY : SD_EAGAIN;
        sd_unit_cache_evict(&job->cache, us);
    }
    return SD_OK;
}

int sd_sched_reserve(struct sd_job *job, uint64_t bytes, uint64_t *off_p)
{
    struct sd_job_sched *sc = job->sched;
    if (sc->want_iv == SD_SCHED_NONE || sc->deviated)
        return SD_ENOENT;
    int st = claim(job, sc->want_off, bytes);
    if (st == SD_EAGAIN)
        return SD_EAGAIN;
    if (st == SD_EBUSY) {
        sc->conflicts++;
        deviate(job, "a unit held outside the planned places is in the way");
        return SD_ENOENT;
    }
    *off_p = sc->want_off;
    return SD_OK;
}

/* Gather copy l of gather I into its place; SD_EAGAIN to retry later. */
static int issue(struct sd_job *job, uint32_t I, uint32_t l)
{
    struct sd_job_sched *sc = job->sched;
    uint32_t u = sc->plan.iv_unit[I];
    struct sd_unit_state *us = &job->cache.units[(size_t)u * job->slots_per_unit + l];
    uint64_t off = sc->plan.iv[I].off + copy_off(job, us);
    if (us->inflight)
        return SD_OK; /* a fetch or a refresh is gathering it */
    if (us->resident && us->pool_off == off && us->gen == job->weights_gen) {
        us->plan_iv = I;
        return SD_OK;
    }
    if (us->resident && us->refs > 0)
        return SD_OK; /* held where it is: its fetch sorts it out */
    if (us->resident)
        sd_unit_cache_evict(&job->cache, us);
    const struct sd_sched_driver *drv = job->reg->sched_driver;
    if (claim(job, off, unit_bytes(job, u)) != SD_OK &&
        (!drv->fenced_poll(job) || claim(job, off, unit_bytes(job, u)) != SD_OK)) {
        drv->fenced_blocked(job); /* a stream may still read the place: polled */
        return SD_EAGAIN;
    }
    us->pool_off = off;
    int st = drv->prefetch(job, us);
    if (st == SD_EAGAIN)
        return SD_EAGAIN;
    if (st != SD_OK)
        return SD_OK; /* the job failed; nothing more to issue */
    us->plan_iv = I;
    sc->prefetches++;
    return SD_OK;
}

void sd_sched_prefetch(struct sd_job *job)
{
    struct sd_job_sched *sc = job->sched;
    const struct sd_sched_driver *drv = job->reg->sched_driver;
    if (sc->state != SD_SCHED_FROZEN || sc->deviated || job->state != SD_JOB_READY ||
        drv->step_running(job) || sc->in_prefetch)
        return;
    sc->in_prefetch = true;
    /* one copy per node follows the leading rank; per-rank copies follow their rank */
    for (uint32_t l = 0; l < job->slots_per_unit; l++) {
        uint32_t lead = job->slots_per_unit > 1 ? sc->cursor[l] : sc->lead;
        if (lead == 0)
            continue; /* the step's first call starts it: nothing for a step that never comes */
        while (sc->pf_next[l] < sc->plan.n_iv && sc->plan.iv[sc->pf_next[l]].start <= lead) {
            if (issue(job, sc->pf_next[l], l) != SD_OK)
                break;
            sc->pf_next[l]++;
        }
        /* coalescing: the next gathers of small consecutive units leave with the open batch,
         * ahead of their planned issue, when their places hold nothing */
        while (job->gnodes[SD_STATE_W] > 1 && sc->pf_next[l] < sc->plan.n_iv) {
            uint32_t I = sc->pf_next[l], u = sc->plan.iv_unit[I];
            struct sd_unit_state *us = &job->cache.units[(size_t)u * job->slots_per_unit + l];
            uint64_t off = sc->plan.iv[I].off + copy_off(job, us);
            if (us->inflight || (us->resident && us->refs > 0) ||
                !drv->would_join(job, u, us->lslot) ||
                !place_empty(job, us, off, unit_bytes(job, u)) || issue(job, I, l) != SD_OK)
                break;
            sc->pf_next[l]++;
        }
    }
    drv->flush(job); /* small units issued together travel together */
    sc->in_prefetch = false;
}

/* the local rank this one's calls must equal: the first of its partition group on this node */
static uint32_t group_reference(const struct sd_job *job, uint32_t local)
{
    struct sd_group grp = sd_group_partition(job->plan.f[SD_STATE_W], job->first_rank + local);
    for (uint32_t i = 0; i < grp.count; i++) {
        uint32_t m = sd_group_member(&grp, i);
        if (m >= job->first_rank && m - job->first_rank < job->k)
            return m - job->first_rank;
    }
    return local;
}

/* first position where two recordings differ, or UINT32_MAX */
static uint32_t first_difference(const struct sd_job_sched *sc, uint32_t a, uint32_t b)
{
    const uint32_t *x = &sc->rec[(size_t)a * sc->cap], *y = &sc->rec[(size_t)b * sc->cap];
    uint32_t n = SD_MIN(sc->rec_len[a], sc->rec_len[b]);
    for (uint32_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return i;
    return sc->rec_len[a] == sc->rec_len[b] ? UINT32_MAX : n;
}

static void call_at(const struct sd_job_sched *sc, uint32_t r, uint32_t pos, char *out, size_t len)
{
    if (pos < sc->rec_len[r])
        describe_entry(out, len, sc->rec[(size_t)r * sc->cap + pos]);
    else
        snprintf(out, len, "step (after %u calls)", sc->rec_len[r]);
}

bool sd_sched_step_check(struct sd_job *job)
{
    struct sd_job_sched *sc = job->sched;
    if (sc->state == SD_SCHED_FROZEN && !sc->deviated) {
        for (uint32_t r = 0; r < job->k; r++)
            if (sc->cursor[r] != sc->n) {
                char why[160];
                snprintf(why, sizeof(why),
                         "rank %u called step at position %u of a %u-call schedule",
                         job->first_rank + r, sc->cursor[r], sc->n);
                deviate(job, why);
                break;
            }
        return true;
    }
    if (sc->state != SD_SCHED_RECORDING)
        return true;
    if (sc->overflow) {
        SD_WARN("sched",
                "job '%s': a rank made more than %u fetch/release/push calls in step %llu; "
                "the schedule is not recorded (raise schedule_max_ops), fetching on demand",
                job->name, sc->cap, (unsigned long long)job->steps + 1);
        sc->state = SD_SCHED_OFF;
        return true;
    }
    bool groups_differ = false;
    for (uint32_t r = 0; r < job->k; r++) {
        uint32_t ref = group_reference(job, r);
        uint32_t pos = first_difference(sc, ref, r);
        if (ref != r && pos != UINT32_MAX) {
            char a[64], b[64];
            call_at(sc, ref, pos, a, sizeof(a));
            call_at(sc, r, pos, b, sizeof(b));
            sd_job_fail(job, SD_EMISMATCH,
                        "schedule: ranks %u and %u of one partition group made different calls "
                        "in step %llu: at call %u rank %u made %s, rank %u made %s (they must "
                        "make the same calls)",
                        job->first_rank + ref, job->first_rank + r,
                        (unsigned long long)job->steps + 1, pos, job->first_rank + ref, a,
                        job->first_rank + r, b);
            return false;
        }
        groups_differ |= first_difference(sc, 0, r) != UINT32_MAX;
    }
    if (groups_differ) { /* legal, but one node schedule cannot serve both */
        SD_INFO("sched",
                "job '%s': the partition groups on this node make different calls; fetching on "
                "demand",
                job->name);
        sc->state = SD_SCHED_OFF;
        return true;
    }
    sc->digest = sd_sched_digest(sc->rec, sc->rec_len[0]);
    sc->freeze_next = true;
    return true;
}

bool sd_sched_check_node(struct sd_job *job, uint32_t m, const struct sd_norm_part *part)
{
    struct sd_job_sched *sc = job->sched;
    uint32_t me = job->node;
    if (!sc->freeze_next || m == me || part->digest == 0 || part->digest == sc->digest)
        return true;
    sd_job_fail(job, SD_EMISMATCH,
                "schedule: node %u and node %u of one partition group recorded different calls "
                "in step %llu (%llu vs %llu calls, digests %016llx vs %016llx): every rank of a "
                "partition group must fetch, release and push the same units in the same order",
                me, m, (unsigned long long)job->steps + 1, (unsigned long long)sc->rec_len[0],
                (unsigned long long)part->n, (unsigned long long)sc->digest,
                (unsigned long long)part->digest);
    return false;
}

static void freeze(struct sd_job *job)
{
    struct sd_job_sched *sc = job->sched;
    const struct sd_config *cfg = job->reg->cfg;
    sc->n = sc->rec_len[0];
    memcpy(sc->ops, sc->rec, sc->n * sizeof(*sc->ops));
    sc->params = (struct sd_sched_params){.prefetch_depth = (uint32_t)cfg->prefetch_depth,
                                          .prefetch_bytes = cfg->prefetch_bytes,
                                          .reuse_distance = (uint32_t)cfg->reuse_distance,
                                          .persist_bytes = cfg->persist_bytes,
                                          .align = SD_CACHELINE};
    uint64_t all = 0;
    for (uint32_t u = 0; u < job->layout.n_units; u++)
        all += sc->slot_bytes[u];
    if (all <= job->cache.spool.capacity) /* the pool holds every unit: nothing is gathered twice */
        sc->params.reuse_distance = UINT32_MAX;
    for (;;) {
        int st = sd_sched_plan_build(sc->ops, sc->n, sc->slot_bytes, job->layout.n_units,
                                     &sc->params, &sc->plan, sc->scratch);
        if (st != SD_OK) {
            SD_WARN("sched", "job '%s': the schedule could not be planned: %s; on demand",
                    job->name, sd_status_str(st));
            sc->state = SD_SCHED_OFF;
            return;
        }
        if (sc->plan.peak <= job->cache.spool.capacity)
            break;
        if (sc->params.prefetch_depth > 0) {
            sc->params.prefetch_depth--; /* less ahead, less live */
        } else if (sc->params.persist_bytes > 0) {
            sc->params.persist_bytes = 0;
        } else {
            char b1[32], b2[32];
            SD_WARN("sched",
                    "job '%s': the planned gather pool (%s) exceeds its %s (max_live_bytes); "
                    "fetching on demand",
                    job->name, sd_fmt_bytes(b1, sizeof(b1), sc->plan.peak),
                    sd_fmt_bytes(b2, sizeof(b2), job->cache.spool.capacity));
            sc->state = SD_SCHED_OFF;
            return;
        }
    }
    for (uint32_t i = 0; i < job->n_slots; i++)
        job->cache.units[i].plan_iv = SD_SCHED_NONE;
    sc->state = SD_SCHED_FROZEN;
    sc->freezes++;
    sc->frozen_at_step = job->steps;
    char b1[32], b2[32], b3[32];
    SD_INFO("sched",
            "job '%s': schedule frozen after step %llu: %u calls, %u gathers, prefetch depth %u, "
            "pool peak %s (lower bound %s, pool %s)",
            job->name, (unsigned long long)job->steps, sc->n, sc->plan.n_iv,
            sc->params.prefetch_depth, sd_fmt_bytes(b1, sizeof(b1), sc->plan.peak),
            sd_fmt_bytes(b2, sizeof(b2), sc->plan.lower_bound),
            sd_fmt_bytes(b3, sizeof(b3), job->cache.spool.capacity));
}

void sd_sched_step_done(struct sd_job *job)
{
    struct sd_job_sched *sc = job->sched;
    if (sc->rec == NULL)
        return;
    if (sc->state == SD_SCHED_RECORDING && sc->freeze_next)
        freeze(job);
    else if (sc->state == SD_SCHED_FROZEN && sc->deviated)
        sc->state = SD_SCHED_RECORDING;
    sc->deviated = sc->freeze_next = sc->overflow = false;
    sc->digest = 0;
    sc->lead = 0;
    for (uint32_t r = 0; r < job->k; r++)
        sc->rec_len[r] = sc->cursor[r] = sc->pf_next[r] = 0;
    /* the first call of the next step starts the prefetch: after the last step nothing is
     * gathered that nobody fetches */
}

void sd_sched_destroy(struct sd_job *job)
{
    sd_sched_free(job);
    free(job->sched);
    job->sched = NULL;
}

/* ---- what others see of it */

/* a job whose schedule was never allocated reads as a fresh one */
static const struct sd_job_sched *view(const struct sd_job *job)
{
    static const struct sd_job_sched fresh = {.state = SD_SCHED_RECORDING};
    return job->sched != NULL ? job->sched : &fresh;
}

uint64_t sd_sched_call_begin(struct sd_job *job, bool fetch)
{
    job->sched->in_call = fetch; /* its answer, if at once, is timed here */
    return job->sched->issue_ns_in_call;
}

void sd_sched_call_end(struct sd_job *job, bool fetch, bool frozen, bool consumed, uint64_t allocs,
                       uint64_t cpu0, uint64_t issue0)
{
    struct sd_job_sched *sc = job->sched;
    sc->in_call = false;
    if (frozen)
        sc->allocs_frozen += allocs;
    if (fetch) {
        sc->cpu_ns[frozen] += sd_thread_cpu_ns() - cpu0;
        sc->issue_ns[frozen] += sc->issue_ns_in_call - issue0;
        sc->fetches[frozen] += consumed;
    }
}

uint64_t sd_sched_issue_clock(const struct sd_job *job)
{
    return job->sched != NULL && job->sched->in_call ? sd_thread_cpu_ns() : 0;
}

void sd_sched_issue_count(struct sd_job *job, uint64_t t0)
{
    if (job->sched != NULL && job->sched->in_call)
        job->sched->issue_ns_in_call += sd_thread_cpu_ns() - t0;
}

bool sd_sched_answer_begin(const struct sd_job *job, uint64_t *cpu0_p)
{
    if (job->sched == NULL || job->sched->in_call)
        return false;
    *cpu0_p = sd_thread_cpu_ns();
    return true;
}

void sd_sched_answer_end(struct sd_job *job, uint64_t cpu0)
{
    struct sd_job_sched *sc = job->sched;
    sc->cpu_ns[sc->state == SD_SCHED_FROZEN && !sc->deviated] += sd_thread_cpu_ns() - cpu0;
}

void sd_sched_recorded(const struct sd_job *job, uint64_t *digest_p, uint64_t *n_p)
{
    const struct sd_job_sched *sc = view(job);
    *digest_p = sc->digest;
    *n_p = sc->rec_len != NULL ? sc->rec_len[0] : 0;
}

void sd_sched_stats_json(const struct sd_job *job, json_t *o)
{
    const struct sd_job_sched *sc = view(job);
    json_object_set_new(o, "allocations_while_frozen", json_integer((json_int_t)sc->allocs_frozen));
    json_object_set_new(o, "schedule", json_string(sd_sched_state_name(sc->state)));
    json_object_set_new(o, "schedule_invalidations", json_integer((json_int_t)sc->invalidations));
    json_object_set_new(o, "prefetches", json_integer((json_int_t)sc->prefetches));
}

void sd_sched_json(const struct sd_job *job, json_t *o)
{
    const struct sd_job_sched *sc = view(job);
    bool planned = sc->freezes > 0, arrays = planned && sc->ops != NULL; /* freed at the end */
    json_t *order = json_array(), *slots = json_array();
    for (uint32_t i = 0; arrays && i < sc->n; i++)
        json_array_append_new(order, json_pack("{s:s, s:i}", "op",
                                               sd_sched_op_name(sd_sched_op_of(sc->ops[i])), "unit",
                                               (int)sd_sched_unit_of(sc->ops[i])));
    for (uint32_t i = 0; arrays && i < sc->plan.n_iv; i++) {
        const struct sd_ival *iv = &sc->plan.iv[i];
        json_array_append_new(slots, json_pack("{s:i, s:I, s:I, s:i, s:i}", "unit",
                                               (int)sc->plan.iv_unit[i], "offset",
                                               (json_int_t)iv->off, "bytes", (json_int_t)iv->size,
                                               "issue", (int)iv->start, "end", (int)iv->end));
    }
    double cpu[2], issue[2];
    for (int i = 0; i < 2; i++) { /* microseconds per fetch */
        double n = (double)sc->fetches[i] * 1e3;
        cpu[i] = n > 0 ? (double)sc->cpu_ns[i] / n : 0.0;
        issue[i] = n > 0 ? (double)sc->issue_ns[i] / n : 0.0;
    }
    json_object_set_new(o, "state", json_string(sd_sched_state_name(sc->state)));
    json_object_set_new(o, "frozen_after_step",
                        json_integer((json_int_t)(planned ? sc->frozen_at_step : 0)));
    json_object_set_new(o, "calls_per_step", json_integer(planned ? (int)sc->n : 0));
    json_object_set_new(o, "prefetch_depth",
                        json_integer(planned ? (int)sc->params.prefetch_depth : 0));
    json_object_set_new(o, "prefetch_bytes", json_integer((json_int_t)sc->params.prefetch_bytes));
    json_object_set_new(o, "reuse_distance",
                        json_integer(sc->params.reuse_distance == UINT32_MAX
                                         ? -1
                                         : (int)sc->params.reuse_distance));
    json_object_set_new(o, "gathers_per_step", json_integer(planned ? (int)sc->plan.n_iv : 0));
    json_object_set_new(o, "pool_peak_bytes",
                        json_integer((json_int_t)(planned ? sc->plan.peak : 0)));
    json_object_set_new(o, "pool_lower_bound_bytes",
                        json_integer((json_int_t)(planned ? sc->plan.lower_bound : 0)));
    json_object_set_new(o, "freezes", json_integer((json_int_t)sc->freezes));
    json_object_set_new(o, "invalidations", json_integer((json_int_t)sc->invalidations));
    /* the gathers and the order: freed with the job's memory when it ends */
    json_object_set_new(o, "plan_kept", json_boolean(arrays));
    json_object_set_new(o, "persist_bytes", json_integer((json_int_t)sc->params.persist_bytes));
    json_object_set_new(o, "prefetches", json_integer((json_int_t)sc->prefetches));
    json_object_set_new(o, "prefetch_hits", json_integer((json_int_t)sc->prefetch_hits));
    json_object_set_new(o, "waits", json_integer((json_int_t)sc->waits));
    json_object_set_new(o, "conflicts", json_integer((json_int_t)sc->conflicts));
    json_object_set_new(o, "fetch_cpu_us_unfrozen", json_real(cpu[0]));
    json_object_set_new(o, "fetch_cpu_us_frozen", json_real(cpu[1]));
    json_object_set_new(o, "fetch_issue_cpu_us_unfrozen", json_real(issue[0]));
    json_object_set_new(o, "fetch_issue_cpu_us_frozen", json_real(issue[1]));
    json_object_set_new(o, "allocations_while_frozen",
                        sd_alloc_counted ? json_integer((json_int_t)sc->allocs_frozen)
                                         : json_null());
    json_object_set_new(o, "order", order);
    json_object_set_new(o, "slots", slots);
}

const struct sd_job_module sd_sched_module = {
    .name = "schedule", .destroy = sd_sched_destroy, .release = sd_sched_free};

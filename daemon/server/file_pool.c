/* The file pool (file_pool.h). */
#include "file_pool.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_THREADS 64

/* A task's items that idle workers help with (sd_file_pool_parallel), on the task's stack. */
struct section {
    struct section *next;
    void (*fn)(void *arg, uint32_t thread, uint64_t i);
    void *arg;
    uint64_t n;
    _Atomic uint64_t next_item;
    const struct sd_file_task *task; /* whose identity the helpers take */
    uint32_t want, joined;           /* (lock) threads it may have, threads it had (its own 1) */
    uint32_t inside;                 /* (lock) helpers running its items now */
};

struct worker {
    pthread_t tid;
    bool started;
    struct sd_file_pool *pool;
    struct sd_file_task *task; /* the one it runs (lock) */
    struct section *help;      /* the items it helps with (lock) */
};

/* the worker this thread is, NULL off the pool */
static _Thread_local struct worker *self;

struct sd_file_pool {
    uv_loop_t *loop;
    uv_async_t async;
    bool async_open; /* (lock) a worker may signal the loop */
    pthread_mutex_t lock;
    pthread_cond_t work;              /* a task was queued, or a uid's share freed up */
    pthread_cond_t idle;              /* a task ended */
    pthread_cond_t helped;            /* a helper left a section */
    struct sd_file_task *head, *tail; /* queued */
    struct sd_file_task *done;        /* ended, for the loop, newest first */
    struct section *sections;         /* tasks' items open to helpers */
    uint32_t threads, running, per_uid;
    bool stopping;
    struct worker w[MAX_THREADS];
};

/* (lock) the workers busy for uid: running its tasks or helping them */
static uint32_t uid_busy(const struct sd_file_pool *p, uid_t uid)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->threads; i++) {
        const struct worker *w = &p->w[i];
        n += (w->task != NULL && w->task->id.uid == uid) ||
             (w->help != NULL && w->help->task->id.uid == uid);
    }
    return n;
}

/* (lock) the first queued task whose uid has fewer than per_uid busy workers, unlinked */
static struct sd_file_task *pick(struct sd_file_pool *p)
{
    for (struct sd_file_task **pp = &p->head, *prev = NULL; *pp != NULL;
         prev = *pp, pp = &(*pp)->next) {
        struct sd_file_task *t = *pp;
        if (uid_busy(p, t->id.uid) >= p->per_uid)
            continue;
        *pp = t->next;
        if (p->tail == t)
            p->tail = prev;
        t->next = NULL;
        return t;
    }
    return NULL;
}

/* items from n: fn on each until none is left */
static void run_items(struct section *s, uint32_t thread)
{
    for (uint64_t i; (i = atomic_fetch_add(&s->next_item, 1)) < s->n;)
        s->fn(s->arg, thread, i);
}

/* (lock) a section with items left and room for a helper within its uid's share */
static struct section *pick_section(struct sd_file_pool *p)
{
    for (struct section *s = p->sections; s != NULL; s = s->next)
        if (s->joined < s->want && atomic_load(&s->next_item) < s->n &&
            uid_busy(p, s->task->id.uid) < p->per_uid)
            return s;
    return NULL;
}

/* (lock, taken and given back) help with s's items under its task's identity */
static void help(struct sd_file_pool *p, struct worker *w, struct section *s)
{
    uint32_t thread = s->joined++;
    s->inside++;
    w->help = s;
    pthread_mutex_unlock(&p->lock);
    struct sd_fsid saved;
    if (sd_fsid_enter(&s->task->id, &saved) == SD_OK) { /* else: the task's thread does them */
        run_items(s, thread);
        sd_fsid_leave(&saved);
    }
    pthread_mutex_lock(&p->lock);
    w->help = NULL;
    s->inside--;
    pthread_cond_broadcast(&p->helped);
    pthread_cond_broadcast(&p->work); /* the uid's share is free again */
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct sd_file_pool *p = w->pool;
    self = w;
    pthread_mutex_lock(&p->lock);
    while (!p->stopping) {
        struct sd_file_task *t = pick(p);
        if (t == NULL) {
            struct section *s = pick_section(p);
            if (s != NULL)
                help(p, w, s);
            else
                pthread_cond_wait(&p->work, &p->lock);
            continue;
        }
        w->task = t;
        p->running++;
        atomic_store(&t->started_ns, sd_now_ns());
        pthread_mutex_unlock(&p->lock);

        struct sd_fsid saved;
        t->status = sd_fsid_enter(&t->id, &saved);
        if (t->status == SD_OK) {
            t->fn(t);
            sd_fsid_leave(&saved);
        }

        pthread_mutex_lock(&p->lock);
        w->task = NULL;
        p->running--;
        t->next = p->done;
        p->done = t;
        pthread_cond_broadcast(&p->idle);
        pthread_cond_broadcast(&p->work); /* the uid's share is free again */
        if (p->async_open)
            uv_async_send(&p->async);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* the ended tasks' after, oldest first */
static void run_done(struct sd_file_task *t)
{
    struct sd_file_task *fifo = NULL;
    while (t != NULL) {
        struct sd_file_task *next = t->next;
        t->next = fifo;
        fifo = t;
        t = next;
    }
    while (fifo != NULL) {
        struct sd_file_task *next = fifo->next;
        fifo->next = NULL;
        fifo->after(fifo, fifo->status);
        fifo = next;
    }
}

static void async_cb(uv_async_t *a)
{
    struct sd_file_pool *p = a->data;
    pthread_mutex_lock(&p->lock);
    struct sd_file_task *done = p->done;
    p->done = NULL;
    pthread_mutex_unlock(&p->lock);
    run_done(done);
}

int sd_file_pool_start(struct sd_file_pool **pool_p, uv_loop_t *loop, uint32_t threads)
{
    struct sd_file_pool *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return SD_ENOMEM;
    p->loop = loop;
    p->threads = SD_MIN(SD_MAX(threads, 1), MAX_THREADS);
    p->per_uid = SD_MAX(p->threads / 2, 1);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->idle, &ca);
    pthread_condattr_destroy(&ca);
    pthread_cond_init(&p->helped, NULL);
    if (uv_async_init(loop, &p->async, async_cb) != 0) {
        free(p);
        return SD_ENOMEM;
    }
    p->async.data = p;
    p->async_open = true;
    for (uint32_t i = 0; i < p->threads; i++) {
        p->w[i].pool = p;
        p->w[i].started = pthread_create(&p->w[i].tid, NULL, worker_main, &p->w[i]) == 0;
        if (!p->w[i].started) {
            SD_ERROR("files", "starting file worker %u: %s", i, strerror(errno));
            p->threads = i;
            break;
        }
    }
    if (p->threads == 0) {
        sd_file_pool_stop(p, 0);
        return SD_ENOMEM;
    }
    *pool_p = p;
    return SD_OK;
}

void sd_file_pool_submit(struct sd_file_pool *p, struct sd_file_task *t)
{
    t->next = NULL;
    t->queued_ns = sd_now_ns();
    atomic_store(&t->started_ns, 0);
    t->status = SD_OK;
    pthread_mutex_lock(&p->lock);
    if (p->stopping) {
        pthread_mutex_unlock(&p->lock);
        t->after(t, SD_ECANCELED);
        return;
    }
    if (p->tail != NULL)
        p->tail->next = t;
    else
        p->head = t;
    p->tail = t;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->lock);
}

void sd_file_pool_parallel(struct sd_file_pool *p, uint32_t threads, uint64_t n,
                           void (*fn)(void *arg, uint32_t thread, uint64_t i), void *arg)
{
    struct worker *w = self;
    struct section s = {.fn = fn, .arg = arg, .n = n, .want = SD_MAX(threads, 1), .joined = 1};
    atomic_init(&s.next_item, 0);
    if (p == NULL || w == NULL || w->pool != p || w->task == NULL || s.want == 1 || n <= 1) {
        run_items(&s, 0); /* off the pool, or nothing to share */
        return;
    }
    s.task = w->task;
    pthread_mutex_lock(&p->lock);
    s.next = p->sections;
    p->sections = &s;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->lock);
    run_items(&s, 0);
    pthread_mutex_lock(&p->lock);
    struct section **pp = &p->sections;
    while (*pp != &s)
        pp = &(*pp)->next;
    *pp = s.next; /* no helper joins now */
    while (s.inside > 0)
        pthread_cond_wait(&p->helped, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

static void pool_free_cb(uv_handle_t *h)
{
    struct sd_file_pool *p = h->data;
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->idle);
    pthread_cond_destroy(&p->helped);
    free(p);
}

uint32_t sd_file_pool_stop(struct sd_file_pool *p, uint64_t wait_ms)
{
    if (p == NULL)
        return 0;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(wait_ms / 1000);
    until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&p->lock);
    p->stopping = true;
    struct sd_file_task *queued = p->head;
    p->head = p->tail = NULL;
    pthread_cond_broadcast(&p->work);
    while (p->running > 0 && pthread_cond_timedwait(&p->idle, &p->lock, &until) != ETIMEDOUT)
        ;
    uint32_t stuck = p->running;
    struct sd_file_task *done = p->done;
    p->done = NULL;
    p->async_open = false; /* a stuck task that ends later signals nobody */
    bool running[MAX_THREADS];
    for (uint32_t i = 0; i < p->threads; i++)
        running[i] = p->w[i].task != NULL;
    pthread_mutex_unlock(&p->lock);

    for (struct sd_file_task *t = queued, *next; t != NULL; t = next) {
        next = t->next;
        t->next = NULL;
        t->after(t, SD_ECANCELED);
    }
    run_done(done);
    for (uint32_t i = 0; i < p->threads; i++) {
        if (!p->w[i].started)
            continue;
        if (running[i])
            pthread_detach(p->w[i].tid); /* stuck: the process's exit ends it */
        else
            pthread_join(p->w[i].tid, NULL);
    }
    if (stuck > 0) {
        SD_WARN("files",
                "%u file tasks are still running after %llu ms (stuck in a filesystem): their "
                "threads and the memory they use are left to the process's exit",
                stuck, (unsigned long long)wait_ms);
        uv_close((uv_handle_t *)&p->async, NULL); /* the pool stays: the threads use it */
        return stuck;
    }
    uv_close((uv_handle_t *)&p->async, pool_free_cb);
    return 0;
}

json_t *sd_file_pool_json(struct sd_file_pool *p)
{
    if (p == NULL)
        return json_null();
    uint64_t now = sd_now_ns(), oldest = 0;
    uint32_t queued = 0;
    pthread_mutex_lock(&p->lock);
    for (struct sd_file_task *t = p->head; t != NULL; t = t->next)
        queued++;
    for (uint32_t i = 0; i < p->threads; i++)
        if (p->w[i].task != NULL) {
            uint64_t s = atomic_load(&p->w[i].task->started_ns);
            if (s != 0 && now > s)
                oldest = SD_MAX(oldest, now - s);
        }
    uint32_t running = p->running, threads = p->threads, per_uid = p->per_uid;
    pthread_mutex_unlock(&p->lock);
    return json_pack("{s:i, s:i, s:i, s:i, s:f}", "threads", (int)threads, "per_uid", (int)per_uid,
                     "running", (int)running, "queued", (int)queued, "oldest_running_ms",
                     (double)oldest / 1e6);
}

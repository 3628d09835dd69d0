/* The file pool (daemon/server/file_pool.c) alone, with a real loop and real threads: a task's
 * items shared with idle workers (sd_file_pool_parallel) run once each, on at most the threads
 * asked for, every one of them with the task's filesystem identity (setfsuid's answer, read on the
 * thread that runs the item); a user's task and its helpers stay within the user's half of the
 * pool, so another user's task starts while they run; off the pool the items run on the calling
 * thread; a pool stopped during a task's items lets them finish. Runs as root (the pool takes
 * users' identities, as shardd does). */
#include "file_pool.h"
#include "check.h"
#include "sd/status.h"
#include "sd/util.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <unistd.h>

#define MAX_ITEMS 400

struct items {
    uint64_t n;
    unsigned sleep_us;
    _Atomic uint32_t runs[MAX_ITEMS];
    _Atomic uint32_t thread_of[MAX_ITEMS];
    _Atomic int fsuid_of[MAX_ITEMS];
    _Atomic uint32_t inside, most_inside;
    pthread_t caller;
    _Atomic uint32_t on_caller; /* items run on the calling thread */
    _Atomic uint64_t first_ns, last_ns;
};

static void item(void *arg, uint32_t thread, uint64_t i)
{
    struct items *it = arg;
    uint32_t now = atomic_fetch_add(&it->inside, 1) + 1;
    for (uint32_t m = atomic_load(&it->most_inside);
         now > m && !atomic_compare_exchange_weak(&it->most_inside, &m, now);)
        ;
    uint64_t zero = 0;
    atomic_compare_exchange_strong(&it->first_ns, &zero, sd_now_ns());
    atomic_fetch_add(&it->runs[i], 1);
    atomic_store(&it->thread_of[i], thread);
    atomic_store(&it->fsuid_of[i], setfsuid((uid_t)-1)); /* the thread's, unchanged */
    atomic_fetch_add(&it->on_caller, pthread_equal(pthread_self(), it->caller) != 0);
    if (it->sleep_us > 0)
        usleep(it->sleep_us);
    atomic_store(&it->last_ns, sd_now_ns());
    atomic_fetch_sub(&it->inside, 1);
}

struct job {
    struct sd_file_task task;
    struct sd_file_pool *pool;
    uint32_t threads;
    struct items *it;
    uint64_t started_ns, ended_ns;
    int after_status;
    bool after_ran;
};

static void task_fn(struct sd_file_task *t)
{
    struct job *j = t->arg;
    j->started_ns = sd_now_ns();
    if (j->it != NULL) {
        j->it->caller = pthread_self();
        sd_file_pool_parallel(j->pool, j->threads, j->it->n, item, j->it);
    } else {
        usleep(20000);
    }
    j->ended_ns = sd_now_ns();
}

static void task_after(struct sd_file_task *t, int status)
{
    struct job *j = t->arg;
    j->after_status = status;
    j->after_ran = true;
}

static void submit(struct job *j, struct sd_file_pool *pool, uid_t uid, uint32_t threads,
                   struct items *it)
{
    *j = (struct job){.pool = pool, .threads = threads, .it = it};
    j->task = (struct sd_file_task){.fn = task_fn, .after = task_after, .arg = j};
    j->task.id = (struct sd_fsid){.uid = uid, .gid = uid};
    sd_file_pool_submit(pool, &j->task);
}

static void wait_after(uv_loop_t *loop, struct job **jobs, uint32_t n)
{
    uint64_t until = sd_now_ns() + 20000000000ull;
    for (bool all = false; !all && sd_now_ns() < until;) {
        uv_run(loop, UV_RUN_NOWAIT);
        all = true;
        for (uint32_t i = 0; i < n; i++)
            all = all && jobs[i]->after_ran;
        if (!all)
            usleep(1000);
    }
}

static struct items *new_items(uint64_t n, unsigned sleep_us)
{
    struct items *it = calloc(1, sizeof(*it));
    it->n = n;
    it->sleep_us = sleep_us;
    return it;
}

/* every item ran once, on a thread below threads, as uid */
static void check_items(const char *what, struct items *it, uint32_t threads, int uid)
{
    uint32_t once = 0, below = 0, as_uid = 0;
    for (uint64_t i = 0; i < it->n; i++) {
        once += atomic_load(&it->runs[i]) == 1;
        below += atomic_load(&it->thread_of[i]) < threads;
        as_uid += atomic_load(&it->fsuid_of[i]) == uid;
    }
    TH_CHECK(once == it->n, "%s: every item ran once (%u of %llu)", what, once,
             (unsigned long long)it->n);
    TH_CHECK(below == it->n, "%s: every item's thread below %u (%u of %llu)", what, threads, below,
             (unsigned long long)it->n);
    TH_CHECK(as_uid == it->n, "%s: every item ran with fsuid %d (%u of %llu)", what, uid, as_uid,
             (unsigned long long)it->n);
}

static uint32_t threads_used(struct items *it)
{
    uint64_t seen = 0;
    for (uint64_t i = 0; i < it->n; i++)
        seen |= 1ull << atomic_load(&it->thread_of[i]);
    return (uint32_t)__builtin_popcountll(seen);
}

int main(void)
{
    TH_CHECK(geteuid() == 0, "runs as root (the pool takes users' identities, as shardd does)");
    if (geteuid() != 0)
        return th_summary("test_file_pool");
    uv_loop_t loop;
    uv_loop_init(&loop);
    const uid_t alice = 4242, bob = 4343;

    /* off the pool: the calling thread alone */
    struct sd_file_pool *pool = NULL;
    TH_CHECK(sd_file_pool_start(&pool, &loop, 8) == SD_OK, "a pool of 8");
    struct items *off = new_items(50, 0);
    off->caller = pthread_self();
    sd_file_pool_parallel(pool, 8, off->n, item, off);
    check_items("off the pool", off, 1, (int)geteuid());
    TH_CHECK(atomic_load(&off->on_caller) == off->n, "off the pool: all on the calling thread (%u)",
             atomic_load(&off->on_caller));

    /* a task's items with idle workers helping, all as the task's user */
    struct items *shared = new_items(200, 1000);
    struct job a;
    struct job *ja[] = {&a};
    submit(&a, pool, alice, 4, shared);
    wait_after(&loop, ja, 1);
    TH_CHECK(a.after_ran && a.after_status == SD_OK, "the task ended: %d", a.after_status);
    check_items("helped", shared, 4, (int)alice);
    TH_CHECK(threads_used(shared) > 1 && atomic_load(&shared->most_inside) <= 4,
             "helped: %u threads took items, at most %u at once (up to 4)", threads_used(shared),
             atomic_load(&shared->most_inside));
    TH_CHECK(atomic_load(&shared->on_caller) > 0 && atomic_load(&shared->on_caller) < shared->n,
             "helped: the task's thread took %u of the items", atomic_load(&shared->on_caller));
    sd_file_pool_stop(pool, 5000);
    uv_run(&loop, UV_RUN_NOWAIT);

    /* a pool of 4: a user has 2 threads, its task and one helper; another user's task starts
     * while they run */
    TH_CHECK(sd_file_pool_start(&pool, &loop, 4) == SD_OK, "a pool of 4");
    struct items *capped = new_items(100, 2000);
    struct job b, c;
    struct job *jb[] = {&b, &c};
    submit(&b, pool, alice, 4, capped);
    submit(&c, pool, bob, 1, NULL);
    wait_after(&loop, jb, 2);
    TH_CHECK(b.after_ran && c.after_ran && b.after_status == SD_OK && c.after_status == SD_OK,
             "both tasks ended: %d %d", b.after_status, c.after_status);
    check_items("capped", capped, 2, (int)alice);
    TH_CHECK(atomic_load(&capped->most_inside) <= 2 && threads_used(capped) == 2,
             "capped: %u threads, at most %u at once (the user's half of 4)", threads_used(capped),
             atomic_load(&capped->most_inside));
    TH_CHECK(c.started_ns < b.ended_ns,
             "the other user's task started %.1f ms before the "
             "first one's items ended",
             ((double)b.ended_ns - (double)c.started_ns) / 1e6);

    /* stopped while a task's items run: they all run, the task's after comes */
    struct items *stopped = new_items(60, 2000);
    struct job d;
    submit(&d, pool, alice, 2, stopped);
    while (atomic_load(&stopped->first_ns) == 0)
        usleep(500);
    TH_CHECK(sd_file_pool_stop(pool, 10000) == 0, "the stop waited for the task");
    uv_run(&loop, UV_RUN_NOWAIT);
    TH_CHECK(d.after_ran && d.after_status == SD_OK, "its after came: %d", d.after_status);
    check_items("stopped", stopped, 2, (int)alice);

    uv_run(&loop, UV_RUN_DEFAULT);
    TH_CHECK(uv_loop_close(&loop) == 0, "the loop closes: nothing left open");
    free(off);
    free(shared);
    free(capped);
    free(stopped);
    return th_summary("test_file_pool");
}

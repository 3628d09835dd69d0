/* The progress engine (server.h): drains every session's ring and the transport, spinning
 * for poll_spin_us after the trainers' last request before it sleeps on the sessions' eventfds
 * and the fabric's wait fd. */
#include "net_service.h"
#include "jobs.h"
#include "registry.h"
#include "server.h"
#include "attach.h"
#include "session.h"
#include "transport/transport.h"
#include "sd/ring.h"
#include "sd/util.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

/* ---- progress: drain rings; spin while busy, then sleep on eventfds */

enum { DID_NET = 1, DID_RING = 2 };

/* one pass over the fabric and the rings: what moved (DID_NET, DID_RING) */
static int progress_once(struct sd_server *srv)
{
    int did = 0;
    if (srv->tp != NULL && srv->tp->ops->progress(srv->tp) > 0) {
        did |= DID_NET;
        srv->last_net_ns = sd_now_ns();
    }
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        if (sd_session_progress(s))
            did |= DID_RING;
    /* steps waiting for their device's queue: a query each (a completion wakes nothing) */
    if (sd_jobs_poll_queues(srv->reg, &srv->queue_waiting))
        did |= DID_RING;
    return did;
}

static void set_sleeping(struct sd_server *srv, uint32_t v)
{
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        atomic_store(&s->hdr->daemon_sleeping, v);
}

/* true if no ring holds a request the daemon could take now. Requests queued behind a stalled
 * one (a push whose unit's previous round still runs, a fetch waiting for pool space or
 * transfer resources) wait for what unblocks it: a completion, another client's request or a
 * timer, each of which wakes the loop. Counting them kept the daemon busy-polling for as long
 * as a client had more requests queued than it could start, which starved the other daemons
 * and the kernel's TCP on a shared host. */
static bool all_empty(struct sd_server *srv)
{
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        if (!s->broken && !s->has_stalled && !sd_ring_sq_empty(s->hdr))
            return false;
    return true;
}

static void wake(struct sd_server *srv);

/* a call waits for what the loop must look for itself (session.h, stall_polls) */
static bool any_stall_polls(struct sd_server *srv)
{
    for (struct sd_session *s = srv->sessions; s; s = s->next)
        if (!s->broken && s->has_stalled && s->stall_polls)
            return true;
    return false;
}

static void poll_timer_cb(uv_timer_t *h)
{
    struct sd_server *srv = h->data;
    if (progress_once(srv)) {
        wake(srv); /* it came: poll closely again */
        return;
    }
    if (!any_stall_polls(srv))
        uv_timer_stop(&srv->poll_timer);
}

/* the transport's wait fd, and the timer that re-polls the fabric every ms while transfers
 * wait for data */
struct sd_tp_watch {
    uv_poll_t poll;
    uv_timer_t timer;
    bool polling;
    int open; /* handles whose close callback has not run */
};

static void net_timer_cb(uv_timer_t *h)
{
    struct sd_server *srv = h->data;
    uint64_t before = srv->last_net_ns;
    sd_server_progress(srv);
    if (srv->last_net_ns != before)
        wake(srv); /* data moves again: poll closely */
    if (!sd_net_busy(srv->reg))
        uv_timer_stop(h);
}

static void idle_cb(uv_idle_t *h)
{
    struct sd_server *srv = h->data;
    uint64_t now = sd_now_ns();
    srv->polls++;
    int did = progress_once(srv);
    if (did) {
        for (int more = progress_once(srv); more; more = progress_once(srv))
            did |= more;
        if (did & DID_RING) /* poll_spin_us counts from the trainers' last request */
            srv->last_activity_ns = now;
        return;
    }
    if (now - srv->last_activity_ns < (uint64_t)srv->cfg->poll_spin_us * 1000)
        return;
    /* a step waits for kernels on a device: poll, yielding the core, until they are done */
    if (srv->queue_waiting) {
        sched_yield();
        return;
    }
    /* transfers in flight need progress calls (manual-progress providers such as ofi_rxm
     * advance a transfer one step per call): busy-poll with net_spin (cores to spare), poll
     * yielding the core for net_poll_us after the last completion, then sleep on the completion
     * queue's wait fd with a 1 ms re-poll. Spinning daemons that share cores with trainers and
     * other daemons (an emulated cluster) slow the transfers down: the default sleeps at once. */
    if (srv->tp != NULL) {
        bool busy = sd_net_busy(srv->reg);
        if (busy && srv->cfg->net_spin)
            return;
        if (busy && now - srv->last_net_ns < (uint64_t)srv->cfg->net_poll_us * 1000) {
            sched_yield();
            return;
        }
        if (!srv->tp->ops->can_sleep(srv->tp)) {
            sched_yield();
            return;
        }
        /* a transfer waits for data that is not there yet: sleep on the wait fd, and look
         * again every millisecond (providers with manual progress need the calls) */
        if (busy && !uv_is_active((uv_handle_t *)&srv->tw->timer))
            uv_timer_start(&srv->tw->timer, net_timer_cb, 1, 1);
    }
    /* a push waits for its gradient's signal on a fence page, which a device stream writes
     * with no event to wake the loop: look every millisecond until it comes (or the call's
     * deadline, op_timeout_ms, fails it) */
    if (any_stall_polls(srv) && !uv_is_active((uv_handle_t *)&srv->poll_timer))
        uv_timer_start(&srv->poll_timer, poll_timer_cb, 1, 1);
    /* go to sleep: announce it, then look once more (pairs with the client's fence) */
    set_sleeping(srv, 1);
    atomic_thread_fence(memory_order_seq_cst);
    if (!all_empty(srv)) {
        set_sleeping(srv, 0);
        return;
    }
    uv_idle_stop(&srv->idle);
    srv->spinning = false;
}

void sd_server_progress(struct sd_server *srv)
{
    while (progress_once(srv))
        ;
    /* a step began waiting for its device: the idle handle polls until the kernels are done */
    if (srv->queue_waiting && !srv->spinning && !srv->stopping) {
        srv->spinning = true;
        uv_idle_start(&srv->idle, idle_cb);
    }
}

/* Progress now, then keep polling from the idle handle until a pass finds nothing to do. The
 * fabric's wake-ups come here directly: spinning for poll_spin_us after each of them would
 * busy-poll through a whole transfer (data arrives continuously), taking the CPU that other
 * daemons and the kernel's TCP need on a shared host. */
static void wake(struct sd_server *srv)
{
    set_sleeping(srv, 0);
    sd_server_progress(srv);
    if (!srv->spinning && !srv->stopping) {
        srv->spinning = true;
        uv_idle_start(&srv->idle, idle_cb);
    }
}

/* A client's request: poll its ring for poll_spin_us more, for the next one. */
void sd_server_kick(struct sd_server *srv)
{
    srv->last_activity_ns = sd_now_ns();
    wake(srv);
}

static void tp_wake_cb(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    wake(h->data);
}

int sd_server_attach_transport(struct sd_server *srv, struct sd_transport *tp)
{
    struct sd_tp_watch *tw = calloc(1, sizeof(*tw));
    if (tw == NULL)
        return SD_ENOMEM;
    srv->tp = tp;
    srv->tw = tw;
    uv_timer_init(srv->loop, &tw->timer);
    tw->timer.data = srv;
    tw->open = 1;
    int fd = tp->ops->wait_fd(tp);
    if (fd >= 0 && uv_poll_init(srv->loop, &tw->poll, fd) == 0) {
        tw->poll.data = srv;
        uv_poll_start(&tw->poll, UV_READABLE, tp_wake_cb);
        tw->polling = true;
        tw->open++;
    }
    sd_server_kick(srv);
    return SD_OK;
}

static void tw_closed(uv_handle_t *h)
{
    struct sd_tp_watch *tw = h->data;
    if (--tw->open == 0)
        free(tw);
}

void sd_server_detach_transport(struct sd_server *srv)
{
    struct sd_tp_watch *tw = srv->tw;
    srv->tp = NULL;
    srv->tw = NULL;
    if (tw == NULL)
        return;
    if (tw->polling) {
        uv_poll_stop(&tw->poll);
        tw->poll.data = tw;
        uv_close((uv_handle_t *)&tw->poll, tw_closed);
    }
    uv_timer_stop(&tw->timer);
    tw->timer.data = tw;
    uv_close((uv_handle_t *)&tw->timer, tw_closed);
}

/* A client session's completions: what every operation answers on its ring (the session's
 * attachment, its ring's draining and its end are attach.c's). */
#include "job.h"
#include "session.h"
#include "sd/log.h"
#include "sd/status.h"
#include "sd/util.h"

#include <stdarg.h>
#include <stdio.h>

/* A client that corrupts its ring loses the session: its attachment reports it on the socket
 * and hangs up (link->broke). */
void sd_session_break(struct sd_session *s, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    s->broken = true;
    s->link->broke(s, text);
}

void sd_session_complete(struct sd_session *s, uint64_t tag, int op, int status, uint64_t v0,
                         uint64_t v1, const char *msg)
{
    if (s->job != NULL)
        sd_trace_call_done(&s->job->stats.trace, s->rank, tag, status, sd_now_ns());
    if (s->broken)
        return;
    struct sd_cqe e;
    e.tag = tag;
    e.status = status;
    e.op = (uint32_t)op;
    e.value0 = v0;
    e.value1 = v1;
    e.msg[0] = '\0';
    if (msg != NULL)
        snprintf(e.msg, sizeof(e.msg), "%s", msg);
    if (sd_ring_cq_push(s->hdr, &e) != 0) {
        sd_session_break(s,
                         "completion queue overflow: the client has more than %d requests "
                         "without reading their completions",
                         SD_RING_ENTRIES);
        return;
    }
    sd_ring_wake(&s->hdr->client_waiting, s->cq_efd);
}

void sd_session_fail(struct sd_session *s, const struct sd_sqe *e, int status, const char *fmt, ...)
{
    char text[SD_CQE_MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    if (s->job != NULL)
        sd_job_count_error(s->job);
    SD_DEBUG("session", "session %llu: %s failed: %s", (unsigned long long)s->id,
             sd_op_name((int)e->op), text);
    sd_session_complete(s, e->tag, (int)e->op, status, 0, 0, text);
}

void sd_op_done(struct sd_job *job, struct sd_session *s, const struct sd_sqe *e, uint64_t v0,
                uint64_t v1, uint64_t start_ns)
{
    job->stats.ops[e->op]++;
    sd_latency_add(&job->stats.lat[e->op], sd_now_ns() - start_ns);
    sd_session_complete(s, e->tag, (int)e->op, SD_OK, v0, v1, NULL);
}

int sd_session_send(struct sd_session *s, const Shard__DaemonMsg *msg, const int *fds,
                    unsigned nfds)
{
    return s->link->send(s, msg, fds, nfds);
}

int sd_session_send_error(struct sd_session *s, int status, const char *fmt, ...)
{
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    return s->link->send_error(s, status, text);
}

bool sd_session_hung_up(const struct sd_session *s)
{
    return s->link->hung_up(s);
}

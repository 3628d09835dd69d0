/* The metrics endpoint's connections (metrics.h): accept, read one request head, answer, close.
 * What it answers is the exposition metrics_text.c writes; the parsing is common/http.c's. */
#include "metrics.h"
#include "sd/http.h"
#include "sd/log.h"
#include "sd/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum conn_state { CONN_READING, CONN_WRITING, CONN_DRAINING };

#define SD_METRICS_DRAIN_MAX (64 * 1024) /* read after an answer, at most, before the close */

struct sd_metrics_conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wreq;
    uv_shutdown_t sreq;
    struct sd_metrics *m;
    struct sd_metrics_conn *next;
    enum conn_state state;
    int open_handles; /* freed when both handles closed */
    bool closing;
    char *out; /* the answer being written */
    size_t len;
    size_t drained; /* bytes read and dropped after the answer */
    char head[SD_HTTP_MAX_HEAD];
};

void sd_text_printf(struct sd_text *t, const char *fmt, ...)
{
    if (t->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->buf ? t->buf + t->len : NULL, t->buf ? t->cap - t->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = true;
            return;
        }
        if (t->buf != NULL && t->len + (size_t)n < t->cap) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = t->cap ? t->cap * 2 : 65536;
        while (cap < t->len + (size_t)n + 1)
            cap *= 2;
        char *b = realloc(t->buf, cap);
        if (b == NULL) {
            t->failed = true;
            return;
        }
        t->buf = b;
        t->cap = cap;
    }
}

void sd_text_append(struct sd_text *t, const void *data, size_t len)
{
    if (t->failed || len == 0)
        return;
    if (t->len + len + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 65536;
        while (cap < t->len + len + 1)
            cap *= 2;
        char *b = realloc(t->buf, cap);
        if (b == NULL) {
            t->failed = true;
            return;
        }
        t->buf = b;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, data, len);
    t->len += len;
    t->buf[t->len] = '\0';
}

static void conn_handle_closed(uv_handle_t *h)
{
    struct sd_metrics_conn *c = h->data;
    if (--c->open_handles == 0) {
        free(c->out);
        free(c);
    }
}

static void conn_close(struct sd_metrics_conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    struct sd_metrics *m = c->m;
    for (struct sd_metrics_conn **pp = &m->conns; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            m->n_conns--;
            break;
        }
    uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
}

static void on_deadline(uv_timer_t *t)
{
    struct sd_metrics_conn *c = t->data;
    c->m->timeouts++; /* (also one that took its answer and never closed its end) */
    conn_close(c);
}

static void drain_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    (void)hint;
    struct sd_metrics_conn *c = h->data;
    *buf = uv_buf_init(c->head, sizeof(c->head)); /* the head was parsed: its room is free */
}

/* after the answer and our FIN: read what the scraper still sends, until its end, so that the
 * close does not reset the connection under an answer it has not read yet */
static void on_drain(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    struct sd_metrics_conn *c = s->data;
    if (nread > 0)
        c->drained += (size_t)nread;
    /* (a scraper that goes on sending after its answer gets no more of the loop's time) */
    if (nread < 0 || c->drained > SD_METRICS_DRAIN_MAX)
        conn_close(c);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    struct sd_metrics_conn *c = req->data;
    if (c->closing)
        return;
    if (status != 0 || uv_read_start((uv_stream_t *)&c->tcp, drain_alloc, on_drain) != 0)
        conn_close(c);
}

static void on_written(uv_write_t *req, int status)
{
    struct sd_metrics_conn *c = req->data;
    free(c->out);
    c->out = NULL;
    if (c->closing)
        return;
    c->state = CONN_DRAINING;
    c->sreq.data = c;
    if (status != 0 || uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, on_shutdown) != 0)
        conn_close(c);
}

static void respond(struct sd_metrics_conn *c, int status, const char *content_type,
                    const char *extra_header, const char *body, size_t body_len, bool head_only)
{
    struct sd_text t = {0};
    sd_text_printf(&t,
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                   "Cache-Control: no-store\r\n%sConnection: close\r\n\r\n",
                   status, sd_http_reason(status), content_type, body_len,
                   extra_header ? extra_header : "");
    if (!head_only)
        sd_text_append(&t, body, body_len);
    if (t.failed) {
        free(t.buf);
        conn_close(c);
        return;
    }
    c->out = t.buf;
    c->len = t.len;
    c->state = CONN_WRITING;
    uv_timer_start(&c->timer, on_deadline, SD_METRICS_WRITE_MS, 0);
    c->wreq.data = c;
    uv_buf_t b = uv_buf_init(c->out, (unsigned)c->len);
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, on_written) != 0) {
        free(c->out);
        c->out = NULL;
        conn_close(c);
    }
}

static void respond_error(struct sd_metrics_conn *c, int status, const char *why, bool head_only)
{
    char body[300];
    int n = snprintf(body, sizeof(body), "%d %s: %s\n", status, sd_http_reason(status), why);
    c->m->bad_requests++;
    respond(c, status, "text/plain; charset=utf-8", status == 405 ? "Allow: GET, HEAD\r\n" : NULL,
            body, (size_t)n, head_only);
}

/* the endpoint's own families, after the daemon's */
static void own_metrics(const struct sd_metrics *m, struct sd_text *t)
{
    sd_text_printf(t,
                   "# HELP shardd_metrics_scrapes_total GET /metrics answered (this one "
                   "included).\n# TYPE shardd_metrics_scrapes_total counter\n"
                   "shardd_metrics_scrapes_total %llu\n"
                   "# HELP shardd_metrics_connections_refused_total Scraper connections closed "
                   "at accept or evicted while silent: the endpoint had %d open.\n"
                   "# TYPE shardd_metrics_connections_refused_total counter\n"
                   "shardd_metrics_connections_refused_total %llu\n"
                   "# HELP shardd_metrics_bad_requests_total Requests answered with an error "
                   "(malformed, not GET or HEAD, unknown path).\n"
                   "# TYPE shardd_metrics_bad_requests_total counter\n"
                   "shardd_metrics_bad_requests_total %llu\n"
                   "# HELP shardd_metrics_timeouts_total Scraper connections closed at a "
                   "deadline: no request head in 5 s, or an answer not taken in 10 s.\n"
                   "# TYPE shardd_metrics_timeouts_total counter\n"
                   "shardd_metrics_timeouts_total %llu\n",
                   (unsigned long long)m->scrapes, SD_METRICS_MAX_CONNS,
                   (unsigned long long)m->refused, (unsigned long long)m->bad_requests,
                   (unsigned long long)m->timeouts);
}

static void answer(struct sd_metrics_conn *c, const struct sd_http_request *req)
{
    struct sd_metrics *m = c->m;
    if (req->status != 0) {
        respond_error(c, req->status, req->why, req->head);
        return;
    }
    if (strcmp(req->path, "/healthz") == 0) {
        respond(c, 200, "text/plain; charset=utf-8", NULL, "ok\n", 3, req->head);
        return;
    }
    if (strcmp(req->path, "/metrics") != 0) {
        respond_error(c, 404, "this endpoint answers /metrics and /healthz", req->head);
        return;
    }
    m->scrapes++;
    struct sd_text t = {0};
    m->fn(m->arg, &t);
    own_metrics(m, &t);
    if (t.failed) {
        free(t.buf);
        m->scrapes--;
        respond_error(c, 500, "out of memory writing the metrics", req->head);
        return;
    }
    respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, t.buf, t.len, req->head);
    free(t.buf);
}

static void head_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    (void)hint;
    struct sd_metrics_conn *c = h->data;
    *buf = uv_buf_init(c->head + c->len, (unsigned)(sizeof(c->head) - c->len));
}

static void on_head(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    struct sd_metrics_conn *c = s->data;
    if (nread < 0) { /* gone before a whole head */
        conn_close(c);
        return;
    }
    c->len += (size_t)nread;
    struct sd_http_request req;
    if (!sd_http_request_parse(c->head, c->len, &req))
        return;
    uv_read_stop(s);
    answer(c, &req);
}

/* the oldest connection still waiting for its head (the list is newest first), or NULL */
static struct sd_metrics_conn *oldest_silent(struct sd_metrics *m)
{
    struct sd_metrics_conn *found = NULL;
    for (struct sd_metrics_conn *c = m->conns; c; c = c->next)
        if (c->state == CONN_READING)
            found = c;
    return found;
}

static void reject_closed(uv_handle_t *h)
{
    free(h);
}

static void on_connection(uv_stream_t *server, int status)
{
    struct sd_metrics *m = server->data;
    if (status != 0)
        return;
    if (m->n_conns >= SD_METRICS_MAX_CONNS) {
        /* a flood of silent connections gives way to the newcomer; answers being written
         * are kept, and the newcomer is refused instead */
        struct sd_metrics_conn *old = oldest_silent(m);
        m->refused++;
        if (old != NULL) {
            conn_close(old);
        } else {
            uv_tcp_t *h = malloc(sizeof(*h));
            if (h == NULL)
                return;
            uv_tcp_init(m->loop, h);
            if (uv_accept(server, (uv_stream_t *)h) != 0)
                SD_WARN_SPARSE("metrics", "refusing a scraper: accept failed");
            uv_close((uv_handle_t *)h, reject_closed);
            SD_WARN_SPARSE("metrics", "refused a scraper: %d connections are open",
                           SD_METRICS_MAX_CONNS);
            return;
        }
    }
    struct sd_metrics_conn *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return;
    c->m = m;
    uv_tcp_init(m->loop, &c->tcp);
    uv_timer_init(m->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->open_handles = 2;
    c->next = m->conns;
    m->conns = c;
    m->n_conns++;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 ||
        uv_read_start((uv_stream_t *)&c->tcp, head_alloc, on_head) != 0) {
        conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    uv_timer_start(&c->timer, on_deadline, SD_METRICS_READ_MS, 0);
}

/* "host:port" or "[v6]:port", numeric, into *ss */
static int parse_listen(const char *s, struct sockaddr_storage *ss)
{
    char host[64];
    const char *colon;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':' || (size_t)(close - s - 1) >= sizeof(host))
            return SD_EINVAL;
        memcpy(host, s + 1, (size_t)(close - s - 1));
        host[close - s - 1] = '\0';
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL || (size_t)(colon - s) >= sizeof(host) || colon == s)
            return SD_EINVAL;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = '\0';
    }
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || port < 0 || port > 65535)
        return SD_EINVAL;
    if (s[0] == '[')
        return uv_ip6_addr(host, (int)port, (struct sockaddr_in6 *)ss) == 0 ? SD_OK : SD_EINVAL;
    return uv_ip4_addr(host, (int)port, (struct sockaddr_in *)ss) == 0 ? SD_OK : SD_EINVAL;
}

int sd_metrics_start(struct sd_metrics *m, uv_loop_t *loop, const char *listen, sd_metrics_fn fn,
                     void *arg, char *why, size_t why_len)
{
    memset(m, 0, sizeof(*m));
    m->loop = loop;
    m->fn = fn;
    m->arg = arg;
    if (listen == NULL || listen[0] == '\0')
        return SD_OK;
    struct sockaddr_storage ss = {0};
    if (parse_listen(listen, &ss) != SD_OK) {
        snprintf(why, why_len,
                 "metrics_listen '%s' is not a numeric address and port ('127.0.0.1:9464', "
                 "'0.0.0.0:9464', '[::1]:9464')",
                 listen);
        return SD_ECONFIG;
    }
    uv_tcp_init(loop, &m->listener);
    m->listener.data = m;
    int r = uv_tcp_bind(&m->listener, (const struct sockaddr *)&ss, 0);
    if (r == 0)
        r = uv_listen((uv_stream_t *)&m->listener, 128, on_connection);
    struct sockaddr_storage bound;
    int bl = sizeof(bound);
    if (r == 0)
        r = uv_tcp_getsockname(&m->listener, (struct sockaddr *)&bound, &bl);
    if (r != 0) {
        snprintf(why, why_len, "metrics_listen %s: %s", listen, uv_strerror(r));
        uv_close((uv_handle_t *)&m->listener, NULL);
        return SD_EIO;
    }
    char host[64] = "";
    int port;
    if (bound.ss_family == AF_INET6) {
        uv_ip6_name((struct sockaddr_in6 *)&bound, host, sizeof(host));
        port = ntohs(((struct sockaddr_in6 *)&bound)->sin6_port);
        snprintf(m->bound, sizeof(m->bound), "[%s]:%d", host, port);
    } else {
        uv_ip4_name((struct sockaddr_in *)&bound, host, sizeof(host));
        port = ntohs(((struct sockaddr_in *)&bound)->sin_port);
        snprintf(m->bound, sizeof(m->bound), "%s:%d", host, port);
    }
    m->listening = true;
    SD_INFO("metrics", "Prometheus metrics on http://%s/metrics", m->bound);
    return SD_OK;
}

void sd_metrics_stop(struct sd_metrics *m)
{
    if (m->listening) {
        uv_close((uv_handle_t *)&m->listener, NULL);
        m->listening = false;
    }
    while (m->conns != NULL)
        conn_close(m->conns);
}

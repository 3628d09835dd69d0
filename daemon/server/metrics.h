/* The metrics endpoint: Prometheus' text format over HTTP on metrics_listen (off by default),
 * answering GET /metrics and GET /healthz and nothing else. A scraper is a client like any
 * other: connections are bounded (SD_METRICS_MAX_CONNS; past it the new one is closed and
 * counted), a request head must arrive within SD_METRICS_READ_MS and an answer leave within
 * SD_METRICS_WRITE_MS, and every socket is non-blocking on the event loop, so a slow or
 * hostile scraper costs a connection slot and never a wait. */
#ifndef SD_METRICS_H
#define SD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define SD_METRICS_MAX_CONNS 16
#define SD_METRICS_READ_MS   5000
#define SD_METRICS_WRITE_MS  10000

/* A growing text buffer the exposition is written into. */
struct sd_text {
    char *buf;
    size_t len, cap;
    bool failed; /* out of memory: the answer is a 500 */
};
void sd_text_printf(struct sd_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sd_text_append(struct sd_text *t, const void *data, size_t len);

/* writes the exposition (every family but the endpoint's own) */
typedef void (*sd_metrics_fn)(void *arg, struct sd_text *out);

struct sd_metrics_conn;
struct sd_metrics {
    uv_loop_t *loop;
    uv_tcp_t listener;
    bool listening;
    char bound[80]; /* host:port it listens on, the port resolved ("" when off) */
    struct sd_metrics_conn *conns;
    uint32_t n_conns;
    sd_metrics_fn fn;
    void *arg;
    /* the endpoint's own counters, in the exposition */
    uint64_t scrapes;      /* GET /metrics answered */
    uint64_t refused;      /* connections closed at accept: SD_METRICS_MAX_CONNS were open */
    uint64_t bad_requests; /* answered 4xx/5xx */
    uint64_t timeouts;     /* closed at a deadline: no head, an answer unread or never closed */
};

/* Listens on listen ("host:port", "[v6]:port"; port 0 any free one) when it is not empty.
 * Returns SD_OK (also when off), or an error with why (the address and the reason). */
int sd_metrics_start(struct sd_metrics *m, uv_loop_t *loop, const char *listen, sd_metrics_fn fn,
                     void *arg, char *why, size_t why_len);
/* Closes the listener and every connection (their handles close with the loop's others). */
void sd_metrics_stop(struct sd_metrics *m);

#endif

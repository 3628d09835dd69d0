/* The little HTTP/1.x the metrics endpoint speaks (pure code: no socket here), and the escaping
 * of Prometheus' text exposition format. A request head is read whole, checked, and answered
 * once; the connection then closes (no keep-alive, no body, no chunking): a scraper needs no
 * more, and a hostile one gets nothing more to use. */
#ifndef SD_HTTP_H
#define SD_HTTP_H

#include <stdbool.h>
#include <stddef.h>

/* The longest request head (request line and headers) read; past it, 431. */
#define SD_HTTP_MAX_HEAD 8192

struct sd_http_request {
    bool head;       /* HEAD: the headers of GET's answer, no body */
    char path[256];  /* the target without its query ("/metrics") */
    int status;      /* 0: well formed; else the answer it gets (400, 405, 414, 431, 505) */
    const char *why; /* with status: what was wrong, for the answer's body */
    size_t head_len; /* bytes of the head, its blank line included */
};

/* Parses the request head at buf[0..len). Returns false while the head is incomplete (no blank
 * line yet) and shorter than SD_HTTP_MAX_HEAD; true once *req says what to answer: status 0
 * for a well-formed GET or HEAD of an origin-form target ("/path[?query]"), else the error to
 * answer. Any byte is handled: NULs, control characters, bare LFs (accepted as line ends, as
 * RFC 9112 allows), missing or foreign versions. */
bool sd_http_request_parse(const char *buf, size_t len, struct sd_http_request *req);

/* The reason phrase of an HTTP status this endpoint answers ("Not Found"), "" if unknown. */
const char *sd_http_reason(int status);

/* Writes s as a Prometheus label value (backslash, double quote and line feed escaped) into
 * out (at most len bytes with the NUL); returns the length it needed (as snprintf). */
size_t sd_prom_escape(char *out, size_t len, const char *s);

#endif

/* The metrics endpoint's request parser and label escaping (sd/http.h), against answers written
 * out here: well-formed GETs and HEADs (CRLF and bare LF, queries, headers), every error it
 * answers (400, 405, 414, 431, 505) with the head that earns it, heads cut anywhere (never
 * complete before their blank line), and random bytes (never a read past the buffer: run under
 * ASan; a "complete" answer only for a head that has its blank line or reached the cap). */
#include "check.h"
#include "sd/http.h"

#include <stdlib.h>
#include <string.h>

static void parse_ok(const char *head, bool want_head, const char *want_path)
{
    struct sd_http_request r;
    bool done = sd_http_request_parse(head, strlen(head), &r);
    TH_CHECK(done && r.status == 0 && r.head == want_head && strcmp(r.path, want_path) == 0 &&
                 r.head_len == strlen(head),
             "'%s': done %d status %d (%s) path '%s'", head, done, r.status, r.why ? r.why : "",
             r.path);
}

static void parse_err(const char *head, size_t len, int want)
{
    struct sd_http_request r;
    bool done = sd_http_request_parse(head, len, &r);
    TH_CHECK(done && r.status == want && r.why != NULL && r.why[0] != '\0',
             "'%.40s': done %d status %d, want %d", head, done, r.status, want);
}

static void parse_errs(const char *head, int want)
{
    parse_err(head, strlen(head), want);
}

/* every proper prefix of a complete head is incomplete */
static void prefixes(const char *head)
{
    struct sd_http_request r;
    size_t len = strlen(head), bad = 0;
    for (size_t i = 0; i < len; i++) {
        char *copy = malloc(i + 1); /* exactly i bytes readable: ASan sees a read past them */
        memcpy(copy, head, i);
        bad += sd_http_request_parse(copy, i, &r);
        free(copy);
    }
    TH_CHECK(bad == 0, "'%s': %zu prefixes said complete", head, bad);
}

static void escape(const char *in, const char *want)
{
    char out[64];
    size_t n = sd_prom_escape(out, sizeof(out), in);
    TH_CHECK(strcmp(out, want) == 0 && n == strlen(want), "escape '%s': '%s' (%zu)", in, out, n);
}

int main(void)
{
    parse_ok("GET /metrics HTTP/1.1\r\nHost: node1:9464\r\nAccept: text/plain\r\n\r\n", false,
             "/metrics");
    parse_ok("GET /metrics HTTP/1.0\r\n\r\n", false, "/metrics");
    parse_ok("HEAD /healthz HTTP/1.1\r\n\r\n", true, "/healthz");
    parse_ok("GET /metrics?name[]=x HTTP/1.1\n\n", false, "/metrics");
    parse_ok("GET / HTTP/1.1\r\nX-Tab:\ta\tb\r\n\r\n", false, "/");
    parse_ok("GET /metrics HTTP/1.1\r\nUser-Agent: Prometheus/2.53.0\r\nAccept: "
             "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3\r\n"
             "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n",
             false, "/metrics");
    /* a body or a second request after the head is not part of it */
    struct sd_http_request r;
    const char *two = "GET /healthz HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\n";
    TH_CHECK(sd_http_request_parse(two, strlen(two), &r) && r.status == 0 &&
                 strcmp(r.path, "/healthz") == 0 && r.head_len == 25,
             "pipelined: the first head (%zu bytes, '%s')", r.head_len, r.path);

    prefixes("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    prefixes("HEAD /healthz HTTP/1.0\n\n");

    parse_errs("POST /metrics HTTP/1.1\r\n\r\n", 405);
    parse_errs("DELETE / HTTP/1.1\r\n\r\n", 405);
    parse_errs("GET /metrics HTTP/2.0\r\n\r\n", 505);
    parse_errs("GET /metrics HTTP/1.10\r\n\r\n", 505);
    parse_errs("GET /metrics\r\n\r\n", 400);           /* HTTP/0.9 */
    parse_errs("GET  /metrics HTTP/1.1\r\n\r\n", 400); /* two spaces */
    parse_errs("GET metrics HTTP/1.1\r\n\r\n", 400);   /* not origin-form */
    parse_errs("GET http://x/metrics HTTP/1.1\r\n\r\n", 400);
    parse_errs("GET /met\x7frics HTTP/1.1\r\n\r\n", 400);
    parse_errs("\r\n\r\n", 400);
    parse_errs("GET /metrics HTTP/1.1\r\nNoColon\r\n\r\n", 400);
    parse_errs("GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n", 400);
    parse_errs("GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n", 400);
    parse_errs("GET /metrics HTTP/1.1\r\nX: a\x01z\r\n\r\n", 400);
    static const char nul[] = "GET /me\0trics HTTP/1.1\r\n\r\n";
    parse_err(nul, sizeof(nul) - 1, 400);
    static const char nul_method[] = "G\0T /metrics HTTP/1.1\r\n\r\n";
    parse_err(nul_method, sizeof(nul_method) - 1, 400);
    /* 256 bytes of path: 414; 255 fits */
    char longpath[400];
    snprintf(longpath, sizeof(longpath), "GET /%0255d HTTP/1.1\r\n\r\n", 0);
    parse_err(longpath, strlen(longpath), 414);
    snprintf(longpath, sizeof(longpath), "GET /%0254d HTTP/1.1\r\n\r\n", 0);
    TH_CHECK(sd_http_request_parse(longpath, strlen(longpath), &r) && r.status == 0 &&
                 strlen(r.path) == 255,
             "a 255-byte path: status %d", r.status);
    /* a head that reaches 8 KiB without its blank line: 431 (not a wait for more); one longer
     * than 8 KiB that has one: 431 */
    static char big[SD_HTTP_MAX_HEAD + 64];
    memset(big, 'a', sizeof(big));
    memcpy(big, "GET / HTTP/1.1\r\nX: ", 19);
    TH_CHECK(!sd_http_request_parse(big, SD_HTTP_MAX_HEAD - 1, &r), "8 KiB - 1: still reading");
    parse_err(big, SD_HTTP_MAX_HEAD, 431);
    memcpy(big + SD_HTTP_MAX_HEAD + 10, "\r\n\r\n", 4);
    parse_err(big, SD_HTTP_MAX_HEAD + 14, 431);

    /* random heads: done only with a blank line in them or at the cap, and never a crash */
    srand(7);
    int wrong = 0;
    for (int i = 0; i < 20000; i++) {
        size_t len = (size_t)(rand() % 96);
        char *buf = malloc(len + 1);
        static const char alphabet[] = "GET /HTP1.\r\n: \0\x01\x7f?a";
        for (size_t j = 0; j < len; j++)
            buf[j] = rand() % 4 ? alphabet[rand() % (sizeof(alphabet) - 1)] : (char)rand();
        bool blank = false;
        for (size_t j = 0; j + 1 < len; j++)
            blank |= buf[j] == '\n' && (buf[j + 1] == '\n' ||
                                        (j + 2 < len && buf[j + 1] == '\r' && buf[j + 2] == '\n'));
        bool done = sd_http_request_parse(buf, len, &r);
        wrong += done != blank || (done && r.status == 0 && r.path[0] != '/');
        free(buf);
    }
    TH_CHECK(wrong == 0, "%d random heads answered against their blank line", wrong);

    escape("mlp", "mlp");
    escape("a\"b", "a\\\"b");
    escape("back\\slash", "back\\\\slash");
    escape("two\nlines", "two\\nlines");
    char small[4];
    TH_CHECK(sd_prom_escape(small, sizeof(small), "a\"bc") == 5 && strcmp(small, "a\\\"") == 0,
             "a short buffer: '%s'", small);
    TH_CHECK(strcmp(sd_http_reason(431), "Request Header Fields Too Large") == 0 &&
                 sd_http_reason(999)[0] == '\0',
             "reasons");
    return th_summary("test_http");
}

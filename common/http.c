/* A request head parser for the metrics endpoint and Prometheus label escaping (sd/http.h). */
#include "sd/http.h"

#include <string.h>

static bool set_error(struct sd_http_request *req, int status, const char *why)
{
    req->status = status;
    req->why = why;
    return true;
}

/* the end of the head (just past its blank line), or 0: "\r\n\r\n" or bare "\n\n" mixes */
static size_t head_end(const char *buf, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        if (buf[i] != '\n')
            continue;
        size_t j = i + 1;
        if (j < len && buf[j] == '\r')
            j++;
        if (j < len && buf[j] == '\n')
            return j + 1;
    }
    return 0;
}

static bool tchar(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           (c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

bool sd_http_request_parse(const char *buf, size_t len, struct sd_http_request *req)
{
    memset(req, 0, sizeof(*req));
    size_t end = head_end(buf, len);
    if (end == 0) {
        if (len < SD_HTTP_MAX_HEAD)
            return false;
        return set_error(req, 431, "the request head is longer than 8 KiB");
    }
    if (end > SD_HTTP_MAX_HEAD)
        return set_error(req, 431, "the request head is longer than 8 KiB");
    req->head_len = end;
    /* the request line: METHOD SP target SP HTTP/1.x (CR) LF */
    const char *line_end = memchr(buf, '\n', end);
    size_t line_len = (size_t)(line_end - buf);
    if (line_len > 0 && buf[line_len - 1] == '\r')
        line_len--;
    size_t m = 0;
    while (m < line_len && tchar(buf[m]))
        m++;
    if (m == 0 || m >= line_len || buf[m] != ' ')
        return set_error(req, 400, "the request line is not 'METHOD /path HTTP/1.1'");
    const char *target = buf + m + 1;
    const char *sp = memchr(target, ' ', line_len - m - 1);
    if (sp == NULL)
        return set_error(req, 400, "the request line is not 'METHOD /path HTTP/1.1'");
    size_t target_len = (size_t)(sp - target);
    const char *version = sp + 1;
    size_t version_len = line_len - (size_t)(version - buf);
    if (version_len != 8 || memcmp(version, "HTTP/1.", 7) != 0 || version[7] < '0' ||
        version[7] > '9') {
        if (version_len >= 5 && memcmp(version, "HTTP/", 5) == 0)
            return set_error(req, 505, "only HTTP/1.x is spoken here");
        return set_error(req, 400, "the request line is not 'METHOD /path HTTP/1.1'");
    }
    /* the headers: each "name: value"; none is needed, but each must be well formed */
    for (const char *p = line_end + 1; p < buf + end;) {
        const char *e = memchr(p, '\n', (size_t)(buf + end - p));
        size_t l = (size_t)(e - p);
        if (l > 0 && p[l - 1] == '\r')
            l--;
        if (l == 0)
            break; /* the blank line */
        size_t n = 0;
        while (n < l && tchar(p[n]))
            n++;
        if (n == 0 || n >= l || p[n] != ':')
            return set_error(req, 400, "a header line is not 'Name: value'");
        for (size_t i = n + 1; i < l; i++)
            if ((unsigned char)p[i] < 0x20 && p[i] != '\t')
                return set_error(req, 400, "a header value holds a control character");
        p = e + 1;
    }
    if (target_len == 0 || target[0] != '/')
        return set_error(req, 400, "the target is not a path ('/metrics')");
    size_t path_len = target_len;
    const char *q = memchr(target, '?', target_len);
    if (q != NULL)
        path_len = (size_t)(q - target);
    for (size_t i = 0; i < target_len; i++)
        if ((unsigned char)target[i] <= 0x20 || (unsigned char)target[i] >= 0x7f)
            return set_error(req, 400, "the target holds a byte a URL cannot");
    if (path_len >= sizeof(req->path))
        return set_error(req, 414, "the path is longer than 255 bytes");
    memcpy(req->path, target, path_len);
    req->path[path_len] = '\0';
    if (m == 3 && memcmp(buf, "GET", 3) == 0)
        return true;
    if (m == 4 && memcmp(buf, "HEAD", 4) == 0) {
        req->head = true;
        return true;
    }
    return set_error(req, 405, "only GET and HEAD are answered");
}

const char *sd_http_reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 414:
        return "URI Too Long";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 503:
        return "Service Unavailable";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "";
    }
}

size_t sd_prom_escape(char *out, size_t len, const char *s)
{
    size_t n = 0;
    for (; *s; s++) {
        const char *rep = *s == '\\' ? "\\\\" : *s == '"' ? "\\\"" : *s == '\n' ? "\\n" : NULL;
        size_t k = rep ? 2 : 1;
        for (size_t i = 0; i < k; i++, n++)
            if (n + 1 < len)
                out[n] = rep ? rep[i] : *s;
    }
    if (len > 0)
        out[n < len ? n : len - 1] = '\0';
    return n;
}

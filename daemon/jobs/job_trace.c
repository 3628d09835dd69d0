/* A job's flight recorder written out (job_trace.h): the JSON document shardctl trace shows and
 * the dump a failed job leaves in <runtime_dir>/trace/. The records are sd/trace.h's ring. */
#include "job_trace.h"
#include "job.h"
#include "registry.h"
#include "coll/tag.h"
#include "sd/log.h"
#include "sd/ring.h"
#include "sd/status.h"
#include "sd/trace.h"
#include "sd/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define TRACE_DIR        "trace"
#define TRACE_FILES_KEPT 64 /* dumps kept in the directory; the oldest go first */

static const char *xfer_name(uint32_t kind)
{
    static const char *const names[] = {
        [SD_TAG_REQ] = "pull_request",  [SD_TAG_WDATA] = "weights",      [SD_TAG_GRAD] = "grad",
        [SD_TAG_AR] = "allreduce",      [SD_TAG_SCALAR] = "scalar",      [SD_TAG_INIT] = "init",
        [SD_TAG_RDV] = "clear_to_send", [SD_TAG_WSTEP] = "weights_step", [SD_TAG_PROBE] = "probe"};
    return kind < sizeof(names) / sizeof(names[0]) && names[kind] ? names[kind] : "other";
}

json_t *sd_job_trace_json(const struct sd_job *job, const char *failing)
{
    const struct sd_trace *t = &job->stats.trace;
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t wall = (uint64_t)rt.tv_sec * 1000000000ULL + (uint64_t)rt.tv_nsec;
    uint64_t mono = sd_now_ns();
    json_t *entries = json_array();
    for (uint64_t id = sd_trace_first(t); t->recs != NULL && id < t->next_id; id++) {
        const struct sd_trace_rec *r = sd_trace_get(t, id);
        if (r == NULL)
            continue;
        char name[64];
        bool call = r->kind == SD_TRACE_CALL;
        if (call)
            snprintf(name, sizeof(name), "shardd:%s", sd_op_name(r->op));
        else
            snprintf(name, sizeof(name), "shardd:%s:%s", r->kind == SD_TRACE_SEND ? "send" : "recv",
                     xfer_name(r->op));
        json_t *e =
            json_pack("{s:I, s:s, s:s, s:I, s:I, s:s, s:I}", "record_id", (json_int_t)id, "kind",
                      call                       ? "call"
                      : r->kind == SD_TRACE_SEND ? "send"
                                                 : "recv",
                      "profiling_name", name, "collective_seq_id", (json_int_t)r->seq, "bytes",
                      (json_int_t)r->bytes, "state", sd_trace_state_name(r->state),
                      "time_created_ns", (json_int_t)(wall - (mono - r->start_ns)));
        if (call) {
            json_object_set_new(e, "op", json_string(sd_op_name(r->op)));
            json_object_set_new(e, "rank", json_integer(r->who));
        } else {
            json_object_set_new(e, "op", json_string(xfer_name(r->op)));
            json_object_set_new(e, "peer_node",
                                r->who == UINT32_MAX ? json_null() : json_integer(r->who));
            json_object_set_new(e, "chunks_pending", json_integer(r->pending));
        }
        json_object_set_new(e, "unit", json_integer(r->unit));
        json_object_set_new(e, "time_discovered_completed_ns",
                            r->end_ns ? json_integer((json_int_t)(wall - (mono - r->end_ns)))
                                      : json_null());
        json_object_set_new(
            e, "duration_ms",
            json_real((double)((r->end_ns ? r->end_ns : mono) - r->start_ns) / 1e6));
        json_object_set_new(e, "status",
                            r->status ? json_string(sd_status_name(r->status)) : json_null());
        json_array_append_new(entries, e);
    }
    json_t *calls = json_array();
    for (uint32_t l = 0; t->calls != NULL && l < t->ranks; l++) {
        json_t *c = json_object();
        json_object_set_new(c, "rank", json_integer(t->first_rank + l));
        for (int op = SD_OP_FETCH; op < SD_OP_COUNT && op < SD_TRACE_OPS; op++)
            json_object_set_new(c, sd_op_name(op),
                                json_integer((json_int_t)t->calls[l * SD_TRACE_OPS + (size_t)op]));
        json_array_append_new(calls, c);
    }
    bool ended = job->state == SD_JOB_CLOSING || job->state == SD_JOB_FINISHED;
    json_t *doc = json_pack(
        "{s:s, s:s, s:I, s:i, s:i, s:i, s:i, s:i, s:s, s:s, s:s, s:I, s:I, s:I, s:o, s:o}",
        "version", "shardd-trace-1", "job", job->name, "job_id", (json_int_t)job->id, "node",
        (int)job->node, "nodes", (int)job->nodes, "world", (int)job->world, "ranks_per_node",
        (int)job->k, "first_rank", (int)job->first_rank, "plan", job->plan.name, "state",
        failing ? "failed" : sd_job_state_name(job->state), "error",
        failing ? failing
        : ended ? ""
                : job->fail_msg,
        "steps", (json_int_t)job->steps, "dumped_at_ns", (json_int_t)wall, "records_kept",
        (json_int_t)t->cap, "calls_taken", calls, "entries", entries);
    return doc;
}

/* at most TRACE_FILES_KEPT - 1 dumps left in dirfd, the oldest removed */
static void prune(int dirfd)
{
    int fd = dup(dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        return;
    }
    for (;;) {
        rewinddir(d);
        unsigned n = 0;
        char oldest[256] = "";
        struct timespec old_t = {0};
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            struct stat st;
            if (e->d_name[0] == '.' || fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
                !S_ISREG(st.st_mode))
                continue;
            n++;
            if (oldest[0] == '\0' || st.st_mtim.tv_sec < old_t.tv_sec ||
                (st.st_mtim.tv_sec == old_t.tv_sec && st.st_mtim.tv_nsec < old_t.tv_nsec)) {
                old_t = st.st_mtim;
                snprintf(oldest, sizeof(oldest), "%s", e->d_name);
            }
        }
        if (n < TRACE_FILES_KEPT || oldest[0] == '\0' || unlinkat(dirfd, oldest, 0) != 0)
            break;
    }
    closedir(d);
}

int sd_job_trace_dump(const struct sd_job *job, const char *failing, char *path, size_t len)
{
    const struct sd_config *cfg = job->reg->cfg;
    if (job->stats.trace.recs == NULL)
        return SD_ENOENT;
    char dir[SD_PATH_MAX + 16];
    snprintf(dir, sizeof(dir), "%s/%s", cfg->runtime_dir, TRACE_DIR);
    /* (the runtime directory is the daemon's own; the file is handed to the job's owner) */
    if (mkdir(dir, 0711) != 0 && errno != EEXIST)
        return -errno;
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dirfd < 0)
        return -errno;
    prune(dirfd);
    char name[128];
    snprintf(name, sizeof(name), "%s.%llu.node%u.json", job->name, (unsigned long long)job->id,
             job->node);
    int fd = openat(dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    int st = fd < 0 ? -errno : SD_OK;
    if (fd >= 0) {
        if (fchown(fd, job->uid, (gid_t)-1) != 0 && geteuid() == 0)
            SD_WARN_SPARSE("job", "flight recorder of job '%s': chown to uid %d: %s", job->name,
                           (int)job->uid, strerror(errno));
        json_t *doc = sd_job_trace_json(job, failing);
        if (json_dumpfd(doc, fd, JSON_INDENT(1)) != 0 || write(fd, "\n", 1) != 1)
            st = SD_EIO;
        json_decref(doc);
        if (close(fd) != 0 && st == SD_OK)
            st = -errno;
    }
    close(dirfd);
    if (st == SD_OK)
        snprintf(path, len, "%s/%s", dir, name);
    return st;
}

/* libshard: attach, register, and the ring-based data path. */
#include "shard.h"
#include "shard_internal.h"
#include "wguard.h"

#include "sd/ckpt.h"
#include "devmem.h"
#include "sd/fence.h"
#include "sd/frame.h"
#include "sd/hmac.h"
#include "sd/model.h"
#include "sd/model_msg.h"
#include "sd/ring.h"
#include "sd/status.h"
#include "sd/util.h"
#include "shard.pb-c.h"

#include <arpa/inet.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define DEFAULT_SOCKET  "/run/shardd/shardd.sock"
#define MAX_REPLY_BYTES (64u << 20)
#define MAX_STAGING     64
#define RING_MASK       (SD_RING_ENTRIES - 1)

/* REQ_DETACHED: in flight, and nobody waits for it (a release: drain reaps its completion, and
 * a failure is the next call's) */
enum req_state { REQ_FREE = 0, REQ_INFLIGHT, REQ_DONE, REQ_DETACHED };

struct shard_ctx {
    int sock;
    struct sd_ring_hdr *ring;
    int sq_efd, cq_efd;
    uint32_t op_timeout_ms;
    uint64_t wait_timeout_ms;
    uint64_t spin_ns;
    uint64_t gen;
    uint32_t next_slot;
    uint8_t req_state[SD_RING_ENTRIES];
    uint64_t req_tag[SD_RING_ENTRIES];
    struct sd_cqe req_cqe[SD_RING_ENTRIES];
    /* registration */
    bool registered;
    uint32_t rank, world, n_units, n_tensors;
    shard_unit_info_t *units;
    shard_tensor_info_t *tensors;
    const struct shard_devmem *mem; /* what the pool and the staging slots are (devmem.h) */
    char device_uuid[48];           /* the daemon's device for them ("" for host memory) */
    const uint8_t *pool;
    size_t pool_bytes;
    int wguard;        /* the pool's write guard (wguard.h), or -1 */
    uint64_t *unit_at; /* per unit: its pool offset at its last fetch (UINT64_MAX: none) */
    uint32_t *holds; /* per unit: fetches (not aside) answered and not released, as shardd counts */
    bool req_aside[SD_RING_ENTRIES]; /* per ring slot: a fetch aside */
    uint32_t detached;               /* slots REQ_DETACHED */
    int release_status;              /* the first failure of a detached release, not yet told */
    char release_err[1024];
    uint32_t req_unit[SD_RING_ENTRIES]; /* per ring slot: the unit of the request in it */
    uint8_t *staging;                   /* the staging slots */
    size_t staging_bytes;
    uint8_t *control; /* the control page: the fence page, the step arguments, a save's path */
    size_t control_bytes;
    struct sd_fence_page *fence; /* this rank's fence page (sd/fence.h): control's start */
    uint32_t grad_seq, gathers;  /* pushes signalled and fetches answered, as the page counts */
    uint32_t release_seq;        /* releases signalled by a stream (release_seq), as it counts */
    uint32_t staging_slots;
    uint64_t staging_slot_bytes;
    uint64_t slot_tag[MAX_STAGING];
    bool slot_busy[MAX_STAGING];
    uint32_t next_staging;
    /* the unit whose staging buffer the caller holds (shard_grad_buffer), or -1, and its slot */
    int64_t held_unit;
    uint32_t held_slot;
    int push_status;
    char push_err[1024];
    bool last_micro; /* the pushes until the step are this rank's last of it (SD_PUSH_LAST) */
    /* the step's arguments: where they go in the control page, and the groups' hyperparameters
     * as of the last step */
    uint64_t step_args_off;
    uint64_t save_path_off, start_step;
    bool resumed; /* the registration resumed a paused job */
    uint64_t bcast_bytes;
    uint32_t n_groups;
    shard_hparams_t *hparams;
    int optim_kind;
    /* a trainer optimizer's step handed the gradients over (shard_step_update_done awaited),
     * with their factor */
    bool handoff;
    double grad_scale;
    char err[1024];
};

_Static_assert(sizeof(shard_hparams_t) == sizeof(struct sd_hparams) &&
                   offsetof(shard_hparams_t, weight_decay) ==
                       offsetof(struct sd_hparams, weight_decay) &&
                   offsetof(shard_hparams_t, momentum) == offsetof(struct sd_hparams, momentum),
               "shard_hparams_t is struct sd_hparams");

#define SAME(x) _Static_assert((int)SHARD_##x == (int)SD_##x, "SHARD_" #x " must equal SD_" #x)
SAME(EINVAL);
SAME(ENOMEM);
SAME(ENOSPC);
SAME(ETIMEDOUT);
SAME(EPROTO);
SAME(ENOSYS);
SAME(EBUSY);
SAME(EAGAIN);
SAME(EIO);
SAME(EPERM);
SAME(ENOENT);
SAME(EEXIST);
SAME(ECONNRESET);
SAME(ENOTCONN);
SAME(EMSGSIZE);
SAME(ERANGE);
SAME(ECANCELED);
SAME(ESTATE);
SAME(EMISMATCH);
SAME(EJOBFAILED);
SAME(EVERSION);
SAME(ENOUNIT);
SAME(ENOJOB);
SAME(ENOTHELD);
SAME(ECONFIG);
SAME(EPEER);
SAME(ENONFINITE);
SAME(EPAUSED);
SAME(ENOREPLICA);
#undef SAME

static int fail(shard_ctx_t *ctx, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(shard_ctx_t *ctx, int status, const char *fmt, ...)
{
    if (ctx != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->err, sizeof(ctx->err), fmt, ap);
        va_end(ap);
    }
    return status;
}

const char *shard_strerror(int status)
{
    return sd_status_str(status);
}

/* the message of the last failed shard_attach of this thread (no context exists then) */
static _Thread_local char attach_err[1024];

const char *shard_last_error(const shard_ctx_t *ctx)
{
    return ctx ? ctx->err : attach_err;
}

static uint64_t env_u64(const char *name, uint64_t def)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        return def;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    return *end == '\0' ? x : def;
}

/* Receive one DaemonMsg; fds as announced. Error replies become the status and message. */
static int recv_reply(shard_ctx_t *ctx, Shard__DaemonMsg **msg_p, int *fds, unsigned max_fds,
                      unsigned *nfds_p, int timeout_ms, const char *what)
{
    uint8_t *buf;
    size_t len;
    unsigned nfds = 0;
    int status =
        sd_frame_recv(ctx->sock, &buf, &len, fds, max_fds, &nfds, MAX_REPLY_BYTES, timeout_ms);
    if (status == SD_ETIMEDOUT)
        return fail(ctx, status, "%s: no answer from shardd within %d ms", what, timeout_ms);
    if (status != SD_OK)
        return fail(ctx, status, "%s: connection to shardd lost: %s", what, sd_status_str(status));
    Shard__DaemonMsg *m = shard__daemon_msg__unpack(NULL, len, buf);
    free(buf);
    if (m == NULL) {
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
        return fail(ctx, SD_EPROTO, "%s: undecodable reply from shardd", what);
    }
    if (m->msg_case == SHARD__DAEMON_MSG__MSG_ERROR) {
        status = m->error->status < 0 ? m->error->status : SD_EPROTO;
        fail(ctx, status, "%s", m->error->message ? m->error->message : "error");
        shard__daemon_msg__free_unpacked(m, NULL);
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
        return status;
    }
    *msg_p = m;
    if (nfds_p != NULL)
        *nfds_p = nfds;
    else
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
    return SD_OK;
}

/* A send to the daemon failed: the daemon may have refused this connection with a reason
 * before closing it (max_clients, allowed_gid, its fd limit). Its status with the error set if
 * so, else SD_OK. */
static int daemon_refusal(shard_ctx_t *ctx, const char *what)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    if (sd_frame_recv(ctx->sock, &buf, &len, NULL, 0, NULL, MAX_REPLY_BYTES, 200) != SD_OK)
        return SD_OK;
    Shard__DaemonMsg *m = shard__daemon_msg__unpack(NULL, len, buf);
    free(buf);
    int status = SD_OK;
    if (m != NULL && m->msg_case == SHARD__DAEMON_MSG__MSG_ERROR)
        status = fail(ctx, m->error->status < 0 ? m->error->status : SD_EPROTO,
                      "%s: shardd refused the connection: %s", what, m->error->message);
    if (m != NULL)
        shard__daemon_msg__free_unpacked(m, NULL);
    return status;
}

int shard__connect(const char *socket_path, int *fd_p, char *err, size_t errlen)
{
    const char *path = socket_path ? socket_path : getenv("SHARD_SOCKET");
    if (path == NULL || *path == '\0')
        path = DEFAULT_SOCKET;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(addr.sun_path)) {
        snprintf(err, errlen, "socket path %s is longer than %zu bytes", path,
                 sizeof(addr.sun_path) - 1);
        return SD_EINVAL;
    }
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        int status = errno == ENOENT || errno == ECONNREFUSED ? SD_ENOTCONN : -errno;
        snprintf(err, errlen, "cannot connect to shardd at %s: %s (is shardd running?)", path,
                 strerror(errno));
        close(fd);
        return status;
    }
    *fd_p = fd;
    return SD_OK;
}

int shard_attach(const char *socket_path, shard_ctx_t **ctx_p)
{
    if (ctx_p == NULL)
        return SD_EINVAL;
    shard_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return SD_ENOMEM;
    ctx->sq_efd = ctx->cq_efd = ctx->sock = -1;
    ctx->held_unit = -1;
    ctx->wguard = -1;
    int status = shard__connect(socket_path, &ctx->sock, ctx->err, sizeof(ctx->err));
    if (status != SD_OK)
        goto err_out;

    char name[64];
    snprintf(name, sizeof(name), "libshard pid %d", (int)getpid());
    Shard__Attach at = SHARD__ATTACH__INIT;
    at.protocol_version = SD_PROTOCOL_VERSION;
    at.client_name = name;
    Shard__ClientMsg msg = SHARD__CLIENT_MSG__INIT;
    msg.msg_case = SHARD__CLIENT_MSG__MSG_ATTACH;
    msg.attach = &at;
    status = sd_frame_send(ctx->sock, &msg.base, NULL, 0, 5000);
    int refused;
    if (status != SD_OK && (refused = daemon_refusal(ctx, "attach")) != SD_OK) {
        status = refused;
        goto err_out;
    }
    if (status != SD_OK) {
        fail(ctx, status, "attach: cannot send to shardd: %s", sd_status_str(status));
        goto err_out;
    }
    Shard__DaemonMsg *rep;
    int fds[3];
    unsigned nfds = 0;
    status = recv_reply(ctx, &rep, fds, 3, &nfds, 10000, "attach");
    if (status != SD_OK)
        goto err_out;
    if (rep->msg_case != SHARD__DAEMON_MSG__MSG_ATTACH || nfds != 3 ||
        rep->attach->ring_entries != SD_RING_ENTRIES || rep->attach->ring_bytes != SD_RING_BYTES) {
        fail(ctx, SD_EPROTO, "attach: unexpected reply from shardd (version mismatch?)");
        status = SD_EPROTO;
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
        shard__daemon_msg__free_unpacked(rep, NULL);
        goto err_out;
    }
    ctx->op_timeout_ms = rep->attach->op_timeout_ms;
    shard__daemon_msg__free_unpacked(rep, NULL);
    ctx->ring = mmap(NULL, SD_RING_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    close(fds[0]);
    ctx->sq_efd = fds[1];
    ctx->cq_efd = fds[2];
    if (ctx->ring == MAP_FAILED) {
        ctx->ring = NULL;
        status = fail(ctx, -errno, "attach: cannot map the ring: %s", strerror(errno));
        goto err_out;
    }
    if (ctx->ring->magic != SD_RING_MAGIC || ctx->ring->version != SD_RING_VERSION) {
        status = fail(ctx, SD_EVERSION, "attach: ring version %u, expected %d", ctx->ring->version,
                      SD_RING_VERSION);
        goto err_out;
    }
    ctx->wait_timeout_ms = env_u64("SHARD_TIMEOUT_MS", 2ULL * ctx->op_timeout_ms + 10000);
    ctx->spin_ns = env_u64("SHARD_SPIN_US", 50) * 1000;
    *ctx_p = ctx;
    return SD_OK;

err_out:
    memcpy(attach_err, ctx->err, sizeof(attach_err));
    shard_detach(ctx);
    *ctx_p = NULL;
    return status;
}

/* ---- the ring */

static void wake_daemon(shard_ctx_t *ctx)
{
    sd_ring_wake(&ctx->ring->daemon_sleeping, ctx->sq_efd);
}

/* A write into the gather pool was caught (wguard.h): name what it hit. */
static int pool_written(shard_ctx_t *ctx, uintptr_t addr)
{
    uint64_t off = (uint64_t)(addr - (uintptr_t)ctx->pool);
    char where[160] = "";
    for (uint32_t u = 0; u < ctx->n_units && ctx->unit_at != NULL; u++) {
        const shard_unit_info_t *ui = &ctx->units[u];
        if (ctx->unit_at[u] == UINT64_MAX || off < ctx->unit_at[u] ||
            off >= ctx->unit_at[u] + ui->bytes)
            continue;
        uint64_t el = (off - ctx->unit_at[u]) / sd_dtype_size((int)ui->dtype);
        uint32_t t = ui->first_tensor;
        while (t + 1 < ui->first_tensor + ui->n_tensors && ctx->tensors[t + 1].offset <= el)
            t++;
        snprintf(where, sizeof(where), " of unit %u (tensor %u, element %llu)", u, t,
                 (unsigned long long)(el - ctx->tensors[t].offset));
        break;
    }
    return fail(ctx, SD_EPERM,
                "a write into the gathered weights%s was caught: they are read-only and shared "
                "with the other ranks (the write went to a private copy, now discarded); change "
                "parameters through the optimizer in shardd: shard_step (in PyTorch, "
                "shard.torch.optimizer(model).step(), or the torch optimizer given to "
                "shard.torch.wrap(optimizer=...))",
                where);
}

static bool drain(shard_ctx_t *ctx);
static int ring_corrupt(shard_ctx_t *ctx);

static int post(shard_ctx_t *ctx, uint32_t op, uint32_t unit, uint64_t a0, uint64_t a1,
                uint64_t *tag_p)
{
    if (ctx->ring != NULL && !drain(ctx))
        return ring_corrupt(ctx);
    if (ctx->release_status != SD_OK) { /* a release that returned before shardd answered */
        int status = ctx->release_status;
        ctx->release_status = SD_OK;
        return fail(ctx, status, "%s: an earlier %s", sd_op_name((int)op), ctx->release_err);
    }
    if (ctx->wguard >= 0) {
        uintptr_t written = sd_wguard_take(ctx->wguard, ctx->pool, ctx->pool_bytes);
        if (written != 0)
            return pool_written(ctx, written);
    }
    uint32_t slot = UINT32_MAX;
    for (uint32_t i = 0; i < SD_RING_ENTRIES; i++) {
        uint32_t c = (ctx->next_slot + i) & RING_MASK;
        if (ctx->req_state[c] == REQ_FREE) {
            slot = c;
            break;
        }
    }
    if (slot == UINT32_MAX)
        return fail(ctx, SD_EAGAIN, "%s: %d requests already in flight; wait for some first",
                    sd_op_name((int)op), SD_RING_ENTRIES);
    ctx->next_slot = (slot + 1) & RING_MASK;
    uint64_t tag = (++ctx->gen << 8) | slot;
    struct sd_sqe e = {.op = op, .unit = unit, .tag = tag, .arg0 = a0, .arg1 = a1};
    if (sd_ring_sq_push(ctx->ring, &e) != 0)
        return fail(ctx, SD_EAGAIN, "%s: submission ring full", sd_op_name((int)op));
    ctx->req_state[slot] = REQ_INFLIGHT;
    ctx->req_tag[slot] = tag;
    ctx->req_unit[slot] = unit;
    ctx->req_aside[slot] = op == SD_OP_FETCH && (a0 & SD_OP_ASIDE);
    wake_daemon(ctx);
    *tag_p = tag;
    return SD_OK;
}

/* false when the completion ring's indices are corrupt */
static bool drain(shard_ctx_t *ctx)
{
    struct sd_cqe e;
    int r;
    while ((r = sd_ring_cq_pop(ctx->ring, &e)) == 1) {
        uint32_t slot = (uint32_t)(e.tag & RING_MASK);
        if (ctx->req_tag[slot] != e.tag)
            continue;
        if (ctx->req_state[slot] == REQ_INFLIGHT) {
            ctx->req_cqe[slot] = e;
            ctx->req_state[slot] = REQ_DONE;
        } else if (ctx->req_state[slot] == REQ_DETACHED) {
            ctx->req_state[slot] = REQ_FREE;
            ctx->detached--;
            if (e.status != SD_OK && ctx->release_status == SD_OK) {
                ctx->release_status = e.status;
                snprintf(ctx->release_err, sizeof(ctx->release_err),
                         "release of unit %u failed: %.*s", ctx->req_unit[slot], (int)sizeof(e.msg),
                         e.msg);
            }
        }
    }
    return r == 0;
}

/* The daemon wrote on the socket outside a request: an error before it hangs up, or EOF. */
static int socket_event(shard_ctx_t *ctx, const char *what)
{
    Shard__DaemonMsg *m = NULL;
    int status = recv_reply(ctx, &m, NULL, 0, NULL, 1000, what);
    if (m != NULL) {
        shard__daemon_msg__free_unpacked(m, NULL);
        return fail(ctx, SD_EPROTO, "%s: unexpected message from shardd", what);
    }
    return status == SD_OK ? SD_ECONNRESET : status;
}

static int ring_corrupt(shard_ctx_t *ctx)
{
    return fail(ctx, SD_EPROTO,
                "wait: the completion ring's indices are corrupt (head %llu, tail %llu, %d "
                "entries): this process wrote into the shared ring; detach and attach again",
                (unsigned long long)atomic_load(&ctx->ring->cq_head),
                (unsigned long long)atomic_load(&ctx->ring->cq_tail), SD_RING_ENTRIES);
}

static int wait_tag(shard_ctx_t *ctx, uint64_t tag, struct sd_cqe *cqe_p)
{
    uint32_t slot = (uint32_t)(tag & RING_MASK);
    if (ctx->req_tag[slot] != tag || ctx->req_state[slot] == REQ_FREE ||
        ctx->req_state[slot] == REQ_DETACHED)
        return fail(ctx, SD_EINVAL, "wait: request %llu is not in flight (waited twice?)",
                    (unsigned long long)tag);
    uint64_t start = sd_now_ns();
    uint64_t deadline = start + ctx->wait_timeout_ms * 1000000ULL;
    for (;;) {
        if (!drain(ctx))
            return ring_corrupt(ctx);
        if (ctx->req_state[slot] == REQ_DONE)
            break;
        uint64_t now = sd_now_ns();
        if (now - start < ctx->spin_ns) {
            __builtin_ia32_pause();
            continue;
        }
        if (now >= deadline)
            return fail(ctx, SD_ETIMEDOUT,
                        "no completion from shardd within %llu ms (SHARD_TIMEOUT_MS); the "
                        "daemon may be stopped or overloaded",
                        (unsigned long long)ctx->wait_timeout_ms);
        atomic_store(&ctx->ring->client_waiting, 1);
        atomic_thread_fence(memory_order_seq_cst);
        if (!drain(ctx))
            return ring_corrupt(ctx);
        if (ctx->req_state[slot] == REQ_DONE) {
            atomic_store(&ctx->ring->client_waiting, 0);
            break;
        }
        struct pollfd p[2] = {{.fd = ctx->cq_efd, .events = POLLIN},
                              {.fd = ctx->sock, .events = POLLIN}};
        int ms = (int)SD_MIN((deadline - now) / 1000000 + 1, 1000);
        int r = poll(p, 2, ms);
        if (r > 0 && (p[0].revents & POLLIN)) {
            uint64_t v;
            ssize_t n = read(ctx->cq_efd, &v, sizeof(v));
            (void)n;
        }
        if (r > 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            if (!drain(ctx))
                return ring_corrupt(ctx);
            if (ctx->req_state[slot] == REQ_DONE)
                break;
            return socket_event(ctx, "wait");
        }
    }
    *cqe_p = ctx->req_cqe[slot];
    ctx->req_state[slot] = REQ_FREE;
    if (cqe_p->status != SD_OK)
        fail(ctx, cqe_p->status, "%s", cqe_p->msg);
    return cqe_p->status;
}

/* Post and wait. */
static int call(shard_ctx_t *ctx, uint32_t op, uint32_t unit, uint64_t a0, uint64_t a1,
                struct sd_cqe *cqe_p)
{
    uint64_t tag;
    int status = post(ctx, op, unit, a0, a1, &tag);
    if (status != SD_OK)
        return status;
    return wait_tag(ctx, tag, cqe_p);
}

int shard__post_raw(shard_ctx_t *ctx, uint32_t op, uint32_t unit, uint64_t a0, uint64_t a1)
{
    struct sd_cqe cqe;
    if (ctx == NULL || ctx->ring == NULL)
        return SD_ENOTCONN;
    return call(ctx, op, unit, a0, a1, &cqe);
}

/* ---- registration */

static int check_attached(shard_ctx_t *ctx, const char *what, bool registered)
{
    if (ctx == NULL)
        return SD_EINVAL;
    if (ctx->ring == NULL)
        return fail(ctx, SD_ENOTCONN, "%s: not attached", what);
    if (registered && !ctx->registered)
        return fail(ctx, SD_ESTATE, "%s: call shard_register first", what);
    return SD_OK;
}

static int parse_optim(shard_ctx_t *ctx, const shard_optimizer_t *o, Shard__Optimizer *out)
{
    int kind = sd_optim_parse(o->name);
    if (kind < 0)
        return fail(ctx, SD_EINVAL,
                    "register: optimizer '%.64s' is none of adamw, sgd, adam, sgd-nesterov, "
                    "trainer0..trainer4",
                    o->name ? o->name : "(null)");
    out->kind = (uint32_t)kind;
    out->lr = o->lr;
    out->beta1 = o->beta1;
    out->beta2 = o->beta2;
    out->eps = o->eps;
    out->weight_decay = o->weight_decay;
    out->momentum = o->momentum;
    out->max_grad_norm = o->max_grad_norm;
    return SD_OK;
}

static int map_job(shard_ctx_t *ctx, const Shard__RegisterReply *rep, const int *fds)
{
    struct stat st;
    uint64_t args_bytes =
        sd_step_args_bytes(ctx->n_groups, (uint32_t)rep->n_tensors, ctx->bcast_bytes);
    uint64_t path_off = rep->step_args_off + args_bytes;
    args_bytes += SD_CKPT_PATH_MAX; /* then a save's directory */
    struct stat cst;
    char why[512];
    snprintf(ctx->device_uuid, sizeof(ctx->device_uuid), "%s",
             rep->device_uuid != NULL ? rep->device_uuid : "");
    ctx->mem = shard_devmem_open(rep->memory, rep->device, ctx->device_uuid, why, sizeof(why));
    if (ctx->mem == NULL)
        return fail(ctx, SD_ENOSYS, "register: %s", why);
    /* memfds have sizes to check; a device's fd handles do not (its import checks them) */
    bool sized = ctx->mem->memfds;
    if ((sized &&
         (fstat(fds[0], &st) != 0 || (uint64_t)st.st_size < rep->pool_bytes ||
          fstat(fds[1], &st) != 0 ||
          (uint64_t)st.st_size < (uint64_t)rep->staging_slots * rep->staging_slot_bytes)) ||
        rep->staging_slots == 0 || rep->staging_slots > MAX_STAGING ||
        rep->step_args_off < SD_FENCE_BYTES || rep->step_args_bytes != args_bytes ||
        rep->save_path_off != path_off || (rep->n_groups != 0 && rep->n_groups != ctx->n_groups) ||
        fstat(fds[2], &cst) != 0 ||
        (uint64_t)cst.st_size < rep->step_args_off + rep->step_args_bytes)
        return fail(ctx, SD_EPROTO, "register: shared buffers do not match the layout");
    ctx->pool_bytes = rep->pool_bytes;
    void *pool = NULL;
    int status = ctx->mem->map(fds[0], ctx->pool_bytes, true, &pool, why, sizeof(why));
    if (status != 0)
        return fail(ctx, status, "register: cannot map the gather pool: %s", why);
    ctx->pool = pool;
    if (ctx->pool_bytes > 0 && ctx->mem->host)
        ctx->wguard = sd_wguard_add(ctx->pool, ctx->pool_bytes);
    ctx->staging_slots = rep->staging_slots;
    ctx->staging_slot_bytes = rep->staging_slot_bytes;
    ctx->staging_bytes = (size_t)(rep->staging_slots * rep->staging_slot_bytes);
    ctx->control_bytes = (size_t)(rep->step_args_off + rep->step_args_bytes);
    ctx->step_args_off = rep->step_args_off;
    ctx->save_path_off = rep->save_path_off;
    ctx->start_step = rep->start_step;
    ctx->resumed = rep->resumed;
    for (uint32_t g = 0; g < rep->n_groups; g++) { /* in force: a checkpoint's when loading one */
        struct sd_hparams h = sd_hparams_from_msg(rep->groups[g]);
        memcpy(&ctx->hparams[g], &h, sizeof(h));
    }
    void *staging = NULL;
    status = ctx->mem->map(fds[1], ctx->staging_bytes, false, &staging, why, sizeof(why));
    if (status != 0)
        return fail(ctx, status, "register: cannot map the staging slots: %s", why);
    ctx->staging = staging;
    ctx->control = mmap(NULL, ctx->control_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[2], 0);
    if (ctx->control == MAP_FAILED) {
        ctx->control = NULL;
        return fail(ctx, -errno, "register: cannot map the control page: %s", strerror(errno));
    }
    ctx->fence = (struct sd_fence_page *)(void *)ctx->control;
    if (ctx->fence->magic != SD_FENCE_MAGIC || ctx->fence->version != SD_FENCE_VERSION)
        return fail(ctx, SD_EVERSION, "register: fence page version %u (magic %#x), expected %u",
                    ctx->fence->version, ctx->fence->magic, SD_FENCE_VERSION);
    /* a resumed job's counters go on from where its last trainer left them */
    ctx->grad_seq = sd_fence_load(&ctx->fence->grad_seq);
    ctx->gathers = sd_fence_load(&ctx->fence->gather_seq);
    ctx->release_seq = sd_fence_load(&ctx->fence->release_seq);
    ctx->n_units = (uint32_t)rep->n_units;
    ctx->n_tensors = (uint32_t)rep->n_tensors;
    ctx->units = calloc(ctx->n_units, sizeof(*ctx->units));
    ctx->tensors = calloc(ctx->n_tensors, sizeof(*ctx->tensors));
    ctx->unit_at = malloc(ctx->n_units * sizeof(*ctx->unit_at) + 1);
    ctx->holds = calloc(ctx->n_units + 1, sizeof(*ctx->holds));
    if (ctx->units == NULL || ctx->tensors == NULL || ctx->unit_at == NULL || ctx->holds == NULL)
        return fail(ctx, SD_ENOMEM, "register: out of memory");
    memset(ctx->unit_at, 0xff, ctx->n_units * sizeof(*ctx->unit_at));
    for (uint32_t u = 0; u < ctx->n_units; u++) {
        const Shard__UnitLayout *ul = rep->units[u];
        if (ul->dtype >= SD_DTYPE_COUNT || ul->first_tensor + ul->n_tensors > ctx->n_tensors)
            return fail(ctx, SD_EPROTO, "register: bad unit %u in the layout", u);
        ctx->units[u] = (shard_unit_info_t){.numel = ul->numel,
                                            .bytes = ul->numel * sd_dtype_size((int)ul->dtype),
                                            .dtype = (shard_dtype_t)ul->dtype,
                                            .first_tensor = ul->first_tensor,
                                            .n_tensors = ul->n_tensors};
        for (uint32_t t = ul->first_tensor; t < ul->first_tensor + ul->n_tensors; t++)
            ctx->tensors[t] = (shard_tensor_info_t){
                .unit = u, .offset = rep->tensors[t]->offset, .numel = rep->tensors[t]->numel};
        if (ctx->units[u].numel * sizeof(float) > ctx->staging_slot_bytes)
            return fail(ctx, SD_EPROTO, "register: staging slots smaller than unit %u", u);
    }
    return SD_OK;
}

/* Rank 0 sends its initial values unit by unit through staging slot 0. */
static int load_initial(shard_ctx_t *ctx, const shard_model_t *model)
{
    struct sd_cqe cqe;
    char why[512];
    for (uint32_t u = 0; u < ctx->n_units; u++) {
        float *dst = (float *)(void *)ctx->staging;
        int status = ctx->mem->zero(dst, ctx->units[u].numel * sizeof(float), why, sizeof(why));
        for (uint32_t t = ctx->units[u].first_tensor;
             status == 0 && t < ctx->units[u].first_tensor + ctx->units[u].n_tensors; t++)
            if (model->init != NULL && model->init[t] != NULL)
                status = ctx->mem->copy(dst + ctx->tensors[t].offset, model->init[t],
                                        ctx->tensors[t].numel * sizeof(float), why, sizeof(why));
        if (status != 0)
            return fail(ctx, status, "register: initial values of unit %u: %s", u, why);
        status = call(ctx, SD_OP_INIT, u, 0, 0, &cqe);
        if (status != SD_OK)
            return status;
    }
    return SD_OK;
}

/* path made absolute against the working directory (the daemon's is not the caller's) */
static int absolute_path(shard_ctx_t *ctx, const char *what, const char *path,
                         char out[SD_CKPT_PATH_MAX])
{
    char cwd[SD_CKPT_PATH_MAX];
    int n;
    if (path[0] == '/')
        n = snprintf(out, SD_CKPT_PATH_MAX, "%s", path);
    else if (getcwd(cwd, sizeof(cwd)) == NULL)
        return fail(ctx, -errno, "%s: cannot make '%s' absolute: %s", what, path, strerror(errno));
    else
        n = snprintf(out, SD_CKPT_PATH_MAX, "%s/%s", cwd, path);
    if (n <= 0 || n >= SD_CKPT_PATH_MAX)
        return fail(ctx, SD_EINVAL, "%s: the path '%.64s...' is longer than %d bytes", what, path,
                    SD_CKPT_PATH_MAX - 1);
    return SD_OK;
}

/* The first host of a Slurm hostlist ("gpu[07-09,12],cpu1" -> "gpu07") into out. */
static bool slurm_first_host(const char *list, char *out, size_t len)
{
    size_t name = strcspn(list, ",[");
    if (name == 0 || name >= len)
        return false;
    memcpy(out, list, name);
    out[name] = '\0';
    if (list[name] != '[')
        return true;
    const char *r = list + name + 1;
    size_t digits = strspn(r, "0123456789");
    if (digits == 0 || name + digits >= len)
        return false;
    memcpy(out + name, r, digits);
    out[name + digits] = '\0';
    return true;
}

/* The job's leader as "ip:port" into out ("" when the launcher names none): the model's, else
 * SHARD_LEADER, MASTER_ADDR (torchrun), the first host of SLURM_STEP_NODELIST (srun), with
 * SHARD_LEADER_PORT (or SHARD_LEADER_PORT's default). */
static int leader_addr(shard_ctx_t *ctx, const char *given, char *out, size_t len,
                       const char **from_p)
{
    char host[256], slurm[256];
    const char *spec = given != NULL && given[0] != '\0' ? given : getenv("SHARD_LEADER");
    const char *from = given != NULL && given[0] != '\0' ? "shard_model_t.leader" : "SHARD_LEADER";
    if (spec == NULL || spec[0] == '\0') {
        spec = getenv("MASTER_ADDR");
        from = "MASTER_ADDR";
    }
    const char *nodes = getenv("SLURM_STEP_NODELIST");
    if ((spec == NULL || spec[0] == '\0') && nodes != NULL &&
        slurm_first_host(nodes, slurm, sizeof(slurm))) {
        spec = slurm;
        from = "SLURM_STEP_NODELIST";
    }
    out[0] = '\0';
    *from_p = from;
    if (spec == NULL || spec[0] == '\0')
        return SD_OK;
    const char *env_port = getenv("SHARD_LEADER_PORT");
    long port =
        env_port != NULL && env_port[0] != '\0' ? strtol(env_port, NULL, 10) : SHARD_LEADER_PORT;
    const char *colon = strrchr(spec, ':');
    size_t hlen =
        colon != NULL && strchr(spec, ':') == colon ? (size_t)(colon - spec) : strlen(spec);
    if (colon != NULL && strchr(spec, ':') == colon)
        port = strtol(colon + 1, NULL, 10);
    if (hlen == 0 || hlen >= sizeof(host) || port <= 0 || port > 65535)
        return fail(ctx, SD_EINVAL, "register: the job's leader '%s' (%s) is not host[:port]", spec,
                    from);
    memcpy(host, spec, hlen);
    host[hlen] = '\0';
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int r = getaddrinfo(host, NULL, &hints, &ai);
    if (r != 0 || ai == NULL) { /* (said by the daemon if this rank needs it: not node 0's) */
        snprintf(out, len, "%.40s:%ld", host, port);
        return SD_OK;
    }
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &((const struct sockaddr_in *)ai->ai_addr)->sin_addr, ip, sizeof(ip));
    freeaddrinfo(ai);
    snprintf(out, len, "%s:%ld", ip, port);
    return SD_OK;
}

/* The job's token (shard_model_t.job_secret): HMAC-SHA256 keyed with the secret over
 * "shardd job token", a zero byte and the job's name. */
static void job_token(const void *secret, size_t len, const char *job, uint8_t out[SD_SHA256_BYTES])
{
    static const char label[] = "shardd job token"; /* with its terminating zero */
    struct sd_hmac m;
    sd_hmac_init(&m, secret, len);
    sd_hmac_update(&m, label, sizeof(label));
    sd_hmac_update(&m, job, strlen(job));
    sd_hmac_final(&m, out);
}

int shard_register(shard_ctx_t *ctx, const shard_model_t *model)
{
    int status = check_attached(ctx, "register", false);
    if (status != SD_OK)
        return status;
    if (ctx->registered)
        return fail(ctx, SD_ESTATE, "register: this context is already registered");
    if (model == NULL || model->job == NULL || model->plan == NULL || model->tensors == NULL ||
        model->n_tensors == 0)
        return fail(ctx, SD_EINVAL, "register: job, plan and at least one tensor are required");

    Shard__Optimizer opt = SHARD__OPTIMIZER__INIT;
    status = parse_optim(ctx, &model->optimizer, &opt);
    if (status != SD_OK)
        return status;
    if ((model->groups == NULL) != (model->n_groups == 0) || model->n_groups > SD_MAX_GROUPS)
        return fail(ctx, SD_EINVAL, "register: %u parameter groups%s; 1..%d with groups set",
                    model->n_groups, model->groups == NULL ? " without groups" : "", SD_MAX_GROUPS);
    if ((model->flags & ~(uint32_t)SHARD_SKIP_UNUSED) != 0)
        return fail(ctx, SD_EINVAL, "register: unknown flags 0x%x", model->flags);
    uint8_t token[SD_SHA256_BYTES];
    bool has_token = model->job_secret != NULL && model->job_secret_len > 0;
    if (has_token && (model->job_secret_len < SHARD_JOB_SECRET_MIN ||
                      model->job_secret_len > SHARD_JOB_SECRET_MAX))
        return fail(ctx, SD_EINVAL,
                    "register: a job secret of %zu bytes; give %d-%d (32 random bytes, made once "
                    "per job)",
                    model->job_secret_len, SHARD_JOB_SECRET_MIN, SHARD_JOB_SECRET_MAX);
    if (has_token) /* the daemons see the token only, never the secret */
        job_token(model->job_secret, model->job_secret_len, model->job, token);
    free(ctx->hparams);
    ctx->n_groups = model->n_groups ? model->n_groups : 1;
    ctx->bcast_bytes = model->bcast_bytes;
    ctx->optim_kind = (int)opt.kind;
    ctx->hparams = calloc(ctx->n_groups, sizeof(*ctx->hparams));
    Shard__Optimizer *gd = calloc(model->n_groups + 1, sizeof(*gd));
    Shard__Optimizer **gp = calloc(model->n_groups + 1, sizeof(*gp));
    if (ctx->hparams == NULL || gd == NULL || gp == NULL) {
        free(gd);
        free(gp);
        return fail(ctx, SD_ENOMEM, "register: out of memory");
    }
    for (uint32_t g = 0; g < model->n_groups; g++) {
        /* shard_hparams_t is struct sd_hparams (asserted above) */
        sd_hparams_to_msg((const struct sd_hparams *)(const void *)&model->groups[g], (int)opt.kind,
                          &gd[g]);
        gp[g] = &gd[g];
        ctx->hparams[g] = model->groups[g];
    }
    if (model->n_groups == 0)
        ctx->hparams[0] = (shard_hparams_t){.lr = opt.lr,
                                            .beta1 = opt.beta1,
                                            .beta2 = opt.beta2,
                                            .eps = opt.eps,
                                            .weight_decay = opt.weight_decay,
                                            .momentum = opt.momentum};
    Shard__TensorDesc *td = calloc(model->n_tensors, sizeof(*td));
    Shard__TensorDesc **tp = calloc(model->n_tensors, sizeof(*tp));
    if (td == NULL || tp == NULL) {
        free(td);
        free(tp);
        free(gd);
        free(gp);
        return fail(ctx, SD_ENOMEM, "register: out of memory");
    }
    for (uint32_t i = 0; i < model->n_tensors; i++) {
        const shard_tensor_t *t = &model->tensors[i];
        shard__tensor_desc__init(&td[i]);
        td[i].name = (char *)(t->name ? t->name : "");
        td[i].n_dims = t->dims ? t->ndim : 0;
        td[i].dims = (uint64_t *)t->dims;
        td[i].dtype = (uint32_t)t->dtype;
        td[i].unit = t->unit;
        td[i].group = t->group;
        tp[i] = &td[i];
    }
    Shard__Register reg = SHARD__REGISTER__INIT;
    reg.job = (char *)model->job;
    reg.rank = model->rank;
    reg.world = model->world;
    reg.plan = (char *)model->plan;
    reg.n_tensors = model->n_tensors;
    reg.tensors = tp;
    reg.optimizer = &opt;
    reg.max_live_bytes = model->max_live_bytes;
    reg.n_groups = model->n_groups;
    reg.groups = gp;
    reg.skip_unused = (model->flags & SHARD_SKIP_UNUSED) != 0;
    reg.bcast_bytes = model->bcast_bytes;
    char load[SD_CKPT_PATH_MAX];
    bool loading = model->load != NULL && model->load[0] != '\0';
    if (loading && (status = absolute_path(ctx, "register: load", model->load, load)) != SD_OK) {
        free(td);
        free(tp);
        free(gd);
        free(gp);
        return status;
    }
    reg.load = loading ? load : "";
    reg.resume_timeout_ms = model->resume_timeout_ms;
    reg.ranks_per_node = model->ranks_per_node;
    reg.job_token.data = token;
    reg.job_token.len = has_token ? sizeof(token) : 0;
    char leader[64];
    const char *leader_from = NULL;
    if ((status = leader_addr(ctx, model->leader, leader, sizeof(leader), &leader_from)) != SD_OK) {
        free(td);
        free(tp);
        free(gd);
        free(gp);
        return status;
    }
    reg.leader = leader;
    Shard__ClientMsg msg = SHARD__CLIENT_MSG__INIT;
    msg.msg_case = SHARD__CLIENT_MSG__MSG_REGISTER;
    msg.register_ = &reg;
    status = sd_frame_send(ctx->sock, &msg.base, NULL, 0, 10000);
    free(td);
    free(tp);
    free(gd);
    free(gp);
    int refused;
    if (status != SD_OK && (refused = daemon_refusal(ctx, "register")) != SD_OK)
        return refused;
    if (status != SD_OK)
        return fail(ctx, status, "register: cannot send to shardd: %s", sd_status_str(status));

    Shard__DaemonMsg *rep;
    int fds[3];
    unsigned nfds = 0;
    int timeout = (int)env_u64("SHARD_REGISTER_TIMEOUT_MS", 600000);
    status = recv_reply(ctx, &rep, fds, 3, &nfds, timeout, "register");
    if (status != SD_OK && leader[0] != '\0' && strstr(ctx->err, "leader") != NULL) {
        /* the daemon knows the address, not where this rank took it from */
        size_t used = strlen(ctx->err);
        snprintf(ctx->err + used, sizeof(ctx->err) - used, " [this rank's leader %s is from %s%s]",
                 leader, leader_from,
                 strcmp(leader_from, "MASTER_ADDR") == 0
                     ? ", torchrun's: on one machine, or where rank 0's daemon is not at "
                       "MASTER_ADDR:SHARD_LEADER_PORT, set SHARD_LEADER"
                     : "");
    }
    if (status != SD_OK)
        return status;
    if (rep->msg_case != SHARD__DAEMON_MSG__MSG_REGISTER || nfds != 3) {
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
        shard__daemon_msg__free_unpacked(rep, NULL);
        return fail(ctx, SD_EPROTO, "register: unexpected reply from shardd (%u descriptors)",
                    nfds);
    }
    status = map_job(ctx, rep->register_, fds);
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    shard__daemon_msg__free_unpacked(rep, NULL);
    if (status != SD_OK)
        return status;
    ctx->rank = model->rank;
    ctx->world = model->world;
    ctx->registered = true;
    struct sd_cqe cqe;
    if (model->rank == 0 && !loading && !ctx->resumed &&
        (status = load_initial(ctx, model)) != SD_OK)
        return status;
    return call(ctx, SD_OP_READY, 0, 0, 0, &cqe);
}

_Static_assert(SHARD_FENCE_BYTES == SD_FENCE_BYTES, "the fence page's size");

int shard_fence(const shard_ctx_t *ctx, shard_fence_t *fence_p)
{
    if (ctx == NULL || fence_p == NULL)
        return SD_EINVAL;
    if (ctx->fence == NULL)
        return SD_ESTATE; /* not registered */
    *fence_p = (shard_fence_t){.page = ctx->fence,
                               .grad_seq = &ctx->fence->grad_seq,
                               .gather_seq = &ctx->fence->gather_seq,
                               .next_grad = ctx->grad_seq + 1,
                               .gathers = ctx->gathers,
                               .release_seq = &ctx->fence->release_seq,
                               .next_release = ctx->release_seq + 1};
    return SD_OK;
}

uint32_t shard_num_units(const shard_ctx_t *ctx)
{
    return ctx && ctx->registered ? ctx->n_units : 0;
}

int shard_unit_info(const shard_ctx_t *ctx, uint32_t unit, shard_unit_info_t *info_p)
{
    if (ctx == NULL || !ctx->registered || info_p == NULL || unit >= ctx->n_units)
        return SD_EINVAL;
    *info_p = ctx->units[unit];
    return SD_OK;
}

int shard_tensor_info(const shard_ctx_t *ctx, uint32_t tensor, shard_tensor_info_t *info_p)
{
    if (ctx == NULL || !ctx->registered || info_p == NULL || tensor >= ctx->n_tensors)
        return SD_EINVAL;
    *info_p = ctx->tensors[tensor];
    return SD_OK;
}

/* ---- data path */

int shard_fetch_async(shard_ctx_t *ctx, uint32_t unit, shard_req_t *req_p)
{
    int status = check_attached(ctx, "fetch", true);
    if (status != SD_OK)
        return status;
    if (req_p == NULL)
        return fail(ctx, SD_EINVAL, "fetch: req_p is NULL");
    return post(ctx, SD_OP_FETCH, unit, 0, 0, req_p);
}

int shard_wait(shard_ctx_t *ctx, shard_req_t req, const void **data_p)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "wait", false);
    if (status != SD_OK)
        return status;
    uint32_t unit = ctx->req_unit[req & RING_MASK];
    bool aside = ctx->req_aside[req & RING_MASK];
    status = wait_tag(ctx, req, &cqe);
    if (status != SD_OK)
        return status;
    if (cqe.op == SD_OP_FETCH && ctx->fence != NULL) {
        /* the daemon counts its answers on the fence page before it sends them */
        uint32_t seen = sd_fence_load(&ctx->fence->gather_seq);
        if (!sd_fence_reached(seen, ++ctx->gathers))
            return fail(ctx, SD_EPROTO,
                        "fetch unit %u: answer %u arrived, but the fence page counts %u (shardd "
                        "writes it before each answer)",
                        unit, ctx->gathers, seen);
    }
    if (data_p != NULL && cqe.op == SD_OP_FETCH) {
        if (cqe.value0 > ctx->pool_bytes || cqe.value1 > ctx->pool_bytes - cqe.value0)
            return fail(ctx, SD_EPROTO, "fetch: slot [%llu, +%llu) outside the pool",
                        (unsigned long long)cqe.value0, (unsigned long long)cqe.value1);
        *data_p = ctx->pool + cqe.value0;
        if (unit < ctx->n_units && ctx->unit_at != NULL)
            ctx->unit_at[unit] = cqe.value0;
    }
    if (cqe.op == SD_OP_FETCH && !aside && unit < ctx->n_units && ctx->holds != NULL)
        ctx->holds[unit]++;
    return SD_OK;
}

/* a fetch and its wait; flags: 0 or SD_OP_ASIDE */
static int fetch_wait(shard_ctx_t *ctx, uint32_t unit, uint64_t flags, const void **data_p)
{
    shard_req_t req;
    int status = check_attached(ctx, "fetch", true);
    if (status != SD_OK)
        return status;
    if ((status = post(ctx, SD_OP_FETCH, unit, flags, 0, &req)) != SD_OK)
        return status;
    return shard_wait(ctx, req, data_p);
}

enum { SIGNAL_NONE, SIGNAL_STREAM, SIGNAL_CALLER };

/* have `stream` write value into word of the fence page after the work queued on it */
static int signal_on_stream(shard_ctx_t *ctx, const char *what, uint32_t unit, void *stream,
                            uint32_t *word, uint32_t value)
{
    if (ctx->mem->stream_write == NULL)
        return fail(ctx, SD_EINVAL,
                    "%s unit %u: the job's memory is %s, which has no streams (pass NULL: "
                    "signalled when the call is made)",
                    what, unit, ctx->mem->name);
    char why[512];
    int status = ctx->mem->stream_write(stream, word, value, why, sizeof(why));
    return status != 0 ? fail(ctx, status, "%s unit %u: %s", what, unit, why) : SD_OK;
}

/* A release of a unit this rank holds returns once it is posted: shardd takes the ring's
 * requests in order, so the next fetch finds the slot released, and this rank does not wait for
 * the daemon to be scheduled (on a node whose cores the trainers fill, that wait was 3% of a
 * rank's time). Its failure (the job's) is the next call's. A release this rank does not hold
 * by its own count is answered (ENOTHELD, named as before); so is one past half the ring in
 * flight, which makes room. */
static int release_detached(shard_ctx_t *ctx, uint32_t unit)
{
    struct sd_cqe cqe;
    if (ctx->detached >= SD_RING_ENTRIES / 2) {
        int status = call(ctx, SD_OP_RELEASE, unit, 0, 0, &cqe);
        if (status == SD_OK)
            ctx->holds[unit]--;
        return status;
    }
    uint64_t tag;
    int status = post(ctx, SD_OP_RELEASE, unit, 0, 0, &tag);
    if (status != SD_OK)
        return status;
    ctx->req_state[tag & RING_MASK] = REQ_DETACHED;
    ctx->detached++;
    ctx->holds[unit]--;
    return SD_OK;
}

/* signal SIGNAL_STREAM: the release is signalled on the fence page by `stream`, after the work
 * queued on it so far (the reads of the unit's slot); SIGNAL_CALLER: by the caller. The daemon
 * keeps the slot until the page counts it. */
static int release(shard_ctx_t *ctx, uint32_t unit, uint64_t flags, int signal, void *stream)
{
    const char *what = flags & SD_OP_ASIDE ? "release_aside" : "release";
    struct sd_cqe cqe;
    int status = check_attached(ctx, what, true);
    if (status != SD_OK)
        return status;
    bool held = !(flags & SD_OP_ASIDE) && unit < ctx->n_units && ctx->holds[unit] > 0;
    if (signal == SIGNAL_NONE || (signal == SIGNAL_STREAM && stream == NULL)) {
        if (held)
            return release_detached(ctx, unit);
        return call(ctx, SD_OP_RELEASE, unit, flags, 0, &cqe);
    }
    uint32_t seq = ctx->release_seq + 1;
    if (signal == SIGNAL_STREAM) {
        char on[32];
        snprintf(on, sizeof(on), "%s_on_stream", what);
        status = signal_on_stream(ctx, on, unit, stream, &ctx->fence->release_seq, seq);
        if (status != SD_OK)
            return status;
    }
    ctx->release_seq = seq; /* signalled whatever the daemon answers */
    status = call(ctx, SD_OP_RELEASE, unit, flags | SD_RELEASE_SIGNAL_LATER, seq, &cqe);
    if (status == SD_OK && held)
        ctx->holds[unit]--;
    return status;
}

/* The detached releases' answers, before the daemon hears the rank detach (it takes the
 * socket's message before what the ring still holds): a second at most */
static void reap_detached(shard_ctx_t *ctx)
{
    struct sd_cqe cqe;
    uint64_t keep = ctx->wait_timeout_ms;
    ctx->wait_timeout_ms = SD_MIN(keep, 1000);
    for (uint32_t i = 0; i < SD_RING_ENTRIES && ctx->detached > 0; i++) {
        if (ctx->req_state[i] != REQ_DETACHED)
            continue;
        ctx->req_state[i] = REQ_INFLIGHT;
        ctx->detached--;
        if (wait_tag(ctx, ctx->req_tag[i], &cqe) == SD_ECONNRESET)
            break;
    }
    ctx->wait_timeout_ms = keep;
}

/* ---- one call per operation (shard_op_param_t); the named variants are these */

/* the flags param gives (0 without SHARD_OP_ATTR_FLAGS, or without param) */
static uint32_t op_flags(const shard_op_param_t *param)
{
    return param != NULL && (param->op_attr_mask & SHARD_OP_ATTR_FLAGS) ? param->flags : 0;
}

/* the name of the lowest bit of got that allowed lacks ("(unknown)" past names), or NULL */
static const char *stray_bit(uint32_t got, uint32_t allowed, const char *const *names, uint32_t n)
{
    uint32_t stray = got & ~allowed;
    if (stray == 0)
        return NULL;
    uint32_t b = (uint32_t)__builtin_ctz(stray);
    return b < n ? names[b] : "(unknown)";
}

/* param's mask and flags against what the call takes: SD_OK, or SD_EINVAL naming the first bit
 * it does not */
static int op_param(shard_ctx_t *ctx, const char *what, uint32_t unit,
                    const shard_op_param_t *param, uint32_t attrs, uint32_t flags)
{
    static const char *const attr_name[] = {"SHARD_OP_ATTR_FLAGS", "SHARD_OP_ATTR_STREAM",
                                            "SHARD_OP_ATTR_GRAD", "SHARD_OP_ATTR_REQUEST"};
    static const char *const flag_name[] = {"SHARD_OP_FLAG_ASIDE", "SHARD_OP_FLAG_ASYNC",
                                            "SHARD_OP_FLAG_SIGNALLED", "SHARD_OP_FLAG_STAGED"};
    if (param == NULL)
        return SD_OK;
    const char *bad = stray_bit(param->op_attr_mask, attrs, attr_name, 4);
    if (bad != NULL)
        return fail(ctx, SD_EINVAL, "%s unit %u: op_attr_mask bit %s is not one %s takes", what,
                    unit, bad, what);
    bad = stray_bit(op_flags(param), flags, flag_name, 4);
    if (bad != NULL)
        return fail(ctx, SD_EINVAL, "%s unit %u: flag %s is not one %s takes", what, unit, bad,
                    what);
    return SD_OK;
}

int shard_fetchx(shard_ctx_t *ctx, uint32_t unit, const shard_op_param_t *param,
                 const void **data_p)
{
    uint32_t flags = op_flags(param);
    int status = check_attached(ctx, "fetch", true);
    if (status == SD_OK)
        status = op_param(ctx, "fetch", unit, param, SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_REQUEST,
                          SHARD_OP_FLAG_ASIDE | SHARD_OP_FLAG_ASYNC);
    if (status != SD_OK)
        return status;
    if (!(flags & SHARD_OP_FLAG_ASYNC))
        return fetch_wait(ctx, unit, flags & SHARD_OP_FLAG_ASIDE ? SD_OP_ASIDE : 0, data_p);
    if (flags & SHARD_OP_FLAG_ASIDE)
        return fail(ctx, SD_EINVAL,
                    "fetch unit %u: SHARD_OP_FLAG_ASYNC with SHARD_OP_FLAG_ASIDE (a fetch aside "
                    "is waited for)",
                    unit);
    if (!(param->op_attr_mask & SHARD_OP_ATTR_REQUEST) || param->req_p == NULL)
        return fail(ctx, SD_EINVAL,
                    "fetch unit %u: SHARD_OP_FLAG_ASYNC needs req_p (SHARD_OP_ATTR_REQUEST)", unit);
    return shard_fetch_async(ctx, unit, param->req_p);
}

int shard_releasex(shard_ctx_t *ctx, uint32_t unit, const shard_op_param_t *param)
{
    uint32_t flags = op_flags(param);
    int status = check_attached(ctx, "release", true);
    if (status == SD_OK)
        status = op_param(ctx, "release", unit, param, SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_STREAM,
                          SHARD_OP_FLAG_ASIDE | SHARD_OP_FLAG_SIGNALLED);
    if (status != SD_OK)
        return status;
    bool on_stream = param != NULL && (param->op_attr_mask & SHARD_OP_ATTR_STREAM);
    if (on_stream && (flags & SHARD_OP_FLAG_SIGNALLED))
        return fail(ctx, SD_EINVAL,
                    "release unit %u: a stream (SHARD_OP_ATTR_STREAM) and "
                    "SHARD_OP_FLAG_SIGNALLED: one signals",
                    unit);
    uint64_t aside = flags & SHARD_OP_FLAG_ASIDE ? SD_OP_ASIDE : 0;
    if (on_stream)
        return release(ctx, unit, aside, SIGNAL_STREAM, param->stream);
    return release(ctx, unit, aside, flags & SHARD_OP_FLAG_SIGNALLED ? SIGNAL_CALLER : SIGNAL_NONE,
                   NULL);
}

int shard_fetch(shard_ctx_t *ctx, uint32_t unit, const void **data_p)
{
    return shard_fetchx(ctx, unit, NULL, data_p);
}

int shard_release(shard_ctx_t *ctx, uint32_t unit)
{
    return shard_releasex(ctx, unit, NULL);
}

int shard_release_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_STREAM, .stream = stream};
    return shard_releasex(ctx, unit, &p);
}

int shard_release_signalled(shard_ctx_t *ctx, uint32_t unit)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_SIGNALLED};
    return shard_releasex(ctx, unit, &p);
}

int shard_fetch_aside(shard_ctx_t *ctx, uint32_t unit, const void **data_p)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_ASIDE};
    return shard_fetchx(ctx, unit, &p, data_p);
}

int shard_release_aside(shard_ctx_t *ctx, uint32_t unit)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_ASIDE};
    return shard_releasex(ctx, unit, &p);
}

int shard_release_aside_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_STREAM,
                          .flags = SHARD_OP_FLAG_ASIDE,
                          .stream = stream};
    return shard_releasex(ctx, unit, &p);
}

/* staging slot i of this rank */
static uint8_t *staging_slot(const shard_ctx_t *ctx, uint32_t i)
{
    return ctx->staging + (size_t)i * ctx->staging_slot_bytes;
}

/* Wait for the push that occupies staging slot i; remember the first error. */
static void reap_push(shard_ctx_t *ctx, uint32_t i)
{
    struct sd_cqe cqe;
    if (!ctx->slot_busy[i])
        return;
    ctx->slot_busy[i] = false;
    int status = wait_tag(ctx, ctx->slot_tag[i], &cqe);
    if (status != SD_OK && ctx->push_status == SD_OK) {
        ctx->push_status = status;
        snprintf(ctx->push_err, sizeof(ctx->push_err), "%s", ctx->err);
    }
}

/* The staging slot the next push goes through, once the push that used it last is reduced; the
 * slot the caller holds (shard_grad_buffer) is skipped. */
static int take_staging(shard_ctx_t *ctx, const char *what, uint32_t unit, uint32_t *slot_p)
{
    uint32_t i = ctx->next_staging;
    if (ctx->held_unit >= 0 && i == ctx->held_slot) {
        if (ctx->staging_slots == 1)
            return fail(ctx, SD_EBUSY,
                        "%s unit %u: the only staging slot holds unit %lld's gradient buffer, not "
                        "pushed yet (shard_push_staged)",
                        what, unit, (long long)ctx->held_unit);
        i = (i + 1) % ctx->staging_slots;
    }
    ctx->next_staging = (i + 1) % ctx->staging_slots;
    reap_push(ctx, i);
    *slot_p = i;
    return SD_OK;
}

/* hand staging slot i, holding the unit's gradient, to the daemon; signal_later: the caller's
 * stream signals it on the fence page, and the daemon waits for that */
static int push_slot(shard_ctx_t *ctx, uint32_t unit, uint32_t i, bool signal_later)
{
    /* the gradient is in the slot: say so on the fence page before the daemon hears of it */
    ++ctx->grad_seq;
    if (!signal_later)
        sd_fence_store(&ctx->fence->grad_seq, ctx->grad_seq);
    uint64_t arg0 =
        i | (signal_later ? SD_PUSH_SIGNAL_LATER : 0) | (ctx->last_micro ? SD_PUSH_LAST : 0);
    int status = post(ctx, SD_OP_PUSH, unit, arg0, ctx->units[unit].bytes, &ctx->slot_tag[i]);
    if (status == SD_OK)
        ctx->slot_busy[i] = true;
    return status;
}

static int check_push_unit(shard_ctx_t *ctx, const char *what, uint32_t unit)
{
    int status = check_attached(ctx, what, true);
    if (status != SD_OK)
        return status;
    if (unit >= ctx->n_units)
        return fail(ctx, SD_ENOUNIT, "%s: unit %u does not exist (units 0..%u)", what, unit,
                    ctx->n_units - 1);
    return SD_OK;
}

int shard_grad_buffer(shard_ctx_t *ctx, uint32_t unit, void **buf_p)
{
    int status = check_push_unit(ctx, "grad_buffer", unit);
    if (status != SD_OK)
        return status;
    if (buf_p == NULL)
        return fail(ctx, SD_EINVAL, "grad_buffer unit %u: buf_p is NULL", unit);
    if (ctx->held_unit >= 0 && ctx->held_unit != (int64_t)unit)
        return fail(ctx, SD_EBUSY,
                    "grad_buffer unit %u: unit %lld's gradient buffer is held and not pushed yet "
                    "(shard_push_staged it first)",
                    unit, (long long)ctx->held_unit);
    if (ctx->held_unit < 0) {
        uint32_t i;
        status = take_staging(ctx, "grad_buffer", unit, &i);
        if (status != SD_OK)
            return status;
        ctx->held_unit = unit;
        ctx->held_slot = i;
    }
    *buf_p = staging_slot(ctx, ctx->held_slot);
    return SD_OK;
}

static int push_held(shard_ctx_t *ctx, const char *what, uint32_t unit, bool signal_later)
{
    int status = check_push_unit(ctx, what, unit);
    if (status != SD_OK)
        return status;
    if (ctx->held_unit != (int64_t)unit) {
        if (ctx->held_unit < 0)
            return fail(ctx, SD_ESTATE,
                        "%s unit %u: no gradient buffer is held (shard_grad_buffer "
                        "first)",
                        what, unit);
        return fail(ctx, SD_ESTATE, "%s unit %u: the gradient buffer held is unit %lld's", what,
                    unit, (long long)ctx->held_unit);
    }
    ctx->held_unit = -1;
    return push_slot(ctx, unit, ctx->held_slot, signal_later);
}

static int push_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream)
{
    const char *what = "push_staged_on_stream";
    int status = check_push_unit(ctx, what, unit);
    if (status != SD_OK)
        return status;
    if (ctx->held_unit != (int64_t)unit) /* push_held names what is wrong */
        return push_held(ctx, what, unit, false);
    if (stream == NULL)
        return push_held(ctx, what, unit, false);
    status = signal_on_stream(ctx, what, unit, stream, &ctx->fence->grad_seq, ctx->grad_seq + 1);
    return status != SD_OK ? status : push_held(ctx, what, unit, true);
}

static int push_copy(shard_ctx_t *ctx, uint32_t unit, const void *grad, size_t bytes)
{
    int status = check_push_unit(ctx, "push_grad", unit);
    if (status != SD_OK)
        return status;
    if (grad == NULL || bytes != ctx->units[unit].bytes)
        return fail(ctx, SD_EMSGSIZE,
                    "push_grad unit %u: gradient is %zu bytes but the unit is %llu bytes (%llu "
                    "%s elements, padded; see shard_unit_info)",
                    unit, grad ? bytes : 0, (unsigned long long)ctx->units[unit].bytes,
                    (unsigned long long)ctx->units[unit].numel,
                    sd_dtype_name((int)ctx->units[unit].dtype));
    uint32_t i;
    status = take_staging(ctx, "push_grad", unit, &i);
    if (status != SD_OK)
        return status;
    char why[512];
    status = ctx->mem->copy(staging_slot(ctx, i), grad, bytes, why, sizeof(why));
    if (status != 0)
        return fail(ctx, status, "push_grad unit %u: %s", unit, why);
    return push_slot(ctx, unit, i, false);
}

int shard_pushx(shard_ctx_t *ctx, uint32_t unit, const shard_op_param_t *param)
{
    uint32_t mask = param != NULL ? param->op_attr_mask : 0, given = op_flags(param);
    bool grad = mask & SHARD_OP_ATTR_GRAD, on_stream = mask & SHARD_OP_ATTR_STREAM;
    bool staged = given & SHARD_OP_FLAG_STAGED, signalled = given & SHARD_OP_FLAG_SIGNALLED;
    /* the name the variant of these parameters has, in every message */
    const char *what = grad        ? "push_grad"
                       : !staged   ? "push"
                       : on_stream ? "push_staged_on_stream"
                       : signalled ? "push_staged_signalled"
                                   : "push_staged";
    int status = check_push_unit(ctx, what, unit);
    if (status == SD_OK)
        status = op_param(ctx, what, unit, param,
                          SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_STREAM | SHARD_OP_ATTR_GRAD,
                          SHARD_OP_FLAG_STAGED | SHARD_OP_FLAG_SIGNALLED);
    if (status != SD_OK)
        return status;
    if (grad == staged)
        return fail(ctx, SD_EINVAL,
                    grad ? "push unit %u: SHARD_OP_ATTR_GRAD (a gradient to copy) with "
                           "SHARD_OP_FLAG_STAGED (the buffer held): one of them"
                         : "push unit %u: needs SHARD_OP_ATTR_GRAD (grad, bytes) or "
                           "SHARD_OP_FLAG_STAGED (the buffer of shard_grad_buffer)",
                    unit);
    if (grad) {
        if (on_stream || signalled)
            return fail(ctx, SD_EINVAL,
                        "push unit %u: a gradient copied at the call (SHARD_OP_ATTR_GRAD) takes "
                        "no stream and no SHARD_OP_FLAG_SIGNALLED (stage it: "
                        "SHARD_OP_FLAG_STAGED)",
                        unit);
        return push_copy(ctx, unit, param->grad, param->bytes);
    }
    if (on_stream && signalled)
        return fail(ctx, SD_EINVAL,
                    "push unit %u: a stream (SHARD_OP_ATTR_STREAM) and SHARD_OP_FLAG_SIGNALLED: "
                    "one signals",
                    unit);
    if (on_stream)
        return push_on_stream(ctx, unit, param->stream);
    return push_held(ctx, what, unit, signalled);
}

int shard_push_grad(shard_ctx_t *ctx, uint32_t unit, const void *grad, size_t bytes)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_GRAD, .grad = grad, .bytes = bytes};
    return shard_pushx(ctx, unit, &p);
}

int shard_push_staged(shard_ctx_t *ctx, uint32_t unit)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS, .flags = SHARD_OP_FLAG_STAGED};
    return shard_pushx(ctx, unit, &p);
}

int shard_push_staged_signalled(shard_ctx_t *ctx, uint32_t unit)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS,
                          .flags = SHARD_OP_FLAG_STAGED | SHARD_OP_FLAG_SIGNALLED};
    return shard_pushx(ctx, unit, &p);
}

int shard_push_staged_on_stream(shard_ctx_t *ctx, uint32_t unit, void *stream)
{
    shard_op_param_t p = {.op_attr_mask = SHARD_OP_ATTR_FLAGS | SHARD_OP_ATTR_STREAM,
                          .flags = SHARD_OP_FLAG_STAGED,
                          .stream = stream};
    return shard_pushx(ctx, unit, &p);
}

int shard__push_flush(shard_ctx_t *ctx)
{
    int status = check_attached(ctx, "push_flush", true);
    if (status != SD_OK)
        return status;
    for (uint32_t i = 0; i < ctx->staging_slots; i++)
        reap_push(ctx, i);
    if (ctx->push_status != SD_OK) {
        status = ctx->push_status;
        ctx->push_status = SD_OK;
        return fail(ctx, status, "an earlier push failed: %s", ctx->push_err);
    }
    return SD_OK;
}

struct sd_ring_hdr *shard__ring(shard_ctx_t *ctx)
{
    return ctx != NULL ? ctx->ring : NULL;
}

int shard__drop(shard_ctx_t *ctx, uint32_t unit)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "drop", true);
    if (status != SD_OK)
        return status;
    return call(ctx, SD_OP_DROP, unit, 0, 0, &cqe);
}

static uint8_t *bcast_area(shard_ctx_t *ctx)
{
    return ctx->control + ctx->step_args_off +
           sd_step_args_bcast_off(ctx->n_groups, ctx->n_tensors);
}

/* The step's arguments into the staging map; the flags that say what was written. */
static int write_step_args(shard_ctx_t *ctx, const shard_step_args_t *a, uint32_t *flags_p)
{
    *flags_p = 0;
    if (a == NULL)
        return SD_OK;
    uint8_t *area = ctx->control + ctx->step_args_off;
    struct sd_step_args hdr = {.n_groups = ctx->n_groups, .n_tensors = ctx->n_tensors};
    if (a->groups != NULL) {
        if (a->n_groups != ctx->n_groups)
            return fail(ctx, SD_EINVAL, "step: %u groups' hyperparameters; the model has %u",
                        a->n_groups, ctx->n_groups);
        for (uint32_t g = 0; g < a->n_groups; g++) {
            char err[128];
            struct sd_hparams h;
            memcpy(&h, &a->groups[g], sizeof(h));
            if (sd_hparams_validate(ctx->optim_kind, &h, g, err, sizeof(err)) != SD_OK)
                return fail(ctx, SD_EINVAL, "step: %s", err);
        }
        memcpy(area + sizeof(hdr), a->groups, (size_t)a->n_groups * sizeof(*a->groups));
        *flags_p |= SD_STEP_ARG_HPARAMS;
    }
    if (a->has_grad != NULL) {
        if (a->n_tensors != ctx->n_tensors)
            return fail(ctx, SD_EINVAL, "step: has_grad for %u tensors; the model has %u",
                        a->n_tensors, ctx->n_tensors);
        memcpy(area + sizeof(hdr) + (size_t)ctx->n_groups * sizeof(shard_hparams_t), a->has_grad,
               a->n_tensors);
        *flags_p |= SD_STEP_ARG_HAS_GRAD;
    }
    if (a->bcast != NULL) {
        if (a->bcast_bytes != ctx->bcast_bytes)
            return fail(ctx, SD_EINVAL,
                        "step: %llu bytes to broadcast; the model registered bcast_bytes %llu",
                        (unsigned long long)a->bcast_bytes, (unsigned long long)ctx->bcast_bytes);
        if (ctx->rank == 0)
            memcpy(bcast_area(ctx), a->bcast, a->bcast_bytes);
        *flags_p |= SD_STEP_ARG_BCAST;
    }
    memcpy(area, &hdr, sizeof(hdr));
    return SD_OK;
}

const char *shard_memory(const shard_ctx_t *ctx)
{
    return ctx != NULL && ctx->registered && ctx->mem != NULL ? ctx->mem->name : NULL;
}

unsigned long long shard_device_syncs(void)
{
    return sd_devmem_waits;
}

const char *shard_device_uuid(const shard_ctx_t *ctx)
{
    return ctx != NULL && ctx->registered && ctx->mem != NULL ? ctx->device_uuid : NULL;
}

int shard_copy(shard_ctx_t *ctx, void *dst, const void *src, size_t bytes)
{
    int status = check_attached(ctx, "copy", true);
    if (status != SD_OK)
        return status;
    if ((dst == NULL || src == NULL) && bytes > 0)
        return fail(ctx, SD_EINVAL, "copy: a NULL buffer");
    uintptr_t d = (uintptr_t)dst, pool = (uintptr_t)ctx->pool;
    if (bytes > 0 && d < pool + ctx->pool_bytes && d + bytes > pool)
        return fail(ctx, SD_EPERM, "copy: the destination is in the gather pool (read-only)");
    char why[512];
    status = ctx->mem->copy(dst, src, bytes, why, sizeof(why));
    return status == 0 ? SD_OK : fail(ctx, status, "copy: %s", why);
}

void *shard__step_args(shard_ctx_t *ctx)
{
    return ctx != NULL && ctx->registered ? ctx->control + ctx->step_args_off : NULL;
}

int shard_group_hparams(const shard_ctx_t *ctx, uint32_t group, shard_hparams_t *h_p)
{
    if (ctx == NULL || !ctx->registered || h_p == NULL || group >= ctx->n_groups)
        return SD_EINVAL;
    *h_p = ctx->hparams[group];
    return SD_OK;
}

/* Before a step or a save: no gradient buffer held (hint says what to do), every push reduced;
 * an error names the call (what) */
static int settle_pushes(shard_ctx_t *ctx, const char *what, const char *hint)
{
    if (ctx->held_unit >= 0)
        return fail(ctx, SD_EBUSY, "%s: unit %lld's gradient buffer is held and not pushed%s", what,
                    (long long)ctx->held_unit, hint);
    int status = shard__push_flush(ctx);
    if (status != SD_OK) {
        char why[sizeof(ctx->err)];
        memcpy(why, ctx->err, sizeof(why));
        return fail(ctx, status, "%s: %s", what, why);
    }
    return SD_OK;
}

int shard_last_micro_step(shard_ctx_t *ctx, int last)
{
    if (ctx == NULL)
        return SD_EINVAL;
    int status = check_attached(ctx, "last_micro_step", true);
    if (status != SD_OK)
        return status;
    ctx->last_micro = last != 0;
    return SD_OK;
}

int shard_step(shard_ctx_t *ctx, double *grad_norm_p)
{
    return shard_step_ex(ctx, NULL, grad_norm_p);
}

int shard_step_ex(shard_ctx_t *ctx, const shard_step_args_t *args, double *grad_norm_p)
{
    return shard_step_scaled(ctx, args, 1.0, grad_norm_p);
}

int shard_step_scaled(shard_ctx_t *ctx, const shard_step_args_t *args, double loss_scale,
                      double *grad_norm_p)
{
    struct sd_cqe cqe;
    if (ctx == NULL)
        return SD_EINVAL;
    int status = check_attached(ctx, "step", true);
    if (status != SD_OK)
        return status;
    if (!isfinite(loss_scale) || !(loss_scale >= DBL_MIN))
        return fail(ctx, SD_EINVAL,
                    "step: loss scale %g: it must be a finite positive number (the factor the "
                    "gradients were multiplied by)",
                    loss_scale);
    uint32_t flags;
    if ((status = write_step_args(ctx, args, &flags)) != SD_OK)
        return status;
    if ((status = settle_pushes(ctx, "step", " (shard_push_staged it first)")) != SD_OK)
        return status;
    ctx->last_micro = false; /* (whatever the step's outcome: the next step's pushes are new) */
    uint64_t scale_bits = 0;
    if (loss_scale != 1.0) {
        flags |= SD_STEP_ARG_SCALED;
        memcpy(&scale_bits, &loss_scale, sizeof(scale_bits));
    }
    status = call(ctx, SD_OP_STEP, 0, flags, scale_bits, &cqe);
    if (status == SD_OK && (flags & SD_STEP_ARG_HPARAMS))
        memcpy(ctx->hparams, args->groups, (size_t)ctx->n_groups * sizeof(*ctx->hparams));
    /* rank 0's bytes, which the daemon wrote before the step completed (also one skipped as
     * non-finite) */
    if ((status == SD_OK || status == SD_ENONFINITE) && (flags & SD_STEP_ARG_BCAST) &&
        ctx->rank != 0)
        memcpy(args->bcast, bcast_area(ctx), args->bcast_bytes);
    if (status == SD_OK && grad_norm_p != NULL) {
        double norm;
        memcpy(&norm, &cqe.value0, sizeof(norm));
        *grad_norm_p = norm;
    }
    if (status == SD_OK && sd_optim_in_trainer(ctx->optim_kind)) {
        memcpy(&ctx->grad_scale, &cqe.value1, sizeof(ctx->grad_scale));
        ctx->handoff = true;
    }
    return status;
}

void shard_scaler_init(shard_scaler_t *s)
{
    *s = (shard_scaler_t){
        .scale = 65536.0, .growth_factor = 2.0, .backoff_factor = 0.5, .growth_interval = 2000};
}

void shard_scaler_update(shard_scaler_t *s, int found_inf)
{
    if (found_inf) {
        s->scale = (float)(s->scale * s->backoff_factor);
        s->growth_tracker = 0;
        s->skipped++;
        return;
    }
    uint32_t taken = s->growth_tracker + 1; /* (torch's comparison: an interval 0 never grows) */
    if (taken != s->growth_interval) {
        s->growth_tracker = taken;
        return;
    }
    float grown = (float)(s->scale * s->growth_factor);
    if (isfinite(grown))
        s->scale = grown;
    s->growth_tracker = 0;
}

int shard_step_amp(shard_ctx_t *ctx, const shard_step_args_t *args, shard_scaler_t *s,
                   double *grad_norm_p)
{
    if (s == NULL)
        return ctx != NULL ? fail(ctx, SD_EINVAL, "step_amp: no scaler") : SD_EINVAL;
    int status = shard_step_scaled(ctx, args, s->scale, grad_norm_p);
    if (status == SD_OK || status == SD_ENONFINITE)
        shard_scaler_update(s, status == SD_ENONFINITE);
    return status;
}

/* the context is attached and registered, and unit one of its units */
static int attached_unit(shard_ctx_t *ctx, const char *op, uint32_t unit)
{
    int status = check_attached(ctx, op, true);
    if (status == SD_OK && unit >= ctx->n_units)
        status = fail(ctx, SD_ENOUNIT, "%s: unit %u does not exist (units 0..%u)", op, unit,
                      ctx->n_units - 1);
    return status;
}

double shard_step_grad_scale(const shard_ctx_t *ctx)
{
    return ctx != NULL && ctx->handoff ? ctx->grad_scale : 0.0;
}

int shard_step_update_done(shard_ctx_t *ctx, double *grad_norm_p)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "step_update_done", true);
    if (status != SD_OK)
        return status;
    if (!ctx->handoff)
        return fail(ctx, SD_ESTATE,
                    "step_update_done: no optimizer update is awaited (a trainer optimizer's "
                    "shard_step hands the gradients over first)");
    ctx->handoff = false;
    status = call(ctx, SD_OP_STEP, 0, SD_STEP_ARG_UPDATED, 0, &cqe);
    if (status == SD_OK && grad_norm_p != NULL)
        memcpy(grad_norm_p, &cqe.value0, sizeof(*grad_norm_p));
    return status;
}

int shard_read_own(shard_ctx_t *ctx, uint32_t unit, uint32_t what, float *out, size_t max,
                   uint64_t *first_p, uint64_t *count_p)
{
    struct sd_cqe cqe;
    char why[512];
    int status = attached_unit(ctx, "read_own", unit);
    if (status != SD_OK)
        return status;
    if (out == NULL || what > 0xffu)
        return fail(ctx, SD_EINVAL, "read_own unit %u: state %u into %p", unit, what, (void *)out);
    uint32_t i;
    if ((status = take_staging(ctx, "read_own", unit, &i)) != SD_OK)
        return status;
    status = call(ctx, SD_OP_READ, unit, i | (uint64_t)(what | SD_STATE_OWN) << 32, 0, &cqe);
    if (status != SD_OK)
        return status;
    if (cqe.value1 > max)
        return fail(ctx, SD_EINVAL, "read_own unit %u: the shard has %llu elements; out holds %zu",
                    unit, (unsigned long long)cqe.value1, max);
    status =
        ctx->mem->copy(out, staging_slot(ctx, i), cqe.value1 * sizeof(float), why, sizeof(why));
    if (status != 0)
        return fail(ctx, status, "read_own unit %u: %s", unit, why);
    if (first_p != NULL)
        *first_p = cqe.value0;
    if (count_p != NULL)
        *count_p = cqe.value1;
    return SD_OK;
}

int shard_write_own(shard_ctx_t *ctx, uint32_t unit, uint32_t what, const float *values,
                    size_t count)
{
    struct sd_cqe cqe;
    char why[512];
    int status = attached_unit(ctx, "write_own", unit);
    if (status != SD_OK)
        return status;
    if (values == NULL || what > 0xffu || count > ctx->units[unit].numel)
        return fail(ctx, SD_EINVAL, "write_own unit %u: state %u, %zu values%s (the unit has %llu)",
                    unit, what, count, values == NULL ? " at NULL" : "",
                    (unsigned long long)ctx->units[unit].numel);
    uint32_t i;
    if ((status = take_staging(ctx, "write_own", unit, &i)) != SD_OK)
        return status;
    status = ctx->mem->copy(staging_slot(ctx, i), values, count * sizeof(float), why, sizeof(why));
    if (status != 0)
        return fail(ctx, status, "write_own unit %u: %s", unit, why);
    return call(ctx, SD_OP_WRITE, unit, i | (uint64_t)(what | SD_STATE_OWN) << 32, count, &cqe);
}

int shard_write(shard_ctx_t *ctx, uint32_t tensor, uint32_t what, const float *values, size_t count)
{
    struct sd_cqe cqe;
    char why[512];
    int status = check_attached(ctx, "write", true);
    if (status != SD_OK)
        return status;
    if (tensor >= ctx->n_tensors)
        return fail(ctx, SD_EINVAL, "write: tensor %u does not exist (tensors 0..%u)", tensor,
                    ctx->n_tensors - 1);
    if (values == NULL || count != ctx->tensors[tensor].numel)
        return fail(ctx, SD_EINVAL, "write tensor %u: %zu values%s; it has %llu elements", tensor,
                    count, values == NULL ? " at NULL" : "",
                    (unsigned long long)ctx->tensors[tensor].numel);
    if (what == SD_WRITE_STEPS)
        return fail(ctx, SD_EINVAL, "write tensor %u: step counts go through shard_write_steps",
                    tensor);
    if ((status = settle_pushes(ctx, "write", "; write between steps")) != SD_OK)
        return status;
    uint32_t i;
    if ((status = take_staging(ctx, "write", tensor, &i)) != SD_OK)
        return status;
    float *slot = (float *)(void *)staging_slot(ctx, i);
    status = ctx->mem->copy(slot, values, count * sizeof(float), why, sizeof(why));
    if (status != 0)
        return fail(ctx, status, "write tensor %u: %s", tensor, why);
    return call(ctx, SD_OP_WRITE, tensor, i | (uint64_t)what << 32, count, &cqe);
}

int shard_write_steps(shard_ctx_t *ctx, uint32_t tensor, uint64_t steps)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "write_steps", true);
    if (status != SD_OK)
        return status;
    if (tensor >= ctx->n_tensors)
        return fail(ctx, SD_EINVAL, "write_steps: tensor %u does not exist (tensors 0..%u)", tensor,
                    ctx->n_tensors - 1);
    return call(ctx, SD_OP_WRITE, tensor, (uint64_t)SD_WRITE_STEPS << 32, steps, &cqe);
}

int shard_write_done(shard_ctx_t *ctx)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "write_done", true);
    if (status != SD_OK)
        return status;
    if ((status = settle_pushes(ctx, "write_done", "; write between steps")) != SD_OK)
        return status;
    return call(ctx, SD_OP_WRITTEN, 0, 0, 0, &cqe);
}

int shard_read(shard_ctx_t *ctx, uint32_t unit, uint32_t what, float *out, size_t count)
{
    struct sd_cqe cqe;
    char why[512];
    int status = attached_unit(ctx, "read", unit);
    if (status != SD_OK)
        return status;
    if (out == NULL || count != ctx->units[unit].numel || what == SD_WRITE_STEPS)
        return fail(ctx, SD_EINVAL, "read unit %u: %zu values%s; it has %llu elements", unit, count,
                    out == NULL ? " into NULL" : "", (unsigned long long)ctx->units[unit].numel);
    if ((status = settle_pushes(ctx, "read", "; read between steps")) != SD_OK)
        return status;
    uint32_t i;
    if ((status = take_staging(ctx, "read", unit, &i)) != SD_OK)
        return status;
    if ((status = call(ctx, SD_OP_READ, unit, i | (uint64_t)what << 32, 0, &cqe)) != SD_OK)
        return status;
    const float *slot = (const float *)(void *)staging_slot(ctx, i);
    status = ctx->mem->copy(out, slot, count * sizeof(float), why, sizeof(why));
    return status == 0 ? SD_OK : fail(ctx, status, "read unit %u: %s", unit, why);
}

int shard_read_steps(shard_ctx_t *ctx, uint32_t tensor, uint64_t *steps_p)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "read_steps", true);
    if (status != SD_OK)
        return status;
    if (tensor >= ctx->n_tensors || steps_p == NULL)
        return fail(ctx, SD_EINVAL, "read_steps: tensor %u (tensors 0..%u), steps_p %p", tensor,
                    ctx->n_tensors - 1, (void *)steps_p);
    status = call(ctx, SD_OP_READ, tensor, (uint64_t)SD_WRITE_STEPS << 32, 0, &cqe);
    if (status == SD_OK)
        *steps_p = cqe.value0;
    return status;
}

int shard_save(shard_ctx_t *ctx, const char *dir, uint64_t *step_p)
{
    struct sd_cqe cqe;
    int status = check_attached(ctx, "save", true);
    if (status != SD_OK)
        return status;
    if (dir == NULL || dir[0] == '\0')
        return fail(ctx, SD_EINVAL, "save: no directory given");
    char path[SD_CKPT_PATH_MAX];
    if ((status = absolute_path(ctx, "save", dir, path)) != SD_OK)
        return status;
    if ((status = settle_pushes(ctx, "save", "; save between steps")) != SD_OK)
        return status;
    size_t len = strlen(path);
    memcpy(ctx->control + ctx->save_path_off, path, len);
    status = call(ctx, SD_OP_SAVE, 0, len, 0, &cqe);
    if (status == SD_OK && step_p != NULL)
        *step_p = cqe.value0;
    return status;
}

uint32_t shard_crc32c(uint32_t crc, const void *data, size_t len)
{
    return sd_crc32c(crc, data, len);
}

uint64_t shard_start_step(const shard_ctx_t *ctx)
{
    return ctx != NULL ? ctx->start_step : 0;
}

int shard_resumed(const shard_ctx_t *ctx)
{
    return ctx != NULL && ctx->resumed;
}

int shard_detach(shard_ctx_t *ctx)
{
    if (ctx == NULL)
        return SD_EINVAL;
    if (ctx->sock >= 0 && ctx->ring != NULL) {
        reap_detached(ctx);
        Shard__Detach d = SHARD__DETACH__INIT;
        Shard__ClientMsg msg = SHARD__CLIENT_MSG__INIT;
        msg.msg_case = SHARD__CLIENT_MSG__MSG_DETACH;
        msg.detach = &d;
        sd_frame_send(ctx->sock, &msg.base, NULL, 0, 1000);
    }
    sd_wguard_remove(ctx->wguard);
    if (ctx->pool != NULL)
        ctx->mem->unmap((void *)ctx->pool, ctx->pool_bytes);
    free(ctx->unit_at);
    free(ctx->holds);
    if (ctx->staging != NULL)
        ctx->mem->unmap(ctx->staging, ctx->staging_bytes);
    if (ctx->control != NULL) {
        if (ctx->mem != NULL && ctx->mem->forget_host != NULL)
            ctx->mem->forget_host(ctx->control, ctx->control_bytes);
        munmap(ctx->control, ctx->control_bytes);
    }
    if (ctx->ring != NULL)
        munmap(ctx->ring, SD_RING_BYTES);
    if (ctx->sq_efd >= 0)
        close(ctx->sq_efd);
    if (ctx->cq_efd >= 0)
        close(ctx->cq_efd);
    if (ctx->sock >= 0)
        close(ctx->sock);
    free(ctx->units);
    free(ctx->tensors);
    free(ctx->hparams);
    free(ctx);
    return SD_OK;
}

static int admin_call(const char *socket_path, const char *command, const char *job,
                      const char *dir, int timeout_ms, char **json_p)
{
    if (command == NULL || json_p == NULL) {
        snprintf(attach_err, sizeof(attach_err), "admin: command and json_p must not be NULL");
        return SD_EINVAL;
    }
    *json_p = NULL;
    int fd;
    int status = shard__connect(socket_path, &fd, attach_err, sizeof(attach_err));
    if (status != SD_OK)
        return status;
    Shard__AdminRequest req = SHARD__ADMIN_REQUEST__INIT;
    req.command = (char *)command;
    req.job = (char *)(job ? job : "");
    req.dir = (char *)(dir ? dir : "");
    Shard__ClientMsg msg = SHARD__CLIENT_MSG__INIT;
    msg.msg_case = SHARD__CLIENT_MSG__MSG_ADMIN;
    msg.admin = &req;
    uint8_t *buf = NULL;
    size_t len;
    status = sd_frame_send(fd, &msg.base, NULL, 0, 5000);
    if (status == SD_OK)
        status = sd_frame_recv(fd, &buf, &len, NULL, 0, NULL, 64u << 20, timeout_ms);
    close(fd);
    if (status != SD_OK) {
        snprintf(attach_err, sizeof(attach_err), "admin %s: no answer from shardd: %s", command,
                 sd_status_str(status));
        return status;
    }
    Shard__DaemonMsg *rep = shard__daemon_msg__unpack(NULL, len, buf);
    free(buf);
    if (rep == NULL || (rep->msg_case != SHARD__DAEMON_MSG__MSG_ADMIN &&
                        rep->msg_case != SHARD__DAEMON_MSG__MSG_ERROR)) {
        snprintf(attach_err, sizeof(attach_err), "admin %s: unexpected reply from shardd", command);
        status = SD_EPROTO;
    } else if (rep->msg_case == SHARD__DAEMON_MSG__MSG_ERROR) {
        snprintf(attach_err, sizeof(attach_err), "admin %s: %s", command, rep->error->message);
        status = rep->error->status ? rep->error->status : SD_EPROTO;
    } else {
        status = rep->admin->status;
        *json_p = strdup(rep->admin->json ? rep->admin->json : "{}");
        if (*json_p == NULL)
            status = SD_ENOMEM;
        else if (status != SD_OK)
            snprintf(attach_err, sizeof(attach_err), "admin %s%s%s: %s", command,
                     job ? " --job " : "", job ? job : "", sd_status_str(status));
    }
    if (rep != NULL)
        shard__daemon_msg__free_unpacked(rep, NULL);
    return status;
}

int shard_admin(const char *socket_path, const char *command, const char *job, char **json_p)
{
    return admin_call(socket_path, command, job, NULL, 10000, json_p);
}

int shard_checkpoint_job(const char *socket_path, const char *job, const char *dir, char **json_p)
{
    if (job == NULL || job[0] == '\0' || dir == NULL || dir[0] == '\0') {
        snprintf(attach_err, sizeof(attach_err), "checkpoint: a job name and a directory needed");
        return SD_EINVAL;
    }
    /* the daemon answers within its own deadline (10 x op_timeout_ms at most) */
    return admin_call(socket_path, "checkpoint", job, dir, 3600 * 1000, json_p);
}

void shard_free(void *p)
{
    free(p);
}

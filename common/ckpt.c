/* Checkpoints: crc32c, the manifest (jansson), the reader of extents and the commit. */
#include "sd/ckpt.h"
#include "sd/safe_fs.h"
#include "sd/status.h"
#include "sd/util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- crc32c: slicing by 8 in software, the SSE4.2 instruction where the CPU has it */

static uint32_t crc_table[8][256];

static void crc_init_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int j = 0; j < 8; j++)
            c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

static uint32_t crc_soft(uint32_t c, const uint8_t *p, size_t n)
{
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= c;
        c = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
            crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
            crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
#endif

static int crc_mode; /* 1: software, 2: SSE4.2 */

static void crc_choose(void)
{
    crc_init_table();
    crc_mode = 1;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2"))
        crc_mode = 2;
#endif
}

uint32_t sd_crc32c(uint32_t crc, const void *data, size_t len)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT; /* the checkpoint threads call it at once */
    pthread_once(&once, crc_choose);
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (crc_mode == 2)
        return ~crc_hw(c, data, len);
#endif
    return ~crc_soft(c, data, len);
}

/* Polynomials over GF(2) modulo the CRC's, in its reflected form: bit 31 is x^0, bit 0 x^31. */
static uint32_t gf_mul(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (uint32_t m = 1u << 31; m != 0; m >>= 1) {
        if (a & m)
            p ^= b;
        b = b & 1 ? (b >> 1) ^ 0x82f63b78u : b >> 1; /* b * x */
    }
    return p;
}

/* The crc of A then B from crc(A), crc(B) and B's length: crc(A B) = crc(A) x^(8 len2) + crc(B)
 * mod P, the inversions at either end cancelling. */
uint32_t sd_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2)
{
    uint32_t pow = 1u << 31, sq = 1u << 23; /* x^0, and x^8: one byte of zeros */
    for (; len2 != 0; len2 >>= 1, sq = gf_mul(sq, sq))
        if (len2 & 1)
            pow = gf_mul(pow, sq);
    return gf_mul(pow, crc1) ^ crc2;
}

/* ---- states */

const char *sd_ckpt_state_name(int optim_kind, uint32_t s)
{
    static const char *const adamw[] = {"master", "exp_avg", "exp_avg_sq"};
    static const char *const sgd[] = {"master", "momentum_buffer"};
    static const char *const trainer[] = {"master", "state1", "state2", "state3", "state4"};
    if (sd_optim_in_trainer(optim_kind))
        return s < sd_optim_state_floats(optim_kind) ? trainer[s] : NULL;
    if (sd_optim_layout(optim_kind) == SD_OPTIM_ADAMW)
        return s < 3 ? adamw[s] : NULL;
    return s < 2 ? sgd[s] : NULL;
}

uint32_t sd_ckpt_states(int optim_kind)
{
    return sd_optim_state_floats(optim_kind);
}

/* ---- reading the manifest */

static bool get_u64(json_t *o, const char *key, uint64_t *v)
{
    json_t *j = json_object_get(o, key);
    if (!json_is_integer(j) || json_integer_value(j) < 0)
        return false;
    *v = (uint64_t)json_integer_value(j);
    return true;
}

static bool get_f32(json_t *o, const char *key, float *v)
{
    json_t *j = json_object_get(o, key);
    if (!json_is_number(j))
        return false;
    double d = json_number_value(j);
    /* past float's range it is an infinity (the conversion itself would be undefined), which
     * the checks of the value refuse */
    *v = d > FLT_MAX ? INFINITY : d < -FLT_MAX ? -INFINITY : (float)d;
    return true;
}

static bool get_str(json_t *o, const char *key, char *buf, size_t len)
{
    json_t *j = json_object_get(o, key);
    if (!json_is_string(j) || strlen(json_string_value(j)) >= len)
        return false;
    snprintf(buf, len, "%s", json_string_value(j));
    return true;
}

static const struct sd_ckpt *key_ck; /* qsort has no context: the extents come through it */

static int key_cmp(const void *a, const void *b)
{
    const struct sd_ckpt_extent *x = &key_ck->extents[*(const uint64_t *)a];
    const struct sd_ckpt_extent *y = &key_ck->extents[*(const uint64_t *)b];
    if (x->state != y->state)
        return x->state < y->state ? -1 : 1;
    if (x->tensor != y->tensor)
        return x->tensor < y->tensor ? -1 : 1;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* dir itself when it holds a MANIFEST, else the checkpoint dir/LATEST names: ck->path and
 * ck->dir_fd set */
static int resolve(const char *dir, struct sd_ckpt *ck, char *err, size_t errlen)
{
    if (strlen(dir) >= SD_CKPT_PATH_MAX - 320) {
        snprintf(err, errlen, "checkpoint path '%.64s...' is too long", dir);
        return SD_EINVAL;
    }
    int dfd = sd_fs_dir_open(dir, false, 0);
    if (dfd < 0) {
        snprintf(err, errlen, "%s: %s%s", dir,
                 dfd == -ENOENT ? "neither a checkpoint (no MANIFEST) nor a directory of them: "
                                : "",
                 strerror(-dfd));
        return dfd == -ENOENT ? SD_ENOENT : dfd;
    }
    struct stat st;
    if (fstatat(dfd, "MANIFEST", &st, AT_SYMLINK_NOFOLLOW) == 0) {
        snprintf(ck->path, sizeof(ck->path), "%s", dir);
        ck->dir_fd = dfd;
        ck->dir_open = true;
        return SD_OK;
    }
    char *latest = NULL, msg[512];
    size_t len = 0;
    int status = sd_fs_read_input(dfd, "LATEST", ck->owner, 4096, &latest, &len, msg, sizeof(msg));
    if (status == -ENOENT) {
        snprintf(err, errlen,
                 "%s: neither a checkpoint (no MANIFEST) nor a directory of them (no LATEST)", dir);
        close(dfd);
        return SD_ENOENT;
    }
    if (status != 0) {
        snprintf(err, errlen, "%s/%s", dir, msg);
        close(dfd);
        return status;
    }
    latest[strcspn(latest, "\r\n")] = '\0';
    if (!sd_fs_name_ok(latest) || latest[0] == '.' || strlen(latest) >= 256) {
        snprintf(err, errlen, "%s/LATEST: does not name a checkpoint in its directory ('%.64s')",
                 dir, latest);
        free(latest);
        close(dfd);
        return SD_EINVAL;
    }
    snprintf(ck->path, sizeof(ck->path), "%s/%s", dir, latest);
    int sub = sd_fs_subdir(dfd, latest);
    close(dfd);
    if (sub < 0) {
        snprintf(err, errlen, "%s/LATEST names '%s': %s%s", dir, latest, strerror(-sub),
                 sub == -ELOOP ? " (a symbolic link: not followed)" : "");
        free(latest);
        return sub == -ENOENT ? SD_ENOENT : sub;
    }
    free(latest);
    ck->dir_fd = sub;
    ck->dir_open = true;
    return SD_OK;
}

static int parse_tensors(json_t *arr, struct sd_ckpt *ck, char *err, size_t errlen)
{
    if (!json_is_array(arr) || json_array_size(arr) == 0 || json_array_size(arr) > SD_MAX_TENSORS) {
        snprintf(err, errlen, "\"tensors\" must be an array of 1..%d tensors", SD_MAX_TENSORS);
        return SD_EINVAL;
    }
    ck->n_tensors = (uint32_t)json_array_size(arr);
    ck->tensors = calloc(ck->n_tensors, sizeof(*ck->tensors));
    if (ck->tensors == NULL)
        return SD_ENOMEM;
    for (uint32_t t = 0; t < ck->n_tensors; t++) {
        json_t *o = json_array_get(arr, t);
        struct sd_ckpt_tensor *ct = &ck->tensors[t];
        char dtype[16];
        json_t *shape = json_object_get(o, "shape");
        uint64_t unit, group;
        if (!json_is_object(o) || !get_str(o, "name", ct->name, sizeof(ct->name)) ||
            !get_str(o, "dtype", dtype, sizeof(dtype)) || !json_is_array(shape) ||
            json_array_size(shape) > SD_MAX_DIMS || !get_u64(o, "unit", &unit) ||
            !get_u64(o, "group", &group) || !get_u64(o, "steps", &ct->steps)) {
            snprintf(err, errlen,
                     "tensor %u: needs \"name\", \"shape\" (at most %d dims), \"dtype\", "
                     "\"unit\", \"group\" and \"steps\"",
                     t, SD_MAX_DIMS);
            return SD_EINVAL;
        }
        ct->dtype = sd_dtype_parse(dtype);
        ct->unit = (uint32_t)unit;
        ct->group = (uint32_t)group;
        ct->ndim = (uint32_t)json_array_size(shape);
        ct->numel = 1;
        for (uint32_t d = 0; d < ct->ndim; d++) {
            json_t *v = json_array_get(shape, d);
            if (!json_is_integer(v) || json_integer_value(v) <= 0 ||
                json_integer_value(v) > (json_int_t)SD_MAX_MODEL_NUMEL ||
                ct->numel * (uint64_t)json_integer_value(v) > SD_MAX_MODEL_NUMEL) {
                snprintf(err, errlen, "tensor %u '%s': shape[%u] is not a positive size", t,
                         ct->name, d);
                return SD_EINVAL;
            }
            ct->dims[d] = (uint64_t)json_integer_value(v);
            ct->numel *= ct->dims[d];
        }
        if (ct->dtype < 0 || group >= SD_MAX_GROUPS) {
            snprintf(err, errlen, "tensor %u '%s': dtype '%s' or group %llu is not valid", t,
                     ct->name, dtype, (unsigned long long)group);
            return SD_EINVAL;
        }
    }
    return SD_OK;
}

static int parse_extents(json_t *arr, struct sd_ckpt *ck, char *err, size_t errlen)
{
    if (!json_is_array(arr)) {
        snprintf(err, errlen, "\"extents\" must be an array");
        return SD_EINVAL;
    }
    ck->n_extents = json_array_size(arr);
    ck->extents = calloc(ck->n_extents + 1, sizeof(*ck->extents));
    ck->by_key = calloc(ck->n_extents + 1, sizeof(*ck->by_key));
    if (ck->extents == NULL || ck->by_key == NULL)
        return SD_ENOMEM;
    for (uint64_t i = 0; i < ck->n_extents; i++) {
        json_t *o = json_array_get(arr, i);
        struct sd_ckpt_extent *x = &ck->extents[i];
        char state[32], file[64];
        json_t *range = json_object_get(o, "range");
        uint64_t tensor, crc;
        if (!json_is_object(o) || !get_str(o, "state", state, sizeof(state)) ||
            !get_u64(o, "tensor", &tensor) || !json_is_array(range) ||
            json_array_size(range) != 2 || !json_is_integer(json_array_get(range, 0)) ||
            !json_is_integer(json_array_get(range, 1)) || !get_str(o, "file", file, sizeof(file)) ||
            !get_u64(o, "offset", &x->file_off) || !get_u64(o, "crc32c", &crc) ||
            crc > UINT32_MAX) {
            snprintf(err, errlen,
                     "extent %llu: needs \"state\", \"tensor\", \"range\" [begin, end), \"file\", "
                     "\"offset\" and \"crc32c\"",
                     (unsigned long long)i);
            return SD_EINVAL;
        }
        x->crc = (uint32_t)crc;
        json_int_t b = json_integer_value(json_array_get(range, 0));
        json_int_t e = json_integer_value(json_array_get(range, 1));
        x->state = UINT32_MAX;
        for (uint32_t s = 0; s < ck->n_states; s++)
            if (strcmp(state, sd_ckpt_state_name(ck->optim_kind, s)) == 0)
                x->state = s;
        x->file = UINT32_MAX;
        for (uint32_t f = 0; f < ck->n_files; f++)
            if (strcmp(file, ck->files[f]) == 0)
                x->file = f;
        if (x->state == UINT32_MAX || x->file == UINT32_MAX || tensor >= ck->n_tensors || b < 0 ||
            e <= b || (uint64_t)e > ck->tensors[tensor].numel ||
            (uint64_t)(e - b) > SD_CKPT_EXTENT_ELEMS) {
            snprintf(err, errlen,
                     "extent %llu: state '%s', file '%s', tensor %llu or range [%lld, %lld) is "
                     "not one of this checkpoint's (ranges are at most %u elements)",
                     (unsigned long long)i, state, file, (unsigned long long)tensor, (long long)b,
                     (long long)e, SD_CKPT_EXTENT_ELEMS);
            return SD_EINVAL;
        }
        x->tensor = (uint32_t)tensor;
        x->begin = (uint64_t)b;
        x->end = (uint64_t)e;
        ck->bytes += (x->end - x->begin) * sizeof(float);
        ck->by_key[i] = i;
    }
    key_ck = ck;
    qsort(ck->by_key, ck->n_extents, sizeof(*ck->by_key), key_cmp);
    key_ck = NULL;
    /* every state of every tensor covered exactly once */
    uint64_t i = 0;
    for (uint32_t s = 0; s < ck->n_states; s++)
        for (uint32_t t = 0; t < ck->n_tensors; t++) {
            uint64_t at = 0;
            for (; i < ck->n_extents; i++) {
                const struct sd_ckpt_extent *x = &ck->extents[ck->by_key[i]];
                if (x->state != s || x->tensor != t)
                    break;
                if (x->begin != at) {
                    snprintf(err, errlen,
                             "%s of tensor %u '%s': elements [%llu, %llu) are %s by the extents",
                             sd_ckpt_state_name(ck->optim_kind, s), t, ck->tensors[t].name,
                             (unsigned long long)SD_MIN(at, x->begin),
                             (unsigned long long)SD_MAX(at, x->begin),
                             x->begin > at ? "missing" : "covered twice");
                    return SD_EINVAL;
                }
                at = x->end;
            }
            if (at != ck->tensors[t].numel) {
                snprintf(err, errlen, "%s of tensor %u '%s': elements [%llu, %llu) are missing",
                         sd_ckpt_state_name(ck->optim_kind, s), t, ck->tensors[t].name,
                         (unsigned long long)at, (unsigned long long)ck->tensors[t].numel);
                return SD_EINVAL;
            }
        }
    return SD_OK;
}

/* format, version, what wrote it, the optimizer */
static int parse_header(json_t *root, struct sd_ckpt *ck, char *err, size_t errlen)
{
    char format[32], kind[16];
    uint64_t version, step, world, k, nodes;
    json_t *opt = json_object_get(root, "optimizer");
    if (!get_str(root, "format", format, sizeof(format)) ||
        strcmp(format, SD_CKPT_FORMAT_NAME) != 0 || !get_u64(root, "version", &version)) {
        snprintf(err, errlen, "\"format\" is not \"%s\" with a \"version\"", SD_CKPT_FORMAT_NAME);
        return SD_EINVAL;
    }
    if (version != SD_CKPT_VERSION) {
        snprintf(err, errlen, "format version %llu; this shardd reads version %d",
                 (unsigned long long)version, SD_CKPT_VERSION);
        return SD_EINVAL;
    }
    if (!get_str(root, "job", ck->job, sizeof(ck->job)) ||
        !get_str(root, "plan", ck->plan, sizeof(ck->plan)) || !get_u64(root, "step", &step) ||
        !get_u64(root, "world", &world) || !get_u64(root, "ranks_per_node", &k) ||
        !get_u64(root, "nodes", &nodes) || !json_is_object(opt) ||
        !get_str(opt, "kind", kind, sizeof(kind)) ||
        !get_f32(opt, "max_grad_norm", &ck->max_grad_norm)) {
        snprintf(err, errlen,
                 "needs \"job\", \"plan\", \"step\", \"world\", \"ranks_per_node\", \"nodes\" "
                 "and \"optimizer\" {\"kind\", \"max_grad_norm\"}");
        return SD_EINVAL;
    }
    ck->step = step;
    ck->world = (uint32_t)world;
    ck->ranks_per_node = (uint32_t)k;
    ck->nodes = (uint32_t)nodes;
    ck->optim_kind = sd_optim_parse(kind);
    if (ck->optim_kind < 0) {
        snprintf(err, errlen, "optimizer kind '%.32s' is none of adamw, sgd, adam, sgd-nesterov",
                 kind);
        return SD_EINVAL;
    }
    ck->n_states = sd_ckpt_states(ck->optim_kind);
    if (!(ck->max_grad_norm >= 0.0f && ck->max_grad_norm <= 1e30f)) {
        snprintf(err, errlen, "optimizer: max_grad_norm is %g; it must be finite and in [0, 1e30]",
                 (double)ck->max_grad_norm);
        return SD_EINVAL;
    }
    return SD_OK;
}

static int parse_groups(json_t *groups, struct sd_ckpt *ck, char *err, size_t errlen)
{
    if (!json_is_array(groups) || json_array_size(groups) == 0 ||
        json_array_size(groups) > SD_MAX_GROUPS) {
        snprintf(err, errlen, "\"groups\" must be an array of 1..%d parameter groups",
                 SD_MAX_GROUPS);
        return SD_EINVAL;
    }
    ck->n_groups = (uint32_t)json_array_size(groups);
    ck->groups = calloc(ck->n_groups, sizeof(*ck->groups));
    if (ck->groups == NULL) {
        snprintf(err, errlen, "out of memory");
        return SD_ENOMEM;
    }
    for (uint32_t g = 0; g < ck->n_groups; g++) {
        json_t *o = json_array_get(groups, g);
        struct sd_hparams *h = &ck->groups[g];
        if (!get_f32(o, "lr", &h->lr) || !get_f32(o, "beta1", &h->beta1) ||
            !get_f32(o, "beta2", &h->beta2) || !get_f32(o, "eps", &h->eps) ||
            !get_f32(o, "weight_decay", &h->weight_decay) ||
            !get_f32(o, "momentum", &h->momentum)) {
            snprintf(err, errlen,
                     "group %u: needs \"lr\", \"beta1\", \"beta2\", \"eps\", "
                     "\"weight_decay\" and \"momentum\"",
                     g);
            return SD_EINVAL;
        }
        /* the same bounds as a registration's: a checkpoint is input like any other */
        int st = sd_hparams_validate(ck->optim_kind, h, g, err, errlen);
        if (st != SD_OK)
            return st;
    }
    return SD_OK;
}

static int parse_files(json_t *files, struct sd_ckpt *ck, char *err, size_t errlen)
{
    if (!json_is_array(files) || json_array_size(files) > SD_MAX_WORLD) {
        snprintf(err, errlen, "\"files\" must be an array of file names");
        return SD_EINVAL;
    }
    ck->n_files = (uint32_t)json_array_size(files);
    ck->files = calloc(ck->n_files + 1, sizeof(*ck->files));
    if (ck->files == NULL) {
        snprintf(err, errlen, "out of memory");
        return SD_ENOMEM;
    }
    for (uint32_t f = 0; f < ck->n_files; f++) {
        json_t *v = json_array_get(files, f);
        const char *s = json_is_string(v) ? json_string_value(v) : "";
        if (s[0] == '\0' || s[0] == '.' || strchr(s, '/') != NULL ||
            strlen(s) >= sizeof(ck->files[f])) {
            snprintf(err, errlen, "file %u: '%s' is not a file name in the checkpoint", f, s);
            return SD_EINVAL;
        }
        snprintf(ck->files[f], sizeof(ck->files[f]), "%s", s);
    }
    return SD_OK;
}

int sd_ckpt_open_owned(const char *dir, uid_t owner, uint64_t max_manifest, struct sd_ckpt *ck,
                       char *err, size_t errlen)
{
    memset(ck, 0, sizeof(*ck));
    ck->dir_fd = -1;
    ck->owner = owner;
    int status = resolve(dir, ck, err, errlen);
    if (status != SD_OK)
        return status;
    char msg[512] = "", *text = NULL;
    size_t len = 0;
    status = sd_fs_read_input(ck->dir_fd, "MANIFEST", owner,
                              max_manifest ? max_manifest : SD_CKPT_MANIFEST_MAX, &text, &len, msg,
                              sizeof(msg));
    if (status != 0) {
        snprintf(err, errlen, "%s/%s%s", ck->path, msg,
                 status == -EFBIG ? " (the manifest of the registered model's size is smaller)"
                                  : "");
        sd_ckpt_close(ck);
        return status == -EFBIG ? SD_EINVAL : status;
    }
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (root == NULL) {
        snprintf(err, errlen, "%s/MANIFEST: not JSON: %s (line %d)", ck->path, jerr.text,
                 jerr.line);
        sd_ckpt_close(ck);
        return SD_EINVAL;
    }
    status = parse_header(root, ck, msg, sizeof(msg));
    if (status == SD_OK)
        status = parse_groups(json_object_get(root, "groups"), ck, msg, sizeof(msg));
    if (status == SD_OK)
        status = parse_files(json_object_get(root, "files"), ck, msg, sizeof(msg));
    if (status == SD_OK)
        status = parse_tensors(json_object_get(root, "tensors"), ck, msg, sizeof(msg));
    for (uint32_t t = 0; status == SD_OK && t < ck->n_tensors; t++)
        if (ck->tensors[t].group >= ck->n_groups) {
            snprintf(msg, sizeof(msg), "tensor %u '%s': group %u of %u", t, ck->tensors[t].name,
                     ck->tensors[t].group, ck->n_groups);
            status = SD_EINVAL;
        }
    if (status == SD_OK)
        status = parse_extents(json_object_get(root, "extents"), ck, msg, sizeof(msg));
    json_decref(root);
    if (status != SD_OK) {
        snprintf(err, errlen, "%s/MANIFEST: %s", ck->path, msg);
        sd_ckpt_close(ck);
    }
    return status;
}

int sd_ckpt_open(const char *dir, struct sd_ckpt *ck, char *err, size_t errlen)
{
    return sd_ckpt_open_owned(dir, SD_FS_ANY_OWNER, 0, ck, err, errlen);
}

void sd_ckpt_close(struct sd_ckpt *ck)
{
    free(ck->tensors);
    free(ck->groups);
    free(ck->files);
    free(ck->extents);
    free(ck->by_key);
    ck->tensors = NULL;
    ck->groups = NULL;
    ck->files = NULL;
    ck->extents = NULL;
    ck->by_key = NULL;
    ck->n_tensors = ck->n_groups = ck->n_files = 0;
    ck->n_extents = 0;
    if (ck->dir_open)
        close(ck->dir_fd);
    ck->dir_open = false;
    ck->dir_fd = -1;
}

static void dims_str(char *buf, size_t len, uint32_t ndim, const uint64_t *dims)
{
    size_t at = 0;
    at += (size_t)snprintf(buf, len, "[");
    for (uint32_t d = 0; d < ndim && at < len; d++)
        at += (size_t)snprintf(buf + at, len - at, "%s%llu", d ? ", " : "",
                               (unsigned long long)dims[d]);
    if (at < len)
        snprintf(buf + at, len - at, "]");
}

int sd_ckpt_check_model(const struct sd_ckpt *ck, const struct sd_model *m, char *err,
                        size_t errlen)
{
    /* (the states must be the same: Adam's are AdamW's, as torch's state dicts are) */
    if (sd_optim_layout(m->optim.kind) != sd_optim_layout(ck->optim_kind)) {
        snprintf(err, errlen,
                 "the checkpoint's optimizer is %s, the model registers %s: their states differ",
                 sd_optim_name(ck->optim_kind), sd_optim_name(m->optim.kind));
        return SD_EMISMATCH;
    }
    for (uint32_t t = 0; t < SD_MIN(m->n_tensors, ck->n_tensors); t++) {
        const struct sd_tensor_desc *d = &m->tensors[t];
        const struct sd_ckpt_tensor *c = &ck->tensors[t];
        char a[160], b[160];
        if (strcmp(d->name, c->name) != 0) {
            snprintf(err, errlen, "tensor %u is '%s' in the checkpoint, '%s' in the model", t,
                     c->name, d->name);
            return SD_EMISMATCH;
        }
        if (d->ndim != c->ndim || memcmp(d->dims, c->dims, d->ndim * sizeof(uint64_t)) != 0) {
            dims_str(a, sizeof(a), c->ndim, c->dims);
            dims_str(b, sizeof(b), d->ndim, d->dims);
            snprintf(err, errlen, "tensor %u '%s' has shape %s in the checkpoint, %s in the model",
                     t, d->name, a, b);
            return SD_EMISMATCH;
        }
        if (d->group != c->group) {
            snprintf(err, errlen,
                     "tensor %u '%s' is in parameter group %u in the checkpoint, %u in the model",
                     t, d->name, c->group, d->group);
            return SD_EMISMATCH;
        }
    }
    if (m->n_tensors != ck->n_tensors) {
        uint32_t t = SD_MIN(m->n_tensors, ck->n_tensors);
        snprintf(err, errlen,
                 "the checkpoint has %u tensors, the model %u (tensor %u '%s' is only "
                 "in the %s)",
                 ck->n_tensors, m->n_tensors, t,
                 m->n_tensors > t ? m->tensors[t].name : ck->tensors[t].name,
                 m->n_tensors > t ? "model" : "checkpoint");
        return SD_EMISMATCH;
    }
    if (sd_model_groups(m) != ck->n_groups) {
        snprintf(err, errlen, "the checkpoint has %u parameter groups, the model %u", ck->n_groups,
                 sd_model_groups(m));
        return SD_EMISMATCH;
    }
    return SD_OK;
}

/* ---- reading extents */

int sd_ckpt_reader_init(struct sd_ckpt_reader *rd, const struct sd_ckpt *ck, char *err,
                        size_t errlen)
{
    memset(rd, 0, sizeof(*rd));
    rd->ck = ck;
    rd->cached = UINT64_MAX;
    if (!ck->dir_open) {
        snprintf(err, errlen, "%s: the checkpoint's directory is not open", ck->path);
        return SD_EINVAL;
    }
    rd->fds = malloc((ck->n_files + 1) * sizeof(int));
    /* an extent and the rest of the aligned blocks it starts and ends in */
    if (posix_memalign((void **)&rd->raw, SD_CKPT_IO_ALIGN,
                       (size_t)SD_CKPT_EXTENT_ELEMS * sizeof(float) + 2 * SD_CKPT_IO_ALIGN) != 0)
        rd->raw = NULL;
    if (rd->fds == NULL || rd->raw == NULL) {
        sd_ckpt_reader_free(rd);
        snprintf(err, errlen, "out of memory");
        return SD_ENOMEM;
    }
    for (uint32_t f = 0; f < ck->n_files; f++)
        rd->fds[f] = -1;
    return SD_OK;
}

void sd_ckpt_reader_free(struct sd_ckpt_reader *rd)
{
    for (uint32_t f = 0; rd->fds != NULL && f < rd->ck->n_files; f++)
        if (rd->fds[f] >= 0)
            close(rd->fds[f]);
    free(rd->fds);
    free(rd->raw);
    rd->fds = NULL;
    rd->raw = NULL;
    rd->data = NULL;
}

/* bytes [off, off + len) of fd into buf; with O_DIRECT, fd's aligned blocks around them: *at is
 * where they start in buf. A filesystem that refuses the alignment gets the fd buffered. */
static ssize_t read_range(int fd, uint8_t *buf, uint64_t off, size_t len, size_t *at)
{
    int fl = fcntl(fd, F_GETFL);
    bool direct = fl >= 0 && (fl & O_DIRECT);
    uint64_t lo = direct ? off / SD_CKPT_IO_ALIGN * SD_CKPT_IO_ALIGN : off;
    size_t want = direct ? (off + len - lo + SD_CKPT_IO_ALIGN - 1) / SD_CKPT_IO_ALIGN *
                               SD_CKPT_IO_ALIGN
                         : len,
           need = off + len - lo, got = 0;
    *at = off - lo;
    while (got < need) {
        ssize_t n = pread(fd, buf + got, want - got, (off_t)(lo + got));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EINVAL && direct) {
            if (fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0)
                return -1;
            return read_range(fd, buf, off, len, at);
        }
        if (n <= 0) /* 0: the file ends early; a partial direct read ends at the end of the file */
            return n;
        got += (size_t)n;
    }
    return (ssize_t)len;
}

/* extent xi (the manifest's order) into rd->data, verified; and into `into` when not NULL (copied a
 * block at a time as the crc reads it, while the block is in the cache) */
static int load_extent(struct sd_ckpt_reader *rd, uint64_t xi, float *into, char *err,
                       size_t errlen)
{
    const struct sd_ckpt *ck = rd->ck;
    const struct sd_ckpt_extent *x = &ck->extents[xi];
    if (rd->cached == xi) {
        if (into != NULL)
            memcpy(into, rd->data, (x->end - x->begin) * sizeof(float));
        return SD_OK;
    }
    if (rd->fds[x->file] < 0) {
        char msg[512];
        int fd = -EINVAL;
        if (rd->direct)
            fd = sd_fs_open_input(ck->dir_fd, ck->files[x->file], ck->owner, 0, O_DIRECT, NULL, msg,
                                  sizeof(msg));
        if (fd == -EINVAL) /* a filesystem without O_DIRECT (or a file of the wrong kind) */
            fd = sd_fs_open_input(ck->dir_fd, ck->files[x->file], ck->owner, 0, 0, NULL, msg,
                                  sizeof(msg));
        if (fd < 0) {
            snprintf(err, errlen, "%.600s/%s", ck->path, msg);
            return fd == -EPERM || fd == -EACCES ? SD_EPERM : SD_EIO;
        }
        rd->fds[x->file] = fd;
    }
    size_t bytes = (x->end - x->begin) * sizeof(float), at = 0;
    rd->cached = UINT64_MAX;
    ssize_t n = read_range(rd->fds[x->file], rd->raw, x->file_off, bytes, &at);
    if (n != (ssize_t)bytes) {
        snprintf(err, errlen,
                 "%.600s/%s: extent %llu (%s of tensor '%s' [%llu, %llu)) at byte "
                 "%llu: %s",
                 ck->path, ck->files[x->file], (unsigned long long)xi,
                 sd_ckpt_state_name(ck->optim_kind, x->state), ck->tensors[x->tensor].name,
                 (unsigned long long)x->begin, (unsigned long long)x->end,
                 (unsigned long long)x->file_off, n >= 0 ? "the file ends early" : strerror(errno));
        return SD_EIO;
    }
    rd->data = (float *)(void *)(rd->raw + at);
    rd->bytes_read += bytes;
    uint32_t crc = 0;
    for (size_t b = 0; b < bytes; b += 64 << 10) {
        size_t len = SD_MIN(bytes - b, (size_t)64 << 10);
        crc = sd_crc32c(crc, (const uint8_t *)rd->data + b, len);
        if (into != NULL)
            memcpy((uint8_t *)into + b, (const uint8_t *)rd->data + b, len);
    }
    if (crc != x->crc) {
        snprintf(err, errlen,
                 "extent %llu in %s is corrupt (its bytes do not match the manifest's crc32c "
                 "0x%08x): %s of tensor '%s' [%llu, %llu), %zu bytes at byte %llu of %.600s/%s",
                 (unsigned long long)xi, ck->files[x->file], x->crc,
                 sd_ckpt_state_name(ck->optim_kind, x->state), ck->tensors[x->tensor].name,
                 (unsigned long long)x->begin, (unsigned long long)x->end, bytes,
                 (unsigned long long)x->file_off, ck->path, ck->files[x->file]);
        return SD_EIO;
    }
    rd->cached = xi;
    return SD_OK;
}

int sd_ckpt_read(struct sd_ckpt_reader *rd, uint32_t state, uint32_t tensor, uint64_t begin,
                 uint64_t end, float *dst, char *err, size_t errlen)
{
    const struct sd_ckpt *ck = rd->ck;
    /* the first extent of (state, tensor) that ends after begin */
    uint64_t lo = 0, hi = ck->n_extents;
    while (lo < hi) {
        uint64_t mid = (lo + hi) / 2;
        const struct sd_ckpt_extent *x = &ck->extents[ck->by_key[mid]];
        bool before = x->state < state || (x->state == state && x->tensor < tensor) ||
                      (x->state == state && x->tensor == tensor && x->end <= begin);
        if (before)
            lo = mid + 1;
        else
            hi = mid;
    }
    uint64_t at = begin;
    for (uint64_t i = lo; i < ck->n_extents && at < end; i++) {
        const struct sd_ckpt_extent *x = &ck->extents[ck->by_key[i]];
        if (x->state != state || x->tensor != tensor || x->begin > at)
            break;
        bool whole = x->begin == at && x->end <= end;
        int status = load_extent(rd, ck->by_key[i], whole ? dst + (at - begin) : NULL, err, errlen);
        if (status != SD_OK)
            return status;
        uint64_t n = SD_MIN(end, x->end) - at;
        if (!whole)
            memcpy(dst + (at - begin), rd->data + (at - x->begin), n * sizeof(float));
        at += n;
    }
    if (at < end) {
        snprintf(err, errlen, "%s: no extent holds %s of tensor %u [%llu, %llu)", ck->path,
                 sd_ckpt_state_name(ck->optim_kind, state), tensor, (unsigned long long)at,
                 (unsigned long long)end);
        return SD_EINVAL;
    }
    return SD_OK;
}

struct verify {
    struct sd_ckpt_reader *rd; /* [threads] */
    pthread_mutex_t lock;
    uint64_t bad, first; /* failed extents; the first of them in the manifest */
    int status;          /* its status, */
    char *err;           /* its message */
    size_t errlen;
};

static void verify_one(void *arg, uint32_t thread, uint64_t i)
{
    struct verify *v = arg;
    char e[1024];
    int st = load_extent(&v->rd[thread], i, NULL, e, sizeof(e));
    if (st == SD_OK)
        return;
    pthread_mutex_lock(&v->lock);
    if (v->bad++ == 0 || i < v->first) {
        v->first = i;
        v->status = st;
        snprintf(v->err, v->errlen, "%s", e);
    }
    pthread_mutex_unlock(&v->lock);
}

int sd_ckpt_verify(const struct sd_ckpt *ck, uint64_t *bad_p, char *err, size_t errlen)
{
    /* several readers at once, with O_DIRECT, in the manifest's order (each file's): a disk
     * serves them at its full rate */
    enum { THREADS = 4 };
    struct sd_ckpt_reader rd[THREADS];
    struct verify v = {.rd = rd, .status = SD_OK, .err = err, .errlen = errlen};
    uint32_t ready = 0;
    int status = SD_OK;
    for (; ready < THREADS && status == SD_OK; ready++) {
        status = sd_ckpt_reader_init(&rd[ready], ck, err, errlen);
        rd[ready].direct = true;
    }
    if (status == SD_OK) {
        pthread_mutex_init(&v.lock, NULL);
        sd_ckpt_parallel(THREADS, ck->n_extents, verify_one, &v);
        pthread_mutex_destroy(&v.lock);
    } else {
        ready--; /* the one that failed freed itself */
    }
    for (uint32_t t = 0; t < ready; t++)
        sd_ckpt_reader_free(&rd[t]);
    if (bad_p != NULL)
        *bad_p = v.bad;
    return status != SD_OK ? status : v.status;
}

/* ---- writing */

int sd_ckpt_write_all(int fd, const void *p, size_t len, uint32_t *crc_p)
{
    if (crc_p != NULL)
        *crc_p = sd_crc32c(*crc_p, p, len);
    return sd_fs_write_all(fd, p, len);
}

/* jansson's constructors return NULL for a string that is not UTF-8 and the setters -1 for a
 * NULL value: every one is checked, so that no field is dropped without the save failing */
struct jb {
    bool bad;
    char what[160];
};

static json_t *jb_take(struct jb *b, json_t *v, const char *what)
{
    if (v == NULL && !b->bad) {
        b->bad = true;
        snprintf(b->what, sizeof(b->what), "%s", what);
    }
    return v;
}

static void jb_set(struct jb *b, json_t *o, const char *key, json_t *v)
{
    if (jb_take(b, v, key) == NULL || json_object_set_new(o, key, v) != 0)
        jb_take(b, NULL, key);
}

static void jb_append(struct jb *b, json_t *arr, json_t *v, const char *what)
{
    if (jb_take(b, v, what) == NULL || json_array_append_new(arr, v) != 0)
        jb_take(b, NULL, what);
}

/* the manifest of ck as JSON text (malloc'd), or NULL with err saying which field failed */
static char *manifest_text(const struct sd_ckpt *ck, char *err, size_t errlen)
{
    struct jb b = {0};
    json_t *root = json_object(), *tens = json_array(), *ext = json_array(), *groups = json_array(),
           *files = json_array(), *states = json_array();
    if (root == NULL || tens == NULL || ext == NULL || groups == NULL || files == NULL ||
        states == NULL) {
        json_decref(root);
        json_decref(tens);
        json_decref(ext);
        json_decref(groups);
        json_decref(files);
        json_decref(states);
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    jb_set(&b, root, "format", json_string(SD_CKPT_FORMAT_NAME));
    jb_set(&b, root, "version", json_integer(SD_CKPT_VERSION));
    jb_set(&b, root, "job", json_string(ck->job));
    jb_set(&b, root, "step", json_integer((json_int_t)ck->step));
    jb_set(&b, root, "plan", json_string(ck->plan));
    jb_set(&b, root, "world", json_integer(ck->world));
    jb_set(&b, root, "ranks_per_node", json_integer(ck->ranks_per_node));
    jb_set(&b, root, "nodes", json_integer(ck->nodes));
    jb_set(&b, root, "bytes", json_integer((json_int_t)ck->bytes));
    for (uint32_t s = 0; s < ck->n_states; s++)
        jb_append(&b, states, json_string(sd_ckpt_state_name(ck->optim_kind, s)), "states");
    jb_set(&b, root, "states", states);
    jb_set(&b, root, "optimizer",
           json_pack("{s:s, s:f}", "kind", sd_optim_name(ck->optim_kind), "max_grad_norm",
                     (double)ck->max_grad_norm));
    for (uint32_t g = 0; g < ck->n_groups; g++) {
        const struct sd_hparams *h = &ck->groups[g];
        jb_append(&b, groups,
                  json_pack("{s:f, s:f, s:f, s:f, s:f, s:f}", "lr", (double)h->lr, "beta1",
                            (double)h->beta1, "beta2", (double)h->beta2, "eps", (double)h->eps,
                            "weight_decay", (double)h->weight_decay, "momentum",
                            (double)h->momentum),
                  "groups");
    }
    jb_set(&b, root, "groups", groups);
    for (uint32_t f = 0; f < ck->n_files; f++)
        jb_append(&b, files, json_string(ck->files[f]), "files");
    jb_set(&b, root, "files", files);
    for (uint32_t t = 0; t < ck->n_tensors && !b.bad; t++) {
        const struct sd_ckpt_tensor *c = &ck->tensors[t];
        json_t *shape = json_array();
        for (uint32_t d = 0; shape != NULL && d < c->ndim; d++)
            jb_append(&b, shape, json_integer((json_int_t)c->dims[d]), "shape");
        char what[160];
        snprintf(what, sizeof(what), "tensor %u's name (not UTF-8?)", t);
        jb_append(&b, tens,
                  shape == NULL
                      ? NULL
                      : json_pack("{s:s, s:o, s:s, s:I, s:I, s:I}", "name", c->name, "shape", shape,
                                  "dtype", sd_dtype_name(c->dtype), "unit", (json_int_t)c->unit,
                                  "group", (json_int_t)c->group, "steps", (json_int_t)c->steps),
                  what);
    }
    jb_set(&b, root, "tensors", tens);
    for (uint64_t i = 0; i < ck->n_extents && !b.bad; i++) {
        const struct sd_ckpt_extent *x = &ck->extents[i];
        jb_append(&b, ext,
                  json_pack("{s:s, s:I, s:[I, I], s:s, s:I, s:I}", "state",
                            sd_ckpt_state_name(ck->optim_kind, x->state), "tensor",
                            (json_int_t)x->tensor, "range", (json_int_t)x->begin,
                            (json_int_t)x->end, "file", ck->files[x->file], "offset",
                            (json_int_t)x->file_off, "crc32c", (json_int_t)x->crc),
                  "an extent");
    }
    jb_set(&b, root, "extents", ext);
    char *text = b.bad ? NULL : json_dumps(root, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
    json_decref(root);
    if (b.bad)
        snprintf(err, errlen, "the manifest cannot hold %s", b.what);
    else if (text == NULL)
        snprintf(err, errlen, "the manifest could not be encoded (out of memory)");
    return text;
}

int sd_ckpt_write_manifest(int dir_fd, const char *dir, const struct sd_ckpt *ck, char *err,
                           size_t errlen)
{
    char msg[256];
    char *text = manifest_text(ck, msg, sizeof(msg));
    if (text == NULL) {
        snprintf(err, errlen, "writing %s/MANIFEST: %s", dir, msg);
        return SD_EINVAL;
    }
    int status = SD_OK;
    int fd = sd_fs_openat(dir_fd, "MANIFEST", O_WRONLY | O_CREAT | O_EXCL, 0640);
    if (fd < 0)
        status = fd;
    if (fd >= 0) {
        status = sd_fs_write_all(fd, text, strlen(text));
        if (status == SD_OK && fsync(fd) != 0)
            status = -errno;
        close(fd);
    }
    free(text);
    if (status != SD_OK)
        snprintf(err, errlen, "writing %s/MANIFEST: %s", dir, strerror(-status));
    return status;
}

int sd_ckpt_remove(int parent_fd, const char *name)
{
    return sd_fs_remove(parent_fd, name);
}

void sd_ckpt_step_name(char *buf, size_t len, uint64_t step)
{
    snprintf(buf, len, "step-%08llu", (unsigned long long)step);
}

/* parent/LATEST names final: a new file under a random name, fsynced, renamed over LATEST */
static int write_latest(int parent_fd, const char *final_name)
{
    char tmp[64];
    uint8_t r[8];
    int st = sd_fs_random(r, sizeof(r));
    if (st != 0)
        return st;
    snprintf(tmp, sizeof(tmp), ".LATEST-%02x%02x%02x%02x%02x%02x%02x%02x", r[0], r[1], r[2], r[3],
             r[4], r[5], r[6], r[7]);
    int fd = sd_fs_openat(parent_fd, tmp, O_WRONLY | O_CREAT | O_EXCL, 0640);
    if (fd < 0)
        return fd;
    char line[320];
    snprintf(line, sizeof(line), "%s\n", final_name);
    st = sd_fs_write_all(fd, line, strlen(line));
    if (st == SD_OK && fsync(fd) != 0)
        st = -errno;
    close(fd);
    if (st == SD_OK && renameat(parent_fd, tmp, parent_fd, "LATEST") != 0)
        st = -errno;
    if (st != SD_OK)
        unlinkat(parent_fd, tmp, 0);
    return st;
}

int sd_ckpt_commit(int parent_fd, const char *parent, const char *tmp_name, const char *final_name,
                   char *err, size_t errlen)
{
    /* how the checkpoint of the same step, if any, was set aside: swapped with the new one
     * (renameat2's RENAME_EXCHANGE: the new one's name then holds it), or renamed aside */
    enum { NONE, SWAPPED, ASIDE } old = NONE;
    char aside[300];
    snprintf(aside, sizeof(aside), "%s.replaced", tmp_name);
    const char *what = "fsync of the new checkpoint's directory";
    int status = sd_fs_fsync(parent_fd, tmp_name);
    struct stat st;
    if (status == SD_OK && fstatat(parent_fd, final_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        what = "replacing the checkpoint of the same step";
        if (!S_ISDIR(st.st_mode)) {
            status = SD_EEXIST; /* not a checkpoint: left as it is */
        } else if (renameat2(parent_fd, tmp_name, parent_fd, final_name, RENAME_EXCHANGE) == 0) {
            old = SWAPPED;
        } else if (errno == EINVAL || errno == ENOSYS) { /* a filesystem without the exchange */
            status = renameat2(parent_fd, final_name, parent_fd, aside, RENAME_NOREPLACE) == 0
                         ? SD_OK
                         : -errno;
            old = status == SD_OK ? ASIDE : NONE;
        } else {
            status = -errno;
        }
    }
    bool placed = status == SD_OK && old == SWAPPED; /* the new one is at final_name */
    if (status == SD_OK && old != SWAPPED) {
        what = "renaming the new checkpoint into place";
        if (renameat2(parent_fd, tmp_name, parent_fd, final_name, RENAME_NOREPLACE) != 0)
            status = errno == EINVAL && renameat(parent_fd, tmp_name, parent_fd, final_name) == 0
                         ? SD_OK
                         : -errno;
        placed = status == SD_OK;
    }
    if (status == SD_OK) {
        what = "fsync of the checkpoints' directory";
        status = sd_fs_fsync(parent_fd, NULL);
    }
    if (status == SD_OK) {
        what = "writing LATEST";
        status = write_latest(parent_fd, final_name);
    }
    if (status == SD_OK) {
        what = "fsync of the checkpoints' directory";
        status = sd_fs_fsync(parent_fd, NULL);
    }
    if (status == SD_OK) { /* committed: the old one goes */
        if (old != NONE)
            sd_fs_remove(parent_fd, old == SWAPPED ? tmp_name : aside);
        return SD_OK;
    }
    /* the old checkpoint is put back where it was, the new one back under tmp_name (the caller
     * removes it) */
    if (old == SWAPPED)
        renameat2(parent_fd, tmp_name, parent_fd, final_name, RENAME_EXCHANGE);
    if (old == ASIDE && renameat(parent_fd, final_name, parent_fd, tmp_name) == 0)
        renameat(parent_fd, aside, parent_fd, final_name);
    if (old == NONE && placed)
        renameat2(parent_fd, final_name, parent_fd, tmp_name, RENAME_NOREPLACE);
    sd_fs_fsync(parent_fd, NULL);
    snprintf(err, errlen, "%s in %s: %s%s", what, parent, strerror(-status),
             old != NONE ? " (the checkpoint of the same step is kept)" : "");
    return status;
}

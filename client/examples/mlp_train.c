/* mlp_train: a small MLP trained through shardd, in plain C.
 *
 * The model has --layers fully connected layers (tanh between them); each layer (weight + bias)
 * is one unit. The task is a deterministic synthetic regression: inputs are uniform in [-1, 1]
 * drawn from a seed, step, micro-step, rank and sample index; targets are sin(A x) for a fixed
 * random matrix A. Each rank computes the mean squared error of its own micro-batch.
 *
 * --reference trains the same global batch (world ranks x accum micro-steps) in one process with
 * plain data parallelism and no daemon: per micro-step the ranks' gradients are summed in rank
 * order and accumulated; at the step the sum is divided by the world size and the optimizer
 * (its own implementation below, the textbook torch.optim formulas) updates fp32 master weights.
 * --dump-params writes all parameters after the last step as little-endian fp32 in
 * registration order, so a test can compare the two runs.
 *
 * --save-every N --save-dir DIR saves a checkpoint (shard_save) after every N steps; --load DIR
 * starts from one (DIR/LATEST's, or DIR itself) and trains from its step to --steps, on the data
 * an uninterrupted run would have seen. --reference --load DIR reads the checkpoint itself,
 * following docs/checkpoints.md's format (jansson for the manifest, its own crc32c): a reader
 * independent of libshard and shardd. */
#include "shard.h"
#include "sd/dtype.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_LAYERS 16
#define IN_DIM     64
#define OUT_DIM    16

struct opts {
    const char *socket, *job, *plan, *optimizer, *dump;
    const char *save_dir, *load; /* --save-dir, --load */
    int save_every, save_delay_ms;
    uint64_t resume_timeout_ms; /* --resume-timeout-ms: a paused job is registered again */
    uint32_t ranks_per_node;    /* --ranks-per-node (0: $LOCAL_WORLD_SIZE, else the daemon's) */
    const char *secret_file;    /* --job-secret-file (NULL: $SHARD_JOB_SECRET_FILE, else none) */
    const char *leader;         /* --leader (NULL: libshard's: $SHARD_LEADER, $MASTER_ADDR, ...) */
    int rank, world, steps, accum, batch, hidden, layers;
    int dtype; /* --dtype: the weights' and pushed gradients' (SHARD_FP32, BF16, FP16) */
    bool half; /* dtype is a 16-bit one */
    bool reference, quiet, timing;
    bool zero_copy;    /* gradients written into shardd's staging buffer (shard_grad_buffer) */
    int mark_last;     /* shard_last_micro_step from micro-step accum - mark_last on (0: never) */
    bool compute_only; /* this rank's compute alone: no shardd, no updates */
    uint64_t seed;
    float lr, max_grad_norm, weight_decay;
    double loss_scale; /* --loss-scale: gradients pushed times it (shard_step_scaled); 1: none */
    bool dynamic;      /* --loss-scale dynamic: libshard's scaler (shard_step_amp) */
    double scale_init; /* its initial scale (dynamic:INIT) */
    uint32_t scale_interval; /* its growth interval (dynamic:INIT:INTERVAL) */
    double compute_ms;
    bool compute_sleep; /* --compute-mode sleep: the host waits idle, as for a GPU kernel */
    uint64_t max_live_bytes;
    int skip_step, skip_layer; /* --skip-layer STEP:LAYER (steps from 1); 0: none */
    int eval_every;            /* a forward-only pass after every N steps */
    int diverge_from;          /* ranks >= this make extra calls in step 1; 0: none */
    bool final_loss;           /* --final-loss: the trained parameters' held-out loss */
    int nonfinite; /* --nonfinite STEP: rank 0 pushes a NaN in unit 1 then; the step fails */
};

/* the unit (layer) whose gradient --nonfinite poisons */
#define NONFINITE_UNIT 1

/* does layer l run in step (counted from 0)? A skipped layer is the identity. */
static bool skipped(const struct opts *o, int step, int l)
{
    return o->skip_step == step + 1 && o->skip_layer == l;
}

struct model {
    int layers;
    int dims[MAX_LAYERS + 1];
    uint32_t n_tensors;
    uint64_t numel[2 * MAX_LAYERS];
};

/* ---- deterministic data */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static float uniform(uint64_t *s) /* [-1, 1) */
{
    return (float)((double)(splitmix(s) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}

static void make_batch(const struct opts *o, int step, int micro, int rank, float *x, float *y)
{
    static float teacher[OUT_DIM * IN_DIM];
    static bool teacher_ready;
    if (!teacher_ready) {
        uint64_t s = 0x7eac4e7ULL;
        for (int i = 0; i < OUT_DIM * IN_DIM; i++)
            teacher[i] = uniform(&s) * 0.3f;
        teacher_ready = true;
    }
    for (int b = 0; b < o->batch; b++) {
        uint64_t s = o->seed * 1000003ULL + ((uint64_t)step << 40) + ((uint64_t)micro << 28) +
                     ((uint64_t)rank << 16) + (uint64_t)b;
        splitmix(&s);
        for (int i = 0; i < IN_DIM; i++)
            x[b * IN_DIM + i] = uniform(&s);
        for (int j = 0; j < OUT_DIM; j++) {
            float acc = 0.0f;
            for (int i = 0; i < IN_DIM; i++)
                acc += teacher[j * IN_DIM + i] * x[b * IN_DIM + i];
            y[b * OUT_DIM + j] = sinf(acc);
        }
    }
}

static void model_init(struct model *m, const struct opts *o)
{
    m->layers = o->layers;
    m->dims[0] = IN_DIM;
    for (int l = 1; l < o->layers; l++)
        m->dims[l] = o->hidden;
    m->dims[o->layers] = OUT_DIM;
    m->n_tensors = (uint32_t)(2 * o->layers);
    for (int l = 0; l < o->layers; l++) {
        m->numel[2 * l] = (uint64_t)m->dims[l + 1] * (uint64_t)m->dims[l];
        m->numel[2 * l + 1] = (uint64_t)m->dims[l + 1];
    }
}

/* Initial parameters: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) from the seed, biases zero. */
static float **initial_params(const struct model *m, const struct opts *o)
{
    float **p = calloc(m->n_tensors, sizeof(*p));
    uint64_t s = o->seed ^ 0x5eed5eedULL;
    for (uint32_t t = 0; t < m->n_tensors; t++) {
        p[t] = calloc(m->numel[t], sizeof(float));
        if (t % 2 == 0) {
            float bound = 1.0f / sqrtf((float)m->dims[t / 2]);
            for (uint64_t i = 0; i < m->numel[t]; i++)
                p[t][i] = uniform(&s) * bound;
        }
    }
    return p;
}

static void free_params(const struct model *m, float **p)
{
    if (p == NULL)
        return;
    for (uint32_t t = 0; t < m->n_tensors; t++)
        free(p[t]);
    free(p);
}

/* ---- forward and backward of one micro-batch; w[t] are fp32 views of the current weights,
 * g[t] receive the gradients of the mean loss. Returns the loss. */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* --timing: where rank 0's step went (seconds spent inside each kind of call, and in the
 * compute waits: over compute_ms per pass when the host is too busy to wake the rank on time) */
static struct {
    double fetch, push, step, wait;
} spent;

/* shard_fetch, its wait counted for --timing */
static int timed_fetch(shard_ctx_t *ctx, uint32_t unit, const void **data)
{
    double t0 = now_s();
    int st = shard_fetch(ctx, unit, data);
    spent.fetch += now_s() - t0;
    return st;
}

static void busy_wait_ms(double ms, bool sleep)
{
    if (ms <= 0)
        return;
    double t0 = now_s();
    if (sleep) {
        struct timespec ts = {.tv_sec = (time_t)(ms / 1e3),
                              .tv_nsec = (long)((ms - (double)(time_t)(ms / 1e3) * 1e3) * 1e6)};
        while (nanosleep(&ts, &ts) != 0)
            ;
    } else {
        while ((now_s() - t0) * 1e3 < ms)
            ;
    }
    spent.wait += now_s() - t0;
}

struct acts {
    float *a[MAX_LAYERS + 1]; /* a[0] = x, a[l+1] = layer l output */
    float *dz, *dz_prev;
};

static void acts_alloc(struct acts *ac, const struct model *m, int batch)
{
    int maxd = 0;
    for (int l = 0; l <= m->layers; l++) {
        ac->a[l] = calloc((size_t)batch * (size_t)m->dims[l], sizeof(float));
        if (m->dims[l] > maxd)
            maxd = m->dims[l];
    }
    ac->dz = calloc((size_t)batch * (size_t)maxd, sizeof(float));
    ac->dz_prev = calloc((size_t)batch * (size_t)maxd, sizeof(float));
}

static void acts_free(struct acts *ac, const struct model *m)
{
    for (int l = 0; l <= m->layers; l++)
        free(ac->a[l]);
    free(ac->dz);
    free(ac->dz_prev);
}

static void layer_forward(const struct model *m, int l, const float *w, const float *bias,
                          struct acts *ac, int batch)
{
    int din = m->dims[l], dout = m->dims[l + 1];
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < dout; j++) {
            float acc = bias[j];
            const float *row = w + (size_t)j * (size_t)din;
            const float *in = ac->a[l] + (size_t)b * (size_t)din;
            for (int i = 0; i < din; i++)
                acc += row[i] * in[i];
            ac->a[l + 1][(size_t)b * (size_t)dout + (size_t)j] =
                l + 1 < m->layers ? tanhf(acc) : acc;
        }
}

/* a skipped layer (square) passes its input through; its backward leaves dz unchanged, which
 * is then exactly dL/dz of the layer before (its output equals this layer's) */
static void layer_skip(const struct model *m, int l, struct acts *ac, int batch)
{
    memcpy(ac->a[l + 1], ac->a[l], sizeof(float) * (size_t)batch * (size_t)m->dims[l]);
}

static float loss_grad(const struct model *m, const float *y, struct acts *ac, int batch)
{
    int dout = m->dims[m->layers];
    float loss = 0.0f, scale = 1.0f / (float)(batch * dout);
    for (int k = 0; k < batch * dout; k++) {
        float d = ac->a[m->layers][k] - y[k];
        loss += d * d;
        ac->dz[k] = 2.0f * d * scale;
    }
    return loss * scale;
}

/* --final-loss: the mean loss of parameters p (fp32, per tensor) on FINAL_BATCHES held-out
 * batches of FINAL_BATCH samples, the same for every run of one seed whatever its world, plan or
 * accumulation: quantized runs and the reference are compared by it. */
#define FINAL_BATCHES 16
#define FINAL_BATCH   64
static double final_loss(const struct opts *o, const struct model *m, float *const *p)
{
    struct opts eo = *o;
    eo.batch = FINAL_BATCH;
    struct acts ac;
    acts_alloc(&ac, m, FINAL_BATCH);
    float *y = calloc((size_t)FINAL_BATCH * OUT_DIM, sizeof(float));
    double sum = 0.0;
    for (int b = 0; b < FINAL_BATCHES && y != NULL; b++) {
        make_batch(&eo, 2000000 + b, 0, 0, ac.a[0], y);
        for (int l = 0; l < m->layers; l++)
            layer_forward(m, l, p[2 * l], p[2 * l + 1], &ac, FINAL_BATCH);
        sum += loss_grad(m, y, &ac, FINAL_BATCH);
    }
    free(y);
    acts_free(&ac, m);
    return sum / FINAL_BATCHES;
}

/* zero the elements of a layer's fp32 unit buffer outside its two tensors (t[0], t[1]) */
static void zero_padding(float *g, const shard_unit_info_t *ui, const shard_tensor_info_t *t)
{
    uint64_t end0 = t[0].offset + t[0].numel, end1 = t[1].offset + t[1].numel;
    memset(g, 0, t[0].offset * sizeof(float));
    memset(g + end0, 0, (t[1].offset - end0) * sizeof(float));
    memset(g + end1, 0, (ui->numel - end1) * sizeof(float));
}

/* dz holds dL/dz of layer l; writes dW, db into gw, gb and dL/dz of layer l-1 into dz. */
static void layer_backward(const struct model *m, int l, const float *w, float *gw, float *gb,
                           struct acts *ac, int batch)
{
    int din = m->dims[l], dout = m->dims[l + 1];
    /* gw = sum over b of dz_b in_b^T, written by the first row, not cleared and then added to:
     * one pass over gw instead of two (the same sums in the same order) */
    for (int b = 0; b < batch; b++)
        for (int j = 0; j < dout; j++) {
            float d = ac->dz[(size_t)b * (size_t)dout + (size_t)j];
            const float *in = ac->a[l] + (size_t)b * (size_t)din;
            float *grow = gw + (size_t)j * (size_t)din;
            if (b == 0) {
                for (int i = 0; i < din; i++)
                    grow[i] = d * in[i];
                gb[j] = d;
            } else {
                for (int i = 0; i < din; i++)
                    grow[i] += d * in[i];
                gb[j] += d;
            }
        }
    if (l == 0)
        return;
    /* dz_prev = (W^T dz) * (1 - a^2), W read row by row: for each input i the terms are added
     * in the order of j as before, so the result is bit for bit the same */
    for (int b = 0; b < batch; b++) {
        float *acc = ac->dz_prev + (size_t)b * (size_t)din;
        const float *dz = ac->dz + (size_t)b * (size_t)dout;
        for (int i = 0; i < din; i++)
            acc[i] = 0.0f;
        for (int j = 0; j < dout; j++) {
            const float *row = w + (size_t)j * (size_t)din;
            for (int i = 0; i < din; i++)
                acc[i] += row[i] * dz[j];
        }
        const float *a = ac->a[l] + (size_t)b * (size_t)din;
        for (int i = 0; i < din; i++)
            acc[i] *= 1.0f - a[i] * a[i];
    }
    float *t = ac->dz;
    ac->dz = ac->dz_prev;
    ac->dz_prev = t;
}

/* fp32 to a 16-bit dtype and back: round to nearest even (fp16: inf beyond 65504) */
static uint16_t to_half(float f, int dtype)
{
    return dtype == SHARD_FP16 ? sd_f32_to_fp16(f) : sd_f32_to_bf16(f);
}

static float from_half(uint16_t h, int dtype)
{
    return dtype == SHARD_FP16 ? sd_fp16_to_f32(h) : sd_bf16_to_f32(h);
}

/* Round an fp32 buffer through the working dtype (what a 16-bit trainer sees and pushes). */
static void round_half(float *x, uint64_t n, int dtype)
{
    for (uint64_t i = 0; i < n; i++)
        x[i] = from_half(to_half(x[i], dtype), dtype);
}

/* the scaler of --loss-scale dynamic[:INIT[:INTERVAL]] (torch.amp.GradScaler's rule) */
static void scaler_start(const struct opts *o, shard_scaler_t *s)
{
    shard_scaler_init(s);
    s->scale = (float)o->scale_init;
    s->growth_interval = o->scale_interval;
}

/* ---- the reference: plain data parallelism in one process */

struct ref_optim {
    float *master, *m, *v; /* per tensor, concatenated */
};

static void ref_adamw(const struct opts *o, float *p, float *mm, float *vv, const float *gsum,
                      float scale, uint64_t n, uint64_t t)
{
    const float lr = o->lr, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = o->weight_decay;
    const float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
    for (uint64_t i = 0; i < n; i++) {
        float g = gsum[i] * scale;
        float x = p[i] * (1.0f - lr * wd);
        mm[i] = b1 * mm[i] + (1.0f - b1) * g;
        vv[i] = b2 * vv[i] + (1.0f - b2) * g * g;
        x = x - lr / bc1 * (mm[i] / (sqrtf(vv[i]) / sqrtf(bc2) + eps));
        p[i] = x;
    }
}

static void ref_sgd(const struct opts *o, float *p, float *buf, const float *gsum, float scale,
                    uint64_t n)
{
    const float lr = o->lr, mu = 0.9f, wd = o->weight_decay;
    for (uint64_t i = 0; i < n; i++) {
        float g = gsum[i] * scale + wd * p[i];
        buf[i] = mu * buf[i] + g;
        p[i] = p[i] - lr * buf[i];
    }
}

static int write_params(const char *path, const struct model *m, float *const *p)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        perror(path);
        return 1;
    }
    for (uint32_t t = 0; t < m->n_tensors; t++)
        fwrite(p[t], sizeof(float), m->numel[t], f); /* x86-64 and aarch64: little-endian */
    return fclose(f) == 0 ? 0 : 1;
}

/* ---- --reference --load: the checkpoint format read without libshard */

static uint32_t crc32c_bitwise(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

/* the checkpoint at dir (its MANIFEST) or the one dir/LATEST names: path into ck (PATH_MAX) */
static json_t *ckpt_manifest(const char *dir, char *ck, size_t len)
{
    char p[4200], name[256] = "";
    snprintf(ck, len, "%s", dir);
    snprintf(p, sizeof(p), "%s/MANIFEST", dir);
    FILE *f = fopen(p, "r");
    if (f == NULL) {
        snprintf(p, sizeof(p), "%s/LATEST", dir);
        FILE *l = fopen(p, "r");
        if (l == NULL || fgets(name, sizeof(name), l) == NULL) {
            fprintf(stderr, "mlp_train: %s holds neither MANIFEST nor LATEST\n", dir);
            if (l != NULL)
                fclose(l);
            return NULL;
        }
        fclose(l);
        name[strcspn(name, "\n")] = '\0';
        snprintf(ck, len, "%s/%s", dir, name);
    } else {
        fclose(f);
    }
    snprintf(p, sizeof(p), "%s/MANIFEST", ck);
    json_error_t e;
    json_t *root = json_load_file(p, 0, &e);
    if (root == NULL)
        fprintf(stderr, "mlp_train: %s: %s\n", p, e.text);
    return root;
}

/* Fill master, moments (per tensor) and the step from the checkpoint; 0 or 1 (an error). */
static int ref_load(const struct opts *o, const struct model *m, float **master, float **mom,
                    float **vel, uint64_t *step_p, uint64_t *applied_p)
{
    char ck[4096];
    json_t *root = ckpt_manifest(o->load, ck, sizeof(ck));
    if (root == NULL)
        return 1;
    int rc = 1;
    json_t *tensors = json_object_get(root, "tensors"), *extents = json_object_get(root, "extents");
    if (json_array_size(tensors) != m->n_tensors) {
        fprintf(stderr, "mlp_train: the checkpoint has %zu tensors, the model %u\n",
                json_array_size(tensors), m->n_tensors);
        goto out;
    }
    *step_p = (uint64_t)json_integer_value(json_object_get(root, "step"));
    *applied_p = (uint64_t)json_integer_value(json_object_get(json_array_get(tensors, 0), "steps"));
    size_t i;
    json_t *x;
    json_array_foreach(extents, i, x)
    {
        const char *state = json_string_value(json_object_get(x, "state"));
        uint32_t t = (uint32_t)json_integer_value(json_object_get(x, "tensor"));
        json_t *range = json_object_get(x, "range");
        uint64_t b = (uint64_t)json_integer_value(json_array_get(range, 0));
        uint64_t e = (uint64_t)json_integer_value(json_array_get(range, 1));
        uint64_t off = (uint64_t)json_integer_value(json_object_get(x, "offset"));
        uint32_t crc = (uint32_t)json_integer_value(json_object_get(x, "crc32c"));
        float *dst = NULL;
        if (state != NULL && t < m->n_tensors && e > b && e <= m->numel[t])
            dst = strcmp(state, "master") == 0 ? master[t]
                  : strcmp(state, "exp_avg") == 0 || strcmp(state, "momentum_buffer") == 0 ? mom[t]
                  : strcmp(state, "exp_avg_sq") == 0                                       ? vel[t]
                                                                                           : NULL;
        if (dst == NULL) {
            fprintf(stderr, "mlp_train: extent %zu of the checkpoint is not understood\n", i);
            goto out;
        }
        char p[4400];
        snprintf(p, sizeof(p), "%s/%s", ck, json_string_value(json_object_get(x, "file")));
        FILE *f = fopen(p, "rb");
        size_t n = (size_t)(e - b);
        bool ok = f != NULL && fseek(f, (long)off, SEEK_SET) == 0 &&
                  fread(dst + b, sizeof(float), n, f) == n;
        if (f != NULL)
            fclose(f);
        if (!ok || crc32c_bitwise((const uint8_t *)(dst + b), n * sizeof(float)) != crc) {
            fprintf(stderr, "mlp_train: %s: extent %zu cannot be read or fails its crc\n", p, i);
            goto out;
        }
    }
    rc = 0;
out:
    json_decref(root);
    return rc;
}

static int run_reference(const struct opts *o, const struct model *m)
{
    float **master = initial_params(m, o);
    float *mom[2 * MAX_LAYERS], *vel[2 * MAX_LAYERS], *acc[2 * MAX_LAYERS], *tmp[2 * MAX_LAYERS];
    float *w[2 * MAX_LAYERS], *g[2 * MAX_LAYERS];
    for (uint32_t t = 0; t < m->n_tensors; t++) {
        mom[t] = calloc(m->numel[t], sizeof(float));
        vel[t] = calloc(m->numel[t], sizeof(float));
        acc[t] = calloc(m->numel[t], sizeof(float));
        tmp[t] = calloc(m->numel[t], sizeof(float));
        w[t] = calloc(m->numel[t], sizeof(float));
        g[t] = calloc(m->numel[t], sizeof(float));
    }
    struct acts ac;
    acts_alloc(&ac, m, o->batch);
    float *y = calloc((size_t)o->batch * OUT_DIM, sizeof(float));
    uint64_t applied = 0; /* optimizer steps taken (AdamW's t) */
    uint64_t first = 0;
    shard_scaler_t scaler;
    scaler_start(o, &scaler);
    if (o->load != NULL && ref_load(o, m, master, mom, vel, &first, &applied) != 0)
        return 1;

    for (int step = (int)first; step < o->steps; step++) {
        double S = o->dynamic ? scaler.scale : o->loss_scale; /* this step's loss scale */
        for (uint32_t t = 0; t < m->n_tensors; t++) {         /* working weights */
            memcpy(w[t], master[t], m->numel[t] * sizeof(float));
            if (o->half)
                round_half(w[t], m->numel[t], o->dtype);
            memset(acc[t], 0, m->numel[t] * sizeof(float));
        }
        double loss_sum = 0.0;
        for (int micro = 0; micro < o->accum; micro++) {
            for (int r = 0; r < o->world; r++) {
                make_batch(o, step, micro, r, ac.a[0], y);
                for (int l = 0; l < m->layers; l++)
                    if (skipped(o, step, l))
                        layer_skip(m, l, &ac, o->batch);
                    else
                        layer_forward(m, l, w[2 * l], w[2 * l + 1], &ac, o->batch);
                loss_sum += loss_grad(m, y, &ac, o->batch);
                for (int l = m->layers - 1; l >= 0; l--)
                    if (skipped(o, step, l)) { /* no gradient this step */
                        memset(g[2 * l], 0, m->numel[2 * l] * sizeof(float));
                        memset(g[2 * l + 1], 0, m->numel[2 * l + 1] * sizeof(float));
                    } else {
                        layer_backward(m, l, w[2 * l], g[2 * l], g[2 * l + 1], &ac, o->batch);
                    }
                for (uint32_t t = 0; t < m->n_tensors; t++) {
                    if (S != 1.0) /* the loss scaled before its backward, as the ranks */
                        for (uint64_t i = 0; i < m->numel[t]; i++)
                            g[t][i] = (float)(g[t][i] * S);
                    if (o->half)
                        round_half(g[t], m->numel[t], o->dtype);
                    for (uint64_t i = 0; i < m->numel[t]; i++)
                        tmp[t][i] = r == 0 ? g[t][i] : tmp[t][i] + g[t][i];
                }
            }
            for (uint32_t t = 0; t < m->n_tensors; t++)
                for (uint64_t i = 0; i < m->numel[t]; i++)
                    acc[t][i] += tmp[t][i];
        }
        double sumsq = 0.0;
        for (uint32_t t = 0; t < m->n_tensors; t++)
            for (uint64_t i = 0; i < m->numel[t]; i++)
                sumsq += (double)acc[t][i] * (double)acc[t][i];
        bool overflow = !isfinite(sumsq);           /* a sum that is inf or NaN makes it so */
        if (o->nonfinite == step + 1 || overflow) { /* shardd fails and skips this step: so does
                                                     * this, and a scaler backs off */
            if (o->dynamic)
                shard_scaler_update(&scaler, 1);
            if (!o->quiet)
                printf("step %d skipped (non-finite gradient)\n", step + 1);
            continue;
        }
        if (o->dynamic)
            shard_scaler_update(&scaler, 0);
        applied++;
        /* the daemon's unscaling and clipping (optimizer.c's grad_scale) */
        double norm = sqrt(sumsq) / (double)o->world / S;
        float scale = 1.0f / (float)o->world;
        if (S != 1.0)
            scale = scale * (float)(1.0 / S);
        if (o->max_grad_norm > 0.0f && norm > (double)o->max_grad_norm)
            scale = scale * (float)((double)o->max_grad_norm / (norm + 1e-6));
        for (uint32_t t = 0; t < m->n_tensors; t++) {
            if (strcmp(o->optimizer, "adamw") == 0)
                ref_adamw(o, master[t], mom[t], vel[t], acc[t], scale, m->numel[t], applied);
            else
                ref_sgd(o, master[t], mom[t], acc[t], scale, m->numel[t]);
        }
        if (!o->quiet)
            printf("step %d loss %.6f grad_norm %.6f\n", step + 1,
                   loss_sum / (double)(o->world * o->accum), norm);
    }
    if (o->dynamic)
        printf("loss scale %g after step %d, %llu steps skipped\n", scaler.scale, o->steps,
               (unsigned long long)scaler.skipped);
    int rc = 0;
    if (o->dump != NULL || o->final_loss) {
        for (uint32_t t = 0; t < m->n_tensors; t++)
            if (o->half)
                round_half(master[t], m->numel[t], o->dtype);
        if (o->final_loss)
            printf("final loss %.9f\n", final_loss(o, m, master));
        if (o->dump != NULL)
            rc = write_params(o->dump, m, master);
    }
    for (uint32_t t = 0; t < m->n_tensors; t++) {
        free(mom[t]);
        free(vel[t]);
        free(acc[t]);
        free(tmp[t]);
        free(w[t]);
        free(g[t]);
    }
    free_params(m, master);
    acts_free(&ac, m);
    free(y);
    return rc;
}

/* ---- training through shardd */

#define RC_PAUSED 75 /* run_shardd: the job paused (another rank died); register again */
#define CHECK(call)                                                                                \
    do {                                                                                           \
        int st_ = (call);                                                                          \
        if (st_ != SHARD_OK) {                                                                     \
            fprintf(stderr, "mlp_train rank %d: %s failed: %s: %s\n", o->rank, #call,              \
                    shard_strerror(st_), shard_last_error(ctx));                                   \
            rc = st_ == SHARD_EPAUSED && o->resume_timeout_ms > 0 ? RC_PAUSED : 1;                 \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* fp32 view of a fetched unit: the shared buffer itself for fp32, else converted into buf */
static const float *unit_view(const shard_unit_info_t *ui, const void *data, float *buf);

/* The job's buffers are a device's (shard_memory is not "host"): this process reads fetched
 * units and fills gradient buffers only through shard_copy, as a GPU trainer's host code must;
 * host_unit holds a unit's bytes on the way. */
static shard_ctx_t *dev_ctx;
static uint16_t *host_unit;

/* fp32 view of a fetched unit (converts bf16 and fp16) */
static void unit_to_f32(const shard_unit_info_t *ui, const void *data, float *out)
{
    if (dev_ctx != NULL) {
        void *to = ui->dtype == SHARD_FP32 ? (void *)out : (void *)host_unit;
        if (shard_copy(dev_ctx, to, data, ui->bytes) != SHARD_OK) {
            fprintf(stderr, "mlp_train: reading a fetched unit: %s\n", shard_last_error(dev_ctx));
            exit(1);
        }
        data = to;
    }
    if (ui->dtype == SHARD_FP32) {
        if (data != out)
            memcpy(out, data, ui->numel * sizeof(float));
        return;
    }
    const uint16_t *h = data;
    for (uint64_t i = 0; i < ui->numel; i++)
        out[i] = from_half(h[i], ui->dtype);
}

static const float *unit_view(const shard_unit_info_t *ui, const void *data, float *buf)
{
    if (ui->dtype == SHARD_FP32 && dev_ctx == NULL)
        return data;
    unit_to_f32(ui, data, buf);
    return buf;
}

/* The forward pass through shardd: fetch each layer's unit (zero-copy for fp32), compute,
 * release. step < 0: an evaluation pass (no skipped layer, no compute wait). */
static int forward_pass(shard_ctx_t *ctx, const struct opts *o, const struct model *m,
                        const shard_unit_info_t *ui, const shard_tensor_info_t *ti, float *const *w,
                        struct acts *ac, int step)
{
    for (int l = 0; l < m->layers; l++) {
        if (step >= 0 && skipped(o, step, l)) {
            layer_skip(m, l, ac, o->batch);
            continue;
        }
        const void *data;
        int st = timed_fetch(ctx, (uint32_t)l, &data);
        if (st != SHARD_OK)
            return st;
        const float *wl = unit_view(&ui[l], data, w[l]);
        if (step >= 0)
            busy_wait_ms(o->compute_ms, o->compute_sleep);
        layer_forward(m, l, wl + ti[2 * l].offset, wl + ti[2 * l + 1].offset, ac, o->batch);
        st = shard_release(ctx, (uint32_t)l);
        if (st != SHARD_OK)
            return st;
    }
    return SHARD_OK;
}

/* the job's secret from file: its bytes into buf (shard_register checks their number), or -1
 * after saying why */
static ssize_t read_secret(const char *file, uint8_t *buf, size_t cap)
{
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "mlp_train: --job-secret-file %s: %s\n", file, strerror(errno));
        return -1;
    }
    ssize_t n = 0, r;
    while ((size_t)n < cap && (r = read(fd, buf + n, cap - (size_t)n)) > 0)
        n += r;
    int err = errno;
    close(fd);
    if (n < 0 || r < 0) {
        fprintf(stderr, "mlp_train: --job-secret-file %s: %s\n", file, strerror(err));
        return -1;
    }
    return n;
}

/* torchrun's LOCAL_WORLD_SIZE, else Slurm's SLURM_NTASKS_PER_NODE (0: neither, the daemon's
 * ranks_per_node) */
static uint32_t launcher_ranks_per_node(void)
{
    const char *v = getenv("LOCAL_WORLD_SIZE");
    if (v == NULL || v[0] == '\0')
        v = getenv("SLURM_NTASKS_PER_NODE");
    return v != NULL ? (uint32_t)strtoul(v, NULL, 10) : 0;
}

/* the first of two launcher variables that is set, as a number into *out; false (and a message
 * naming it) when it is not one */
static bool launcher_int(const char *a, const char *b, int *out)
{
    const char *name = a, *v = getenv(a);
    if (v == NULL || v[0] == '\0') {
        name = b;
        v = getenv(b);
    }
    if (v == NULL || v[0] == '\0')
        return true;
    char *end;
    long n = strtol(v, &end, 10);
    if (*end != '\0' || n < 0 || n > 1 << 20) {
        fprintf(stderr, "mlp_train: %s=%s is not a number\n", name, v);
        return false;
    }
    *out = (int)n;
    return true;
}

/* The launcher's rank, world and job name, the defaults that --rank, --world and --job
 * override: torchrun's RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID (job torch-ID), else Slurm's
 * SLURM_PROCID, SLURM_NTASKS and SLURM_JOB_ID with SLURM_STEP_ID (job slurm-ID.STEP). */
static bool launcher_defaults(struct opts *o, char *job, size_t len)
{
    if (!launcher_int("RANK", "SLURM_PROCID", &o->rank) ||
        !launcher_int("WORLD_SIZE", "SLURM_NTASKS", &o->world))
        return false;
    const char *run = getenv("TORCHELASTIC_RUN_ID"), *sj = getenv("SLURM_JOB_ID");
    const char *step = getenv("SLURM_STEP_ID");
    if (run != NULL && run[0] != '\0')
        snprintf(job, len, "torch-%s", run);
    else if (sj != NULL && sj[0] != '\0')
        snprintf(job, len, "slurm-%s%s%s", sj, step && step[0] ? "." : "", step ? step : "");
    if (job[0] != '\0')
        o->job = job;
    return true;
}

static int run_shardd(const struct opts *o, const struct model *m)
{
    shard_ctx_t *ctx = NULL;
    int rc = 0;
    uint32_t units = 0;
    float *w[MAX_LAYERS] = {0}, *grad[MAX_LAYERS] = {0};
    uint16_t *grad16[MAX_LAYERS] = {0};
    struct acts ac = {0};
    float *y = NULL;
    float **init = initial_params(m, o);
    CHECK(shard_attach(o->socket, &ctx));
    shard_tensor_t tensors[2 * MAX_LAYERS];
    uint64_t dims[2 * MAX_LAYERS][2];
    char names[2 * MAX_LAYERS][32];
    for (int l = 0; l < m->layers; l++) {
        snprintf(names[2 * l], sizeof(names[0]), "fc%d.weight", l);
        snprintf(names[2 * l + 1], sizeof(names[0]), "fc%d.bias", l);
        dims[2 * l][0] = (uint64_t)m->dims[l + 1];
        dims[2 * l][1] = (uint64_t)m->dims[l];
        dims[2 * l + 1][0] = (uint64_t)m->dims[l + 1];
        for (int k = 0; k < 2; k++)
            tensors[2 * l + k] = (shard_tensor_t){.name = names[2 * l + k],
                                                  .ndim = k == 0 ? 2u : 1u,
                                                  .dims = dims[2 * l + k],
                                                  .dtype = o->dtype,
                                                  .unit = (uint32_t)l};
    }
    shard_model_t model = {
        .job = o->job,
        .rank = (uint32_t)o->rank,
        .world = (uint32_t)o->world,
        .plan = o->plan,
        .tensors = tensors,
        .n_tensors = m->n_tensors,
        .optimizer = {.name = o->optimizer,
                      .lr = o->lr,
                      .beta1 = 0.9f,
                      .beta2 = 0.999f,
                      .eps = 1e-8f,
                      .weight_decay = o->weight_decay,
                      .momentum = 0.9f,
                      .max_grad_norm = o->max_grad_norm},
        .init = (const float *const *)init,
        .max_live_bytes = o->max_live_bytes,
        .load = o->load,
        .resume_timeout_ms = o->resume_timeout_ms,
        .ranks_per_node = o->ranks_per_node ? o->ranks_per_node : launcher_ranks_per_node(),
        .leader = o->leader,
    };
    uint8_t secret[SHARD_JOB_SECRET_MAX + 1];
    if (o->secret_file != NULL) {
        ssize_t n = read_secret(o->secret_file, secret, sizeof(secret));
        if (n < 0) {
            rc = 2;
            goto out;
        }
        model.job_secret = secret;
        model.job_secret_len = (size_t)n;
    }
    CHECK(shard_register(ctx, &model));
    int first = (int)shard_start_step(ctx);
    if (shard_resumed(ctx))
        printf("rank %d: resumed the paused job after step %d\n", o->rank, first);
    if (o->load != NULL && !o->quiet && o->rank == 0)
        printf("rank 0: loaded step %d from %s\n", first, o->load);

    free_params(m, init);
    init = NULL;
    if (strcmp(shard_memory(ctx), "host") != 0) {
        dev_ctx = ctx;
        if (!o->quiet && o->rank == 0)
            printf("rank 0: the job's buffers are %s memory (read through shard_copy)\n",
                   shard_memory(ctx));
    }
    units = shard_num_units(ctx);
    shard_unit_info_t ui[MAX_LAYERS];
    shard_tensor_info_t ti[2 * MAX_LAYERS];
    size_t max_unit = 0;
    for (uint32_t u = 0; u < units; u++) {
        CHECK(shard_unit_info(ctx, u, &ui[u]));
        max_unit = ui[u].bytes > max_unit ? ui[u].bytes : max_unit;
        w[u] = calloc(ui[u].numel, sizeof(float));
        grad[u] = calloc(ui[u].numel, sizeof(float));
        grad16[u] = calloc(ui[u].numel, sizeof(uint16_t));
    }
    host_unit = dev_ctx != NULL ? malloc(max_unit ? max_unit : 1) : NULL;
    for (uint32_t t = 0; t < m->n_tensors; t++)
        CHECK(shard_tensor_info(ctx, t, &ti[t]));

    acts_alloc(&ac, m, o->batch);
    y = calloc((size_t)o->batch * OUT_DIM, sizeof(float));
    struct timespec t0, t1;
    shard_scaler_t scaler;
    scaler_start(o, &scaler);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int step = first; step < o->steps; step++) {
        struct timespec ts0, ts1;
        clock_gettime(CLOCK_MONOTONIC, &ts0);
        double loss_sum = 0.0;
        double S = o->dynamic ? scaler.scale : o->loss_scale; /* this step's loss scale */
        if (step == 0 && o->diverge_from > 0 && o->rank >= o->diverge_from) {
            const void *data; /* an extra fetch: this rank's schedule differs from the others' */
            CHECK(shard_fetch(ctx, units - 1, &data));
            CHECK(shard_release(ctx, units - 1));
        }
        for (int micro = 0; micro < o->accum; micro++) {
            if (o->mark_last > 0 && micro == o->accum - o->mark_last)
                CHECK(shard_last_micro_step(ctx, 1)); /* this backward's pushes end the step */
            make_batch(o, step, micro, o->rank, ac.a[0], y);
            CHECK(forward_pass(ctx, o, m, ui, ti, w, &ac, step));
            loss_sum += loss_grad(m, y, &ac, o->batch);
            for (int l = m->layers - 1; l >= 0; l--) { /* backward: fetch, grads, push */
                const void *data;
                if (skipped(o, step, l))
                    continue; /* nothing fetched, nothing pushed: a zero gradient */
                CHECK(timed_fetch(ctx, (uint32_t)l, &data));
                const float *wl = unit_view(&ui[l], data, w[l]);
                busy_wait_ms(o->compute_ms, o->compute_sleep);
                /* layer_backward writes both tensors; the padding between them stays zero. With
                 * --zero-copy an fp32 gradient is written straight into the staging buffer,
                 * whose padding holds what an earlier push left there: zeroed here. */
                double p0 = now_s();
                void *sbuf = NULL;
                if (o->zero_copy)
                    CHECK(shard_grad_buffer(ctx, (uint32_t)l, &sbuf));
                spent.push += now_s() - p0;
                /* on a device's buffer the gradient is made here and copied in below */
                bool in_place = o->zero_copy && dev_ctx == NULL;
                float *gl = in_place && !o->half ? sbuf : grad[l];
                if (gl != grad[l])
                    zero_padding(gl, &ui[l], &ti[2 * l]);
                layer_backward(m, l, wl + ti[2 * l].offset, gl + ti[2 * l].offset,
                               gl + ti[2 * l + 1].offset, &ac, o->batch);
                if (S != 1.0) /* a loss scaled before its backward */
                    for (uint64_t i = 0; i < ui[l].numel; i++)
                        gl[i] = (float)(gl[i] * S);
                if (o->nonfinite == step + 1 && micro == 0 && o->rank == 0 && l == NONFINITE_UNIT)
                    gl[ti[2 * l].offset + 3] = NAN;
                CHECK(shard_release(ctx, (uint32_t)l));
                p0 = now_s();
                if (o->half) {
                    uint16_t *g16 = in_place ? sbuf : grad16[l];
                    for (uint64_t i = 0; i < ui[l].numel; i++)
                        g16[i] = to_half(grad[l][i], o->dtype);
                }
                if (o->zero_copy && !in_place)
                    CHECK(
                        shard_copy(ctx, sbuf, o->half ? (void *)grad16[l] : grad[l], ui[l].bytes));
                if (o->zero_copy)
                    CHECK(shard_push_staged(ctx, (uint32_t)l));
                else
                    CHECK(shard_push_grad(ctx, (uint32_t)l, o->half ? (void *)grad16[l] : grad[l],
                                          ui[l].bytes));
                spent.push += now_s() - p0;
            }
        }
        double norm = 0.0, s0 = now_s();
        int st = o->dynamic ? shard_step_amp(ctx, NULL, &scaler, &norm)
                            : shard_step_scaled(ctx, NULL, o->loss_scale, &norm);
        if (o->nonfinite == step + 1) { /* the step must fail, naming the unit, and the job go on */
            char want[32];
            snprintf(want, sizeof(want), "unit %d ", NONFINITE_UNIT);
            if (st != SHARD_ENONFINITE || strstr(shard_last_error(ctx), want) == NULL) {
                fprintf(
                    stderr, "mlp_train rank %d: step %d with a NaN gradient in unit %d: %s: %s\n",
                    o->rank, step + 1, NONFINITE_UNIT, shard_strerror(st), shard_last_error(ctx));
                rc = 1;
                goto out;
            }
            printf("rank %d step %d failed as it must: %s: %s\n", o->rank, step + 1,
                   shard_strerror(st), shard_last_error(ctx));
            continue;
        }
        if (o->dynamic && st == SHARD_ENONFINITE) { /* an overflow: skipped on every rank */
            if (!o->quiet && o->rank == 0)
                printf("step %d skipped (non-finite gradient at loss scale %g)\n", step + 1, S);
            continue;
        }
        CHECK(st);
        spent.step += now_s() - s0;
        clock_gettime(CLOCK_MONOTONIC, &ts1);
        if (o->timing && o->rank == 0)
            printf("timing step %d: in fetch %.4f s, in push %.4f s, in step %.4f s, "
                   "in compute waits %.4f s\n",
                   step + 1, spent.fetch, spent.push, spent.step, spent.wait);
        memset(&spent, 0, sizeof(spent));
        if (o->save_every > 0 && (step + 1) % o->save_every == 0) {
            uint64_t saved = 0;
            if (o->save_delay_ms > 0)
                usleep((useconds_t)o->save_delay_ms * 1000);
            double sv0 = now_s();
            CHECK(shard_save(ctx, o->save_dir, &saved));
            if (!o->quiet && o->rank == 0)
                printf("rank 0: saved step %llu to %s in %.3f s\n", (unsigned long long)saved,
                       o->save_dir, now_s() - sv0);
        }
        if (!o->quiet && o->rank == 0)
            printf("step %d loss %.6f grad_norm %.6f (rank 0 micro-batches) %.4f s\n", step + 1,
                   loss_sum / o->accum, norm,
                   (double)(ts1.tv_sec - ts0.tv_sec) + (double)(ts1.tv_nsec - ts0.tv_nsec) / 1e9);
        if (o->eval_every > 0 && (step + 1) % o->eval_every == 0) {
            /* a forward-only pass on held-out data: fetches and releases, nothing pushed */
            make_batch(o, 1000000 + step, 0, o->rank, ac.a[0], y);
            CHECK(forward_pass(ctx, o, m, ui, ti, w, &ac, -1));
            float eval = loss_grad(m, y, &ac, o->batch);
            if (!o->quiet && o->rank == 0)
                printf("eval after step %d: loss %.6f\n", step + 1, eval);
        }
        fflush(stdout);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (o->dynamic)
        printf("loss scale %g after step %d, %llu steps skipped\n", scaler.scale, o->steps,
               (unsigned long long)scaler.skipped);
    if (!o->quiet && o->rank == 0)
        printf("rank 0: %d steps in %.3f s\n", o->steps,
               (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);

    if (o->dump != NULL || (o->final_loss && o->rank == 0)) {
        float *params[2 * MAX_LAYERS];
        for (uint32_t u = 0; u < units; u++) {
            const void *data;
            CHECK(shard_fetch(ctx, u, &data));
            unit_to_f32(&ui[u], data, w[u]);
            CHECK(shard_release(ctx, u));
        }
        for (uint32_t t = 0; t < m->n_tensors; t++)
            params[t] = w[ti[t].unit] + ti[t].offset;
        if (o->final_loss && o->rank == 0)
            printf("final loss %.9f\n", final_loss(o, m, params));
        if (o->dump != NULL && write_params(o->dump, m, params) != 0)
            rc = 1;
    }
out:
    if (ctx != NULL)
        shard_detach(ctx);
    for (uint32_t u = 0; u < MAX_LAYERS; u++) {
        free(w[u]);
        free(grad[u]);
        free(grad16[u]);
    }
    if (ac.dz != NULL)
        acts_free(&ac, m);
    free(y);
    free(host_unit);
    host_unit = NULL;
    dev_ctx = NULL;
    free_params(m, init);
    return rc;
}

/* --compute-only: the forward and backward passes of run_shardd (the same matrix products and
 * compute waits, the same step lines) on this process's own copy of the initial weights, with
 * no shardd and no update: the compute a step needs when communication costs nothing. */
static int run_compute_only(const struct opts *o, const struct model *m)
{
    float **p = initial_params(m, o);
    float *g[2 * MAX_LAYERS];
    struct acts ac = {0};
    float *y = calloc((size_t)o->batch * OUT_DIM, sizeof(float));
    for (uint32_t t = 0; t < m->n_tensors; t++)
        g[t] = calloc(m->numel[t], sizeof(float));
    acts_alloc(&ac, m, o->batch);
    for (int step = 0; step < o->steps; step++) {
        double t0 = now_s(), loss_sum = 0.0;
        for (int micro = 0; micro < o->accum; micro++) {
            make_batch(o, step, micro, o->rank, ac.a[0], y);
            for (int l = 0; l < m->layers; l++) {
                busy_wait_ms(o->compute_ms, o->compute_sleep);
                layer_forward(m, l, p[2 * l], p[2 * l + 1], &ac, o->batch);
            }
            loss_sum += loss_grad(m, y, &ac, o->batch);
            for (int l = m->layers - 1; l >= 0; l--) {
                busy_wait_ms(o->compute_ms, o->compute_sleep);
                layer_backward(m, l, p[2 * l], g[2 * l], g[2 * l + 1], &ac, o->batch);
            }
        }
        if (!o->quiet && o->rank == 0)
            printf("step %d loss %.6f (compute only) %.4f s\n", step + 1, loss_sum / o->accum,
                   now_s() - t0);
        fflush(stdout);
    }
    for (uint32_t t = 0; t < m->n_tensors; t++)
        free(g[t]);
    acts_free(&ac, m);
    free(y);
    free_params(m, p);
    return 0;
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: mlp_train [--socket PATH] [--job NAME] [--rank R] [--world W]\n"
            "                 [--plan topo:W/G/OS|ddp|zero1|zero2|zero3|zeropp|mics:P|topo|\n"
            "                         topo-fp, options ,sec=S ,qw ,qg ,qsec ,ef ...]\n"
            "                 [--steps N] [--accum S]\n"
            "                 [--optimizer adamw|sgd] [--dtype fp32|bf16|fp16] [--seed X]\n"
            "                 [--lr LR] [--weight-decay WD] [--max-grad-norm C]\n"
            "                 [--loss-scale S|dynamic[:INIT[:INTERVAL]]]\n"
            "                 [--batch B] [--hidden H] [--layers L] [--compute-ms MS]\n"
            "                 [--max-live-bytes B] [--skip-layer STEP:LAYER] [--eval-every N]\n"
            "                 [--diverge-from R] [--compute-mode busy|sleep]\n"
            "                 [--dump-params FILE] [--reference] [--compute-only] [--quiet]\n"
            "                 [--timing] [--zero-copy] [--final-loss] [--nonfinite STEP]\n"
            "                 [--mark-last | --mark-last-from N]\n"
            "                 [--save-every N --save-dir DIR] [--save-delay-ms MS] [--load DIR]\n"
            "                 [--resume-timeout-ms MS] [--ranks-per-node K]\n"
            "                 [--job-secret-file FILE] [--leader HOST[:PORT]]\n"
            "Trains a %d-input, %d-output MLP through shardd (or, with --reference, with plain\n"
            "data parallelism in this one process). Defaults: job mlp, rank 0, world 1, plan\n"
            "ddp, 20 steps, accum 1, adamw, fp32, seed 1, lr 1e-3, batch 8, hidden 384,\n"
            "layers 4 (about 327k parameters; at most %d layers). --compute-ms adds a busy\n"
            "wait per layer, forward and backward; --max-live-bytes sizes the job's gather\n"
            "pool (0: every unit).\n"
            "--compute-mode sleep waits idle instead (a GPU kernel; for machines with fewer\n"
            "cores than ranks). --skip-layer makes a hidden layer the identity in one step\n"
            "(no fetch, no gradient; the reference does the same); --eval-every runs a\n"
            "forward-only pass after every N steps; --diverge-from makes ranks >= R fetch one\n"
            "extra unit in step 1 (a schedule that differs between ranks, which shardd must\n"
            "refuse). --timing prints, per step, the seconds rank 0 spent waiting inside\n"
            "shard_fetch, shard_push_grad and shard_step. --zero-copy writes each gradient\n"
            "straight into shardd's staging buffer (shard_grad_buffer, shard_push_staged)\n"
            "instead of having shard_push_grad copy it. --mark-last calls\n"
            "shard_last_micro_step before the last micro-step (the daemon sends each unit's\n"
            "gradient across nodes as soon as its node pushed it); --mark-last-from N before\n"
            "the N-th last (N > 1 breaks the promise: the job must fail). --compute-only runs this "
            "rank's\n"
            "forward and backward passes (matrix products and compute waits) on its own copy\n"
            "of the weights, without shardd and without updates: the compute alone.\n"
            "--final-loss prints the trained parameters' mean loss on 16 held-out batches of\n"
            "64 (rank 0, or the reference): the same measure for any world, plan or accum.\n"
            "--loss-scale S pushes every gradient multiplied by S and steps with\n"
            "shard_step_scaled, which divides them by S again (a power of two: the same bits).\n"
            "--loss-scale dynamic scales by libshard's scaler instead (shard_step_amp,\n"
            "torch.amp.GradScaler's rule: INIT 65536, x2 after INTERVAL 2000 steps taken, x0.5\n"
            "after a step skipped for an overflow; with --dtype fp16 a gradient beyond 65504\n"
            "overflows); the reference scales and skips alike. Either prints the last scale and\n"
            "the steps skipped (the scaler starts afresh after --load).\n"
            "--nonfinite makes rank 0 push a NaN in unit 1's gradient in step STEP (from 1):\n"
            "that step must fail with SHARD_ENONFINITE naming the unit, and training go on\n"
            "(the reference skips the step's update alike).\n"
            "--save-every N --save-dir DIR saves a checkpoint (shard_save) after every N steps\n"
            "into DIR/step-NNNNNNNN and points DIR/LATEST at it; --load DIR starts from DIR's\n"
            "LATEST checkpoint (or DIR, a checkpoint) under any world and plan and trains from\n"
            "its step to --steps; with --reference the checkpoint is read without shardd.\n"
            "--save-delay-ms MS waits MS before each save: a rank that comes late to it.\n"
            "--resume-timeout-ms MS registers the job with that resume timeout: when a rank\n"
            "dies the job pauses, and this rank, told so (SHARD_EPAUSED), registers again\n"
            "and continues from the step the job paused at; a restarted rank does the same.\n"
            "--ranks-per-node K: the job's ranks per node (rank r on node r / K; default\n"
            "torchrun's LOCAL_WORLD_SIZE or Slurm's SLURM_NTASKS_PER_NODE when set, else the\n"
            "daemon's ranks_per_node).\n"
            "--job-secret-file FILE: the job's secret (16-4096 bytes, the same file for every\n"
            "rank; default $SHARD_JOB_SECRET_FILE): the daemons form the job across nodes of\n"
            "the nodes whose ranks gave it, and refuse a node that reports the job without it.\n"
            "--leader HOST[:PORT]: the job's leader, the daemon of rank 0's node, which\n"
            "independent daemons (no cluster list) meet through (default $SHARD_LEADER, else\n"
            "torchrun's MASTER_ADDR, else the first host of Slurm's SLURM_STEP_NODELIST, port\n"
            "$SHARD_LEADER_PORT or 7701).\n"
            "Under a launcher the rank, world and job default to torchrun's RANK, WORLD_SIZE\n"
            "and TORCHELASTIC_RUN_ID (job torch-ID), else Slurm's SLURM_PROCID, SLURM_NTASKS\n"
            "and SLURM_JOB_ID.SLURM_STEP_ID (job slurm-ID.STEP); the options override them.\n",
            IN_DIM, OUT_DIM, MAX_LAYERS);
}

int main(int argc, char **argv)
{
    struct opts o = {.job = "mlp",
                     .plan = "ddp",
                     .optimizer = "adamw",
                     .world = 1,
                     .steps = 20,
                     .accum = 1,
                     .batch = 8,
                     .hidden = 384,
                     .layers = 4,
                     .seed = 1,
                     .lr = 1e-3f,
                     .loss_scale = 1.0,
                     .dtype = SHARD_FP32,
                     .scale_init = 65536.0,
                     .scale_interval = 2000};
    char launcher_job[96] = "";
    if (!launcher_defaults(&o, launcher_job, sizeof(launcher_job)))
        return 2;
    o.secret_file = getenv("SHARD_JOB_SECRET_FILE");
    if (o.secret_file != NULL && o.secret_file[0] == '\0')
        o.secret_file = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define ARG(name) (strcmp(a, name) == 0 && v != NULL && ++i)
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(a, "--reference") == 0) {
            o.reference = true;
        } else if (strcmp(a, "--compute-only") == 0) {
            o.compute_only = true;
        } else if (strcmp(a, "--zero-copy") == 0) {
            o.zero_copy = true;
        } else if (strcmp(a, "--mark-last") == 0) {
            o.mark_last = 1;
        } else if (ARG("--mark-last-from")) {
            o.mark_last = atoi(v);
        } else if (strcmp(a, "--quiet") == 0) {
            o.quiet = true;
        } else if (strcmp(a, "--timing") == 0) {
            o.timing = true;
        } else if (ARG("--socket")) {
            o.socket = v;
        } else if (ARG("--job")) {
            o.job = v;
        } else if (ARG("--rank")) {
            o.rank = atoi(v);
        } else if (ARG("--world")) {
            o.world = atoi(v);
        } else if (ARG("--plan")) {
            o.plan = v;
        } else if (ARG("--steps")) {
            o.steps = atoi(v);
        } else if (ARG("--accum")) {
            o.accum = atoi(v);
        } else if (ARG("--optimizer")) {
            o.optimizer = v;
        } else if (ARG("--dtype")) {
            if (strcmp(v, "bf16") != 0 && strcmp(v, "fp32") != 0 && strcmp(v, "fp16") != 0) {
                fprintf(stderr, "mlp_train: --dtype must be fp32, bf16 or fp16\n");
                return 2;
            }
            o.dtype = strcmp(v, "bf16") == 0   ? SHARD_BF16
                      : strcmp(v, "fp16") == 0 ? SHARD_FP16
                                               : SHARD_FP32;
            o.half = o.dtype != SHARD_FP32;
        } else if (ARG("--seed")) {
            o.seed = strtoull(v, NULL, 10);
        } else if (ARG("--lr")) {
            o.lr = strtof(v, NULL);
        } else if (ARG("--weight-decay")) {
            o.weight_decay = strtof(v, NULL);
        } else if (ARG("--max-grad-norm")) {
            o.max_grad_norm = strtof(v, NULL);
        } else if (ARG("--loss-scale")) {
            if (strncmp(v, "dynamic", 7) == 0 && (v[7] == '\0' || v[7] == ':')) {
                char *end = (char *)v + 7;
                o.dynamic = true;
                if (*end == ':')
                    o.scale_init = strtod(end + 1, &end);
                if (*end == ':')
                    o.scale_interval = (uint32_t)strtoul(end + 1, &end, 10);
                if (*end != '\0' || !(o.scale_init > 0) || !isfinite(o.scale_init) ||
                    o.scale_interval == 0) {
                    fprintf(stderr, "mlp_train: --loss-scale dynamic[:INIT[:INTERVAL]]: INIT a "
                                    "positive number, INTERVAL a positive count\n");
                    return 2;
                }
            } else {
                o.loss_scale = strtod(v, NULL);
            }
        } else if (ARG("--batch")) {
            o.batch = atoi(v);
        } else if (ARG("--hidden")) {
            o.hidden = atoi(v);
        } else if (ARG("--layers")) {
            o.layers = atoi(v);
        } else if (ARG("--compute-ms")) {
            o.compute_ms = strtod(v, NULL);
        } else if (ARG("--max-live-bytes")) {
            o.max_live_bytes = strtoull(v, NULL, 0);
        } else if (ARG("--compute-mode")) {
            if (strcmp(v, "busy") != 0 && strcmp(v, "sleep") != 0) {
                fprintf(stderr, "mlp_train: --compute-mode must be busy or sleep\n");
                return 2;
            }
            o.compute_sleep = strcmp(v, "sleep") == 0;
        } else if (ARG("--skip-layer")) {
            if (sscanf(v, "%d:%d", &o.skip_step, &o.skip_layer) != 2 || o.skip_step < 1) {
                fprintf(stderr, "mlp_train: --skip-layer wants STEP:LAYER, steps from 1\n");
                return 2;
            }
        } else if (ARG("--eval-every")) {
            o.eval_every = atoi(v);
        } else if (strcmp(a, "--final-loss") == 0) {
            o.final_loss = true;
        } else if (ARG("--nonfinite")) {
            o.nonfinite = atoi(v);
        } else if (ARG("--diverge-from")) {
            o.diverge_from = atoi(v);
        } else if (ARG("--save-every")) {
            o.save_every = atoi(v);
        } else if (ARG("--save-delay-ms")) {
            o.save_delay_ms = atoi(v);
        } else if (ARG("--save-dir")) {
            o.save_dir = v;
        } else if (ARG("--resume-timeout-ms")) {
            o.resume_timeout_ms = strtoull(v, NULL, 10);
        } else if (ARG("--ranks-per-node")) {
            o.ranks_per_node = (uint32_t)strtoul(v, NULL, 10);
        } else if (ARG("--job-secret-file")) {
            o.secret_file = v;
        } else if (ARG("--leader")) {
            o.leader = v;
        } else if (ARG("--load")) {
            o.load = v;
        } else if (ARG("--dump-params")) {
            o.dump = v;
        } else {
            fprintf(stderr, "mlp_train: unknown or incomplete argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
#undef ARG
    }
    if (o.world < 1 || o.rank < 0 || o.rank >= o.world || o.steps < 0 || o.accum < 1 ||
        o.batch < 1 || o.hidden < 1 || o.layers < 1 || o.layers > MAX_LAYERS ||
        (strcmp(o.optimizer, "adamw") != 0 && strcmp(o.optimizer, "sgd") != 0)) {
        fprintf(stderr,
                "mlp_train: invalid arguments (rank %d world %d layers %d optimizer %s): need "
                "0 <= rank < world, 1 <= layers <= %d, accum, batch and hidden >= 1, steps >= 0, "
                "optimizer adamw or sgd\n",
                o.rank, o.world, o.layers, o.optimizer, MAX_LAYERS);
        return 2;
    }
    if (o.mark_last < 0 || o.mark_last > o.accum) {
        fprintf(stderr, "mlp_train: --mark-last-from %d: it must be in 1..accum (%d)\n",
                o.mark_last, o.accum);
        return 2;
    }
    if ((o.save_every > 0) != (o.save_dir != NULL) || o.save_every < 0) {
        fprintf(stderr, "mlp_train: --save-every N (N >= 1) and --save-dir DIR go together\n");
        return 2;
    }
    struct model m;
    model_init(&m, &o);
    if (o.skip_step > 0 && (o.skip_layer < 1 || o.skip_layer >= m.layers - 1 ||
                            m.dims[o.skip_layer] != m.dims[o.skip_layer + 1])) {
        fprintf(stderr, "mlp_train: --skip-layer: layer %d is not a square hidden layer (1..%d)\n",
                o.skip_layer, m.layers - 2);
        return 2;
    }
    if (o.compute_only)
        return run_compute_only(&o, &m);
    if (o.reference)
        return run_reference(&o, &m);
    /* a paused job (another rank died): register again and go on from where it paused */
    int rc = run_shardd(&o, &m);
    for (int again = 0; rc == RC_PAUSED && again < 16; again++) {
        printf("rank %d: the job paused; registering again\n", o.rank);
        fflush(stdout);
        rc = run_shardd(&o, &m);
    }
    return rc == RC_PAUSED ? 1 : rc;
}

/* Launchers of the one kernel source (kern_ops.h). */
#include "kern_ops.h"
#include "sd/codec.h"
#include "sd/model.h"

#include <math.h>

_Static_assert((int)SDK_FP32 == (int)SD_DTYPE_FP32 && (int)SDK_BF16 == (int)SD_DTYPE_BF16 &&
                   (int)SDK_FP16 == (int)SD_DTYPE_FP16,
               "the kernels' dtype codes are sd/model.h's");

/* enough blocks to fill the largest GPUs (132 SMs x 8 blocks of 256 threads), few enough that
 * each thread has several elements to stream */
#define SDK_MAX_BLOCKS 2048

#define SDK_NAME(id, name) #name,
const char *const sdk_kernel_names[SDK_K_COUNT] = {SDK_KERNELS(SDK_NAME)};
#undef SDK_NAME

uint64_t sdk_blocks(uint64_t work)
{
    uint64_t b = (work + SDK_THREADS_PER_BLOCK - 1) / SDK_THREADS_PER_BLOCK;
    return b == 0 ? 1 : b > SDK_MAX_BLOCKS ? SDK_MAX_BLOCKS : b;
}

uint64_t sdk_sumsq_blocks(uint64_t n)
{
    const uint64_t per_block = (uint64_t)SDK_THREADS_PER_BLOCK * SDK_SUMSQ_PER_THREAD;
    uint64_t b = (n + per_block - 1) / per_block;
    return b == 0 ? 1 : b > SDK_SUMSQ_MAX_BLOCKS ? SDK_SUMSQ_MAX_BLOCKS : b;
}

void sdk_at(struct sdk_launcher *l, const void *p)
{
    if (l->route == NULL)
        return;
    int d = l->route->device_of(l, p);
    if (d >= 0 && d != l->cur)
        l->route->use(l, d);
}

const void *sdk_readable(struct sdk_launcher *l, const void *src, size_t bytes)
{
    if (l->route == NULL || bytes == 0)
        return src;
    int e = l->route->device_of(l, src);
    return e < 0 || e == l->cur || l->route->peer(l, l->cur, e) ? src
                                                                : l->route->bring(l, src, bytes);
}

/* the launcher a queue starts with */
static struct sdk_launcher *L(struct sd_gpu_queue *q)
{
    return (struct sdk_launcher *)(void *)q;
}

void sdk_op_reduce_add(struct sd_gpu_queue *q, float *acc, const void *src, int dtype, size_t n)
{
    struct sdk_launcher *l = L(q);
    uint64_t n64 = n;
    if (n == 0)
        return;
    sdk_at(l, acc);
    src = sdk_readable(l, src, n * sd_dtype_size(dtype));
    void *args[] = {&acc, &src, &dtype, &n64};
    l->launch(l, SDK_K_REDUCE_ADD, sdk_blocks(n), args);
}

void sdk_op_to_f32(struct sd_gpu_queue *q, float *dst, const void *src, int dtype, size_t n)
{
    struct sdk_launcher *l = L(q);
    uint64_t n64 = n;
    if (n == 0)
        return;
    sdk_at(l, dst);
    src = sdk_readable(l, src, n * sd_dtype_size(dtype));
    void *args[] = {&dst, &src, &dtype, &n64};
    l->launch(l, SDK_K_TO_F32, sdk_blocks(n), args);
}

void sdk_op_from_f32(struct sd_gpu_queue *q, void *dst, int dtype, const float *src, size_t n)
{
    struct sdk_launcher *l = L(q);
    uint64_t n64 = n;
    if (n == 0)
        return;
    sdk_at(l, dst);
    src = sdk_readable(l, src, n * sizeof(float));
    void *args[] = {&dst, &dtype, &src, &n64};
    l->launch(l, SDK_K_FROM_F32, sdk_blocks(n), args);
}

void sdk_sum_sq(struct sdk_launcher *l, const float *x, size_t n)
{
    sdk_at(l, x); /* the partials in that device's scratch */
    uint64_t n64 = n, blocks = sdk_sumsq_blocks(n);
    uint32_t parts = (uint32_t)blocks;
    double *part = l->scratch, *out = l->scratch + SDK_SUMSQ_MAX_BLOCKS;
    void *a1[] = {&x, &n64, &part};
    l->launch(l, SDK_K_SUMSQ_PART, blocks, a1);
    void *a2[] = {&part, &parts, &out};
    l->launch(l, SDK_K_SUMSQ_FINAL, 1, a2);
}

struct sdk_adamw_c sdk_adamw_consts(const struct sd_adamw_args *a)
{
    /* AdamW as torch.optim.AdamW computes it (decoupled decay, bias correction); Adam's decay
     * goes into the gradient instead (torch.optim.Adam) */
    const float bc1 = 1.0f - powf(a->beta1, (float)a->step);
    const float bc2 = 1.0f - powf(a->beta2, (float)a->step);
    return (struct sdk_adamw_c){.decay = a->l2 ? 1.0f : 1.0f - a->lr * a->weight_decay,
                                .l2 = a->l2 ? a->weight_decay : 0.0f,
                                .b1 = a->beta1,
                                .b2 = a->beta2,
                                .omb1 = 1.0f - a->beta1,
                                .omb2 = 1.0f - a->beta2,
                                .step_size = a->lr / bc1,
                                .sqrt_bc2 = sqrtf(bc2),
                                .eps = a->eps};
}

void sdk_op_adamw(struct sd_gpu_queue *q, const struct sd_adamw_args *a, float *master, float *m,
                  float *v, float *grad, float scale, void *w, int w_dtype, size_t n)
{
    struct sdk_launcher *l = L(q);
    struct sdk_adamw_c c = sdk_adamw_consts(a);
    uint64_t n64 = n;
    void *args[] = {&c, &master, &m, &v, &grad, &scale, &w, &w_dtype, &n64};
    if (n == 0)
        return;
    sdk_at(l, master); /* a shard's states and gradient, all on its rank's device */
    l->launch(l, SDK_K_ADAMW, sdk_blocks((n + 3) / 4), args);
}

void sdk_op_sgd(struct sd_gpu_queue *q, const struct sd_sgd_args *a, float *master, float *buf,
                float *grad, float scale, void *w, int w_dtype, size_t n)
{
    struct sdk_launcher *l = L(q);
    struct sdk_sgd_c c = {
        .lr = a->lr, .mu = a->momentum, .wd = a->weight_decay, .nest = a->nesterov ? 1.0f : 0.0f};
    uint64_t n64 = n;
    void *args[] = {&c, &master, &buf, &grad, &scale, &w, &w_dtype, &n64};
    if (n == 0)
        return;
    sdk_at(l, master);
    l->launch(l, SDK_K_SGD, sdk_blocks(n), args);
}

static void encode(struct sdk_launcher *l, void *dst, int bits, const void *src, int dtype,
                   float *err, size_t n, uint32_t block)
{
    sdk_at(l, dst); /* err, written too, lives beside dst (the quantized copies' memory) */
    src = sdk_readable(l, src, n * sd_dtype_size(dtype));
    uint64_t n64 = n, blocks = sd_codec_blocks(n, block);
    float *scales = dst;
    uint8_t *vals = (uint8_t *)dst + 4 * blocks;
    void *a1[] = {&scales, &src, &dtype, &err, &n64, &block};
    l->launch(l, SDK_K_SCALES, sdk_blocks(blocks * 32), a1); /* 32 threads a codec block */
    void *a2[] = {&vals, &bits, &scales, &src, &dtype, &err, &n64, &block};
    l->launch(l, SDK_K_ENCODE, sdk_blocks(bits == SD_CODEC_INT8 ? n : (n + 1) / 2), a2);
}

void sdk_op_quantize(struct sd_gpu_queue *q, void *dst, int bits, const void *src, int src_dtype,
                     size_t n, uint32_t block)
{
    if (n > 0)
        encode(L(q), dst, bits, src, src_dtype, NULL, n, block);
}

void sdk_op_quantize_ef(struct sd_gpu_queue *q, void *dst, int bits, const float *x, float *err,
                        size_t n, uint32_t block)
{
    if (n > 0)
        encode(L(q), dst, bits, x, SD_DTYPE_FP32, err, n, block);
}

void sdk_op_dequantize(struct sd_gpu_queue *q, void *dst, int dst_dtype, const void *src, int bits,
                       size_t n, uint32_t block, bool accumulate)
{
    struct sdk_launcher *l = L(q);
    uint64_t n64 = n;
    if (n == 0)
        return;
    sdk_at(l, dst);
    src = sdk_readable(l, src, sd_codec_bytes(bits, n, block));
    const float *scales = src;
    const uint8_t *vals = (const uint8_t *)src + 4 * sd_codec_blocks(n, block);
    int acc = accumulate;
    void *args[] = {&dst, &dst_dtype, &scales, &vals, &bits, &n64, &block, &acc};
    l->launch(l, SDK_K_DECODE, sdk_blocks(n), args);
}

/* several devices: is piece one the launch on the device of the first's destination can take
 * (its destination there, its source read from there)? Else it is copied alone. */
static bool sdk_piece_joins(struct sdk_launcher *l, int d, const struct sd_gpu_piece *piece)
{
    if (l->route == NULL)
        return true;
    int e = l->route->device_of(l, piece->src);
    return l->route->device_of(l, piece->dst) == d && e >= 0 && (e == d || l->route->peer(l, d, e));
}

/* pieces[0..n) as few launches as the device can take, on the device of each batch's first
 * destination */
static void gather_run(struct sdk_launcher *l, const struct sd_gpu_piece *pieces, uint32_t n)
{
    while (n > 0) {
        struct sdk_pieces p = {.n = 0};
        uint64_t most = 0;
        for (; n > 0 && pieces->bytes == 0; pieces++, n--)
            ;
        if (n > 0)
            sdk_at(l, pieces->dst);
        int d = l->cur;
        for (; n > 0 && p.n < SDK_PIECES_MAX; pieces++, n--) {
            if (pieces->bytes == 0)
                continue;
            if (!sdk_piece_joins(l, d, pieces)) {
                l->route->copy(l, pieces->dst, pieces->src, pieces->bytes); /* may run elsewhere */
                continue;
            }
            p.dst[p.n] = (uint64_t)(uintptr_t)pieces->dst;
            p.src[p.n] = (uint64_t)(uintptr_t)pieces->src;
            p.bytes[p.n] = pieces->bytes;
            most = pieces->bytes > most ? pieces->bytes : most;
            p.n++;
        }
        if (p.n == 0)
            continue;
        if (l->route != NULL && l->cur != d)
            l->route->use(l, d);
        /* the grid of one copy of the largest piece, shared out (16 bytes a thread) */
        uint64_t per = sdk_blocks((most + 15) / 16), cap = SDK_MAX_BLOCKS / p.n; /* p.n <= 16 */
        p.blocks_per = per < cap ? per : cap;
        void *args[] = {&p};
        l->launch(l, SDK_K_GATHER, p.n * p.blocks_per, args);
    }
}

/* the device a piece is written on (its destination's; host memory: where the queue runs) */
static int piece_device(struct sdk_launcher *l, const struct sd_gpu_piece *piece, int from)
{
    int d = l->route->device_of(l, piece->dst);
    return d >= 0 ? d : from;
}

void sdk_op_gather(struct sd_gpu_queue *q, const struct sd_gpu_piece *pieces, uint32_t n)
{
    struct sdk_launcher *l = L(q);
    uint64_t devs = 0;
    int from = l->cur;
    for (uint32_t i = 0; l->route != NULL && i < n; i++)
        if (pieces[i].bytes > 0)
            devs |= 1ULL << piece_device(l, &pieces[i], from);
    if (__builtin_popcountll(devs) < 2) {
        gather_run(l, pieces, n);
        return;
    }
    /* Pieces written on several devices (the gather pool's copies): each device's run on its
     * own stream at once, after the queue's work so far, and what follows after all of them;
     * the device the queue was on last, so that the other branches start before its own work */
    uint64_t others = devs & ~(1ULL << from);
    bool mine = devs >> from & 1;
    while (others != 0 || mine) {
        int d = from;
        if (others != 0) {
            d = __builtin_ctzll(others);
            others &= others - 1;
        } else {
            mine = false;
        }
        l->route->branch(l, from, d);
        struct sd_gpu_piece chunk[32];
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (pieces[i].bytes == 0 || piece_device(l, &pieces[i], from) != d)
                continue;
            chunk[m++] = pieces[i];
            if (m == sizeof(chunk) / sizeof(chunk[0])) {
                gather_run(l, chunk, m);
                m = 0;
            }
        }
        gather_run(l, chunk, m);
    }
    l->route->merge(l, from, devs);
}

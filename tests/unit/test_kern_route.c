/* Where a queue over several GPUs runs each operation (gpu/kern_ops.c's routing, sd/gpu.h's
 * queue): the launchers against a fake launcher that logs every hook, with "device addresses"
 * whose high bits name the GPU, so that the order of the switches, branches and merges is
 * checked as written, not only the bytes (emu-gpu runs every launch at its call: a wrong order
 * cannot show there; on a GPU it would be a race). Each case against the sequence the rules
 * give: an operation on the GPU holding what it writes, after the work before it (use); a
 * source its GPU cannot reach copied over first (bring); copies for several GPUs branched from
 * the GPU the queue is on, the others first, and merged back there. */
#include "check.h"
#include "kern_ops.h"
#include "sd/model.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

struct sd_gpu_queue {
    struct sdk_launcher l; /* first: the launchers take the queue as their launcher */
    char log[2048];
    bool peers;
    double scratch[SDK_SUMSQ_MAX_BLOCKS + 1];
};

/* device d's memory at (d + 1) << 40; anything lower is host memory */
static void *at(int d, uintptr_t off)
{
    return (void *)((((uintptr_t)d + 1) << 40) + off);
}

static void say(struct sdk_launcher *l, const char *fmt, int a, int b)
{
    struct sd_gpu_queue *q = (struct sd_gpu_queue *)l;
    size_t n = strlen(q->log);
    snprintf(q->log + n, sizeof(q->log) - n, fmt, a, b);
}

static int device_of(struct sdk_launcher *l, const void *p)
{
    (void)l;
    uintptr_t d = (uintptr_t)p >> 40;
    return d >= 1 && d <= 8 ? (int)d - 1 : -1;
}

static void launch(struct sdk_launcher *l, enum sdk_kernel_id id, uint64_t blocks, void **args)
{
    (void)blocks;
    (void)args;
    say(l, "k%d@%d ", (int)id, l->cur);
}

static void use(struct sdk_launcher *l, int d)
{
    say(l, "use%d>%d ", l->cur, d);
    l->cur = d;
}

static bool peer(struct sdk_launcher *l, int d, int e)
{
    return d == e || ((struct sd_gpu_queue *)l)->peers;
}

static const void *bring(struct sdk_launcher *l, const void *src, size_t bytes)
{
    (void)bytes;
    say(l, "bring%d>%d ", device_of(l, src), l->cur);
    return at(l->cur, 0xbeef);
}

static void copy(struct sdk_launcher *l, void *dst, const void *src, size_t bytes)
{
    (void)bytes;
    sdk_at(l, dst);
    say(l, "copy%d<%d ", l->cur, device_of(l, src));
}

static void branch(struct sdk_launcher *l, int from, int d)
{
    say(l, "br%d>%d ", from, d);
    l->cur = d;
}

static void merge(struct sdk_launcher *l, int from, uint64_t devs)
{
    say(l, "merge>%d/%d ", from, (int)devs);
    l->cur = from;
}

static void fresh(struct sd_gpu_queue *q, int cur, bool peers)
{
    memset(q, 0, sizeof(*q));
    q->peers = peers;
    static const struct sdk_route route = {.device_of = device_of,
                                           .use = use,
                                           .peer = peer,
                                           .bring = bring,
                                           .copy = copy,
                                           .branch = branch,
                                           .merge = merge};
    q->l =
        (struct sdk_launcher){.launch = launch, .scratch = q->scratch, .cur = cur, .route = &route};
}

static void expect(struct sd_gpu_queue *q, const char *want, const char *what)
{
    TH_CHECK(strcmp(q->log, want) == 0, "%s: '%s', want '%s'", what, q->log, want);
}

int main(void)
{
    struct sd_gpu_queue q;
    const int R = SDK_K_REDUCE_ADD, G = SDK_K_GATHER;
    char want[512];

    /* a reduction into GPU 1 of GPU 0's gradient: on GPU 1; without peer access, brought over */
    fresh(&q, 0, true);
    sdk_op_reduce_add(&q, at(1, 0), at(0, 0), SD_DTYPE_FP32, 1024);
    snprintf(want, sizeof(want), "use0>1 k%d@1 ", R);
    expect(&q, want, "reduce_add across GPUs with peer access");
    fresh(&q, 0, false);
    sdk_op_reduce_add(&q, at(1, 0), at(0, 0), SD_DTYPE_FP32, 1024);
    snprintf(want, sizeof(want), "use0>1 bring0>1 k%d@1 ", R);
    expect(&q, want, "reduce_add across GPUs without peer access");
    fresh(&q, 1, false);
    sdk_op_reduce_add(&q, at(1, 0), at(1, 64), SD_DTYPE_FP32, 16);
    snprintf(want, sizeof(want), "k%d@1 ", R);
    expect(&q, want, "reduce_add on the GPU the queue is on: no switch, nothing brought");

    /* the sum of squares on its input's GPU (its scratch there) */
    fresh(&q, 0, true);
    sdk_sum_sq(&q.l, at(2, 0), 4096);
    snprintf(want, sizeof(want), "use0>2 k%d@2 k%d@2 ", SDK_K_SUMSQ_PART, SDK_K_SUMSQ_FINAL);
    expect(&q, want, "sum_sq on its input's GPU");

    /* the pool's copies: GPU 0's slot onto GPUs 3, 1, 2 from the queue on GPU 0: one branch a
     * GPU (ascending), then merged back on GPU 0; no use() (no chain) in between */
    fresh(&q, 0, true);
    struct sd_gpu_piece pool[] = {
        {at(3, 0), at(0, 0), 4096}, {at(1, 0), at(0, 0), 4096}, {at(2, 0), at(0, 0), 4096}};
    sdk_op_gather(&q, pool, 3);
    snprintf(want, sizeof(want), "br0>1 k%d@1 br0>2 k%d@2 br0>3 k%d@3 merge>0/14 ", G, G, G);
    expect(&q, want, "copies for three GPUs: branched and merged");

    /* the queue's own GPU among them: its pieces last, after the others started */
    fresh(&q, 1, true);
    struct sd_gpu_piece mixed[] = {
        {at(1, 0), at(0, 0), 64}, {at(0, 0), at(1, 0), 64}, {at(1, 64), at(0, 64), 64}};
    sdk_op_gather(&q, mixed, 3);
    snprintf(want, sizeof(want), "br1>0 k%d@0 br1>1 k%d@1 merge>1/3 ", G, G);
    expect(&q, want, "the queue's own GPU's pieces last (one launch for both)");

    /* one GPU's pieces: one launch there, no branch */
    fresh(&q, 0, true);
    struct sd_gpu_piece one[] = {{at(2, 0), at(2, 4096), 64}, {at(2, 64), at(0, 0), 64}};
    sdk_op_gather(&q, one, 2);
    snprintf(want, sizeof(want), "use0>2 k%d@2 ", G);
    expect(&q, want, "pieces for one GPU: a launch there");
    /* without peer access, the piece from GPU 0 is copied alone (the driver stages it) */
    fresh(&q, 0, false);
    sdk_op_gather(&q, one, 2);
    snprintf(want, sizeof(want), "use0>2 copy2<0 k%d@2 ", G);
    expect(&q, want, "a piece its GPU cannot read copied alone");

    /* AdamW on its shard's GPU; a cast into GPU 3 from GPU 1's fp32 */
    fresh(&q, 0, true);
    struct sd_adamw_args a = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 1};
    sdk_op_adamw(&q, &a, at(2, 0), at(2, 1 << 20), at(2, 2 << 20), at(2, 3 << 20), 1.0f,
                 at(2, 4 << 20), SD_DTYPE_FP32, 1000);
    sdk_op_from_f32(&q, at(3, 0), SD_DTYPE_BF16, at(1, 0), 1000);
    snprintf(want, sizeof(want), "use0>2 k%d@2 use2>3 k%d@3 ", SDK_K_ADAMW, SDK_K_FROM_F32);
    expect(&q, want, "adamw on its shard's GPU, a cast on its destination's");

    /* one GPU (no hooks): nothing routed, the launches where the queue is */
    fresh(&q, 0, true);
    q.l.route = NULL;
    sdk_op_gather(&q, pool, 3);
    sdk_op_reduce_add(&q, at(1, 0), at(0, 0), SD_DTYPE_FP32, 8);
    snprintf(want, sizeof(want), "k%d@0 k%d@0 ", G, R);
    expect(&q, want, "a backend with one GPU: no routing");
    return th_summary("test_kern_route");
}

/* A push round's arithmetic (daemon/ops/push_round.c) without a daemon: the module is linked alone
 * with the host backend, a job built by hand (plan, layout, staging slots of the local ranks),
 * and a fake of what it asks of the rest (quant.c's receive buffers, which only ,qg's decode
 * reads and this test does not). Checked against references computed here from the definitions:
 *  - the node partial (sd_round_partial): block q of it is the sum, in local rank order, of the
 *    local ranks' gradients over the g shard of the group's q-th rank (its range from the
 *    layout), or the plain sum where the blocks are the unit's elements in order; called block
 *    by block in a random order, fp32 and bf16 gradients, bit for bit;
 *  - this node's block of the reduce-scatter (sd_round_chunk): chunks arriving from the other
 *    nodes in a random order; a chunk is summed only once every node's arrived (until then its
 *    output is untouched), then in node order with this node's own partial in its place, bit
 *    for bit. */
#include "check.h"
#include "job_fixture.h"
#include "net.h"
#include "push_round.h"
#include "quant.h"
#include "session.h"
#include "sd/gpu.h"
#include "sd/model.h"
#include "sd/status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* the fake: quant.c's ,qg receive buffers (sd_round_decode only) */
uint8_t *sd_qg_recv(struct sd_job *job, uint32_t r, uint32_t o)
{
    (void)job;
    (void)r;
    (void)o;
    return NULL;
}

struct fixture {
    struct th_job tj;
    struct sd_job *job;
    struct sd_mem staging[8];
    struct sd_push_entry ent[8];
};

static float bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static float rand_unit(void)
{
    return (float)rand() / (float)RAND_MAX * 2.0f - 1.0f;
}

/* rank m's gradient element i as the kernels read it (fp32, or bf16 widened) */
static float grad_at(const struct fixture *fx, uint32_t m, uint64_t i, int dtype)
{
    if (dtype == SD_DTYPE_BF16)
        return bf16_to_f32(((const uint16_t *)fx->staging[m].ptr)[i]);
    return ((const float *)fx->staging[m].ptr)[i];
}

/* a job of one unit of numel elements in dtype on node `node` of nodes x k ranks under plan */
static bool setup(struct fixture *fx, const char *plan, uint32_t nodes, uint32_t k, uint32_t node,
                  uint64_t numel, int dtype)
{
    memset(fx, 0, sizeof(*fx));
    if (!th_job_build(&fx->tj, plan, nodes, k, node, &numel, 1, dtype))
        return false;
    struct sd_job *job = fx->job = &fx->tj.job;
    const struct sd_unit_layout *ul = &job->layout.units[0];
    job->mem.staging_slot_bytes = ul->numel * sd_dtype_size(dtype);
    job->mem.staging = fx->staging;
    for (uint32_t m = 0; m < k; m++) {
        fx->staging[m].ptr = malloc(job->mem.staging_slot_bytes);
        fx->staging[m].bytes = job->mem.staging_slot_bytes;
        for (uint64_t i = 0; i < ul->numel; i++) {
            float v = rand_unit() * (float)(1 + rand() % 1000);
            if (dtype == SD_DTYPE_BF16) {
                uint32_t u;
                memcpy(&u, &v, sizeof(u));
                ((uint16_t *)fx->staging[m].ptr)[i] = (uint16_t)(u >> 16);
            } else {
                ((float *)fx->staging[m].ptr)[i] = v;
            }
        }
        fx->ent[m] = (struct sd_push_entry){.s = &fx->tj.s[m], .slot = 0};
    }
    return true;
}

static void teardown(struct fixture *fx)
{
    for (uint32_t m = 0; m < fx->job->k; m++)
        free(fx->staging[m].ptr);
    th_job_free(&fx->tj);
}

static void shuffle(uint32_t *a, uint32_t n)
{
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)rand() % i, t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/* the node partial, block by block in a random order, against the definition */
static void check_partial(const char *plan, uint32_t nodes, uint32_t k, uint32_t node, int dtype)
{
    struct fixture fx;
    if (!setup(&fx, plan, nodes, k, node, 1000, dtype))
        return;
    struct sd_job *job = fx.job;
    const struct sd_unit_layout *ul = &job->layout.units[0];
    uint64_t n = ul->numel;
    uint32_t G = job->gnodes[SD_STATE_G], fg = job->plan.f[SD_STATE_G];
    struct sd_node_round rd = {.job = job};
    rd.buf = malloc(n * sizeof(float));
    float *want = malloc(n * sizeof(float));
    /* block q of the partial: the g shard of the group's q-th rank, or the unit in order */
    uint32_t first = (node - node % G) * k;
    bool in_order = G == 1 || job->plan.f[SD_STATE_W] == 1;
    uint64_t len = G > 1 ? n / fg : n;
    for (uint64_t q = 0; q * len < n; q++) {
        uint64_t b = q * len, e = b + len;
        if (!in_order)
            sd_layout_shard(ul, &job->plan, SD_STATE_G, first + (uint32_t)q, &b, &e);
        for (uint64_t i = 0; i < len; i++) {
            float acc = grad_at(&fx, 0, b + i, dtype);
            for (uint32_t m = 1; m < k; m++)
                acc += grad_at(&fx, m, b + i, dtype);
            want[q * len + i] = acc;
        }
    }
    /* as push.c calls it: the node partial's blocks (one per node of the g group) */
    uint32_t order[64];
    for (uint32_t i = 0; i < G; i++)
        order[i] = i;
    shuffle(order, G);
    for (uint32_t i = 0; i < G; i++)
        sd_round_partial(job, &rd, fx.ent, ul, order[i] * (n / G), (order[i] + 1) * (n / G));
    TH_CHECK(job->reg->dev->sync(job->mem.queue) == SD_OK, "the queue");
    uint64_t bad = 0, first_bad = 0;
    for (uint64_t i = 0; i < n; i++)
        if (memcmp(&rd.buf[i], &want[i], sizeof(float)) != 0 && bad++ == 0)
            first_bad = i;
    TH_CHECK(bad == 0,
             "%s on %ux%u, node %u, %s: %llu of %llu partial elements differ (first %llu: %g, "
             "want %g)",
             plan, nodes, k, node, dtype == SD_DTYPE_BF16 ? "bf16" : "fp32",
             (unsigned long long)bad, (unsigned long long)n, (unsigned long long)first_bad,
             (double)rd.buf[first_bad], (double)want[first_bad]);
    free(rd.buf);
    free(want);
    teardown(&fx);
}

/* this node's block of the reduce-scatter, its chunks arriving from the other nodes at random */
static void check_chunks(const char *plan, uint32_t nodes, uint32_t k, uint32_t node, size_t chunk)
{
    struct fixture fx;
    if (!setup(&fx, plan, nodes, k, node, 1000, SD_DTYPE_FP32))
        return;
    struct sd_job *job = fx.job;
    uint32_t G = job->gnodes[SD_STATE_G], me = node % G;
    size_t block = job->layout.units[0].numel / G, bytes = block * sizeof(float);
    uint32_t n_chunks = (uint32_t)((bytes + chunk - 1) / chunk);
    TH_CHECK(G > 1 && n_chunks <= SD_TAG_MAX_CHUNKS, "%s on %ux%u: a group across nodes", plan,
             nodes, k);
    struct sd_node_round rd = {.job = job, .unit = 0, .chunk = chunk};
    rd.part = malloc(G * bytes);
    rd.rs_recv = malloc((G - 1) * bytes);
    rd.rs_out = malloc(bytes);
    float *want = malloc(bytes);
    for (size_t i = 0; i < G * block; i++)
        rd.part[i] = rand_unit();
    for (size_t i = 0; i < (G - 1) * block; i++)
        rd.rs_recv[i] = rand_unit();
    memset(rd.rs_out, 0xff, bytes);      /* NaN: untouched until a chunk is complete */
    for (size_t i = 0; i < block; i++) { /* node order, this node's own partial in its place */
        float acc = 0.0f;
        for (uint32_t j = 0; j < G; j++) {
            float v =
                j == me ? rd.part[me * block + i] : rd.rs_recv[(j < me ? j : j - 1) * block + i];
            acc = j == 0 ? v : acc + v;
        }
        want[i] = acc;
    }
    /* every (peer, chunk) arrival once, shuffled */
    uint32_t n_ev = (G - 1) * n_chunks, *ev = malloc(n_ev * sizeof(*ev)), seen[SD_TAG_MAX_CHUNKS];
    for (uint32_t i = 0; i < n_ev; i++)
        ev[i] = i % n_chunks;
    shuffle(ev, n_ev);
    memset(seen, 0, sizeof(seen));
    struct sd_bulk b = {.arg = &rd};
    uint64_t early = 0;
    for (uint32_t i = 0; i < n_ev; i++) {
        uint32_t c = ev[i];
        size_t off = (size_t)c * chunk, len = off + chunk <= bytes ? chunk : bytes - off;
        sd_round_chunk(&b, 0, off, len);
        job->reg->dev->sync(job->mem.queue);
        seen[c]++;
        for (uint32_t d = 0; d < n_chunks; d++) {
            if (seen[d] == G - 1)
                continue;
            size_t lo = (size_t)d * chunk / sizeof(float);
            early += !isnan(rd.rs_out[lo]); /* summed before every node's part arrived */
        }
    }
    TH_CHECK(early == 0, "%s on %ux%u node %u: %llu chunks summed before all had arrived", plan,
             nodes, k, node, (unsigned long long)early);
    TH_CHECK(memcmp(rd.rs_out, want, bytes) == 0,
             "%s on %ux%u node %u (chunk %zu): this node's block differs from the node-order sum",
             plan, nodes, k, node, chunk);
    free(ev);
    free(want);
    free(rd.part);
    free(rd.rs_recv);
    free(rd.rs_out);
    teardown(&fx);
}

int main(void)
{
    srand(2718);
    static const struct {
        const char *plan;
        uint32_t nodes, k;
    } cases[] = {
        {"zero3", 2, 2}, {"zero3", 4, 2},          {"mics:4", 4, 2},        {"mics:2", 2, 2},
        {"ddp", 2, 2},   {"topo:1/4/4", 2, 2},     {"topo:2/4/8", 4, 2},    {"topo:1/8/8", 4, 2},
        {"zero3", 2, 4}, {"mics:4,no-hier", 2, 2}, {"zero3,no-2hop", 4, 1}, {"topo:2/2/4", 2, 2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (uint32_t node = 0; node < cases[i].nodes; node++) {
            check_partial(cases[i].plan, cases[i].nodes, cases[i].k, node, SD_DTYPE_FP32);
            check_partial(cases[i].plan, cases[i].nodes, cases[i].k, node, SD_DTYPE_BF16);
            struct sd_topo t = {.nodes = cases[i].nodes, .ranks_per_node = cases[i].k};
            struct sd_plan p;
            char err[128];
            if (sd_plan_parse(cases[i].plan, &t, &p, err, sizeof(err)) == SD_OK &&
                p.f[SD_STATE_G] > cases[i].k) {
                check_chunks(cases[i].plan, cases[i].nodes, cases[i].k, node, 256);
                check_chunks(cases[i].plan, cases[i].nodes, cases[i].k, node, 1000);
            }
        }
    return th_summary("test_push_round");
}

/* libFuzzer: model descriptions built from bytes (tensor names drawn from a small alphabet so
 * that duplicates happen, dims, dtypes, units, hyperparameters including non-finite ones), then
 * validated and laid out under a plan. A model that validates must lay out with every unit
 * split evenly into aligned shards of every state, tensors in order inside their unit, and the
 * arenas the sums of the shards. */
#include "sd/model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint32_t take(const uint8_t **d, size_t *n, unsigned bytes)
{
    uint32_t v = 0;
    for (unsigned i = 0; i<bytes && * n> 0; i++, (*d)++, (*n)--)
        v = v << 8 | **d;
    return v;
}

static float take_float(const uint8_t **d, size_t *n)
{
    uint32_t bits = take(d, n, 4);
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8)
        return 0;
    uint32_t nt = 1 + take(&data, &size, 2) % 512;
    struct sd_model m = {.n_tensors = nt};
    m.tensors = calloc(nt, sizeof(*m.tensors));
    if (m.tensors == NULL)
        return 0;
    static const char *const plans[] = {
        "ddp",        "zero1",      "zero2",       "zero3",          "mics:2",           "topo",
        "topo:1/2/4", "topo:2/2/8", "zero3,sec=2", "mics:4,no-hier", "topo:2/4/8,sec=1", "zero3,"};
    snprintf(m.plan, sizeof(m.plan), "%s", plans[take(&data, &size, 1) % 12]);
    uint32_t unit = 0;
    for (uint32_t i = 0; i < nt; i++) {
        struct sd_tensor_desc *t = &m.tensors[i];
        uint32_t b = take(&data, &size, 1);
        snprintf(t->name, sizeof(t->name), "t%u.%c", take(&data, &size, 1) % 64, 'a' + b % 3);
        t->ndim = 1 + b % 3;
        for (uint32_t d = 0; d < t->ndim; d++)
            t->dims[d] = 1 + take(&data, &size, 1) % 70;
        t->dtype = (int)(take(&data, &size, 1) % 4);
        unit += take(&data, &size, 1) % 3 == 0;
        t->unit = unit;
    }
    m.optim = (struct sd_optim){.kind = (int)(take(&data, &size, 1) % 3),
                                .lr = take_float(&data, &size),
                                .beta1 = 0.9f,
                                .beta2 = 0.999f,
                                .eps = 1e-8f,
                                .weight_decay = take_float(&data, &size),
                                .momentum = 0.5f,
                                .max_grad_norm = take_float(&data, &size)};
    char err[512];
    if (sd_model_validate(&m, err, sizeof(err)) == 0) {
        struct sd_topo topo = {.nodes = 2, .ranks_per_node = 4, .package_size = 2};
        struct sd_plan plan;
        struct sd_layout l;
        if (sd_plan_parse(m.plan, &topo, &plan, err, sizeof(err)) == 0 &&
            sd_layout_build(&m, &plan, &l, err, sizeof(err)) == 0) {
            uint64_t arena[SD_STATE_COUNT] = {0};
            for (uint32_t u = 0; u < l.n_units; u++) {
                const struct sd_unit_layout *ul = &l.units[u];
                for (int s = 0; s < SD_STATE_COUNT; s++) {
                    if (ul->numel % plan.f[s] != 0 || (ul->numel / plan.f[s]) % SD_ALIGN_ELEMS)
                        abort();
                    if (ul->arena_off[s] != arena[s])
                        abort();
                    arena[s] += ul->numel / plan.f[s];
                }
                if (ul->used > ul->numel)
                    abort();
                for (uint32_t t = ul->first_tensor + 1; t < ul->first_tensor + ul->n_tensors; t++)
                    if (l.tensors[t].offset < l.tensors[t - 1].offset + l.tensors[t - 1].numel)
                        abort();
            }
            for (int s = 0; s < SD_STATE_COUNT; s++)
                if (arena[s] != l.arena_numel[s])
                    abort();
            sd_layout_free(&l);
        }
    }
    free(m.tensors);
    return 0;
}

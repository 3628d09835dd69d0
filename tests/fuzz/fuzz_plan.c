/* libFuzzer: plan strings against topologies. A plan that parses must keep its promises: each
 * factor divides the next and the world, aligns with a topology level, a secondary partition
 * divides the ranks per node, and every rank's os shard lies inside its g shard inside its w
 * shard. A refusal must say why. */
#include "sd/model.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3)
        return 0;
    static const uint32_t ks[] = {1, 2, 3, 4, 6, 8};
    struct sd_topo t = {.nodes = 1 + data[0] % 8, .ranks_per_node = ks[data[1] % 6]};
    t.package_size = data[2] % 3 == 0 ? 1 : data[2] % 3 == 1 ? 2 : t.ranks_per_node;
    if (t.ranks_per_node % t.package_size)
        t.package_size = 1;
    char spec[64];
    size_t n = size - 3 < sizeof(spec) - 1 ? size - 3 : sizeof(spec) - 1;
    memcpy(spec, data + 3, n);
    spec[n] = '\0';
    struct sd_plan p;
    char err[256] = "";
    if (sd_plan_parse(spec, &t, &p, err, sizeof(err)) != 0) {
        if (err[0] == '\0')
            abort();
        return 0;
    }
    uint32_t world = sd_topo_world(&t), k = t.ranks_per_node, P = sd_topo_package(&t);
    uint32_t next[SD_STATE_COUNT] = {p.f[1], p.f[2], world};
    for (int s = 0; s < SD_STATE_COUNT; s++) {
        uint32_t f = p.f[s];
        if (f == 0 || next[s] % f != 0)
            abort();
        if (!(P % f == 0 || (f % P == 0 && k % f == 0) || f % k == 0))
            abort();
    }
    if (p.sec != 0 && k % p.sec != 0)
        abort();
    uint64_t numel = (uint64_t)p.f[SD_STATE_OS] * 4;
    for (uint32_t r = 0; r < world; r++) {
        uint64_t wl = numel / p.f[0], gl = numel / p.f[1], ol = numel / p.f[2];
        uint64_t w0 = sd_plan_shard(&p, SD_STATE_W, r) * wl;
        uint64_t g0 = sd_plan_shard(&p, SD_STATE_G, r) * gl;
        uint64_t o0 = sd_plan_shard(&p, SD_STATE_OS, r) * ol;
        if (!(w0 <= g0 && g0 + gl <= w0 + wl && g0 <= o0 && o0 + ol <= g0 + gl))
            abort();
    }
    return 0;
}

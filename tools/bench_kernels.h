/* shard-bench kernels (bench_kernels.c) */
#ifndef SD_BENCH_KERNELS_H
#define SD_BENCH_KERNELS_H

#include <stdbool.h>
#include <stdint.h>

/* 0, 1 on failure, 77 when the backend is not built or finds no device */
int sd_bench_kernels(const char *backend, uint64_t size, uint64_t params, int iters, bool json);

#endif

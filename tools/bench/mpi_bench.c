/* The Open MPI baseline of tools/bench/compare.sh: MPI_Allgather, MPI_Reduce_scatter_block and
 * MPI_Allreduce with the sizes and conventions of shard-bench (size: the gathered output for
 * allgather, the input per rank otherwise), Open MPI's default transports on this machine.
 * Build: mpicc -O2 -o mpi_bench mpi_bench.c. Prints one JSON object per measurement. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const char *op = argc > 1 ? argv[1] : "allreduce";
    long min = argc > 2 ? atol(argv[2]) : 4096, max = argc > 3 ? atol(argv[3]) : 64L << 20;
    int iters0 = argc > 4 ? atoi(argv[4]) : 20;
    float *in = malloc((size_t)max), *out = malloc((size_t)max);
    for (long i = 0; i < max / 4; i++)
        in[i] = (float)(rank + 1);
    for (long size = min; size <= max; size *= 2) {
        int count = (int)(size / 4);
        long iters = iters0;
        if ((long)size * iters > (1L << 30))
            iters = (1L << 30) / size < 3 ? 3 : (1L << 30) / size;
        for (long it = -2; it < iters; it++) {
            if (it == 0)
                MPI_Barrier(MPI_COMM_WORLD);
            static double t0;
            if (it == 0)
                t0 = MPI_Wtime();
            if (strcmp(op, "allgather") == 0)
                MPI_Allgather(in, count / n, MPI_FLOAT, out, count / n, MPI_FLOAT, MPI_COMM_WORLD);
            else if (strcmp(op, "reducescatter") == 0)
                MPI_Reduce_scatter_block(in, out, count / n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else
                MPI_Allreduce(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            if (it == iters - 1) {
                double t = (MPI_Wtime() - t0) / iters, worst;
                MPI_Reduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
                if (rank == 0) {
                    double algbw = size / worst / 1e9;
                    double f =
                        strcmp(op, "allreduce") == 0 ? 2.0 * (n - 1) / n : (double)(n - 1) / n;
                    printf("{\"name\": \"%s\", \"impl\": \"openmpi\", \"size_bytes\": %ld, "
                           "\"ranks\": %d, \"time_s\": %.9g, \"algbw_GBps\": %.4f, "
                           "\"busbw_GBps\": %.4f}\n",
                           op, size, n, worst, algbw, algbw * f);
                    fflush(stdout);
                }
            }
        }
    }
    free(in);
    free(out);
    MPI_Finalize();
    return 0;
}

/* Open MPI's own MPI_Allreduce (float, sum), timed as `fabric allreduce` times it: the
 * slowest rank's mean over --iters after --warmup, per size; prints one line per size:
 * "bytes count time_us algbw busbw wrong" (GB = 10^9, busbw = algbw x 2(n-1)/n).
 * Built by scripts/bench-collectives with mpicc; run with mpirun --mca btl tcp,self. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    int iters = 20, warmup = 5;
    const char *sizes = "8,1024,65536,1048576,16777216";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--warmup")) warmup = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--sizes")) sizes = argv[i + 1];
    }
    char *list = strdup(sizes);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        long bytes = atol(tok) / 4 * 4;
        long count = bytes / 4;
        float *in = malloc(bytes + 4), *out = malloc(bytes + 4);
        for (long i = 0; i < count; i++) in[i] = (float)((rank + i) % 7 + 1);
        for (int w = 0; w < warmup; w++)
            MPI_Allreduce(in, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int it = 0; it < iters; it++)
            MPI_Allreduce(in, out, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double mine = (MPI_Wtime() - t0) / iters, slowest;
        long wrong = 0, total_wrong;
        for (long i = 0; i < count; i++) {
            float want = 0;
            for (int r = 0; r < n; r++) want += (float)((r + i) % 7 + 1);
            if (out[i] != want) wrong++;
        }
        MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        MPI_Reduce(&wrong, &total_wrong, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = bytes / slowest / 1e9;
            printf("%ld %ld %.2f %.4f %.4f %ld\n", bytes, count, slowest * 1e6, algbw,
                   algbw * 2.0 * (n - 1) / n, total_wrong);
            fflush(stdout);
        }
        free(in);
        free(out);
    }
    free(list);
    MPI_Finalize();
    return 0;
}

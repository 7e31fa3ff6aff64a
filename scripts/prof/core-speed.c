/*
 * core-speed: how fast the CPU it runs on is, moment by moment: the number of fixed
 * ALU work units done in each 100 ms, for SECONDS (default 10), one figure per 100 ms.
 * Run one per CPU at once to see whether the machine's cores change speed under a
 * benchmark, and whether together or apart:
 *
 *   gcc -O2 -o /tmp/core-speed scripts/prof/core-speed.c
 *   taskset -c 0 /tmp/core-speed 20 > /tmp/cpu0 & taskset -c 1 /tmp/core-speed 20 > /tmp/cpu1
 *
 * Nothing else should run meanwhile. On the project's machines (a 2-vCPU virtual machine)
 * each core's figure moved between about 1 340 and 2 100 within seconds, each core on its
 * own, in spells of 0.5-2 s, and an hour later held at 1 870-2 240 but for brief dips: the
 * fast and slow states that both the host's ping-pongs and the soft-RDMA guest's runs
 * fall into (docs/benchmarks-record.md, fiftieth session).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 10;
    if (!(seconds > 0)) {
        fprintf(stderr, "usage: core-speed [SECONDS > 0]\n");
        return 2;
    }
    volatile uint64_t x = 0;
    double end = now_s() + seconds;
    while (now_s() < end) {
        double start = now_s();
        long units = 0;
        while (now_s() - start < 0.1) {
            for (int i = 0; i < 1000; i++)
                x += (uint64_t)i * i;
            units++;
        }
        printf("%.1f ", units / 100.0);
        fflush(stdout);
    }
    printf("\n");
    return 0;
}

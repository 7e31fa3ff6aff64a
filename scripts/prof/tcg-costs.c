/*
 * tcg-costs: what a few kinds of instruction cost on the CPU this runs on, in ns each;
 * meant for the soft-RDMA guest, whose vCPUs are QEMU's TCG, where the prices are not a
 * real CPU's and decide what a hot path should avoid:
 *
 *   gcc -O2 -o /tmp/tcg-costs scripts/prof/tcg-costs.c
 *   taskset -c 0 /tmp/tcg-costs; taskset -c 1 /tmp/tcg-costs     (in the guest)
 *
 * Rows: a plain add to memory; a locked add (an atomic read-modify-write); an
 * uncontended lock and unlock (compare-and-swap, then a release store); a call and
 * return; then one load per page over K distinct pages, round after round, for K from
 * 16 to 16 384. TCG translates guest addresses through a software TLB of its own, one
 * per vCPU and privilege level, direct-mapped (a page's slot is its page number modulo
 * the table's size) and resized only when the guest flushes it (an address-space switch
 * without PCID, for instance): once the pages a loop touches outnumber the table, or
 * collide in it, every access misses, and the last rows show what a miss costs.
 * Measured in the guest of docs/benchmarks-record.md's fiftieth session: about 2 ns for a
 * plain add, 7.5 for a locked add, 9.5 for a lock and unlock, 8 for a call and return,
 * 6-10 per access over up to 256 pages and 120-200 over 1 024 or more (on the host: 2, 2.3-3.3,
 * 2.2-3.8, 1.4-2.2, 2 and 3-4).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static volatile uint64_t word;
static volatile uint8_t lock;

int main(void)
{
    const long n = 20000000;
    const long page = 4096;
    const int ks[] = {16, 64, 256, 1024, 4096, 16384};
    const int nk = sizeof ks / sizeof ks[0];
    const long max_pages = ks[nk - 1];
    char *buf = aligned_alloc(page, max_pages * page);
    if (!buf) {
        perror("aligned_alloc");
        return 1;
    }
    for (long i = 0; i < max_pages; i++)
        buf[i * page] = 1;

    double t0 = now_ns();
    for (long i = 0; i < n; i++)
        __asm__ volatile("addq $1, %0" : "+m"(word));
    double t1 = now_ns();
    for (long i = 0; i < n; i++)
        __asm__ volatile("lock addq $1, %0" : "+m"(word));
    double t2 = now_ns();
    for (long i = 0; i < n; i++) {
        uint8_t expected = 0;
        __atomic_compare_exchange_n(&lock, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
        __atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
    }
    double t3 = now_ns();
    for (long i = 0; i < n; i++)
        __asm__ volatile("call 1f\n\tjmp 2f\n1:\tret\n2:" ::: "memory");
    double t4 = now_ns();
    printf("ns each: add %.2f, locked add %.2f, lock+unlock %.2f, call+ret %.2f\n",
           (t1 - t0) / n, (t2 - t1) / n, (t3 - t2) / n, (t4 - t3) / n);

    printf("ns per load, by distinct pages touched:");
    volatile long sink = 0;
    for (int j = 0; j < nk; j++) {
        long k = ks[j];
        long loads = 4000000 / k * k;
        long acc = 0;
        double a = now_ns();
        for (long i = 0; i < loads; i++)
            acc += buf[(i % k) * page + ((i * 64) & (page - 1))];
        double b = now_ns();
        sink += acc;
        printf(" %ld:%.1f", k, (b - a) / loads);
    }
    printf("\n");
    free(buf);
    return 0;
}

/*
 * thread-cpus: where the threads of some processes, and siw's transmit threads, run.
 *
 *   thread-cpus PERIOD_US PID [PID...]
 *
 * Every PERIOD_US microseconds it reads /proc/PID/task/TID/stat of every thread of each
 * PID (the first PID tagged "srv", the others "cli") and /proc/TID/stat of every kernel
 * thread named siw_tx* (tagged "k"), and counts the samples by tag, thread name, the CPU
 * the thread last ran on and its state (R running or runnable, S sleeping, D
 * uninterruptible). On SIGTERM or SIGINT it prints one line per count, then the number
 * of samples, and exits.
 *
 * Made for the soft-RDMA guest, where `ps` takes longer than a sample should: the fifty-
 * third session's record (docs/benchmarks-record.md) found with it that an iwarp read
 * stream runs at the rate of the CPU its spinning server shares with siw's transmit
 * thread. Example (the server's pid, then the client's):
 *
 *   gcc -O2 -o /tmp/thread-cpus scripts/prof/thread-cpus.c
 *   /tmp/thread-cpus 10000 "$server_pid" "$client_pid" > counts.txt & s=$!
 *   ...; kill "$s"; wait "$s"; sort -k4 counts.txt
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_KEYS 1024
#define MAX_KTHREADS 64

static char keys[MAX_KEYS][96];
static long counts[MAX_KEYS];
static int nkeys;
static volatile sig_atomic_t stop;

static void count(const char *key) {
    for (int i = 0; i < nkeys; i++) {
        if (strcmp(keys[i], key) == 0) {
            counts[i]++;
            return;
        }
    }
    if (nkeys < MAX_KEYS) {
        snprintf(keys[nkeys], sizeof keys[nkeys], "%s", key);
        counts[nkeys++] = 1;
    }
}

/* One thread's stat line: its name (between the first '(' and the last ')'), its state
 * (the field after the name) and the CPU it last ran on (field 39). */
static void sample(const char *path, const char *tag) {
    char buf[2048];
    FILE *f = fopen(path, "r");
    if (!f) {
        return; /* the thread ended between the listing and the read */
    }
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *open = strchr(buf, '('), *close = strrchr(buf, ')');
    if (!open || !close || close[1] != ' ' || !close[2]) {
        return;
    }
    *close = 0;
    char state = close[2];
    int field = 3;
    const char *p = close + 2;
    while (*p && field < 39) {
        if (*p++ == ' ') {
            field++;
        }
    }
    if (field != 39) {
        return;
    }
    char key[96];
    snprintf(key, sizeof key, "%s %.32s cpu%d %c", tag, open + 1, atoi(p), state);
    count(key);
}

static int siw_tx_threads(int *tids) {
    int n = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    if (!d) {
        return 0;
    }
    while ((e = readdir(d)) && n < MAX_KTHREADS) {
        char path[300], comm[64] = "";
        snprintf(path, sizeof path, "/proc/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) {
            continue;
        }
        if (fgets(comm, sizeof comm, f) && strncmp(comm, "siw_tx", 6) == 0) {
            tids[n++] = atoi(e->d_name);
        }
        fclose(f);
    }
    closedir(d);
    return n;
}

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

static int positive(const char *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    return errno == 0 && *s && !*end && v > 0 && v < 100000000 ? (int)v : 0;
}

int main(int argc, char **argv) {
    int period = argc >= 3 ? positive(argv[1]) : 0;
    for (int i = 2; period && i < argc; i++) {
        if (!positive(argv[i])) {
            period = 0;
        }
    }
    if (!period) {
        fprintf(stderr, "usage: thread-cpus PERIOD_US PID [PID...]\n");
        return 2;
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    int kthreads[MAX_KTHREADS];
    int nk = siw_tx_threads(kthreads);
    long samples = 0;
    while (!stop) {
        for (int i = 2; i < argc; i++) {
            char dir[64];
            snprintf(dir, sizeof dir, "/proc/%s/task", argv[i]);
            DIR *t = opendir(dir);
            struct dirent *e;
            if (!t) {
                continue;
            }
            while ((e = readdir(t))) {
                if (e->d_name[0] == '.') {
                    continue;
                }
                char path[400];
                snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
                sample(path, i == 2 ? "srv" : "cli");
            }
            closedir(t);
        }
        for (int i = 0; i < nk; i++) {
            char path[64];
            snprintf(path, sizeof path, "/proc/%d/stat", kthreads[i]);
            sample(path, "k");
        }
        samples++;
        usleep((useconds_t)period);
    }
    for (int i = 0; i < nkeys; i++) {
        printf("%-48s %ld\n", keys[i], counts[i]);
    }
    printf("samples %ld\n", samples);
    return 0;
}

/*
 * rxe-stamps: where a verbs ping-pong's time goes between the poll that finds a message
 * and the next doorbell, for any program on rxe (ours and perftest alike), without
 * changing it. LD_PRELOAD it; it stamps (TSC) librxe's spin locks (a completion queue's
 * poll, a receive queue's post, a send queue's post) and the doorbell (rxe's post_send
 * rings it with a 32-byte write() to the uverbs command fd).
 *
 *   gcc -O2 -shared -fPIC -o /tmp/rxe-stamps.so scripts/prof/rxe-stamps.c -ldl
 *   RXE_STAMPS_OUT=/tmp/out/server RXE_STAMPS_TAG=pt LD_PRELOAD=/tmp/rxe-stamps.so ib_send_lat ...
 *   python3 scripts/prof/rxe-stamps.py LOG...
 *
 * The lock taken most often (a spinning poll's completion queue) is "hot": only its
 * latest lock and unlock times are kept; every other lock and unlock is logged with them,
 * and every doorbell, at its call and at its return. The log is written at exit to $RXE_STAMPS_OUT-<tag>-<pid>.txt
 * (default /tmp/rxe-stamps), one event per line: kind (L, U, W, R), lock address, TSC, the
 * hot lock's latest lock and unlock TSC. Each stamp adds about 20-40 ns in the soft-RDMA
 * guest, the same for every program measured. The log is not guarded: meant for a
 * ping-pong whose polls and posts come from one thread (events of another thread taking
 * librxe's locks at the same moment may be lost or mixed in).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <x86intrin.h>

#define MAX_EVENTS 400000

struct event {
	char kind;
	const void *lock;
	unsigned long long tsc, hot_lock, hot_unlock;
};

static int (*real_lock)(pthread_spinlock_t *);
static int (*real_unlock)(pthread_spinlock_t *);
static ssize_t (*real_write)(int, const void *, size_t);
static struct event events[MAX_EVENTS];
static long n_events;
/* The hot lock, by majority vote (Boyer-Moore), and its latest lock and unlock. */
static const void *hot;
static long hot_votes;
static unsigned long long hot_lock, hot_unlock;

static void note(char kind, const void *lock, unsigned long long tsc)
{
	if (n_events < MAX_EVENTS)
		events[n_events++] = (struct event){ kind, lock, tsc, hot_lock, hot_unlock };
}

int pthread_spin_lock(pthread_spinlock_t *l)
{
	if (!real_lock)
		real_lock = dlsym(RTLD_NEXT, "pthread_spin_lock");
	unsigned long long t = __rdtsc();
	int r = real_lock(l);
	const void *p = (const void *)l;
	if (p == hot) {
		hot_votes++;
		hot_lock = t;
	} else if (hot_votes == 0) {
		hot = p;
		hot_votes = 1;
		hot_lock = t;
	} else {
		hot_votes--;
		note('L', p, t);
	}
	return r;
}

int pthread_spin_unlock(pthread_spinlock_t *l)
{
	if (!real_unlock)
		real_unlock = dlsym(RTLD_NEXT, "pthread_spin_unlock");
	unsigned long long t = __rdtsc();
	const void *p = (const void *)l;
	if (p == hot)
		hot_unlock = t;
	else
		note('U', p, t);
	return real_unlock(l);
}

ssize_t write(int fd, const void *buf, size_t len)
{
	if (!real_write)
		real_write = dlsym(RTLD_NEXT, "write");
	unsigned long long t = __rdtsc();
	ssize_t r = real_write(fd, buf, len);
	if (len == 32) {
		note('W', NULL, t);
		/* The doorbell's return: what the kernel did in the call (rxe runs the request,
		 * and on loopback the peer's side and often the reply, inside it). */
		note('R', NULL, __rdtsc());
	}
	return r;
}

__attribute__((destructor)) static void dump(void)
{
	const char *out = getenv("RXE_STAMPS_OUT");
	const char *tag = getenv("RXE_STAMPS_TAG");
	char name[512];
	snprintf(name, sizeof name, "%s-%s-%d.txt", out ? out : "/tmp/rxe-stamps", tag ? tag : "x",
		 (int)getpid());
	FILE *f = fopen(name, "w");
	if (!f)
		return;
	for (long i = 0; i < n_events; i++)
		fprintf(f, "%c %p %llu %llu %llu\n", events[i].kind, events[i].lock, events[i].tsc,
			events[i].hot_lock, events[i].hot_unlock);
	fclose(f);
}

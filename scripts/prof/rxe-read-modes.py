#!/usr/bin/env python3
"""The two modes of a soft-RoCE (rxe) read ping-pong, from an ftrace log: for any program
(ours and perftest alike), without changing it.

On rxe a user queue pair's `ibv_post_send` ends in a `write()` to the uverbs file (the
doorbell), and the kernel runs the requester in that system call. On loopback the Read
Request reaches the responder there too, and rxe hands it over as a tasklet
(`rxe_resp_queue_pkt`, `must_sched` for reads). Raised in process context, the tasklet
wakes the CPU's `ksoftirqd`, and then runs in the caller's context when it enables bottom
halves again, before the system call returns. Whether that wake-up preempts the requester
decides the iteration's mode:

- **slow**: the wake-up sets need-resched; on the doorbell's return the requester is switched
  out, `ksoftirqd` runs, finds nothing, sleeps, and the requester is switched back in: two
  context switches per read;
- **fast**: the wake-up does not preempt (the scheduler's wake-up check finds `ksoftirqd`
  not far enough behind in virtual run time); `ksoftirqd` stays runnable, so the next
  doorbells' tasklets wake nothing, and the reads run without a switch until the tick lets
  `ksoftirqd` run: a streak of fast iterations.

Capture, in the soft-RDMA guest (stop tracing before copying the log):

    T=/sys/kernel/tracing
    echo 'comm ~ "ksoftirqd*"' > $T/events/sched/sched_wakeup/filter
    for e in sched/sched_wakeup sched/sched_switch syscalls/sys_enter_write \\
             syscalls/sys_exit_write; do echo 1 > $T/events/$e/enable; done
    echo > $T/trace; <run the ping-pong>; echo 0 > $T/tracing_on; cp $T/trace run.trace

    rxe-read-modes.py [--skip N] TRACE...

The requester is the process with the most `write`s (its doorbells). Per log: the share of
iterations in each mode and their median length (doorbell to doorbell, usec), and the fast
streaks: how many began (a `ksoftirqd` wake-up without need-resched), their length in ms
and in reads. The first --skip iterations (warm-up, default 200) and the last 10 are left
out. Stack-trace lines (a `stacktrace` trigger) are ignored.
"""
import argparse
import collections
import re
import statistics

LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+(\S+)\s+(\d+\.\d+): (.*)$")


def events(path):
    """(ts, comm, pid, cpu, flags, kind, text) for each event line of an ftrace log."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            comm, pid, cpu, flags, ts, msg = m.groups()
            if msg.startswith("sys_write("):
                kind = "door"
            elif msg.startswith("sched_wakeup:") and "comm=ksoftirqd" in msg:
                kind = "wake"
            elif msg.startswith("sched_switch:"):
                kind = "switch"
            else:
                continue
            out.append((float(ts), comm, int(pid), int(cpu), flags, kind, msg))
    return out


def report(path, skip):
    ev = events(path)
    writes = collections.Counter(e[2] for e in ev if e[5] == "door")
    if not writes:
        print(f"{path}: no write() calls traced")
        return
    req = writes.most_common(1)[0][0]
    doors = [i for i, e in enumerate(ev) if e[5] == "door" and e[2] == req]
    modes = {"slow": [], "fast": []}
    for a, b in zip(doors[skip:-10], doors[skip + 1:-9]):
        switched = any(e[5] == "switch" and "next_comm=ksoftirqd" in e[6] for e in ev[a:b])
        modes["slow" if switched else "fast"].append((ev[b][0] - ev[a][0]) * 1e6)
    n = sum(len(v) for v in modes.values())
    print(f"== {path}: requester pid {req}, {n} iterations")
    for k, v in modes.items():
        if v:
            print(f"  {k}: {len(v)} ({100 * len(v) / n:.0f} %), median {statistics.median(v):.1f} usec")
    # Fast streaks: from a wake-up that did not set need-resched (flags' second
    # character 'N') to ksoftirqd's next switch-in on that CPU.
    first, last = ev[doors[skip]][0], ev[doors[-10]][0]
    streaks = []
    i = 0
    while i < len(ev):
        e = ev[i]
        if e[5] == "wake" and first <= e[0] <= last and e[4][1:2] != "N":
            j, reads = i + 1, 0
            while j < len(ev) and not (ev[j][5] == "switch" and ev[j][3] == e[3]
                                       and "next_comm=ksoftirqd" in ev[j][6]):
                reads += ev[j][5] == "door" and ev[j][2] == req
                j += 1
            end = ev[j][0] if j < len(ev) else e[0]
            streaks.append(((end - e[0]) * 1e3, reads))
            i = j
        i += 1
    wakes = sum(1 for e in ev if e[5] == "wake" and first <= e[0] <= last)
    print(f"  ksoftirqd wake-ups {wakes}, of them not preempting (a fast streak begins) {len(streaks)}")
    if streaks:
        ms = ", ".join(f"{t:.1f} ms/{r}" for t, r in streaks)
        print(f"  streaks (length / reads): {ms}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", type=int, default=200)
    p.add_argument("trace", nargs="+")
    a = p.parse_args()
    for t in a.trace:
        report(t, a.skip)


if __name__ == "__main__":
    main()

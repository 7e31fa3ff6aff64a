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
             syscalls/sys_exit_write irq/softirq_raise; do echo 1 > $T/events/$e/enable; done
    echo > $T/trace; <run the ping-pong>; echo 0 > $T/tracing_on; cp $T/trace run.trace

    rxe-read-modes.py [--skip N] TRACE...

The requester is the process with the most `write`s to one descriptor (its doorbells).
Per log: the share of iterations in each mode and their median length (doorbell to
doorbell, usec), and the fast streaks: how many began (a `ksoftirqd` wake-up without
need-resched), their length in ms and in reads. The first --skip iterations (warm-up,
default 200) and the last 10 are left out.

With `irq/softirq_raise` enabled too, each CPU's iterations without a switch are split in
three: the doorbell's entry to the tasklet's raise (the requester's kernel work), the
raise to the system call's return (the responder's tasklet and the completion), and the
return to the next doorbell (user space). On QEMU's TCG all three move together, by
about 1.8x, between runs and between vCPUs of one run, for any program (docs/benchmarks-record.md,
fiftieth session).
"""
import argparse
import statistics

from ftrace import doorbell, events, is_doorbell


def is_ksoftirqd_in(e, cpu=None):
    """Whether `e` switches `ksoftirqd` in (on `cpu`, if given)."""
    return (e.text.startswith("sched_switch:") and "next_comm=ksoftirqd" in e.text
            and (cpu is None or e.cpu == cpu))


def doorbells(path, skip):
    """The log's events, the requester's (pid, fd) and the indices of its measured
    doorbells (the first `skip` and the last 9 left out); None if it has no doorbell."""
    evs = list(events(path))
    found = doorbell(evs)
    if found is None:
        return None
    req, fd = found
    doors = [i for i, e in enumerate(evs) if is_doorbell(e, req, fd)]
    return evs, found, doors[skip:-9]


def analyse(path, skip):
    """The requester's (pid, fd), its iterations' lengths in usec by mode ("slow": ksoftirqd
    switched in during the iteration, "fast": not), the ksoftirqd wake-ups in the measured
    span, and the fast streaks as (ms, reads); None if the log has no doorbell."""
    measured = doorbells(path, skip)
    if measured is None:
        return None
    evs, found, doors = measured
    req, fd = found
    modes = {"slow": [], "fast": []}
    for a, b in zip(doors, doors[1:]):
        slow = any(is_ksoftirqd_in(e) for e in evs[a:b])
        modes["slow" if slow else "fast"].append(evs[b].us - evs[a].us)
    if not doors:
        return found, modes, 0, []
    first, last = evs[doors[0]].us, evs[doors[-1]].us
    wakes = [i for i, e in enumerate(evs) if first <= e.us <= last
             and e.text.startswith("sched_wakeup:") and "comm=ksoftirqd" in e.text]
    # A fast streak: from a wake-up that did not set need-resched (the flags' second
    # character, 'N' when set) to ksoftirqd's next switch-in on that CPU.
    streaks, after = [], -1
    for i in wakes:
        if i <= after or evs[i].flags[1:2] == "N":
            continue
        j, reads = i + 1, 0
        while j < len(evs) and not is_ksoftirqd_in(evs[j], evs[i].cpu):
            reads += is_doorbell(evs[j], req, fd)
            j += 1
        end = evs[j].us if j < len(evs) else evs[i].us
        streaks.append(((end - evs[i].us) / 1e3, reads))
        after = j
    return found, modes, len(wakes), streaks


def stages(path, skip):
    """The iterations without a `ksoftirqd` switch, split at the tasklet's raise and the
    doorbell's return, by the CPU they ran on: {cpu: [(doorbell to raise, raise to the
    system call's exit, exit to the next doorbell), ...]} in usec. An iteration that
    changed CPU, or has other than one raise and one exit of the requester, is left out.
    Needs `irq/softirq_raise` in the capture; None if the log has no doorbell."""
    measured = doorbells(path, skip)
    if measured is None:
        return None
    evs, (req, _), doors = measured
    by_cpu = {}
    for a, b in zip(doors, doors[1:]):
        if evs[a].cpu != evs[b].cpu or any(is_ksoftirqd_in(e) for e in evs[a:b]):
            continue
        mine = [e for e in evs[a + 1:b] if e.pid == req]
        raised = [e for e in mine if e.text.startswith("softirq_raise:")]
        exits = [e for e in mine if e.text.startswith("sys_write ->")]
        if len(raised) != 1 or len(exits) != 1:
            continue
        r, x = raised[0].us, exits[0].us
        by_cpu.setdefault(evs[a].cpu, []).append((r - evs[a].us, x - r, evs[b].us - x))
    return by_cpu


def report(path, skip):
    result = analyse(path, skip)
    if result is None:
        print(f"{path}: no write() calls traced")
        return
    (req, fd), modes, wakes, streaks = result
    n = sum(len(v) for v in modes.values())
    print(f"== {path}: requester pid {req} (doorbell fd {fd}), {n} iterations")
    for k, v in modes.items():
        if v:
            print(f"  {k}: {len(v)} ({100 * len(v) / n:.0f} %), median {statistics.median(v):.1f} usec")
    print(f"  ksoftirqd wake-ups {wakes}, of them not preempting (a fast streak begins) {len(streaks)}")
    if streaks:
        ms = ", ".join(f"{t:.1f} ms/{r}" for t, r in streaks)
        print(f"  streaks (length / reads): {ms}")
    for cpu, spans in sorted(stages(path, skip).items()):
        med = [statistics.median(s[k] for s in spans) for k in range(3)]
        print(f"  without a switch, on CPU {cpu}: {len(spans)} iterations; medians: doorbell to "
              f"raise {med[0]:.1f}, raise to return {med[1]:.1f}, user space {med[2]:.1f} usec")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", type=int, default=200)
    p.add_argument("trace", nargs="+")
    a = p.parse_args()
    for t in a.trace:
        report(t, a.skip)


if __name__ == "__main__":
    main()

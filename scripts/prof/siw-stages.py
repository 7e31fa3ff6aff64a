#!/usr/bin/env python3
"""Where an iWARP (siw) read ping-pong's iterations go, from an ftrace log: for any program
(ours and perftest alike), without changing it.

A read on siw runs in three places. The requester's doorbell (`ibv_post_send` ends in a
`write()` to the uverbs file) sends the Read Request inside that system call, and on
loopback the responder's receive processing runs there too, in softirq; it queues the Read
Response and wakes siw's per-CPU transmit thread (`siw_tx/N`, the CPU that siw chose for
the responder's queue pair when it was created). That thread sends the response, whose
receive processing places the data and the completion at the requester. This script splits
each iteration (one doorbell to the next) at those events and groups the iterations by
where the requester ran: on the transmit thread's CPU (the thread then preempts it) or on
the other one.

Capture, in the soft-RDMA guest (tracefs; stop tracing before copying the log, or the
copy's own `write`s are traced while it reads):

    T=/sys/kernel/tracing
    echo 'comm ~ "siw_tx*"' > $T/events/sched/sched_wakeup/filter
    for e in sched/sched_wakeup sched/sched_switch syscalls/sys_enter_write \\
             syscalls/sys_exit_write; do echo 1 > $T/events/$e/enable; done
    echo > $T/trace; <run the ping-pong>; echo 0 > $T/tracing_on; cp $T/trace run.trace

    siw-stages.py [--skip N] TRACE...

The requester is the process with the most `write`s to one descriptor (its doorbell).
Columns, medians in usec from the doorbell's entry: `exit` the doorbell's return, `wake`
the transmit thread's wake-up, `run` its start, `done` its switch-out after that (which,
when the requester runs on the other CPU, can come after the next doorbell), `total` the
whole iteration; `preempted` how often per iteration the requester was switched out.
The first --skip iterations (warm-up, default 200) and the last 10 are left out.
"""
import argparse
import collections
import re
import statistics

from ftrace import NEXT, PREV, doorbell, events, is_doorbell


def iterations(path):
    """The requester's iterations, each a dict of stage times relative to its doorbell."""
    evs = list(events(path))
    found = doorbell(evs)
    if found is None:
        return None, None, []
    req, fd = found
    its, cur = [], None
    for e in evs:
        ts, cpu, pid, t = e.us, e.cpu, e.pid, e.text
        if is_doorbell(e, req, fd):
            if cur:
                cur["total"] = ts - cur["t0"]
                its.append(cur)
            cur = {"t0": ts, "cpu": cpu, "preempted": 0}
        elif cur is None:
            continue
        elif pid == req and t.startswith("sys_write ->"):
            cur.setdefault("exit", ts - cur["t0"])
        elif t.startswith("sched_wakeup") and "comm=siw_tx" in t:
            if "wake" not in cur:
                cur["wake"] = ts - cur["t0"]
                cur["tx_cpu"] = int(re.search(r"target_cpu=(\d+)", t).group(1))
        elif t.startswith("sched_switch"):
            nxt, prv = NEXT.search(t), PREV.search(t)
            if nxt.group(1).startswith("siw_tx") and "run" not in cur:
                cur["run"] = ts - cur["t0"]
                cur["displaced"] = prv.group(1)
            elif prv.group(1).startswith("siw_tx") and "run" in cur and "done" not in cur:
                cur["done"] = ts - cur["t0"]
            if int(prv.group(2)) == req:
                cur["preempted"] += 1
    return req, fd, its


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def report(path, skip):
    req, fd, its = iterations(path)
    its = its[skip:-10]
    if not its:
        print(f"{path}: no iterations")
        return
    totals = sorted(i["total"] for i in its)
    pct = lambda q: totals[int(q * (len(totals) - 1))]
    print(f"{path}: requester pid {req} (doorbell fd {fd}), {len(its)} iterations; "
          f"total p10 {pct(0.1):.0f}, p50 {pct(0.5):.0f}, p90 {pct(0.9):.0f} usec")
    groups = collections.defaultdict(list)
    for i in its:
        if "tx_cpu" not in i:
            groups["no wake-up seen"].append(i)
        elif i["cpu"] == i["tx_cpu"]:
            groups["on siw_tx's CPU"].append(i)
        else:
            groups["on the other CPU"].append(i)
    print(f"  {'requester':18} {'n':>5} {'exit':>6} {'wake':>6} {'run':>6} {'done':>6} "
          f"{'total':>6} {'preempted':>9}  displaced by siw_tx")
    for name, g in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        col = lambda k: median([i[k] for i in g if k in i])
        shown = ", ".join(f"{c} {n}" for c, n in
                          collections.Counter(i.get("displaced") for i in g).most_common(2))
        print(f"  {name:18} {len(g):5d} {col('exit'):6.0f} {col('wake'):6.0f} {col('run'):6.0f} "
              f"{col('done'):6.0f} {col('total'):6.0f} "
              f"{statistics.mean(i['preempted'] for i in g):9.2f}  {shown}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--skip", type=int, default=200)
    a = ap.parse_args()
    for p in a.traces:
        report(p, a.skip)


if __name__ == "__main__":
    main()

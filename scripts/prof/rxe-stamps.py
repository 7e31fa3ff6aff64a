#!/usr/bin/env python3
"""Reads rxe-stamps logs (see rxe-stamps.c) and prints, per log, the median of each step
from the poll that found a message to the doorbell of the next send, in nanoseconds:

    found poll            the hot (completion-queue) lock held by the poll that found it
    poll -> RQ lock       from that poll's unlock to the receive queue's lock (the repost)
    RQ hold               librxe's post_recv under its lock
    RQ -> SQ lock         from the repost's unlock to the send queue's lock (the next send)
    SQ hold               librxe's post_send under its lock
    SQ -> doorbell        to the doorbell's write()
    total                 from the finding poll's lock to the doorbell

Only iterations of that shape (repost, then send) count: a send-receive ping-pong.

    rxe-stamps.py [--mhz F] LOG...     (F: the TSC's MHz; default /proc/cpuinfo's)
"""
import collections
import statistics
import sys


def tsc_mhz():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1])
    raise SystemExit("rxe-stamps.py: no cpu MHz in /proc/cpuinfo: pass --mhz")


def steps(path):
    ev = [line.split() for line in open(path)]
    # The send queue's lock: the one whose unlock the doorbell follows.
    sq = collections.Counter(a[1] for a, b in zip(ev, ev[1:]) if a[0] == "U" and b[0] == "W")
    if not sq:
        return None
    sq = sq.most_common(1)[0][0]
    # The receive queue's lock: the other one released right before the send queue's lock.
    rq = collections.Counter(
        a[1] for a, b in zip(ev, ev[1:]) if b[0] == "L" and b[1] == sq and a[0] == "U" and a[1] != sq
    )
    if not rq:
        return None
    rq = rq.most_common(1)[0][0]
    out = collections.defaultdict(list)
    i = 0
    while i + 5 <= len(ev):
        e = ev[i : i + 5]
        if [x[0] for x in e] == ["L", "U", "L", "U", "W"] and e[0][1] == rq and e[2][1] == sq:
            hot_lock, hot_unlock = int(e[0][3]), int(e[0][4])
            t = [int(x[2]) for x in e]
            if hot_lock <= hot_unlock <= t[0]:
                out["found poll"].append(hot_unlock - hot_lock)
                out["poll -> RQ lock"].append(t[0] - hot_unlock)
                out["RQ hold"].append(t[1] - t[0])
                out["RQ -> SQ lock"].append(t[2] - t[1])
                out["SQ hold"].append(t[3] - t[2])
                out["SQ -> doorbell"].append(t[4] - t[3])
                out["total"].append(t[4] - hot_lock)
            i += 5
        else:
            i += 1
    return out


def main(argv):
    mhz = None
    if len(argv) > 1 and argv[0] == "--mhz":
        mhz = float(argv[1])
        argv = argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    mhz = mhz or tsc_mhz()
    for path in argv:
        s = steps(path)
        if not s:
            print(f"{path}: no repost-then-send iterations found")
            continue
        cells = " | ".join(f"{k} {statistics.median(v) * 1000 / mhz:.0f}" for k, v in s.items())
        print(f"{path} ({len(s['total'])} iterations): {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Reads rxe-stamps logs (see rxe-stamps.c) and prints, per log, the median of each step
of an iteration, from the poll that found a completion to the next one, in nanoseconds:

    found poll            the hot (completion-queue) lock held by the poll that found it
    poll -> RQ lock       from that poll's unlock to the receive queue's lock (the repost)
    RQ hold               librxe's post_recv under its lock
    RQ -> SQ lock         from the repost's unlock to the send queue's lock (the next send)
    poll -> SQ lock       instead of the three above when nothing is reposted (a read, an
                          atomic, a write ping-pong)
    SQ hold               librxe's post_send under its lock
    SQ -> doorbell        to the doorbell's write()
    to doorbell           from the finding poll's lock to the doorbell: the application's
                          and librxe's part between a completion and the next request
    in write()            the doorbell's system call: rxe's work done inside it (on loopback
                          the request, the peer's side and often the reply)
    return -> found poll  from the doorbell's return to the lock of the next poll that
                          finds a completion: the application after its post, its empty
                          polls, and any wait for the peer
    total                 from one doorbell to the next (one iteration)

Logs written before the shim stamped the doorbell's return lack the last three columns
but "total". Iterations in which another lock or doorbell comes between are skipped.

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


def iterations(ev):
    """Each doorbell's iteration: (doorbell, its return or None, the locks taken since the
    previous doorbell returned, in time order, as (lock, lock time, unlock time)). The hot
    lock (its address is never logged) is "hot", its latest hold taken from the doorbell's
    event when it falls inside the iteration."""
    since = None
    seg = []
    for i, e in enumerate(ev):
        if e[0] in "LU":
            seg.append(e)
            continue
        if e[0] != "W":
            continue
        w = int(e[2])
        ret = int(ev[i + 1][2]) if i + 1 < len(ev) and ev[i + 1][0] == "R" else None
        holds, open_ = [], {}
        for x in seg:
            if x[0] == "L":
                open_[x[1]] = int(x[2])
            elif x[1] in open_:
                holds.append((x[1], open_.pop(x[1]), int(x[2])))
        hot = (int(e[3]), int(e[4]))
        if since is not None and since <= hot[0] <= hot[1] <= w:
            holds.append(("hot", hot[0], hot[1]))
        holds.sort(key=lambda h: h[1])
        yield w, ret, holds
        since = ret if ret is not None else w
        seg = []


def steps(path):
    ev = [line.split() for line in open(path)]
    its = list(iterations(ev))
    # The send queue's lock: the last one before a doorbell, most often. The completion
    # queues' locks: those taken first after a doorbell returns (a poll comes first) in at
    # least 1 % of the iterations, and the hot one, unless it is the send queue's (a
    # one-sided loop whose every poll finds: one poll and one post per iteration).
    sq = collections.Counter(h[-1][0] for _, _, h in its if h).most_common(1)
    if not sq:
        return None
    sq = sq[0][0]
    first = collections.Counter(h[0][0] for _, _, h in its if h)
    cqs = {k for k, n in first.items() if n * 100 >= len(its)} | {"hot"}
    cqs.discard(sq)
    # Per shape (a repost before the post, or none): only the more common one is reported.
    shapes = {1: collections.defaultdict(list), 2: collections.defaultdict(list)}
    prev = None
    for w, ret, holds in its:
        polls = [k for k, h in enumerate(holds) if h[0] in cqs]
        after = holds[polls[-1] + 1 :] if polls else None
        shape = [h[0] for h in after] if after is not None else []
        if shape[-1:] == [sq] and len(shape) in (1, 2) and shape[0] not in cqs:
            out = shapes[len(shape)]
            found = holds[polls[-1]]
            out["found poll"].append(found[2] - found[1])
            if len(after) == 2:
                rq = after[0]
                out["poll -> RQ lock"].append(rq[1] - found[2])
                out["RQ hold"].append(rq[2] - rq[1])
                out["RQ -> SQ lock"].append(after[1][1] - rq[2])
            else:
                out["poll -> SQ lock"].append(after[0][1] - found[2])
            out["SQ hold"].append(after[-1][2] - after[-1][1])
            out["SQ -> doorbell"].append(w - after[-1][2])
            out["to doorbell"].append(w - found[1])
            if prev is not None and prev[1] is not None:
                out["in write()"].append(prev[1] - prev[0])
                out["return -> found poll"].append(found[1] - prev[1])
            if prev is not None:
                out["total"].append(w - prev[0])
        prev = (w, ret)
    out = max(shapes.values(), key=lambda o: len(o["to doorbell"]))
    return out if out["to doorbell"] else None


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
            print(f"{path}: no iteration of a known shape found")
            continue
        cells = " | ".join(f"{k} {statistics.median(v) * 1000 / mhz:.0f}" for k, v in s.items())
        print(f"{path} ({len(s['to doorbell'])} iterations): {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])

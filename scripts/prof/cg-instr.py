#!/usr/bin/env python3
"""Instructions per iteration of one loop, by function and by instruction, from two
callgrind runs of the same binary that differ only in their iteration count.

Run the program twice under `valgrind --tool=callgrind --dump-instr=yes`, with N1 and N2
iterations (the same warm-up); the difference of the two profiles, divided by N2 - N1, is
what one iteration costs, free of start-up and connection set-up. Costs are exclusive
(each instruction counted where it runs, calls not included) and kept for one object (the
binary, not the libraries it calls).

    cg-instr.py BEFORE.out AFTER.out --iters N2-N1 --binary PATH [--top K]
    cg-instr.py BEFORE.out AFTER.out --iters N2-N1 --binary PATH --annotate 'crate::Type::fn'
    cg-instr.py BEFORE.out AFTER.out --iters N2-N1 --whole

The first form prints the functions that cost most per iteration. The second prints the
named function's instructions that ran (with their source lines, from `objdump -dl`) and a
running sum: where in a function its instructions go. Needs binutils (`nm`, `objdump`).
The third needs neither, and works on any program, perftest's too: every object's
instructions per iteration (the libraries' and the program's), then the functions called
most per iteration, of every object: two programs profiled alike compare whole. Waits
count as well as work in the first column (a spinning program's empty polls); the second
counts each instruction at most once per iteration, which leaves a wait's repeats out
(and a working loop's: a copy's, a second call of the same function), the work of one
pass through the iteration. `--exclude REGEX` leaves out functions by name (the sort of
the samples after the run, a helper thread's loop):

    cg-instr.py s2000.out s6000.out --iters 4000 --whole --exclude 'sort|rnr_main'

Example (the soft-RDMA guest, the server of the 8-byte send ping-pong):

    valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file=s2000.out \\
        fabric perf lat --op send --size 8 --role server --listen ADDR:7471 --provider roce &
    fabric perf lat --op send --size 8 --iters 2000 --warmup 100 --spin --provider roce \\
        --role client --connect ADDR:7471
    (the same with 6000 iterations into s6000.out; stop each server with SIGINT)
    cg-instr.py s2000.out s6000.out --iters 4000 --binary target/release/fabric
"""
import argparse
import bisect
import collections
import re
import subprocess
import sys


def costs(path, binary):
    """Exclusive Ir per instruction address of the object whose path ends in `binary`."""
    out = collections.Counter()
    for (ob, _, addr), v in whole(path)[0].items():
        if ob and ob.endswith(binary):
            out[addr] += v
    if not out:
        sys.exit(f"cg-instr.py: {path}: no costs for an object ending in {binary!r} "
                 "(was it run with --dump-instr=yes?)")
    return out


def whole(path):
    """Exclusive Ir per instruction, keyed (object, function, address), and calls per
    callee name, over the whole profile."""
    ir, calls = collections.Counter(), collections.Counter()
    obs, fns = {}, {}
    ob = fn = callee = None
    addr = 0
    after_calls = False
    with open(path) as f:
        for line in f:
            if line.startswith("positions:") and line.split()[1:3] != ["instr", "line"]:
                sys.exit(f"cg-instr.py: {path}: positions are {line.split()[1:]}, not "
                         "instr and line: run callgrind with --dump-instr=yes")
            m = re.match(r"(c?ob|c?fn)=\((\d+)\)\s*(.*)", line)
            if m:
                kind, ident, name = m.groups()
                names = obs if kind.endswith("ob") else fns
                if name:
                    names[ident] = name.strip()
                if kind == "ob":
                    ob = obs.get(ident, "?")
                elif kind == "fn":
                    fn = fns.get(ident, "?")
                elif kind == "cfn":
                    callee = fns.get(ident, "?")
                continue
            if line.startswith("calls="):
                # The next cost line is the call's inclusive cost: not the caller's own.
                calls[callee] += int(line.split()[0][len("calls="):])
                after_calls = True
                continue
            if line[:1] in "0123456789+-*":
                parts = line.split()
                a = parts[0]
                if a.startswith("0x"):
                    addr = int(a, 16)
                elif a[0] == "+":
                    addr += int(a[1:])
                elif a[0] == "-":
                    addr -= int(a[1:])
                if after_calls:
                    after_calls = False
                elif len(parts) >= 3:
                    # positions: instr line, then the event (Ir).
                    ir[(ob, fn, addr)] += int(parts[2])
            elif not line.startswith(("cfi", "cfl", "cob")):
                after_calls = False
    if not ir:
        sys.exit(f"cg-instr.py: {path}: no costs (was it run with --dump-instr=yes?)")
    return ir, calls


def whole_per_object(before, after, iters, exclude=None):
    """Per object: instructions per iteration, and the same with each instruction
    counted at most once per iteration (a wait's repeats, a spinning poll's, left out;
    so are the repeats of a loop that does work, such as a copy's). Functions whose name
    matches `exclude` are left out of both."""
    total, capped = collections.Counter(), collections.Counter()
    for key in set(before) | set(after):
        ob, fn, _ = key
        if exclude is not None and fn is not None and exclude.search(fn):
            continue
        v = (after[key] - before[key]) / iters
        total[ob] += v
        capped[ob] += min(max(v, 0.0), 1.0)
    return total, capped


def print_whole(a):
    (ir0, calls0), (ir1, calls1) = whole(a.before), whole(a.after)
    exclude = re.compile(a.exclude) if a.exclude else None
    total, capped = whole_per_object(ir0, ir1, a.iters, exclude)
    print("per iteration: instructions, and each instruction at most once"
          + (f" (functions matching {a.exclude!r} left out)" if exclude else ""))
    print(f"{sum(total.values()):9.1f} {sum(capped.values()):9.1f}  every object")
    for name, v in sorted(total.items(), key=lambda kv: -kv[1]):
        if abs(v) >= a.min:
            print(f"{v:9.1f} {capped[name]:9.1f}  {name}")
    print("calls per iteration, by callee")
    cper = {k: (calls1[k] - calls0[k]) / a.iters for k in set(calls0) | set(calls1)}
    for name, v in sorted(cper.items(), key=lambda kv: -kv[1])[:a.top]:
        if v >= 0.01:
            print(f"{v:9.2f}  {name}")


def symbols(binary):
    text = subprocess.run(["nm", "-C", "-n", "--defined-only", binary],
                          capture_output=True, text=True, check=True).stdout
    syms = []
    for line in text.splitlines():
        m = re.match(r"([0-9a-f]+) [tTwW] (.*)", line)
        if m:
            syms.append((int(m.group(1), 16), m.group(2)))
    return syms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--iters", type=float, required=True,
                    help="how many more iterations the second run made")
    ap.add_argument("--binary", help="the profiled program's path")
    ap.add_argument("--whole", action="store_true",
                    help="every object's instructions and the calls, per iteration")
    ap.add_argument("--exclude", metavar="REGEX",
                    help="with --whole: leave out the functions whose names match (a "
                    "sort after the run, a helper thread's loop)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--annotate", metavar="FUNCTION")
    ap.add_argument("--min", type=float, default=0.5,
                    help="with --annotate: hide instructions run fewer times per iteration; "
                    "with --whole: objects that cost fewer")
    a = ap.parse_args()
    if a.whole:
        print_whole(a)
        return
    if a.binary is None:
        ap.error("--binary is needed, except with --whole")

    before, after = costs(a.before, a.binary), costs(a.after, a.binary)
    per = {k: (after[k] - before[k]) / a.iters for k in set(before) | set(after)}
    syms = symbols(a.binary)
    starts = [s for s, _ in syms]

    def owner(addr):
        i = bisect.bisect_right(starts, addr) - 1
        return i if i >= 0 else None

    if a.annotate is None:
        by_fn = collections.Counter()
        for addr, v in per.items():
            i = owner(addr)
            by_fn[syms[i][1] if i is not None else "?"] += v
        print(f"{sum(per.values()):9.1f}  all of {a.binary} per iteration")
        for name, v in by_fn.most_common(a.top):
            print(f"{v:9.1f}  {name}")
        return

    # The named function's copy that costs most (generic functions have several).
    best = None
    for i, (s, name) in enumerate(syms[:-1]):
        if name == a.annotate:
            end = syms[i + 1][0]
            t = sum(v for addr, v in per.items() if s <= addr < end)
            if best is None or t > best[0]:
                best = (t, s, end)
    if best is None:
        sys.exit(f"cg-instr.py: no function named {a.annotate!r} in {a.binary}")
    total, lo, hi = best
    dis = subprocess.run(["objdump", "-dl", "--no-show-raw-insn", "-C",
                          f"--start-address={lo}", f"--stop-address={hi}", a.binary],
                         capture_output=True, text=True, check=True).stdout
    where = None
    run = 0.0
    for line in dis.splitlines():
        m = re.match(r"^\s+([0-9a-f]+):\s+(.*)$", line)
        if m:
            v = per.get(int(m.group(1), 16), 0.0)
            if v >= a.min:
                run += v
                if where:
                    print(f"    {where}   [running sum {run:.0f}]")
                    where = None
                print(f"{v:6.1f}  {m.group(1)}  {m.group(2)}")
        elif line.startswith("/"):
            where = line.rsplit("/", 1)[-1]
    print(f"{total:.1f} instructions per iteration in {a.annotate}")


if __name__ == "__main__":
    main()

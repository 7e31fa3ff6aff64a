"""Reading a tracefs `trace` log, for the profiling scripts beside this file
(`siw-stages.py`, `rxe-read-modes.py`)."""
import collections
import re
from typing import NamedTuple

LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+(\S+)\s+(\d+\.\d+): (.*)$")
NEXT = re.compile(r"next_comm=(.*?) next_pid=(\d+)")
PREV = re.compile(r"prev_comm=(.*?) prev_pid=(\d+)")


class Event(NamedTuple):
    """One event line."""

    us: float  # timestamp, usec
    cpu: int
    pid: int
    flags: str  # irqs-off, need-resched, hardirq/softirq, preempt depth: "dN.3." and the like
    text: str  # the event from its name on: "sched_wakeup: comm=...", "sys_write(fd: 6, ..."


def events(path):
    """Every event line of the log (a `stacktrace` trigger's header line reads as an event
    whose text is `<stack trace>`; its frames, ` => ...`, are not event lines)."""
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                _, pid, cpu, flags, ts, text = m.groups()
                yield Event(float(ts) * 1e6, int(cpu), int(pid), flags, text)


def doorbell(evs):
    """(pid, fd) of the requester: the process with the most `write`s to one descriptor.

    On rxe and siw, `ibv_post_send` ends in a `write()` to the uverbs file, so these are
    its doorbells. None if the log has no `write` at all."""
    writers = collections.Counter(
        (e.pid, re.search(r"fd: (\w+)", e.text).group(1))
        for e in evs
        if e.text.startswith("sys_write(fd:")
    )
    return writers.most_common(1)[0][0] if writers else None


def is_doorbell(e, req, fd):
    """Whether `e` is the requester's doorbell (the entry of its `write` to `fd`)."""
    return e.pid == req and e.text.startswith(f"sys_write(fd: {fd},")

"""Tests of the ftrace and callgrind readers in this folder, on small made-up logs:
`python3 -m unittest discover -s scripts/prof` (scripts/test runs it)."""
import importlib.util
import os
import re
import shutil
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
LOGS = tempfile.mkdtemp(prefix="test_prof.")


def tearDownModule():
    shutil.rmtree(LOGS, ignore_errors=True)


def load(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), os.path.join(HERE, name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def line(comm, pid, cpu, flags, us, text):
    return f"{comm:>16}-{pid:<7} [{cpu:03d}] {flags} {us / 1e6:12.6f}: {text}\n"


def switch(cpu, us, prev, prev_pid, nxt, nxt_pid, state="R"):
    return line(prev, prev_pid, cpu, "d..2.", us,
                f"sched_switch: prev_comm={prev} prev_pid={prev_pid} prev_prio=120 "
                f"prev_state={state} ==> next_comm={nxt} next_pid={nxt_pid} next_prio=120")


class Log:
    """A made-up trace, written to a temporary file."""

    def __init__(self):
        self.lines = ["# tracer: nop\n"]

    def add(self, text):
        self.lines.append(text)

    def write(self):
        """The log's path."""
        fd, path = tempfile.mkstemp(suffix=".trace", dir=LOGS)
        with os.fdopen(fd, "w") as f:
            f.writelines(self.lines)
        return path


REQ, KSI = 357, 21


def rxe_log(modes):
    """A requester on CPU 1 doing one read per entry of `modes`: "slow" (the wake-up
    preempts; ksoftirqd switched in and out), "start" (a wake-up without need-resched:
    a fast streak begins), "fast" (no wake-up: ksoftirqd still runnable), "end" (the
    tick lets ksoftirqd run: the streak ends, this read is slow). A slow read takes 100
    usec, a fast one 50; each has a write to stdout too (not a doorbell)."""
    log, t = Log(), 1_000_000
    for m in modes:
        log.add(line("app", REQ, 1, "...1.", t, "sys_write(fd: 6, buf: 7ffe, count: 20)"))
        log.add(line("app", REQ, 1, "d....", t + 5, "softirq_raise: vec=6 [action=TASKLET]"))
        log.add(line("app", REQ, 1, "d....", t + 6, "<stack trace>"))
        if m == "slow":
            log.add(line("app", REQ, 1, "dN.3.", t + 7, f"sched_wakeup: comm=ksoftirqd/1 pid={KSI} prio=120 target_cpu=001"))
        elif m == "start":
            log.add(line("app", REQ, 1, "d..3.", t + 7, f"sched_wakeup: comm=ksoftirqd/1 pid={KSI} prio=120 target_cpu=001"))
        log.add(line("app", REQ, 1, "...1.", t + 20, "sys_write -> 0x20"))
        if m in ("slow", "end"):
            log.add(switch(1, t + 25, "app", REQ, "ksoftirqd/1", KSI))
            log.add(switch(1, t + 40, "ksoftirqd/1", KSI, "app", REQ, "S"))
        log.add(line("app", REQ, 1, "...1.", t + 50, "sys_write(fd: 1, buf: 55, count: 1)"))
        t += 100 if m in ("slow", "end") else 50
    return log.write()


class RxeReadModes(unittest.TestCase):
    def setUp(self):
        self.mod = load("rxe-read-modes.py")

    def test_modes_and_streaks(self):
        modes = ["slow"] * 5 + ["start"] + ["fast"] * 4 + ["end"] + ["slow"] * 12
        (req, fd), got, wakes, streaks = self.mod.analyse(rxe_log(modes), skip=0)
        self.assertEqual((req, fd), (REQ, "6"))
        # 23 doorbells, the last 9 dropped: iterations between doorbells 0..13 = 13.
        self.assertEqual(len(got["fast"]), 5)  # the streak's start and its 4 fast reads
        self.assertEqual(len(got["slow"]), 8)
        self.assertEqual([round(x, 3) for x in got["fast"]], [50.0] * 5)
        self.assertEqual([round(x, 3) for x in got["slow"]], [100.0] * 8)
        self.assertEqual(len(streaks), 1)
        ms, reads = streaks[0]
        self.assertEqual(reads, 5)  # the 4 fast doorbells and the one the tick ends
        self.assertAlmostEqual(ms, (5 * 50 + 25 - 7) / 1e3)
        # 5 slow, the start, and the slow reads of doorbells 11 and 12 (13's wake-up
        # comes after the last doorbell kept; the fast reads and the end wake nothing).
        self.assertEqual(wakes, 8)

    def test_a_log_without_doorbells(self):
        log = Log()
        log.add(switch(0, 10, "a", 1, "b", 2))
        self.assertIsNone(self.mod.analyse(log.write(), skip=0))

    def test_stages_of_the_iterations_without_a_switch(self):
        modes = ["slow"] * 3 + ["start"] + ["fast"] * 3 + ["end"] + ["slow"] * 10
        got = self.mod.stages(rxe_log(modes), skip=0)
        # 18 doorbells, the last 9 dropped: 8 iterations, of which the streak's start and
        # its 3 fast reads ran without a switch (the slow ones and the tick's end did not).
        self.assertEqual(list(got), [1])
        self.assertEqual([tuple(round(x, 3) for x in s) for s in got[1]], [(5.0, 15.0, 30.0)] * 4)
        log = Log()
        log.add(switch(0, 10, "a", 1, "b", 2))
        self.assertIsNone(self.mod.stages(log.write(), skip=0))


class SiwStages(unittest.TestCase):
    def test_stages_of_one_read(self):
        mod = load("siw-stages.py")
        log, t = Log(), 2_000_000
        for _ in range(3):
            log.add(line("app", REQ, 0, "...1.", t, "sys_write(fd: 6, buf: 7ffe, count: 20)"))
            log.add(line("app", REQ, 0, "d..3.", t + 30, "sched_wakeup: comm=siw_tx/0 pid=99 prio=120 target_cpu=000"))
            log.add(line("app", REQ, 0, "...1.", t + 40, "sys_write -> 0x20"))
            log.add(switch(0, t + 50, "app", REQ, "siw_tx/0", 99))
            log.add(switch(0, t + 70, "siw_tx/0", 99, "app", REQ, "S"))
            t += 100
        req, fd, its = mod.iterations(log.write())
        self.assertEqual((req, fd), (REQ, "6"))
        self.assertEqual(len(its), 2)
        first = its[0]
        for key, want in (("exit", 40), ("wake", 30), ("run", 50), ("done", 70), ("total", 100)):
            self.assertAlmostEqual(first[key], want, places=3, msg=key)
        self.assertEqual((first["cpu"], first["tx_cpu"], first["preempted"]), (0, 0, 1))
        self.assertEqual(first["displaced"], "app")


def callgrind(iters):
    """A made-up callgrind profile of `iters` iterations: the program's loop (5
    instructions, and a call to the library's poll per iteration), the library's poll (3
    instructions per call, 2 calls per iteration: one from the program, one from itself),
    and 100 instructions of start-up."""
    return "".join([
        "# callgrind format\nversion: 1\npositions: instr line\nevents: Ir\n",
        "ob=(1) /bin/prog\nfl=(1) ???\nfn=(1) main\n",
        "0x1000 0 100\n",
        f"+4 0 {5 * iters}\n",
        "cob=(2) /lib/libdev.so\ncfi=(1)\ncfn=(2) poll\n",
        f"calls={iters} 0x2000 0\n",
        f"+4 0 {6 * iters}\n",
        "ob=(2)\nfl=(1)\nfn=(2)\n",
        f"0x2000 0 {6 * iters}\n",
        "cfn=(2)\n",
        f"calls={iters} 0x2000 0\n",
        f"+8 0 {3 * iters}\n",
    ])


class CgWhole(unittest.TestCase):
    def test_every_object_and_the_calls_per_iteration(self):
        mod = load("cg-instr.py")
        paths = []
        for n in (1000, 3000):
            path = os.path.join(LOGS, f"cg.{n}.out")
            with open(path, "w") as f:
                f.write(callgrind(n))
            paths.append(path)
        ir, calls = mod.whole(paths[0])
        # The inclusive cost of a call (its line after `calls=`) is never counted.
        self.assertEqual(ir, {("/bin/prog", "main", 0x1000): 100,
                              ("/bin/prog", "main", 0x1004): 5 * 1000,
                              ("/lib/libdev.so", "poll", 0x2000): 6 * 1000})
        self.assertEqual(calls, {"poll": 2 * 1000})
        ir2, calls2 = mod.whole(paths[1])
        total, capped = mod.whole_per_object(ir, ir2, 2000)
        self.assertEqual(total, {"/bin/prog": 5.0, "/lib/libdev.so": 6.0})
        # The poll's instruction runs twice per iteration: once, capped.
        self.assertEqual(capped, {"/bin/prog": 1.0, "/lib/libdev.so": 1.0})
        self.assertEqual((calls2["poll"] - calls["poll"]) / 2000, 2.0)
        total, _ = mod.whole_per_object(ir, ir2, 2000, re.compile("^poll$"))
        self.assertEqual(total, {"/bin/prog": 5.0})

if __name__ == "__main__":
    unittest.main()

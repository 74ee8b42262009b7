"""How many torch threads the decode may use: the cores the rest of the machine leaves idle.

A decode step is hundreds of small matmuls, each ending on an OpenMP barrier. With a thread per
core on a machine whose other processes want those cores (harness CLIs, the gateway, a test
suite), every barrier waits for a descheduled thread: on the shared 2-core VM at load ~9 a 4-row
SmolLM2 step took 5.1 s with two threads and 0.39 s with one. On an idle machine the second
thread is worth it: a 4-row step reads the weights at twice the bandwidth (68.7 against 53.6
sampled tokens/s). So the count follows what others use, measured from ``/proc/stat`` against
this process's own CPU time (all its threads: the decode's, and a node's event loop when the
engine runs in it) over the last interval: others' busy cores come off the cores this process may
run on, less a quarter-core margin, and never below one thread.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

INTERVAL_S = 1.0
"""Seconds between two looks at the machine (one read of /proc/stat)."""

FIRST_S = 0.1
"""The shortest window of the first estimate (10 ticks of /proc/stat): a short first busy period
is not left on one thread for a second."""

MARGIN = 0.25
"""Cores others may use before a thread is given up: 0.1 busy core elsewhere leaves both threads
of a 2-core machine, 0.3 takes one."""


def allowed_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _busy_seconds(stat: Path) -> float | None:
    """Every CPU's non-idle time since boot, in seconds; None where /proc/stat cannot be read."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


class ThreadBudget:
    """``pick()`` at each step boundary: the thread count to use now, between 1 and ``most``."""

    def __init__(self, most: int, stat: Path = Path("/proc/stat"), interval: float = INTERVAL_S) -> None:
        self.most, self.stat, self.interval = max(1, most), stat, interval
        self.current = 1
        self._estimated = False
        self._last: tuple[float, float, float] | None = None  # (wall, machine busy, our CPU)
        if self.most > 1:  # the first look at the machine: the first pick measures from here
            busy = _busy_seconds(stat)
            self._last = None if busy is None else (time.monotonic(), busy, time.process_time())

    def pick(self) -> int:
        if self.most == 1:
            return 1
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < (self.interval if self._estimated else FIRST_S):
            return self.current
        busy = _busy_seconds(self.stat)
        ours = time.process_time()
        if busy is None:
            return 1
        if self._last is not None:
            wall, busy_before, ours_before = self._last
            others = max(0.0, (busy - busy_before) - (ours - ours_before)) / max(now - wall, 1e-6)
            self.current = self.threads_for(others)
            self._estimated = True
        self._last = (now, busy, ours)
        return self.current

    def threads_for(self, others: float) -> int:
        """Threads when others keep ``others`` cores busy."""
        return max(1, min(self.most, int(self.most - others + MARGIN)))

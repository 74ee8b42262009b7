"""Per-stage CPU time of the gateway's call path, always on, so a benchmark names the stage
that regressed (``scripts/bench_scale.py`` prints them from the gateway's ``stage_cpu`` status).

Each stage is a synchronous section timed with the running thread's CPU clock
(``time.thread_time_ns``: ~0.1 µs, and neither other threads nor other processes count), added to
one process-wide counter. Only synchronous code is timed (never across an ``await``), so time the
event loop spends on other tasks is not charged to a stage. The journal stages run on the writer
thread; the counters are plain ints updated under the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

STAGES = ("parse", "validate", "share", "continuation", "engine_build", "engine_decode", "journal_encode",
          "journal_write", "reply_build")
_CPU_NS: dict[str, int] = dict.fromkeys(STAGES, 0)
_CALLS: dict[str, int] = dict.fromkeys(STAGES, 0)
_clock = time.thread_time_ns
P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Charge this block's thread CPU time to ``name``."""
    t0 = _clock()
    try:
        yield
    finally:
        _CPU_NS[name] += _clock() - t0
        _CALLS[name] += 1


def timed(name: str, fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with its calls charged to ``name``."""

    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with stage(name):
            return fn(*args, **kwargs)

    return wrapper


def snapshot() -> dict[str, dict[str, int]]:
    """Cumulative CPU ns and section count per stage since the process started."""
    return {name: {"cpu_ns": _CPU_NS[name], "count": _CALLS[name]} for name in STAGES}

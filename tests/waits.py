"""Waits for the tests: poll a condition until it holds, and fail loudly (an AssertionError that
says what was awaited) when it does not within a generous timeout. A deadline here bounds a wait;
it is never the thing a test asserts (wall-clock figures belong to the benchmarks in scripts/)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WAIT_S = 120.0
"""Generous: long enough for a loaded 2-core machine, short enough that a wedged test fails."""


async def until(condition: Callable[[], object], what: str, *, timeout_s: float = WAIT_S, poll_s: float = 0.02) -> None:
    """Return once ``condition()`` is truthy; raise AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(poll_s)


def until_sync(condition: Callable[[], object], what: str, *, timeout_s: float = WAIT_S, poll_s: float = 0.1) -> None:
    """``until`` for synchronous tests (subprocesses, files)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)

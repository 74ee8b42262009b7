"""The event loop a gateway or node process runs on: uvloop (a core dependency off Windows), else
asyncio's default loop.

uvloop (libuv underneath) spends less CPU per socket read and write than the default selector
loop, and writes a large body without copying it into a buffer first; a node's calls at 100k
tokens move ~3.5 MB each (request in, engine payload out, engine reply in): 5.56 → 5.25 ms of
node CPU per call (scripts/bench_scale.py, docs/performance.md). Ray's async actors pick it up
on their own where it is installed. Without it, or with ``POLAR_ENV_LOOP=asyncio`` (to rule the
loop out when chasing a bug), the default loop runs the same code.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOP_ENV = "POLAR_ENV_LOOP"  # "asyncio": the default loop even where uvloop is installed


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default (not installed, or turned off)."""
    choice = os.environ.get(LOOP_ENV, "").strip().lower()
    if choice == "asyncio":
        return None
    if choice not in ("", "uvloop"):
        from polar_env.errors import ConfigError

        raise ConfigError(f"{LOOP_ENV}={choice!r}: use 'uvloop' or 'asyncio' (or leave it unset)")
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def loop_name() -> str:
    """What ``run`` would run on, for start-up lines: 'uvloop' or 'asyncio'."""
    return "asyncio" if loop_factory() is None else "uvloop"


def new_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the kind ``run`` would run on (for a loop kept in a thread)."""
    factory = loop_factory()
    return asyncio.new_event_loop() if factory is None else factory()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)

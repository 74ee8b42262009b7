"""The event loop a server process runs on: uvloop when it is installed (the ``fast`` extra), else
asyncio's default loop.

uvloop (libuv underneath) spends less CPU per socket read, write and timer than the default
selector loop; the gateway's hop is mostly that work (scripts/bench_gateway.py). It is optional:
without it, or with ``POLAR_ENV_LOOP=asyncio`` (to rule the loop out when chasing a bug), the
default loop runs the same code.
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


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)

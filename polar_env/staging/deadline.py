"""One shutdown deadline for a whole process: every close step (the interrupted sessions' POSTRUN,
the nodes' gateways and engines, the POSTRUN and evaluation worker processes) takes what is left of
it, not a timeout of its own; past it the remaining children are killed, and the event loop's
threads are not waited for (``bounded_run``).

Why one: per-step timeouts add up. Closing the POSTRUN and evaluation workers joined each for up to
30 s, and on a busy machine niced workers ran each of them out: a stopped ``rollout`` lived 145-221 s
after its signal, a finished one ~1 min 46 s after its last line. The promise (docs/outcomes.md) is
an exit within ``SIGNAL_BUDGET_S`` + a few seconds of a signal and within seconds of a normal end.

The deadline is process-wide (``begin`` / ``current``): the nodes' stop is reached through the
rollout server, which takes no argument for it. A Ray actor is its own process, with its own.
In a process that is the ``polar-env`` command itself (``whole_process``), ``finish`` kills
whatever descendant is left and leaves with ``os._exit`` (a thread still in a blocking call, e.g.
an engine load cancelled by a signal during start-up, would otherwise hold the exit), and a
watchdog (``arm_watchdog``) exits past the hard limit whatever the main thread is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Coroutine, Iterator
from pathlib import Path
from typing import TypeVar

from polar_env.observe.liveness import end_all

T = TypeVar("T")
SIGNAL_BUDGET_S = 12.0  # after a signal: sessions, POSTRUN and every close step, then kill what is left
CLOSE_BUDGET_S = 10.0  # a cluster's close without a signal (at a normal end nothing runs: idle workers)
CLOSE_GRACE_S = 2.0  # past the deadline, for a close step's own kills (a worker killed, then joined)
POSTRUN_SHARE = 0.6  # of a signal's budget, for the interrupted sessions' POSTRUN; the rest closes the nodes
HARD_LIMIT_S = 18.0  # after a signal, the watchdog exits whatever the main thread is doing
WRITE_LIMIT_S = 300.0  # the watchdog waits for the outputs being written at most this long
AFTER_WRITE_S = 3.0  # and then gives the summary and the resume line this long
EXIT_JOIN_S = 1.0  # ``bounded_run``: the most the tasks left at its end are waited for once cancelled

_active: Deadline | None = None
_writing = threading.Event()  # set while the run's outputs are written (``writing_outputs``)


class Deadline:
    """A point in time (monotonic) that every close step shares."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def cap(self, seconds: float) -> float:
        """``seconds``, or less: what is left of the deadline."""
        return min(seconds, self.remaining())

    def before(self, share: float) -> Deadline:
        """An earlier deadline: ``share`` of what is left of this one (a step that must leave time
        to the ones after it)."""
        part = Deadline(0.0)
        part.at = time.monotonic() + share * self.remaining()
        return part

    async def wait(self, aw: Awaitable[T]) -> tuple[bool, T | None]:
        """Await ``aw`` until the deadline: (True, its result), or (False, None) when it passed
        (``aw`` is then cancelled)."""
        try:
            return True, await asyncio.wait_for(aw, self.remaining())
        except TimeoutError:
            return False, None


def begin(seconds: float) -> Deadline:
    """Start the process's shutdown deadline ``seconds`` from now (an earlier one stands)."""
    global _active
    new = Deadline(seconds)
    if _active is None or new.at < _active.at:
        _active = new
    return _active


def active() -> bool:
    """Whether a shutdown deadline is under way."""
    return _active is not None


def current(default_s: float = CLOSE_BUDGET_S) -> Deadline:
    """The shutdown deadline under way, or one of ``default_s`` from now (a close step called
    outside a shutdown: a node stopped on its own)."""
    return _active if _active is not None else Deadline(default_s)


def reset(previous: Deadline | None = None) -> None:
    """Back to ``previous`` (None: no shutdown under way): the job that began it is over, and the
    next one in this process starts clean."""
    global _active
    _active = previous


@contextlib.contextmanager
def scope(seconds: float) -> Iterator[Deadline]:
    """A shutdown deadline for the steps inside (a cluster's close), restored after: a process
    that closes one cluster and starts another (a trainer) starts the next close afresh."""
    previous = _active
    try:
        yield begin(seconds)
    finally:
        reset(previous)


def descendants(root: int | None = None) -> list[int]:
    """The live descendants of ``root`` (this process), from /proc; [] where there is no /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def kill_descendants(root: int | None = None) -> int:
    """SIGKILL every descendant of ``root`` (this process) and the process groups they lead (a
    sandbox's session, a harness CLI's children); returns how many were found. Found first, killed
    after: a killed parent's children are re-parented away from this tree."""
    found = descendants(root)
    own = os.getpgrp()
    for pid in found:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid and pid != own:
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(found)


def whole_process() -> bool:
    """Whether this process is the ``polar-env`` command itself (``python -m polar_env.cli`` or the
    console script), so its end may kill every descendant and ``os._exit``; never a test or a
    library caller running a job in its own process."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "polar_env.cli.__main__":
        return True
    return Path(sys.argv[0]).name == "polar-env" if sys.argv else False


def finish(code: int) -> int:
    """The command's end: in the ``polar-env`` process itself, kill what is left and exit now
    (``os._exit``: nothing waits on a thread or child any more); elsewhere return ``code``."""
    if not whole_process():
        return code
    kill_descendants()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def writing_outputs() -> Iterator[None]:
    """The run's outputs being written: work, not waiting (a large run's files take seconds), so
    the watchdog lets it end (up to ``WRITE_LIMIT_S``) and gives the summary ``AFTER_WRITE_S``."""
    _writing.set()
    try:
        yield
    finally:
        _writing.clear()


def arm_watchdog(code: int, limit_s: float = HARD_LIMIT_S) -> None:
    """In the ``polar-env`` process itself: exit with ``code`` ``limit_s`` from now if it is still
    here (the main thread stuck past every deadline), killing every descendant first."""
    if not whole_process():
        return

    def watch() -> None:
        time.sleep(limit_s)
        if _writing.is_set():
            waited = time.monotonic()
            while _writing.is_set() and time.monotonic() - waited < WRITE_LIMIT_S:
                time.sleep(0.1)
            time.sleep(AFTER_WRITE_S)
        print(f"\npolar-env: not stopped {limit_s:g} s after the signal: exiting now; the captures stay on disk "
              "for --resume; where it was (for a bug report):", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        end_all("interrupted", error=f"stopped by the shutdown watchdog {limit_s:g} s after the signal")
        kill_descendants()
        os._exit(code)

    threading.Thread(target=watch, daemon=True, name="polar-shutdown-watchdog").start()


def bounded_run(main: Coroutine[object, object, T]) -> T:
    """``eventloop.run(main)``, except that the loop's threads (``asyncio.to_thread``: an engine
    load a signal cancelled, a close step) are not joined: asyncio's own shutdown joins them with
    no limit, and an engine load takes minutes on a busy machine."""
    from polar_env import eventloop

    loop = eventloop.new_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:  # no shutdown_default_executor: it joins a thread still in a call (uvloop's blocks even
            # the loop); close() lets idle threads go and leaves a busy one to finish() or the caller
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left (sessions given up on at the deadline) and give them ``EXIT_JOIN_S``."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=EXIT_JOIN_S))

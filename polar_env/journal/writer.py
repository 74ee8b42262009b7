"""The ordered journal writer: one thread per gateway appends records in submission order.

The event loop only enqueues (a few microseconds); encoding, the write and the optional fsync run
on the writer thread, and the caller's future resolves once the record is durable (or with the
write's error), so a reply is still never sent for a lost call. One thread keeps every session's
records in capture order and its encoder state single-threaded; a queue, not a pool, because
appends are short and must not reorder.

Small records skip the hand-off: ``submit(..., inline=True)`` runs the write on the caller's
thread when the writer has finished everything queued before it (so the order still holds). At
one connection the hand-off (queue put, thread wake, GIL hand-over, the loop's self-pipe wake) cost
more than encoding and writing a 30 kB record; the caller decides what is small enough to block
its loop for (``Gateway.record``: bounded by the record's size, never by the session's history).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("polar_env.gateway")

_STOP = object()
T = TypeVar("T")


class JournalWriter:
    """``await writer.append(*args)`` runs ``write(*args)`` on the writer thread, in order."""

    def __init__(self, write: Callable[..., int], name: str = "polar-journal") -> None:
        self._write = write
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        # Jobs queued (counted by the submitting thread) and finished (counted by the writer):
        # one writer each, so equal means the thread is idle with nothing before a new job.
        self._queued = 0
        self._finished = 0

    async def append(self, *args: Any, inline: bool = False) -> int:
        return await self.submit(self._write, *args, inline=inline)

    @property
    def idle(self) -> bool:
        """Everything queued so far is written (or failed)."""
        return self._finished == self._queued

    async def submit(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """Run ``fn(*args)`` on the writer thread in order with the appends; await its outcome
        (what ``fn`` returned, or its exception). ``inline``: run it here instead when nothing
        is queued before it (same order, no hand-off)."""
        if self._closed:
            raise RuntimeError("journal writer is closed")
        if inline and self.idle:
            return fn(*args)
        loop = asyncio.get_running_loop()
        self._queued += 1
        done: asyncio.Future[T] = loop.create_future()
        self._jobs.put(((fn, args), loop, done))
        return await done

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the writer thread after everything queued so far (descriptor closes)."""
        self._queued += 1
        self._jobs.put(((), None, fn))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            work, loop, done = job
            if loop is None:
                try:
                    done()
                except Exception:  # noqa: BLE001 - housekeeping must not stop the writer
                    log.exception("journal writer task failed")
                self._finished += 1
                continue
            error: BaseException | None = None
            result: Any = None
            fn, args = work
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting request
                error = exc
            self._finished += 1  # after the write: an inline job may follow it now
            try:
                loop.call_soon_threadsafe(_settle, done, result, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what is queued, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(_STOP)
        self._thread.join(timeout_s)


def _settle(done: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if done.cancelled():
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)

"""Bounded stage pools of one gateway node, and the bookkeeping that proves the bounds hold.

Admission to INIT takes a place in the READY buffer first (a priority semaphore: higher task
priority first, then FIFO), and gives it back only when the session starts RUNNING. So prepared
runtimes (INIT + READY) never exceed ``ready_buffer``, however many sessions are queued, and a
RUNNING slot that frees up finds a prepared runtime waiting. INIT, RUNNING and POSTRUN each have
their own slot count, so slow setup, evaluation or cleanup never hold a RUNNING slot (the engine's
capacity). ``Occupancy`` integrates the stage counts over time for the report.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polar_env.staging.models import Stage


class PoolLimits(BaseModel):
    """Per-node stage limits. ``max_running`` should match what the engine serves at once."""

    model_config = ConfigDict(extra="forbid")

    max_init: int = Field(default=4, ge=1)
    max_running: int = Field(default=4, ge=1)
    max_postrun: int = Field(default=2, ge=1)
    ready_buffer: int | None = Field(default=None, ge=1)  # default: max_running + max_init

    @model_validator(mode="after")
    def _buffer(self) -> PoolLimits:
        if self.ready_buffer is None:
            self.ready_buffer = self.max_running + self.max_init
        return self


class PrioritySemaphore:
    """A semaphore whose waiters are served by (-priority, arrival)."""

    def __init__(self, value: int) -> None:
        self._value = value
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()

    async def acquire(self, priority: int = 0) -> None:
        if self._value > 0 and not self._waiters:
            self._value -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._counter), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted just as we were cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self._value += 1

    @asynccontextmanager
    async def hold(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()


@dataclass(slots=True)
class Occupancy:
    """Time-integrated count of sessions per stage (for occupancy and the timeline)."""

    started: float = field(default_factory=time.monotonic)
    counts: dict[Stage, int] = field(default_factory=lambda: {s: 0 for s in Stage})
    peak: dict[Stage, int] = field(default_factory=lambda: {s: 0 for s in Stage})
    area: dict[Stage, float] = field(default_factory=lambda: {s: 0.0 for s in Stage})
    _last: float = field(default_factory=time.monotonic)

    def _advance(self) -> None:
        now = time.monotonic()
        for stage, n in self.counts.items():
            self.area[stage] += n * (now - self._last)
        self._last = now

    def move(self, old: Stage | None, new: Stage | None) -> None:
        self._advance()
        if old is not None:
            self.counts[old] -= 1
        if new is not None:
            self.counts[new] += 1
            self.peak[new] = max(self.peak[new], self.counts[new])

    def mean(self, stage: Stage, since: float | None = None) -> float:
        self._advance()
        elapsed = self._last - (self.started if since is None else since)
        return self.area[stage] / elapsed if elapsed > 0 else 0.0


class StagePools:
    def __init__(self, limits: PoolLimits) -> None:
        assert limits.ready_buffer is not None
        self.limits = limits
        self.prepared = PrioritySemaphore(limits.ready_buffer)  # INIT + READY places
        self.init = asyncio.Semaphore(limits.max_init)
        self.running = asyncio.Semaphore(limits.max_running)
        self.postrun = asyncio.Semaphore(limits.max_postrun)
        self.occupancy = Occupancy()

    def stats(self) -> dict[str, object]:
        return {
            "counts": {s.value: n for s, n in self.occupancy.counts.items()},
            "peak": {s.value: n for s, n in self.occupancy.peak.items()},
            "limits": self.limits.model_dump(),
        }

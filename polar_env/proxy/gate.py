"""Pause/resume of upstream engine calls around a weight sync.

``pause`` stops new calls from starting and waits until the in-flight ones have finished, so the
trainer can swap weights with nothing half-generated; ``resume`` lets calls through again under a
new weight version, which every record sampled afterwards carries. A pause that cannot drain in
time (a hung engine) is rolled back rather than left half-applied, and reports which calls were
still running: the gateway never stays wedged behind a call that will not finish.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class EngineGate:
    def __init__(self, weight_version: str = "0") -> None:
        self.weight_version = weight_version
        self.paused = False
        self._running: dict[int, tuple[str, float]] = {}  # call id -> (session id, started)
        self._ids = itertools.count()
        self._changed = asyncio.Condition()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @asynccontextmanager
    async def call(self, label: str = "") -> AsyncIterator[str]:
        """Hold a slot for one upstream call; yields the weight version it runs under."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.paused)
            call_id = next(self._ids)
            self._running[call_id] = (label, time.monotonic())
        try:
            yield self.weight_version
        finally:
            async with self._changed:
                self._running.pop(call_id, None)
                self._changed.notify_all()

    def running(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [{"session_id": label, "running_s": round(now - started, 3)} for label, started in self._running.values()]

    async def pause(self, timeout_s: float | None = None) -> bool:
        """Stop new calls and wait for in-flight ones. If they do not drain within ``timeout_s``,
        the pause is undone (calls flow again) and False is returned; ``running()`` says which."""
        async with self._changed:
            self.paused = True
            if not self._running:
                return True
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not self._running), timeout_s)
            except TimeoutError:
                self.paused = False
                self._changed.notify_all()
                return False
        return True

    async def resume(self, weight_version: str | None = None) -> None:
        async with self._changed:
            if weight_version is not None:
                self.weight_version = weight_version
            self.paused = False
            self._changed.notify_all()

    def status(self) -> dict[str, object]:
        return {"paused": self.paused, "in_flight": self.in_flight, "weight_version": self.weight_version}

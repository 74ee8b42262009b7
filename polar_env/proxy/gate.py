"""Pause/resume of upstream engine calls around a weight sync.

``pause`` stops new calls from starting and waits until the in-flight ones have finished, so the
trainer can swap weights with nothing half-generated; ``resume`` lets calls through again under a
new weight version, which every record sampled afterwards carries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class EngineGate:
    def __init__(self, weight_version: str = "0") -> None:
        self.weight_version = weight_version
        self.in_flight = 0
        self.paused = False
        self._changed = asyncio.Condition()

    @asynccontextmanager
    async def call(self) -> AsyncIterator[str]:
        """Hold a slot for one upstream call; yields the weight version it runs under."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.paused)
            self.in_flight += 1
        try:
            yield self.weight_version
        finally:
            async with self._changed:
                self.in_flight -= 1
                self._changed.notify_all()

    async def pause(self, timeout_s: float | None = None) -> bool:
        """Stop new calls; wait for in-flight ones. False if they did not drain in time (still paused)."""
        async with self._changed:
            self.paused = True
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.in_flight == 0), timeout_s)
            except TimeoutError:
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

"""``LazyEnv``: a PolarEnv (or anything with its async context) entered once, on first use, under
a lock — trainers call their rollout hooks concurrently, and the first calls must not start two
clusters. Shared by the slime generate function and the NeMo Gym agent."""

from __future__ import annotations

import asyncio
from typing import Generic, Protocol, TypeVar


class AsyncContext(Protocol):
    """What LazyEnv enters and exits: PolarEnv's async context."""

    async def __aenter__(self) -> object: ...

    async def __aexit__(self, *exc: object) -> object: ...


E = TypeVar("E", bound=AsyncContext)


class LazyEnv(Generic[E]):
    def __init__(self, env: E) -> None:
        self.env = env
        self._started = False
        self._lock = asyncio.Lock()

    async def start(self) -> E:
        async with self._lock:
            if not self._started:
                await self.env.__aenter__()
                self._started = True
        return self.env

    async def close(self) -> None:
        async with self._lock:
            if self._started:
                self._started = False
                await self.env.__aexit__(None, None, None)

"""``SimulatedRuntime``: a test double for pipeline tests and benchmarks, named as one.

It implements the Runtime interface with simulated costs and runs nothing: ``prepare``, ``exec``
and ``stop`` sleep for their configured seconds (jittered), ``exec`` answers with the command it
was given; its trees are empty (``walk_tree``), so the grader sees no change. Staging tests and
``scripts/bench_staging.py`` use it to measure scheduling without container start-up noise; real
isolation is the sandbox, Docker and Apptainer runtimes.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings


@dataclass
class SimulatedRuntime:
    spec: RuntimeSpec
    prepare_s: float = 0.0
    exec_s: float = 0.0
    stop_s: float = 0.0
    jitter: float = 0.0  # ± this fraction on every simulated cost
    fail_prepare: bool = False
    seed: int | None = None
    name: str = "simulated"
    timings: Timings = field(default_factory=Timings)
    prepared: bool = False
    stopped: bool = False
    commands: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    async def _cost(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds * (1 + self.jitter * (2 * self._rng.random() - 1)))

    async def prepare(self) -> None:
        started = time.monotonic()
        await self._cost(self.prepare_s)
        if self.fail_prepare:
            raise RuntimeError("simulated prepare failure")
        self.prepared = True
        self.timings.prepare_s = time.monotonic() - started

    async def exec(self, command: Any, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout_s: float = 600.0) -> ExecResult:
        self.commands.append(command)
        started = time.monotonic()
        await self._cost(self.exec_s)
        return ExecResult(0, f"ran {command!r}", False, time.monotonic() - started)

    async def write_file(self, path: str, data: bytes) -> None:
        return None

    async def read_file(self, path: str) -> bytes:
        return b""

    async def diff(self) -> str:
        return ""

    async def walk_tree(self, inside: str, digests: bool) -> list[tuple[str, str, int, int, str | None]]:
        """The grader's walk of a tree: this double has no files, so every tree is empty."""
        return []

    async def stop(self) -> None:
        started = time.monotonic()
        await self._cost(self.stop_s)
        self.stopped = True
        self.timings.stop_s = time.monotonic() - started

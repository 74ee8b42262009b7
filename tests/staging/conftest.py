"""Test doubles for the staging tests, named as such: ``FakeRuntime`` (a runtime whose prepare,
exec and stop take simulated time and run nothing) and ``FakeRuntimeNode`` (a GatewayNode that
builds FakeRuntimes). The engine is the ``simulated`` test double. The real path — bwrap sandbox,
a real harness CLI, the embedded engine and the swebench evaluator — is tested in
``test_rollout_e2e.py``."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from polar_env.engines.config import EngineConfig
from polar_env.runtimes.base import ExecResult, RuntimeSpec, Timings
from polar_env.staging.node import GatewayNode, NodeConfig
from polar_env.staging.pools import PoolLimits


@dataclass
class FakeRuntime:
    """Test double: a Runtime with simulated costs. ``exec`` echoes the command unless
    ``hang``/``crash`` is set; nothing runs."""

    spec: RuntimeSpec
    prepare_s: float = 0.0
    exec_s: float = 0.0
    fail_prepare: bool = False
    name: str = "fake"
    timings: Timings = field(default_factory=Timings)
    prepared: bool = False
    stopped: bool = False
    commands: list[Any] = field(default_factory=list)

    async def prepare(self) -> None:
        await asyncio.sleep(self.prepare_s)
        if self.fail_prepare:
            raise RuntimeError("simulated prepare failure")
        self.prepared = True

    async def exec(self, command: Any, *, env: dict[str, str] | None = None, cwd: str | None = None,
                   timeout_s: float = 600.0) -> ExecResult:
        self.commands.append(command)
        started = time.monotonic()
        await asyncio.sleep(self.exec_s)
        return ExecResult(0, f"ran {command!r}", False, time.monotonic() - started)

    async def write_file(self, path: str, data: bytes) -> None:
        return None

    async def read_file(self, path: str) -> bytes:
        return b""

    async def diff(self) -> str:
        return ""

    async def stop(self) -> None:
        self.stopped = True


class FakeRuntimeNode(GatewayNode):
    """Test double: a GatewayNode whose runtimes are FakeRuntimes (everything else is real)."""

    def __init__(self, config: NodeConfig, **runtime_options: Any) -> None:
        super().__init__(config)
        self.runtime_options = runtime_options
        self.made: list[FakeRuntime] = []

    def make_runtime(self, spec: Any, **options: Any) -> Any:
        rt = FakeRuntime(spec, **self.runtime_options)
        self.made.append(rt)
        return rt


@pytest.fixture
def node_config(tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(latency_s: float = 0.01, **limits: int) -> NodeConfig:
        return NodeConfig(engine=EngineConfig(kind="simulated", latency_s=latency_s), store=tmp_path / "store",
                          limits=PoolLimits(**limits), tcp_port=None)

    return make

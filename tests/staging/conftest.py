"""Test doubles for the staging tests, named as such: ``FakeRuntime`` (the package's
``SimulatedRuntime``: prepare, exec and stop take simulated time and run nothing) and
``FakeRuntimeNode`` (a GatewayNode that builds them). The engine is the ``simulated`` test
double. The real path — bwrap sandbox, a real harness CLI, the embedded engine and the swebench
evaluator — is tested in ``test_rollout_e2e.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_env.engines.config import SimulatedEngineConfig
from polar_env.staging.node import GatewayNode, NodeConfig
from polar_env.staging.pools import PoolLimits
from polar_env.testing.simulated_runtime import SimulatedRuntime

FakeRuntime = SimulatedRuntime  # the package's named test double


class FakeRuntimeNode(GatewayNode):
    """Test double: a GatewayNode whose runtimes are FakeRuntimes (everything else is real)."""

    def __init__(self, config: NodeConfig, *, per_session: dict[str, dict[str, Any]] | None = None,
                 **runtime_options: Any) -> None:
        super().__init__(config)
        self.runtime_options = runtime_options
        self.per_session = per_session or {}  # session id -> FakeRuntime options for that one
        self.made: list[FakeRuntime] = []

    def make_runtime(self, spec: Any, session_id: str, **options: Any) -> Any:
        rt = FakeRuntime(spec, **{**self.runtime_options, **self.per_session.get(session_id, {})})
        self.made.append(rt)
        return rt


@pytest.fixture
def node_config(tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(latency_s: float = 0.01, **limits: int) -> NodeConfig:
        return NodeConfig(engine=SimulatedEngineConfig(latency_s=latency_s), store=tmp_path / "store",
                          limits=PoolLimits(**limits), tcp_port=None)

    return make

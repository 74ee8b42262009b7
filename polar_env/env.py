"""``PolarEnv``: the Python API for trainers — roll a task out N times, get the group back with
rewards; update the engine's weights between steps.

    env = PolarEnv.from_yaml("env.yaml")            # or PolarEnv(PolarEnvConfig(...)) / PolarEnv({...})
    async with env:
        group = await env.rollout(task, n=8)         # TaskRequest, SweTask or a dict row
        trajs = group.trajectories                   # each with reward, status and provenance
        await env.update_weights(state_dict, version="1")   # pause → load → resume

``start_sync``, ``rollout_sync``, ``update_weights_sync`` and ``close`` are the same for code without
an event loop; ``start``/``start_sync`` before the first rollout give a custom loop ``env.engine``,
the gateway and the weight sync up front (a later rollout reuses them). The config
(``PolarEnvConfig``, defined in ``staging.config`` and re-exported here) is read once and passed
down; nothing imports torch, slime or nemo-gym at import time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from polar_env import eventloop
from polar_env.errors import ConfigError
from polar_env.records import Trajectory
from polar_env.staging.cluster import Cluster, start_cluster
from polar_env.staging.config import PolarEnvConfig, task_request
from polar_env.staging.models import SessionResult, TaskRequest, TaskStatus
from polar_env.tasks.swe import SweTask

__all__ = ["PolarEnv", "PolarEnvConfig", "RolloutGroup", "build_trajectories", "task_request"]  # the config's home is staging.config

T = TypeVar("T")


@dataclass
class RolloutGroup:
    """One task's samples: a GRPO group."""

    task_id: str
    group_id: str
    results: list[SessionResult]
    early_stopped: bool = False

    @property
    def trajectories(self) -> list[Trajectory]:
        return [r.trajectory for r in self.results if r.trajectory is not None]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results]

    @classmethod
    def from_status(cls, status: TaskStatus) -> RolloutGroup:
        return cls(status.task_id, status.group_id, list(status.results), status.early_stopped)


class PolarEnv:
    def __init__(self, config: PolarEnvConfig | Mapping[str, Any] | None = None, *, engine: Any | None = None) -> None:
        """``engine``: an in-process engine client to share instead of building one from the config
        (e.g. an EmbeddedEngine your trainer also holds)."""
        if isinstance(config, PolarEnvConfig):
            self.config = config
        else:
            try:
                self.config = PolarEnvConfig.model_validate(config or {})
            except ValidationError as exc:  # one line naming the field, the bad value and the fix
                from polar_env.registry import validation_line

                raise ConfigError(f"PolarEnv config: {validation_line(exc, model=PolarEnvConfig)}") from None
        self._engine = engine
        self._cluster: Cluster | None = None
        self._starting = asyncio.Lock()  # concurrent first rollouts must start one cluster
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> PolarEnv:
        return cls(PolarEnvConfig.from_yaml(path))

    # -- lifetime -------------------------------------------------------------------------------
    async def start(self) -> PolarEnv:
        """Start the cluster (engine, gateway, weight sync) once; later calls and rollouts reuse it."""
        async with self._starting:
            if self._cluster is None:
                self._cluster = await start_cluster(self.config.cluster(), engine=self._engine)
        return self

    async def aclose(self) -> None:
        if self._cluster is not None:
            await self._cluster.aclose()
            self._cluster = None

    async def __aenter__(self) -> PolarEnv:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            raise ConfigError("PolarEnv is not started: use 'async with env:', 'await env.start()' or 'env.start_sync()'")
        return self._cluster

    @property
    def engine(self) -> Any:
        """The in-process engine client (the first node's), when the nodes run in this process."""
        if self._engine is not None:
            return self._engine
        nodes = self.cluster.local_nodes
        return nodes[0].engine if nodes else None

    # -- rollouts -------------------------------------------------------------------------------
    async def rollout(self, task: TaskRequest | SweTask | Mapping[str, Any], n: int | None = None,
                      **overrides: Any) -> RolloutGroup:
        await self.start()
        status = await self.cluster.server.run(task_request(task, self.config, n, **overrides))
        return RolloutGroup.from_status(status)

    async def rollout_many(self, tasks: Iterable[TaskRequest | SweTask | Mapping[str, Any]], n: int | None = None,
                           **overrides: Any) -> list[RolloutGroup]:
        return list(await asyncio.gather(*(self.rollout(t, n, **overrides) for t in tasks)))

    async def update_weights(self, weights: Any, version: str | int | None = None) -> str:
        """Pause every node's gateway, load ``weights`` (a state dict, or a folder of safetensors)
        into its engine, resume under ``version``; returns the version now served."""
        await self.start()
        versions = await self.cluster.server.update_weights(weights, None if version is None else str(version))
        return versions[0]

    # -- sync forms -------------------------------------------------------------------------------
    def _sync(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = eventloop.new_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="polar-env", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start_sync(self) -> PolarEnv:
        """``start`` for code without an event loop (the env's own loop thread runs the cluster)."""
        return self._sync(self.start())

    def rollout_sync(self, task: TaskRequest | SweTask | Mapping[str, Any], n: int | None = None,
                     **overrides: Any) -> RolloutGroup:
        return self._sync(self.rollout(task, n, **overrides))

    def update_weights_sync(self, weights: Any, version: str | int | None = None) -> str:
        return self._sync(self.update_weights(weights, version))

    def close(self) -> None:
        if self._loop is None:
            return
        self._sync(self.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop.close()
        self._loop = None


def build_trajectories(store_dir: str | Path, builder: str = "prefix_merge",
                       sessions: Sequence[str] | None = None) -> list[Trajectory]:
    """The trajectories of a capture store folder (all sessions, or ``sessions``), by builder name.
    The Python API's entry over a folder, so a root: it names the file store (readers below take
    a ``JournalSource``: ``trajectory.reader.build_store``)."""
    from polar_env.journal.store import JournalStore
    from polar_env.trajectory.builders import BUILDERS
    from polar_env.trajectory.reader import build_store

    build = BUILDERS.get(builder)
    root = Path(store_dir)
    if not root.is_dir():
        raise ConfigError(f"capture store {root} does not exist")
    return build_store(JournalStore(root), build, sessions or None)

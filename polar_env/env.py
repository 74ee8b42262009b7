"""``PolarEnv``: the Python API for trainers — roll a task out N times, get the group back with
rewards; update the engine's weights between steps.

    env = PolarEnv.from_yaml("env.yaml")            # or PolarEnv(PolarEnvConfig(...)) / PolarEnv({...})
    async with env:
        group = await env.rollout(task, n=8)         # TaskRequest, SweTask or a dict row
        trajs = group.trajectories                   # each with reward, status and provenance
        await env.update_weights(state_dict, version="1")   # pause → load → resume

``rollout_sync`` and ``close`` are the same for code without an event loop. The config is read once
here and passed down; nothing imports torch, slime or nemo-gym at import time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from polar_env.engines.config import EmbeddedEngineConfig, EngineConfig
from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvaluatorSpec
from polar_env.proxy.config import Sampling
from polar_env.records import ProviderAPI, Trajectory
from polar_env.registry import NAMES_CHECKED
from polar_env.runtimes.base import RuntimeSpec
from polar_env.staging.cluster import Cluster, ClusterConfig, start_cluster
from polar_env.staging.models import AgentSpec, SessionResult, TaskRequest, TaskStatus
from polar_env.staging.node import NodeConfig
from polar_env.staging.pools import PoolLimits
from polar_env.tasks.swe import SweTask

T = TypeVar("T")
MOVED = {"temperature": "sampling.temperature", "top_p": "sampling.top_p", "max_tokens": "sampling.max_tokens"}


class PolarEnvConfig(BaseModel):
    """Everything a rollout needs, as data (YAML-loadable): the root of the config tree (engine,
    runtime, evaluator, sampling, pool limits; ``cluster()`` derives the nodes' and gateways'
    settings from these sub-models). Every name (harness, builder, evaluator and its params,
    runtime, engine kind) is resolved when the config is built, so a typo is refused before any
    session starts. Per-task values in a TaskRequest win."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EmbeddedEngineConfig)
    harness: str = "pi"
    api: ProviderAPI | None = None
    agent_settings: dict[str, Any] = Field(default_factory=dict)
    agent_env: dict[str, str] = Field(default_factory=dict)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    builder: str = "prefix_merge"
    evaluator: EvaluatorSpec | None = None  # default: swebench for SWE tasks, none otherwise
    continuation: bool = True  # token-in continuation: append-only chains (canonical: False)
    sampling: Sampling = Sampling()  # trainer-owned temperature / top_p / max_tokens (per-call cap)
    timeout_s: float = 600.0
    init_timeout_s: float = 300.0
    limits: PoolLimits = Field(default_factory=PoolLimits)
    store: Path = Path("polar_rollouts/capture")
    nodes: int = 1
    ray: bool = False
    ray_address: str | None = None
    harness_cache: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for old, new in MOVED.items():
                if old in data:
                    raise ValueError(f"{old!r} is now {new} (e.g. sampling: {{{new.split('.')[1]}: {data[old]!r}}})")
        return data

    @field_validator("harness")
    @classmethod
    def _known_harness(cls, value: str, info: ValidationInfo) -> str:
        from polar_env.staging.models import check_harness_name

        return check_harness_name(value, info)

    @field_validator("builder")
    @classmethod
    def _known_builder(cls, value: str, info: ValidationInfo) -> str:
        from polar_env.trajectory.builders import BUILDERS

        return BUILDERS.check(value, info)

    @model_validator(mode="after")
    def _harness_speaks_api(self, info: ValidationInfo) -> PolarEnvConfig:
        from polar_env.staging.models import check_harness_api

        check_harness_api(self.harness, self.api, info)
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> PolarEnvConfig:
        from polar_env.yaml_config import load_model

        return load_model(cls, path, "config file")

    def cluster(self) -> ClusterConfig:
        engine = self.engine
        scripted = getattr(engine, "script", None) is not None
        if scripted and getattr(engine, "script_finish_command", None) is None and self.harness != "loop":
            from polar_env.harnesses import get_harness

            finish = get_harness(self.harness).finish_command  # mini-swe-agent ends only by a command
            engine = engine.model_copy(update={"script_finish_command": finish})
        node = NodeConfig(engine=engine, limits=self.limits, store=self.store, sampling=self.sampling,
                          harness_cache=self.harness_cache)
        return ClusterConfig(nodes=self.nodes, ray=self.ray, ray_address=self.ray_address, node=node)


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


def task_request(task: TaskRequest | SweTask | Mapping[str, Any], config: PolarEnvConfig, n: int | None = None,
                 **overrides: Any) -> TaskRequest:
    """A TaskRequest from what the user has: a TaskRequest (kept), a SweTask or SWE row (the repo or
    image becomes the runtime, the problem statement the instruction, swebench the default
    evaluator), or a plain row with ``task_id`` and ``instruction`` (the rest is the task row).
    A row that names something unknown is a ConfigError of one line, before anything runs."""
    try:
        return _task_request(task, config, n, **overrides)
    except ValidationError as exc:
        from polar_env.registry import validation_line

        where = task.get("task_id") or task.get("instance_id") if isinstance(task, Mapping) else None
        line = validation_line(exc, model=TaskRequest)
        raise ConfigError(f"task {where!r}: {line}" if where else line) from None


def _task_request(task: TaskRequest | SweTask | Mapping[str, Any], config: PolarEnvConfig, n: int | None,
                  **overrides: Any) -> TaskRequest:
    # the config resolved its harness and api when it was built: not again (a harness file re-read) per row
    agent = AgentSpec.model_validate({"harness": config.harness, "api": config.api, "env": config.agent_env,
                                      "settings": config.agent_settings}, context=NAMES_CHECKED)
    common: dict[str, Any] = {"agent": agent, "builder": config.builder, "continuation": config.continuation,
                              "timeout_s": config.timeout_s, "init_timeout_s": config.init_timeout_s,
                              "evaluator": config.evaluator}
    if isinstance(task, TaskRequest):
        req = task
    elif isinstance(task, SweTask) or (isinstance(task, Mapping) and "instance_id" in task):
        swe = SweTask.from_row(task)
        runtime = swe.runtime_spec(config.runtime.kind, **{k: v for k, v in config.runtime.model_dump().items()
                                                          if k not in ("kind", "source_dir", "image")})
        if config.runtime.image is not None:
            runtime = runtime.model_copy(update={"image": config.runtime.image})
        req = TaskRequest(task_id=swe.instance_id, instruction=swe.problem_statement, runtime=runtime,
                          task=swe.model_dump(mode="json"),
                          **{**common, "evaluator": config.evaluator or EvaluatorSpec(name="swebench")})
    elif isinstance(task, Mapping):
        row = dict(task)
        try:
            task_id, instruction = str(row.pop("task_id")), str(row.pop("instruction"))
        except KeyError as exc:
            raise ConfigError(f"a task row needs 'task_id' and 'instruction' (or be a SWE row); missing {exc}") from None
        fields = {k: row.pop(k) for k in list(row) if k in TaskRequest.model_fields}
        req = TaskRequest.model_validate({**common, "runtime": config.runtime, **fields, "task_id": task_id,
                                          "instruction": instruction, "task": {**row, **fields.get("task", {})}})
    else:
        raise ConfigError(f"cannot roll out a {type(task).__name__}; give a TaskRequest, a SweTask or a dict row")
    update = dict(overrides)
    if n is not None:
        update["num_samples"] = n
    return req.model_copy(update=update) if update else req


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
            raise ConfigError("PolarEnv is not started: use 'async with env:' or 'await env.start()'")
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
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="polar-env", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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

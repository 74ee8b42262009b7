"""``PolarEnvConfig``: the root of the config tree (engine, runtime, evaluator, sampling, pool
limits, nodes), and ``task_request``, which turns a task row into a TaskRequest under it.

It lives in staging because staging consumes it (the job, the cluster, the task API's defaults);
``polar_env.env`` (the trainer API, one layer up) re-exports both. The settings a TaskRequest may
override per task are ``submission.TASK_SETTINGS``: one table for the rows the job and
``polar-env submit`` build and the defaults ``polar-env serve`` fills in.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from polar_env.engines.config import EmbeddedEngineConfig, EngineConfig
from polar_env.errors import ConfigError
from polar_env.evaluators.base import EvaluatorSpec
from polar_env.proxy.config import Sampling
from polar_env.records import ProviderAPI
from polar_env.registry import NAMES_CHECKED
from polar_env.runtimes.base import RuntimeSpec
from polar_env.staging.cluster import ClusterConfig
from polar_env.staging.models import AgentSpec, TaskRequest
from polar_env.staging.node import NodeConfig
from polar_env.staging.pools import PoolLimits
from polar_env.staging.submission import task_settings
from polar_env.tasks.swe import SweTask

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
    # bounded here, so a YAML value and its flag are refused alike, before anything starts
    timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    init_timeout_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    limits: PoolLimits = Field(default_factory=PoolLimits)
    store: Path = Path("polar_rollouts/capture")
    nodes: int = Field(default=1, ge=1)
    ray: bool = False
    ray_address: str | None = None
    ray_node_resource: str | None = None  # Ray custom resource each node actor takes one unit of
    ray_wait_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)  # for hosts to offer ray_node_resource
    shared_store: bool | None = None  # Ray: True every host mounts store; False the head pulls all; None detect
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

    def check_sampling(self, sampling: Sampling | None, task_id: str) -> None:
        """The trainer's sampling for a task must not contradict ``sampling`` (ConfigError, one
        line): a trainer sampling at 0.7 under an environment forcing 1.0 would train off-policy."""
        conflicts = self.sampling.conflicts(sampling) if sampling is not None else []
        if conflicts:
            raise ConfigError(
                f"task {task_id!r}: the trainer's sampling contradicts the environment's "
                f"(sampling: {self.sampling.line()}): {', '.join(conflicts)}; set one of them, or the same values")

    def cluster(self) -> ClusterConfig:
        engine = self.engine
        scripted = getattr(engine, "script", None) is not None
        if scripted and getattr(engine, "script_finish_command", None) is None and self.harness != "loop":
            from polar_env.harnesses import get_harness

            finish = get_harness(self.harness).finish_command  # mini-swe-agent ends only by a command
            engine = engine.model_copy(update={"script_finish_command": finish})
        node = NodeConfig(engine=engine, limits=self.limits, store=self.store, sampling=self.sampling,
                          harness_cache=self.harness_cache)
        return ClusterConfig(nodes=self.nodes, ray=self.ray, ray_address=self.ray_address, node=node,
                             shared_store=self.shared_store, node_resource=self.ray_node_resource,
                             ray_wait_s=self.ray_wait_s)


# What a SWE row may set for itself, over the config's: its runtime (image, binds, env, limits), the
# agent's and INIT's budgets, and its evaluator (e.g. a longer eval timeout for a slow suite).
ROW_SETTINGS = ("runtime", "timeout_s", "init_timeout_s", "evaluator")


def _row_runtime(swe: SweTask, base: RuntimeSpec, own: Any) -> RuntimeSpec:
    """The runtime of a SWE row: the config's settings with the row's repo or image, then what the
    row's own ``runtime`` sets (its ``env`` merged over the config's, its ``binds`` added to them)."""
    if own is not None and not isinstance(own, Mapping):
        raise ConfigError(f"task {swe.instance_id!r}: 'runtime' must be a mapping of RuntimeSpec fields, got "
                          f"{type(own).__name__}")
    own = dict(own or {})
    kind = str(own.get("kind", base.kind))
    runtime = swe.runtime_spec(kind, **{k: v for k, v in base.model_dump().items()
                                        if k not in ("kind", "source_dir", "image")})
    if base.image is not None:
        runtime = runtime.model_copy(update={"image": base.image})
    merged = {**runtime.model_dump(), **own}
    merged["env"] = {**runtime.env, **(own.get("env") or {})}
    binds = [*runtime.binds, *(own.get("binds") or [])]
    merged["binds"] = list({str(dst): (src, dst) for src, dst in binds}.values())
    return RuntimeSpec.model_validate(merged)


def _row_evaluator(own: Any, default: EvaluatorSpec) -> EvaluatorSpec:
    """A SWE row's own evaluator: a full spec, or only its settings (``{timeout_s: 3600}``) over the default's."""
    if own is None:
        return default
    if not isinstance(own, Mapping):
        raise ConfigError(f"a SWE row's 'evaluator' must be a mapping, got {type(own).__name__}")
    if "name" not in own or own["name"] == default.name:
        data = default.model_dump()
        return EvaluatorSpec.model_validate({**data, **own, "params": {**data["params"], **(own.get("params") or {})}})
    return EvaluatorSpec.model_validate(own)


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
    common = task_settings(config, dump=False)  # the per-task settings (submission.TASK_SETTINGS)
    del common["runtime"]  # each kind of row makes its own (a SWE row's repo or image)
    # the config resolved its harness and api when it was built: not again (a harness file re-read) per row
    common["agent"] = AgentSpec.model_validate(common["agent"], context=NAMES_CHECKED)
    if isinstance(task, TaskRequest):
        req = task
    elif isinstance(task, SweTask) or (isinstance(task, Mapping) and "instance_id" in task):
        swe = SweTask.from_row(task)
        own = {k: swe.extra[k] for k in ROW_SETTINGS if swe.extra.get(k) is not None}
        evaluator = _row_evaluator(own.pop("evaluator", None), config.evaluator or EvaluatorSpec(name="swebench"))
        runtime = _row_runtime(swe, config.runtime, own.pop("runtime", None))
        req = TaskRequest.model_validate({**common, **own, "task_id": swe.instance_id, "runtime": runtime,
                                          "instruction": swe.problem_statement, "evaluator": evaluator,
                                          "task": swe.model_dump(mode="json")})
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
    if isinstance(update.get("sampling"), Mapping):
        update["sampling"] = Sampling.model_validate(update["sampling"])
    req = req.model_copy(update=update) if update else req
    config.check_sampling(req.sampling, req.task_id)
    return req

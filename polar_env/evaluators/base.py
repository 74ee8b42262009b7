"""The evaluator seam: an ``EvalContext`` goes in, an ``EvalResult`` comes out.

An evaluator scores one finished rollout from the task row, the final answer, the agent's runtime
(workspace files, diff) and the harness outcome. It may grade in a fresh runtime built by the
context's factory, and that runtime can be prepared while the agent still runs (``prewarm``).
``run_evaluator`` is the only caller: it turns a crash into an ERROR result that carries the
exception (never a silent 0) and stops the fresh runtime. The name → evaluator table lives in
``polar_env.evaluators``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, Self, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from polar_env.errors import ConfigError
from polar_env.evaluators.report import EvalReport, PlainJSONObject
from polar_env.evaluators.workspace import Changes, Manifest
from polar_env.records import Status
from polar_env.registry import Registry
from polar_env.runtimes.base import Runtime, limit_hit_of, prepared

EVAL_STATUSES = (Status.COMPLETED, Status.TIMEOUT, Status.ERROR)

RuntimeFactory = Callable[[], "Runtime | Awaitable[Runtime]"]
"""Builds an unprepared runtime holding a clean copy of the task (the context prepares it)."""


class EvalResult(BaseModel):
    """The verdict on one rollout. Only a COMPLETED evaluation may carry a nonzero reward. ``report``:
    its keys are ``report.EvalReport``'s, plus any a custom evaluator adds."""

    model_config = ConfigDict(extra="forbid")

    reward: float = 0.0
    status: Status = Status.COMPLETED
    report: Annotated[EvalReport, PlainJSONObject] = Field(default_factory=lambda: EvalReport())

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.status not in EVAL_STATUSES:
            raise ValueError(f"an evaluation ends COMPLETED, TIMEOUT or ERROR, not {self.status.name}")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")
        if self.status is not Status.COMPLETED and self.reward != 0.0:
            raise ValueError(f"a {self.status.name} evaluation carries reward 0, got {self.reward}")
        return self


class EvaluatorSpec(BaseModel):
    """Which evaluator a task uses and how. Keys other than ``name``/``timeout_s`` may be given flat
    (``{"name": "output", "regex": "42"}``); they are gathered into ``params``."""

    model_config = ConfigDict(extra="forbid")

    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = None  # the whole evaluation, fresh-runtime preparation included

    @model_validator(mode="before")
    @classmethod
    def _gather_flat_params(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"name": data}
        if isinstance(data, Mapping):
            known = {"name", "params", "timeout_s"}
            flat = {k: v for k, v in data.items() if k not in known}
            if flat:
                out = {k: v for k, v in data.items() if k in known}
                out["params"] = {**dict(data.get("params") or {}), **flat}
                return out
        return data

    @field_validator("name")
    @classmethod
    def _known_name(cls, value: str, info: ValidationInfo) -> str:
        return EVALUATORS.check(value, info)

    @model_validator(mode="after")
    def _params_fit(self, info: ValidationInfo) -> Self:
        """The params checked by the evaluator's own params model, now rather than at POSTRUN."""
        from polar_env.registry import names_checked

        if not names_checked(info):
            try:
                EVALUATORS.check_params(self.name, self.params)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self


class NoAgentRuntime(ConfigError):
    """The context has no agent runtime (e.g. in an evaluation worker process: the agent's live
    workspace exists only in the node, which then runs the evaluator itself)."""


@dataclass(slots=True, eq=False)
class EvalContext:
    """Everything an evaluator may look at. ``task`` is the task row (a dict, or a model the
    evaluator knows). What the agent changed reaches graders as ``changes`` (taken by the node from
    the agent's workspace against ``base``, its pristine manifest) or, from the Python API, as a
    text ``patch``; ``grading.graded_runtime`` handles all three."""

    task: Any
    params: dict[str, Any] = field(default_factory=dict)
    final_answer: str | None = None
    runtime: Runtime | None = None
    exit_code: int | None = None
    timed_out: bool = False
    patch: str | None = None
    changes: Changes | None = None
    base: Manifest | None = None
    runtime_factory: RuntimeFactory | None = None
    _fresh: asyncio.Future[Runtime] | None = field(default=None, init=False, repr=False)

    def agent_runtime(self) -> Runtime:
        if self.runtime is None:
            raise NoAgentRuntime("this evaluator needs the agent's runtime, and the context has none")
        return self.runtime

    async def fresh_runtime(self) -> Runtime:
        """The prepared fresh runtime: the pre-warmed one if ``prewarm`` started it, else built now.
        One per context; ``run_evaluator`` stops it."""
        if self._fresh is None:
            if self.runtime_factory is None:
                raise ConfigError("this evaluator grades in a fresh runtime, and the context has no runtime_factory")
            self._fresh = asyncio.ensure_future(self._build_fresh(self.runtime_factory))
        # shield: an evaluator cancelled mid-preparation must not leave a half-started runtime
        # behind; aclose() waits for it and stops it.
        return await asyncio.shield(self._fresh)

    def fresh_limit_hit(self) -> str | None:
        """The limit the fresh runtime hit (its sticky ``limit_hit``, e.g. ``"disk_mb=64 (...): ..."``),
        or None: none hit, or no fresh runtime was started."""
        fresh = self._fresh
        if fresh is None or not fresh.done() or fresh.cancelled() or fresh.exception() is not None:
            return None
        return limit_hit_of(fresh.result())

    @staticmethod
    async def _build_fresh(factory: RuntimeFactory) -> Runtime:
        made = factory()
        runtime = await made if inspect.isawaitable(made) else made
        return await prepared(runtime)

    async def aclose(self) -> None:
        """Stop the fresh runtime (waiting for a preparation in flight). Safe to call twice."""
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            return
        try:
            runtime = await fresh
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are being cancelled ourselves; _build_fresh stops what it started
            return
        except Exception:  # noqa: BLE001 - the evaluation already reported it
            return  # preparation failed: _build_fresh already stopped it
        await runtime.stop()


@runtime_checkable
class Evaluator(Protocol):
    """Grades on the live runtime only, unless it is also a ``FreshRuntimeEvaluator``."""

    @property
    def name(self) -> str: ...

    async def evaluate(self, ctx: EvalContext) -> EvalResult: ...


@runtime_checkable
class FreshRuntimeEvaluator(Evaluator, Protocol):
    """An evaluator that may grade in a fresh runtime: ``wants_fresh_runtime(ctx)`` says whether it
    does for this context (then the node hands it the agent's change set and the pristine base)."""

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool: ...


@runtime_checkable
class PrewarmingEvaluator(FreshRuntimeEvaluator, Protocol):
    """One with extra warm-up (such as a slow import), run while the agent still works."""

    async def prewarm(self, ctx: EvalContext) -> None: ...


EvalFunction = Callable[[EvalContext], Awaitable[EvalResult]]


@dataclass(frozen=True, slots=True)
class FunctionEvaluator:
    """Adapts a plain ``async def evaluate(ctx) -> EvalResult`` to the protocol."""

    name: str
    fn: EvalFunction
    fresh_runtime: bool = False

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        return await self.fn(ctx)

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
        return self.fresh_runtime


def as_evaluator(obj: object, name: str) -> Evaluator:
    """An evaluator instance from an instance, a class (built without arguments) or a coroutine function."""
    if inspect.isclass(obj):
        obj = obj()
    elif inspect.iscoroutinefunction(obj):
        return FunctionEvaluator(name=name, fn=obj)
    if not callable(getattr(obj, "evaluate", None)):
        raise ConfigError(f"{name!r} is not an evaluator: it needs an async evaluate(ctx) method")
    if not isinstance(getattr(obj, "name", None), str):
        try:
            setattr(obj, "name", name)  # noqa: B010 - obj is whatever the table was given
        except AttributeError as exc:
            raise ConfigError(f"evaluator {obj!r} has no name attribute") from exc
    return obj  # type: ignore[return-value]  # checked above: an evaluate method and a name


def error_report(exc: BaseException) -> EvalReport:
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "exception_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "traceback": "".join(traceback.format_exception(exc)),
    }


def needs_module(module: str, extra: str = "") -> Callable[[str, str], None]:
    """An evaluator's preflight check: ``module`` imports, else one line naming the evaluator,
    ``where`` it is used and the extra that provides the module."""

    def check(name: str, where: str) -> None:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            fix = f"pip install -e '.[{extra}]'" if extra else f"install the package that provides {module}"
            raise ConfigError(f"evaluator {name} needs the Python module {module}, which does not import, {where}; {fix}")

    return check


def check_importable(name: str, where: str) -> None:
    """The preflight check of an evaluator that declares none: one named by import path needs its
    module; one registered by name was imported already."""
    if ":" in name:
        needs_module(name.partition(":")[0])(name, where)


# The table (filled by ``polar_env/evaluators/__init__.py``): an evaluator class (built without
# arguments), instance, or ``async def (ctx)``; its params model is ``params=`` or the evaluator's
# own ``params_model`` attribute (None: params are not checked); its preflight check (called with
# its name and where it is used) ``preflight=``, else ``check_importable``. Declared here, below the
# package, so the spec's validators read it without importing the package that imports them.
EVALUATORS: Registry[Evaluator] = Registry("evaluator", load=as_evaluator, coerce=as_evaluator, dotted=True,
                                           preflight=check_importable)

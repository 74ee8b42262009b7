"""One NeMo Gym ``/run`` row → one Polar session → the row's result (response items + reward).

The row is Gym's: ``responses_create_params`` (the prompt, as Responses ``input``), task fields
passed through (a SWE-Gym row for ``polar_swegym``), and ``_ng_rollout_id``. The Polar task is the
row's ``task`` field if it has one, else the row itself without Gym's own keys; the instruction is
the row's ``instruction``/``problem_statement`` or the last user message of the input. The result
carries the real evaluator reward; ``mask_sample`` is the session's ``mask``
(``polar_env.records.masked``: the environment, not the policy, failed, the session was cancelled, or
nothing was sampled) or nothing delivered; ``failure_kind`` is ``polar_agent:<FailureKind>`` whenever
the session did not complete (an agent timeout keeps its tokens and reward 0, unmasked).
The row's ``responses_create_params`` sampling (temperature, top_p, max_output_tokens: what NeMo RL
sets from its generation config) is the session's trainer sampling, so the engine samples as the
trainer computes; one that contradicts the environment's ``sampling`` is refused, not masked.
No nemo_gym import: Gym's ``app.py`` wraps this in its server classes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from polar_env.integrations.delivery import DeliveryTally, choose_delivered
from polar_env.integrations.lazy_env import LazyEnv
from polar_env.integrations.nemo_gym.convert import output_items, response_object
from polar_env.journal.protocols import JournalOpener
from polar_env.proxy.config import Sampling
from polar_env.records import CompletionRecord, FailureKind, Trajectory

if TYPE_CHECKING:
    from polar_env.tasks.swe import SweTask

GYM_KEYS = ("responses_create_params", "_ng_rollout_id", "_ng_task_index", "_ng_rollout_index", "agent_ref",
            "capture_rollout_id")
FAILURE_KIND_PREFIX = "polar_agent"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


def instruction_of(row: Mapping[str, Any], task: Mapping[str, Any]) -> str:
    for key in ("instruction", "problem_statement"):
        text = task.get(key)
        if isinstance(text, str) and text:
            return text
    params = row.get("responses_create_params") or {}
    items = params.get("input") if isinstance(params, Mapping) else None
    if isinstance(items, str):
        return items
    for item in reversed(items or []):
        if isinstance(item, Mapping) and item.get("role") == "user":
            return _text(item.get("content"))
    return ""


def task_request(row: Mapping[str, Any]) -> SweTask | dict[str, object]:
    """The PolarEnv task for a Gym row: a SWE row (``instance_id``) as is, so PolarEnv makes its
    runtime and swebench grades it; polar_env's offline toy task for ``toy_task``; else a
    ``{task_id, instruction, task}`` row."""
    task = row.get("task")
    if not isinstance(task, Mapping):
        task = {k: v for k, v in row.items() if k not in GYM_KEYS}
    if isinstance(task.get("toy_task"), str):  # built on this machine (a local git checkout)
        from polar_env.tasks.toy import toy_tasks

        (swe,) = toy_tasks(ids=[task["toy_task"]])
        return swe
    if "instance_id" in task:
        return dict(task)
    task = dict(task)
    task_id = task.pop("task_id", None) or f"gym-{row.get('_ng_task_index', 0)}"
    return {"task_id": str(task_id), "instruction": instruction_of(row, task), "task": task}


def sampling_of(row: Mapping[str, object]) -> Sampling | None:
    """The row's own sampling (``responses_create_params`` temperature / top_p /
    max_output_tokens), or None when it sets none. An ill-typed value is a ValueError naming it."""
    from pydantic import ValidationError

    params = row.get("responses_create_params")
    if not isinstance(params, Mapping):
        return None
    given = {"temperature": params.get("temperature"), "top_p": params.get("top_p"),
             "max_tokens": params.get("max_output_tokens")}
    if all(v is None for v in given.values()):
        return None
    try:
        return Sampling.model_validate(given)
    except ValidationError as exc:
        from polar_env.registry import validation_line

        raise ValueError(f"responses_create_params: {validation_line(exc, model=Sampling)}") from None


def gym_ids(row: Mapping[str, Any]) -> dict[str, Any]:
    """Where a session came from, recorded in its TaskRequest metadata (Gym's rollout id first)."""
    return {"ng_rollout_id": row.get("_ng_rollout_id") or row.get("capture_rollout_id"),
            "ng_task_index": row.get("_ng_task_index"), "ng_rollout_index": row.get("_ng_rollout_index")}


class SessionOutcome(Protocol):
    """What build_result reads of a finished session: a ``SessionResult``, or the stand-in
    ``PolarGymAgent.run`` makes when the rollout service failed."""

    @property
    def session_id(self) -> str: ...
    @property
    def status(self) -> object: ...
    @property
    def trajectory(self) -> Trajectory | None: ...
    @property
    def reward(self) -> float: ...
    @property
    def evaluation(self) -> Mapping[str, object] | None: ...
    @property
    def failure_kind(self) -> FailureKind | None: ...
    @property
    def failure_detail(self) -> str | None: ...
    @property
    def mask(self) -> bool: ...


def build_result(row: Mapping[str, Any], result: SessionOutcome, *, model: str,
                 records: Sequence[CompletionRecord] = ()) -> dict[str, Any]:
    """The ``/run`` result for one finished Polar session (a ``SessionResult`` or its shape).
    ``records`` (the session's captured calls) give the items their text and tool calls. The
    delivered trace and the dropped share are in ``polar`` and as top-level numbers (Gym's
    aggregate metrics average those over the run)."""
    status = str(result.status)
    traj = result.trajectory
    delivery = choose_delivered(traj)
    chosen = delivery.index
    items = output_items(traj.traces[chosen], records) if traj is not None and chosen is not None else []
    evaluation = dict(result.evaluation or {})
    kind = str(result.failure_kind) if result.failure_kind else None
    failure: tuple[str, str] | None = None
    if kind is not None:
        failure = (f"{FAILURE_KIND_PREFIX}:{kind}", result.failure_detail or kind)
    elif not items:
        failure = (f"{FAILURE_KIND_PREFIX}:no_tokens", "the session sampled no tokens in a chain the harness continued")
    out = {k: v for k, v in row.items() if k not in ("_ng_rollout_id", "capture_rollout_id")}
    out.update({
        "response": response_object(items, model=model, created_at=time.time(), incomplete=status != "completed"),
        "reward": float(result.reward),
        "mask_sample": bool(result.mask) or not items,
        "polar": {
            "session_id": result.session_id,
            "status": status,
            "failure_kind": kind,
            "evaluation": evaluation,
            "delivered_trace": chosen,
            "traces": len(traj.traces) if traj is not None else 0,
            "trainable_tokens": [sum(t.loss_mask) if t.trainable else 0 for t in traj.traces] if traj is not None else [],
            "dropped_traces": delivery.dropped_traces,
            "dropped_tokens": delivery.dropped_tokens,
        },
        **delivery.fields(),
    })
    if failure is not None:
        out["failure_kind"], out["failure_reason"] = failure
    return out


class PolarGymAgent:
    """Runs ``/run`` rows through one ``PolarEnv`` (anything with its ``rollout`` coroutine and
    async context), started on first use. ``open_journal`` opens a node's capture folder (Gym's
    ``app.py``, the root, names the store)."""

    def __init__(self, env: Any, *, open_journal: JournalOpener, model: str = "policy") -> None:
        self.env = env
        self.model = model
        self.open_journal = open_journal
        self._lazy = LazyEnv(env)
        self.delivery = DeliveryTally()  # the run's dropped share so far (``delivery.line()``)

    async def start(self) -> None:
        await self._lazy.start()

    async def close(self) -> None:
        await self._lazy.close()

    async def run(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The row's result. Its sampling contradicting the environment's raises ConfigError (Gym
        answers 500 with the line): every row of the run would, and a masked sample hides it."""
        sampling = sampling_of(row)
        check = getattr(getattr(self.env, "config", None), "check_sampling", None)  # PolarEnvConfig's
        if sampling is not None and callable(check):
            check(sampling, str(gym_ids(row)["ng_rollout_id"] or "gym row"))
        await self.start()
        try:
            overrides: dict[str, Any] = {"metadata": gym_ids(row)}
            if sampling is not None:
                overrides["sampling"] = sampling
            group = await self.env.rollout(task_request(row), n=1, **overrides)
            result = group.results[0]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Gym gets a masked sample, not a 500
            result = SimpleNamespace(session_id="", status="error", trajectory=None, reward=0.0, evaluation={},
                                     failure_kind=FailureKind.NODE_LOST, mask=True,
                                     failure_detail=f"the rollout service failed: {type(exc).__name__}: {exc}")
        records = await asyncio.to_thread(self._records, result.session_id, getattr(result, "node_id", ""))
        out = build_result(row, result, model=self.model, records=records)
        self.delivery.add(choose_delivered(result.trajectory))
        return out

    def _records(self, session_id: str, node_id: str) -> list[CompletionRecord]:
        """The session's captured calls, when its node's journal is on this machine (a local or
        shared store); otherwise the items carry tokens without text."""
        store = getattr(getattr(self.env, "config", None), "store", None)
        folder = Path(store) / node_id if store is not None and node_id else None
        if not session_id or folder is None or not folder.is_dir():
            return []
        from polar_env.errors import PolarError

        try:
            return self.open_journal(folder).read(session_id)
        except (PolarError, OSError, ValueError):
            return []


def polar_env_config(polar: Mapping[str, Any]) -> dict[str, Any]:
    """The agent config's ``polar`` block as a PolarEnv config. Gym's ``policy_base_url`` ends in
    ``/v1`` (an OpenAI base URL); Polar's vLLM client takes the server root. NeMo RL passes a list
    (one URL per data-parallel vLLM server): it stays a list, which makes the engine a
    session-sticky pool over all of them."""
    config = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in polar.items()}
    engine = config.get("engine")
    if isinstance(engine, dict):
        url = engine.get("url")
        if isinstance(url, str):
            engine["url"] = url.rstrip("/").removesuffix("/v1")
        elif isinstance(url, (list, tuple)):
            engine["url"] = [str(u).rstrip("/").removesuffix("/v1") for u in url]
    return config


def check_polar_block(polar: Mapping[str, Any]) -> Mapping[str, Any]:
    """The agent config's ``polar`` block, checked as a PolarEnv config (every name and evaluator
    param) when Gym loads the agent's config, not at the first ``/run``; ValueError with the one
    line (``polar.builder: unknown builder ...``) otherwise."""
    from pydantic import ValidationError

    from polar_env.env import PolarEnvConfig
    from polar_env.registry import validation_line

    try:
        PolarEnvConfig.model_validate(polar_env_config(polar))
    except ValidationError as exc:
        raise ValueError(validation_line(exc, prefix="polar", model=PolarEnvConfig)) from None
    return polar

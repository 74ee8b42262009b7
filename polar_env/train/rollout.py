"""Where the trainer's data comes from: ``RolloutSource`` (``rollout(task, n)`` and
``update_weights``), with two implementations.

``PolarEnvSource`` is the staged pipeline (``PolarEnv``: a gateway node, a bubblewrap sandbox per
session, the built-in ``loop`` harness over OpenAI Chat). A task's ``files`` are written once into a
folder the sandbox copies into each session's workspace, where the loop's ``bash`` tool reads them.

``LocalGateway`` runs the pieces in this process: the embedded engine, the gateway on 127.0.0.1
with token-in continuation, the capture journal, a prefix-merge builder and the evaluator. Its
agent is a small chat loop over the Anthropic Messages API (thinking disabled, no tools) that
asks the instruction, then each follow-up, so every rollout is a multi-call session whose merged
trace holds the template's tokens between turns (mask 0). Its weight sync goes through the
gateway: pause (drain) → engine reload from a state dict → resume under the engine's new version.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, Self

import aiohttp
import torch
from pydantic import BaseModel, ConfigDict, Field

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.env import PolarEnv
from polar_env.evaluators import EvalContext, EvaluatorSpec, run_evaluator
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig, Sampling
from polar_env.proxy.gateway import Gateway
from polar_env.records import Status, Trajectory
from polar_env.train.seeding import SeededEngine
from polar_env.trajectory.builders import BUILDERS

ADMIN_TOKEN = "polar-train-admin"  # the gateway listens on 127.0.0.1 only; the token keeps the agent off the control plane


class ToyTask(BaseModel):
    """One prompt group's task: what the user asks, and how the answer is graded."""

    model_config = ConfigDict(extra="forbid")

    task_id: str
    instruction: str
    follow_ups: list[str] = Field(default_factory=list)  # user turns after each answer
    files: dict[str, str] = Field(default_factory=dict)  # the session workspace's contents (PolarEnvSource)
    evaluator: EvaluatorSpec


class RolloutSource(Protocol):
    """What the loop needs from a rollout backend (``LocalGateway`` now; ``PolarEnv`` fits too)."""

    async def rollout(self, task: ToyTask, n: int) -> list[Trajectory]: ...

    async def update_weights(self, state: dict[str, torch.Tensor]) -> str: ...


class PolarEnvSource:
    """Rollouts through ``PolarEnv`` (started by the caller); weights through its pause → load → resume."""

    def __init__(self, env: PolarEnv, workspaces: Path | None = None) -> None:
        self.env = env
        # one folder per task with files, copied into each session's workdir (default: a temporary folder)
        self.workspaces = workspaces or Path(tempfile.mkdtemp(prefix="polar-train-workspaces-"))
        self._written: dict[str, Path] = {}  # task id -> its folder, written at its first rollout
        self.version = 0

    async def rollout(self, task: ToyTask, n: int) -> list[Trajectory]:
        row: dict[str, Any] = {"task_id": task.task_id, "instruction": task.instruction,
                               "evaluator": task.evaluator.model_dump(mode="json")}
        if task.files:
            row["runtime"] = self.env.config.runtime.model_copy(update={"source_dir": self._workspace(task)})
        if isinstance(engine := self.env.engine, SeededEngine):  # its sessions' seeds follow the group id
            row["group_id"] = engine.seeds.group_id(task.task_id)
        group = await self.env.rollout(row, n)
        return group.trajectories

    def _workspace(self, task: ToyTask) -> Path:
        if (root := self._written.get(task.task_id)) is not None:
            return root
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", task.task_id)[:80]
        root = self.workspaces / f"{safe}-{hashlib.sha256(task.task_id.encode()).hexdigest()[:8]}"
        for name, text in task.files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        self._written[task.task_id] = root
        return root

    async def update_weights(self, state: dict[str, torch.Tensor]) -> str:
        self.version += 1
        return await self.env.update_weights(state, version=str(self.version))


class LocalGateway:
    """Embedded engine + gateway + chat loop in this process. Use as ``async with``."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        *,
        temperature: float = 1.0,
        max_tokens: int = 8,
        builder: str = "prefix_merge_strict",
        store_dir: Path | None = None,
    ) -> None:
        self.engine = engine
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.builder = BUILDERS[builder]
        self.store = JournalStore(store_dir or Path(tempfile.mkdtemp(prefix="polar-train-")))
        self.gateway: Gateway | None = None
        self._http: aiohttp.ClientSession | None = None
        self.url = ""

    async def __aenter__(self) -> Self:
        config = GatewayConfig(
            engine_model=self.engine.model_name,
            template=self.engine.chat.name,  # the engine's family: its rules and continuation text
            # the trainer owns sampling: harness values are overridden
            sampling=Sampling(temperature=self.temperature, top_p=1.0, max_tokens=self.max_tokens),
            admin_token=ADMIN_TOKEN,
            continuation=True,  # token-in: merged chains are exactly what the model saw
        )
        # EmbeddedEngine.aclose is a no-op: the trainer keeps using the engine afterwards
        self.gateway = await Gateway(self.engine, self.store, config).start("127.0.0.1", 0)
        self.url = self.gateway.url or ""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()
        if self.gateway is not None:
            await self.gateway.aclose()

    # -- rollouts ---------------------------------------------------------------------------
    async def rollout(self, task: ToyTask, n: int) -> list[Trajectory]:
        engine = self.engine  # a SeededEngine's sessions' seeds follow the group id
        group_id = (engine.seeds.group_id(task.task_id) if isinstance(engine, SeededEngine)
                    else f"{task.task_id}-{uuid.uuid4().hex[:8]}")
        return list(await asyncio.gather(*(self._session(task, group_id, i) for i in range(n))))

    async def _session(self, task: ToyTask, group_id: str, index: int) -> Trajectory:
        http = self._client()
        session_id = f"{group_id}-{index}"
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # opening and closing sessions is the trainer's
        async with http.post(f"{self.url}/sessions", json={"session_id": session_id}, headers=admin) as resp:
            resp.raise_for_status()
            key = (await resp.json())["key"]
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.instruction}]
        answer: str | None = None
        error: str | None = None
        for follow_up in [*task.follow_ups, None]:
            body = {"model": "any", "max_tokens": self.max_tokens, "thinking": {"type": "disabled"}, "messages": messages}
            async with http.post(f"{self.url}/v1/messages", json=body, headers=headers) as resp:
                reply = await resp.json()
            if resp.status != 200:
                error = f"gateway answered {resp.status}: {reply}"
                break
            blocks = reply["content"]
            answer = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
            messages.append({"role": "assistant", "content": blocks})
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
        async with http.delete(f"{self.url}/sessions/{session_id}", headers=admin):
            pass

        records = self.store.read(session_id)
        trajectory = self.builder(records)
        if error is None:
            result = await run_evaluator(task.evaluator.name, EvalContext(task=task.model_dump(), params=task.evaluator.params,
                                                                          final_answer=answer), timeout_s=task.evaluator.timeout_s)
            reward, evaluation = result.reward, {"status": result.status, **result.report}
        else:
            reward, evaluation = 0.0, {"status": Status.ERROR, "reason": error}
        metadata = {
            **trajectory.metadata,
            "session_id": session_id,
            "task_id": task.task_id,
            "group_id": group_id,
            "sample_index": index,
            "harness": "toy_chat_loop",
            "weight_versions": sorted({r.weight_version for r in records if r.weight_version is not None}),
            "evaluation": evaluation,
            "final_answer": answer,
        }
        traces = [t.model_copy(update={"reward": reward if t.trainable else None}) for t in trajectory.traces]
        status = trajectory.status if error is None else Status.ERROR
        return trajectory.model_copy(update={"traces": traces, "reward": reward, "metadata": metadata, "status": status})

    # -- weight sync ------------------------------------------------------------------------
    async def update_weights(self, state: dict[str, torch.Tensor]) -> str:
        """Gateway pause (waits for in-flight calls) → engine reload → resume under the new version."""
        http = self._client()
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with http.post(f"{self.url}/admin/pause", headers=auth) as resp:
            if resp.status != 200:
                raise RuntimeError(f"gateway did not drain for the weight sync: {await resp.text()}")
        version: str | None = None
        try:
            version = str(await asyncio.to_thread(self.engine.reload_weights, state))
        finally:  # resume even when the reload failed (under the old version), so rollouts never hang
            async with http.post(f"{self.url}/admin/resume", headers=auth, json={"weight_version": version}) as resp:
                resp.raise_for_status()
        return version

    async def weight_version(self) -> str:
        async with self._client().get(f"{self.url}/admin/status", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
            resp.raise_for_status()
            return str((await resp.json())["weight_version"])

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("LocalGateway is not started; use `async with LocalGateway(...)`")
        return self._http


def flatten(groups: Sequence[Sequence[Trajectory]]) -> list[Trajectory]:
    return [t for group in groups for t in group]

"""The rollout server: a TaskRequest becomes ``num_samples`` sessions on gateway nodes, and one
TaskStatus comes back (a callback, a pollable status, or an awaited return value).

Dispatch goes to the least-loaded live node (sessions assigned and not yet finished). Early stop
(``early_stop_min_usable``) finishes a group as soon as that many sessions completed, cancelling the
stragglers (they still report, as CANCELLED, with what they captured). A node that dies has its
sessions reported as ERROR ``node_lost`` results (salvaged from its store) and takes no more work; the server keeps serving on the others.
Callbacks are retried with exponential backoff; the status endpoint serves the same payload.
Nodes are ``LocalNode`` (a GatewayNode in this process) or ``RayNode`` (a node actor).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import ValidationError

from polar_env.errors import ConfigError
from polar_env.observe.metrics import RolloutMetrics, install_server_metrics
from polar_env.records import FailureKind
from polar_env.registry import validation_line
from polar_env.staging.models import (
    SessionResult,
    SessionSpec,
    SessionStatus,
    TaskRequest,
    TaskState,
    TaskStatus,
)
from polar_env.staging.node import GatewayNode
from polar_env.staging.runs import session_ids
from polar_env.staging.shipping import Chunk, Puller, ShardMirror
from polar_env.staging.submission import with_defaults

_log = logging.getLogger(__name__)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class NodeHandle(Protocol):
    node_id: str

    async def run(self, spec: SessionSpec) -> SessionResult: ...

    async def cancel(self, session_id: str) -> bool: ...

    async def stats(self) -> dict[str, Any]: ...

    async def update_weights(self, source: Any, version: str | None) -> str: ...

    async def stop(self) -> None: ...


class LocalNode:
    def __init__(self, node: GatewayNode) -> None:
        self.node = node
        self.node_id = node.node_id

    async def run(self, spec: SessionSpec) -> SessionResult:
        return await self.node.run(spec)

    async def cancel(self, session_id: str) -> bool:
        return self.node.cancel(session_id)

    async def stats(self) -> dict[str, Any]:
        return self.node.stats()

    async def update_weights(self, source: Any, version: str | None) -> str:
        return await self.node.update_weights(source, version)

    async def stop(self) -> None:
        await self.node.stop()


class NodeDied(Exception):
    pass


class RayNode:
    """A node actor. Ray's actor errors (the process died) become ``NodeDied``. ``store``: the
    head's copy of the node's shard, for salvaging a dead node's sessions; ``pull``: the node
    journals to a disk the head does not share, so the head keeps that copy (staging/shipping.py)."""

    def __init__(self, node_id: str, actor: Any, store: Path | None = None, *, pull: bool = False,
                 interval_s: float = 0.5) -> None:
        self.node_id = node_id
        self.actor = actor
        self.store = store
        self.puller: Puller | None = None
        if pull:
            if store is None:
                raise ConfigError(f"node {node_id}: pulling its journals needs the head's store")
            self.puller = Puller(ShardMirror(store), self._shard_since, interval_s)
            self.puller.start()

    async def _call(self, method: str, *args: Any) -> Any:
        import ray.exceptions

        try:
            return await getattr(self.actor, method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as exc:
            raise NodeDied(f"node {self.node_id} died: {str(exc).splitlines()[0]}") from exc

    async def _shard_since(self, cursors: dict[str, int]) -> tuple[list[Chunk], bool]:
        chunks, more = await self._call("shard_since", cursors)
        return list(chunks), bool(more)

    async def run(self, spec: SessionSpec) -> SessionResult:
        result = SessionResult.model_validate_json(await self._call("run", spec.model_dump_json()))
        if self.puller is not None:  # its journal and outcome are on the head before it is reported
            try:
                await self.puller.sync()
            except NodeDied as exc:  # finished, then lost: its result stands, its journal is what was pulled
                _log.warning("session %s finished but its journal was not all pulled: %s", spec.session_id, exc)
        return result

    async def halt(self, *, last_pull: bool = False) -> None:
        """Stop pulling (the node died: what the head holds now is what salvage reads; or another
        process takes over, after ``last_pull``)."""
        if self.puller is not None:
            await self.puller.aclose()
            if last_pull:
                try:
                    await self.puller.sync()
                except NodeDied:
                    pass

    async def cancel(self, session_id: str) -> bool:
        return bool(await self._call("cancel", session_id))

    async def stats(self) -> dict[str, Any]:
        stats = dict(await self._call("stats"))
        if self.puller is not None:
            stats["shipped_bytes"] = self.puller.mirror.bytes
        return stats

    async def update_weights(self, source: Any, version: str | None) -> str:
        return str(await self._call("update_weights", str(source), version))

    async def stop(self) -> None:
        try:
            if self.puller is not None:
                await self.puller.sync()  # the spool goes with the node
            await self._call("stop")
        except NodeDied:
            pass
        finally:
            if self.puller is not None:
                await self.puller.aclose()


def new_group_id(task_id: str) -> str:
    return f"{_UNSAFE.sub('_', task_id).lstrip('_.-')[:100] or 'task'}-{secrets.token_hex(3)}"


class _Task:
    def __init__(self, req: TaskRequest, group_id: str, samples: list[int] | None = None) -> None:
        self.req = req
        self.samples = list(range(req.num_samples)) if samples is None else samples
        self.status = TaskStatus(task_id=req.task_id, group_id=group_id, state=TaskState.PENDING,
                                 num_samples=req.num_samples)
        self.assigned: dict[str, NodeHandle] = {}
        self.done = asyncio.Event()
        self.runner: asyncio.Task[TaskStatus] | None = None
        self.callback_attempts = 0
        self.callback_error: str | None = None


class RolloutServer:
    def __init__(self, nodes: Iterable[NodeHandle], *, callback_retries: int = 4, callback_backoff_s: float = 0.5,
                 keep_tasks: int = 10_000) -> None:
        self.nodes: list[NodeHandle] = list(nodes)
        if not self.nodes:
            raise ConfigError("a rollout server needs at least one gateway node")
        self.dead: dict[str, str] = {}
        self.hosts: dict[str, str] = {}  # node id -> the host its last stats came from (named when it dies)
        self.load: dict[str, int] = {n.node_id: 0 for n in self.nodes}
        self.tasks: dict[str, _Task] = {}
        self.callback_retries = callback_retries
        self.callback_backoff_s = callback_backoff_s
        self.keep_tasks = keep_tasks
        self._http: aiohttp.ClientSession | None = None
        self.metrics = RolloutMetrics()

    # -- tasks --------------------------------------------------------------------------------
    def submit(self, req: TaskRequest, *, samples: Iterable[int] | None = None) -> TaskStatus:
        """Start rolling out ``req`` in the background; returns its (pending) status at once.
        ``samples``: only these sample indices of the group (a resumed run's unfinished ones)."""
        group_id = req.group_id or new_group_id(req.task_id)
        if group_id in self.tasks and not self.tasks[group_id].done.is_set():
            raise ConfigError(f"group {group_id!r} is already running")
        task = _Task(req, group_id, None if samples is None else sorted(set(samples)))
        self.tasks[group_id] = task
        task.runner = asyncio.create_task(self._run(task))
        self._forget_old()
        return task.status

    async def run(self, req: TaskRequest) -> TaskStatus:
        """Roll out ``req`` and return its finished status."""
        status = self.submit(req)
        task = self.tasks[status.group_id]
        assert task.runner is not None
        return await task.runner

    async def run_many(self, reqs: Iterable[TaskRequest]) -> list[TaskStatus]:
        return list(await asyncio.gather(*(self.run(r) for r in reqs)))

    def get(self, ref: str) -> TaskStatus | None:
        """A task's status by group id, or the latest one submitted under that task id."""
        if ref in self.tasks:
            return self.tasks[ref].status
        matches = [t.status for t in self.tasks.values() if t.req.task_id == ref]
        return matches[-1] if matches else None

    async def cancel(self, ref: str) -> TaskStatus | None:
        status = self.get(ref)
        if status is None:
            return None
        task = self.tasks[status.group_id]
        if not task.done.is_set():
            status.state = TaskState.CANCELLED
            await self._cancel_stragglers(task)
        return status

    async def _run(self, task: _Task) -> TaskStatus:
        req, status = task.req, task.status
        status.state = TaskState.RUNNING
        ids = session_ids(status.group_id, req.num_samples)
        specs = [SessionSpec(session_id=ids[i], sample_index=i, group_id=status.group_id, request=req)
                 for i in task.samples if 0 <= i < req.num_samples]
        pending = [asyncio.create_task(self._dispatch(task, spec)) for spec in specs]
        usable = 0
        for next_done in asyncio.as_completed(pending):
            result = await next_done
            status.results.append(result)
            self.metrics.observe_result(result)
            usable += result.usable
            if (req.early_stop_min_usable is not None and usable >= req.early_stop_min_usable
                    and not status.early_stopped and len(status.results) < len(specs)):
                status.early_stopped = True
                await self._cancel_stragglers(task)
        status.results.sort(key=lambda r: r.sample_index)
        if status.state is not TaskState.CANCELLED:
            status.state = TaskState.DONE
        status.finished_at = time.time()
        task.done.set()
        if req.callback_url:
            await self._callback(task)
        return status

    async def _dispatch(self, task: _Task, spec: SessionSpec) -> SessionResult:
        node = self._least_loaded()
        if node is None:
            return self._error_result(spec, "", "no live gateway node: " + "; ".join(self.dead.values()))
        task.assigned[spec.session_id] = node
        self.load[node.node_id] += 1
        try:
            return await node.run(spec)
        except NodeDied as exc:
            self.dead[node.node_id] = str(exc)
            _log.error("%s; its sessions are reported as errors", exc)
            result = self._error_result(spec, node.node_id, str(exc))
            halt = getattr(node, "halt", None)
            if halt is not None:
                await halt()
            store = getattr(node, "store", None)
            if store is None:
                return result
            from polar_env.journal.store import JournalStore  # the server is a root: it names the store
            from polar_env.staging.salvage import salvage

            return await asyncio.to_thread(salvage, Path(store), spec, result, JournalStore)
        except Exception as exc:  # noqa: BLE001 - a node bug must not lose the group
            return self._error_result(spec, node.node_id, f"node {node.node_id} failed: {type(exc).__name__}: {exc}")
        finally:
            self.load[node.node_id] -= 1
            task.assigned.pop(spec.session_id, None)

    @staticmethod
    def _error_result(spec: SessionSpec, node_id: str, detail: str) -> SessionResult:
        """The result of a session its node could not run (it died, failed, or none was left): an
        ERROR ``node_lost`` with an empty trajectory, so the group keeps its size."""
        return SessionResult.model_validate({  # no trajectory given: the empty, masked row (models.py)
            "session_id": spec.session_id, "task_id": spec.request.task_id, "group_id": spec.group_id,
            "sample_index": spec.sample_index, "node_id": node_id, "status": SessionStatus.ERROR,
            "failure_kind": FailureKind.NODE_LOST, "failure_detail": detail, "mask": True,
            "stage_times": {"done": time.time()}})

    def _least_loaded(self) -> NodeHandle | None:
        live = [n for n in self.nodes if n.node_id not in self.dead]
        return min(live, key=lambda n: self.load[n.node_id]) if live else None

    async def _cancel_stragglers(self, task: _Task) -> None:
        for sid, node in list(task.assigned.items()):
            try:
                await node.cancel(sid)
            except NodeDied:
                pass

    def _forget_old(self) -> None:
        while len(self.tasks) > self.keep_tasks:
            oldest = next((k for k, t in self.tasks.items() if t.done.is_set()), None)
            if oldest is None:
                return
            del self.tasks[oldest]

    # -- callbacks ----------------------------------------------------------------------------
    async def _callback(self, task: _Task) -> None:
        assert task.req.callback_url is not None
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        body = task.status.model_dump_json().encode()
        delay = self.callback_backoff_s
        for attempt in range(1, self.callback_retries + 1):
            task.callback_attempts = attempt
            try:
                async with self._http.post(task.req.callback_url, data=body,
                                           headers={"Content-Type": "application/json"}) as resp:
                    if resp.status < 300:
                        task.callback_error = None
                        return
                    task.callback_error = f"callback answered {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                task.callback_error = f"callback failed: {type(exc).__name__}: {exc}"
            if attempt < self.callback_retries:
                await asyncio.sleep(delay)
                delay *= 2
        _log.warning("group %s: giving up on callback %s after %d attempts (%s); poll its status instead",
                     task.status.group_id, task.req.callback_url, self.callback_retries, task.callback_error)

    # -- the rest -----------------------------------------------------------------------------
    async def node_stats(self) -> list[dict[str, Any]]:
        """Each node's stats; a dead node's entry names the host it last reported from."""
        out = []
        for node in self.nodes:
            if node.node_id not in self.dead:
                try:
                    stats = await node.stats()
                except NodeDied as exc:
                    self.dead[node.node_id] = str(exc)
                else:
                    if stats.get("host"):
                        self.hosts[node.node_id] = str(stats["host"])
                    out.append(stats)
                    continue
            host = self.hosts.get(node.node_id)
            out.append({"node_id": node.node_id, "dead": self.dead[node.node_id], **({"host": host} if host else {})})
        return out

    async def update_weights(self, source: Any, version: str | None = None) -> list[str]:
        live = [n for n in self.nodes if n.node_id not in self.dead]
        return list(await asyncio.gather(*(n.update_weights(source, version) for n in live)))

    async def aclose(self) -> None:
        """Stop the nodes: each cancels what still runs (those sessions end ``interrupted``, not
        ``cancelled``: nobody asked for them to go, and a resumed job runs them again)."""
        await asyncio.gather(*(n.stop() for n in self.nodes), return_exceptions=True)
        if self._http is not None:
            await self._http.close()


# -- HTTP -------------------------------------------------------------------------------------

SERVER = web.AppKey("rollout_server", RolloutServer)
TOKEN = web.AppKey("rollout_token", str)
DEFAULTS = web.AppKey("rollout_defaults", dict)  # polar-env serve's settings for rows that lack them


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route but /health needs the server's bearer token: the agents being trained run
    code, and the control plane must not be theirs to use."""
    if request.path != "/health":
        import hmac

        sent = request.headers.get("Authorization", "")
        # surrogateescape: aiohttp hands undecodable header bytes over as surrogates (a non-ASCII
        # header must be a 401, not a crash)
        if not hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), f"Bearer {request.app[TOKEN]}".encode()):
            return _error(401, "missing or wrong bearer token (see the server's token file)")
    return await handler(request)


async def _submit(request: web.Request) -> web.Response:
    try:  # every name and param model is resolved here: a typo is a 400 before any session starts
        body = with_defaults(orjson.loads(await request.read()), request.app.get(DEFAULTS))
        req = TaskRequest.model_validate(body)
        status = request.app[SERVER].submit(req)
    except ValidationError as exc:
        return _error(400, f"invalid TaskRequest: {validation_line(exc, model=TaskRequest)}")
    except ValueError as exc:  # orjson.JSONDecodeError
        return _error(400, f"invalid TaskRequest: {exc}")
    except ConfigError as exc:
        return _error(409, str(exc))
    accepted: dict[str, Any] = {"task_id": status.task_id, "group_id": status.group_id, "state": status.state.value}
    if req.evaluator is None:  # not an error (rollouts for SFT/inspection), but reward 0 for every session
        accepted["warning"] = "no evaluator (in the row, submit --evaluator or serve --evaluator): every session gets reward 0"
    return _json(accepted, 202)


async def _task(request: web.Request) -> web.Response:
    status = request.app[SERVER].get(request.match_info["ref"])
    if status is None:
        return _error(404, f"unknown task {request.match_info['ref']!r}")
    if request.query.get("results") == "0":
        return _json(status.summary())
    return web.Response(body=status.model_dump_json(), content_type="application/json")


async def _cancel(request: web.Request) -> web.Response:
    status = await request.app[SERVER].cancel(request.match_info["ref"])
    if status is None:
        return _error(404, f"unknown task {request.match_info['ref']!r}")
    return _json(status.summary())


async def _status(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    tasks = [t.status.summary() for t in server.tasks.values()]
    return _json({"nodes": await server.node_stats(), "tasks": tasks})


async def _health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


def build_server_app(server: RolloutServer, token: str, defaults: dict[str, Any] | None = None) -> web.Application:
    """The task API; ``defaults`` (``submission.server_defaults``) fill what a submitted row lacks."""
    app = web.Application(middlewares=[_auth], client_max_size=64 * 1024 * 1024)
    app[SERVER] = server
    app[TOKEN] = token
    app[DEFAULTS] = defaults or {}
    app.router.add_post("/rollout/task/submit", _submit)
    app.router.add_get("/rollout/task/{ref}", _task)
    app.router.add_delete("/rollout/task/{ref}", _cancel)
    app.router.add_get("/rollout/status", _status)
    app.router.add_get("/health", _health)
    install_server_metrics(app, server.metrics, server.node_stats,
                           lambda: [t.status.state.value for t in server.tasks.values()])
    return app

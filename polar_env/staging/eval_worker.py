"""Evaluations off the gateway's process: a node's evaluation worker processes.

An evaluation that grades in a fresh runtime (SWE-bench, Harbor, ``output`` commands, custom ones
that say ``wants_fresh_runtime``) spends its CPU on preparing that runtime, restricting and applying
the patch, draining the test run's output and parsing the log (swebench's grading code). In the
node process all of that holds the GIL of the loop that serves every running session, so it runs
in a worker process instead, with its own event loop: the node sends a picklable ``EvalJob`` (task
row, evaluator name or import path, params, the fresh runtime's spec) when RUNNING starts — the
worker pre-warms the fresh runtime then, as the node did — and the agent's outcome (final answer,
exit code, its change set, taken in the node while the agent runtime still exists) at POSTRUN; the
``EvalResult`` comes back. A session keeps its worker from pre-warm to verdict.

Evaluators the worker cannot resolve (registered at runtime only in the node, e.g. in
``__main__``), ones that grade on the agent's own runtime (its live workspace exists only in the
node), and cheap ones with no runtime (``session_completion``, answer regexes) stay in the node
(``offloadable``). An offloaded evaluator that asks for the agent runtime anyway is re-run in the
node (``NEEDS_AGENT_RUNTIME``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from polar_env.evaluators import (
    EVALUATORS,
    EvalContext,
    EvalResult,
    get_evaluator,
    prewarm,
    run_evaluator,
    wants_fresh_runtime,
)
from polar_env.evaluators.base import NoAgentRuntime, error_report
from polar_env.evaluators.workspace import Changes
from polar_env.records import Status
from polar_env.runtimes import RuntimeSpec, make_runtime
from polar_env.staging.deadline import Deadline, current
from polar_env.staging.deathsig import forkserver_context, launch_forkserver, lower_priority, run_with_deathsig

_log = logging.getLogger(__name__)
NEEDS_AGENT_RUNTIME = f"{NoAgentRuntime.__module__}.{NoAgentRuntime.__qualname__}"


@dataclass(slots=True)
class EvalJob:
    """Everything a worker needs to grade one session (picklable)."""

    evaluator: str  # a table name or an import path
    module: str | None  # imported first in the worker (where a registered evaluator is defined)
    task: Any
    params: dict[str, Any]
    fresh: RuntimeSpec
    timeout_s: float
    final_answer: str | None = None
    exit_code: int | None = None
    timed_out: bool = False
    changes: Changes | None = None  # the agent's change set, taken by the grader in the node


def offloadable(name: str, ctx: EvalContext) -> str | None | bool:
    """The module a worker must import to find evaluator ``name`` (None: a built-in or an import
    path), or False when the evaluation stays in the node (see the module docstring)."""
    if not wants_fresh_runtime(name, ctx):  # nor does a bad spec: the in-node path reports it
        return False
    ev = get_evaluator(name)
    if name not in EVALUATORS:
        return None  # an import path: the worker imports it the same way
    if type(ev).__module__.startswith("polar_env.evaluators."):
        return None
    module = getattr(getattr(ev, "fn", None), "__module__", None) or type(ev).__module__
    return False if module in (None, "__main__") else module


# -- the worker process ---------------------------------------------------------------------------

def _context(job: EvalJob) -> EvalContext:
    spec = job.fresh
    return EvalContext(task=job.task, params=dict(job.params), runtime=None, final_answer=job.final_answer,
                       exit_code=job.exit_code, timed_out=job.timed_out, changes=job.changes,
                       runtime_factory=lambda: make_runtime(spec))


class _Serve:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.contexts: dict[str, tuple[EvalContext, asyncio.Future[Any]]] = {}
        self.running: dict[str, asyncio.Task[Any]] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.send_lock = threading.Lock()
        self.done = asyncio.Event()

    def _send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def receive(self) -> None:  # a thread: blocking reads, handed to the loop
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the node is gone: stop everything
                message = ("stop",)
            self.loop.call_soon_threadsafe(self.handle, message)
            if message[0] == "stop":
                return

    def handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "stop":
            self.done.set()
            return
        task = self.loop.create_task(getattr(self, kind)(*message[1:]))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def prewarm(self, key: str, job: EvalJob) -> None:
        ctx = _context(job)
        self.contexts[key] = (ctx, asyncio.ensure_future(_prewarm(job, ctx)))

    async def evaluate(self, key: str, job: EvalJob) -> None:
        ctx, warm = self.contexts.pop(key, (None, None))
        current = asyncio.current_task()
        assert current is not None
        self.running[key] = current
        try:
            if ctx is None:
                ctx = _context(job)
            else:
                ctx.final_answer, ctx.exit_code, ctx.timed_out, ctx.changes = job.final_answer, job.exit_code, job.timed_out, job.changes
            if warm is not None:
                await asyncio.gather(warm, return_exceptions=True)
            if job.module is not None:
                _import(job.module)
            if job.evaluator not in EVALUATORS and ":" not in job.evaluator and "." not in job.evaluator:
                await ctx.aclose()
                result: EvalResult | None = None  # not registered here: the node runs it
            else:
                result = await run_evaluator(job.evaluator, ctx, timeout_s=job.timeout_s)
        except Exception as exc:  # noqa: BLE001 - always answer
            result = EvalResult(status=Status.ERROR, report=error_report(exc))
        finally:
            self.running.pop(key, None)
        await asyncio.to_thread(self._send, ("result", key, result))

    async def cancel(self, key: str) -> None:
        running = self.running.pop(key, None)
        if running is not None:  # run_evaluator stops its fresh runtime on cancellation
            running.cancel()
        ctx, warm = self.contexts.pop(key, (None, None))
        if warm is not None:
            warm.cancel()
            await asyncio.gather(warm, return_exceptions=True)
        if ctx is not None:
            with contextlib.suppress(Exception):
                await ctx.aclose()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for key in list(self.contexts):
            await self.cancel(key)


def _import(module: str) -> None:
    import importlib

    importlib.import_module(module)


async def _prewarm(job: EvalJob, ctx: EvalContext) -> None:
    if job.module is not None:
        _import(job.module)
    if job.evaluator in EVALUATORS or ":" in job.evaluator or "." in job.evaluator:
        await prewarm(job.evaluator, ctx)


async def _serve(conn: Connection) -> None:
    serve = _Serve(conn)
    threading.Thread(target=serve.receive, daemon=True, name="polar-eval-recv").start()
    await serve.done.wait()
    await serve.close()


def worker_main(conn: Connection) -> None:
    """The worker process's entry point."""
    lower_priority()  # grading is throughput work: the gateway's replies win the cores
    asyncio.run(_serve(conn))


# -- the node's side ------------------------------------------------------------------------------

class _Worker:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        context = forkserver_context()  # the forkserver and the worker die with the node (deathsig.py)
        self.conn, child = context.Pipe()
        self.process = context.Process(target=run_with_deathsig, args=(worker_main, child), daemon=True,
                                       name="polar-eval-worker")
        self.process.start()
        child.close()
        self.lock = threading.Lock()
        self.pending: dict[str, asyncio.Future[EvalResult | None]] = {}
        self.sessions = 0
        self.dead = False  # its pipe closed: the process is gone or going
        self.loop = loop
        threading.Thread(target=self._receive, daemon=True, name="polar-eval-results").start()

    @property
    def alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)

    def _receive(self) -> None:
        while True:
            try:
                _kind, key, result = self.conn.recv()
            except (EOFError, OSError):
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    self.loop.call_soon_threadsafe(self._lost)
                return
            self.loop.call_soon_threadsafe(self._deliver, key, result)

    def _deliver(self, key: str, result: EvalResult | None) -> None:
        future = self.pending.pop(key, None)
        if future is not None and not future.done():
            future.set_result(result)

    def _lost(self) -> None:
        self.dead = True
        for key in list(self.pending):
            self._deliver(key, EvalResult(status=Status.ERROR, report={
                "error": f"the evaluation worker process exited (code {self.process.exitcode})"}))


class EvalWorkers:
    """A node's evaluation worker processes (started on first use, stopped by ``close``)."""

    def __init__(self, workers: int) -> None:
        self.size = max(1, workers)
        self._workers: list[_Worker] = []
        self._of: dict[str, _Worker] = {}
        self._start_lock = asyncio.Lock()
        self._ids = itertools.count()

    async def _pick(self) -> _Worker:
        async with self._start_lock:
            self._workers = [w for w in self._workers if w.alive]  # a dead one is replaced
            if len(self._workers) < self.size:
                launch_forkserver()  # from the loop's thread (deathsig.py); the worker's start waits, off the loop
                self._workers.append(await asyncio.to_thread(_Worker, asyncio.get_running_loop()))
        alive = [w for w in self._workers if w.alive] or self._workers
        return min(alive, key=lambda w: w.sessions)

    async def _assign(self, key: str) -> _Worker:
        worker = self._of.get(key)
        if worker is not None and not worker.alive:  # its pre-warmed runtime died with it
            self._release(key)
            worker = None
        if worker is None:
            worker = self._of[key] = await self._pick()
            worker.sessions += 1
        return worker

    def _release(self, key: str) -> _Worker | None:
        worker = self._of.pop(key, None)
        if worker is not None:
            worker.sessions -= 1
        return worker

    async def prewarm(self, key: str, job: EvalJob) -> None:
        worker = await self._assign(key)
        await asyncio.to_thread(worker.send, ("prewarm", key, job))

    async def evaluate(self, key: str, job: EvalJob, timeout_s: float) -> EvalResult | None:
        """The verdict; None when the worker cannot resolve the evaluator (run it in the node).
        ``timeout_s`` bounds the wait (a hung worker): past it, the evaluation is cancelled and the
        verdict is an ERROR (``evaluator_error``: the grader failed, not the agent's change)."""
        worker = await self._assign(key)
        future: asyncio.Future[EvalResult | None] = asyncio.get_running_loop().create_future()
        worker.pending[key] = future
        try:
            try:
                await asyncio.to_thread(worker.send, ("evaluate", key, job))
            except (OSError, ValueError):  # the pipe broke: the worker is gone
                worker._lost()
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:  # the evaluator's own timeout answers inside the worker: this one is a stuck worker
            await asyncio.to_thread(self._send_quietly, worker, ("cancel", key))
            return EvalResult(status=Status.ERROR, report={"error": f"the evaluation worker gave no verdict in {timeout_s} s"})
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.to_thread(self._send_quietly, worker, ("cancel", key)))
            raise
        finally:
            worker.pending.pop(key, None)
            self._release(key)

    async def cancel(self, key: str) -> None:
        """Drop a session's pre-warmed runtime (it will not be evaluated)."""
        worker = self._release(key)
        if worker is not None:
            await asyncio.to_thread(self._send_quietly, worker, ("cancel", key))

    @staticmethod
    def _send_quietly(worker: _Worker, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(OSError, ValueError):
            worker.send(message)

    def close(self, deadline: Deadline | None = None) -> None:
        """Stop the workers (each stops the runtimes it still holds first) by the shutdown
        deadline (``deadline.py``: one for all of them, not a join each), then kill those still
        there; a dead or killed one's sandboxes go with it (bwrap ``--die-with-parent``)."""
        deadline = deadline or current()
        for worker in self._workers:
            self._send_quietly(worker, ("stop",))
        for worker in self._workers:
            worker.process.join(deadline.remaining())
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.process.join(1.0)
            worker.conn.close()
        self._workers.clear()
        self._of.clear()

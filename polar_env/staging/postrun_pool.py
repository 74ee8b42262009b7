"""POSTRUN's CPU work off the gateway's process: journal read + trajectory build in worker
processes, so a finishing session never holds the GIL of the loop that serves the running ones.

A 100-call session's read and prefix merge is ~1 s of Python; in a thread it still stalls every
live session's replies (the GIL), so it runs in a ``ProcessPoolExecutor`` (forkserver: the node
process has threads, which ``fork`` must not copy) with ``max_postrun`` workers. The worker reads
the journal itself (it gets the node's opener, ``functools.partial(store class, folder)``, which
pickles), so only the small result crosses back: the trajectory plus the few
facts POSTRUN needs (record count, final answer, weight versions); the journal's prompt
references go to the builder (``journal/reader.py``). A journal of a few calls
(``INLINE_JOURNAL_BYTES``) is built in the node: ~1 ms, as the journal writer writes small records
on the loop. Evaluations have their own worker processes (``eval_worker.py``): a session keeps one
from pre-warm to verdict, which a pool cannot promise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from polar_env.errors import ConfigError, PolarError
from polar_env.journal.protocols import JournalSource
from polar_env.records import Status, Trajectory
from polar_env.staging.deadline import Deadline, current
from polar_env.staging.deathsig import launch_forkserver, lower_priority, run_with_deathsig


@dataclass(frozen=True, slots=True)
class Built:
    """What POSTRUN needs from a session's journal. ``error`` says why there is no trajectory."""

    trajectory: Trajectory | None
    records: int
    final_answer: str | None = None
    weight_versions: list[str] = field(default_factory=list)
    error: str | None = None
    journal_ok: bool = True  # False: the journal itself could not be read


def read_and_build(open_journal: Callable[[], JournalSource], session_id: str, builder: str) -> Built:
    """Runs in a worker process (or inline): read the journal, build the trajectory."""
    from polar_env.trajectory.builders import BUILDERS, build

    store = open_journal()
    try:
        records, refs = store.read_with_refs(session_id)
    except PolarError as exc:  # a journal line that is not a record: nothing trustworthy to build
        return Built(None, 0, error=f"journal unreadable: {exc}", journal_ok=False)
    if not records:
        return Built(None, 0)
    final = records[-1].message.content
    versions = sorted({r.weight_version for r in records if r.weight_version is not None})
    try:
        BUILDERS.get(builder)
    except ConfigError as exc:
        return Built(None, len(records), final, versions, str(exc))
    try:
        trajectory = build(builder, records, refs)  # the journal's prompt refs spare re-comparing
    except Exception as exc:  # noqa: BLE001 - a builder bug must not lose the session's result
        line = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        return Built(None, len(records), final, versions, f"builder {builder} failed: {type(exc).__name__}: {line}")
    if trajectory.status is Status.ERROR:  # the builder refused the records (checks.py): nothing to train on
        why = trajectory.metadata.get("error") or "no reason given"
        return Built(None, len(records), final, versions, f"builder {builder} refused the journal: {why}")
    return Built(trajectory, len(records), final, versions)


def journal_bytes(store: JournalSource, session_id: str) -> int:
    """The session's journal size on disk (0: none yet, or a store that keeps no files: it is read
    in the node, as it cannot be reopened in a worker)."""
    try:
        return store.path(session_id).stat().st_size
    except FileNotFoundError:
        return 0


def _warm() -> None:
    """Each worker at start: lower its CPU priority (POSTRUN is throughput work; the gateway's
    replies are latency work and must win the cores) and import what builds need (preloaded in
    the forkserver: normally nothing left to do)."""
    lower_priority()
    import polar_env.journal.reader
    import polar_env.journal.store
    import polar_env.trajectory.builders  # noqa: F401


INLINE_JOURNAL_BYTES = 16 * 1024  # a journal this small (a few calls) reads and builds in ~1 ms


class PostrunPool:
    """A node's POSTRUN worker processes (started on first use, stopped by ``close``). A small
    journal builds in the node instead: ~1 ms of loop time, less than the hand-off, and never
    waiting for a worker (on a busy machine the niced workers, and the forkserver's first start,
    wait behind every other process: bench_staging.py)."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        """The pool. On first use its forkserver is launched from this thread, the loop's, which
        lives as long as the node (the death signal follows the launching thread: deathsig.py)."""
        if self._pool is None:
            context = launch_forkserver()  # the forkserver and each worker die with the node (deathsig.py)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=run_with_deathsig,
                                             initargs=(_warm,))
        return self._pool

    async def build(self, open_journal: Callable[[], JournalSource], session_id: str, builder: str) -> Built:
        """``open_journal`` opens the node's journal again; it must pickle (it crosses to a worker)."""
        if journal_bytes(open_journal(), session_id) <= INLINE_JOURNAL_BYTES:
            return read_and_build(open_journal, session_id, builder)
        # Submitted from a thread, never the loop: a submit that finds no idle worker starts one,
        # and that waits on the forkserver (until its preload is done, and for the fork) — on a
        # loaded machine, seconds in which no running session was answered (bench_staging.py).
        pool = self._executor()
        future = await asyncio.to_thread(pool.submit, read_and_build, open_journal, session_id, builder)
        return await asyncio.wrap_future(future)

    def close(self, deadline: Deadline | None = None) -> None:
        """Stop the workers by the shutdown deadline (``deadline.py``), killing those still there:
        a niced worker mid-build on a busy machine would otherwise hold the node for as long as
        its build takes (a join with no limit)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        deadline = deadline or current()
        processes = list((getattr(pool, "_processes", None) or {}).values())  # before shutdown forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(deadline.remaining())
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(1.0)

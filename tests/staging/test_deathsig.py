"""The node's worker processes (POSTRUN pool, evaluation workers) and their forkserver die with the
node, however it ends: a parent process holding both pools is killed and every descendant must go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_PARENT = """
import asyncio, os
from polar_env.staging.eval_worker import _Worker
from polar_env.staging.postrun_pool import PostrunPool

async def main():
    pool = PostrunPool(2)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(pool._executor(), os.getpid)  # the pool's workers are up
    worker = _Worker(loop)
    assert worker.alive
    print("ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # a zombie is dead already
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def descendants(pid: int) -> set[int]:
    kids, found, todo = _children(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(pid)
        except OSError:
            continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_and_forkserver_die_with_their_parent(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        workers = descendants(proc.pid)
        assert len(workers) >= 4, workers  # the forkserver, two POSTRUN workers, one evaluation worker
        proc.send_signal(sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = alive(workers)
        assert not left, {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in left}
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout is not None:
            proc.stdout.close()


# What a worker reports about itself: its niceness, and whether the node's modules were there
# before it imported anything (eval: a builtin, so nothing of the test's is imported to run it).
_FACTS = "(__import__('os').getpriority(0, 0), 'polar_env.staging.node' in __import__('sys').modules)"


async def test_workers_fork_from_a_preloaded_forkserver_and_run_niced() -> None:
    """A worker's start is a fork of a forkserver that has the node's modules loaded (each worker
    importing them itself, at the node's priority, was the bench_staging regression), and the
    worker then runs WORKER_NICE below the node."""
    import asyncio

    from polar_env.staging.deathsig import WORKER_NICE
    from polar_env.staging.postrun_pool import PostrunPool

    pool = PostrunPool(1)
    try:
        executor = pool._executor()  # launches the forkserver from this (the loop's) thread
        future = await asyncio.to_thread(executor.submit, eval, _FACTS)
        nice, preloaded = await asyncio.wrap_future(future)
    finally:
        await asyncio.to_thread(pool.close)
    assert preloaded
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
